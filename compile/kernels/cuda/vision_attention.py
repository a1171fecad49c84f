"""Vision-tower attention on CUDA (thread-bound TIR): same contract as kernels/vision_attention.py.

  vit_attention(q[n, H, D], k[n, H, D], v[n, H, D], cu[s+1] i32, seg[n] i32) -> out[n, H, D]

One block per (head, QT consecutive patches), one thread per patch: its fp32 accumulator in
registers, its (scaled) query in a padded shared-memory row (registers for both spill at D = 72). The block walks
the keys of every image its patches belong to in tiles
of KT rows staged in shared memory (fp32; every thread reads the same key row: a broadcast), with
an online softmax; a thread skips the keys outside its own image. No n x n scores are formed.
"""
from __future__ import annotations

from tvm.script import tirx as T

QT = 64
KT = 32
NEG = -1.0e30


def vit_attention(n_heads: int, head_dim: int, dtype: str):
    D, H = head_dim, n_heads
    scale = float(D) ** -0.5
    per_thread = (KT * D + QT - 1) // QT

    @T.prim_func
    def vit_attn(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_cu: T.handle, var_seg: T.handle,
                 var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        s1 = T.int64()
        q = T.match_buffer(var_q, (n, H, D), dtype)
        k = T.match_buffer(var_k, (n, H, D), dtype)
        v = T.match_buffer(var_v, (n, H, D), dtype)
        cu = T.match_buffer(var_cu, (s1,), "int32")
        seg = T.match_buffer(var_seg, (n,), "int32")
        out = T.match_buffer(var_out, (n, H, D), dtype)
        for bx in T.thread_binding(H * ((n + QT - 1) // QT), thread="blockIdx.x"):
            for tx in T.thread_binding(QT, thread="threadIdx.x"):
                qs = T.alloc_buffer((QT, D + 1), "float32", scope="shared")  # +1: conflict-free rows
                acc = T.alloc_buffer((D,), "float32", scope="local")
                st = T.alloc_buffer((4,), "float32", scope="local")  # running max, denominator, score, p
                ks = T.alloc_buffer((KT, D), "float32", scope="shared")
                vs = T.alloc_buffer((KT, D), "float32", scope="shared")
                h = bx % H
                i0 = bx // H * QT
                i = T.min(i0 + tx, n - 1)
                lo = cu[seg[i]]
                hi = cu[seg[i] + 1]
                jlo = cu[seg[i0]]
                jhi = cu[seg[T.min(i0 + QT - 1, n - 1)] + 1]
                for d in T.unroll(D):
                    qs[tx, d] = T.Cast("float32", q[i, h, d]) * T.float32(scale)
                    acc[d] = T.float32(0)
                st[0] = T.float32(NEG)
                st[1] = T.float32(0)
                for t in range((jhi - jlo + KT - 1) // KT):
                    for e in T.unroll(per_thread):
                        if e * QT + tx < KT * D:
                            if jlo + t * KT + (e * QT + tx) // D < jhi:
                                ks[(e * QT + tx) // D, (e * QT + tx) % D] = T.Cast(
                                    "float32", k[jlo + t * KT + (e * QT + tx) // D, h, (e * QT + tx) % D])
                                vs[(e * QT + tx) // D, (e * QT + tx) % D] = T.Cast(
                                    "float32", v[jlo + t * KT + (e * QT + tx) // D, h, (e * QT + tx) % D])
                    T.tvm_storage_sync("shared")
                    for jj in range(KT):
                        if jlo + t * KT + jj >= lo and jlo + t * KT + jj < hi:
                            st[2] = T.float32(0)
                            for d in T.unroll(D):
                                st[2] = st[2] + qs[tx, d] * ks[jj, d]
                            st[3] = T.exp(st[0] - T.max(st[0], st[2]))  # rescale of the old sums
                            st[0] = T.max(st[0], st[2])
                            st[1] = st[1] * st[3]
                            for d in T.unroll(D):
                                acc[d] = acc[d] * st[3]
                            st[3] = T.exp(st[2] - st[0])
                            st[1] = st[1] + st[3]
                            for d in T.unroll(D):
                                acc[d] = acc[d] + st[3] * vs[jj, d]
                    T.tvm_storage_sync("shared")
                if i0 + tx < n:
                    for d in T.unroll(D):
                        out[i0 + tx, h, d] = T.Cast(dtype, acc[d] / st[1])

    return vit_attn.with_attr("global_symbol", f"vit_attention_cuda_{H}x{D}_{dtype}")
