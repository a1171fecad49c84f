"""Serving benchmark: the user's path, `ninfer serve` over HTTP with streaming clients.

Starts `ninfer serve MODEL_DIR [--serve-args ...]` (or attaches to --url), warms it up, then for every
(context, concurrency, sampling preset) cell sends `concurrency x --waves` streamed OpenAI chat
completions (`stream: true`, `stream_options.include_usage`, `ignore_eos`, `max_tokens`) from that many
client threads, and writes one JSON document: the configuration, the server's load section (model,
dtypes, KV dtype, random-weights flag), the device rates, and per cell:

* ttft_s            request sent -> first chunk carrying generated text (p50/p99)
* itl_ms            inter-token latency: gap between consecutive text chunks / tokens in the later chunk
                    (tokens per chunk: exact with --logprobs, else the usage count spread evenly, see
                    serve_common.chunk_tokens; chunk_gap_ms is the raw gap)
* decode_tok_s_per_stream   (completion_tokens - 1) / (finish chunk - first chunk), per request
* decode_tok_s_full_batch   tokens arriving while all `concurrency` streams are decoding / that time
* output_tok_s      all completion tokens / cell wall time (prefill included)
* prefill_tok_s_client      prompt tokens / TTFT (what a user sees, queueing included)
* prefill_tok_s_server      the engine's `timings.prompt_per_second` (computed tokens / prefill time)
* server_timings    the engine's timings object summarised (prompt_ms, predicted_per_second, queue_ms)
* stats_delta       /stats counters after - before (cache hits, preemptions, transfers, graphs)
* host_step         the engine's host ms per decode step by phase (runtime/step_timing.py): mean over the
                    cell's decode steps (from /stats sums), and p50/p99 of the last 1024 decode steps
* harness           (--harness) the kernel harness's figure for the same shape and its floor

Prompts are exactly `context` tokens: a fixed header then single-token words drawn from the model's
vocabulary (serve_common.WordPool); the template overhead is calibrated against the server and every
request's usage.prompt_tokens is checked against the target. Every request gets different words,
so the prefix cache cannot hide prefill. --shared-prefix F (for contexts >= --shared-prefix-min-context)
asks for it: a share F of the words moves into a system message common to all requests of that
context, primed into the prefix cache by one request (its cold prefill is reported as the cell's
`shared_prefix.prime`), so long-context decode cells do not each prefill `concurrency` full prompts.

A time budget (--budget-s) skips cells that would not finish (reported with the reason), and a cell
still running at the budget's end is cut off (its requests cancelled) and reported as partial.

    python bench/serve_bench.py                                     # embedded tiny model, small cells
    python bench/serve_bench.py .gpu/q27b --contexts 8192,65536,131072,262144 --concurrency 1,2,4,8 \\
        --extra-cells 524288:1 --presets greedy,qwen --max-tokens 256 --budget-s 540 --harness -o serve.json
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_common import (PRESETS, BenchError, WordPool, chunk_tokens, decode_rate, device_rates_subprocess,  # noqa: E402
                          flag_value, get_stats, inter_token_latencies, request_json, run_threads, serving, stats_delta,
                          stream_chat, summarize, token_times, run_and_report, write_json)

HEADER = "Read the following text:"


# ---- prompts -----------------------------------------------------------------------------------------
class PromptMaker:
    """Chat messages of an exact prompt length: HEADER + K single-token words in the user message, or,
    for a shared prefix, a system message of shared words (the engine checkpoints the state at the user
    message's turn opener, so later requests reuse it) and a user message of the request's own words.
    The template overhead of both shapes (prompt tokens - words) is measured against the server."""

    SHAPES = ("user", "system+user")

    def __init__(self, words: WordPool, thinking: bool):
        self.words, self.thinking = words, thinking
        self.overhead: dict[str, int] = {}

    @staticmethod
    def messages(system: Optional[str], user: str) -> list[dict]:
        return ([{"role": "system", "content": system}] if system is not None else []) + \
            [{"role": "user", "content": user}]

    def body(self, messages: list[dict], max_tokens: int, preset: dict, seed: Optional[int], logprobs: bool) -> dict:
        b = {"messages": messages, "max_tokens": max_tokens, "ignore_eos": True,
             "chat_template_kwargs": {"enable_thinking": self.thinking}, **preset}
        if seed is not None:
            b["seed"] = seed
        if logprobs:
            b["logprobs"], b["top_logprobs"] = True, 0
        return b

    def calibrate(self, url: str, headers: dict) -> dict:
        """Template overhead in tokens of each message shape, checked for additivity with two word counts."""
        rng = np.random.default_rng(12345)
        for shape in self.SHAPES:
            seen = []
            for k in (32, 96):
                sys_text = HEADER + self.words.text(k // 2, rng) if shape != "user" else None
                user = HEADER + self.words.text(k - k // 2 if sys_text else k, rng)
                body = self.body(self.messages(sys_text, user), 1, PRESETS["greedy"], None, False)
                status, doc = request_json(url, "POST", "/v1/chat/completions", body, headers=headers)
                if status != 200:
                    raise BenchError(f"calibration request answered {status}: {doc}")
                seen.append(int(doc["usage"]["prompt_tokens"]) - k)
            if seen[0] != seen[1]:
                raise BenchError(f"prompt token counts are not additive in words ({shape}: {seen}): the word pool "
                                 "does not fit this tokenizer")
            self.overhead[shape] = seen[0]
        return dict(self.overhead)

    def split(self, context: int, shared_fraction: float) -> tuple[int, int]:
        """(shared words, own words) of a prompt of `context` tokens."""
        shape = "system+user" if shared_fraction > 0 else "user"
        k = context - self.overhead[shape]
        shared = int(shared_fraction * k)
        if k - shared < 1:
            raise BenchError(f"context {context} is not above the template overhead ({self.overhead[shape]} tokens)")
        return shared, k - shared

    def prompt(self, context: int, rng, shared_fraction: float = 0.0, shared_seed=None) -> list[dict]:
        """Messages of exactly `context` prompt tokens; the shared part is the same for every call with the
        same (context, shared_fraction, shared_seed), the rest comes from rng."""
        n_shared, n_own = self.split(context, shared_fraction)
        system = None
        if shared_fraction > 0:
            system = HEADER + self.words.text(n_shared, np.random.default_rng(shared_seed))
        return self.messages(system, HEADER + self.words.text(n_own, rng))


# ---- one cell --------------------------------------------------------------------------------------
def full_batch_rate(recs, concurrency: int) -> Optional[float]:
    """Tokens per second while exactly `concurrency` streams are past their first token and not finished:
    the engine's steady decode rate at that batch (None when that never happened)."""
    spans = [(r.chunks[0][0], r.t_finish or r.chunks[-1][0]) for r in recs if r.ok and r.chunks]
    if len(spans) < concurrency:
        return None
    events = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    windows, active, start = [], 0, None
    for t, d in events:
        active += d
        if active == concurrency and d == 1:
            start = t
        elif start is not None and active < concurrency:
            windows.append((start, t))
            start = None
    length = sum(b - a for a, b in windows)
    if length <= 0:
        return None
    toks = 0.0
    for r in recs:
        if not (r.ok and r.chunks):
            continue
        for t, k in token_times(r)[1:]:  # the first chunk is the prefill's token
            if any(a < t <= b for a, b in windows):
                toks += k
    return toks / length


def request_row(r, t0: float) -> dict:
    rel = lambda t: None if t is None else round(t - t0, 6)  # noqa: E731
    toks, method = chunk_tokens(r)
    return {"t_send": rel(r.t_send), "t_headers": rel(r.t_headers), "t_first_token": rel(r.chunks[0][0]) if r.chunks
            else None, "t_last_chunk": rel(r.chunks[-1][0]) if r.chunks else None, "t_finish": rel(r.t_finish),
            "t_done": rel(r.t_done), "ttft_s": None if r.ttft is None else round(r.ttft, 6), "chunks": len(r.chunks),
            "chunk_tokens_method": method, "decode_tok_s": _r(decode_rate(r)), "finish_reason": r.finish_reason,
            "usage": r.usage, "timings": r.timings, "status": r.status, "error": r.error}


def _r(x, nd: int = 3):
    return None if x is None else round(x, nd)


def shared_fraction(a, ctx: int) -> float:
    return a.shared_prefix if ctx >= a.shared_prefix_min_context else 0.0


def run_cell(url: str, headers: dict, prompts: PromptMaker, ctx: int, conc: int, preset: str, a,
             deadline: float, cell_seed: int, primed: set) -> dict:
    """One cell: conc client threads send conc x waves streamed requests back to back. With a shared
    prefix, one priming request first puts the shared part in the prefix cache (once per context)."""
    n_req = conc * a.waves
    frac = shared_fraction(a, ctx)
    shared_seed = [a.seed, ctx]
    prime = None
    if frac > 0 and ctx not in primed:
        msgs = prompts.prompt(ctx, np.random.default_rng([cell_seed, 10 ** 6]), frac, shared_seed)
        pr = stream_chat(url, prompts.body(msgs, 2, PRESETS["greedy"], None, False), timeout=a.request_timeout_s,
                         headers=headers, deadline=deadline)
        prime = {"ttft_s": _r(pr.ttft, 4), "usage": pr.usage, "timings": pr.timings, "error": pr.error}
        if pr.ok:
            primed.add(ctx)
    bodies = []
    for i in range(n_req):
        msgs = prompts.prompt(ctx, np.random.default_rng([cell_seed, i]), frac, shared_seed)
        seed = cell_seed * 1000 + i if preset != "greedy" else None
        bodies.append(prompts.body(msgs, a.max_tokens, PRESETS[preset], seed, a.logprobs))
    before = get_stats(url, headers)
    recs = [None] * n_req
    nxt = iter(range(n_req))
    lock = threading.Lock()

    def worker():
        while True:
            with lock:
                i = next(nxt, None)
            if i is None or time.perf_counter() > deadline:
                return
            recs[i] = stream_chat(url, bodies[i], timeout=a.request_timeout_s, headers=headers, deadline=deadline)

    t0 = time.perf_counter()
    run_threads([worker] * conc)
    wall = time.perf_counter() - t0
    after = get_stats(url, headers)
    done = [r for r in recs if r is not None]
    ok = [r for r in done if r.ok]
    cut = any(r.error and r.error.startswith("deadline") for r in done) or len(done) < n_req
    delta = stats_delta(before, after)
    ptoks = sorted({int(r.usage["prompt_tokens"]) for r in ok})
    ctoks = [int(r.usage["completion_tokens"]) for r in ok]
    itl = [x for r in ok for x in inter_token_latencies(r)]
    gaps = [b[0] - a_[0] for r in ok for a_, b in zip(r.chunks, r.chunks[1:])]
    methods = sorted({chunk_tokens(r)[1] for r in ok})
    tm = [r.timings or {} for r in ok]
    cell = {
        "context": ctx, "concurrency": conc, "preset": preset, "sampling": PRESETS[preset],
        "shared_prefix": {"fraction": frac, "tokens": prompts.split(ctx, frac)[0], "prime": prime},
        "status": "ok" if len(ok) == n_req else ("partial" if cut else "failed"),
        "requests": n_req, "requests_ok": len(ok), "wall_s": round(wall, 4),
        "errors": sorted({r.error for r in done if r.error})[:5],
        "prompt_tokens": {"target": ctx, "seen": ptoks, "all_match": bool(ok) and ptoks == [ctx]},
        "completion_tokens": {"per_request": a.max_tokens, "total": sum(ctoks), "all_match": bool(ok) and all(
            c == a.max_tokens for c in ctoks)},
        "cached_tokens_total": sum(int((r.usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
                                   for r in ok),
        "ttft_s": summarize([r.ttft for r in ok], nd=4),
        "itl_ms": summarize(itl, 1e3),
        "itl_method": methods[0] if len(methods) == 1 else methods,
        "chunk_gap_ms": summarize(gaps, 1e3),
        "tokens_per_chunk_mean": _r(sum(ctoks) / sum(len(r.chunks) for r in ok)) if ok else None,
        "decode_tok_s_per_stream": summarize([decode_rate(r) for r in ok if decode_rate(r) is not None], nd=2),
        "decode_tok_s_full_batch": _r(full_batch_rate(ok, conc), 2),
        "output_tok_s": _r(sum(ctoks) / wall, 2) if wall > 0 else None,
        "prefill_tok_s_client": summarize([int(r.usage["prompt_tokens"]) / r.ttft for r in ok if r.ttft], nd=1),
        "prefill_tok_s_server": summarize([t.get("prompt_per_second", 0) for t in tm if t.get("prompt_per_second")],
                                          nd=1),
        "server_timings": {k: summarize([t[k] for t in tm if k in t], nd=3)
                           for k in ("prompt_ms", "prompt_n", "cache_n", "predicted_ms", "predicted_per_second",
                                     "queue_ms")},
        "preemptions": delta["counters"].get("preemptions", 0),
        "host_step": host_step_cell(delta.get("host_step") or {}, after.get("host_step") or {}),
        "stats_delta": delta,
        "requests_detail": [request_row(r, t0) for r in done],
    }
    return cell


def host_step_cell(delta: dict, after: dict) -> dict:
    """Mean host ms per decode step by phase over the cell (the /stats sums' delta over its steps), and the
    percentiles of the server's recent window at the cell's end."""
    steps = delta.get("steps", 0)
    out: dict = {"steps": steps, "overlapped_steps": delta.get("overlapped_steps", 0)}
    for k, v in delta.items():
        if k.endswith("_sum_ms") and steps:
            out[k[: -len("_sum_ms")] + "_mean_ms"] = round(v / steps, 4)
    out.update({k: v for k, v in after.items() if k.endswith(("_p50_ms", "_p99_ms"))})
    return out


# ---- planning ---------------------------------------------------------------------------------------
def plan_cells(a) -> list[tuple[int, int, str]]:
    cells = [(c, n, p) for c in a.contexts for n in a.concurrency for p in a.presets]
    for c, n in a.extra_cells:
        cells += [(c, n, p) for p in a.presets]
    seen, out = set(), []
    for x in cells:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


class Estimator:
    """Seconds a cell will take, from what the run measured so far (prefill tok/s by context, decode
    tok/s per stream by concurrency). Prefill beyond the largest measured context is assumed to slow down
    with the square root of the context (attention grows), decode with the context's share of KV reads."""

    def __init__(self):
        self.prefill: dict[int, float] = {}
        self.decode: dict[tuple[int, int], float] = {}

    def note(self, cell: dict) -> None:
        p = (cell.get("prefill_tok_s_server") or {}).get("p50")
        d = (cell.get("decode_tok_s_per_stream") or {}).get("p50")
        if p:
            self.prefill[cell["context"]] = min(p, self.prefill.get(cell["context"], p))
        if d:
            key = (cell["context"], cell["concurrency"])
            self.decode[key] = min(d, self.decode.get(key, d))

    def seconds(self, ctx: int, prefill_tokens: float, conc: int, waves: int, max_tokens: int) -> Optional[float]:
        if not self.prefill or not self.decode:
            return None
        below = [c for c in self.prefill if c <= ctx]
        c0 = max(below) if below else min(self.prefill)
        p_rate = self.prefill[c0] * min(1.0, (c0 / ctx) ** 0.5)
        ref = min(self.decode, key=lambda k: (abs(np.log2(k[1] / conc)), abs(np.log2(k[0] / ctx))))
        d_rate = self.decode[ref] * min(1.0, (ref[0] / ctx) ** 0.25)
        return (prefill_tokens / p_rate + waves * max_tokens / d_rate) * 1.15 + 2.0


def cell_fits(ctx: int, conc: int, a, load: dict, shared_tokens: int = 0) -> Optional[str]:
    """Why a cell cannot run on this server (context limit, device KV), or None. Requests of a shared
    prefix share its full pages (copy-on-write), so the prefix counts once."""
    mx = load.get("max_context")
    if mx and ctx + a.max_tokens > mx:
        return f"context {ctx} + {a.max_tokens} generated exceeds the server's max context {mx}"
    cap = load.get("kv_capacity_tokens")
    need = shared_tokens + conc * (ctx - shared_tokens + a.max_tokens)
    if cap and need > cap and not a.allow_preemption:
        return (f"device KV holds {cap} tokens, the cell needs {need} and would preempt "
                "(--allow-preemption runs it anyway)")
    return None


# ---- the run -----------------------------------------------------------------------------------------
def warm_up(url: str, headers: dict, prompts: PromptMaker, a) -> dict:
    """One request, then one wave at the largest concurrency: first calls, CUDA-graph captures."""
    t0 = time.perf_counter()
    conc = max(a.concurrency + [n for _, n in a.extra_cells])
    n_ctx = max(prompts.overhead["user"] + 16, min(512, min(a.contexts + [c for c, _ in a.extra_cells])))
    body = lambda i: prompts.body(prompts.prompt(n_ctx, np.random.default_rng([999, i])),  # noqa: E731
                                  min(32, a.max_tokens), PRESETS["greedy"], None, a.logprobs)
    r = stream_chat(url, body(0), timeout=a.request_timeout_s, headers=headers)
    if not r.ok:
        raise BenchError(f"warm-up request failed: {r.error}")
    recs = run_threads([lambda i=i: stream_chat(url, body(i + 1), headers=headers) for i in range(conc)])
    errs = [x.error for x in recs if not x.ok]
    if errs:
        raise BenchError(f"warm-up wave failed: {errs[0]}")
    return {"seconds": round(time.perf_counter() - t0, 3), "context": n_ctx, "concurrency": conc}


def attach_harness(cells: list, harness: dict) -> None:
    dec = {(d["context"], d["batch"]): d for d in harness.get("decode", [])}
    pre = {p["context"]: p for p in harness.get("prefill", [])}
    for c in cells:
        if c.get("status") not in ("ok", "partial"):
            continue
        d, p = dec.get((c["context"], c["concurrency"])), pre.get(c["context"])
        h = {"decode": d, "prefill": p}
        ps = (c.get("decode_tok_s_per_stream") or {}).get("p50")
        if d and ps:
            h["decode_per_stream_vs_harness"] = round(ps / d["tok_s_per_stream"], 4)
        if d and c.get("decode_tok_s_full_batch"):
            h["decode_full_batch_vs_harness"] = round(c["decode_tok_s_full_batch"] / d["tok_s"], 4)
        sp = (c.get("prefill_tok_s_server") or {}).get("p50")
        if p and sp:
            h["prefill_server_vs_harness"] = round(sp / p["tok_s"], 4)
        c["harness"] = h


def run_harness_subprocess(model_dir: str, cells: list, a, prefill_chunk: int, budget_s: float) -> dict:
    import subprocess
    import tempfile

    shapes = sorted({(c, n) for c, n, _ in cells})
    ctxs = sorted({c for c, _, _ in cells if c <= a.harness_prefill_max})
    out = tempfile.mkstemp(prefix="serve_harness_", suffix=".json")[1]
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "serve_harness.py"), model_dir,
           "--decode", ",".join(f"{c}x{n}" for c, n in shapes), "--prefill", ",".join(map(str, ctxs)),
           "--steps", str(a.harness_steps), "--prefill-chunk", str(prefill_chunk), "--budget-s", str(budget_s),
           "-o", out] + ([] if a.harness_host_logits else ["--device-argmax"])
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=budget_s + 300)
    except subprocess.TimeoutExpired:
        return {"error": "harness took too long"}
    if r.returncode != 0:
        return {"error": f"harness failed ({r.returncode}): {r.stderr[-3000:]}"}
    return json.loads(Path(out).read_text())


def run(a) -> dict:
    t_start = time.perf_counter()
    budget_end = t_start + a.budget_s
    model_dir = a.model
    if model_dir is None and not a.url:
        from ninfer_mlc.paths import default_model_dir

        model_dir = str(default_model_dir())
    tok_src = a.tokenizer or model_dir
    if not tok_src:
        raise BenchError("--url needs the model directory (or --tokenizer) to build exact-length prompts")
    prompts = PromptMaker(WordPool(tok_src), a.thinking == "on")
    serve_args = shlex.split(a.serve_args)
    headers = {"authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    cells_planned = plan_cells(a)
    doc: dict = {"schema": "ninfer_mlc_serve_bench", "schema_version": 1,
                 "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                 "config": {"model": model_dir, "url": a.url, "serve_args": serve_args, "contexts": a.contexts,
                            "concurrency": a.concurrency, "extra_cells": a.extra_cells, "presets": a.presets,
                            "presets_sampling": {p: PRESETS[p] for p in a.presets}, "max_tokens": a.max_tokens,
                            "waves": a.waves, "shared_prefix": a.shared_prefix,
                            "shared_prefix_min_context": a.shared_prefix_min_context, "logprobs": a.logprobs,
                            "thinking": a.thinking, "budget_s": a.budget_s, "harness": a.harness},
                 "cells": [], "skipped": []}
    if a.harness:
        if not model_dir:
            raise BenchError("--harness needs the model directory")
        pchunk = int(flag_value(serve_args, "--prefill-chunk") or 512)
        doc["harness"] = run_harness_subprocess(model_dir, cells_planned, a, pchunk, a.budget_s * a.harness_share)
        doc["rates"] = (doc["harness"].get("rates") or {}) if "error" not in doc["harness"] else {}
    elif a.rates:
        doc["rates"] = device_rates_subprocess(("floors",))
    write_json(a.output, doc)

    with serving(doc, model_dir, serve_args, a.url, a.server_log, headers) as url:
        doc["calibration"] = {"template_overhead_tokens": prompts.calibrate(url, headers),
                              "words": len(prompts.words.words)}
        primed: set = set()
        doc["warm_up"] = warm_up(url, headers, prompts, a)
        est = Estimator()
        for i, (ctx, conc, preset) in enumerate(cells_planned):
            frac = shared_fraction(a, ctx)
            try:
                why = cell_fits(ctx, conc, a, doc["load"], prompts.split(ctx, frac)[0])
            except BenchError as e:  # a context below the template overhead
                why = str(e)
            left = budget_end - time.perf_counter()
            need = est.seconds(ctx, conc * a.waves * (1 - frac) * ctx + (frac * ctx if ctx not in primed else 0),
                               conc, a.waves, a.max_tokens)
            if why is None and need is not None and need > left:
                why = f"time budget: estimated {need:.0f} s, {left:.0f} s left"
            if why is None and left <= 1:
                why = "time budget: none left"
            if why:
                doc["skipped"].append({"context": ctx, "concurrency": conc, "preset": preset, "why": why})
                print(f"cell ctx={ctx} c={conc} {preset}: skipped ({why})", flush=True)
                continue
            cell = run_cell(url, headers, prompts, ctx, conc, preset, a, budget_end, a.seed + i, primed)
            if need is not None:
                cell["estimated_s"] = round(need, 2)
            est.note(cell)
            doc["cells"].append(cell)
            print(f"cell ctx={ctx} c={conc} {preset}: {cell['status']}, TTFT p50 {cell['ttft_s']['p50']} s, "
                  f"ITL p50 {cell['itl_ms']['p50']} ms, per-stream {cell['decode_tok_s_per_stream']['p50']} tok/s, "
                  f"full batch {cell['decode_tok_s_full_batch']} tok/s, prefill (server) "
                  f"{cell['prefill_tok_s_server']['p50']} tok/s", flush=True)
            write_json(a.output, doc)
        doc["stats_final"] = get_stats(url, headers)
    if a.harness and "error" not in doc["harness"]:
        attach_harness(doc["cells"], doc["harness"])
    doc["wall_s"] = round(time.perf_counter() - t_start, 3)
    write_json(a.output, doc)
    return doc


# ---- command line ----------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    try:
        v = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None
    if any(x < 1 for x in v):
        raise argparse.ArgumentTypeError(f"{text!r}: values must be positive")
    return v


def _pairs(text: str) -> list[tuple[int, int]]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            c, n = part.split(":")
            out.append((int(c), int(n)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: expected CONTEXT:CONCURRENCY") from None
    return out


def _presets(text: str) -> list[str]:
    v = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in v if x not in PRESETS]
    if bad or not v:
        raise argparse.ArgumentTypeError(f"presets must be among {sorted(PRESETS)}, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="compiled model directory (default: the embedded model)")
    ap.add_argument("--url", default=None, help="attach to a running server instead of starting one")
    ap.add_argument("--tokenizer", default=None, help="tokenizer.json (default: the model directory's)")
    ap.add_argument("--serve-args", default="", help="extra `ninfer serve` flags, one shell-quoted string")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--contexts", type=_ints, default=[256, 512], help="prompt lengths in tokens")
    ap.add_argument("--concurrency", type=_ints, default=[1, 2], help="concurrent streams")
    ap.add_argument("--extra-cells", type=_pairs, default=[], help="CONTEXT:CONCURRENCY,... run after the grid "
                                                                   "(e.g. 524288:1)")
    ap.add_argument("--presets", type=_presets, default=["greedy"], help="greedy,qwen")
    ap.add_argument("--max-tokens", type=int, default=64, help="generated tokens per request (ignore_eos)")
    ap.add_argument("--waves", type=int, default=1, help="requests per cell = concurrency x waves")
    ap.add_argument("--shared-prefix", type=float, default=0.0,
                    help="fraction of each prompt shared by the requests of a context (a system message primed "
                         "into the prefix cache once): decode at long contexts without a full prefill per stream")
    ap.add_argument("--shared-prefix-min-context", type=int, default=0,
                    help="apply --shared-prefix only to contexts of at least this many tokens")
    ap.add_argument("--logprobs", action="store_true", help="ask for logprobs: exact tokens per chunk (costs time)")
    ap.add_argument("--thinking", choices=("on", "off"), default="off", help="chat_template_kwargs.enable_thinking")
    ap.add_argument("--budget-s", type=float, default=540.0, help="wall-clock budget of the whole run")
    ap.add_argument("--request-timeout-s", type=float, default=1800.0)
    ap.add_argument("--allow-preemption", action="store_true", help="run cells larger than the device KV")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--harness", action="store_true", help="kernel-harness figures for the same shapes first")
    ap.add_argument("--harness-steps", type=int, default=8)
    ap.add_argument("--harness-prefill-max", type=int, default=32768, help="longest harness prefill")
    ap.add_argument("--harness-share", type=float, default=0.3, help="share of --budget-s the harness may use")
    ap.add_argument("--harness-host-logits", action="store_true",
                    help="harness decode steps bring the [B, V] logits to the host (default: device argmax, only token "
                         "ids, as the engine with device sampling)")
    ap.add_argument("--no-rates", dest="rates", action="store_false",
                    help="skip the torch copy / matmul rates (measured when torch and a GPU are present)")
    ap.add_argument("--server-log", default=None, help="server output file (default: a temporary file)")
    ap.add_argument("-o", "--output", default=None, help="JSON result (rewritten after every cell)")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if not 0 <= a.shared_prefix < 1:
        raise SystemExit("serve_bench: --shared-prefix must be in [0, 1)")
    if a.max_tokens < 2 or a.waves < 1:
        raise SystemExit("serve_bench: --max-tokens must be >= 2 and --waves >= 1")
    return run_and_report("serve_bench", run, a)


if __name__ == "__main__":
    sys.exit(main())
