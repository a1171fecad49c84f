"""Paged gated-attention kernels: append new K/V into runtime-owned pages, then attend.

The page pool is page-major, [num_pages, n_attn_layers, 2, kv_heads, page_size, head_dim], so one
page of every attention layer is a single contiguous block: the host tier moves a page with one
copy. The runtime owns the pool; the kernels only read the page table it passes in.

This file holds the portable (llvm) version: fp32 online softmax a page at a time, blocks of
tokens sharing each page in cache, SIMD row loops and exps. The KV pool may use another dtype than the
activations (f32 / bf16 pages are cast on write and read; fp8 / nvfp4 pages are uint8 rows, see
attention_quant.py).
"""
from __future__ import annotations

from functools import lru_cache

from tvm.script import tirx as T

from .attention_quant import QUANT_KV_DTYPES, paged_attention_quant

QUERY_BLOCK = 16  # tokens whose rows share each KV page while it is in cache


def exp_nonpos(x):
    """exp(x) for x <= 0 in SIMD-friendly arithmetic (Cephes expf: 2^n times a polynomial of the
    remainder); within ~1 ulp of expf, and ~1e-38 below -87. LLVM's exp is a scalar libm call."""
    x = T.max(T.min(x, T.float32(0)), T.float32(-87.0))
    n = T.Cast("int32", x * T.float32(1.44269504088896341) - T.float32(0.5))  # x <= 0: truncation rounds
    nf = T.Cast("float32", n)
    r = x - nf * T.float32(0.693359375) - nf * T.float32(-2.12194440e-4)
    p = T.float32(1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + T.float32(c)
    return (p * r * r + r + T.float32(1)) * T.reinterpret("float32", T.shift_left(n + 127, 23))


@lru_cache(maxsize=None)
def paged_attention(
    n_heads: int, n_kv: int, head_dim: int, page_size: int, n_layers: int, dtype: str, sm_scale: float,
    kv_dtype: str | None = None,
):
    """Ragged multi-sequence attention over paged KV.

    Token i belongs to batch row tseq[i] at absolute position pos[i]; it attends to positions
    0..pos[i] of its sequence. All of this call's K/V are written first, so tokens of one chunk
    see each other causally and earlier chunks through the page table. kv_dtype: page dtype
    (None = dtype; float32 | bfloat16 | fp8 | nvfp4).
    """
    if kv_dtype in QUANT_KV_DTYPES:
        return paged_attention_quant(n_heads, n_kv, head_dim, page_size, n_layers, dtype, sm_scale, kv_dtype)
    kv_dt = kv_dtype or dtype
    group = n_heads // n_kv
    neg_big = -3.0e38
    lanes = next(w for w in (8, 4, 2, 1) if head_dim % w == 0)
    nd = head_dim // lanes
    qb = QUERY_BLOCK
    rows = qb * group

    @T.prim_func
    def attn(var_q: T.handle, var_k: T.handle, var_v: T.handle, var_pos: T.handle, var_tseq: T.handle,
             var_pt: T.handle, var_pool: T.handle, layer: T.int32, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        b = T.int64()
        p = T.int64()
        npages = T.int64()
        q = T.match_buffer(var_q, (n, n_heads, head_dim), dtype)
        k = T.match_buffer(var_k, (n, n_kv, head_dim), dtype)
        v = T.match_buffer(var_v, (n, n_kv, head_dim), dtype)
        pos = T.match_buffer(var_pos, (n,), "int32")
        tseq = T.match_buffer(var_tseq, (n,), "int32")
        pt = T.match_buffer(var_pt, (b, p), "int32")
        pool = T.match_buffer(var_pool, (npages, n_layers, 2, n_kv, page_size, head_dim), kv_dt)
        out = T.match_buffer(var_out, (n, n_heads, head_dim), dtype)
        for i, h, d in T.grid(n, n_kv, head_dim):
            pool[pt[tseq[i], pos[i] // page_size], layer, 0, h, pos[i] % page_size, d] = T.Cast(kv_dt, k[i, h, d])
            pool[pt[tseq[i], pos[i] // page_size], layer, 1, h, pos[i] % page_size, d] = T.Cast(kv_dt, v[i, h, d])
        # one task per (block of QB tokens, KV head): the rows of the block (tokens x the heads of the
        # group) sweep each KV page together while it is in cache; per row and page: SIMD dot
        # products, one max, one rescale, SIMD exps, SIMD accumulation. Stack buffers and T.Bind
        # scalars: nothing is allocated inside the loops.
        for task in T.parallel((n + qb - 1) // qb * n_kv):
            qv = T.alloc_buffer((rows, head_dim), "float32")
            acc = T.alloc_buffer((rows, head_dim), "float32")
            st = T.alloc_buffer((rows, 2), "float32")  # running max, denominator per row
            sc = T.alloc_buffer((page_size,), "float32")
            part = T.alloc_buffer((lanes,), "float32")
            w = T.alloc_buffer((3,), "float32")  # page max, weight, -
            mp = T.alloc_buffer((1,), "int32")
            i0 = T.Bind(task // n_kv * qb)
            hk = T.Bind(task % n_kv)
            nr = T.Bind(T.min(qb, n - i0) * group)
            mp[0] = 0
            for r in range(nr):
                for d in range(head_dim):
                    qv[r, d] = T.Cast("float32", q[i0 + r // group, hk * group + r % group, d]) * T.float32(sm_scale)
                    acc[r, d] = T.float32(0)
                st[r, 0] = T.float32(neg_big)
                st[r, 1] = T.float32(0)
                mp[0] = T.max(mp[0], pos[i0 + r // group] // page_size)
            for pg in range(mp[0] + 1):
                for r in range(nr):
                    i = T.Bind(i0 + r // group)
                    if pg * page_size <= pos[i]:
                        page = T.Bind(pt[tseq[i], pg])
                        nk = T.Bind(T.min(page_size, pos[i] + 1 - pg * page_size))
                        w[0] = st[r, 0]
                        for jj in range(nk):
                            for l in T.vectorized(lanes):
                                part[l] = T.float32(0)
                            for d0 in range(nd):
                                for l in T.vectorized(lanes):
                                    part[l] = part[l] + qv[r, d0 * lanes + l] * T.Cast(
                                        "float32", pool[page, layer, 0, hk, jj, d0 * lanes + l])
                            sc[jj] = part[0]
                            for l in range(1, lanes):
                                sc[jj] = sc[jj] + part[l]
                            w[0] = T.max(w[0], sc[jj])
                        w[1] = T.exp(st[r, 0] - w[0])
                        st[r, 1] = st[r, 1] * w[1]
                        for d0 in range(nd):
                            for l in T.vectorized(lanes):
                                acc[r, d0 * lanes + l] = acc[r, d0 * lanes + l] * w[1]
                        st[r, 0] = w[0]
                        for jj in range(nk, page_size):
                            sc[jj] = T.float32(neg_big)
                        for j0 in range(page_size // lanes):
                            for l in T.vectorized(lanes):
                                sc[j0 * lanes + l] = exp_nonpos(sc[j0 * lanes + l] - w[0])
                        for jj in range(nk):
                            st[r, 1] = st[r, 1] + sc[jj]
                            for d0 in range(nd):
                                for l in T.vectorized(lanes):
                                    acc[r, d0 * lanes + l] = acc[r, d0 * lanes + l] + sc[jj] * T.Cast(
                                        "float32", pool[page, layer, 1, hk, jj, d0 * lanes + l])
            for r, d in T.grid(nr, head_dim):
                out[i0 + r // group, hk * group + r % group, d] = T.Cast(dtype, acc[r, d] / st[r, 1])
    return attn
