"""Overlapped decode on the GPU: same tokens as in-order decode, and what it buys, engine-level (no HTTP).

For --async-scheduling off, then on: opens the engine on MODEL_DIR, runs `concurrency` requests of random
prompts (greedy and seeded Qwen-preset rows, every other one with a stop id taken from the greedy reference,
so each mode batches the same rows at every step), and reports per mode: tokens identical to the off run,
KV audit, per-stream decode tok/s (first token to last), overlapped / discarded rows, and the engine's host
ms per decode step by phase (mean over the run, from /stats' sums). One JSON line per mode, then a verdict.

    python3 bench/overlap_gpu_check.py .gpu/serve --concurrency 1,8 --context 8192 --max-tokens 128 -o out.json
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time

import numpy as np

PHASES = ("loop", "schedule", "inputs", "launch", "read", "commit", "detok", "emit", "total")
QWEN = dict(temperature=0.7, top_p=0.95, top_k=20, presence_penalty=1.0)


def run_mode(eng, mode: str, concs: list[int], ctx: int, max_tokens: int, ref: dict) -> list[dict]:
    """One pass over the cells with overlap off or on (the engine's switch, flipped while it is idle); the
    off passes record the reference tokens in `ref`."""
    from ninfer_mlc.runtime.engine import Finished, GenRequest
    from ninfer_mlc.runtime.sampling import SamplingParams

    eng.overlap = mode == "on"
    out = []
    vocab = min(eng.runner.sample_vocab, 100_000)
    for conc in concs:
        rng = np.random.default_rng(conc)
        prompts = [rng.integers(1000, vocab, ctx).tolist() for _ in range(conc)]
        reqs = []
        for i, p in enumerate(prompts):
            stop = ref.get((conc, i), {}).get("stop_id") if i % 2 else None
            sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i, stop_token_ids=[] if stop is None else [stop],
                                **(QWEN if i % 4 >= 2 else {"temperature": 0.0}))
            reqs.append(GenRequest(p, sp))
        before = dict(eng.stats().host_step)
        c0 = eng.stats().counters
        hs = [eng.submit(r) for r in reqs]
        rows: list = [None] * len(hs)

        def consume(i, h):  # one reader per stream, as HTTP handlers are: arrival times are real
            ids, t_first, t_last, reason = [], None, None, None
            for ev in h.iter_sync(timeout=900):
                if isinstance(ev, Finished):
                    reason = ev.reason
                    break
                if ev.token_ids:
                    t_last = time.perf_counter()
                    t_first = t_first or t_last
                    ids += ev.token_ids
            rate = (len(ids) - 1) / (t_last - t_first) if t_first and t_last and t_last > t_first else None
            rows[i] = {"ids": ids, "reason": reason, "rate": rate}

        readers = [threading.Thread(target=consume, args=(i, h)) for i, h in enumerate(hs)]
        for t in readers:
            t.start()
        for t in readers:
            t.join()
        after, c1 = eng.stats().host_step, eng.stats().counters
        steps = max(1, after["steps"] - before["steps"])
        host = {p: round((after[f"{p}_sum_ms"] - before[f"{p}_sum_ms"]) / steps, 4) for p in PHASES}
        # the off passes: rows without a stop id must repeat exactly (else a mismatch below is the kernels' noise)
        repeat = [r["ids"] == ref[(conc, i)]["ids"] for i, r in enumerate(rows)
                  if mode == "off" and i % 2 == 0 and "ids" in ref.get((conc, i), {})]
        for i, r in enumerate(rows):
            if mode == "off" and len(r["ids"]) > 8:
                ref.setdefault((conc, i), {})["ids"] = r["ids"]
                ref[(conc, i)].setdefault("stop_id", r["ids"][len(r["ids"]) // 2])
        same = None if mode == "off" else all(r["ids"] == ref.get((conc, i), {}).get("ids") for i, r in enumerate(rows))
        rates = [r["rate"] for r in rows if r["rate"]]
        out.append({"mode": mode, "concurrency": conc, "context": ctx, "tokens_identical_to_off": same,
                    "off_repeats_itself": all(repeat) if repeat else None,
                    "audit": eng.audit(), "per_stream_tok_s_p50": round(float(np.median(rates)), 2) if rates else None,
                    "overlapped_rounds": c1.overlapped_decode_rounds - c0.overlapped_decode_rounds,
                    "discarded_rows": c1.discarded_decode_rows - c0.discarded_decode_rows,
                    "host_mean_ms_per_step": host, "host_p99_ms": {p: after.get(f"{p}_p99_ms") for p in PHASES},
                    "reasons": sorted({r["reason"] for r in rows})})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir")
    ap.add_argument("--concurrency", default="1,8")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("-o", "--output", default=None)
    a = ap.parse_args()
    from ninfer_mlc.runtime.assemble import open_engine
    from ninfer_mlc.runtime.config import EngineConfig

    concs = [int(x) for x in a.concurrency.split(",")]
    eng = open_engine(a.model_dir, EngineConfig(max_concurrency=max(concs), prefix_reuse=False,
                                                max_context=a.context + a.max_tokens + 64))
    ref: dict = {}
    try:
        # off runs twice: the first picks each odd row's stop id from its reference, the second is the reference
        run_mode(eng, "off", concs, a.context, a.max_tokens, ref)
        cells = run_mode(eng, "off", concs, a.context, a.max_tokens, ref)
        cells += run_mode(eng, "on", concs, a.context, a.max_tokens, ref)
    finally:
        eng.stop()
    ok = all(c["tokens_identical_to_off"] in (None, True) and not c["audit"] for c in cells)
    print("VERDICT", "ok" if ok else "MISMATCH", flush=True)
    if a.output:
        with open(a.output, "w") as f:
            json.dump({"cells": cells, "ok": ok}, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
