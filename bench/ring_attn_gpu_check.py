"""The DFlash drafter's windowed (ring) attention on the GPU: the CUDA kernel (compile/dflash/ring_attention.py)
against the dense relax path it replaces (model.py's _ring_mask + _ring_attention, DLight-scheduled as the drafter
had them) and a float64 reference, at the 27B drafter shape (bench/spec_forced.py QWEN38_DFLASH2: block 8, 32 q /
8 kv heads of 128, window 2048 -> R = 2056 ring slots, 4 ring layers), bf16.

  prep OUT [--arch sm_90]   (compiler machine, ~1 min) OUT/ring_attn.so: functions dense_{causal,full} and
                            fused_{causal,full} (q[n,32,128], ring[lanes,4,2,8,2056,128], pos[n], lanes[b], lo[b])
                            -> out[n,32,128], ring layer 1
  run OUT RESULT.json       (GPU machine, runtime-only TVM + torch)
      per batch b (1, 4) and layer kind: blocks at ~8k context (wrapped rings, one ring_lo inside the window, at b = 4
      a sequence younger than its ring): max relative error of fused and dense vs the float64 reference (pass:
      fused < 2e-2, i.e. bf16 output rounding) and of fused vs dense; GPU time per call (the sum of the call's
      kernel durations under the CUPTI profiler, 20 calls) with each kernel's share, and wall time per call (CUDA
      events over 50 back-to-back calls: the VM's host overhead included).
Prints one JSON line per case and PASS / FAIL; exit status 0 when every case passes.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_common as gc  # noqa: E402

SLOT = 1  # ring layer of the pool the functions read
N_LANES = 4
BATCHES = (1, 4)
STARTS = [8192 + 13, 8192 + 700, 1500, 4096 + 2]  # block starts; 1500 < R: slots past the context are stale
LO_OFFSETS = [0, 40, 0, 0]  # ring_lo = start - window + offset (40: the ring holds less than the window)


def drafter_cfg():
    from spec_forced import QWEN38_DFLASH2

    from ninfer_mlc.compile.dflash.config import load_drafter_config

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(QWEN38_DFLASH2))
        return load_drafter_config(Path(d))


def cmd_prep(a) -> int:

    from ninfer_mlc.compile.dflash.ring_attention import ring_plan
    from ninfer_mlc.compile.gpu_pipeline import build_cuda, last_report
    from ninfer_mlc.compile.kernels.cuda.emulate.ring import ring_module
    from ninfer_mlc.compile.targets import cuda_build_env, parse_target

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cfg = drafter_cfg()
    tgt = parse_target("cuda:" + a.arch).tvm_target()
    with tgt:
        mod = ring_module(cfg, SLOT, True, "bfloat16")
    with cuda_build_env(tgt):
        ex = build_cuda(mod, tgt)
    ex.export_library(str(out / "ring_attn.so"))
    meta = {"arch": a.arch, "config": cfg.to_dict(), "slot": SLOT,
            "plan": ring_plan(cfg.block_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                              cfg.ring_size), "dlight": last_report()}
    (out / "ring_attn.json").write_text(json.dumps(meta, indent=1))
    print(f"built {sorted(gv.name_hint for gv in mod.get_global_vars())} for {a.arch} in {time.time() - t0:.1f}s", flush=True)
    return 0


def _profile(torch, fn, reps: int) -> tuple[float, dict]:
    """(GPU microseconds of one call: the sum of its kernels' durations, {kernel: microseconds per call}), from
    `reps` calls under the CUPTI profiler."""
    from spec_forced import _profiled

    fn()
    torch.cuda.synchronize()
    ks = _profiled(lambda: [fn() for _ in range(reps)])
    per: dict = {}
    for s, e, name in sorted(ks):
        per[name] = per.get(name, 0.0) + (e - s) / reps
    return sum(per.values()), {k: round(v, 2) for k, v in per.items()}


def _wall(torch, fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps):
        fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3 / reps


def cmd_run(a) -> int:
    import torch

    from ninfer_mlc.compile.kernels.cuda.emulate.ring import ring_case, ring_reference
    from ninfer_mlc.contract.drafter import DrafterConfig
    from ninfer_mlc.runtime.tvm_loader import import_tvm, load_vm

    tvm = import_tvm("cuda")
    dev = tvm.cuda(0)
    out = Path(a.out)
    meta = json.loads((out / "ring_attn.json").read_text())
    cfg = DrafterConfig.from_dict(meta["config"])
    vm = load_vm(tvm, out / "ring_attn.so", dev)
    res = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "plan": meta["plan"], "cases": []}
    ok = True
    for b in BATCHES:
        case = ring_case(np.random.default_rng(b), cfg, STARTS[:b], LO_OFFSETS[:b], N_LANES)
        bf = {k: torch.from_numpy(v).cuda() for k, v in case.items()}
        for k in ("q", "pool"):
            bf[k] = bf[k].to(torch.bfloat16)
        rounded = dict(case, q=bf["q"].float().cpu().numpy(), pool=bf["pool"].float().cpu().numpy())
        args = [tvm.runtime.from_dlpack(bf[k]) for k in ("q", "pool", "pos", "lanes", "lo")]
        for kind in ("causal", "full"):
            ref = ring_reference(rounded, cfg, meta["slot"], kind == "causal")
            got = {}
            row = {"b": b, "layer": kind, "rows": int(case["q"].shape[0])}
            for path in ("fused", "dense"):
                fn = vm[f"{path}_{kind}"]
                o = torch.from_dlpack(fn(*args)).float().cpu().numpy()
                got[path] = o
                row[f"{path}_err_ref"] = float(np.abs(o - ref).max() / np.abs(ref).max()) if np.isfinite(o).all() \
                    else float("inf")
                row[f"{path}_wall_us"] = round(_wall(torch, lambda fn=fn: fn(*args), 50), 2)
                try:
                    gpu_us, row[f"{path}_kernels"] = _profile(torch, lambda fn=fn: fn(*args), 20)
                    row[f"{path}_gpu_us"] = round(gpu_us, 2)
                except Exception as e:  # noqa: BLE001 (no CUPTI: the wall time still says it)
                    row[f"{path}_gpu_us"], row["profile_error"] = None, repr(e)
            row["fused_vs_dense"] = float(np.abs(got["fused"] - got["dense"]).max() / np.abs(got["dense"]).max())
            row["pass"] = row["fused_err_ref"] < 2e-2
            ok &= row["pass"]
            res["cases"].append(row)
            print(json.dumps(row), flush=True)
            print(f"b={b} {kind}: fused {row['fused_gpu_us']} us GPU ({row['fused_wall_us']} us wall), dense "
                  f"{row['dense_gpu_us']} us GPU ({row['dense_wall_us']} us wall); err vs float64: fused "
                  f"{row['fused_err_ref']:.2e}, dense {row['dense_err_ref']:.2e} -> {'PASS' if row['pass'] else 'FAIL'}",
                  flush=True)
    gc.write_result(a.result, res)
    print("PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(gc.prep_run_main(__doc__, cmd_prep, cmd_run))
