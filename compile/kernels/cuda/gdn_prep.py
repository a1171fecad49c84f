"""The GDN prefill's elementwise work around the chunked delta rule, fused (thread-bound TIR, CUDA).

Between the qkv+z projection and the chunked kernel the relax path copies the projection into qkv and z
(split), runs the causal conv, casts its output to fp32 and splits it into q, k, v (three more copies),
and L2-normalises q and k in two launches each; after the chunked kernel a gated RMSNorm reads z.
At 8192 tokens that is ~70 ms of memory-bound launches per 27B prefill. Here:

  gdn_prep(qkvz[n, C + Hv*dv], cu[b+1], slot[b], pool[S, L, C, K-1] (in place), w[C, K], layer,
           q[n, Hk, dk] f32, k[n, Hk, dk] f32, v[n, Hv, dv] f32)
    u = cast(silu(causal conv of qkvz[:, :C] over its row, the stored tail before the row start)) (the
    conv kernel's bf16 output), then q = u_q / sqrt(|u_q|^2 + 1e-6) * dk^-0.5, k = u_k / sqrt(|u_k|^2 +
    1e-6), v = u_v in fp32 (the relax path's roundings and order); a second launch stores each row's new
    conv tail (the conv kernel's launch 2).
    Warp per (token, 128-channel head), lane = dk/32 adjacent channels; the L2 sums by xor shuffles.
  gdn_gated_norm(o[n, Hv, dv] f32, qkvz[n, C + Hv*dv], w[dv] f32, out[n, Hv*dv])
    out = cast(f32(cast(o * rsqrt(mean(o^2) + eps) * w)) * silu(f32(z))) with z read in place from qkvz.
Both need dk == dv, a multiple of 32 (the 27B: 128; the tiny test model: 32); other geometries keep
the relax path (the factories return None).
"""
from __future__ import annotations

from functools import lru_cache

from tvm.script import tirx as T

from .gdn import conv_taps, conv_tails

WARPS = 8


def supported(dk: int, dv: int) -> bool:
    return dk == dv and dk % 32 == 0


@lru_cache(maxsize=None)
def gdn_prep(hk: int, hv: int, dk: int, dv: int, kernel: int, n_layers: int, dtype: str):
    if not supported(dk, dv):
        return None
    taps = kernel - 1
    C = 2 * hk * dk + hv * dv
    W = C + hv * dv
    NH = 2 * hk + hv
    NGB = (NH + WARPS - 1) // WARPS
    EPL = dk // 32
    q_scale = float(dk) ** -0.5
    store_tails = conv_tails(C, kernel, dtype)
    find_row, conv_sum = conv_taps(kernel)

    @T.prim_func
    def prep(
        var_x: T.handle, var_cu: T.handle, var_slot: T.handle, var_pool: T.handle, var_w: T.handle,
        layer: T.int32, var_q: T.handle, var_k: T.handle, var_v: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        b = T.int64()
        bp1 = T.int64()
        s = T.int64()
        x = T.match_buffer(var_x, (n, W), dtype)
        cu = T.match_buffer(var_cu, (bp1,), "int32")
        slot = T.match_buffer(var_slot, (b,), "int32")
        pool = T.match_buffer(var_pool, (s, n_layers, C, taps), dtype)
        w = T.match_buffer(var_w, (C, kernel), dtype)
        q = T.match_buffer(var_q, (n, hk, dk), "float32")
        k = T.match_buffer(var_k, (n, hk, dk), "float32")
        v = T.match_buffer(var_v, (n, hv, dv), "float32")
        # (1) conv + silu + bf16 rounding + L2 norms, warp per (token, head)
        for t in T.thread_binding(n, thread="blockIdx.x"):
            for gb in T.thread_binding(NGB, thread="blockIdx.y"):
                for tx in T.thread_binding(WARPS * 32, thread="threadIdx.x"):
                    rowv = T.alloc_buffer((1,), "int32", scope="local")
                    u = T.alloc_buffer((EPL,), "float32", scope="local")
                    acc = T.alloc_buffer((1,), "float32", scope="local")
                    ss = T.alloc_buffer((1,), "float32", scope="local")
                    if gb * WARPS + tx // 32 < NH:
                        find_row(rowv, t, b, cu)
                        ss[0] = T.float32(0)
                        for e in T.unroll(EPL):
                            conv_sum(acc, rowv, t, (gb * WARPS + tx // 32) * dk + tx % 32 * EPL + e, x, w, pool, slot,
                                     cu, layer)
                            u[e] = T.Cast("float32", T.Cast(dtype, acc[0] / (T.float32(1) + T.exp(-acc[0]))))
                            ss[0] = ss[0] + u[e] * u[e]
                        for o in T.unroll(5):
                            ss[0] = ss[0] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), ss[0], 16 >> o, 32, 32)
                        for e in T.unroll(EPL):
                            if gb * WARPS + tx // 32 < hk:
                                q[t, gb * WARPS + tx // 32, tx % 32 * EPL + e] = (
                                    u[e] / T.sqrt(ss[0] + T.float32(1e-6)) * T.float32(q_scale))
                            elif gb * WARPS + tx // 32 < 2 * hk:
                                k[t, gb * WARPS + tx // 32 - hk, tx % 32 * EPL + e] = u[e] / T.sqrt(ss[0] + T.float32(1e-6))
                            else:
                                v[t, gb * WARPS + tx // 32 - 2 * hk, tx % 32 * EPL + e] = u[e]
        # (2) new tails = last K-1 entries of [old tail | row inputs] (the conv kernel's launch)
        store_tails(b, cu, slot, pool, x, layer)

    return prep.with_attr("global_symbol", f"gdn_prep_{hk}x{hv}x{dk}_{dtype}")


@lru_cache(maxsize=None)
def gdn_gated_norm(hk: int, hv: int, dk: int, dv: int, dtype: str, eps: float):
    if not supported(dk, dv):
        return None
    C = 2 * hk * dk + hv * dv
    W = C + hv * dv
    NGB = (hv + WARPS - 1) // WARPS
    EPL = dv // 32

    @T.prim_func
    def gated_norm(var_o: T.handle, var_x: T.handle, var_w: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        o = T.match_buffer(var_o, (n, hv, dv), "float32")
        x = T.match_buffer(var_x, (n, W), dtype)
        w = T.match_buffer(var_w, (dv,), "float32")
        out = T.match_buffer(var_out, (n, hv * dv), dtype)
        for t in T.thread_binding(n, thread="blockIdx.x"):
            for gb in T.thread_binding(NGB, thread="blockIdx.y"):
                for tx in T.thread_binding(WARPS * 32, thread="threadIdx.x"):
                    ov = T.alloc_buffer((EPL,), "float32", scope="local")
                    ss = T.alloc_buffer((1,), "float32", scope="local")
                    zz = T.alloc_buffer((1,), "float32", scope="local")
                    if gb * WARPS + tx // 32 < hv:
                        ss[0] = T.float32(0)
                        for e in T.unroll(EPL):
                            ov[e] = o[t, gb * WARPS + tx // 32, tx % 32 * EPL + e]
                            ss[0] = ss[0] + ov[e] * ov[e]
                        for r in T.unroll(5):
                            ss[0] = ss[0] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), ss[0], 16 >> r, 32, 32)
                        for e in T.unroll(EPL):
                            zz[0] = T.Cast("float32", x[t, C + (gb * WARPS + tx // 32) * dv + tx % 32 * EPL + e])
                            out[t, (gb * WARPS + tx // 32) * dv + tx % 32 * EPL + e] = T.Cast(dtype, T.Cast(
                                "float32", T.Cast(dtype, ov[e] / T.sqrt(ss[0] / T.float32(dv) + T.float32(eps))
                                                  * w[tx % 32 * EPL + e]))
                                * (zz[0] / (T.float32(1) + T.exp(-zz[0]))))

    return gated_norm.with_attr("global_symbol", f"gdn_gated_norm_{hv}x{dv}_{dtype}")
