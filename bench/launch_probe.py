"""What a decode step's CUDA-graph replay costs the host, and what the device does when replays queue up.

For each artifact (random weights drawn on the device), batch 1 at CONTEXT tokens, after warm-up (eager call,
capture):
  synced_ms      stage + upload the inputs, replay the decode graph, wait (as the harness and the engine do
                 when the next step needs this one's ids: the device drains every step)
  upload_ms      host time of staging + uploading the step's inputs (a synchronous host->device copy)
  launch_ms      host time of cuGraphLaunch alone, issued with the device idle
  pipelined_ms   the same recorded step replayed N times back to back, then one wait: the device's time per step
                 when the next replay is already queued (an upper bound on what hiding the host's part can give)

    python bench/launch_probe.py ART [ART ...] --context 8192 --steps 20 -o probe.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def probe(art: str, context: int, steps: int) -> dict:
    from ninfer_mlc.runtime.harness import Harness

    h = Harness(art, kv_capacity_tokens=context + 4 * steps + 256, num_slots=2, max_batch=1, verify="none")
    r = h.runner
    g = r.decode_graphs
    if g is None:
        return {"artifact": Path(art).name, "error": "no CUDA graphs (not a CUDA artifact?)"}
    s = h.new_seq()
    h.reserve(s, context + 4 * steps + 8)
    h.kv.advance(s, context - 1)
    for _ in range(3):  # eager, capture, replay
        r.decode([s], [1], on_device=True)
    r.dev.sync()
    entry = next(reversed(g._graphs.values()))  # the step's graph (the one key captured)

    t_sync, t_up = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        r.decode([s], [1], on_device=True, wait=False)
        r.dev.sync()
        t_sync.append(time.perf_counter() - t0)
        t_up.append(r.last_inputs_s)
    t_launch = []
    for _ in range(steps):
        r.dev.sync()
        t0 = time.perf_counter()
        g._launch(entry, wait=False)
        t_launch.append(time.perf_counter() - t0)
    g.drv.call("cuStreamSynchronize", g.stream)
    t0 = time.perf_counter()
    for _ in range(steps):
        g._launch(entry, wait=False)
    g.drv.call("cuStreamSynchronize", g.stream)
    pipelined = (time.perf_counter() - t0) / steps

    def ms(xs):
        xs = sorted(xs)
        return round(1e3 * xs[len(xs) // 2], 4)

    return {"artifact": Path(art).name, "context": context, "graph_nodes": entry.nodes,
            "synced_ms": ms(t_sync), "upload_ms": ms(t_up), "launch_ms": ms(t_launch),
            "pipelined_ms": round(1e3 * pipelined, 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("artifacts", nargs="+")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("-o", "--output", default=None)
    a = ap.parse_args(argv)
    rows = []
    for art in a.artifacts:
        try:
            row = probe(art, a.context, a.steps)
        except Exception as e:  # noqa: BLE001 - report and go on with the next artifact
            row = {"artifact": Path(art).name, "error": repr(e)[:500]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.output:
        Path(a.output).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
