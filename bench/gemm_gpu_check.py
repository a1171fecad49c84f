"""Prefill GEMM variants on the GPU: correctness vs torch and TFLOP/s per variant.

  prep OUT            (here, nvcc + stub libcuda) OUT/gemm.so + OUT/gemm.json: y = cast(x @ W^T) bf16,
                      fp32 accumulation, dynamic row count, for the 27B projection shapes: DLight's WMMA
                      schedule (TensorCoreMatmul), the TiledTensorCoreMatmul configs, and the sm_90a
                      wgmma kernel (compile/kernels/cuda/gemm_sm90.py) per (bn, stages, group_m), plus its
                      fused epilogues (gate_up silu_mul, down + residual) and odd shapes (K, O not
                      multiples of the tiles; rows not a multiple of 128, and few rows = the GEMV launch)
  run OUT RESULT.json (GPU machine, runtime-only TVM + torch) max relative error vs torch and the rate
                      of each variant at 2048 and 8192 rows, next to torch's (cuBLAS) rate

The chosen config goes into schedules/cuda_<arch>.json ("tensor_core", "kernels.gemm").
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import gpu_common as gc

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {"qkv": (14336, 5120), "gate_up": (34816, 5120), "down": (5120, 17408)}
VARIANTS = {  # DLight WMMA baselines: the schedule file's tiling (earlier sweeps: BENCHMARKS.md run 3)
    "w2x2_f4x4_k4": dict(warps_m=2, warps_n=2, frags_m=4, frags_n=4, k_frags=4),
}
ROWS = (2048, 8192)
# wgmma kernel variants (bn, stages, group_m); the first is the registry default
WG_VARIANTS = [(256, 4, 8), (256, 4, 16), (256, 3, 8), (128, 4, 8), (128, 6, 8)]
# epilogue / edge cases of the default variant: name -> (K, O, epilogue, rows)
WG_CASES = {
    "gate_up_silu": (5120, 34816, "silu_mul", (2048,)),
    "down_res": (17408, 5120, "residual", (2048,)),
    "odd_none": (200, 300, "none", (1, 20, 33, 200, 1000)),
    "odd_res": (72, 520, "residual", (5, 129, 300)),
    "odd_silu": (136, 260, "silu_mul", (7, 40, 257)),
}


def _mm(n: int, k: int):
    from tvm import te, tirx

    m = tirx.Var("m", "int64")
    N, K = tirx.IntImm("int64", n), tirx.IntImm("int64", k)
    a = te.placeholder((m, K), "bfloat16", name="A")
    b = te.placeholder((N, K), "bfloat16", name="B")
    r = te.reduce_axis((0, K), name="k")
    c = te.compute((m, N), lambda i, j: te.sum(a[i, r].astype("float32") * b[j, r].astype("float32"), axis=r),
                   name="NT_matmul")
    d = te.compute((m, N), lambda i, j: c[i, j].astype("bfloat16"), name="cast")
    return te.create_prim_func([a, b, d])


def cmd_prep(a) -> int:
    sys.path.insert(0, str(ROOT.parent))
    import tvm
    from tvm.s_tir.dlight.base.transform import _apply_rules

    from ninfer_mlc.compile.kernels.cuda.tensor_core import TensorCoreMatmul, TiledTensorCoreMatmul
    from ninfer_mlc.compile.targets import cuda_build_env, parse_target

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tgt = parse_target("cuda:" + a.arch).tvm_target()
    funcs, meta = {}, {}
    with cuda_build_env(tgt):
        for vname, cfg in VARIANTS.items():
            rule = TensorCoreMatmul() if cfg is None else TiledTensorCoreMatmul(**cfg)
            for sname, (n, k) in SHAPES.items():
                sch = _apply_rules(_mm(n, k), tgt, [rule], tunable=False)
                if sch is None:
                    print(f"{vname} {sname}: rule did not apply", flush=True)
                    continue
                name = f"mm_{vname}_{sname}"
                funcs[name] = sch[0].mod["main"].with_attr("global_symbol", name)
                meta[name] = {"variant": vname, "shape": sname, "n": n, "k": k, "config": cfg}
        from ninfer_mlc.compile.kernels.cuda import gemm_sm90

        for bn, st, gm in WG_VARIANTS:
            vname = f"wg_bn{bn}_s{st}_g{gm}"
            for sname, (n, k) in SHAPES.items():
                f = gemm_sm90.gemm(k, n, "bfloat16", "bfloat16", "none", bn=bn, stages=st, group_m=gm)
                name = f"mm_{vname}_{sname}"
                funcs[name] = f.with_attr("global_symbol", name)
                meta[name] = {"variant": vname, "shape": sname, "n": n, "k": k, "config": [bn, st, gm]}
        for cname, (k, n, epi, rows) in WG_CASES.items():
            name = f"case_{cname}"
            funcs[name] = gemm_sm90.gemm(k, n, "bfloat16", "bfloat16", epi).with_attr("global_symbol", name)
            meta[name] = {"variant": "wg_default", "case": cname, "n": n, "k": k, "epilogue": epi, "rows": list(rows)}
        t = time.time()
        ex = tvm.compile(tvm.IRModule(funcs), target=tgt)
        print(f"built {len(funcs)} functions in {time.time() - t:.1f}s", flush=True)
    ex.export_library(str(out / "gemm.so"))
    (out / "gemm.json").write_text(json.dumps(meta, indent=1))
    return 0


def cmd_run(a) -> int:
    import torch

    from ninfer_mlc.runtime.tvm_loader import import_tvm

    tvm = import_tvm("cuda")
    out = Path(a.out)
    meta = json.loads((out / "gemm.json").read_text())
    lib = tvm.runtime.load_module(str(out / "gemm.so"))
    res = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": []}
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fn, reps):
        fn()
        torch.cuda.synchronize()
        s.record()
        for _ in range(reps):
            fn()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / 1e3 / reps

    g = torch.Generator(device="cuda").manual_seed(0)
    for name, mt in meta.items():  # fused epilogues and edge shapes: correctness (+ rate of the big ones)
        if "case" not in mt:
            continue
        n, k, epi = mt["n"], mt["k"], mt["epilogue"]
        w = torch.randn((n, k), device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
        oo = n // 2 if epi == "silu_mul" else n
        for m in mt["rows"]:
            x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16, generator=g)
            y32 = (x.float() @ w.float().T)
            args = [x, w]
            if epi == "silu_mul":
                gt, up = y32.bfloat16().float().split(oo, dim=1)
                ref = torch.nn.functional.silu(gt) * up
            elif epi == "residual":
                r = torch.randn((m, n), device="cuda", dtype=torch.bfloat16, generator=g)
                args.append(r)
                ref = r.float() + y32.bfloat16().float()
            else:
                ref = y32
            y = torch.full((m, oo), float("nan"), device="cuda", dtype=torch.bfloat16)
            targs = [tvm.runtime.from_dlpack(a_) for a_ in args + [y]]
            try:
                lib[name](*targs)
                torch.cuda.synchronize()
                err = float(((y.float() - ref).abs().max() / ref.abs().max()).item())
                row = {"shape": mt["case"], "m": m, "variant": "wg_default", "rel_err": err}
                if m >= 2048:
                    t = timed(lambda: lib[name](*targs), 10)
                    row.update(tflops=2 * m * n * k / t / 1e12, ms=t * 1e3)
            except Exception as ex:  # noqa: BLE001
                row = {"shape": mt["case"], "m": m, "variant": "wg_default", "error": repr(ex)[:300]}
            res["rows"].append(row)
            gc.write_result(a.result, res)
    for sname, (n, k) in SHAPES.items():
        w = torch.randn((n, k), device="cuda", dtype=torch.bfloat16, generator=g) * k ** -0.5
        for m in ROWS:
            x = torch.randn((m, k), device="cuda", dtype=torch.bfloat16, generator=g)
            ref = (x.float() @ w.float().T)
            flops = 2 * m * n * k
            t_torch = timed(lambda: x @ w.T, 10)
            res["rows"].append({"shape": sname, "m": m, "variant": "torch", "tflops": flops / t_torch / 1e12})
            xt, wt = tvm.runtime.from_dlpack(x), tvm.runtime.from_dlpack(w)
            y = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
            yt = tvm.runtime.from_dlpack(y)
            for name, mt in meta.items():
                if mt.get("shape") != sname:
                    continue
                f = lib[name]
                try:
                    y.fill_(float("nan"))
                    f(xt, wt, yt)
                    torch.cuda.synchronize()
                    err = float(((y.float() - ref).abs().max() / ref.abs().max()).item())
                    t = timed(lambda: f(xt, wt, yt), 10)
                    row = {"shape": sname, "m": m, "variant": mt["variant"], "tflops": flops / t / 1e12,
                           "ms": t * 1e3, "rel_err": err}
                except Exception as ex:  # noqa: BLE001
                    row = {"shape": sname, "m": m, "variant": mt["variant"], "error": repr(ex)[:300]}
                res["rows"].append(row)
            gc.write_result(a.result, res)
            del x, ref
    print(f"{'shape':8s} {'rows':>5s} {'variant':14s} {'TFLOP/s':>8s} {'rel_err':>9s}")
    for r in res["rows"]:
        print(f"{r['shape']:8s} {r['m']:5d} {r['variant']:14s} {r.get('tflops', float('nan')):8.1f} "
              f"{r.get('rel_err', float('nan')):9.2e} {r.get('error', '')}")
    return 0


def main(argv=None) -> int:
    return gc.prep_run_main(__doc__, cmd_prep, cmd_run, argv)


if __name__ == "__main__":
    sys.exit(main())
