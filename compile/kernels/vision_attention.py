"""Bidirectional attention of the vision tower, within each image (segment) only.

  vit_attention(q[n, H, D], k[n, H, D], v[n, H, D], cu[s+1] i32, seg[n] i32) -> out[n, H, D]

Patch i belongs to image seg[i], whose patches are cu[seg[i]] .. cu[seg[i]+1]; it attends to all of
them (no causal mask), softmax in fp32 with scale D^-0.5. The portable (llvm) version works on
tiles of TILE consecutive patches of one head in parallel: every key row is read once per tile and
the TILE dot products, softmax updates and value accumulations run as vector lanes. A tile that
straddles two images walks both images' keys and masks per lane. No n x n score matrix exists, so
a 4096x4096 image (65536 patches) needs no more memory than a small one.
"""
from __future__ import annotations

from tvm.script import tirx as T

TILE = 16
NEG = -1.0e30


def vit_attention(n_heads: int, head_dim: int, dtype: str):
    D, H = head_dim, n_heads
    scale = float(D) ** -0.5

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
        for ht in T.parallel(H * ((n + TILE - 1) // TILE)):
            qt = T.alloc_buffer((D, TILE), "float32", scope="local")
            acc = T.alloc_buffer((D, TILE), "float32", scope="local")
            lo = T.alloc_buffer((TILE,), "int32", scope="local")
            hi = T.alloc_buffer((TILE,), "int32", scope="local")
            mx = T.alloc_buffer((TILE,), "float32", scope="local")
            den = T.alloc_buffer((TILE,), "float32", scope="local")
            sc = T.alloc_buffer((TILE,), "float32", scope="local")
            pr = T.alloc_buffer((TILE,), "float32", scope="local")
            corr = T.alloc_buffer((TILE,), "float32", scope="local")
            h = ht % H
            i0 = ht // H * TILE
            for qi in range(TILE):
                lo[qi] = cu[seg[T.min(i0 + qi, n - 1)]]
                hi[qi] = cu[seg[T.min(i0 + qi, n - 1)] + 1]
                mx[qi] = T.float32(NEG)
                den[qi] = T.float32(0)
            for d, qi in T.grid(D, TILE):
                qt[d, qi] = T.Cast("float32", q[T.min(i0 + qi, n - 1), h, d]) * T.float32(scale)
                acc[d, qi] = T.float32(0)
            for j in range(lo[0], hi[TILE - 1]):
                for qi in T.vectorized(TILE):
                    sc[qi] = T.float32(0)
                for d in range(D):
                    for qi in T.vectorized(TILE):
                        sc[qi] = sc[qi] + qt[d, qi] * T.Cast("float32", k[j, h, d])
                for qi in range(TILE):
                    if j >= lo[qi] and j < hi[qi]:
                        corr[qi] = T.exp(mx[qi] - T.max(mx[qi], sc[qi]))
                        mx[qi] = T.max(mx[qi], sc[qi])
                        pr[qi] = T.exp(sc[qi] - mx[qi])
                    else:
                        corr[qi] = T.float32(1)
                        pr[qi] = T.float32(0)
                    den[qi] = den[qi] * corr[qi] + pr[qi]
                for d in range(D):
                    for qi in T.vectorized(TILE):
                        acc[d, qi] = acc[d, qi] * corr[qi] + pr[qi] * T.Cast("float32", v[j, h, d])
            for qi, d in T.grid(TILE, D):
                if i0 + qi < n:
                    out[i0 + qi, h, d] = T.Cast(dtype, acc[d, qi] / den[qi])

    return vit_attn.with_attr("global_symbol", f"vit_attention_{H}x{D}_{dtype}")
