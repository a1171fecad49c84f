"""RMSNorm over the hidden size in one CUDA launch (thread-bound TIR).

The relax form `rms_norm(x.astype(f32), w).astype(x.dtype)` legalizes to a cast kernel plus a norm
kernel; with 129 norms per decode step of the 27B model that is 129 extra launches. Here:

  rms_norm(x[n, D] dtype, w[D] f32, out[n, D] dtype)     out = cast(x * rsqrt(mean(x^2) + eps) * w)

block per row, `threads` threads striding the row (coalesced), fp32 sum of squares reduced with
warp shuffles and one shared-memory step across the warps.
"""
from __future__ import annotations

from functools import lru_cache

from tvm.script import tirx as T


def block_threads(dim: int, threads: int) -> int:
    """Threads of a block that norms rows of `dim` (at most `threads`, whole warps)."""
    return min(threads, max(32, (dim + 31) // 32 * 32))


def sum_of_squares(dim: int, nt: int):
    """Macro reduce(x, row, base, tx, xs, tot) for a block of nt threads: xs[e] = f32(x[row, base + e*nt + tx])
    for thread tx's elements (e < ceil(dim / nt)) and tot[0] = their row's sum of squares in every thread, in
    rms_norm's order (per thread, warp shuffles, then the warps' partial sums one after another): kernels that
    norm like rms_norm share it, so their fp32 sums are the same bit for bit."""
    nw = nt // 32
    ne = (dim + nt - 1) // nt

    @T.macro
    def reduce(x, row, base, tx, xs, tot):
        acc = T.alloc_buffer((1,), "float32", scope="local")
        part = T.alloc_buffer((nw,), "float32", scope="shared")
        acc[0] = T.float32(0)
        for e in T.unroll(ne):
            if e * nt + tx < dim:
                xs[e] = T.Cast("float32", x[row, base + e * nt + tx])
                acc[0] = acc[0] + xs[e] * xs[e]
        for o in T.unroll(5):
            acc[0] = acc[0] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), acc[0], 16 >> o, 32, 32)
        if tx % 32 == 0:
            part[tx // 32] = acc[0]
        T.tvm_storage_sync("shared")
        tot[0] = T.float32(0)
        for j in T.unroll(nw):
            tot[0] = tot[0] + part[j]

    return reduce


@lru_cache(maxsize=None)
def rms_norm(dim: int, dtype: str, eps: float, *, threads: int = 256):
    NT = block_threads(dim, threads)
    NE = (dim + NT - 1) // NT
    reduce = sum_of_squares(dim, NT)

    @T.prim_func
    def rmsnorm(var_x: T.handle, var_w: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, dim), dtype)
        w = T.match_buffer(var_w, (dim,), "float32")
        out = T.match_buffer(var_out, (n, dim), dtype)
        for row in T.thread_binding(n, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                xs = T.alloc_buffer((NE,), "float32", scope="local")
                tot = T.alloc_buffer((1,), "float32", scope="local")
                reduce(x, row, 0, tx, xs, tot)
                for e in T.unroll(NE):
                    if e * NT + tx < dim:
                        out[row, e * NT + tx] = T.Cast(
                            dtype, xs[e] / T.sqrt(tot[0] / T.float32(dim) + T.float32(eps)) * w[e * NT + tx])

    return rmsnorm.with_attr("global_symbol", f"rms_norm_{dim}_{dtype}")
