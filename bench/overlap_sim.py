"""The engine's host time against a simulated device step, through HTTP, on the CPU.

Why: on the GPU a decode step is ~15 ms (27B bf16) and every host millisecond the engine does not hide
behind it lowers the per-stream rate below the kernel harness's. This runs the real engine, server and
streaming clients on the embedded tiny model, but replaces the forward with a simulated device: the
decode call stages and uploads its inputs as usual and returns fixed logits at once, and reading the
step's sampled ids waits until `--step-ms` after the launch (a sleep: the GIL is free meanwhile, as
while a GPU computes). With `--async-scheduling on` the commit of step N (detokenizing, stop strings,
events, SSE) runs inside step N+1's simulated device time; off, it adds to every step.

Prints one line per (mode, concurrency): ITL p50/p99, per-stream tok/s as a share of 1000 / step-ms (the
harness rate), and the engine's host ms per decode step by phase (/stats host_step), and writes -o JSON.

    .venv/bin/python bench/overlap_sim.py --step-ms 15 --concurrency 1,8 --max-tokens 256
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_common import decode_rate, inter_token_latencies, run_threads, stream_chat, summarize, write_json  # noqa: E402

PHASES = ("loop", "schedule", "inputs", "launch", "read", "commit", "detok", "emit", "total")


class SimulatedDevice:
    """Replace the decode forward with fixed logits ready `step_s` after the launch; the device sampler's
    collect waits for that moment (the host read of a GPU step's ids)."""

    def __init__(self, eng, step_s: float):
        runner, ds = eng.runner, eng.device_sampler
        assert ds is not None, "run with --device-sampling on"
        self.step_s, self.ready_at = step_s, 0.0
        rng = np.random.default_rng(0)
        self._logits = {b: runner.tvm.runtime.tensor(rng.standard_normal((b, runner.vocab_size), np.float32) * 3,
                                                     runner.dev)
                        for b in range(1, eng.cfg.max_concurrency + 1)}
        self._ready: dict[int, float] = {}

        def decode(seqs, tokens, on_device=False, wait=True):
            t0 = time.perf_counter()
            runner._check_room(seqs, [1] * len(seqs))
            runner.inputs.decode(seqs, tokens, None)  # the real staging and uploads
            runner.last_inputs_s = time.perf_counter() - t0
            self.ready_at = time.perf_counter() + self.step_s
            out = self._logits[len(seqs)]
            return out if on_device else runner.host_logits(out)

        start, collect = ds.start, ds.collect

        def start_timed(logits, draw):
            start(logits, draw)
            self._ready[id(draw)] = self.ready_at
            return draw

        def collect_waiting(draw):
            left = self._ready.pop(id(draw), 0.0) - time.perf_counter()
            if left > 0:
                time.sleep(left)
            return collect(draw)

        runner.decode, ds.start, ds.collect = decode, start_timed, collect_waiting


def run_cell(url: str, model: str, conc: int, max_tokens: int, seed: int) -> list:
    bodies = [{"model": model, "messages": [{"role": "user", "content": f"write a story number {seed + i}"}],
               "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.7, "top_p": 0.95, "seed": seed + i}
              for i in range(conc)]
    recs: list = [None] * conc

    def worker(i):
        return lambda: recs.__setitem__(i, stream_chat(url, bodies[i], timeout=600))

    run_threads([worker(i) for i in range(conc)])
    return recs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--step-ms", type=float, default=15.0, help="simulated device time of one decode step")
    ap.add_argument("--concurrency", default="1,4", help="streams per cell, comma-separated")
    ap.add_argument("--modes", default="off,on", help="--async-scheduling values to compare")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--switch-interval-ms", type=float, default=None,
                    help="sys.setswitchinterval for the run (how long a thread waiting for the GIL waits at most)")
    ap.add_argument("-o", "--output", default=None)
    a = ap.parse_args()
    if a.switch_interval_ms is not None:
        sys.setswitchinterval(a.switch_interval_ms / 1e3)
    import argparse as _ap

    from ninfer_mlc.paths import default_model_dir
    from ninfer_mlc.runtime.assemble import open_engine
    from ninfer_mlc.runtime.config import EngineConfig
    from ninfer_mlc.server.app import ServerThread, create_app, load_state
    from ninfer_mlc.server.options import add_serve_args

    concs = [int(x) for x in a.concurrency.split(",")]
    doc: dict = {"step_ms": a.step_ms, "max_tokens": a.max_tokens, "switch_interval_ms": sys.getswitchinterval() * 1e3,
                 "cells": []}
    for mode in a.modes.split(","):
        eng = open_engine(default_model_dir(), EngineConfig(max_concurrency=max(concs), prefix_reuse=False,
                                                            device_sampling="on", async_scheduling=mode))
        SimulatedDevice(eng, a.step_ms / 1e3)
        p = _ap.ArgumentParser()
        add_serve_args(p)
        state = load_state(p.parse_args([]), engine=eng)
        srv = ServerThread(create_app(state)).start()
        try:
            run_cell(srv.url, state.config.model_id, 1, 8, 0)  # warm-up
            for conc in concs:
                before = dict(eng.stats().host_step)
                recs = [r for r in run_cell(srv.url, state.config.model_id, conc, a.max_tokens, 100 * conc) if r is not None and r.ok]
                after = eng.stats().host_step
                steps = after["steps"] - before["steps"]
                host = {ph: round((after[f"{ph}_sum_ms"] - before[f"{ph}_sum_ms"]) / max(1, steps), 4) for ph in PHASES}
                itl = summarize([x for r in recs for x in inter_token_latencies(r)], 1e3)
                rate = summarize([decode_rate(r) for r in recs if decode_rate(r) is not None], nd=2)
                share = round(rate["p50"] * a.step_ms / 1e3, 4) if rate.get("p50") else None
                cell = {"mode": mode, "concurrency": conc, "requests_ok": len(recs), "itl_ms": itl,
                        "decode_tok_s_per_stream": rate, "share_of_step_rate": share,
                        "host_mean_ms_per_step": host, "host_p99_ms": {ph: after.get(f"{ph}_p99_ms") for ph in PHASES}}
                doc["cells"].append(cell)
                print(f"async {mode} c={conc}: ITL p50 {itl.get('p50')} p99 {itl.get('p99')} ms, per-stream "
                      f"{rate.get('p50')} tok/s = {share} of 1000/step, host ms/step mean {host}", flush=True)
                write_json(a.output, doc)
        finally:
            srv.stop()
            eng.stop()
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "overlap-sim"
    sys.exit(main())
