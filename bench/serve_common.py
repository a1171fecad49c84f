"""What the HTTP benchmarks (serve_bench.py, agent_replay.py) share: a `ninfer serve` process, a
streaming chat client that timestamps every SSE chunk, /stats deltas, exact-length prompt text, and
the device rates the figures are set against.

Client side only: the standard library (http.client, threads) and the `tokenizers` package the
project already needs, so the scripts run wherever the server runs (the H200 box has no extra
client libraries). Nothing here imports the engine; the benchmarks see what a user sees.

`python bench/serve_common.py rates` prints the device rates as JSON (run in its own process so the
CUDA context it opens is gone before the server takes the device memory).
"""
from __future__ import annotations

import http.client
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

# /stats sections whose numbers are counters: a benchmark reports their change over a cell / turn
DELTA_SECTIONS = ("counters", "cache_reuse", "kv_transfers", "state_transfers", "spec", "host_step")
PRESSURE_COUNTERS = ("spill_pages", "partial_tail_cow_pages", "private_owners_demoted", "private_owners_evicted",
                     "host_owners_evicted", "owners_evicted_total", "checkpoints_taken", "checkpoints_dropped",
                     "restores_device", "restores_host", "restore_failures", "planner_runs", "demote_failures")


# request sampling of the benchmarks: greedy, and Qwen3.x's recommended thinking-mode preset
PRESETS = {
    "greedy": {"temperature": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0},
    "qwen": {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "presence_penalty": 1.0},
}


class BenchError(RuntimeError):
    """A benchmark cannot go on (server did not start, bad configuration); the message says why."""


# ---- statistics --------------------------------------------------------------------------------
def percentile(xs, p: float) -> Optional[float]:
    """The p-th percentile (0..100) by linear interpolation, None for no data."""
    v = sorted(float(x) for x in xs)
    if not v:
        return None
    k = (len(v) - 1) * p / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(xs, scale: float = 1.0, nd: int = 3) -> dict:
    """{n, mean, p50, p90, p99, min, max} of xs * scale (None entries when xs is empty)."""
    xs = [float(x) * scale for x in xs]
    r = lambda v: None if v is None else round(v, nd)  # noqa: E731
    return {"n": len(xs), "mean": r(sum(xs) / len(xs)) if xs else None, "p50": r(percentile(xs, 50)),
            "p90": r(percentile(xs, 90)), "p99": r(percentile(xs, 99)), "min": r(min(xs)) if xs else None,
            "max": r(max(xs)) if xs else None}


# ---- HTTP ------------------------------------------------------------------------------------
def _conn(base_url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    u = urllib.parse.urlsplit(base_url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise BenchError(f"--url must look like http://HOST:PORT, got {base_url!r}")
    cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    return cls(u.hostname, u.port, timeout=timeout), u.path.rstrip("/")


def request_json(base_url: str, method: str, path: str, body: Optional[dict] = None, timeout: float = 600.0,
                 headers: Optional[dict] = None) -> tuple[int, dict]:
    """(status, decoded JSON body) of one request."""
    conn, prefix = _conn(base_url, timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        h = {"content-type": "application/json", **(headers or {})}
        conn.request(method, prefix + path, body=data, headers=h)
        resp = conn.getresponse()
        raw = resp.read()
        try:
            doc = json.loads(raw) if raw else {}
        except json.JSONDecodeError:
            doc = {"raw": raw[:2000].decode("utf-8", "replace")}
        return resp.status, doc
    finally:
        conn.close()


def get_stats(base_url: str, headers: Optional[dict] = None) -> dict:
    status, doc = request_json(base_url, "GET", "/stats", timeout=60, headers=headers)
    if status != 200:
        raise BenchError(f"GET /stats answered {status}: {doc}")
    return doc


@dataclass
class StreamRecord:
    """One streamed chat completion as the client saw it. Times are time.perf_counter() seconds.

    `chunks` holds one (arrival time, characters, tokens) per SSE chunk that carried generated text
    (reasoning_content, content or tool-call arguments); tokens is the number of logprob entries the
    chunk carried when the request asked for logprobs, else None (the server sends a chunk per
    detokenized piece, which may hold several tokens)."""

    t_send: float
    t_headers: Optional[float] = None
    t_role: Optional[float] = None
    chunks: list = field(default_factory=list)
    t_finish: Optional[float] = None  # the chunk carrying finish_reason
    t_done: Optional[float] = None  # [DONE]
    finish_reason: Optional[str] = None
    usage: Optional[dict] = None
    timings: Optional[dict] = None
    status: Optional[int] = None
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200 and self.usage is not None

    @property
    def ttft(self) -> Optional[float]:
        return self.chunks[0][0] - self.t_send if self.chunks else None


def _delta_text(choice: dict) -> tuple[int, int]:
    """(characters of generated text, logprob entries) in one chunk's choice."""
    d = choice.get("delta") or {}
    n = len(d.get("content") or "") + len(d.get("reasoning_content") or "")
    for tc in d.get("tool_calls") or []:
        fn = tc.get("function") or {}
        n += len(fn.get("arguments") or "") + len(fn.get("name") or "")
    lp = choice.get("logprobs") or {}
    return n, len(lp.get("content") or [])


def stream_chat(base_url: str, body: dict, timeout: float = 3600.0, headers: Optional[dict] = None,
                deadline: Optional[float] = None) -> StreamRecord:
    """POST /v1/chat/completions with stream: true and include_usage; every SSE line is timestamped on
    arrival. Never raises for server-side problems: they land in .error / .status. Past `deadline`
    (a time.perf_counter() value) the connection is closed, which cancels the request on the server."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    want_lp = bool(body.get("logprobs"))
    rec = StreamRecord(t_send=time.perf_counter())
    if deadline is not None:
        timeout = max(0.5, min(timeout, deadline - rec.t_send))
    conn, prefix = _conn(base_url, timeout)
    try:
        conn.request("POST", prefix + "/v1/chat/completions", body=json.dumps(body).encode(),
                     headers={"content-type": "application/json", "accept": "text/event-stream", **(headers or {})})
        resp = conn.getresponse()
        rec.t_headers, rec.status = time.perf_counter(), resp.status
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {resp.read()[:2000].decode('utf-8', 'replace')}"
            return rec
        while True:
            line = resp.readline()
            t = time.perf_counter()
            if deadline is not None and t > deadline and rec.t_done is None:
                rec.error = "deadline: the time budget ran out"
                break
            if not line:
                if rec.t_done is None:
                    rec.error = rec.error or "stream ended without [DONE]"
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                rec.t_done = t
                break
            ev = json.loads(payload)
            if "error" in ev:
                rec.error = f"stream error: {ev['error']}"
                continue
            if ev.get("usage"):
                rec.usage, rec.timings = ev["usage"], ev.get("timings") or {}
            for ch in ev.get("choices") or []:
                n_chars, n_lp = _delta_text(ch)
                if n_chars or n_lp:
                    rec.chunks.append((t, n_chars, n_lp if want_lp else None))
                elif rec.t_role is None and (ch.get("delta") or {}).get("role"):
                    rec.t_role = t
                if ch.get("finish_reason"):
                    rec.t_finish, rec.finish_reason = t, ch["finish_reason"]
    except socket.timeout:
        rec.error = "deadline: the time budget ran out" if deadline is not None else f"no data for {timeout:.0f} s"
    except (OSError, http.client.HTTPException, json.JSONDecodeError) as e:
        rec.error = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    if rec.error is None and rec.usage is None:
        rec.error = "no usage chunk (stream_options.include_usage ignored?)"
    return rec


def run_threads(fns: list) -> list:
    """Call every function on its own thread at once (concurrent clients); their results, in order. An
    exception in one is raised here once all have ended."""
    out: list = [None] * len(fns)
    errs: list = []

    def call(i, f):
        try:
            out[i] = f()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            errs.append(e)

    threads = [threading.Thread(target=call, args=(i, f), daemon=True) for i, f in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errs:
        raise errs[0]
    return out


# ---- per-request figures ---------------------------------------------------------------------------
def chunk_tokens(rec: StreamRecord) -> tuple[list[float], str]:
    """Tokens carried by each text chunk and how they are known.

    With logprobs every chunk carries one entry per token: exact ("logprobs"). Without, the first
    chunk is counted as one token (the prefill's sample) and the other completion_tokens - 1 are spread
    evenly over the remaining chunks ("even split of usage over chunks"): exact whenever the server sends
    one chunk per token, which it does unless the detokenizer holds back a partial character, a stop
    string prefix or a tag, or speculative decoding commits several tokens in one step."""
    n = len(rec.chunks)
    if n == 0:
        return [], "none"
    if all(c[2] is not None for c in rec.chunks) and sum(c[2] for c in rec.chunks) > 0:
        return [float(c[2]) for c in rec.chunks], "logprobs"
    total = int((rec.usage or {}).get("completion_tokens", n))
    if n == 1:
        return [float(total)], "even split of usage over chunks"
    rest = max(total - 1, 0) / (n - 1)
    return [1.0] + [rest] * (n - 1), "even split of usage over chunks"


def inter_token_latencies(rec: StreamRecord) -> list[float]:
    """Seconds per token between consecutive text chunks: gap / tokens in the later chunk (each such
    value counted once per chunk, not per token)."""
    toks, _ = chunk_tokens(rec)
    out = []
    for (t0, _, _), (t1, _, _), k in zip(rec.chunks, rec.chunks[1:], toks[1:]):
        if k > 0:
            out.append((t1 - t0) / k)
    return out


def decode_rate(rec: StreamRecord) -> Optional[float]:
    """Tokens per second of one stream after its first token: (completion_tokens - 1) / (finish - first)."""
    if not rec.ok or not rec.chunks:
        return None
    n = int(rec.usage.get("completion_tokens", 0))
    end = rec.t_finish or rec.chunks[-1][0]
    dt = end - rec.chunks[0][0]
    return (n - 1) / dt if n > 1 and dt > 0 else None


def token_times(rec: StreamRecord) -> list[tuple[float, float]]:
    """(arrival time, tokens) per text chunk, for windowed aggregate rates."""
    toks, _ = chunk_tokens(rec)
    return [(c[0], k) for c, k in zip(rec.chunks, toks)]


# ---- /stats ----------------------------------------------------------------------------------------
def _num_diff(a: dict, b: dict) -> dict:
    out = {}
    for k, v in b.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool) and isinstance(a.get(k), (int, float)):
            d = v - a[k]
            out[k] = round(d, 6) if isinstance(d, float) else d
    return out


def stats_delta(before: dict, after: dict) -> dict:
    """What changed in the server's counters between two /stats documents."""
    out = {s: _num_diff(before.get(s) or {}, after.get(s) or {}) for s in DELTA_SECTIONS}
    pb, pa = before.get("pressure") or {}, after.get("pressure") or {}
    out["pressure"] = {k: pa.get(k, 0) - pb.get(k, 0) for k in PRESSURE_COUNTERS if k in pa}
    g0 = ((before.get("load") or {}).get("cuda_graphs")) or {}
    g1 = ((after.get("load") or {}).get("cuda_graphs")) or {}
    out["cuda_graphs"] = _num_diff(g0, g1)
    return out


def transfer_rates(delta: dict) -> dict:
    """Bytes, seconds and GB/s of host<->device traffic in a stats delta: restore = h2d (KV pages +
    state slots), spill = d2h. Seconds are the engine's own copy timings; the device draining the work
    queued before each copy (an overlapped decode step) is apart, in {restore,spill}_wait_seconds."""
    kv, st = delta.get("kv_transfers") or {}, delta.get("state_transfers") or {}
    out = {}
    for name, d in (("restore", "h2d"), ("spill", "d2h")):
        b = kv.get(f"kv_{d}_bytes", 0) + st.get(f"state_{d}_bytes", 0)
        s = kv.get(f"kv_{d}_seconds", 0.0) + st.get(f"state_{d}_seconds", 0.0)
        out[f"{name}_bytes"] = int(b)
        out[f"{name}_kv_pages"] = int(kv.get(f"kv_{d}_pages", 0))
        out[f"{name}_state_slots"] = int(st.get(f"state_{d}_count", 0))
        out[f"{name}_seconds"] = round(s, 6)
        out[f"{name}_wait_seconds"] = round(kv.get(f"kv_{d}_wait_seconds", 0.0) + st.get(f"state_{d}_wait_seconds", 0.0), 6)
        out[f"{name}_kv_copies"] = int(kv.get(f"kv_{d}_copies", 0))
        out[f"{name}_GBps"] = round(b / s / 1e9, 3) if s > 0 and b > 0 else None
    return out


def load_info(stats: dict, model_dir: Optional[str] = None) -> dict:
    """The server's load section, plus the artifact manifest's weight facts when the directory is known.
    `random_weights` is null when neither says (the server and manifest predate the flag)."""
    load = dict(stats.get("load") or {})
    mem = stats.get("memory") or {}
    load["weights_bytes"] = mem.get("weights_bytes")
    load["kv_capacity_tokens"] = mem.get("kv_capacity_tokens")
    load["device_name"] = mem.get("device_name")
    load["max_context"] = mem.get("max_context")
    man = read_manifest_json(model_dir)
    if "random_weights" not in load:
        load["random_weights"] = _random_flag(man)
    if man:
        load["manifest"] = {k: man.get(k) for k in ("name", "target", "dtype", "quant", "kv_dtype", "max_context",
                                                   "tvm_version") if k in man}
    return load


def read_manifest_json(model_dir: Optional[str]) -> Optional[dict]:
    if not model_dir:
        return None
    p = Path(model_dir) / "manifest.json"
    try:
        return json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _random_flag(man: Optional[dict]) -> Optional[bool]:
    if not man:
        return None
    for k in ("random_weights", "weights_random"):
        if k in man:
            return bool(man[k])
    if "random_weights" in (man.get("extras") or {}):
        return bool(man["extras"]["random_weights"])
    w = man.get("weights")
    if isinstance(w, dict) and "random" in w:
        return bool(w["random"])
    return None


# ---- the server process ---------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def flag_value(args: list[str], name: str) -> Optional[str]:
    """The value of `--name V` / `--name=V` in a flag list (the last one), or None."""
    v = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            v = args[i + 1]
        elif a.startswith(name + "="):
            v = a.split("=", 1)[1]
    return v


class ServerProcess:
    """`ninfer serve MODEL` on a free loopback port, as its own process (the user's path); stopped with
    SIGINT (uvicorn's graceful shutdown), then killed if it does not exit."""

    def __init__(self, model_dir: Optional[str], serve_args: list[str], start_timeout_s: float = 900.0,
                 log_path: Optional[str] = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # -P: the working directory stays off sys.path (a repo checkout's ninfer_mlc/ folder would shadow the
        # installed package, whose runtime/ and compile/ live elsewhere)
        cmd = [sys.executable, "-P", "-m", "ninfer_mlc.cli", "serve"] + ([model_dir] if model_dir else [])
        self.cmd = cmd + ["--host", "127.0.0.1", "--port", str(self.port)] + list(serve_args)
        if _random_flag(read_manifest_json(model_dir)) and "--allow-random-weights" not in self.cmd:
            self.cmd.append("--allow-random-weights")  # a benchmark artifact: this tool asks for it, and says so
        self.start_timeout_s = start_timeout_s
        self.log_path = log_path or tempfile.mkstemp(prefix="ninfer_serve_", suffix=".log")[1]
        self.proc: Optional[subprocess.Popen] = None
        self.start_seconds: Optional[float] = None

    def __enter__(self) -> "ServerProcess":
        t0 = time.perf_counter()
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        while True:
            if self.proc.poll() is not None:
                raise BenchError(f"`{' '.join(self.cmd)}` exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                status, _ = request_json(self.url, "GET", "/health", timeout=5)
                if status == 200:
                    break
            except OSError:
                pass
            if time.perf_counter() - t0 > self.start_timeout_s:
                self.stop()
                raise BenchError(f"server not healthy after {self.start_timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(0.25)
        self.start_seconds = time.perf_counter() - t0
        return self

    def log_tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log_path).read_bytes()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self) -> Optional[int]:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def __exit__(self, *exc) -> None:
        self.stop()


@contextmanager
def serving(doc: dict, model_dir: Optional[str], serve_args: list[str], url: Optional[str] = None,
            log_path: Optional[str] = None, headers: Optional[dict] = None):
    """Attach to `url` or start `ninfer serve`; records doc["server"] (command, start seconds, log, exit code)
    and doc["load"] (load_info), yields the base URL, stops a server it started."""
    server = None
    try:
        if url:
            base = url.rstrip("/")
        else:
            server = ServerProcess(model_dir, serve_args, log_path=log_path).__enter__()
            base = server.url
            doc["server"] = {"cmd": server.cmd, "start_seconds": round(server.start_seconds, 3),
                             "log": server.log_path}
        doc["load"] = load_info(get_stats(base, headers), model_dir)
        yield base
    finally:
        if server is not None:
            doc.setdefault("server", {})["exit_code"] = server.stop()


# ---- prompt text -------------------------------------------------------------------------------
class WordPool:
    """Words that are exactly one token each after a space (" word"), taken from the model's own
    vocabulary, so a text of K such words after a fixed header is exactly K tokens more than the
    header alone: a byte-level BPE pre-tokenizer splits before every " word", and merges never cross
    those splits. Built from tokenizer.json with the `tokenizers` package."""

    MAX_WORDS = 4096

    def __init__(self, tokenizer_path: str | Path):
        from tokenizers import Tokenizer

        p = Path(tokenizer_path)
        if p.is_dir():
            p = p / "tokenizer.json"
        if not p.is_file():
            raise BenchError(f"no tokenizer.json at {tokenizer_path}")
        self.tok = Tokenizer.from_file(str(p))
        vocab = self.tok.get_vocab()
        cands = sorted((i, s[1:]) for s, i in vocab.items() if re.fullmatch(r"\u0120[a-z]{3,12}", s))
        words = []
        for _, w in cands:
            if len(self.tok.encode(" " + w, add_special_tokens=False).ids) == 1:
                words.append(w)
                if len(words) >= self.MAX_WORDS:
                    break
        if len(words) < 64:
            raise BenchError(f"{p}: only {len(words)} single-token words (a byte-level BPE vocabulary is needed)")
        self.words = words

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def text(self, n: int, rng, line_words: int = 0) -> str:
        """n words, each one token (" w"); with line_words, a newline token after every line_words words."""
        idx = rng.integers(0, len(self.words), n)
        ws = [" " + self.words[i] for i in idx]
        if line_words:
            ws = ["".join(ws[i:i + line_words]) + "\n" for i in range(0, len(ws), line_words)]
        return "".join(ws)


# ---- device rates ------------------------------------------------------------------------------------
def _pinned_rates(torch, nbytes: int) -> dict:
    """Host<->device copy rates over page-locked host memory, bytes/s (one direction each)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_common import cuda_median_s

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = nbytes / cuda_median_s(torch, lambda: dev.copy_(host, non_blocking=True), reps=5, warm=2)
    d2h = nbytes / cuda_median_s(torch, lambda: host.copy_(dev, non_blocking=True), reps=5, warm=2)
    return {"h2d_Bps": h2d, "d2h_Bps": d2h, "bytes": nbytes}


def device_rates(which: tuple = ("pinned", "floors"), pinned_bytes: int = 1 << 30) -> dict:
    """Rates measured with torch in this process: pinned host<->device copy, device copy bandwidth
    (read + written), bf16 matmul rate. Every value is null without torch or a CUDA device."""
    out = {"torch": None, "device": None, "pinned_h2d_Bps": None, "pinned_d2h_Bps": None,
           "copy_bandwidth_Bps": None, "bf16_matmul_flops": None}
    try:
        import torch
    except ImportError:
        out["why_null"] = "torch is not installed"
        return out
    out["torch"] = torch.__version__
    if not torch.cuda.is_available():
        out["why_null"] = "no CUDA device"
        return out
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from gpu_common import measure_floors

    out["device"] = torch.cuda.get_device_name(0)
    if "pinned" in which:
        r = _pinned_rates(torch, pinned_bytes)
        torch.cuda.empty_cache()
        out["pinned_h2d_Bps"], out["pinned_d2h_Bps"], out["pinned_bytes"] = r["h2d_Bps"], r["d2h_Bps"], r["bytes"]
    if "floors" in which:
        out["copy_bandwidth_Bps"], out["bf16_matmul_flops"] = measure_floors(torch)
    return out


def device_rates_subprocess(which: tuple = ("pinned", "floors"), timeout: float = 300.0) -> dict:
    """device_rates() in a child process, so no CUDA context stays open in the benchmark's process."""
    try:
        r = subprocess.run([sys.executable, str(Path(__file__).resolve()), "rates", ",".join(which)],
                           capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"rate measurement took over {timeout:.0f} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"error": f"rate measurement failed ({r.returncode}): {r.stderr[-2000:]}"}
    return json.loads(lines[-1])


def write_json(path: Optional[str], doc: dict) -> None:
    """The result document to `path` (atomically, so a killed run leaves the last complete version)."""
    if not path:
        return
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, p)


def run_and_report(name: str, run, a) -> int:
    """A benchmark's main: run(a) -> document; BenchError -> exit with its message; the document to stdout
    when no --output file was given."""
    try:
        doc = run(a)
    except BenchError as e:
        raise SystemExit(f"{name}: {e}") from None
    if not a.output:
        print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "rates":
        which = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("pinned", "floors")
        print(json.dumps(device_rates(which)))
    else:
        print(__doc__)
