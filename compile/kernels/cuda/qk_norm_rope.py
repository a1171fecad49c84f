"""The gated attention's q/k preparation in one CUDA launch (thread-bound TIR).

Between the fused qkv projection and the paged attention, GatedAttention.forward ran on CUDA: the split of
the projection into q|gate, k, v (split / copy launches), q_norm and k_norm (norm.py rms_norm, one launch
each) and RoPE on q and k (kernels/rope.py apply_rope, a tensor expression each): ~6 launches per attention
layer, each at batch-1 decode costing more in fixed overhead (~2-3 us in the CUDA graph) than its work. Here:

  qk_norm_rope(qkv[n, hq*2*dh + 2*hkv*dh] (the projection, read in place), pos[n] i32 (or [n, 3]: M-RoPE),
               inv_freq[rotary_dim/2] f32, attn_factor[1] f32, q_w[dh] f32, k_w[dh] f32,
               q[n, hq, dh], gate[n, hq, dh], k[n, hkv, dh], v[n, hkv, dh])

block per (row, head of q or k) (grid n x (hq + hkv)), the thread layout of norm.py's rms_norm: each
thread reads its elements of the head, the fp32 sum of squares is reduced with warp shuffles and one
shared-memory step, in rms_norm's order, and the normed value is rounded to the activation dtype
(rms_norm's output cast). The rounded head sits in shared memory; after a barrier each thread rotates its
elements as apply_rope's tensor expression does (same operations in the same order: angle = f32(p) *
inv_freq[d % half], cos / sin of it times the attention factor, x * cos + partner * sin in fp32, cast;
dims past rotary_dim pass through), so q and k are bit-equal to the unfused path's. A q block also copies
its gate head, a k block its v head, into the buffers the attention kernel and the gate multiply read.
M-RoPE positions take the component of frequency j that rope.mrope_component picks.
"""
from __future__ import annotations

from functools import lru_cache

from tvm.script import tirx as T

from .norm import block_threads, sum_of_squares


@lru_cache(maxsize=None)
def qk_norm_rope(hq: int, hkv: int, dh: int, rotary_dim: int, dtype: str, eps: float,
                 mrope_section: tuple | None = None, *, threads: int = 256):
    """mrope_section: (s_t, s_h, s_w) for [n, 3] positions (None: [n] positions). threads: rms_norm's
    (the same count gives the same fp32 reduction order as the unfused norm)."""
    NT = block_threads(dh, threads)
    NE = (dh + NT - 1) // NT
    reduce = sum_of_squares(dh, NT)
    half = rotary_dim // 2
    width = (2 * hq + 2 * hkv) * dh
    k_base = 2 * hq * dh
    v_base = k_base + hkv * dh
    mm = mrope_section is not None
    # M-RoPE: frequency j takes component 1 (H) where j % 3 == 1 and j < s_h, 2 (W) where j % 3 == 2 and j < s_w
    s_h, s_w = (3 * int(mrope_section[1]), 3 * int(mrope_section[2])) if mrope_section is not None else (0, 0)

    @T.prim_func
    def qk_rope(var_qkv: T.handle, var_pos: T.handle, var_inv: T.handle, var_factor: T.handle, var_qw: T.handle,
                var_kw: T.handle, var_q: T.handle, var_gate: T.handle, var_k: T.handle, var_v: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        qkv = T.match_buffer(var_qkv, (n, width), dtype)
        pos = T.match_buffer(var_pos, (n, 3) if mm else (n,), "int32")
        inv = T.match_buffer(var_inv, (half,), "float32")
        factor = T.match_buffer(var_factor, (T.int64(1),), "float32")
        qw = T.match_buffer(var_qw, (dh,), "float32")
        kw = T.match_buffer(var_kw, (dh,), "float32")
        q = T.match_buffer(var_q, (n, hq, dh), dtype)
        gate = T.match_buffer(var_gate, (n, hq, dh), dtype)
        k = T.match_buffer(var_k, (n, hkv, dh), dtype)
        v = T.match_buffer(var_v, (n, hkv, dh), dtype)
        for row in T.thread_binding(n, thread="blockIdx.x"):
            for hb in T.thread_binding(hq + hkv, thread="blockIdx.y"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    xs = T.alloc_buffer((NE,), "float32", scope="local")
                    tot = T.alloc_buffer((1,), "float32", scope="local")
                    ys = T.alloc_buffer((dh,), dtype, scope="shared")
                    ang = T.alloc_buffer((1,), "float32", scope="local")
                    # this block's head in the projection: q head hb (gate after it) or k head hb - hq
                    reduce(qkv, row, T.if_then_else(hb < hq, hb * (2 * dh), k_base + (hb - hq) * dh), tx, xs, tot)
                    for e in T.unroll(NE):
                        if e * NT + tx < dh:
                            ys[e * NT + tx] = T.Cast(dtype, xs[e] / T.sqrt(tot[0] / T.float32(dh) + T.float32(eps))
                                                     * T.if_then_else(hb < hq, qw[e * NT + tx], kw[e * NT + tx]))
                    T.tvm_storage_sync("shared")
                    for e in T.unroll(NE):
                        d = e * NT + tx
                        if d < dh:
                            # apply_rope's element: fi = d % half, its position component, angle, cos / sin
                            fi = T.floormod(d, half)
                            ang[0] = T.Cast("float32", pos[row, T.if_then_else(
                                fi % 3 == 1 and fi < s_h, 1, T.if_then_else(fi % 3 == 2 and fi < s_w, 2, 0))]
                                if mm else pos[row]) * inv[fi]
                            partner = T.if_then_else(d < half, -T.Cast("float32", ys[T.min(d + half, dh - 1)]),
                                                     T.Cast("float32", ys[T.max(d - half, 0)]))
                            r = T.if_then_else(d < rotary_dim, T.Cast(
                                dtype, T.Cast("float32", ys[d]) * (T.cos(ang[0]) * factor[0])
                                + partner * (T.sin(ang[0]) * factor[0])), ys[d])
                            if hb < hq:
                                q[row, hb, d] = r
                                gate[row, hb, d] = qkv[row, hb * (2 * dh) + dh + d]
                            else:
                                k[row, hb - hq, d] = r
                                v[row, hb - hq, d] = qkv[row, v_base + (hb - hq) * dh + d]

    tag = f"_mrope{'x'.join(str(int(s)) for s in mrope_section)}" if mrope_section is not None else ""
    return qk_rope.with_attr("global_symbol", f"qk_norm_rope_{hq}x{hkv}x{dh}_r{rotary_dim}_{dtype}{tag}")
