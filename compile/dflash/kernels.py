"""Drafter KV writes: K/V rows into the paged pool (the target's page ids) or into a sequence's ring.

  paged_append(k[n,H,D], v[n,H,D], pos[n], tseq[n], pt[b,p], pool[pages, L, 2, H, PAGE, D], layer)
      row i goes to page pt[tseq[i], pos[i] // PAGE], slot pos[i] % PAGE.
  ring_append(k, v, pos[n], tseq[n], lane[b], keep_from[b], ring[lanes, L, 2, H, R, D], layer)
      row i goes to ring lane[tseq[i]] at pos[i] % R when pos[i] >= keep_from[tseq[i]] (a chunk longer
      than the ring writes only its last R rows, so no two rows of one call share a ring slot).
Only writes: the drafter's attention reads the pools elsewhere. With `gpu` the same loops are
thread-bound (a block per row and KV head, a thread per element), which the CUDA pipeline leaves as is.
"""
from __future__ import annotations

from tvm.script import tirx as T


def _loops(gpu: bool):
    """Loop kinds of the (row, head, element) nest: serial, or blockIdx.x / blockIdx.y / threadIdx.x."""
    if not gpu:
        return T.serial, T.serial, T.serial
    return tuple((lambda e, t=t: T.thread_binding(e, thread=t)) for t in ("blockIdx.x", "blockIdx.y", "threadIdx.x"))


def paged_append(n_kv: int, head_dim: int, page_size: int, n_layers: int, dtype: str, gpu: bool = False):
    rows, heads, elems = _loops(gpu)

    @T.prim_func
    def dflash_paged_append(var_k: T.handle, var_v: T.handle, var_pos: T.handle, var_tseq: T.handle,
                            var_pt: T.handle, var_pool: T.handle, layer: T.int32):
        T.func_attr({"tirx.noalias": True})
        n, b, p, npages = T.int64(), T.int64(), T.int64(), T.int64()
        k = T.match_buffer(var_k, (n, n_kv, head_dim), dtype)
        v = T.match_buffer(var_v, (n, n_kv, head_dim), dtype)
        pos = T.match_buffer(var_pos, (n,), "int32")
        tseq = T.match_buffer(var_tseq, (n,), "int32")
        pt = T.match_buffer(var_pt, (b, p), "int32")
        pool = T.match_buffer(var_pool, (npages, n_layers, 2, n_kv, page_size, head_dim), dtype)
        for i in rows(n):
            for h in heads(n_kv):
                for d in elems(head_dim):
                    pool[pt[tseq[i], pos[i] // page_size], layer, 0, h, pos[i] % page_size, d] = k[i, h, d]
                    pool[pt[tseq[i], pos[i] // page_size], layer, 1, h, pos[i] % page_size, d] = v[i, h, d]

    return dflash_paged_append


def ring_append(n_kv: int, head_dim: int, ring: int, n_layers: int, dtype: str, gpu: bool = False):
    rows, heads, elems = _loops(gpu)

    @T.prim_func
    def dflash_ring_append(var_k: T.handle, var_v: T.handle, var_pos: T.handle, var_tseq: T.handle,
                           var_lane: T.handle, var_keep: T.handle, var_pool: T.handle, layer: T.int32):
        T.func_attr({"tirx.noalias": True})
        n, b, lanes = T.int64(), T.int64(), T.int64()
        k = T.match_buffer(var_k, (n, n_kv, head_dim), dtype)
        v = T.match_buffer(var_v, (n, n_kv, head_dim), dtype)
        pos = T.match_buffer(var_pos, (n,), "int32")
        tseq = T.match_buffer(var_tseq, (n,), "int32")
        lane = T.match_buffer(var_lane, (b,), "int32")
        keep = T.match_buffer(var_keep, (b,), "int32")
        pool = T.match_buffer(var_pool, (lanes, n_layers, 2, n_kv, ring, head_dim), dtype)
        for i in rows(n):
            for h in heads(n_kv):
                for d in elems(head_dim):
                    if pos[i] >= keep[tseq[i]]:
                        pool[lane[tseq[i]], layer, 0, h, pos[i] % ring, d] = k[i, h, d]
                        pool[lane[tseq[i]], layer, 1, h, pos[i] % ring, d] = v[i, h, d]

    return dflash_ring_append
