"""Gated DeltaNet kernels: causal conv with a carried tail, chunked prefill, one-step decode.

State lives in runtime-owned slot pools so the runtime can park, copy and restore it:
  conv pool [num_slots, n_gdn_layers, conv_dim, K-1]  (last K-1 pre-conv inputs, oldest first)
  ssm pool  [num_slots, n_gdn_layers, Hv, dk, dv]     (fp32, transformers' layout)
Each batch row names its slot; sequences are ragged, row b owns tokens cu[b]..cu[b+1].

Portable (llvm) versions: plain loops, fp32 math. Exponents are always <= 0 (see qwen3x_arch §4.3).
"""
from __future__ import annotations

from functools import lru_cache

from tvm.script import tirx as T

CHUNK = 64


@lru_cache(maxsize=None)
def causal_conv(conv_dim: int, kernel: int, n_layers: int, dtype: str):
    """Depthwise causal conv + SiLU over each row's tokens, continuing from its stored tail."""
    taps = kernel - 1

    @T.prim_func
    def conv(
        var_x: T.handle, var_cu: T.handle, var_slot: T.handle, var_pool: T.handle, var_w: T.handle,
        layer: T.int32, var_out: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        b = T.int64()
        bp1 = T.int64()
        s = T.int64()
        x = T.match_buffer(var_x, (n, conv_dim), dtype)
        cu = T.match_buffer(var_cu, (bp1,), "int32")
        slot = T.match_buffer(var_slot, (b,), "int32")
        pool = T.match_buffer(var_pool, (s, n_layers, conv_dim, taps), dtype)
        w = T.match_buffer(var_w, (conv_dim, kernel), dtype)
        out = T.match_buffer(var_out, (n, conv_dim), dtype)
        acc = T.alloc_buffer((1,), "float32", scope="local")
        for bi in range(b):
            for t, c in T.grid(cu[bi + 1] - cu[bi], conv_dim):
                acc[0] = T.float32(0)
                for j in range(kernel):
                    # input index relative to the row start; negative reads the stored tail
                    if t - taps + j >= 0:
                        acc[0] = acc[0] + T.Cast("float32", w[c, j]) * T.Cast(
                            "float32", x[cu[bi] + t - taps + j, c])
                    else:
                        acc[0] = acc[0] + T.Cast("float32", w[c, j]) * T.Cast(
                            "float32", pool[slot[bi], layer, c, t + j])
                out[cu[bi] + t, c] = T.Cast(dtype, acc[0] / (T.float32(1) + T.exp(-acc[0])))
            # new tail = last K-1 entries of [old tail | inputs]; ascending m never clobbers a
            # source it still needs (source index >= m)
            for c, m in T.grid(conv_dim, taps):
                if cu[bi + 1] - cu[bi] + m < taps:
                    pool[slot[bi], layer, c, m] = pool[slot[bi], layer, c, cu[bi + 1] - cu[bi] + m]
                else:
                    pool[slot[bi], layer, c, m] = x[cu[bi + 1] - taps + m, c]

    return conv


@lru_cache(maxsize=None)
def chunked_delta_rule(hk: int, hv: int, dk: int, dv: int, n_layers: int, chunk: int = CHUNK):
    """Chunked gated delta rule (WY/UT form, chunk 64) starting from each row's stored state.

    q is l2-normalised and scaled, k l2-normalised, g the log-decay (<= 0), all fp32.
    """
    r = hv // hk

    @T.prim_func
    def gdn_chunk(
        var_q: T.handle, var_k: T.handle, var_v: T.handle, var_g: T.handle, var_beta: T.handle,
        var_cu: T.handle, var_slot: T.handle, var_ssm: T.handle, layer: T.int32, var_o: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        b = T.int64()
        bp1 = T.int64()
        s = T.int64()
        q = T.match_buffer(var_q, (n, hk, dk), "float32")
        k = T.match_buffer(var_k, (n, hk, dk), "float32")
        v = T.match_buffer(var_v, (n, hv, dv), "float32")
        g = T.match_buffer(var_g, (n, hv), "float32")
        beta = T.match_buffer(var_beta, (n, hv), "float32")
        cu = T.match_buffer(var_cu, (bp1,), "int32")
        slot = T.match_buffer(var_slot, (b,), "int32")
        ssm = T.match_buffer(var_ssm, (s, n_layers, hv, dk, dv), "float32")
        o = T.match_buffer(var_o, (n, hv, dv), "float32")
        gam = T.alloc_buffer((chunk,), "float32")
        amat = T.alloc_buffer((chunk, chunk), "float32")
        qk = T.alloc_buffer((chunk, chunk), "float32")
        u = T.alloc_buffer((chunk, dv), "float32")
        wm = T.alloc_buffer((chunk, dk), "float32")
        acc = T.alloc_buffer((1,), "float32", scope="local")
        for bi, h in T.grid(b, hv):
            for c in T.serial((cu[bi + 1] - cu[bi] + chunk - 1) // chunk):
                c0 = cu[bi] + c * chunk
                ln = T.min(chunk, cu[bi + 1] - c0)
                # cumulative log-decay inside the chunk
                acc[0] = T.float32(0)
                for t in range(ln):
                    acc[0] = acc[0] + g[c0 + t, h]
                    gam[t] = acc[0]
                # A (strictly lower) and Q K^T (lower incl. diagonal)
                for i in range(ln):
                    for j in range(i + 1):
                        acc[0] = T.float32(0)
                        for e in range(dk):
                            acc[0] = acc[0] + k[c0 + i, h // r, e] * k[c0 + j, h // r, e]
                        amat[i, j] = beta[c0 + i, h] * T.exp(gam[i] - gam[j]) * acc[0]
                        acc[0] = T.float32(0)
                        for e in range(dk):
                            acc[0] = acc[0] + q[c0 + i, h // r, e] * k[c0 + j, h // r, e]
                        qk[i, j] = T.exp(gam[i] - gam[j]) * acc[0]
                # U = (I+A)^-1 (beta V), W = (I+A)^-1 (beta e^gam K) by forward substitution
                for i in range(ln):
                    for d in range(dv):
                        u[i, d] = beta[c0 + i, h] * v[c0 + i, h, d]
                    for e in range(dk):
                        wm[i, e] = beta[c0 + i, h] * T.exp(gam[i]) * k[c0 + i, h // r, e]
                    for j in range(i):
                        for d in range(dv):
                            u[i, d] = u[i, d] - amat[i, j] * u[j, d]
                        for e in range(dk):
                            wm[i, e] = wm[i, e] - amat[i, j] * wm[j, e]
                # V_new = U - W S0 (kept in u)
                for i, d in T.grid(ln, dv):
                    acc[0] = T.float32(0)
                    for e in range(dk):
                        acc[0] = acc[0] + wm[i, e] * ssm[slot[bi], layer, h, e, d]
                    u[i, d] = u[i, d] - acc[0]
                # O = (Q e^gam) S0 + (QK^T . M) V_new
                for i, d in T.grid(ln, dv):
                    acc[0] = T.float32(0)
                    for e in range(dk):
                        acc[0] = acc[0] + q[c0 + i, h // r, e] * ssm[slot[bi], layer, h, e, d]
                    acc[0] = acc[0] * T.exp(gam[i])
                    for j in range(i + 1):
                        acc[0] = acc[0] + qk[i, j] * u[j, d]
                    o[c0 + i, h, d] = acc[0]
                # S = e^gam_last S0 + (K e^(gam_last - gam))^T V_new
                for e, d in T.grid(dk, dv):
                    acc[0] = ssm[slot[bi], layer, h, e, d] * T.exp(gam[ln - 1])
                    for j in range(ln):
                        acc[0] = acc[0] + T.exp(gam[ln - 1] - gam[j]) * k[c0 + j, h // r, e] * u[j, d]
                    ssm[slot[bi], layer, h, e, d] = acc[0]

    return gdn_chunk


@lru_cache(maxsize=None)
def recurrent_delta_rule(hk: int, hv: int, dk: int, dv: int, n_layers: int):
    """One decode step per batch row: decay, delta update, read (FLA fused_recurrent order)."""
    r = hv // hk

    @T.prim_func
    def gdn_step(
        var_q: T.handle, var_k: T.handle, var_v: T.handle, var_g: T.handle, var_beta: T.handle,
        var_slot: T.handle, var_ssm: T.handle, layer: T.int32, var_o: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        b = T.int64()
        s = T.int64()
        q = T.match_buffer(var_q, (b, hk, dk), "float32")
        k = T.match_buffer(var_k, (b, hk, dk), "float32")
        v = T.match_buffer(var_v, (b, hv, dv), "float32")
        g = T.match_buffer(var_g, (b, hv), "float32")
        beta = T.match_buffer(var_beta, (b, hv), "float32")
        slot = T.match_buffer(var_slot, (b,), "int32")
        ssm = T.match_buffer(var_ssm, (s, n_layers, hv, dk, dv), "float32")
        o = T.match_buffer(var_o, (b, hv, dv), "float32")
        delta = T.alloc_buffer((dv,), "float32")
        acc = T.alloc_buffer((1,), "float32", scope="local")
        for bi, h in T.grid(b, hv):
            for e, d in T.grid(dk, dv):
                ssm[slot[bi], layer, h, e, d] = ssm[slot[bi], layer, h, e, d] * T.exp(g[bi, h])
            for d in range(dv):
                acc[0] = T.float32(0)
                for e in range(dk):
                    acc[0] = acc[0] + ssm[slot[bi], layer, h, e, d] * k[bi, h // r, e]
                delta[d] = (v[bi, h, d] - acc[0]) * beta[bi, h]
            for e, d in T.grid(dk, dv):
                ssm[slot[bi], layer, h, e, d] = ssm[slot[bi], layer, h, e, d] + k[bi, h // r, e] * delta[d]
            for d in range(dv):
                acc[0] = T.float32(0)
                for e in range(dk):
                    acc[0] = acc[0] + ssm[slot[bi], layer, h, e, d] * q[bi, h // r, e]
                o[bi, h, d] = acc[0]

    return gdn_step
