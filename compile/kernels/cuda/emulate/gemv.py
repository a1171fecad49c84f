"""Checks of the CUDA decode GEMV (compile/kernels/cuda/gemv.py gemv, gemv_nvfp4): the reference with the
kernel's roundings, NVFP4 test weights, and run_emulation, which runs small cases' generated CUDA on the
CPU emulator (tensor-core and FMA paths, remainders in K and O, every epilogue, n on both sides of the
host's n <= 8 launch branch). bench/gemv_gpu_check.py checks the 27B shapes on the GPU with the same
reference. Numpy only at module level.
"""
from __future__ import annotations

import json
from typing import Any, Optional

import numpy as np

from .numerics import rel_err

TOL = {"bfloat16": 1e-2, "float16": 2e-3, "float32": 3e-5}  # max|d| / max|ref|, by output rounding

EMU_CASES = [
    # (K, O, epilogue, dtype, out dtype, params): every code path at small sizes
    (256, 48, "none", "bfloat16", "bfloat16", {}),
    (72, 40, "none", "bfloat16", "float32", {}),
    (200, 36, "silu_mul", "bfloat16", "bfloat16", {}),
    (1024, 32, "silu_mul", "bfloat16", "bfloat16", {"unroll": 2}),
    (512, 40, "residual", "float16", "float16", {}),
    (5120, 16, "residual", "bfloat16", "bfloat16", {}),  # 27B K, 8 warps, several iterations per warp
    (6144, 32, "none", "bfloat16", "bfloat16", {"unroll": 8, "max_warps": 16, "min_warps": 16}),
    (1024, 64, "silu_mul", "bfloat16", "bfloat16", {"target_warps": 1}),  # one warp per block
    (17408, 16, "residual", "bfloat16", "bfloat16", {"min_warps": 6, "max_warps": 6}),  # 136 chunks / 6 warps
    (100, 50, "residual", "bfloat16", "bfloat16", {}),  # K % 8 != 0 -> FMA
    (64, 96, "silu_mul", "float32", "float32", {}),
    (70, 10, "none", "float32", "float32", {}),
]
EMU_NVFP4_CASES: list[tuple[int, int, str, str, str, dict[str, Any]]] = [
    # (K, O, epilogue, dtype, out dtype, params) of gemv_nvfp4: tensor-core path (bf16, K % 32 == 0) and FMA path
    (256, 48, "none", "bfloat16", "bfloat16", {}),
    (512, 40, "residual", "bfloat16", "bfloat16", {"unroll": 1}),  # O % 16 != 0, 4 warps split K
    (384, 36, "silu_mul", "bfloat16", "bfloat16", {}),  # O/2 % 8 != 0, K % 256 != 0
    (1024, 32, "none", "bfloat16", "float32", {"unroll": 1, "target_warps": 1}),  # one warp, fp32 out
    (5120, 16, "residual", "bfloat16", "bfloat16", {}),  # 27B K: 20 chunks over 5 warps
    (6144, 32, "silu_mul", "bfloat16", "bfloat16", {"unroll": 4, "min_warps": 3, "max_warps": 3}),
    (48, 40, "residual", "bfloat16", "bfloat16", {}),  # K % 32 != 0 -> FMA
    (64, 96, "silu_mul", "float32", "float32", {}),  # f32 activations -> FMA
    (96, 24, "none", "float16", "float16", {}),  # f16 -> FMA
    # row tiles per warp and the prefetching pipeline: the last block's second tile past O, odd iteration count
    (512, 72, "none", "bfloat16", "bfloat16", {"row_tiles": 2, "prefetch": True, "unroll": 1}),
    (1024, 80, "silu_mul", "bfloat16", "bfloat16", {"row_tiles": 4, "unroll": 1, "big_row_tiles": 2,
                                                    "big_prefetch": True}),
    (2560, 32, "residual", "bfloat16", "bfloat16", {"row_tiles": 1, "prefetch": True, "target_warps": 1,
                                                   "max_warps": 16}),
    # cp.async stage rings: wrapping 20 iterations of one warp; 2 tiles per warp with an empty one, 4 warps
    (2560, 48, "residual", "bfloat16", "bfloat16", {"stages": 4, "unroll": 1, "target_warps": 1}),
    (768, 72, "silu_mul", "bfloat16", "bfloat16", {"stages": 3, "unroll": 1}),
    (352, 40, "none", "bfloat16", "bfloat16", {}),  # K % 64 != 0: no stage ring (4-byte scale words), registers
    # x late (x words loaded per step at the mma chain): plain, prefetching with 2 tiles, 4 steps in one warp
    (5120, 40, "residual", "bfloat16", "bfloat16", {"x_late": True}),
    (1024, 80, "silu_mul", "bfloat16", "bfloat16", {"row_tiles": 2, "prefetch": True, "unroll": 1, "x_late": True}),
    (2560, 48, "none", "bfloat16", "float32", {"unroll": 4, "x_late": True, "target_warps": 1}),
]


# gemv_rows (weight rows known at run time): (K, dtype, out dtype, params), each run at several (m, n)
EMU_ROWS_CASES = [
    (1024, "bfloat16", "float32", {}),  # the shortlisted MTP head's contract: bf16 in, fp32 logits
    (256, "float16", "float16", {"target_warps": 1}),
    (5120, "bfloat16", "float32", {"rows_plan": 16}),  # planned for few rows: 8 warps split K
]
EMU_ROWS_SHAPES = [(40, 1), (7, 3), (64, 8), (48, 13)]  # (m, n): m % 16 != 0, m < 16, n on both launch sides


# gemv(..., norm_eps): the RMSNorm folded into the GEMV (bf16): (K, O, epilogue, out dtype, params), each at EMU_NORM_NS
EMU_NORM_CASES = [
    (256, 48, "none", "bfloat16", {}),
    (1024, 64, "silu_mul", "bfloat16", {"target_warps": 1}),  # one warp: the whole row's squares in one warp
    (5120, 40, "none", "float32", {}),  # 27B K over several warps, fp32 out (the lm_head), O % 16 != 0
    (512, 36, "silu_mul", "bfloat16", {"unroll": 1, "min_warps": 4, "max_warps": 4}),  # 4 warps, OO % 8 != 0
    (768, 32, "residual", "bfloat16", {}),
]
EMU_NORM_NS = (1, 3, 8, 13)  # both sides of the n <= 8 launch branch; 13: two batch tiles of the big launch
NORM_EPS = 1e-6


def norm_reference(x32, g32, w32, res32, epilogue: str, out_dtype: str, eps: float = NORM_EPS, fused: bool = False):
    """fused=False: rms_norm (compile/kernels/cuda/norm.py: bf16(x / sqrt(mean(x^2) + eps) * g)) then the GEMV
    reference, what the fused kernel replaces; fused=True: the fused kernel's roundings (bf16(x * g) into the
    products, the fp32 sums divided by sqrt(mean(x^2) + eps), then the epilogue)."""
    rms = np.sqrt((x32.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + eps)
    if not fused:
        xn = round_to(x32 / rms * g32, "bfloat16")
        return reference(xn, w32, res32, epilogue, "bfloat16", out_dtype, round_to)
    y = ((round_to(x32 * g32, "bfloat16").astype(np.float64) @ w32.astype(np.float64).T) / rms).astype(np.float32)
    if epilogue == "residual":
        return round_to(res32 + round_to(y, "bfloat16"), out_dtype)
    if epilogue == "silu_mul":
        h = y.shape[1] // 2
        g, u = round_to(y[:, :h], "bfloat16"), round_to(y[:, h:], "bfloat16")
        return round_to(g / (1 + np.exp(-g)) * u, out_dtype)
    return round_to(y, out_dtype)


def run_norm_emulation(log=print) -> list[dict]:
    """The EMU_NORM_CASES kernels in one emulator at every EMU_NORM_NS, rows of very different sizes (the norm is
    per row), against norm_reference."""
    from .. import gemv as G
    from .lib import EmuLib

    funcs, meta = {}, []
    for i, (k, o, ep, odt, prm) in enumerate(EMU_NORM_CASES):
        f = G.gemv(k, o, "bfloat16", odt, ep, **{**default_params(), **prm}, norm_eps=NORM_EPS)
        sym = f"emu{i}_" + str(f.attrs["global_symbol"])
        funcs[sym] = f.with_attr("global_symbol", sym)
        meta.append((sym, k, o, ep, odt, prm))
    lib = EmuLib(funcs)
    rows = []
    for sym, k, o, ep, odt, prm in meta:
        oo = o // 2 if ep == "silu_mul" else o
        for n in EMU_NORM_NS:
            rng = np.random.default_rng(k + o + n)
            size = 10.0 ** rng.uniform(-2, 2, (n, 1))
            x = (rng.standard_normal((n, k)) * size).astype(np_dtype("bfloat16"))
            g = rng.uniform(0.5, 1.5, k).astype(np.float32)
            w = (rng.standard_normal((o, k)) * k ** -0.5).astype(np_dtype("bfloat16"))
            r = rng.standard_normal((n, oo)).astype(np_dtype("bfloat16"))
            y = np.full((n, oo), np.nan, np.float32).astype(np_dtype(odt))
            lib(sym, dict(x=x, g=g, w=w, out=y, **({"res": r} if ep == "residual" else {})))
            args = (x.astype(np.float32), g, w.astype(np.float32), r.astype(np.float32), ep, odt)
            got = y.astype(np.float32)
            err = rel_err(got, norm_reference(*args, fused=True))
            # bf16(x * g) / rms and bf16(x / rms * g) round differently (the silu epilogue rounds its inputs
            # again): the unfused sequence within twice the output rounding, the fused roundings within it
            err_unfused = rel_err(got, norm_reference(*args))
            row = dict(K=k, O=o, epilogue=ep, out_dtype=odt, params=prm, n=n, rel_err=err, rel_err_unfused=err_unfused,
                       ok=bool(err <= TOL[odt] and err_unfused <= 2 * TOL["bfloat16"]))
            rows.append(row)
            log(json.dumps(row))
    return rows


def run_rows_emulation(log=print) -> list[dict]:
    """The EMU_ROWS_CASES gemv_rows kernels in one emulator at every EMU_ROWS_SHAPES (m, n)."""
    from .. import gemv as G
    from .lib import EmuLib

    funcs, meta = {}, []
    for i, (k, dt, odt, prm) in enumerate(EMU_ROWS_CASES):
        f = G.gemv_rows(k, dt, odt, **{**default_params(), **prm})
        sym = f"emu{i}_" + str(f.attrs["global_symbol"])
        funcs[sym] = f.with_attr("global_symbol", sym)
        meta.append((sym, k, dt, odt, prm))
    lib = EmuLib(funcs)
    rows = []
    for sym, k, dt, odt, prm in meta:
        for m, n in EMU_ROWS_SHAPES:
            rng = np.random.default_rng(m * 100 + n)
            x = rng.standard_normal((n, k)).astype(np_dtype(dt))
            w = (rng.standard_normal((m, k)) * k ** -0.5).astype(np_dtype(dt))
            y = np.full((n, m), np.nan, np.float32).astype(np_dtype(odt))
            lib(sym, dict(x=x, w=w, out=y))
            ref = reference(x.astype(np.float32), w.astype(np.float32), None, "none", dt, odt, round_to)
            err = rel_err(y.astype(np.float32), ref)
            row = dict(K=k, dtype=dt, out_dtype=odt, params=prm, m=m, n=n, rel_err=err, ok=bool(err <= TOL[odt]))
            rows.append(row)
            log(json.dumps(row))
    return rows


def default_params() -> dict:
    """gemv keyword arguments of the kernel registry's defaults."""
    from ..registry import DEFAULT_KERNELS

    return dict(DEFAULT_KERNELS["gemv"])


def default_params_nvfp4() -> dict:
    """gemv_nvfp4 keyword arguments as the kernel set passes them (gemv(..., weight_format="nvfp4"))."""
    from .. import gemv as G

    shared = {k: v for k, v in default_params().items() if k not in ("unroll", "big_tiles")}
    return {**shared, **G.NVFP4_DEFAULTS}


def reference(x32, w32, res32, epilogue: str, dtype: str, out_dtype: str, rnd):
    """fp32/fp64 reference with the kernel's roundings; rnd(a, dtype) rounds an fp32 array to dtype."""
    y = x32.astype(np.float64) @ w32.astype(np.float64).T
    y = y.astype(np.float32)
    if epilogue == "residual":
        return rnd(res32 + rnd(y, dtype), out_dtype)
    if epilogue == "silu_mul":
        h = y.shape[1] // 2
        g, u = rnd(y[:, :h], dtype), rnd(y[:, h:], dtype)
        return rnd(g / (1 + np.exp(-g)) * u, out_dtype)
    return rnd(y, out_dtype)


def np_dtype(dtype: str):
    import ml_dtypes

    return {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16),
            "float32": np.dtype(np.float32)}[dtype]


def round_to(a, dtype):
    """fp32 values rounded to dtype (and back to fp32)."""
    return np.asarray(a, np.float32).astype(np_dtype(dtype)).astype(np.float32)


def nvfp4_weights(rng, O: int, K: int):
    """(codes uint8 [O, K/2], E4M3 block scales uint8 [O, K/16], row scales fp32 [O]) with every code value
    and, by row o % 4: block scales around 1; E4M3 subnormals (0.002-0.014); large (128-448); a mix of zero,
    the smallest normal, 1 and 1.875. Row scales make every dequantized row ~K^-0.5 in size, so the error
    check sees all four kinds."""
    codes = rng.integers(0, 256, (O, K // 2), dtype=np.uint8)
    kind = np.arange(O) % 4
    lo = np.array([0x30, 0x01, 0x70, 0])[kind][:, None]
    hi = np.array([0x40, 0x07, 0x7E, 3])[kind][:, None]
    scales = rng.integers(lo, hi + 1, (O, K // 16)).astype(np.uint8)
    mixed = kind == 3
    scales[mixed] = np.array([0x00, 0x08, 0x38, 0x3F], np.uint8)[scales[mixed]]
    typical = np.array([1.2, 4 * 2.0 ** -9, 300.0, 0.8])[kind]
    g = (K ** -0.5 / (2.93 * typical) * rng.uniform(0.7, 1.3, O)).astype(np.float32)
    return codes, scales, g


def nvfp4_dequant(codes, scales, g) -> np.ndarray:
    """The reference weight: compile/nvfp4.py's dequantization times the row scale (fp32)."""
    from .... import nvfp4

    w = nvfp4.dequantize_nvfp4(codes, scales, n=codes.shape[1] * 2)
    return (w * np.asarray(g, np.float32)[:, None]).astype(np.float32)


def emulate_case(lib, symbol: str, K: int, O: int, epilogue: str, dtype: str, out_dtype: str, n: int,
                 seed: int = 0, weight: str | None = None) -> float:
    """Run gemv (weight None) or gemv_nvfp4 (weight "nvfp4") `symbol` of EmuLib `lib` on n seeded rows;
    the rel_err vs the numpy reference (inf: NaN / an unwritten output)."""
    rng = np.random.default_rng(seed)
    OO = O // 2 if epilogue == "silu_mul" else O
    arrays: dict[str, np.ndarray] = {}
    if weight == "nvfp4":
        codes, scales, g = nvfp4_weights(rng, O, K)
        arrays.update(w=codes, ws=scales, ws2=g)
        w = nvfp4_dequant(codes, scales, g)
    x = rng.standard_normal((n, K)).astype(np_dtype(dtype))
    if weight != "nvfp4":
        arrays["w"] = (rng.standard_normal((O, K)) * K ** -0.5).astype(np_dtype(dtype))
        w = arrays["w"].astype(np.float32)
    r = rng.standard_normal((n, OO)).astype(np_dtype(dtype))
    y = np.full((n, OO), np.nan, np.float32).astype(np_dtype(out_dtype))
    arrays.update(x=x, out=y, **({"res": r} if epilogue == "residual" else {}))
    lib(symbol, arrays)
    ref = reference(x.astype(np.float32), w, r.astype(np.float32), epilogue, dtype, out_dtype, round_to)
    return rel_err(y.astype(np.float32), ref)


def run_emulation(quick: bool = False, log=print, nvfp4: bool = True) -> list[dict]:
    """The EMU_CASES (and EMU_NVFP4_CASES) kernels in one emulator, each at several n; quick: a subset."""
    from .. import gemv as G
    from .lib import EmuLib

    cases = [EMU_CASES[i] for i in (1, 2, 4, 7, 9)] if quick else EMU_CASES
    ncases = ([EMU_NVFP4_CASES[i] for i in (1, 2, 4, 6, 7, 9, 12, 16)] if quick else EMU_NVFP4_CASES) if nvfp4 else []
    funcs = {}
    meta: list[tuple[str, int, int, str, str, str, dict, Optional[str]]] = []  # the last: weight format
    for i, (k, o, ep, dt, odt, prm) in enumerate(cases):
        sym = f"emu{i}_" + G.symbol(k, o, dt, odt, ep)
        funcs[sym] = G.gemv(k, o, dt, odt, ep, **{**default_params(), **prm}).with_attr("global_symbol", sym)
        meta.append((sym, k, o, ep, dt, odt, prm, None))
    for i, (k, o, ep, dt, odt, prm) in enumerate(ncases):
        sym = f"emu{i}_" + G.symbol(k, o, dt, odt, ep, "nvfp4")
        funcs[sym] = G.gemv_nvfp4(k, o, dt, odt, ep, **{**default_params_nvfp4(), **prm}).with_attr(
            "global_symbol", sym)
        meta.append((sym, k, o, ep, dt, odt, prm, "nvfp4"))
    lib = EmuLib(funcs)
    rows = []
    for sym, k, o, ep, dt, odt, prm, wf in meta:
        for n in ((1, 5, 8, 13) if quick else (1, 2, 3, 8, 9, 13, 40)):
            err = emulate_case(lib, sym, k, o, ep, dt, odt, n, seed=n, weight=wf)
            row = dict(K=k, O=o, epilogue=ep, dtype=dt, out_dtype=odt, params=prm, n=n, rel_err=err,
                       ok=bool(err <= TOL[odt]), **({"weight": wf} if wf else {}))
            rows.append(row)
            log(json.dumps(row))
    return rows
