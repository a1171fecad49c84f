"""A speculative verify against plain decode on the GPU (the row-by-row GDN kernel verify and gdn_replay take on CUDA,
compile/kernels/cuda/gdn.py short_delta_rule): two sequences with the same prompt; one decodes T tokens one at a time,
the other verifies [pending, T-1 more] in one call (and a third replays the verify's rows from the pre-verify state).
Prints each verify row's logits against the decode step at that position (relative error, argmax) and the GDN state
after the verify against the decode's; passes when the replay reproduces the verify's state exactly and the verify
rows' argmax agrees with decode on >= 3/4 of the rows. (Random bf16 weights amplify any difference between the decode
kernels and the verify's multi-row kernels: on the H200's 27B artifact both the chunked and the row-by-row GDN verify
differ from decode by 5-12 % of the logits' range with the same argmax flips, BENCHMARKS.md run 9, so the
check is a comparison between builds, not a tolerance.)

  python3 bench/verify_gpu_check.py ARTIFACT [--ctx 1024] [--rows 8] [-o RESULT.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", type=Path)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("-o", "--output", default=None)
    a = ap.parse_args(argv)
    from ninfer_mlc.runtime.harness import Harness

    h = Harness(a.artifact, num_slots=4, kv_capacity_tokens=4 * (a.ctx + 64))
    r = h.runner
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, r.sample_vocab, a.ctx).tolist()
    dec, ver = h.new_seq(), h.new_seq()
    chunk = int(r.manifest.extras.get("max_prefill_chunk") or a.ctx) // 2  # both sequences in one call
    for lo in range(0, a.ctx, chunk):
        lg = h.prefill([(dec, prompt[lo: lo + chunk]), (ver, prompt[lo: lo + chunk])])
    toks = [int(np.argmax(lg[0]))]
    dec_logits = []
    for _ in range(a.rows):
        x = h.decode([dec], [toks[-1]])[0]
        dec_logits.append(x)
        toks.append(int(np.argmax(x)))
    snap = [r.tvm.runtime.empty(tuple(v.shape), str(v.dtype), r.dev) for v in r.state_views(ver.slot)]
    for v, c in zip(r.state_views(ver.slot), snap):  # the verify sequence's pre-verify conv + SSM state
        v.copyto(c)
    logits, _ = h.verify([(ver, toks[: a.rows])])
    vlog = np.asarray(logits[0])
    row_err = [rel(vlog[i], dec_logits[i]) for i in range(a.rows)]
    argmax_same = [int(np.argmax(vlog[i])) == int(np.argmax(dec_logits[i])) for i in range(a.rows)]
    s_dec, s_ver = r.state_views(dec.slot)[1].numpy(), r.state_views(ver.slot)[1].numpy()
    res = {"artifact": str(a.artifact), "ctx": a.ctx, "rows": a.rows, "row_rel_err": row_err, "argmax_same": argmax_same,
           "state_rel_err_verify_vs_decode": rel(s_ver, s_dec)}
    if r.has_gdn_replay and r.verify_gdn_rows is not None:  # replay all rows from the pre-verify state
        for c, v in zip(snap, r.state_views(ver.slot)):
            c.copyto(v)
        r.replay_gdn(r.verify_gdn_rows, [(ver, 0, a.rows)])
        r.sync()
        res["state_rel_err_replay_vs_verify"] = rel(r.state_views(ver.slot)[1].numpy(), s_ver)
    ok = 4 * sum(argmax_same) >= 3 * a.rows and res.get("state_rel_err_replay_vs_verify", 0.0) < 1e-6
    res["pass"] = ok
    print(json.dumps(res), flush=True)
    print(f"verify vs decode: max row rel err {max(row_err):.2e}, argmax {sum(argmax_same)}/{a.rows}, state "
          f"{res['state_rel_err_verify_vs_decode']:.2e}; replay vs verify state "
          f"{res.get('state_rel_err_replay_vs_verify', float('nan')):.2e} -> {'PASS' if ok else 'FAIL'}", flush=True)
    if a.output:
        Path(a.output).write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
