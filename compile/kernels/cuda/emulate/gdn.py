"""Checks of the CUDA chunked GDN prefill (compile/kernels/cuda/gdn.py chunked_delta_rule): model-like
seeded inputs, a deterministic initial state, the llvm kernel as reference, and emulate_case, which runs
the generated CUDA on the CPU emulator against it.

Inputs follow the model: q, k l2-normalised (q also times dk^-0.5), beta in (0.1, 0.9), g < 0. "strong"
decays are g ~ -U(0.01, 0.5) (the carried state barely reaches o after a chunk); "mixed" decays are
log-uniform in [-0.5, -0.001] so the inter-chunk state path is exercised. bench/gdn_gpu_check.py uses the
same inputs on the GPU. Numpy only at module level.
"""
from __future__ import annotations

import json
import time

import numpy as np

from .numerics import cu_seqlens, l2_qk, rel_err

LAYERS, LAYER = 2, 1  # state pools hold 2 layers; the call updates layer 1
# emulated cases: (hk, hv, dk, dv), row lengths, decays, chunked_delta_rule keywords[, tolerance]
EMU_QUICK = [
    dict(geo=(2, 6, 16, 8), lens=[150, 0, 64, 1, 33], decay="strong", kw={}),  # 1 lane per column
    dict(geo=(2, 6, 16, 8), lens=[150, 0, 64, 1, 33], decay="mixed", kw={}),
    dict(geo=(2, 6, 16, 8), lens=[70, 33, 5], decay="mixed", kw=dict(ept=4)),  # 4 lanes, shuffles
    dict(geo=(1, 2, 64, 16), lens=[40, 64, 1], decay="mixed", kw=dict(ept=8, state_tile=4, mma=False)),  # 8 lanes, swizzle
    # tensor-core passes (dk % 64 == 0): 1, 2 and 4 n tiles, 3xTF32 and plain tf32
    dict(geo=(1, 2, 64, 16), lens=[70, 0, 33, 1, 64], decay="mixed", kw=dict(mma_tile=8)),
    dict(geo=(1, 3, 64, 16), lens=[40, 64, 0, 5], decay="strong", kw=dict(mma_tile=16)),
    dict(geo=(1, 2, 64, 32), lens=[33, 0, 96, 1, 31], decay="mixed", kw={}),  # default tile 32: 4 n tiles
    dict(geo=(1, 2, 64, 16), lens=[70, 0, 33, 1, 64], decay="mixed", kw=dict(mma_tile=16, tf32x3=False),
         tol=3e-3),
]
EMU_FULL = [
    dict(geo=(2, 6, 128, 128), lens=[70, 0, 33, 1, 64], decay="mixed", kw={}),
    dict(geo=(16, 48, 128, 128), lens=[70, 33, 5], decay="mixed", kw={}),
]


def layout(dk: int, dv: int, kw: dict) -> dict:
    """The layout chunked_delta_rule derives from its keywords kw (see compile/kernels/cuda/gdn.py)."""
    from .. import gdn

    chunk, tile, ept = kw.get("chunk", gdn.CHUNK), kw.get("state_tile", gdn.STATE_TILE), kw.get("ept", gdn.STATE_EPT)
    if kw.get("passes", 3) != 3:
        return dict(layout(dk, dv, {k: x for k, x in kw.items() if k != "passes"}), passes=kw["passes"])
    mma = kw.get("mma")
    mtile = kw.get("mma_tile", gdn.MMA_TILE)
    mma = gdn.mma_applies(dk, dv, chunk, mtile) if mma is None else mma
    C, EPT, G, DVT, NT1 = gdn._chunk_layout(dk, dv, chunk, tile, ept)
    if mma:
        C, DVT = gdn._mma_layout(dk, dv, chunk, mtile)
        return dict(chunk=C, state_tile=DVT, threads_pass1=gdn.MMA_THREADS[0], threads_pass2=gdn.MMA_THREADS[1],
                    mma="tf32x3" if kw.get("tf32x3", True) else "tf32")
    return dict(chunk=C, ept=EPT, lanes=G, state_tile=DVT, threads_pass1=NT1, threads_pass2=DVT * G, mma=False)


def state_init(shape) -> np.ndarray:
    """Deterministic pseudo-random initial state, exact on any machine (integer hash, power-of-two
    division): a GPU check need not carry the pool."""
    n = int(np.prod(shape))
    u = (np.arange(n, dtype=np.uint64) * np.uint64(2654435761) + np.uint64(12345)) % np.uint64(1 << 32)
    return ((u.astype(np.float64) / float(1 << 32) - 0.5) * 0.6).astype(np.float32).reshape(shape)


def inputs(geo, lens, decay: str, seed: int) -> dict:
    """q, k, v, g, beta, cu (cu_seqlens), slot (distinct state slots of 0..len(lens)) of one call."""
    hk, hv, dk, dv = geo
    rng = np.random.default_rng(seed)
    n = sum(lens)
    cu = cu_seqlens(lens)
    slots = rng.permutation(len(lens) + 1)[:len(lens)].astype(np.int32)
    q, k = l2_qk(rng, n, hk, dk)
    v = rng.standard_normal((n, hv, dv)).astype(np.float32)
    if decay == "strong":
        g = -rng.uniform(0.01, 0.5, (n, hv))
    else:
        g = -np.exp(rng.uniform(np.log(1e-3), np.log(0.5), (n, hv)))
    beta = rng.uniform(0.1, 0.9, (n, hv)).astype(np.float32)
    return dict(q=q, k=k, v=v, g=g.astype(np.float32), beta=beta, cu=cu, slot=slots)


def llvm_kernels(geos) -> dict:
    """{geometry: callable} of the llvm kernel set's chunked_delta_rule for each (hk, hv, dk, dv), one build."""
    import tvm

    from ...registry import kernel_set

    geos = list(dict.fromkeys(tuple(g) for g in geos))
    sym = {g: "ref_" + "_".join(map(str, g)) for g in geos}
    lib = tvm.compile(tvm.IRModule({sym[g]: kernel_set("llvm").chunked_delta_rule(*g, LAYERS).with_attr(
        "global_symbol", sym[g]) for g in geos}), target=tvm.target.Target({"kind": "llvm"}))
    return {g: lib[sym[g]] for g in geos}


def llvm_outputs(fn, x: dict, ssm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(o, new state pool) of an llvm chunked_delta_rule (llvm_kernels) on inputs x and pool ssm."""
    import tvm

    hv, dv = x["v"].shape[1], x["v"].shape[2]
    cpu = tvm.cpu()
    t = [tvm.runtime.tensor(np.ascontiguousarray(a), cpu) for a in
         (x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"], x["slot"], ssm,
          np.full((x["q"].shape[0], hv, dv), np.nan, np.float32))]
    fn(*t[:8], LAYER, t[8])
    return t[8].numpy(), t[7].numpy()


def _check(case: dict, lib, symbol: str, ref_fn, log) -> dict:
    geo, kw = tuple(case["geo"]), dict(case.get("kw", {}))
    hk, hv, dk, dv = geo
    x = inputs(geo, case["lens"], case["decay"], seed=7)
    ssm = state_init((len(case["lens"]) + 1, LAYERS, hv, dk, dv))
    ref_o, ref_s = llvm_outputs(ref_fn, x, ssm)
    o = np.full((x["q"].shape[0], hv, dv), np.nan, np.float32)
    got_s = ssm.copy()
    t = time.time()
    lib(symbol, dict(x, ssm=got_s, o=o), dict(layer=LAYER))
    other = np.ones(ssm.shape[:2], bool)
    other[x["slot"], LAYER] = False
    row = dict(geo=list(geo), lens=case["lens"], decay=case["decay"], kw=kw,
               layout=case.get("layout") or layout(dk, dv, kw),
               o_err=rel_err(o, ref_o), state_err=rel_err(got_s, ref_s),
               untouched_equal=bool(np.array_equal(got_s[other], ssm[other])), seconds=time.time() - t)
    tol = case.get("tol", 1e-5)
    row["ok"] = row["o_err"] < tol and row["state_err"] < tol and row["untouched_equal"]
    log(json.dumps(row))
    return row


def run_emulation(cases=None, quick: bool = True, log=print) -> list[dict]:
    """Each case's gdn_chunk generated for cuda:sm_90 and run on the CPU emulator, and the llvm kernel on the
    same inputs (seed 7): the relative errors of o and of the new state pool, whether the other state entries
    stayed put, ok. Default cases: EMU_QUICK (+ EMU_FULL unless quick). One emulator and one llvm build."""
    from .. import gdn
    from .lib import EmuLib

    cases = cases if cases is not None else EMU_QUICK + ([] if quick else EMU_FULL)
    lib = EmuLib({f"gdn_{i}": gdn.chunked_delta_rule(*c["geo"], LAYERS, **c["kw"]).with_attr("global_symbol", f"gdn_{i}")
                  for i, c in enumerate(cases)})
    refs = llvm_kernels(c["geo"] for c in cases)
    return [_check(c, lib, f"gdn_{i}", refs[tuple(c["geo"])], log) for i, c in enumerate(cases)]


# short_delta_rule (verify / replay calls: few rows per sequence), against the llvm chunked kernel
EMU_SHORT = [
    dict(geo=(2, 6, 16, 8), lens=[5, 0, 1, 8, 3], decay="mixed"),
    dict(geo=(1, 2, 128, 128), lens=[4, 1, 8], decay="strong"),
]


def run_short_emulation(cases=None, log=print) -> list[dict]:
    """Each case's gdn_short (compile/kernels/cuda/gdn.py short_delta_rule) for cuda:sm_90 on the CPU emulator
    against the llvm chunked kernel on the same inputs: errors of o and of the new state pool, ok."""
    from .. import gdn
    from .lib import EmuLib

    cases = [dict(c, layout={"kernel": "short"}) for c in (cases if cases is not None else EMU_SHORT)]
    def build(i: int, geo) -> object:
        hk, hv, dk, dv = geo
        return gdn.short_delta_rule(hk, hv, dk, dv, LAYERS).with_attr("global_symbol", f"gdn_short_{i}")

    lib = EmuLib({f"gdn_short_{i}": build(i, c["geo"]) for i, c in enumerate(cases)})
    refs = llvm_kernels(c["geo"] for c in cases)
    return [_check(c, lib, f"gdn_short_{i}", refs[tuple(c["geo"])], log) for i, c in enumerate(cases)]
