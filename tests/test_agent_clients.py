"""The real agent CLIs against the real server on loopback: Claude Code (`claude -p`, /v1/messages)
and Codex (`codex exec`, /v1/responses), installed at pinned versions by scripts/test.sh with npm.

The model is the tiny default geometry recompiled with a 64k context (linear rope x8), because
the CLIs send 3k-35k-token prompts; the server runs `ninfer serve --no-thinking` so the random
model's text reaches the client. Each CLI must exit 0, every answer of the server must be 2xx (read
from its access log), and a second turn of the same session must reuse >= 90% of the first prompt
from the prefix cache (read from the request log).
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BIN = ROOT / "build" / "agent-clients" / "node_modules" / ".bin"
CLAUDE, CODEX = BIN / "claude", BIN / "codex"
CONTEXT = 65536
ACCESS = re.compile(r'"(GET|POST|HEAD|DELETE|PUT|OPTIONS) (\S+) HTTP/[\d.]+" (\d{3})')


def _need(binary: Path):
    if not binary.exists():
        pytest.skip(f"{binary.name} is not installed: scripts/test.sh installs the pinned agent CLIs with npm "
                    f"into build/agent-clients when npm is present")


@pytest.fixture(scope="module")
def model_64k(tmp_path_factory):
    """The tiny default model compiled for a 64k context (the library comes from NINFER_LIB_CACHE)."""
    from ninfer_mlc.compile.build import compile_model
    from ninfer_mlc.compile.tiny_default import generate

    if not (CLAUDE.exists() or CODEX.exists()):
        pytest.skip("the agent CLIs are not installed (scripts/test.sh installs them with npm when npm is present)")
    tmp = tmp_path_factory.mktemp("tiny64k")
    hf = generate(tmp / "hf")
    return compile_model(hf, target="llvm", quant="f32", out_dir=tmp / "art", name="qwen3x-tiny-64k",
                         max_context=CONTEXT, log=lambda *_: None,
                         rope_overrides={"scaling_type": "linear", "factor": 8.0, "original_context": 8192})


class Server:
    """`ninfer serve` in a child process, with its access log and request log."""

    def __init__(self, art: Path, work: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work / "serve.log"
        self.requests_path = work / "requests.jsonl"
        self._log = open(self.log_path, "w")
        env = {**os.environ, "TVM_NUM_THREADS": os.environ.get("TVM_NUM_THREADS", "2")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ninfer_mlc.cli", "serve", str(art), "--port", str(self.port), "--no-thinking",
             "--max-concurrency", "2", "--host-kv-mib", "256", "--request-log-jsonl", str(self.requests_path)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ninfer serve exited: {self.log_path.read_text()[-2000:]}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError("ninfer serve did not start")

    def statuses(self) -> list[tuple[str, str, int]]:
        return [(m[1], m[2], int(m[3])) for m in ACCESS.finditer(self.log_path.read_text())]

    def requests(self) -> list[dict]:
        if not self.requests_path.exists():
            return []
        return [json.loads(line) for line in self.requests_path.read_text().splitlines() if line.strip()]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


@pytest.fixture(scope="module")
def server(model_64k, tmp_path_factory):
    srv = Server(model_64k, tmp_path_factory.mktemp("serve"))
    yield srv
    srv.stop()


def run_cli(argv: list, env: dict, cwd: Path, timeout: float = 400) -> subprocess.CompletedProcess:
    p = subprocess.run([str(a) for a in argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout,
                       stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"{argv[0]} exited {p.returncode}\nstdout: {p.stdout[-2000:]}\nstderr: {p.stderr[-3000:]}"
    return p


def assert_all_2xx(server: Server) -> None:
    bad = [s for s in server.statuses() if not 200 <= s[2] < 300]
    assert not bad, f"non-2xx answers: {bad}"


def new_requests(server: Server, before: int, api: str) -> list[dict]:
    return [r for r in server.requests()[before:] if r["api"] == api]


def two_turns(server: Server, api: str, first_argv: list, second_argv: list, env: dict, cwd: Path) -> None:
    """Run a CLI turn and the next turn of the same session: both exit 0, only 2xx answers, and the
    second turn's first request reads >= 90% of the first turn's last prompt from the cache."""
    n0 = len(server.requests())
    run_cli(first_argv, env, cwd)
    first = new_requests(server, n0, api)
    assert first, f"{first_argv[0]} sent no {api} request"
    n1 = len(server.requests())
    run_cli(second_argv, env, cwd)
    second = new_requests(server, n1, api)
    assert second, f"{second_argv[0]} sent no {api} request on the second turn"
    assert second[0]["cached_tokens"] >= 0.9 * first[-1]["prompt_tokens"], (first, second)
    assert_all_2xx(server)


@pytest.fixture()
def workdir(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "project").mkdir()
    return tmp_path


def _claude_env(server: Server, home: Path) -> dict:
    return {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "ANTHROPIC_BASE_URL": server.url,
            "ANTHROPIC_AUTH_TOKEN": "unused", "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}


def test_claude_code_two_turns_reuse_the_prefix(server, workdir):
    """`claude -p` then `claude -p --continue` (no tools: a ~3k-token prompt) exit 0 with only 2xx
    answers; the second turn reads >= 90% of the first prompt from the prefix cache."""
    _need(CLAUDE)
    two_turns(server, "anthropic.messages", [CLAUDE, "-p", "say hi", "--tools", ""],
              [CLAUDE, "-p", "--continue", "and now bye", "--tools", ""], _claude_env(server, workdir / "home"),
              workdir / "project")


def test_claude_code_full_tool_list(server, workdir):
    """The default tool list: a ~21k-token prompt (system prompt, 12+ tools with deferred ones,
    a mid-conversation system message, adaptive thinking, context_management, effort)."""
    _need(CLAUDE)
    n0 = len(server.requests())
    run_cli([CLAUDE, "-p", "say hi"], _claude_env(server, workdir / "home"), workdir / "project", timeout=500)
    reqs = new_requests(server, n0, "anthropic.messages")
    assert reqs and reqs[0]["prompt_tokens"] > 10_000
    assert_all_2xx(server)


def test_codex_exec_two_turns_reuse_the_prefix(server, workdir):
    """`codex exec` then `codex exec resume --last` over wire_api "responses": exit 0, only 2xx,
    and the second turn reuses >= 90% of the first prompt."""
    _need(CODEX)
    codex_home = workdir / "home" / ".codex"
    codex_home.mkdir(parents=True)
    (codex_home / "config.toml").write_text(
        'model = "qwen3x-tiny-64k"\nmodel_provider = "ninfer"\n\n[model_providers.ninfer]\nname = "ninfer"\n'
        f'base_url = "{server.url}/v1"\nenv_key = "NINFER_API_KEY"\nwire_api = "responses"\n')
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(workdir / "home"), "CODEX_HOME": str(codex_home),
           "NINFER_API_KEY": "unused"}
    two_turns(server, "openai.responses", [CODEX, "exec", "--skip-git-repo-check", "say hi"],
              [CODEX, "exec", "--skip-git-repo-check", "resume", "--last", "and now bye"], env, workdir / "project")

