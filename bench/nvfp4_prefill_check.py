"""NVFP4 prefill projections on sm_90: the dequant + wgmma GEMM of NVFP4Linear, old vs new vs bf16 weights.

  prep OUT            (here, nvcc + stub libcuda) OUT/nvfp4.so + OUT/nvfp4.json, for the 27B projection shapes
                      (qkv, qkv_z none, o_proj, down residual, gate_up silu_mul) and an odd one: the tensor-expression
                      dequant as the relax pipeline schedules it (DLight, "old"), the hand-written copy-rate
                      dequant (compile/kernels/cuda/dequant_nvfp4.py, "new") and the prefill GEMM of the kernel
                      set (compile/kernels/cuda/gemm_sm90.py, the model's epilogue per projection)
  run OUT RESULT.json (GPU machine, runtime-only TVM + torch) per shape: both dequants bit for bit against a
                      torch decode of the codes (float8_e4m3fn scales), the GEMM over the new weights against
                      torch; then at 2048 and 8192 rows the times of gemm(bf16 weights), old dequant + gemm,
                      new dequant + gemm, the dequants alone (GB/s of codes read + weights written, next to the
                      device copy rate), and the ratio bf16 / new (issue 15's target: >= 0.9); last, the
                      sums over every projection call of one 27B forward (bf16 / old / new ms and ratios)
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import gpu_common as gc

ROOT = Path(__file__).resolve().parent.parent
# name -> (K, O, epilogue of the model's prefill call, calls per 27B forward (0: not timed)): attention qkv_proj
# (16 layers), GDN in_proj_qkv_z (48), o_proj / out_proj (6144 -> 5120 in all 64), the MLP's gate_up and down
SHAPES = {
    "qkv": (5120, 14336, "none", 16),
    "qkv_z": (5120, 16384, "none", 48),
    "o_proj": (6144, 5120, "residual", 64),
    "gate_up": (5120, 34816, "silu_mul", 64),
    "down": (17408, 5120, "residual", 64),
    "odd": (48, 40, "none", 0),  # K % 32 != 0, items not a multiple of a block
}
ROWS = (2048, 8192)


def cmd_prep(a) -> int:
    sys.path.insert(0, str(ROOT.parent))
    import tvm
    from tvm import te

    from ninfer_mlc.compile.gpu_pipeline import NinferDLight, schedule_for
    from ninfer_mlc.compile.kernels.cuda.dequant_nvfp4 import dequant_nvfp4
    from ninfer_mlc.compile.kernels.cuda.registry import kernel_set
    from ninfer_mlc.compile.kernels.dequant import dequant_compute
    from ninfer_mlc.compile.targets import cuda_build_env, parse_target

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tgt = parse_target("cuda:" + a.arch).tvm_target()
    funcs, meta, report = {}, {}, {}
    with cuda_build_env(tgt):
        gemm = kernel_set(arch=a.arch).gemm
        for sname, (k, o, epi, calls) in SHAPES.items():
            c = te.placeholder((o, k // 2), "uint8", name="w")
            s = te.placeholder((o, k // 16), "uint8", name="ws")
            g = te.placeholder((o,), "float32", name="ws2")
            old = te.create_prim_func([c, s, g, dequant_compute(c, s, g, o, k, "bfloat16")])
            with tgt:  # the relax pipeline's DLight pass, as a build schedules the tensor-expression dequant
                mod = NinferDLight(schedule_for(tgt), report)(tvm.IRModule({f"old_{sname}": old}))
            funcs[f"old_{sname}"] = mod[f"old_{sname}"].with_attr("global_symbol", f"old_{sname}")
            funcs[f"new_{sname}"] = dequant_nvfp4(k, o, "bfloat16").with_attr("global_symbol", f"new_{sname}")
            funcs[f"gemm_{sname}"] = gemm(k, o, "bfloat16", "bfloat16", epi).with_attr("global_symbol",
                                                                                        f"gemm_{sname}")
            meta[sname] = {"k": k, "o": o, "epilogue": epi, "calls": calls, "old_rule": report.get(f"old_{sname}")}
        t = time.time()
        ex = tvm.compile(tvm.IRModule(funcs), target=tgt)
        print(f"built {len(funcs)} functions in {time.time() - t:.1f}s; old dequant rules: "
              f"{sorted({m['old_rule'] for m in meta.values()})}", flush=True)
    ex.export_library(str(out / "nvfp4.so"))
    (out / "nvfp4.json").write_text(json.dumps(meta, indent=1))
    return 0


def _weights(torch, o: int, k: int, gen):
    """Random codes (every nibble), E4M3 block scales of every finite magnitude, row scales ~K^-0.5 / typical."""
    codes = torch.randint(0, 256, (o, k // 2), device="cuda", dtype=torch.uint8, generator=gen)
    scales = torch.randint(0, 0x7F, (o, k // 16), device="cuda", dtype=torch.uint8, generator=gen)  # no NaN 0x7F
    g = (k ** -0.5 / 3.0 / 40.0 * (0.7 + 0.6 * torch.rand((o,), device="cuda", generator=gen))).float()
    return codes, scales, g


def _dequant_ref(torch, codes, scales, g):
    """bf16(e2m1 * e4m3 * g) in torch: the exact fp32 product, one fp32 rounding for * g, round to bf16."""
    e2m1 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], device="cuda")
    lo, hi = e2m1[(codes & 15).long()], e2m1[(codes >> 4).long()]
    v = torch.stack([lo, hi], dim=-1).reshape(codes.shape[0], -1)  # element 2i in the low nibble
    s = scales.view(torch.float8_e4m3fn).float().repeat_interleave(16, dim=1)
    return ((v * s) * g[:, None]).bfloat16()


def cmd_run(a) -> int:
    import torch

    from ninfer_mlc.runtime.tvm_loader import import_tvm

    tvm = import_tvm("cuda")
    out = Path(a.out)
    meta = json.loads((out / "nvfp4.json").read_text())
    lib = tvm.runtime.load_module(str(out / "nvfp4.so"))
    bw = gc.copy_bw(torch)
    res = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "copy_GBps": bw / 1e9, "cases": []}
    gen = torch.Generator(device="cuda").manual_seed(0)
    td = tvm.runtime.from_dlpack
    for sname, mt in meta.items():
        k, o, epi = mt["k"], mt["o"], mt["epilogue"]
        oo = o // 2 if epi == "silu_mul" else o
        codes, scales, g = _weights(torch, o, k, gen)
        ref_w = _dequant_ref(torch, codes, scales, g)
        w_old = torch.full((o, k), float("nan"), device="cuda", dtype=torch.bfloat16)
        w_new = torch.full((o, k), float("nan"), device="cuda", dtype=torch.bfloat16)
        qargs = [td(codes), td(scales), td(g)]
        lib[f"old_{sname}"](*qargs, td(w_old))
        lib[f"new_{sname}"](*qargs, td(w_new))
        torch.cuda.synchronize()
        bits = lambda t: t.view(torch.int16)  # noqa: E731
        row = {"shape": sname, "k": k, "o": o, "old_rule": mt["old_rule"],
               "old_bitexact": bool(torch.equal(bits(w_old), bits(ref_w))),
               "new_bitexact": bool(torch.equal(bits(w_new), bits(ref_w))),
               "new_vs_old_mismatches": int((bits(w_new) != bits(w_old)).sum().item())}
        for m in (ROWS if mt["calls"] else (1, 40, 300)):
            x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16, generator=gen)
            r = torch.randn((m, o), device="cuda", dtype=torch.bfloat16, generator=gen) if epi == "residual" else None
            y = torch.full((m, oo), float("nan"), device="cuda", dtype=torch.bfloat16)
            y32 = x.float() @ w_new.float().T
            if epi == "silu_mul":
                gt, up = y32.bfloat16().float().split(oo, dim=1)
                ref = torch.nn.functional.silu(gt) * up
            elif epi == "residual":
                ref = r.float() + y32.bfloat16().float()
            else:
                ref = y32
            gargs = [td(x), td(w_new)] + ([td(r)] if r is not None else []) + [td(y)]
            f_gemm, f_old, f_new = lib[f"gemm_{sname}"], lib[f"old_{sname}"], lib[f"new_{sname}"]
            f_gemm(*gargs)
            torch.cuda.synchronize()
            case = dict(row, m=m, gemm_rel_err=float(((y.float() - ref).abs().max() / ref.abs().max()).item()))
            if mt["calls"]:
                wb = td(w_new)
                t_bf16 = gc.cuda_median_s(torch, lambda: f_gemm(*gargs))
                t_dq_old = gc.cuda_median_s(torch, lambda: f_old(*qargs, wb))
                t_dq_new = gc.cuda_median_s(torch, lambda: f_new(*qargs, wb))
                t_old = gc.cuda_median_s(torch, lambda: (f_old(*qargs, wb), f_gemm(*gargs)))
                t_new = gc.cuda_median_s(torch, lambda: (f_new(*qargs, wb), f_gemm(*gargs)))
                moved = o * k // 2 + o * k // 16 + 4 * o + 2 * o * k
                case.update(ms_bf16=t_bf16 * 1e3, ms_old=t_old * 1e3, ms_new=t_new * 1e3,
                            ms_dequant_old=t_dq_old * 1e3, ms_dequant_new=t_dq_new * 1e3,
                            dequant_old_GBps=moved / t_dq_old / 1e9, dequant_new_GBps=moved / t_dq_new / 1e9,
                            tflops_bf16=2 * m * o * k / t_bf16 / 1e12, ratio_old=t_bf16 / t_old,
                            ratio_new=t_bf16 / t_new)
            gc.record_row(res, case, a.result)
            del x, r, y, y32, ref
        del codes, scales, g, ref_w, w_old, w_new
        torch.cuda.empty_cache()
    for m in ROWS:  # every projection of one 27B forward over m rows (lm_head and the rest excluded)
        rows = [c for c in res["cases"] if c["m"] == m and "ms_bf16" in c]
        tot = {v: sum(c[f"ms_{v}"] * meta[c["shape"]]["calls"] for c in rows) for v in ("bf16", "old", "new")}
        res[f"forward_{m}"] = dict(tot, ratio_old=tot["bf16"] / tot["old"], ratio_new=tot["bf16"] / tot["new"])
    gc.write_result(a.result, res)
    print(f"copy {bw / 1e9:.0f} GB/s")
    print(f"{'shape':8s} {'rows':>5s} {'bitexact o/n':>12s} {'gemm err':>9s} {'bf16 ms':>8s} {'old ms':>8s} "
          f"{'new ms':>8s} {'dq old GB/s':>11s} {'dq new GB/s':>11s} {'old/bf16':>8s} {'new/bf16':>8s}")
    for c in res["cases"]:
        print(f"{c['shape']:8s} {c['m']:5d} {str(c['old_bitexact'])[0]}/{str(c['new_bitexact'])[0]:>10s} "
              f"{c['gemm_rel_err']:9.2e} {c.get('ms_bf16', float('nan')):8.3f} {c.get('ms_old', float('nan')):8.3f} "
              f"{c.get('ms_new', float('nan')):8.3f} {c.get('dequant_old_GBps', float('nan')):11.0f} "
              f"{c.get('dequant_new_GBps', float('nan')):11.0f} {c.get('ratio_old', float('nan')):8.2f} "
              f"{c.get('ratio_new', float('nan')):8.2f}")
    for m in ROWS:
        f = res[f"forward_{m}"]
        print(f"27B forward projections at {m} rows: bf16 {f['bf16']:.1f} ms, old {f['old']:.1f} ms "
              f"({f['ratio_old']:.2f}), new {f['new']:.1f} ms ({f['ratio_new']:.2f} of the bf16 rate)")
    ok = all(c["new_bitexact"] and c["gemm_rel_err"] < 1e-2 for c in res["cases"])
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def main(argv=None) -> int:
    return gc.prep_run_main(__doc__, cmd_prep, cmd_run, argv)


if __name__ == "__main__":
    sys.exit(main())
