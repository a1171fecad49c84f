"""Decode GEMV (compile/kernels/cuda/gemv.py) on the GPU: correctness vs an fp32 reference, and the
weight-streaming rate per shape, batch rows and launch-parameter variant.

  prep OUT [--arch sm_90]     (here: compiler + nvcc + stub libcuda, no GPU)
        OUT/gemv.so   the kernels, built for ARCH: the 27B decode shapes with every variant of
                      VARIANTS (the "kernels.gemv" parameters), plus odd small shapes (K % 32 != 0,
                      O % 16 != 0, K % 8 != 0 -> FMA path, f16, f32) with the default parameters
        OUT/gemv.json case list (shape, epilogue, dtypes, variant, symbol, launch config)
  run OUT RESULT.json         (GPU machine: runtime-only TVM + numpy + torch) inputs made on the GPU
        from seeds; every case at n in NS: max error vs torch fp32 (x @ W^T in fp32, epilogue with
        the kernel's roundings), then us/call and GB/s of weight bytes (weights rotated over enough
        copies to miss L2), next to the copy bandwidth and torch's (cuBLAS) matmul at the same n.
  emulate [--quick]           (here, no GPU) run the generated CUDA source of small cases on the CPU
        emulator of ninfer_mlc.compile.kernels.cuda.emulate (a fiber per CUDA thread; barriers, shuffles
        and mma.sync m16n8k16 as warp collectives from the PTX fragment layouts); checks vs numpy.

NVFP4 weights (gemv.gemv_nvfp4, the decode path of NVFP4Linear): the 27B shapes of CASES_NVFP4 with every
NVFP4_VARIANTS entry at n in NS_NVFP4. `run` makes codes / E4M3 block scales / per-row global scales on the
GPU from a per-shape seed; the reference is compile/nvfp4.py's numpy dequantization of the first copy
times weight_scale_2, then an fp32 matmul (TF32 off); GB/s counts the NVFP4 bytes (codes + block scales +
row scales); "vs bf16" is the bf16 kernel's time on the same shape and n over this one's. `emulate` adds
small NVFP4 shapes (tensor-core and FMA paths, remainders, subnormal / zero block scales, n > 8).

  build27b OUT [--arch sm_90]  (here) the 27B geometry with --quant nvfp4: build time, decode's kernels
        (gemv_nvfp4*, no dequant_nvfp4 left) and the schedule report -> OUT/q27b_nvfp4.json

Commands:
  .venv/bin/python bench/gemv_gpu_check.py emulate                  # CPU check of the generated CUDA (~1.5 min)
  .venv/bin/python bench/gemv_gpu_check.py prep .gpu/gemv           # ~1 min, gemv.so ~3 MB (bf16 + NVFP4)
  35B-A3B shapes (hidden 2048), every variant, n = 1, 4, 8 (GEMV_DIR selects the prep dir in gpu_driver.sh):
  .venv/bin/python bench/gemv_gpu_check.py prep .gpu/moe8/gemv --shapes 35b
  GPU machine (runtime-only TVM bundle and PYTHONPATH/LD_LIBRARY_PATH as in bench/README.md step 3):
  python3 bench/gemv_gpu_check.py run .gpu/gemv $OUT/gemv.json       # everything: ~6-9 min on an H100/H200
  python3 bench/gemv_gpu_check.py run .gpu/gemv $OUT/gemv_nvfp4.json --weight nvfp4   # NVFP4 + bf16 baseline
  NVFP4 variants alone (old vs new, 5 shapes x n=1,4,8,13; ~4-5 min):
  .venv/bin/python bench/gemv_gpu_check.py prep .gpu/gemv4 --arch sm_90        # ~5.5 min here, 3.9 MB
  (prep takes the same --weight / --variants filters as run: build only what one call will run)
  python3 bench/gemv_gpu_check.py run .gpu/gemv4 $OUT/gemv_nvfp4.json --weight nvfp4
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import numpy as np

import gpu_common as gc
from ninfer_mlc.compile.kernels.cuda.emulate.gemv import (
    TOL, default_params, default_params_nvfp4, nvfp4_dequant, rel_err, run_emulation,
)

# (name, K, O, epilogue, dtype, out dtype) of the Qwen3.x-27B decode projections (bf16)
CASES_27B = [
    ("qkv", 5120, 14336, "none", "bfloat16", "bfloat16"),
    ("in_proj_qkv_z", 5120, 16384, "none", "bfloat16", "bfloat16"),
    ("in_proj_ba", 5120, 96, "none", "bfloat16", "bfloat16"),
    ("gate_up_silu", 5120, 34816, "silu_mul", "bfloat16", "bfloat16"),
    ("down_res", 17408, 5120, "residual", "bfloat16", "bfloat16"),
    ("o_proj_res", 6144, 5120, "residual", "bfloat16", "bfloat16"),
    ("lm_head_f32", 5120, 248320, "none", "bfloat16", "float32"),
]
# the Qwen3.5/3.6-35B-A3B decode projections outside the experts (hidden 2048: short K; prep --shapes 35b)
CASES_35B = [
    ("lm_head_f32", 2048, 248320, "none", "bfloat16", "float32"),
    ("gdn_in_proj", 2048, 12288, "none", "bfloat16", "bfloat16"),
    ("attn_qkv", 2048, 9216, "none", "bfloat16", "bfloat16"),
    ("out_proj_res", 4096, 2048, "residual", "bfloat16", "bfloat16"),
    ("router_f32", 2048, 257, "none", "bfloat16", "float32"),
    ("gdn_ba", 2048, 64, "none", "bfloat16", "bfloat16"),
]
CASES_35B_NVFP4 = [
    ("gdn_in_proj", 2048, 12288, "none"),
    ("attn_qkv", 2048, 9216, "none"),
    ("out_proj_res", 4096, 2048, "residual"),
]
NS_35B = (1, 4, 8)
# odd shapes: remainders in K and O, FMA path, f16, f32 (default parameters only)
CASES_ODD = [
    ("k72_o40_f32out", 72, 40, "none", "bfloat16", "float32"),
    ("k200_o36_silu", 200, 36, "silu_mul", "bfloat16", "bfloat16"),
    ("k1000_o24_f16", 1000, 24, "none", "float16", "float16"),
    ("k96_o50_res_f16", 96, 50, "residual", "float16", "float16"),
    ("k100_o50_res_fma", 100, 50, "residual", "bfloat16", "bfloat16"),
    ("k64_o96_silu_f32", 64, 96, "silu_mul", "float32", "float32"),
    ("k64_o100_res_f32", 64, 100, "residual", "float32", "float32"),
    ("k5120_o40_res_f32", 5120, 40, "residual", "float32", "float32"),
]
VARIANTS = {
    "default": {},
    "u2": {"unroll": 2},
    "u8": {"unroll": 8},
    "t1024": {"target_warps": 1024},
    "t4096": {"target_warps": 4096},
    "w4-8": {"min_warps": 4, "max_warps": 8},
    "w2": {"min_warps": 2},  # short K (35B: 16 iterations of one warp per 16-row tile): two warps split it
    "w2-u8": {"min_warps": 2, "unroll": 8},
    "w16": {"max_warps": 16},  # grids of fewer than 256 tiles (35B out_proj / router / ba): 16 warps split K
    # the warp-iteration loop rolled (#pragma unroll 1; the default from K <= gemv.ROLLED_MAX_K) or left to nvcc
    "unrolled": {"rolled": False},
    "rolled": {"rolled": True},
    "w2-rolled": {"min_warps": 2, "rolled": True},
}
# (name, K, O, epilogue) of the 27B decode projections with NVFP4 weights (bf16 activations)
CASES_NVFP4 = [
    ("qkv", 5120, 14336, "none"),
    ("in_proj_qkv_z", 5120, 16384, "none"),
    ("gate_up_silu", 5120, 34816, "silu_mul"),
    ("down_res", 17408, 5120, "residual"),
    ("o_proj_res", 6144, 5120, "residual"),
]
# gemv_nvfp4 overrides of NVFP4_DEFAULTS (unroll 2, stages 0; "default" here runs row_tiles 1, the model takes 2 from
# O = 8192: gemv.nvfp4_row_tiles): "old" is the previous default (weights
# loaded into registers at the top of each iteration); st = cp.async stage ring of that many iterations per warp
# (st - 1 in flight; fewer where 48 KiB of shared memory per block do not hold them); rt = 16-row tiles per warp (x
# fragments and their byte_perms shared); u = 128-K steps per warp iteration;
# pf = register double buffer (next iteration's loads before this one's math); b-* = the n > 8 launch only (n > 8)
NVFP4_VARIANTS = {
    "default": {},
    "old": {"stages": 0},
    "old-u4": {"stages": 0, "unroll": 4},
    "st3": {"stages": 3},
    "st4": {"stages": 4},
    "st6-u1": {"stages": 6, "unroll": 1},
    "rt2-st4-u1": {"row_tiles": 2, "unroll": 1, "stages": 4},
    "rt2-st3": {"row_tiles": 2, "stages": 3},
    "rt2": {"row_tiles": 2, "stages": 0},
    "pf": {"stages": 0, "prefetch": True},
    "rt2-pf-u1": {"row_tiles": 2, "stages": 0, "prefetch": True, "unroll": 1},
    # xl = x late: each step's x words loaded at its mma chain, so only weight codes wait in registers
    "xl": {"x_late": True},
    "xl-u4": {"x_late": True, "unroll": 4},
    "rt2-xl": {"row_tiles": 2, "x_late": True},
    "rt2-xl-u4": {"row_tiles": 2, "x_late": True, "unroll": 4},
    "rt4-xl-u1": {"row_tiles": 4, "x_late": True, "unroll": 1},
    "pf-xl": {"prefetch": True, "x_late": True},
    "pf-xl-u4": {"prefetch": True, "x_late": True, "unroll": 4},
    "rt2-pf-xl-u1": {"row_tiles": 2, "prefetch": True, "x_late": True, "unroll": 1},
    "rt2-pf-xl": {"row_tiles": 2, "prefetch": True, "x_late": True},
    # probes (WRONG results, expected mismatches): the same launch without the block-scale multiply / without any
    # dequantization, i.e. what a cheaper dequantization could buy at most
    "rt2-noscale": {"row_tiles": 2, "probe": "noscale"},
    "rt2-nodq": {"row_tiles": 2, "probe": "nodq"},
    "pf-xl-noscale": {"prefetch": True, "x_late": True, "probe": "noscale"},
    "pf-xl-nodq": {"prefetch": True, "x_late": True, "probe": "nodq"},
    "b-rt2": {"big_row_tiles": 2},
    "b-pf": {"big_prefetch": True},
    "w16": {"max_warps": 16},
}
NS_NVFP4 = (1, 4, 8, 13)
NS = (1, 2, 3, 4, 8, 13)
NS_ODD = (1, 2, 3, 8, 13, 40)


def _params(variant: str) -> dict:
    return {**default_params(), **VARIANTS[variant]}


def _params_nvfp4(variant: str) -> dict:
    """gemv_nvfp4 keyword arguments as the kernel set passes them, then the variant's overrides."""
    return {**default_params_nvfp4(), **NVFP4_VARIANTS[variant]}


def nvfp4_bytes(K: int, O: int) -> int:
    """Bytes of one NVFP4 weight: codes + E4M3 block scales + fp32 row scales."""
    return O * K // 2 + O * K // 16 + 4 * O


def _cases(shapes: str = "27b") -> list[dict]:
    """27b: the 27B shapes with every variant, the odd shapes, the 27B NVFP4 shapes; 35b: the 35B-A3B shapes (bf16 and
    NVFP4) with every variant at NS_35B."""
    from ninfer_mlc.compile.kernels.cuda import gemv as G

    dense, ns, odd, nvfp4 = ((CASES_27B, NS, CASES_ODD, CASES_NVFP4) if shapes == "27b" else
                             (CASES_35B, NS_35B, [], CASES_35B_NVFP4))
    out = []
    for variant in VARIANTS:
        for name, k, o, ep, dt, odt in dense:
            out.append(dict(name=name, K=k, O=o, epilogue=ep, dtype=dt, out_dtype=odt, variant=variant, ns=ns))
    for name, k, o, ep, dt, odt in odd:
        out.append(dict(name=name, K=k, O=o, epilogue=ep, dtype=dt, out_dtype=odt, variant="default", ns=NS_ODD))
    for c in out:
        p = _params(c["variant"])
        c["symbol"] = G.symbol(c["K"], c["O"], c["dtype"], c["out_dtype"], c["epilogue"]) + "_" + c["variant"].replace(
            "-", "_")
        c["launch"] = G.launch_config(c["K"], c["O"], c["dtype"], c["epilogue"], **p)
        c["weight_bytes"] = c["K"] * c["O"] * np.dtype(np.float32 if c["dtype"] == "float32" else np.float16).itemsize
    for name, k, o, ep in nvfp4:  # shape-major: run() keeps one shape's reference weight at a time
        for variant in NVFP4_VARIANTS:
            p = _params_nvfp4(variant)
            out.append(dict(name=name + "_nvfp4", K=k, O=o, epilogue=ep, dtype="bfloat16", out_dtype="bfloat16",
                            variant=variant, ns=tuple(n for n in (NS_NVFP4 if shapes == "27b" else NS_35B)
                                                      if n > 8 or not variant.startswith("b-")),
                            weight="nvfp4", weight_bytes=nvfp4_bytes(k, o),
                            symbol=G.symbol(k, o, "bfloat16", "bfloat16", ep, "nvfp4") + "_"
                            + variant.replace("-", "_"),
                            launch=G.launch_config_nvfp4(k, o, "bfloat16", ep, **p)))
    return out


def _func(c: dict):
    from ninfer_mlc.compile.kernels.cuda import gemv as G

    if c.get("weight") == "nvfp4":
        f = G.gemv_nvfp4(c["K"], c["O"], c["dtype"], c["out_dtype"], c["epilogue"], **_params_nvfp4(c["variant"]))
    else:
        f = G.gemv(c["K"], c["O"], c["dtype"], c["out_dtype"], c["epilogue"], **_params(c["variant"]))
    return f.with_attr("global_symbol", c["symbol"])


def cmd_prep(a) -> int:
    import tvm

    from ninfer_mlc.compile.targets import cuda_build_env, parse_target

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    every = _cases(a.shapes)
    cases = [c for c in every if _selected(c, every, a) and (c.get("weight") != "nvfp4" or not a.skip_nvfp4)]
    tgt = parse_target("cuda:" + a.arch).tvm_target()
    t = time.time()
    with cuda_build_env(tgt):
        ex = tvm.compile(tvm.IRModule({c["symbol"]: _func(c) for c in cases}), target=tgt)
    ex.export_library(str(out / "gemv.so"))
    (out / "gemv.json").write_text(json.dumps({"arch": a.arch, "cases": cases}, indent=1))
    print(f"built {len(cases)} kernels in {time.time() - t:.1f}s -> {out / 'gemv.so'} "
          f"({(out / 'gemv.so').stat().st_size} bytes)", flush=True)
    return 0


# ---- GPU run -----------------------------------------------------------------------------------
def cmd_run(a) -> int:
    import torch

    from ninfer_mlc.runtime.tvm_loader import import_tvm

    tvm = import_tvm("cuda")
    out = Path(a.out)
    meta = json.loads((out / "gemv.json").read_text())
    lib = tvm.runtime.load_module(str(out / "gemv.so"))
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    res = {"device": torch.cuda.get_device_name(0), "arch": meta["arch"],
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "rows": []}
    try:
        bw, mm_rate = gc.measure_floors(torch)
        res["copy_bandwidth_GBs"] = bw / 1e9
        res["bf16_matmul_tflops"] = mm_rate / 1e12
    except Exception as e:  # noqa: BLE001 - floors are context only
        bw = None
        res["floors_error"] = repr(e)[:200]
    print(f"device {res['device']}  copy bandwidth {res.get('copy_bandwidth_GBs', float('nan')):.0f} GB/s", flush=True)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(fns, reps):
        for f in fns[:2]:
            f()
        torch.cuda.synchronize()
        s.record()
        for i in range(reps):
            fns[i % len(fns)]()
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / 1e3 / reps

    torch.backends.cuda.matmul.allow_tf32 = False

    def kernel_us(fns, reps, name=None):
        """Mean device time of the kernels (name: only those whose name contains it), via CUPTI:
        launch gaps and Python call overhead excluded."""
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(reps):
                fns[i % len(fns)]()
            torch.cuda.synchronize()
        tot = 0.0
        for ev in prof.key_averages():
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0) or 0
            if t and (name is None or name in ev.key):
                tot += float(t)
        return tot / reps if tot else None

    ok_all = True
    torch_done = set()
    nvfp4_ref = {}  # (K, O) -> the fp32 reference weight of the first copy (one shape at a time)
    for ci, c in enumerate(meta["cases"]):
        if not _selected(c, meta["cases"], a):
            continue
        f = lib[c["symbol"]]
        K, O, ep = c["K"], c["O"], c["epilogue"]
        OO = O // 2 if ep == "silu_mul" else O
        dt, odt = tdt[c["dtype"]], tdt[c["out_dtype"]]
        nv = c.get("weight") == "nvfp4"
        g = torch.Generator(device="cuda").manual_seed(1000 + ci)
        # enough weight copies to stream past L2 (>= 256 MB), at most 8
        copies = int(min(8, max(1, -(-256e6 // c["weight_bytes"]))))
        if nv:  # per-shape seed: every variant sees the same weights (and reuses the reference)
            gw = torch.Generator(device="cuda").manual_seed(K * 100003 + O)
            ws = [nvfp4_gpu_weights(torch, O, K, gw) for _ in range(copies)]
            wts = [tuple(tvm.runtime.from_dlpack(t) for t in w) for w in ws]
            if (K, O) not in nvfp4_ref:
                nvfp4_ref.clear()
                torch.cuda.empty_cache()
                nvfp4_ref[(K, O)] = torch.from_numpy(nvfp4_dequant(*(t.cpu().numpy() for t in ws[0]))).cuda()
            wref = nvfp4_ref[(K, O)]
        else:
            ws = [(torch.randn((O, K), device="cuda", generator=g) * K ** -0.5).to(dt) for _ in range(copies)]
            wts = [tvm.runtime.from_dlpack(w) for w in ws]
            wref = ws[0]
        for n in c["ns"]:
            x = torch.randn((n, K), device="cuda", generator=g).to(dt)
            r = torch.randn((n, OO), device="cuda", generator=g).to(dt) if ep == "residual" else None
            y = torch.full((n, OO), float("nan"), device="cuda", dtype=odt)
            xt, yt = tvm.runtime.from_dlpack(x), tvm.runtime.from_dlpack(y)
            rt = tvm.runtime.from_dlpack(r) if r is not None else None
            if nv:  # (x, codes, scales, row scales[, res], out)
                args = (lambda wt: (xt, *wt, rt, yt)) if r is not None else (lambda wt: (xt, *wt, yt))
            else:
                args = (lambda wt: (xt, wt, rt, yt)) if r is not None else (lambda wt: (xt, wt, yt))
            row = dict(case=c["name"], variant=c["variant"], K=K, O=O, epilogue=ep, dtype=c["dtype"],
                       out_dtype=c["out_dtype"], n=n, launch=c["launch"], weight=c.get("weight", c["dtype"]),
                       weight_bytes=c["weight_bytes"])
            try:
                f(*args(wts[0]))
                torch.cuda.synchronize()
                ref = _torch_reference(torch, x, wref, r, ep, dt, odt)
                err = rel_err(y.float().cpu().numpy(), ref.cpu().numpy())
                reps = int(max(20, min(2000, 2e9 / c["weight_bytes"])))
                fns = [(lambda wt=wt: f(*args(wt))) for wt in wts]
                t = timed(fns, reps)
                kt = kernel_us(fns, min(reps, 200), c["symbol"])
                tk = kt * 1e-6 if kt else t
                row.update(us=t * 1e6, kernel_us=kt, GBs=c["weight_bytes"] / tk / 1e9, rel_err=err,
                           ok=bool(err <= TOL[c["out_dtype"]]))
                if bw:
                    row["frac_of_copy_bw"] = row["GBs"] * 1e9 / bw
                key = (K, O, c["dtype"], n)
                if c["variant"] == "default" and key not in torch_done and c["dtype"] != "float32" and not nv:
                    torch_done.add(key)
                    tfns = [(lambda w=w: torch.matmul(x, w.T)) for w in ws]
                    timed(tfns, 4)
                    row["torch_kernel_us"] = kernel_us(tfns, min(reps, 200))
            except Exception as ex:  # noqa: BLE001
                row.update(error=repr(ex)[:300], ok=False)
            ok_all &= row["ok"]
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            del x, r, y
        del ws, wts
        torch.cuda.empty_cache()
        gc.write_result(a.result, res)
    res["ok"] = bool(ok_all)
    gc.write_result(a.result, res)
    _print_table(res)
    return 0 if ok_all else 1


def _selected(c: dict, cases: list, a) -> bool:
    """run's --weight / --variants filters; --weight nvfp4 keeps the default-variant bf16 cases of the NVFP4
    shapes (the 'vs bf16' baseline)."""
    weight = getattr(a, "weight", "all")
    variants = [v for v in (getattr(a, "variants", "") or "").split(",") if v]
    nv = c.get("weight") == "nvfp4"
    if weight == "bf16" and nv:
        return False
    if weight == "nvfp4" and not nv:
        shapes = {(d["K"], d["O"], d["epilogue"]) for d in cases if d.get("weight") == "nvfp4"}
        return c["variant"] == "default" and (c["K"], c["O"], c["epilogue"]) in shapes
    return not variants or c["variant"] in variants


def nvfp4_gpu_weights(torch, O: int, K: int, gen, dev: str = "cuda"):
    """nvfp4_weights on the GPU (same row kinds: block scales around 1, E4M3 subnormals, large, mixed with
    zeros; every code byte): (codes uint8 [O, K/2], scales uint8 [O, K/16], row scales fp32 [O])."""
    codes = torch.randint(0, 256, (O, K // 2), device=dev, dtype=torch.uint8, generator=gen)
    kind = torch.arange(O, device=dev) % 4
    lo = torch.tensor([0x30, 0x01, 0x70, 0], device=dev)[kind][:, None]
    hi = torch.tensor([0x40, 0x07, 0x7E, 3], device=dev)[kind][:, None]
    u = torch.rand((O, K // 16), device=dev, generator=gen)
    sc = torch.minimum(lo + (u * (hi - lo + 1)).floor().long(), hi)
    mixed = torch.tensor([0x00, 0x08, 0x38, 0x3F], device=dev)[sc.clamp(max=3)]
    scales = torch.where((kind == 3)[:, None], mixed, sc).to(torch.uint8)
    typical = torch.tensor([1.2, 4 * 2.0 ** -9, 300.0, 0.8], device=dev)[kind]
    gsc = K ** -0.5 / (2.93 * typical) * (torch.rand(O, device=dev, generator=gen) * 0.6 + 0.7)
    return codes, scales, gsc.float()


def _torch_reference(torch, x, w, r, ep, dt, odt):
    y = x.float() @ w.float().T  # fp32 (TF32 off)
    if ep == "residual":
        return (r.float() + y.to(dt).float()).to(odt).float()
    if ep == "silu_mul":
        h = y.shape[1] // 2
        gg, u = y[:, :h].to(dt).float(), y[:, h:].to(dt).float()
        return (gg / (1 + torch.exp(-gg)) * u).to(odt).float()
    return y.to(odt).float()


def _print_table(res: dict) -> None:
    nan = float("nan")
    print("\nus: wall per call (events, back-to-back calls); kern: CUPTI kernel time; GB/s and %bw (of the copy "
          "bandwidth) from kern; torch: cuBLAS x @ W^T kernel time")
    print("NVFP4 rows (*_nvfp4): GB/s of codes + block scales + row scales; 'vs bf16' = the bf16 kernel's time "
          "(default variant, same shape and n) / this one's")
    bf16_us = {(r["K"], r["O"], r["epilogue"], r["n"]): r.get("kernel_us") for r in res["rows"]
               if r.get("weight", r["dtype"]) == "bfloat16" and r["variant"] == "default"}
    print(f"{'case':18s} {'variant':8s} {'n':>3s} {'us':>8s} {'kern us':>8s} {'GB/s':>6s} {'%bw':>5s} {'torch':>8s} "
          f"{'vs bf16':>7s} {'rel_err':>8s} ok  launch")
    for r in res["rows"]:
        vs = nan
        if r.get("weight") == "nvfp4" and r.get("kernel_us") and bf16_us.get((r["K"], r["O"], r["epilogue"], r["n"])):
            vs = bf16_us[(r["K"], r["O"], r["epilogue"], r["n"])] / r["kernel_us"]
        print(f"{r['case']:18s} {r['variant']:8s} {r['n']:3d} {r.get('us', nan):8.1f} {r.get('kernel_us') or nan:8.1f} "
              f"{r.get('GBs', nan):6.0f} {100 * r.get('frac_of_copy_bw', nan):5.1f} "
              f"{r.get('torch_kernel_us') or nan:8.1f} {vs:7.2f} {r.get('rel_err', nan):8.1e} "
              f"{'ok' if r['ok'] else 'BAD'} {r.get('error', r['launch'])}")
    # best variant per 27B case and n
    best = {}
    for r in res["rows"]:
        if "GBs" in r and r["ok"]:
            k = (r["case"], r["n"])
            if k not in best or r["GBs"] > best[k]["GBs"]:
                best[k] = r
    print("\nbest variant per case and n (GB/s):")
    for (case, n), r in sorted(best.items()):
        print(f"  {case:18s} n={n:3d} {r['variant']:8s} {r['GBs']:7.0f}")
    print("OK" if res.get("ok") else "MISMATCH")


def cmd_emulate(a) -> int:
    rows = run_emulation(a.quick)
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)}/{len(rows)} ok")
    return 1 if bad else 0


def cmd_build27b(a) -> int:
    """The Qwen3.x-27B geometry (bench/gpu_bench.py Q27B) with NVFP4 decoder projections (`--quant nvfp4`,
    bf16 activations) built for cuda:ARCH: build time, the kernels the decode / mtp-free functions call (no
    dequant_nvfp4 may be left in decode) and the schedule report (gpu_pipeline.last_report()) of the decode
    GEMVs. Writes OUT/q27b_nvfp4.so and OUT/q27b_nvfp4.json."""
    import os

    import tvm

    from gpu_bench import Q27B
    from ninfer_mlc.compile import gpu_pipeline
    from ninfer_mlc.compile.build import build_library
    from ninfer_mlc.compile.config import parse_config
    from ninfer_mlc.compile.model import Qwen3xForCausalLM
    from ninfer_mlc.compile.targets import parse_target

    os.environ.pop("NINFER_LIB_CACHE", None)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = parse_config(Q27B)
    t0 = time.time()
    m = Qwen3xForCausalLM(cfg, "bfloat16", "cuda", None, weight_quant="nvfp4")
    mod, _ = m.export_tvm(spec=m.export_spec())
    calls = {gv.name_hint: sorted(set(re.findall(r"call_tir\((?:cls\.)?(\w+)", f.script())))
             for gv, f in mod.functions_items() if isinstance(f, tvm.relax.Function)}
    print(f"export {time.time() - t0:.1f}s", flush=True)
    t1 = time.time()
    build_library(cfg, "bfloat16", parse_target("cuda:" + a.arch), out / "q27b_nvfp4.so", weight_quant="nvfp4")
    build_s = time.time() - t1
    report = gpu_pipeline.last_report()
    dec = calls["decode"]
    info = {"arch": a.arch, "build_seconds": build_s, "library_bytes": (out / "q27b_nvfp4.so").stat().st_size,
            "decode_calls": dec, "decode_dequant": [c for c in dec if "dequant" in c],
            "decode_gemv_nvfp4": [c for c in dec if c.startswith("gemv_nvfp4")],
            "prefill_dequant": [c for c in calls["prefill"] if "dequant" in c],
            "report_gemv_nvfp4": {k: v for k, v in report.items() if k.startswith("gemv_nvfp4")},
            "report_dequant": {k: v for k, v in report.items() if "dequant" in k},
            "schedule_report": report}
    (out / "q27b_nvfp4.json").write_text(json.dumps(info, indent=1))
    print(f"27b nvfp4 ({a.arch}): built in {build_s:.1f}s, {info['library_bytes']} bytes")
    print("decode gemv_nvfp4:", info["decode_gemv_nvfp4"])
    print("decode dequant:", info["decode_dequant"] or "none")
    print("report gemv_nvfp4:", info["report_gemv_nvfp4"])
    print("report dequant (prefill / verify / prefill_h):", info["report_dequant"])
    return 0 if not info["decode_dequant"] and info["decode_gemv_nvfp4"] else 1


def main(argv=None) -> int:
    ap, sub, p, r = gc.prep_run_parser(__doc__)
    p.add_argument("--shapes", choices=("27b", "35b"), default="27b", help="35b: the 35B-A3B projections (short K)")
    p.add_argument("--skip-nvfp4", action="store_true", help="no NVFP4 cases")
    for q in (p, r):  # prep builds (and run runs) only the selected cases
        q.add_argument("--weight", choices=("all", "bf16", "nvfp4"), default="all",
                       help="nvfp4: the NVFP4 cases and the bf16 default-variant cases of the same shapes")
        q.add_argument("--variants", default="", help="comma-separated variant names (default: all)")
    m = sub.add_parser("emulate")
    m.add_argument("--quick", action="store_true")
    b = sub.add_parser("build27b")
    b.add_argument("out")
    b.add_argument("--arch", default="sm_90")
    a = ap.parse_args(argv)
    return {"prep": cmd_prep, "run": cmd_run, "emulate": cmd_emulate, "build27b": cmd_build27b}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
