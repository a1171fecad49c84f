"""DFlash2's candidate walk on the GPU (the drafter library's select_walk, compile/dflash/selector_walk.py) against
the host walk it replaces in greedy device rounds (runtime/spec/selector.py CandidateSelector.walk_greedy).

  python3 bench/walk_gpu_check.py DRAFTER_DIR [--device cuda] [-o RESULT.json]

Random candidates (blocks of k rows, S top-logprob slots, ties in value at the top-k boundary, empty slots) and
selector rows, the drafter's own codebooks (random weights drawn on the device when the artifact has none); every
block's drafts must equal the host walk's, and the call's time is printed (it sits between the drafter's block
forward and the verify in every DFlash2 device round). Exit status 0 when every block matches.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def run(drafter: Path, device: str, blocks: int, k: int, seed: int) -> dict:
    from ninfer_mlc.contract.drafter import DrafterConfig
    from ninfer_mlc.contract.sampler_abi import top_logprob_slots
    from ninfer_mlc.runtime.executor.weights import load_params
    from ninfer_mlc.runtime.spec.dflash_runner import read_drafter_manifest
    from ninfer_mlc.runtime.spec.selector import CandidateSelector
    from ninfer_mlc.runtime.tvm_loader import device_for, import_tvm, load_vm

    tvm = import_tvm(device)
    dev = device_for(tvm, device)
    m = read_drafter_manifest(drafter)
    cfg = DrafterConfig.from_dict(m.config)
    vm = load_vm(tvm, drafter / m.library, dev)
    params, _, random_weights = load_params(m, drafter, dev, tvm)
    names = [n for n, _, _ in m.params]
    books = [params[names.index(f"candidate_selector.{x}_codebook.weight")].numpy() for x in ("predecessor", "successor")]
    sel = CandidateSelector(*books, cfg.selector_top_k)
    V, S, R = cfg.vocab_size, top_logprob_slots(cfg.vocab_size), cfg.selector_rank
    rng = np.random.default_rng(seed)
    n = blocks * k
    ids = np.stack([rng.choice(V, S, replace=False) for _ in range(n)]).astype(np.int32)
    vals = (rng.normal(size=(n, S)) - 8.0).astype(np.float32)  # logprob-like
    order = np.argsort(-vals, axis=1)
    top_k = cfg.selector_top_k
    for r in range(n):  # a tie across the top-k boundary
        vals[r, order[r, top_k]] = vals[r, order[r, top_k - 1]]
    ids[::5, -2:] = -1
    hidden = rng.normal(size=(n, R)).astype(np.float32)
    anchors = rng.integers(0, V, blocks).astype(np.int32)
    t = lambda a: tvm.runtime.tensor(a, dev)  # noqa: E731
    args = [t(ids), t(vals), t(hidden), t(anchors)]
    fn = vm["select_walk"]
    out = fn(*args, params).numpy().reshape(k, blocks)
    mism = 0
    for i in range(blocks):
        rows = slice(i * k, (i + 1) * k)
        mism += out[:, i].tolist() != sel.walk_greedy(ids[rows], vals[rows], hidden[rows], int(anchors[i]))
    reps = 20
    dev.sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn(*args, params)
    dev.sync()
    ms = (time.perf_counter() - t0) / reps * 1e3
    res = {"drafter": str(drafter), "device": device, "random_weights": random_weights, "blocks": blocks, "k": k,
           "slots": S, "top_k": top_k, "rank": R, "mismatched_blocks": mism, "ms_per_call": round(ms, 4),
           "pass": mism == 0}
    print(f"select_walk {blocks} blocks x {k} rows: {mism} of {blocks} blocks differ from the host walk; "
          f"{ms:.3f} ms per call -> {'PASS' if mism == 0 else 'FAIL'}", flush=True)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("drafter", type=Path)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-o", "--output", default=None)
    a = ap.parse_args(argv)
    res = [run(a.drafter, a.device, b, a.k, a.seed) for b in sorted({1, a.blocks})]
    if a.output:
        Path(a.output).write_text(json.dumps(res, indent=1))
    return 0 if all(r["pass"] for r in res) else 1


if __name__ == "__main__":
    sys.exit(main())
