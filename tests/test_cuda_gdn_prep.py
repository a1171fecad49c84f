"""The fused GDN prefill kernels (compile/kernels/cuda/gdn_prep.py) as generated CUDA on the CPU emulator
(ninfer_mlc.compile.kernels.cuda.emulate), against a numpy reference of the relax path they replace (causal
conv over ragged rows with stored tails, silu, activation-dtype rounding, L2 norms, gated RMSNorm)."""
from __future__ import annotations

import shutil

import ml_dtypes
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")

HK, HV, D, K, LAYERS, LAYER = 2, 4, 64, 4, 3, 1
EPS = 1e-6


def _np_dt(dtype):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32


def _round(x, dtype):
    return np.asarray(x, np.float32).astype(_np_dt(dtype)).astype(np.float32)


def _reference(x, cu, slot, pool, w, dtype):
    """(q, k, v, new pool) of the relax path: conv kernel output in dtype, then fp32 L2 norms."""
    C = 2 * HK * D + HV * D
    n = x.shape[0]
    xf, wf, pf = (np.asarray(a, np.float32) for a in (x[:, :C], w, pool))
    u = np.zeros((n, C), np.float32)
    new_pool = pool.copy()
    for r in range(len(cu) - 1):
        a, e = cu[r], cu[r + 1]
        seq = np.concatenate([pf[slot[r], LAYER].T, xf[a:e]], axis=0)  # [K-1 + len, C]
        for t in range(a, e):
            acc = sum(wf[:, j] * seq[t - a + j] for j in range(K))
            u[t] = _round(acc / (1 + np.exp(-acc)), dtype)
        new_pool[slot[r], LAYER] = seq[-(K - 1):].T.astype(pool.dtype)
    q = u[:, :HK * D].reshape(n, HK, D)
    k = u[:, HK * D:2 * HK * D].reshape(n, HK, D)
    v = u[:, 2 * HK * D:].reshape(n, HV, D)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * D ** -0.5
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    return q, k, v, new_pool


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gdn_prep_and_gated_norm_on_cpu_emulator(dtype, tmp_path):
    from ninfer_mlc.compile.kernels.cuda import gdn_prep
    from ninfer_mlc.compile.kernels.cuda.emulate import EmuLib

    C, VD = 2 * HK * D + HV * D, HV * D
    rng = np.random.default_rng(3)
    lens = [5, 0, 1, 13, 3]  # an empty row, a 1-token row, rows shorter than the conv
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    n, b = int(cu[-1]), len(lens)
    slot = np.array([3, 0, 5, 1, 2], np.int32)
    dt = _np_dt(dtype)
    x = rng.standard_normal((n, C + VD)).astype(dt)
    w = (rng.standard_normal((C, K)) * 0.5).astype(dt)
    pool = rng.standard_normal((6, LAYERS, C, K - 1)).astype(dt)
    q_ref, k_ref, v_ref, pool_ref = _reference(x, cu, slot, pool, w, dtype)

    prep = gdn_prep.gdn_prep(HK, HV, D, D, K, LAYERS, dtype).with_attr("global_symbol", "prep")
    gn = gdn_prep.gdn_gated_norm(HK, HV, D, D, dtype, EPS).with_attr("global_symbol", "gnorm")
    lib = EmuLib({"prep": prep, "gnorm": gn}, workdir=tmp_path)
    nan = np.float32("nan")
    arrs = dict(x=x, cu=cu, slot=slot, pool=pool.copy(), w=w, q=np.full((n, HK, D), nan, np.float32),
                k=np.full((n, HK, D), nan, np.float32), v=np.full((n, HV, D), nan, np.float32))
    lib("prep", arrs, dict(n=n, b=b, bp1=b + 1, s=pool.shape[0], layer=LAYER))
    tol = 1e-5 if dtype == "float32" else 1e-2  # bf16: a rounding step of u may flip
    for name, ref in (("q", q_ref), ("k", k_ref), ("v", v_ref)):
        got = arrs[name]
        assert np.isfinite(got).all(), name
        assert np.abs(got - ref).max() / np.abs(ref).max() < tol, name
    assert np.array_equal(arrs["pool"].view(np.uint8), pool_ref.view(np.uint8)), "conv tails"

    o = rng.standard_normal((n, HV, D)).astype(np.float32)
    nw = rng.standard_normal(D).astype(np.float32)
    out = np.full((n, VD), nan, np.float32).astype(dt)
    lib("gnorm", dict(o=o, x=x, w=nw, out=out), dict(n=n))
    z = np.asarray(x[:, C:], np.float32).reshape(n, HV, D)
    normed = _round(o / np.sqrt((o * o).mean(-1, keepdims=True) + EPS) * nw, dtype)
    ref = _round(normed * z / (1 + np.exp(-z)), dtype).reshape(n, VD)
    assert np.abs(out.astype(np.float32) - ref).max() / np.abs(ref).max() < (1e-5 if dtype == "float32" else 1e-2)


def test_gdn_prep_replaces_the_split_copies():
    """CUDA prefill traces no split of the qkv+z projection and no separate L2 norms: one gdn_prep and one
    gdn_gated_norm per GDN layer; decode keeps its fused path and llvm the relax ops."""
    import re

    from ninfer_mlc.compile import tiny_default
    from ninfer_mlc.compile.config import parse_config
    from ninfer_mlc.compile.model import Qwen3xForCausalLM

    cfg = parse_config(tiny_default.CONFIG)
    n_gdn = cfg.layer_types.count("linear_attention")
    for kind in ("cuda", "llvm"):
        m = Qwen3xForCausalLM(cfg, "bfloat16", kind, None)
        mod = m.export_tvm(spec=m.export_spec())[0]
        pre = mod["prefill"].script()
        dec = mod["decode"].script()
        if kind == "cuda":
            assert len(re.findall(r"call_tir_inplace\((?:cls\.)?gdn_prep", pre)) == n_gdn
            assert len(re.findall(r"call_tir\((?:cls\.)?gdn_gated_norm", pre)) == n_gdn
            assert "gdn_prep" not in dec and "gdn_gated_norm" not in dec
        else:
            assert "gdn_prep" not in pre and "gdn_gated_norm" not in pre
