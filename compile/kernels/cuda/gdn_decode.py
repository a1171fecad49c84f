"""One-launch Gated DeltaNet decode step for CUDA (thread-bound TIR), with the causal conv folded in.

At decode a GDN layer's per-head math between the projections is a dozen tiny kernels (split of
the b/a projection, sigmoid, softplus gate, bf16 -> fp32 cast and split of the conv output, two
L2 norms of two launches each, the recurrent step, the gated RMSNorm with silu(z)); at batch 1
each launch costs more than its work (~2-3 us of fixed overhead inside the CUDA graph). Two kernels:

  gdn_decode(u[b, conv_dim] (conv output, q|k|v), ba[b, 2*Hv] (b|a projection), z[b, Hv, dv],
             A_log[Hv] f32, dt_bias[Hv] f32, norm_w[dv] f32, slot[b] i32,
             ssm[S, L, Hv, dk, dv] f32 (in place), layer i32, out[b, Hv*dv])
    after the split of the projection into qkv | z and the causal conv's two launches: one launch.
  gdn_decode_conv(qkvz[b, conv_dim + Hv*dv] (the in_proj output, read in place: no split), cu[b+1] i32
                  (the identity: one token per row), ba, conv_pool[S, L, conv_dim, K-1] (in place),
                  conv_w[conv_dim, K], A_log, dt_bias, norm_w, slot, ssm (in place), layer, out)
    the same step with the conv in it: 2 launches instead of 4 (split, conv outputs, conv tails,
    gdn_decode). Each block computes the conv outputs of the channels it needs from the OLD tail in the
    pool and this row's input (gdn.py's conv_taps): q and k of its key head (recomputed by each of the
    Hv/Hk value heads sharing it: dk * K FMAs, cheap) and v of its own column; the conv output is
    rounded to the activation dtype (silu, cast) before the fp32 math, as the conv kernel's output is,
    so the two paths agree bit for bit. The r = Hv/Hk blocks of a key head read its q/k tails, so no
    block may overwrite them: the new tails are a second launch (gdn.py's conv_tails, x = qkvz in place)
    after every block of the first has read the old ones (stream order).

block per (row, value head), thread per value column d (the thread walks its state column S[:, d]
twice: k.S first, then the update, writing S and summing q.S):
  q, k of the head's key head staged in shared memory; L2 norms summed by every thread from
  shared memory (dk floats: cheaper than a tree and barrier-free); q *= dk^-0.5
  beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)     (softplus as relax's: x > 20 -> x)
  S = e^g S;  delta = beta (v - k.S);  S += k delta;  o = q.S
  o_n = bf16(o * rsqrt(mean(o^2) + eps) * w);  out = bf16(f32(o_n) * silu(f32(z)))
The roundings follow the unfused relax path (the norm's output is cast to the activation dtype
before the gate), so the two differ only by fp32 summation order.
"""
from __future__ import annotations

from functools import lru_cache

from tvm.script import tirx as T

from .gdn import conv_taps, conv_tails


def _delta_step(hv: int, dk: int, dv: int, dtype: str, eps: float):
    """Macro step(bi, h, d, qs, ks, v, z, ba, a_log, dt_bias, w, slot, ssm, layer, out): thread d of block
    (row bi, value head h) after q, k (fp32, before their L2 norms) are staged in shared qs, ks and a barrier:
    gates, norms, the recurrent step on state column d, the gated RMSNorm; v and z: this column's value and
    gate (fp32 expressions, read where they are used)."""
    q_scale = float(dk) ** -0.5

    @T.macro
    def step(bi, h, d, qs, ks, v, z, ba, a_log, dt_bias, w, slot, ssm, layer, out):
        os_ = T.alloc_buffer((dv,), "float32", scope="shared")
        col = T.alloc_buffer((1,), "float32", scope="local")
        acc = T.alloc_buffer((1,), "float32", scope="local")
        acc2 = T.alloc_buffer((1,), "float32", scope="local")
        dl = T.alloc_buffer((1,), "float32", scope="local")
        gb = T.alloc_buffer((2,), "float32", scope="local")
        acc[0] = T.float32(0)
        acc2[0] = T.float32(0)
        for e in T.unroll(dk):
            acc[0] = acc[0] + qs[e] * qs[e]
            acc2[0] = acc2[0] + ks[e] * ks[e]
        qn = T.float32(q_scale) / T.sqrt(acc[0] + T.float32(1e-6))
        kn = T.float32(1.0) / T.sqrt(acc2[0] + T.float32(1e-6))
        # gates (every thread computes the same two scalars)
        gb[1] = T.float32(1) / (T.float32(1) + T.exp(-T.Cast("float32", ba[bi, h])))
        xa = T.Cast("float32", ba[bi, hv + h]) + dt_bias[h]
        gb[0] = -T.exp(a_log[h]) * T.Select(xa > T.float32(20), xa,
                                              T.log(T.float32(1) + T.exp(xa)))
        # two passes over the state column (the second one hits L2): holding all dk
        # values in registers next to the rest spilled and ran 7x slower on the H200
        gb[0] = T.exp(gb[0])
        acc[0] = T.float32(0)
        for e in T.unroll(dk):
            acc[0] = acc[0] + ssm[slot[bi], layer, h, e, d] * ks[e]
        dl[0] = (v - acc[0] * gb[0] * kn) * gb[1]
        acc[0] = T.float32(0)
        for e in T.unroll(dk):
            col[0] = ssm[slot[bi], layer, h, e, d] * gb[0] + ks[e] * kn * dl[0]
            acc[0] = acc[0] + col[0] * qs[e]
            ssm[slot[bi], layer, h, e, d] = col[0]
        acc[0] = acc[0] * qn
        os_[d] = acc[0]
        T.tvm_storage_sync("shared")
        acc2[0] = T.float32(0)
        for e in T.unroll(dv):
            acc2[0] = acc2[0] + os_[e] * os_[e]
        on = T.Cast(dtype, acc[0] / T.sqrt(acc2[0] / T.float32(dv) + T.float32(eps)) * w[d])
        zf = z
        out[bi, h * dv + d] = T.Cast(dtype, T.Cast("float32", on) * (zf / (T.float32(1) + T.exp(-zf))))

    return step


@lru_cache(maxsize=None)
def fused_gdn_decode(hk: int, hv: int, dk: int, dv: int, n_layers: int, dtype: str, eps: float):
    r = hv // hk
    NT = dv
    NE = (dk + NT - 1) // NT
    key_dim = hk * dk
    conv_dim = 2 * key_dim + hv * dv
    step = _delta_step(hv, dk, dv, dtype, eps)

    @T.prim_func
    def gdn_decode(
        var_u: T.handle, var_ba: T.handle, var_z: T.handle, var_alog: T.handle, var_dtb: T.handle,
        var_w: T.handle, var_slot: T.handle, var_ssm: T.handle, layer: T.int32, var_out: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        b = T.int64()
        s = T.int64()
        u = T.match_buffer(var_u, (b, conv_dim), dtype)
        ba = T.match_buffer(var_ba, (b, 2 * hv), dtype)
        z = T.match_buffer(var_z, (b, hv, dv), dtype)
        a_log = T.match_buffer(var_alog, (hv,), "float32")
        dt_bias = T.match_buffer(var_dtb, (hv,), "float32")
        w = T.match_buffer(var_w, (dv,), "float32")
        slot = T.match_buffer(var_slot, (b,), "int32")
        ssm = T.match_buffer(var_ssm, (s, n_layers, hv, dk, dv), "float32")
        out = T.match_buffer(var_out, (b, hv * dv), dtype)
        for bi in T.thread_binding(b, thread="blockIdx.x"):
            for h in T.thread_binding(hv, thread="blockIdx.y"):
                for d in T.thread_binding(NT, thread="threadIdx.x"):
                    ks = T.alloc_buffer((dk,), "float32", scope="shared")
                    qs = T.alloc_buffer((dk,), "float32", scope="shared")
                    kh = h // r
                    for e0 in range(NE):
                        if e0 * NT + d < dk:
                            qs[e0 * NT + d] = T.Cast("float32", u[bi, kh * dk + e0 * NT + d])
                            ks[e0 * NT + d] = T.Cast("float32", u[bi, key_dim + kh * dk + e0 * NT + d])
                    T.tvm_storage_sync("shared")
                    step(bi, h, d, qs, ks, T.Cast("float32", u[bi, 2 * key_dim + h * dv + d]),
                         T.Cast("float32", z[bi, h, d]), ba, a_log, dt_bias, w, slot, ssm, layer, out)

    return gdn_decode.with_attr("global_symbol", f"gdn_decode_{hv}x{dk}x{dv}_{dtype}")


@lru_cache(maxsize=None)
def fused_gdn_decode_conv(hk: int, hv: int, dk: int, dv: int, kernel: int, n_layers: int, dtype: str, eps: float, *,
                          threads: int = 256):
    """gdn_decode with the causal conv in it, reading the projection qkvz in place (module docstring); threads: the
    tails launch's block (the conv kernel's, registry "causal_conv")."""
    r = hv // hk
    NT = dv
    NE = (dk + NT - 1) // NT
    taps = kernel - 1
    key_dim = hk * dk
    conv_dim = 2 * key_dim + hv * dv
    width = conv_dim + hv * dv
    step = _delta_step(hv, dk, dv, dtype, eps)
    _find_row, conv_sum = conv_taps(kernel)
    store_tails = conv_tails(conv_dim, kernel, dtype, threads)

    @T.macro
    def conv_out(dst, i, acc, rowv, bi, c, x, cw, pool, slot, cu, layer):
        # the conv kernel's output (silu, rounded to the activation dtype) as fp32
        conv_sum(acc, rowv, bi, c, x, cw, pool, slot, cu, layer)
        dst[i] = T.Cast("float32", T.Cast(dtype, acc[0] / (T.float32(1) + T.exp(-acc[0]))))

    @T.prim_func
    def gdn_decode_conv(
        var_x: T.handle, var_cu: T.handle, var_ba: T.handle, var_pool: T.handle, var_cw: T.handle,
        var_alog: T.handle, var_dtb: T.handle, var_w: T.handle, var_slot: T.handle, var_ssm: T.handle,
        layer: T.int32, var_out: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        b = T.int64()
        s = T.int64()
        x = T.match_buffer(var_x, (b, width), dtype)
        cu = T.match_buffer(var_cu, (b + 1,), "int32")
        ba = T.match_buffer(var_ba, (b, 2 * hv), dtype)
        pool = T.match_buffer(var_pool, (s, n_layers, conv_dim, taps), dtype)
        cw = T.match_buffer(var_cw, (conv_dim, kernel), dtype)
        a_log = T.match_buffer(var_alog, (hv,), "float32")
        dt_bias = T.match_buffer(var_dtb, (hv,), "float32")
        w = T.match_buffer(var_w, (dv,), "float32")
        slot = T.match_buffer(var_slot, (b,), "int32")
        ssm = T.match_buffer(var_ssm, (s, n_layers, hv, dk, dv), "float32")
        out = T.match_buffer(var_out, (b, hv * dv), dtype)
        # (1) conv outputs of the block's channels from the old tails, then the recurrent step
        for bi in T.thread_binding(b, thread="blockIdx.x"):
            for h in T.thread_binding(hv, thread="blockIdx.y"):
                for d in T.thread_binding(NT, thread="threadIdx.x"):
                    ks = T.alloc_buffer((dk,), "float32", scope="shared")
                    qs = T.alloc_buffer((dk,), "float32", scope="shared")
                    vv = T.alloc_buffer((1,), "float32", scope="local")
                    cacc = T.alloc_buffer((1,), "float32", scope="local")
                    rowv = T.alloc_buffer((1,), "int32", scope="local")
                    rowv[0] = T.Cast("int32", bi)  # one token per row: token bi is row bi
                    kh = h // r
                    for e0 in range(NE):
                        if e0 * NT + d < dk:
                            conv_out(qs, e0 * NT + d, cacc, rowv, bi, kh * dk + e0 * NT + d, x, cw, pool, slot, cu,
                                     layer)
                            conv_out(ks, e0 * NT + d, cacc, rowv, bi, key_dim + kh * dk + e0 * NT + d, x, cw, pool,
                                     slot, cu, layer)
                    conv_out(vv, 0, cacc, rowv, bi, 2 * key_dim + h * dv + d, x, cw, pool, slot, cu, layer)
                    T.tvm_storage_sync("shared")
                    step(bi, h, d, qs, ks, vv[0], T.Cast("float32", x[bi, conv_dim + h * dv + d]), ba, a_log,
                         dt_bias, w, slot, ssm, layer, out)
        # (2) new tails = the last K-1 entries of [old tail | the row's input] (the conv kernel's launch 2)
        store_tails(b, cu, slot, pool, x, layer)

    return gdn_decode_conv.with_attr("global_symbol", f"gdn_decode_conv_{hv}x{dk}x{dv}_{dtype}")
