"""Paged gated-attention kernels: append new K/V into runtime-owned pages, then attend.

The page pool is page-major, [num_pages, n_attn_layers, 2, kv_heads, page_size, head_dim], so one
page of every attention layer is a single contiguous block: the host tier moves a page with one
copy. The runtime owns the pool; the kernels only read the page table it passes in.

This file holds the portable (llvm) versions: plain loops, fp32 online softmax. The KV pool may
use another dtype than the activations (f32 / bf16 pages are cast on write and read; fp8 / nvfp4
pages are uint8 rows, see attention_quant.py).
"""
from __future__ import annotations

from functools import lru_cache

from tvm.script import tirx as T

from .attention_quant import QUANT_KV_DTYPES, paged_attention_quant


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

    @T.prim_func
    def attn(
        var_q: T.handle, var_k: T.handle, var_v: T.handle, var_pos: T.handle, var_tseq: T.handle,
        var_pt: T.handle, var_pool: T.handle, layer: T.int32, var_out: T.handle,
    ):
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
        mx = T.alloc_buffer((1,), "float32", scope="local")
        den = T.alloc_buffer((1,), "float32", scope="local")
        sc = T.alloc_buffer((1,), "float32", scope="local")
        acc = T.alloc_buffer((head_dim,), "float32", scope="local")
        for i, h, d in T.grid(n, n_kv, head_dim):
            pool[pt[tseq[i], pos[i] // page_size], layer, 0, h, pos[i] % page_size, d] = T.Cast(kv_dt, k[i, h, d])
            pool[pt[tseq[i], pos[i] // page_size], layer, 1, h, pos[i] % page_size, d] = T.Cast(kv_dt, v[i, h, d])
        for i, h in T.grid(n, n_heads):
            mx[0] = T.float32(neg_big)
            den[0] = T.float32(0)
            for d in range(head_dim):
                acc[d] = T.float32(0)
            for j in T.serial(pos[i] + 1):
                sc[0] = T.float32(0)
                for d in range(head_dim):
                    sc[0] = sc[0] + T.Cast("float32", q[i, h, d]) * T.Cast(
                        "float32", pool[pt[tseq[i], j // page_size], layer, 0, h // group, j % page_size, d]
                    )
                sc[0] = sc[0] * T.float32(sm_scale)
                # rescale the running sums to the new max; exponents stay <= 0
                if sc[0] > mx[0]:
                    den[0] = den[0] * T.exp(mx[0] - sc[0])
                    for d in range(head_dim):
                        acc[d] = acc[d] * T.exp(mx[0] - sc[0])
                    mx[0] = sc[0]
                den[0] = den[0] + T.exp(sc[0] - mx[0])
                for d in range(head_dim):
                    acc[d] = acc[d] + T.exp(sc[0] - mx[0]) * T.Cast(
                        "float32", pool[pt[tseq[i], j // page_size], layer, 1, h // group, j % page_size, d]
                    )
            for d in range(head_dim):
                out[i, h, d] = T.Cast(dtype, acc[d] / den[0])

    return attn
