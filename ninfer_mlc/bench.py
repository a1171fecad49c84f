"""`ninfer bench`: decode and prefill throughput of a compiled artifact, written as JSON.

Measures the executor directly through the harness (no scheduler, no HTTP, no sampling): decode tok/s per batch size at a given
context, prefill tok/s for one long chunked prompt, and the bytes a decode step must move
(weights + KV read + state read/write) so the figure can be set against a bandwidth floor.
"""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import numpy as np


def _decode_bytes(runner, batch: int, context: int) -> int:
    kv_per_token = runner.page_bytes / runner.page_size
    state = runner.conv_slot_bytes + runner.ssm_slot_bytes
    return int(runner.weights_bytes + batch * (context * kv_per_token + 2 * state))


def run_bench(art_dir: str | Path, batches=(1, 2, 4, 8), context: int = 512, prefill_tokens: int = 1024,
              prefill_chunk: int = 512, steps: int = 16, device: str = "auto") -> dict:
    from .runtime.harness import Harness

    max_b = max(batches)
    cap = max_b * (context + steps + 64) + prefill_tokens + 128
    runner = Harness(art_dir, device=device, kv_capacity_tokens=cap, num_slots=max_b + 1, max_batch=max_b)
    rng = np.random.default_rng(0)
    vocab = runner.vocab_size
    out = {"artifact": str(art_dir), "target": runner.manifest.target, "dtype": runner.manifest.dtype,
           "host": platform.node(), "date": time.strftime("%Y-%m-%d"), "context": context,
           "weights_bytes": runner.weights_bytes, "decode": [], "prefill": {}}

    seqs = []
    for _ in range(max_b):  # fill contexts once, reuse them for every batch size
        s = runner.new_seq()
        for c0 in range(0, context, prefill_chunk):
            runner.prefill([(s, rng.integers(0, vocab, min(prefill_chunk, context - c0)).tolist())])
        seqs.append(s)
    for b in batches:
        group = seqs[:b]
        lengths = [s.length for s in group]
        runner.decode(group, rng.integers(0, vocab, b).tolist())  # warm-up
        t0 = time.perf_counter()
        for _ in range(steps):
            runner.decode(group, rng.integers(0, vocab, b).tolist())
        dt = (time.perf_counter() - t0) / steps
        for s, n in zip(group, lengths):  # rewind: keeps every batch at the same context
            s.length = n
        out["decode"].append({"batch": b, "step_ms": round(dt * 1000, 3), "tok_per_s": round(b / dt, 2),
                              "bytes_per_step": _decode_bytes(runner, b, context)})
    for s in seqs:
        runner.free_seq(s)

    s = runner.new_seq()
    toks = rng.integers(0, vocab, prefill_tokens).tolist()
    t0 = time.perf_counter()
    for c0 in range(0, prefill_tokens, prefill_chunk):
        runner.prefill([(s, toks[c0:c0 + prefill_chunk])])
    dt = time.perf_counter() - t0
    runner.free_seq(s)
    out["prefill"] = {"tokens": prefill_tokens, "chunk": prefill_chunk, "seconds": round(dt, 4),
                      "tok_per_s": round(prefill_tokens / dt, 2)}
    return out


def add_bench_args(p) -> None:
    from .cli_support import add_model_arg, add_model_compile_flags, int_at_least

    add_model_arg(p, default_text="the embedded tiny model")
    p.add_argument("--batch", default="1,2,4,8", help="comma-separated decode batch sizes (default: %(default)s)")
    p.add_argument("--context", type=int_at_least(1), default=512,
                   help="context tokens each decoding sequence holds (default: %(default)s)")
    p.add_argument("--prefill-tokens", type=int_at_least(1), default=1024,
                   help="length of the prompt whose prefill is timed (default: %(default)s)")
    p.add_argument("--prefill-chunk", type=int_at_least(1), default=512,
                   help="prompt tokens per prefill call (default: %(default)s)")
    p.add_argument("--steps", type=int_at_least(1), default=16,
                   help="timed decode steps per batch size (default: %(default)s)")
    p.add_argument("-o", "--output", default=None, help="also write the JSON to this file (it always goes to stdout)")
    add_model_compile_flags(p)


def batch_sizes(text: str) -> list[int]:
    from .config import CLIError

    try:
        batches = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CLIError(f"--batch {text!r} must be comma-separated integers") from None
    if not batches or min(batches) < 1:
        raise CLIError(f"--batch {text!r} needs positive sizes")
    return batches


def main_bench(args, art_dir: str | Path) -> int:
    res = run_bench(art_dir, batch_sizes(args.batch), args.context, args.prefill_tokens, args.prefill_chunk, args.steps)
    text = json.dumps(res, indent=1)
    if args.output:
        Path(args.output).write_text(text)
    print(text)
    return 0
