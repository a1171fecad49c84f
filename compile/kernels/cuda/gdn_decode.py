"""One-launch Gated DeltaNet decode step for CUDA (thread-bound TIR).

At decode a GDN layer's per-head math between the projections is a dozen tiny kernels (split of
the b/a projection, sigmoid, softplus gate, bf16 -> fp32 cast and split of the conv output, two
L2 norms of two launches each, the recurrent step, the gated RMSNorm with silu(z)); at batch 1
each launch costs more than its work. This kernel does all of it in one launch:

  gdn_decode(u[b, conv_dim] (conv output, q|k|v), ba[b, 2*Hv] (b|a projection), z[b, Hv, dv],
             A_log[Hv] f32, dt_bias[Hv] f32, norm_w[dv] f32, slot[b] i32,
             ssm[S, L, Hv, dk, dv] f32 (in place), layer i32, out[b, Hv*dv])

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


@lru_cache(maxsize=None)
def fused_gdn_decode(hk: int, hv: int, dk: int, dv: int, n_layers: int, dtype: str, eps: float):
    r = hv // hk
    NT = dv
    NE = (dk + NT - 1) // NT
    key_dim = hk * dk
    conv_dim = 2 * key_dim + hv * dv
    q_scale = float(dk) ** -0.5

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
                    os_ = T.alloc_buffer((dv,), "float32", scope="shared")
                    col = T.alloc_buffer((1,), "float32", scope="local")
                    acc = T.alloc_buffer((1,), "float32", scope="local")
                    acc2 = T.alloc_buffer((1,), "float32", scope="local")
                    dl = T.alloc_buffer((1,), "float32", scope="local")
                    gb = T.alloc_buffer((2,), "float32", scope="local")
                    kh = h // r
                    for e0 in range(NE):
                        if e0 * NT + d < dk:
                            qs[e0 * NT + d] = T.Cast("float32", u[bi, kh * dk + e0 * NT + d])
                            ks[e0 * NT + d] = T.Cast("float32", u[bi, key_dim + kh * dk + e0 * NT + d])
                    T.tvm_storage_sync("shared")
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
                    dl[0] = (T.Cast("float32", u[bi, 2 * key_dim + h * dv + d]) - acc[0] * gb[0] * kn) * gb[1]
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
                    zf = T.Cast("float32", z[bi, h, d])
                    out[bi, h * dv + d] = T.Cast(
                        dtype, T.Cast("float32", on) * (zf / (T.float32(1) + T.exp(-zf))))

    return gdn_decode.with_attr("global_symbol", f"gdn_decode_{hv}x{dk}x{dv}_{dtype}")
