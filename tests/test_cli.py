"""The `ninfer` command line a newcomer meets: help text on every flag, defaults shown, the MODEL
argument the same everywhere, bad flags and bad models as one `ninfer: error:` line (no traceback),
a taken port refused before any model work, scripts/serve.sh installing once, and packaging that
ships static/ without setuptools warnings. Nothing here loads a model."""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer_mlc.cli import build_parser, main

ROOT = Path(__file__).resolve().parent.parent


def subcommands() -> dict[str, argparse.ArgumentParser]:
    p = build_parser()
    sub = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def run_cli(argv, capsys) -> tuple[int, str]:
    """Exit status and stderr of `ninfer argv` run in-process."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


# ---- help ---------------------------------------------------------------------------------------
def test_every_flag_of_every_subcommand_has_help():
    subs = subcommands()
    assert set(subs) == {"compile", "serve", "generate", "bench"}
    for name, parser in subs.items():
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            label = "/".join(action.option_strings) or action.dest
            assert action.help and len(action.help.strip()) > 8, f"ninfer {name} {label} has no help text"


def test_help_shows_defaults(monkeypatch):
    monkeypatch.setenv("COLUMNS", "2000")  # one line per flag
    for name, parser in subcommands().items():
        for action in parser._actions:
            if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._StoreTrueAction,
                                                                 argparse._StoreFalseAction)):
                continue
            if action.default is not None:
                assert "default" in action.help, f"ninfer {name} {action.option_strings[0]}: default not shown"
    text = subcommands()["serve"].format_help()
    for shown in ("(default: 8080)", "(default: 127.0.0.1)", "(default: 4)", "(default: 8192)", "(default: auto)",
                  "auto on CUDA, max-context x max-concurrency on the CPU", "(default: the embedded tiny model"):
        assert shown in text
    assert "turn off:" not in text  # negative switches say what they do


def test_model_argument_is_the_same_everywhere():
    subs = subcommands()
    for name in ("serve", "generate", "bench", "compile"):
        model = next(a for a in subs[name]._actions if a.dest == "model" and not a.option_strings)
        assert model.metavar == "MODEL" and "repo id" in model.help
    for name in ("serve", "generate", "bench"):  # compile flags for a MODEL that needs compiling, auto by default
        flags = {a.dest: a for a in subs[name]._actions}
        assert (flags["target"].default, flags["quant"].default, flags["kv_dtype"].default) == ("auto", "auto", None)
    assert subcommands()["compile"].parse_args(["m"]).target == "llvm"  # an explicit compile keeps its default
    g = subs["generate"]
    assert (g.parse_args(["hello"]).model, g.parse_args(["hello"]).prompt) == (None, "hello")
    assert (g.parse_args(["dir", "hello"]).model, g.parse_args(["dir", "hello"]).prompt) == ("dir", "hello")
    assert g.parse_args(["--model", "dir", "hello"]).model_flag == "dir"


# ---- bad flags, bad models ---------------------------------------------------------------------------
@pytest.mark.parametrize("argv,flag", [
    (["generate", "--max-tokens", "0", "hi"], "--max-tokens"),
    (["generate", "--max-tokens", "-5", "hi"], "--max-tokens"),
    (["generate", "--temperature", "-1", "hi"], "--temperature"),
    (["generate", "--temperature", "nan", "hi"], "--temperature"),
    (["bench", "--steps", "0"], "--steps"),
    (["bench", "--batch", "1,x"], "--batch"),
    (["serve", "--temperature", "-1", "--port", "0"], "--temperature"),
    (["serve", "--max-concurrency", "0", "--port", "0"], "--max-concurrency"),
])
def test_bad_flags_are_refused_naming_the_flag(argv, flag, capsys):
    code, err = run_cli(argv, capsys)
    assert code == 2 and flag in err and "Traceback" not in err


def test_missing_and_broken_models_are_one_line(tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text("{not json")
    empty = tmp_path / "empty"
    empty.mkdir()
    cases = [(["generate", str(tmp_path / "absent"), "hi"], "no such directory"),
             (["bench", str(tmp_path / "absent")], "no such directory"),
             (["generate", str(broken), "hi"], "corrupt manifest"),
             (["bench", str(broken)], "corrupt manifest"),
             (["generate", str(empty), "hi"], "neither a compiled model"),
             (["compile", str(empty)], "neither a compiled model"),
             (["compile", str(ROOT / "dist" / "qwen3x-tiny")], "compiled model already"),
             (["generate", "--model", str(tmp_path / "absent"), "hi"], "no such directory")]
    for argv, what in cases:
        code, err = run_cli(argv, capsys)
        assert code == 2, argv
        assert err.startswith("ninfer: ") and what in err and "Traceback" not in err, (argv, err)
    code, err = run_cli(["generate", "--model", "a", "b", "hi"], capsys)
    assert code == 2 and "not both" in err


def test_deprecated_model_flag_warns(tmp_path, capsys):
    code, err = run_cli(["generate", "--model", str(tmp_path / "absent"), "hi"], capsys)
    assert code == 2 and "--model is deprecated" in err


# ---- ports ---------------------------------------------------------------------------------------------
@pytest.fixture()
def taken_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


@pytest.mark.parametrize("flag", ["--port", "--stats-port"])
def test_taken_port_fails_before_the_model_is_looked_at(flag, taken_port, tmp_path, capsys):
    other = ["--port", "0"] if flag == "--stats-port" else []
    code, err = run_cli(["serve", str(tmp_path / "absent"), flag, str(taken_port), *other], capsys)
    assert code == 2 and f"{flag} {taken_port}" in err and "already in use" in err
    assert "absent" not in err  # the model (missing here) was never resolved


def test_free_port_reaches_the_model(tmp_path, capsys):
    code, err = run_cli(["serve", str(tmp_path / "absent"), "--port", "0", "--stats-port", "0"], capsys)
    assert code == 2 and "no such directory" in err


# ---- scripts/serve.sh ---------------------------------------------------------------------------------
FAKE_TOOL = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "{log}"
"""
FAKE_PYTHON3 = """#!/usr/bin/env bash
# stands in for `python3 -m venv .venv`: a venv whose pip and ninfer only log their calls
echo "python3 $*" >> "{log}"
mkdir -p .venv/bin
for tool in python pip ninfer; do
  printf '%s\\n' '#!/usr/bin/env bash' 'echo "$(basename "$0") $*" >> "{log}"' > .venv/bin/$tool
  chmod +x .venv/bin/$tool
done
"""


def test_serve_script_installs_once_then_only_when_pyproject_changes(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for f in ("serve.sh", "ensure_venv.sh", "install-xgrammar.sh"):
        shutil.copy2(ROOT / "scripts" / f, repo / "scripts" / f)
    shutil.copy2(ROOT / "pyproject.toml", repo / "pyproject.toml")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "calls.log"
    (bindir / "python3").write_text(FAKE_PYTHON3.format(log=log))
    (bindir / "python3").chmod((bindir / "python3").stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}")

    def serve(*args) -> list[str]:
        log.write_text("")
        subprocess.run([str(repo / "scripts" / "serve.sh"), *args], env=env, check=True, timeout=60,
                       capture_output=True)
        return log.read_text().splitlines()

    first = serve("--port", "9")
    assert first[0] == "python3 -m venv .venv" and "pip install -q -e ." in first and first[-1] == "ninfer serve --port 9"
    assert 'pip install -q --no-deps xgrammar==0.2.8' in first  # the pinned constrained-decoding core
    assert serve() == ["ninfer serve"]  # no venv, no pip: straight to the server
    (repo / "pyproject.toml").write_text((repo / "pyproject.toml").read_text() + "\n# changed\n")
    again = serve()
    assert "pip install -q -e ." in again and "python3 -m venv .venv" not in again
    assert serve() == ["ninfer serve"]
    want = hashlib.sha256((repo / "pyproject.toml").read_bytes()
                          + (repo / "scripts" / "install-xgrammar.sh").read_bytes()).hexdigest()
    assert (repo / ".venv" / ".ninfer-install-base").read_text().strip() == want
    # a test install (scripts/test.sh) covers serving too
    (repo / ".venv" / ".ninfer-install-base").unlink()
    (repo / ".venv" / ".ninfer-install-test").write_text(want)
    assert serve() == ["ninfer serve"]


# ---- packaging ------------------------------------------------------------------------------------------
def test_every_package_directory_is_listed():
    """setuptools warns for (and would drop) an importable directory missing from `packages`, such
    as the data-only ninfer_mlc/static; every one is listed and static/ ships its page."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    roots = {pkg: ROOT / path for pkg, path in cfg["package-dir"].items()}
    found = set()
    for pkg, path in roots.items():
        for d in [path, *(p for p in path.rglob("*") if p.is_dir())]:
            rel = d.relative_to(path).parts
            if "__pycache__" in rel or not any(f.is_file() for f in d.iterdir()):
                continue
            found.add(".".join((pkg, *rel)))
    assert found == listed
    assert (ROOT / "ninfer_mlc" / "static" / "monitor.html").is_file()
    assert any(Path(ROOT / "ninfer_mlc" / "static").glob(pat) for pat in cfg["package-data"]["ninfer_mlc.static"])


def test_cli_module_runs():
    out = subprocess.run([sys.executable, "-m", "ninfer_mlc.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "{compile,serve,generate,bench}" in out.stdout


def test_compile_progress_bars(capsys):
    from ninfer_mlc.compile.progress import SILENT, Progress

    on = Progress(enabled=True)
    assert list(on.iterate(range(3), "convert weights", 3, "weight")) == [0, 1, 2]
    with on.step("build llvm library"):
        pass
    err = capsys.readouterr().err
    assert "convert weights" in err and "3/3" in err and "build llvm library" in err
    items = [1]
    assert SILENT.iterate(items, "x") is items
    assert Progress().enabled is False  # on by default only when stderr is a terminal
