"""Debug: one DFlash2 greedy request through the engine on the GPU with its device rounds traced (drafts, the host
walk over the same candidates, anchors, the verify's tokens). Not a benchmark.

  python3 bench/dflash_device_debug.py TARGET DRAFTER [--ctx 1024] [--gen 24] [--forced 5.4]
"""
from __future__ import annotations

import argparse
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("target", type=Path)
    ap.add_argument("drafter", type=Path)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--gen", type=int, default=24)
    ap.add_argument("--forced", type=float, default=5.4)
    a = ap.parse_args(argv)
    from ninfer_mlc.runtime.assemble import open_engine
    from ninfer_mlc.runtime.config import EngineConfig
    from ninfer_mlc.runtime.engine import Engine, GenRequest
    from ninfer_mlc.runtime.sampling import SamplingParams
    from ninfer_mlc.runtime.spec import dflash as D
    from ninfer_mlc.runtime.spec import dflash_runner as R
    from ninfer_mlc.runtime.spec.dflash_runner import attach_paged_pool

    cfg = EngineConfig(device="auto", max_concurrency=1, max_pending_requests=1, max_context=a.ctx + a.gen + 64,
                       kv_capacity=str(a.ctx + a.gen + 256), prefix_reuse=False, prefill_chunk=2048,
                       spec="dflash2", draft_tokens=7, draft_model=str(a.drafter))
    base = open_engine(a.target, replace(cfg, spec="mtp", draft_model=None, draft_tokens=3), start=False)
    runner, kv, tok = base.runner, base.kv, base.tok
    del base
    attach_paged_pool(runner, a.drafter)
    log = []
    run_walk, launch = R.DrafterRunner.run_walk, D.DFlashProposer.launch_device

    def walk(self, top_ids, top_vals, sel, anchors):
        out = run_walk(self, top_ids, top_vals, sel, anchors)
        ids, vals, h, anc = (self.target.read_host(x) for x in (top_ids, top_vals, sel, anchors))
        dev = self.target.read_host(out)
        sel_ = D.CandidateSelector(*self.codebooks(), self.cfg.selector_top_k)
        k, b = dev.shape
        host = [sel_.walk_greedy(ids[i * k:(i + 1) * k], vals[i * k:(i + 1) * k], h[i * k:(i + 1) * k], int(anc[i]))
                for i in range(b)]
        log.append(f"walk anchors {anc.tolist()} device {dev.T.tolist()} host {host} ids[0,:6] {ids[0, :6].tolist()} "
                   f"vals[0,:4] {vals[0, :4].tolist()} sel finite {bool(np.isfinite(h).all())}")
        print(log[-1], flush=True)
        return out

    def launch_dev(self, staged, argmax):
        d = launch(self, staged, argmax)
        print("launch_device drafts (read right away)", self.runner.read_host(d).T.tolist(), flush=True)
        return d

    R.DrafterRunner.run_walk, D.DFlashProposer.launch_device = walk, launch_dev
    eng = Engine(runner, kv, tok, replace(cfg, forced_acceptance=a.forced if a.forced > 0 else None), []).start()
    dec = eng.spec
    vad = dec._verify_accept_device

    def vad_(*args, **kw):
        res = vad(*args, **kw)
        for rid, r in res.items():
            print("round result", rid, r.tokens, "drafted", r.drafted, "accepted", r.accepted, flush=True)
        return res

    dec._verify_accept_device = vad_
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, runner.sample_vocab, a.ctx).tolist()
    try:
        h = eng.submit(GenRequest(prompt, SamplingParams(temperature=0, max_tokens=a.gen, ignore_eos=True)))
        evs = list(h.iter_sync(timeout=600))
        print("finished", evs[-1], flush=True)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    finally:
        eng.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
