"""CUDA Gated DeltaNet kernels (thread-bound TIR).

Same prim_func signatures and buffer contracts as compile/kernels/gdn.py:
  conv(x[n,C], cu[b+1], slot[b], pool[S,L,C,K-1], w[C,K], layer, out[n,C])
  gdn_chunk(q[n,Hk,dk], k[n,Hk,dk], v[n,Hv,dv], g[n,Hv], beta[n,Hv], cu[b+1], slot[b],
            ssm[S,L,Hv,dk,dv], layer, o[n,Hv,dv])
  gdn_step(q[b,Hk,dk], k[b,Hk,dk], v[b,Hv,dv], g[b,Hv], beta[b,Hv], slot[b], ssm[S,L,Hv,dk,dv], layer,
           o[b,Hv,dv])
State (ssm) is fp32; all GDN math is fp32.

conv: two launches. (1) thread per (token, channel): every output is independent once the row
start is known (a scan over cu, b is small), reading the stored tail for the first K-1 inputs of a
row; (2) thread per (row, channel): new tail, read into registers before it is written.
gdn_step: block per (row, value head), thread per value column d; the state column S[:, d] lives
in registers (dk floats), k and q in shared memory. One read and one write of the state.
gdn_chunk: chunked WY form (FLA-style), two launches inside the one prim_func (stream order is the
barrier). Chunk C = 32 tokens (`chunk`, lowered until both launches fit 48 KiB of static shared memory).
Per chunk, gamma = cumulative log-decay, A[i,j] = b_i e^(g_i-g_j) k_i.k_j (j<i),
M[i,j] = e^(g_i-g_j) q_i.k_j (j<=i), U = (I+A)^-1 (b V), W = (I+A)^-1 (b e^g K). Then per chunk in order:
V_new = U - W S, O = e^g Q S + M V_new, S <- e^(g_last) S + (K e^(g_last-g))^T V_new.
  1. grid (chunks, Hv) x NT1 (256 for dk=dv=128) threads, fully parallel. Block x finds its row and chunk
     by scanning cu (chunks of a row start at the row start; the last one is partial; grid x is
     n/C + b, an upper bound, spare blocks exit). Stages K, Q of the chunk, computes gamma (left to
     right), A (shared) and M (2x2 register blocks over the lower triangle), then one column per
     thread of [b V | b e^g K] is forward-substituted in registers: U goes to `o` (overwritten by
     launch 2), W, M and gamma to workspace scratch (n*Hv*dk + n*Hv*C + n*Hv floats, ~250 MB at n=8192).
  2. grid (b, Hv, dv/16) x 128 threads, chunks in order. Thread = (value column tx/8, state rows
     (tx%8)*16..+16): its 16 state floats stay in registers for the whole row. Per chunk: stage W and Q
     (XOR-swizzled float4 rows: the 8 lanes of a column read 8 segments of one row conflict-free), U, M,
     decays; W.S and Q.S partial dots over 16 rows, reduced by xor-shuffles over the 8 lanes -> V_new,
     e^g Q.S in shared; stage K into W's buffer while O = e^g Q S + M V_new is written (coalesced over
     columns); state update from K and V_new. Four barriers per chunk, ~43 KB shared, no spills.
  Row b's state is read at its first chunk and written after its last (rows of length 0 keep it).
Tensor-core variant (`mma`, default wherever it applies: chunk 32, dk % 64 == 0, the value tile
`mma_tile` a multiple of 8; the SIMT launches above stay for other geometries and mma=False):
  products on mma.sync.m16n8k8 tf32 with fp32 accumulation; tf32x3 (this function's default) splits each
  operand into tf32 big + small parts and issues As Bb + Ab Bs + Ab Bb (three mma, ~fp32 accuracy: 5e-7
  relative vs the llvm kernel in emulation, like the SIMT kernel); tf32x3=False issues one (~5e-4 vs
  float64, far below bf16 rounding). The kernel set (registry "tf32x3": "auto") uses three for fp32
  models and one for bf16 / f16 models: 1.62 vs 2.46 ms per layer at 8192 tokens on the H200.
  1. 256 threads (8 warps). A and M from [K; Q] K^T: warp w computes row tile w // 2 (K 0-15, K 16-31,
     Q 0-15, Q 16-31) x column tiles 2 (w % 2), +1 (16 k steps over dk; tiles above the diagonal
     skipped), decays / masks applied on the fragments; A goes to shared through opaque stores and an
     opaque barrier (TVM's sync planner cannot tell the warps' tiles apart), M to scratch. Forward
     substitution as above with float4 reads of A's rows (stride C + 4). K, Q rows padded to dk + 4
     (conflict-free fragment reads).
  2. grid (b, Hv, dv / mma_tile) x 128 threads (4 warps), chunks in order; the state tile S (dk x
     mma_tile) lives in registers as mma accumulators: warp w owns state rows 32w.. (dk = 128).
     Per chunk: warps 0, 1 compute W S for chunk rows 0-15 / 16-31 and warps 2, 3 Q S (A fragments
     straight from global memory as float4: the k index of a pair of k steps is permuted so that one
     lane's 4 consecutive floats feed both; B fragments from S^T in shared, rows padded to dk + 16);
     V_new = U - W S goes to shared (transposed, rows padded to C + 16); the A fragments of the next
     chunk are prefetched into the same registers; barrier; warps 2, 3: O = e^g Q S + M V_new (M rows
     from scratch) -> o; all: S = e^(g_last) S + (K e^(g_last - g))^T V_new (K^T fragments straight
     from global) and S^T -> shared; barrier. Two barriers per chunk, ~25 KB shared at tile 32.
"""
from __future__ import annotations

from functools import lru_cache

from tvm.script import tirx as T

CHUNK = 32
STATE_TILE = 16  # value columns per block of the sequential pass
STATE_EPT = 16  # state rows per thread of the sequential pass
SMEM_LIMIT = 48 * 1024  # static shared memory per block
MMA_THREADS = (256, 128)  # threads of the two launches of the tensor-core variant
MMA_TILE = 32  # value columns per block of the tensor-core sequential pass


@lru_cache(maxsize=None)
def causal_conv(conv_dim: int, kernel: int, n_layers: int, dtype: str, *, threads: int = 256):
    taps = kernel - 1
    CT = min(threads, ((conv_dim + 31) // 32) * 32)
    NCB = (conv_dim + CT - 1) // CT
    store_tails = conv_tails(conv_dim, kernel, dtype, threads)
    find_row, conv_sum = conv_taps(kernel)

    @T.prim_func
    def conv(
        var_x: T.handle, var_cu: T.handle, var_slot: T.handle, var_pool: T.handle, var_w: T.handle,
        layer: T.int32, var_out: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        b = T.int64()
        bp1 = T.int64()
        s = T.int64()
        x = T.match_buffer(var_x, (n, conv_dim), dtype)
        cu = T.match_buffer(var_cu, (bp1,), "int32")
        slot = T.match_buffer(var_slot, (b,), "int32")
        pool = T.match_buffer(var_pool, (s, n_layers, conv_dim, taps), dtype)
        w = T.match_buffer(var_w, (conv_dim, kernel), dtype)
        out = T.match_buffer(var_out, (n, conv_dim), dtype)
        # (1) outputs
        for t in T.thread_binding(n, thread="blockIdx.x"):
            for cb in T.thread_binding(NCB, thread="blockIdx.y"):
                for tx in T.thread_binding(CT, thread="threadIdx.x"):
                    rowv = T.alloc_buffer((1,), "int32", scope="local")
                    acc = T.alloc_buffer((1,), "float32", scope="local")
                    if cb * CT + tx < conv_dim:
                        find_row(rowv, t, b, cu)
                        conv_sum(acc, rowv, t, cb * CT + tx, x, w, pool, slot, cu, layer)
                        out[t, cb * CT + tx] = T.Cast(dtype, acc[0] / (T.float32(1) + T.exp(-acc[0])))
        # (2) new tails = last K-1 entries of [old tail | row inputs]
        store_tails(b, cu, slot, pool, x, layer)

    return conv


def conv_taps(kernel: int):
    """Macros (find_row, conv_sum) of the causal conv's output side, shared with gdn_prep.py:
    find_row(rowv, t, b, cu): rowv[0] = the row of token t (a scan over cu; b is small);
    conv_sum(acc, rowv, t, c, x, w, pool, slot, cu, layer): acc[0] = the fp32 conv of channel c at token t,
    taps before the row start read from the row's stored tail."""
    taps = kernel - 1

    @T.macro
    def find_row(rowv, t, b, cu):
        rowv[0] = 0
        for r in range(b - 1):
            if T.Cast("int64", cu[r + 1]) <= t:
                rowv[0] = rowv[0] + 1

    @T.macro
    def conv_sum(acc, rowv, t, c, x, w, pool, slot, cu, layer):
        acc[0] = T.float32(0)
        for j in T.unroll(kernel):
            if t - taps + j >= T.Cast("int64", cu[rowv[0]]):
                acc[0] = acc[0] + T.Cast("float32", w[c, j]) * T.Cast("float32", x[t - taps + j, c])
            else:
                acc[0] = acc[0] + T.Cast("float32", w[c, j]) * T.Cast(
                    "float32", pool[slot[rowv[0]], layer, c, t - T.Cast("int64", cu[rowv[0]]) + j])

    return find_row, conv_sum


def conv_tails(conv_dim: int, kernel: int, dtype: str, threads: int = 256):
    """Macro store_tails(b, cu, slot, pool, x, layer): the launch that stores each row's new conv tail (the
    last K-1 entries of [old tail | the row's inputs x[:, :conv_dim]]), thread per (row, channel), read into
    registers before written; after every output has read the old tail (stream order)."""
    taps = kernel - 1
    CT = min(threads, ((conv_dim + 31) // 32) * 32)
    NCB = (conv_dim + CT - 1) // CT

    @T.macro
    def store_tails(b, cu, slot, pool, x, layer):
        for bi in T.thread_binding(b, thread="blockIdx.x"):
            for cb in T.thread_binding(NCB, thread="blockIdx.y"):
                for tx in T.thread_binding(CT, thread="threadIdx.x"):
                    tail = T.alloc_buffer((taps,), dtype, scope="local")
                    if cb * CT + tx < conv_dim:
                        for m in T.unroll(taps):
                            if cu[bi + 1] - cu[bi] + m < taps:
                                tail[m] = pool[slot[bi], layer, cb * CT + tx, cu[bi + 1] - cu[bi] + m]
                            else:
                                tail[m] = x[cu[bi + 1] - taps + m, cb * CT + tx]
                        for m in T.unroll(taps):
                            pool[slot[bi], layer, cb * CT + tx, m] = tail[m]

    return store_tails


@lru_cache(maxsize=None)
def recurrent_delta_rule(hk: int, hv: int, dk: int, dv: int, n_layers: int):
    r = hv // hk
    NT = dv
    NE = (dk + NT - 1) // NT

    @T.prim_func
    def gdn_step(
        var_q: T.handle, var_k: T.handle, var_v: T.handle, var_g: T.handle, var_beta: T.handle,
        var_slot: T.handle, var_ssm: T.handle, layer: T.int32, var_o: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        b = T.int64()
        s = T.int64()
        q = T.match_buffer(var_q, (b, hk, dk), "float32")
        k = T.match_buffer(var_k, (b, hk, dk), "float32")
        v = T.match_buffer(var_v, (b, hv, dv), "float32")
        g = T.match_buffer(var_g, (b, hv), "float32")
        beta = T.match_buffer(var_beta, (b, hv), "float32")
        slot = T.match_buffer(var_slot, (b,), "int32")
        ssm = T.match_buffer(var_ssm, (s, n_layers, hv, dk, dv), "float32")
        o = T.match_buffer(var_o, (b, hv, dv), "float32")
        for bi in T.thread_binding(b, thread="blockIdx.x"):
            for h in T.thread_binding(hv, thread="blockIdx.y"):
                for d in T.thread_binding(NT, thread="threadIdx.x"):
                    ks = T.alloc_buffer((dk,), "float32", scope="shared")
                    qs = T.alloc_buffer((dk,), "float32", scope="shared")
                    col = T.alloc_buffer((dk,), "float32", scope="local")
                    acc = T.alloc_buffer((1,), "float32", scope="local")
                    dl = T.alloc_buffer((1,), "float32", scope="local")
                    for e0 in range(NE):
                        if e0 * NT + d < dk:
                            ks[e0 * NT + d] = k[bi, h // r, e0 * NT + d]
                            qs[e0 * NT + d] = q[bi, h // r, e0 * NT + d]
                    T.tvm_storage_sync("shared")
                    acc[0] = T.float32(0)
                    for e in T.unroll(dk):
                        col[e] = ssm[slot[bi], layer, h, e, d] * T.exp(g[bi, h])
                        acc[0] = acc[0] + col[e] * ks[e]
                    dl[0] = (v[bi, h, d] - acc[0]) * beta[bi, h]
                    acc[0] = T.float32(0)
                    for e in T.unroll(dk):
                        col[e] = col[e] + ks[e] * dl[0]
                        acc[0] = acc[0] + col[e] * qs[e]
                        ssm[slot[bi], layer, h, e, d] = col[e]
                    o[bi, h, d] = acc[0]

    return gdn_step


def short_delta_rule(hk: int, hv: int, dk: int, dv: int, n_layers: int):
    """gdn_chunk's contract for calls whose sequences have few rows (a speculative verify, its replay): the
    recurrent step of gdn_step applied row after row. Block per (sequence, value head), thread per value column
    d; the state column stays in registers from the sequence's first row to its last (one read, one write), q and k
    of each row in shared memory. A row costs ~2 dk FMAs per thread: 8-12 us per layer call at 4-8 rows on the H200
    (BENCHMARKS.md run 9) against ~18 us for the chunked form's two launches; its cost grows with the row count, so
    prefill keeps the chunked form.
    The dot products run on ACC = 4 partial sums (a row is a chain of dependent FMAs: latency, not issue)."""
    r = hv // hk
    NT = dv
    NE = (dk + NT - 1) // NT
    ACC = 4
    if dk % ACC:
        raise ValueError(f"the row-by-row GDN kernel needs dk % {ACC} == 0 (got {dk})")

    @T.prim_func
    def gdn_short(
        var_q: T.handle, var_k: T.handle, var_v: T.handle, var_g: T.handle, var_beta: T.handle, var_cu: T.handle,
        var_slot: T.handle, var_ssm: T.handle, layer: T.int32, var_o: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        b = T.int64()
        s = T.int64()
        q = T.match_buffer(var_q, (n, hk, dk), "float32")
        k = T.match_buffer(var_k, (n, hk, dk), "float32")
        v = T.match_buffer(var_v, (n, hv, dv), "float32")
        g = T.match_buffer(var_g, (n, hv), "float32")
        beta = T.match_buffer(var_beta, (n, hv), "float32")
        cu = T.match_buffer(var_cu, (b + 1,), "int32")
        slot = T.match_buffer(var_slot, (b,), "int32")
        ssm = T.match_buffer(var_ssm, (s, n_layers, hv, dk, dv), "float32")
        o = T.match_buffer(var_o, (n, hv, dv), "float32")
        for bi in T.thread_binding(b, thread="blockIdx.x"):
            for h in T.thread_binding(hv, thread="blockIdx.y"):
                for d in T.thread_binding(NT, thread="threadIdx.x"):
                    ks = T.alloc_buffer((dk,), "float32", scope="shared")
                    qs = T.alloc_buffer((dk,), "float32", scope="shared")
                    col = T.alloc_buffer((dk,), "float32", scope="local")
                    acc = T.alloc_buffer((ACC,), "float32", scope="local")
                    dl = T.alloc_buffer((1,), "float32", scope="local")
                    eg = T.alloc_buffer((1,), "float32", scope="local")
                    for e in T.unroll(dk):
                        col[e] = ssm[slot[bi], layer, h, e, d]
                    for t in T.serial(cu[bi + 1] - cu[bi]):
                        for e0 in range(NE):
                            if e0 * NT + d < dk:
                                ks[e0 * NT + d] = k[cu[bi] + t, h // r, e0 * NT + d]
                                qs[e0 * NT + d] = q[cu[bi] + t, h // r, e0 * NT + d]
                        T.tvm_storage_sync("shared")
                        eg[0] = T.exp(g[cu[bi] + t, h])
                        for j in T.unroll(ACC):
                            acc[j] = T.float32(0)
                        for e in T.unroll(dk):
                            col[e] = col[e] * eg[0]
                            acc[e % ACC] = acc[e % ACC] + col[e] * ks[e]
                        dl[0] = (v[cu[bi] + t, h, d] - ((acc[0] + acc[1]) + (acc[2] + acc[3]))) * beta[cu[bi] + t, h]
                        for j in T.unroll(ACC):
                            acc[j] = T.float32(0)
                        for e in T.unroll(dk):
                            col[e] = col[e] + ks[e] * dl[0]
                            acc[e % ACC] = acc[e % ACC] + col[e] * qs[e]
                        o[cu[bi] + t, h, d] = (acc[0] + acc[1]) + (acc[2] + acc[3])
                        T.tvm_storage_sync("shared")
                    for e in T.unroll(dk):
                        ssm[slot[bi], layer, h, e, d] = col[e]

    return gdn_short


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def _chunk_layout(dk: int, dv: int, chunk: int, state_tile: int, ept: int):
    """(C, EPT, G, DVT, NT1) for chunked_delta_rule; see the module docstring."""
    if dk % 4:
        raise ValueError(f"CUDA chunked GDN needs dk % 4 == 0 (got {dk})")
    EPT = dk  # G = 1 always works
    for e in range(max(4, ept - ept % 4), dk + 1, 4):
        if dk % e == 0 and _is_pow2(dk // e) and dk // e <= 32:
            EPT = e
            break
    G = dk // EPT
    DVT = max(1, min(state_tile, dv))
    while dv % DVT:
        DVT -= 1
    C = 2
    while C * 2 <= max(2, chunk):
        C *= 2

    def smem1(c):  # pass 1: K, Q chunks (padded rows), A, gamma/beta/e^gamma/g
        return 4 * (2 * c * (dk + 1) + c * (c + 1) + 4 * c)

    def smem2(c):  # pass 2: W/K and Q chunks, U / V_new / Q.h tiles, M, decays
        return 4 * (2 * c * dk + 3 * c * DVT + c * (c + 1) + 2 * c + 1)

    while C > 2 and max(smem1(C), smem2(C)) > SMEM_LIMIT:
        C //= 2
    NT1 = max(C, min(256, (dv + dk + 31) // 32 * 32))
    return C, EPT, G, DVT, NT1


def mma_applies(dk: int, dv: int, chunk: int = CHUNK, mma_tile: int = MMA_TILE) -> bool:
    """The tensor-core sequential pass: 4 warps, chunk 32 (the four 16-row tiles of [W; Q]), dk a
    multiple of 64 (the state rows split over the 4 warps in 16-row tiles), value tile a multiple of 8."""
    C, DVT = _mma_layout(dk, dv, chunk, mma_tile)
    return C == 32 and dk % 64 == 0 and DVT % 8 == 0


def _mma_layout(dk: int, dv: int, chunk: int, state_tile: int):
    """(C, DVT) of the tensor-core variant: the chunk only has to fit the parallel pass (the sequential
    pass keeps its operands in registers: ~24 KB of shared memory at a 32-column tile)."""
    C, _, _, _, _ = _chunk_layout(dk, dv, chunk, 1, 4)
    DVT = max(1, min(state_tile, dv))
    while dv % DVT:
        DVT -= 1
    return C, DVT


def _mma_src(split: bool):
    """D[16x8] += A[16x8] B[8x8] (mma.sync m16n8k8 tf32, fp32 accumulate) from fp32 fragments; split:
    3xTF32 (a = big + small, D += As Bb + Ab Bs + Ab Bb): about fp32 accuracy at three mma."""
    name = "ninfer_gdn_mma_tf32x3" if split else "ninfer_gdn_mma_tf32"
    mma = ('  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, "\n'
           '               "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\\n"\n'
           '               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])\n'
           '               : "r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "r"(B[0]), "r"(B[1]));\n')
    body = [f"__forceinline__ __device__ void {name}(float* c, float a0, float a1, float a2, float a3, float b0, "
            "float b1) {",
            "  float af[4] = {a0, a1, a2, a3}, bf[2] = {b0, b1};",
            "  unsigned ab[4], as[4], bb[2], bs[2];",
            "  for (int i = 0; i < 4; ++i) {",
            '    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(ab[i]) : "f"(af[i]));',
            '    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(as[i]) : "f"(af[i] - __uint_as_float(ab[i])));',
            "  }",
            "  for (int i = 0; i < 2; ++i) {",
            '    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bb[i]) : "f"(bf[i]));',
            '    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(bs[i]) : "f"(bf[i] - __uint_as_float(bb[i])));',
            "  }"]
    if split:
        body += ["  { const unsigned* A = as; const unsigned* B = bb;", mma + "  }",
                 "  { const unsigned* A = ab; const unsigned* B = bs;", mma + "  }"]
    body += ["  { const unsigned* A = ab; const unsigned* B = bb;", mma + "  }", "}"]
    return name, "\n" + "\n".join(body) + "\n"


@lru_cache(maxsize=None)
def chunked_delta_rule(hk: int, hv: int, dk: int, dv: int, n_layers: int, chunk: int = CHUNK,
                       *, dv_tile: int | None = None, state_tile: int = STATE_TILE, ept: int = STATE_EPT,
                       mma: bool | None = None, mma_tile: int = MMA_TILE, tf32x3: bool = True, passes: int = 3):
    """Chunked prefill, two launches (see the module docstring).

    chunk: tokens per chunk (rounded down to a power of two, lowered until the static shared memory
    of both launches fits 48 KiB; 32 for dk=128). state_tile: value columns per block of the
    sequential pass. ept: state rows (of dk) each thread of that pass keeps in registers.
    dv_tile: the previous kernel's tile knob, accepted for the registry and ignored.
    mma: tensor-core launches (None: wherever mma_applies; False: the SIMT launches). mma_tile: value
    columns per block of the tensor-core sequential pass (32: 192 blocks of 128 threads for Hv 48, at
    255 registers two per SM, i.e. one wave on 132 SMs; 16: 384 blocks, 213 registers). tf32x3: three
    tf32 mma per product (big/small split, ~fp32 accuracy) instead of one (~5e-4 relative error).
    state_tile / ept only shape the SIMT launches. passes: timing breakdowns only (1: the parallel
    launch does its work, the sequential one only reads and writes the state back; 2: the parallel
    launch's blocks exit at once and the sequential one runs on whatever the scratch holds); 3 = the
    kernel.
    """
    del dv_tile
    P1, P2 = passes & 1, passes >> 1 & 1  # 0: that launch's blocks exit at once (timing breakdowns)
    r = hv // hk
    C, EPT, G, DVT, NT1 = _chunk_layout(dk, dv, chunk, state_tile, ept)
    MMA = mma_applies(dk, dv, chunk, mma_tile) if mma is None else bool(mma)
    if MMA and not mma_applies(dk, dv, chunk, mma_tile):
        raise ValueError(f"tensor-core GDN passes need chunk 32, dk % 64 == 0, mma_tile % 8 == 0 "
                         f"(got C={C}, dk={dk}, tile={DVT})")
    if MMA:
        C, DVT = _mma_layout(dk, dv, chunk, mma_tile)
    MMA_FN, MMA_SRC = _mma_src(tf32x3)
    ST_FN, ST_SRC = "ninfer_gdn_st", "\n__forceinline__ __device__ void ninfer_gdn_st(float* p, float v) { *p = v; }\n"
    BAR_FN, BAR_SRC = "ninfer_gdn_bar", "\n__forceinline__ __device__ void ninfer_gdn_bar() { __syncthreads(); }\n"
    NTM = MMA_THREADS[1]  # threads of the tensor-core sequential pass (4 warps)
    MT = max(1, dk // 64)  # 16-row state tiles per warp
    NNT = DVT // 8 if DVT % 8 == 0 else 1  # 8-column n tiles
    KP = dk // 16  # float4 pairs of k steps over dk
    CP2 = C // 16 if C >= 16 else 1  # ... over the chunk
    SSS = dk + 16  # S^T row stride: the float4 B-fragment reads of a quarter warp hit 32 distinct banks
    SVS = C + 16  # V_new^T row stride (same reason)

    def srow(tx, mt, rr):  # state row of C-fragment register rr of m tile mt
        return (tx // 32 * MT + mt) * 16 + tx % 32 // 4 + 8 * (rr // 2)

    def scol(tx, nt, rr):  # column (in the tile) of C-fragment register rr of n tile nt
        return nt * 8 + tx % 4 * 2 + rr % 2

    def arow(tx, hf):  # chunk row of the warp's 16-row tile of [W; Q] (hf: + 8)
        return tx // 32 % 2 * 16 + tx % 32 // 4 + 8 * hf

    NDT = dv // DVT
    NT = DVT * G  # threads of the sequential pass
    NV4 = EPT // 4  # float4 per thread segment
    RV4 = dk // 4  # float4 per staged row
    SWD = max(1, 8 // NV4)
    LOG2G = G.bit_length() - 1
    DKP = dk + 4 if MMA else dk + 1  # pass-1 rows: (mma fragment / scalar column) reads hit distinct banks
    CP = C + 1
    CPA = C + 4 if MMA else CP  # pass-1 rows of A (float4 reads in the forward substitution)
    if MMA:
        NT1 = MMA_THREADS[0]  # 8 warps: the 16 tiles of [K; Q] K^T, two per warp

    def kqrow(ks, qs, tx, hf, e):  # A fragment of [K; Q] for warp tx // 32: row (w // 2 % 2) 16 + gid + 8 hf
        return T.if_then_else(tx // 64 < 2, ks[(tx // 64 % 2 * 16 + tx % 32 // 4 + 8 * hf) * DKP + e],
                              qs[(tx // 64 % 2 * 16 + tx % 32 // 4 + 8 * hf) * DKP + e])

    def tri(tx, rr, which):  # (chunk row, chunk column - 8 nn) of C-fragment register rr
        if which == 0:
            return tx // 64 % 2 * 16 + tx % 32 // 4 + 8 * (rr // 2)
        return tx // 32 % 2 * 16 + tx % 4 * 2 + rr % 2

    HB = C // 2
    NTRI = HB * (HB + 1) // 2  # 2x2 blocks of the lower triangle (incl. diagonal)
    mask = 0xFFFFFFFF if NT >= 32 else (1 << NT) - 1
    swz = _is_pow2(NV4)

    def phys(s4):
        """Physical float4 slot of logical slot s4 of a staged row (XOR swizzle inside a segment:
        the G lanes of one column read G segments of the same row without bank conflicts)."""
        if not swz or NV4 == 1:
            return s4
        e_g = s4 // NV4
        return e_g * NV4 + T.bitwise_xor(s4 % NV4, (e_g // SWD) % NV4)

    def i64(x):
        return T.Cast("int64", x)

    @T.prim_func
    def gdn_chunk(
        var_q: T.handle, var_k: T.handle, var_v: T.handle, var_g: T.handle, var_beta: T.handle,
        var_cu: T.handle, var_slot: T.handle, var_ssm: T.handle, layer: T.int32, var_o: T.handle,
    ):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        b = T.int64()
        bp1 = T.int64()
        s = T.int64()
        q = T.match_buffer(var_q, (n, hk, dk), "float32")
        k = T.match_buffer(var_k, (n, hk, dk), "float32")
        v = T.match_buffer(var_v, (n, hv, dv), "float32")
        g = T.match_buffer(var_g, (n, hv), "float32")
        beta = T.match_buffer(var_beta, (n, hv), "float32")
        cu = T.match_buffer(var_cu, (bp1,), "int32")
        slot = T.match_buffer(var_slot, (b,), "int32")
        ssm = T.match_buffer(var_ssm, (s, n_layers, hv, dk, dv), "float32")
        o = T.match_buffer(var_o, (n, hv, dv), "float32")
        # scratch (workspace): W rows, the masked decayed Q K^T rows, in-chunk cumulative log-decay
        wsc = T.alloc_buffer((T.max(n, T.int64(1)) * (hv * dk),), "float32", scope="global")
        mq = T.alloc_buffer((T.max(n, T.int64(1)) * (hv * C),), "float32", scope="global")
        gsc = T.alloc_buffer((T.max(n, T.int64(1)) * hv,), "float32", scope="global")
        # ---- 1. per (chunk, value head): gamma, A, M, then U -> o and W -> wsc ----------------
        for x in T.thread_binding((n + (C - 1)) // C + b, thread="blockIdx.x"):
            for h in T.thread_binding(hv, thread="blockIdx.y"):
                for tx in T.thread_binding(NT1, thread="threadIdx.x"):
                    ks = T.alloc_buffer((C * DKP,), "float32", scope="shared")
                    qs = T.alloc_buffer((C * DKP,), "float32", scope="shared")
                    am = T.alloc_buffer((C * CPA,), "float32", scope="shared")
                    graw = T.alloc_buffer((C,), "float32", scope="shared")
                    gam = T.alloc_buffer((C,), "float32", scope="shared")
                    egm = T.alloc_buffer((C,), "float32", scope="shared")
                    bet = T.alloc_buffer((C,), "float32", scope="shared")
                    loc = T.alloc_buffer((4,), "int32", scope="local")
                    dots = T.alloc_buffer((8,), "float32", scope="local")
                    kqa = T.alloc_buffer((8,), "float32", scope="local")
                    xs = T.alloc_buffer((C,), "float32", scope="local")
                    acc = T.alloc_buffer((1,), "float32", scope="local")
                    # which row / chunk this block is: scan the rows' chunk counts
                    loc[0] = 0
                    loc[1] = 0
                    loc[2] = 0
                    for rw in range(b):
                        if T.Cast("int32", x) >= loc[0]:
                            if T.Cast("int32", x) < loc[0] + (cu[rw + 1] - cu[rw] + (C - 1)) // C:
                                loc[1] = cu[rw] + (T.Cast("int32", x) - loc[0]) * C
                                loc[2] = T.min(C, cu[rw + 1] - loc[1])
                        loc[0] = loc[0] + (cu[rw + 1] - cu[rw] + (C - 1)) // C
                    c0 = loc[1]
                    ln = loc[2]
                    if ln * P1 > 0:
                        for m in range((C + NT1 - 1) // NT1):
                            if m * NT1 + tx < C:
                                graw[m * NT1 + tx] = T.if_then_else(
                                    m * NT1 + tx < ln, g[i64(c0 + m * NT1 + tx), h], T.float32(0))
                                bet[m * NT1 + tx] = T.if_then_else(
                                    m * NT1 + tx < ln, beta[i64(c0 + m * NT1 + tx), h], T.float32(0))
                        for m in range((C * dk + NT1 - 1) // NT1):
                            if (m * NT1 + tx) // dk < C:
                                ks[(m * NT1 + tx) // dk * DKP + (m * NT1 + tx) % dk] = T.if_then_else(
                                    (m * NT1 + tx) // dk < ln,
                                    k[i64(c0 + (m * NT1 + tx) // dk), h // r, (m * NT1 + tx) % dk], T.float32(0))
                                qs[(m * NT1 + tx) // dk * DKP + (m * NT1 + tx) % dk] = T.if_then_else(
                                    (m * NT1 + tx) // dk < ln,
                                    q[i64(c0 + (m * NT1 + tx) // dk), h // r, (m * NT1 + tx) % dk], T.float32(0))
                        T.tvm_storage_sync("shared")
                        # gamma_i = g_0 + ... + g_i (left to right; padded rows add 0)
                        for m in range((C + NT1 - 1) // NT1):
                            if m * NT1 + tx < C:
                                acc[0] = T.float32(0)
                                for t in T.unroll(C):
                                    acc[0] = acc[0] + T.Select(t <= m * NT1 + tx, graw[t], T.float32(0))
                                gam[m * NT1 + tx] = acc[0]
                                egm[m * NT1 + tx] = T.exp(acc[0])
                                if m * NT1 + tx < ln:
                                    gsc[i64(c0 + m * NT1 + tx) * hv + h] = acc[0]
                        T.tvm_storage_sync("shared")
                        if MMA:
                            # A and M on tensor cores: [K; Q] K^T in 16 x 8 tiles; warp w: row tile w // 2
                            # (K 0-15, K 16-31, Q 0-15, Q 16-31), column tiles 2 (w % 2) + 0, 1 (tiles
                            # above the diagonal skipped: warps 1 and 5 idle)
                            if tx // 32 // 2 % 2 == 1 or tx // 32 % 2 == 0:
                                for u in T.unroll(8):
                                    kqa[u] = T.float32(0)
                                for ks8 in T.unroll(dk // 8):
                                    for nn in T.unroll(2):
                                        T.evaluate(T.cuda.func_call(
                                            MMA_FN, T.address_of(kqa[nn * 4]),
                                            kqrow(ks, qs, tx, 0, ks8 * 8 + tx % 4),
                                            kqrow(ks, qs, tx, 1, ks8 * 8 + tx % 4),
                                            kqrow(ks, qs, tx, 0, ks8 * 8 + tx % 4 + 4),
                                            kqrow(ks, qs, tx, 1, ks8 * 8 + tx % 4 + 4),
                                            ks[((tx // 32 % 2 * 2 + nn) * 8 + tx % 32 // 4) * DKP + ks8 * 8 + tx % 4],
                                            ks[((tx // 32 % 2 * 2 + nn) * 8 + tx % 32 // 4) * DKP + ks8 * 8 + tx % 4 + 4],
                                            source_code=MMA_SRC))
                                for nn in T.unroll(2):
                                    for rr in T.unroll(4):
                                        if tx // 64 < 2:
                                            T.evaluate(T.cuda.func_call(
                                                ST_FN, T.address_of(am[tri(tx, rr, 0) * CPA + tri(tx, rr, 1) + nn * 8]), T.Select(
                                                    tri(tx, rr, 1) + nn * 8 < tri(tx, rr, 0),
                                                    bet[tri(tx, rr, 0)] * T.exp(T.min(
                                                        gam[tri(tx, rr, 0)] - gam[tri(tx, rr, 1) + nn * 8], T.float32(0)))
                                                    * kqa[nn * 4 + rr],
                                                    T.float32(0)), source_code=ST_SRC))
                                        else:
                                            if tri(tx, rr, 1) + nn * 8 <= tri(tx, rr, 0):
                                                if tri(tx, rr, 0) < ln:
                                                    mq[(i64(c0 + tri(tx, rr, 0)) * hv + h) * C + tri(tx, rr, 1) + nn * 8] = T.exp(
                                                        T.min(gam[tri(tx, rr, 0)] - gam[tri(tx, rr, 1) + nn * 8], T.float32(0))
                                                    ) * kqa[nn * 4 + rr]
                            # A is written by opaque stores and read after an opaque barrier: TVM's sync
                            # planner cannot tell the warps' tiles apart (it asks for a barrier inside the
                            # warp branch) and drops a plain barrier it sees no shared write before
                            T.evaluate(T.cuda.func_call(BAR_FN, source_code=BAR_SRC))
                        else:
                            # A (strictly lower, shared) and M (lower incl. diagonal, scratch): 2x2 blocks
                            for m in range((NTRI + NT1 - 1) // NT1):
                                if m * NT1 + tx < NTRI:
                                    loc[3] = 0
                                    for bq in range(1, HB):
                                        if bq * (bq + 1) // 2 <= m * NT1 + tx:
                                            loc[3] = bq
                                    for u in T.unroll(8):
                                        dots[u] = T.float32(0)
                                    for e in range(dk):
                                        dots[0] = dots[0] + ks[2 * loc[3] * DKP + e] * ks[
                                            2 * (m * NT1 + tx - loc[3] * (loc[3] + 1) // 2) * DKP + e]
                                        dots[1] = dots[1] + ks[2 * loc[3] * DKP + e] * ks[
                                            (2 * (m * NT1 + tx - loc[3] * (loc[3] + 1) // 2) + 1) * DKP + e]
                                        dots[2] = dots[2] + ks[(2 * loc[3] + 1) * DKP + e] * ks[
                                            2 * (m * NT1 + tx - loc[3] * (loc[3] + 1) // 2) * DKP + e]
                                        dots[3] = dots[3] + ks[(2 * loc[3] + 1) * DKP + e] * ks[
                                            (2 * (m * NT1 + tx - loc[3] * (loc[3] + 1) // 2) + 1) * DKP + e]
                                        dots[4] = dots[4] + qs[2 * loc[3] * DKP + e] * ks[
                                            2 * (m * NT1 + tx - loc[3] * (loc[3] + 1) // 2) * DKP + e]
                                        dots[5] = dots[5] + qs[2 * loc[3] * DKP + e] * ks[
                                            (2 * (m * NT1 + tx - loc[3] * (loc[3] + 1) // 2) + 1) * DKP + e]
                                        dots[6] = dots[6] + qs[(2 * loc[3] + 1) * DKP + e] * ks[
                                            2 * (m * NT1 + tx - loc[3] * (loc[3] + 1) // 2) * DKP + e]
                                        dots[7] = dots[7] + qs[(2 * loc[3] + 1) * DKP + e] * ks[
                                            (2 * (m * NT1 + tx - loc[3] * (loc[3] + 1) // 2) + 1) * DKP + e]
                                    for ii in T.unroll(2):
                                        for jj in T.unroll(2):
                                            # i = 2 bi + ii, j = 2 bj + jj
                                            am[(2 * loc[3] + ii) * CP + 2 * (m * NT1 + tx - loc[3] * (loc[3] + 1) // 2) + jj] = T.Select(
                                                2 * (m * NT1 + tx - loc[3] * (loc[3] + 1) // 2) + jj < 2 * loc[3] + ii,
                                                bet[2 * loc[3] + ii] * T.exp(T.min(
                                                    gam[2 * loc[3] + ii] - gam[2 * (m * NT1 + tx - loc[3] * (loc[3] + 1) // 2) + jj],
                                                    T.float32(0))) * dots[ii * 2 + jj],
                                                T.float32(0))
                                            if 2 * (m * NT1 + tx - loc[3] * (loc[3] + 1) // 2) + jj <= 2 * loc[3] + ii:
                                                if 2 * loc[3] + ii < ln:
                                                    mq[(i64(c0 + 2 * loc[3] + ii) * hv + h) * C
                                                       + 2 * (m * NT1 + tx - loc[3] * (loc[3] + 1) // 2) + jj] = T.exp(T.min(
                                                        gam[2 * loc[3] + ii] - gam[2 * (m * NT1 + tx - loc[3] * (loc[3] + 1) // 2) + jj],
                                                        T.float32(0))) * dots[4 + ii * 2 + jj]
                            T.tvm_storage_sync("shared")
                        # U = (I+A)^-1 beta V (into o), W = (I+A)^-1 beta e^gamma K (into wsc): one
                        # column per thread, forward substitution in registers
                        for m in range((dv + dk + NT1 - 1) // NT1):
                            if m * NT1 + tx < dv + dk:
                                if m * NT1 + tx < dv:
                                    for i in T.unroll(C):
                                        xs[i] = T.if_then_else(
                                            i < ln, bet[i] * v[i64(c0 + i), h, m * NT1 + tx], T.float32(0))
                                else:
                                    for i in T.unroll(C):
                                        xs[i] = bet[i] * egm[i] * ks[i * DKP + m * NT1 + tx - dv]
                                if MMA:
                                    for i in T.unroll(C):
                                        for j4 in T.unroll(C // 4):
                                            if j4 * 4 < i:
                                                for u in T.vectorized(4):
                                                    dots[4 + u] = am[i * CPA + j4 * 4 + u]
                                                for u in T.unroll(4):
                                                    if j4 * 4 + u < i:
                                                        xs[i] = xs[i] - dots[4 + u] * xs[j4 * 4 + u]
                                else:
                                    for i in T.unroll(C):
                                        for j in T.unroll(C):
                                            if j < i:
                                                xs[i] = xs[i] - am[i * CP + j] * xs[j]
                                if m * NT1 + tx < dv:
                                    for i in T.unroll(C):
                                        if i < ln:
                                            o[i64(c0 + i), h, m * NT1 + tx] = xs[i]
                                else:
                                    for i in T.unroll(C):
                                        if i < ln:
                                            wsc[(i64(c0 + i) * hv + h) * dk + (m * NT1 + tx - dv)] = xs[i]
        # ---- 2. per (row, value head, dv tile): chunks in order ---------------------------------
        if MMA:
            # tensor cores (mma.sync m16n8k8 tf32, fp32 accumulate; 3xTF32 split unless tf32x3=False).
            # warp w: rows 16 (w % 2).. of W (w < 2) or Q (w >= 2) for W S / Q S, state rows
            # (w MT + mt) 16.. (C fragments, in registers for the whole row) for the update.
            for bi in T.thread_binding(b, thread="blockIdx.x"):
                for h in T.thread_binding(hv, thread="blockIdx.y"):
                    for dt in T.thread_binding(NDT, thread="blockIdx.z"):
                        for tx in T.thread_binding(NTM, thread="threadIdx.x"):
                            sst = T.alloc_buffer((DVT * SSS,), "float32", scope="shared")  # S^T [c][e]
                            vnt = T.alloc_buffer((DVT * SVS,), "float32", scope="shared")  # V_new^T [c][j]
                            sa = T.alloc_buffer((MT * NNT * 4,), "float32", scope="local")
                            af = T.alloc_buffer((KP * 8,), "float32", scope="local")
                            pa = T.alloc_buffer((NNT * 4,), "float32", scope="local")
                            ua = T.alloc_buffer((NNT * 4,), "float32", scope="local")
                            mf = T.alloc_buffer((CP2 * 8,), "float32", scope="local")
                            kf = T.alloc_buffer((MT * CP2 * 8,), "float32", scope="local")
                            dcf = T.alloc_buffer((CP2 * 4,), "float32", scope="local")
                            vb = T.alloc_buffer((NNT * CP2 * 4,), "float32", scope="local")
                            bq = T.alloc_buffer((4,), "float32", scope="local")
                            sc = T.alloc_buffer((4,), "float32", scope="local")
                            for mt in T.unroll(MT):
                                for nt in T.unroll(NNT):
                                    for rr in T.unroll(4):
                                        sa[(mt * NNT + nt) * 4 + rr] = ssm[slot[bi], layer, h, srow(tx, mt, rr),
                                                                           dt * DVT + scol(tx, nt, rr)]
                                        sst[scol(tx, nt, rr) * SSS + srow(tx, mt, rr)] = sa[(mt * NNT + nt) * 4 + rr]
                            T.tvm_storage_sync("shared")
                            # A fragments (W rows for warps 0, 1, Q rows for 2, 3) of chunk 0
                            for kp in T.unroll(KP):
                                for hf in T.unroll(2):
                                    if arow(tx, hf) < T.min(C, cu[bi + 1] - cu[bi]):
                                        if tx // 32 < 2:
                                            for u in T.vectorized(4):
                                                af[(kp * 2 + hf) * 4 + u] = wsc[
                                                    (i64(cu[bi] + arow(tx, hf)) * hv + h) * dk + kp * 16 + tx % 4 * 4 + u]
                                        else:
                                            for u in T.vectorized(4):
                                                af[(kp * 2 + hf) * 4 + u] = q[
                                                    i64(cu[bi] + arow(tx, hf)), h // r, kp * 16 + tx % 4 * 4 + u]
                                    else:
                                        for u in T.vectorized(4):
                                            af[(kp * 2 + hf) * 4 + u] = T.float32(0)
                            for c in range((cu[bi + 1] - cu[bi] + (C - 1)) // C * P2):
                                c0 = cu[bi] + c * C
                                ln = T.min(C, cu[bi + 1] - c0)
                                # global -> registers: U / e^gamma, M, decayed K (the A fragments of this
                                # chunk's W or Q rows were loaded during the previous chunk)
                                if tx // 32 < 2:
                                    for nt in T.unroll(NNT):
                                        for rr in T.unroll(4):
                                            ua[nt * 4 + rr] = T.if_then_else(
                                                arow(tx, rr // 2) < ln,
                                                o[i64(c0 + arow(tx, rr // 2)), h, dt * DVT + scol(tx, nt, rr)], T.float32(0))
                                else:
                                    for hf in T.unroll(2):
                                        sc[hf] = T.if_then_else(
                                            arow(tx, hf) < ln, T.exp(gsc[i64(c0 + arow(tx, hf)) * hv + h]), T.float32(0))
                                    for kp in T.unroll(CP2):
                                        for hf in T.unroll(2):
                                            for u in T.unroll(4):
                                                mf[(kp * 2 + hf) * 4 + u] = T.if_then_else(
                                                    arow(tx, hf) < ln and kp * 16 + tx % 4 * 4 + u <= arow(tx, hf),
                                                    mq[(i64(c0 + arow(tx, hf)) * hv + h) * C + kp * 16 + tx % 4 * 4 + u],
                                                    T.float32(0))
                                sc[2] = T.exp(gsc[i64(c0 + ln - 1) * hv + h])
                                for kp in T.unroll(CP2):
                                    for u in T.unroll(4):
                                        dcf[kp * 4 + u] = T.if_then_else(
                                            kp * 16 + tx % 4 * 4 + u < ln,
                                            T.exp(gsc[i64(c0 + ln - 1) * hv + h] - gsc[i64(c0 + kp * 16 + tx % 4 * 4 + u) * hv + h]),
                                            T.float32(0))
                                for mt in T.unroll(MT):
                                    for kp in T.unroll(CP2):
                                        for hh in T.unroll(2):
                                            for u in T.unroll(4):
                                                kf[((mt * CP2 + kp) * 2 + hh) * 4 + u] = T.if_then_else(
                                                    kp * 16 + tx % 4 * 4 + u < ln,
                                                    k[i64(c0 + kp * 16 + tx % 4 * 4 + u), h // r,
                                                      (tx // 32 * MT + mt) * 16 + tx % 32 // 4 + 8 * hh] * dcf[kp * 4 + u],
                                                    T.float32(0))
                                # W S (warps 0, 1) / Q S (warps 2, 3): B fragments of S from S^T rows
                                for u in T.unroll(NNT * 4):
                                    pa[u] = T.float32(0)
                                for kp in T.unroll(KP):
                                    for nt in T.unroll(NNT):
                                        for u in T.vectorized(4):
                                            bq[u] = sst[(nt * 8 + tx % 32 // 4) * SSS + kp * 16 + tx % 4 * 4 + u]
                                        for s2 in T.unroll(2):
                                            T.evaluate(T.cuda.func_call(
                                                MMA_FN, T.address_of(pa[nt * 4]), af[kp * 8 + 2 * s2], af[kp * 8 + 4 + 2 * s2],
                                                af[kp * 8 + 2 * s2 + 1], af[kp * 8 + 4 + 2 * s2 + 1], bq[2 * s2], bq[2 * s2 + 1],
                                                source_code=MMA_SRC))
                                # prefetch the next chunk's A fragments (consumed: their loads overlap the rest)
                                for kp in T.unroll(KP):
                                    for hf in T.unroll(2):
                                        if arow(tx, hf) < cu[bi + 1] - c0 - C:
                                            if tx // 32 < 2:
                                                for u in T.vectorized(4):
                                                    af[(kp * 2 + hf) * 4 + u] = wsc[
                                                        (i64(c0 + C + arow(tx, hf)) * hv + h) * dk + kp * 16 + tx % 4 * 4 + u]
                                            else:
                                                for u in T.vectorized(4):
                                                    af[(kp * 2 + hf) * 4 + u] = q[
                                                        i64(c0 + C + arow(tx, hf)), h // r, kp * 16 + tx % 4 * 4 + u]
                                        else:
                                            for u in T.vectorized(4):
                                                af[(kp * 2 + hf) * 4 + u] = T.float32(0)
                                if tx // 32 < 2:
                                    for nt in T.unroll(NNT):
                                        for rr in T.unroll(4):
                                            vnt[scol(tx, nt, rr) * SVS + arow(tx, rr // 2)] = ua[nt * 4 + rr] - pa[nt * 4 + rr]
                                else:
                                    for nt in T.unroll(NNT):
                                        for rr in T.unroll(4):
                                            pa[nt * 4 + rr] = pa[nt * 4 + rr] * sc[rr // 2]
                                T.tvm_storage_sync("shared")
                                # B fragments of V_new (O and the state update share them)
                                for nt in T.unroll(NNT):
                                    for kp in T.unroll(CP2):
                                        for u in T.vectorized(4):
                                            vb[(nt * CP2 + kp) * 4 + u] = vnt[(nt * 8 + tx % 32 // 4) * SVS + kp * 16 + tx % 4 * 4 + u]
                                if tx // 32 >= 2:
                                    # O = e^gamma Q S + M V_new
                                    for kp in T.unroll(CP2):
                                        for s2 in T.unroll(2):
                                            for nt in T.unroll(NNT):
                                                T.evaluate(T.cuda.func_call(
                                                    MMA_FN, T.address_of(pa[nt * 4]), mf[kp * 8 + 2 * s2], mf[kp * 8 + 4 + 2 * s2],
                                                    mf[kp * 8 + 2 * s2 + 1], mf[kp * 8 + 4 + 2 * s2 + 1],
                                                    vb[(nt * CP2 + kp) * 4 + 2 * s2], vb[(nt * CP2 + kp) * 4 + 2 * s2 + 1],
                                                    source_code=MMA_SRC))
                                    for nt in T.unroll(NNT):
                                        for rr in T.unroll(4):
                                            if arow(tx, rr // 2) < ln:
                                                o[i64(c0 + arow(tx, rr // 2)), h, dt * DVT + scol(tx, nt, rr)] = pa[nt * 4 + rr]
                                # S = e^(g_last) S + (K e^(g_last - g))^T V_new
                                for u in T.unroll(MT * NNT * 4):
                                    sa[u] = sa[u] * sc[2]
                                for mt in T.unroll(MT):
                                    for kp in T.unroll(CP2):
                                        for s2 in T.unroll(2):
                                            for nt in T.unroll(NNT):
                                                T.evaluate(T.cuda.func_call(
                                                    MMA_FN, T.address_of(sa[(mt * NNT + nt) * 4]),
                                                    kf[(mt * CP2 + kp) * 8 + 2 * s2], kf[(mt * CP2 + kp) * 8 + 4 + 2 * s2],
                                                    kf[(mt * CP2 + kp) * 8 + 2 * s2 + 1], kf[(mt * CP2 + kp) * 8 + 4 + 2 * s2 + 1],
                                                    vb[(nt * CP2 + kp) * 4 + 2 * s2], vb[(nt * CP2 + kp) * 4 + 2 * s2 + 1],
                                                    source_code=MMA_SRC))
                                for mt in T.unroll(MT):
                                    for nt in T.unroll(NNT):
                                        for rr in T.unroll(4):
                                            sst[scol(tx, nt, rr) * SSS + srow(tx, mt, rr)] = sa[(mt * NNT + nt) * 4 + rr]
                                T.tvm_storage_sync("shared")
                            for mt in T.unroll(MT):
                                for nt in T.unroll(NNT):
                                    for rr in T.unroll(4):
                                        ssm[slot[bi], layer, h, srow(tx, mt, rr), dt * DVT + scol(tx, nt, rr)] = sa[
                                            (mt * NNT + nt) * 4 + rr]
        else:
            # ---- 2. per (row, value head, dv tile): chunks in order, state in registers ------------
            for bi in T.thread_binding(b, thread="blockIdx.x"):
                for h in T.thread_binding(hv, thread="blockIdx.y"):
                    for dt in T.thread_binding(NDT, thread="blockIdx.z"):
                        for tx in T.thread_binding(NT, thread="threadIdx.x"):
                            wk = T.alloc_buffer((C * dk,), "float32", scope="shared")  # W, then K
                            qs = T.alloc_buffer((C * dk,), "float32", scope="shared")
                            us = T.alloc_buffer((C * DVT,), "float32", scope="shared")
                            vns = T.alloc_buffer((C * DVT,), "float32", scope="shared")
                            oqs = T.alloc_buffer((C * DVT,), "float32", scope="shared")
                            mqs = T.alloc_buffer((C * CP,), "float32", scope="shared")
                            egs = T.alloc_buffer((C,), "float32", scope="shared")
                            decs = T.alloc_buffer((C,), "float32", scope="shared")
                            egl = T.alloc_buffer((1,), "float32", scope="shared")
                            hs = T.alloc_buffer((EPT,), "float32", scope="local")
                            wv = T.alloc_buffer((EPT,), "float32", scope="local")
                            qv = T.alloc_buffer((EPT,), "float32", scope="local")
                            pw = T.alloc_buffer((1,), "float32", scope="local")
                            pq = T.alloc_buffer((1,), "float32", scope="local")
                            acc = T.alloc_buffer((1,), "float32", scope="local")
                            # thread = (column tx // G, state rows (tx % G) * EPT ...)
                            for e in T.unroll(EPT):
                                hs[e] = ssm[slot[bi], layer, h, tx % G * EPT + e, dt * DVT + tx // G]
                            for c in range((cu[bi + 1] - cu[bi] + (C - 1)) // C * P2):
                                c0 = cu[bi] + c * C
                                ln = T.min(C, cu[bi + 1] - c0)
                                # stage W, Q (swizzled rows), U tile, M, decays; padded rows are zero
                                for m in range((C * RV4 + NT - 1) // NT):
                                    if (m * NT + tx) // RV4 < C:
                                        if (m * NT + tx) // RV4 < ln:
                                            for u in T.vectorized(4):
                                                wk[(m * NT + tx) // RV4 * dk + phys((m * NT + tx) % RV4) * 4 + u] = wsc[
                                                    (i64(c0 + (m * NT + tx) // RV4) * hv + h) * dk + (m * NT + tx) % RV4 * 4 + u]
                                            for u in T.vectorized(4):
                                                qs[(m * NT + tx) // RV4 * dk + phys((m * NT + tx) % RV4) * 4 + u] = q[
                                                    i64(c0 + (m * NT + tx) // RV4), h // r, (m * NT + tx) % RV4 * 4 + u]
                                        else:
                                            for u in T.vectorized(4):
                                                wk[(m * NT + tx) // RV4 * dk + phys((m * NT + tx) % RV4) * 4 + u] = T.float32(0)
                                            for u in T.vectorized(4):
                                                qs[(m * NT + tx) // RV4 * dk + phys((m * NT + tx) % RV4) * 4 + u] = T.float32(0)
                                for m in range((C * DVT + NT - 1) // NT):
                                    if m * NT + tx < C * DVT:
                                        us[m * NT + tx] = T.if_then_else(
                                            (m * NT + tx) // DVT < ln,
                                            o[i64(c0 + (m * NT + tx) // DVT), h, dt * DVT + (m * NT + tx) % DVT], T.float32(0))
                                for m in range((C * C + NT - 1) // NT):
                                    if m * NT + tx < C * C:
                                        mqs[(m * NT + tx) // C * CP + (m * NT + tx) % C] = T.if_then_else(
                                            (m * NT + tx) // C < ln and (m * NT + tx) % C <= (m * NT + tx) // C,
                                            mq[(i64(c0 + (m * NT + tx) // C) * hv + h) * C + (m * NT + tx) % C], T.float32(0))
                                for m in range((C + NT - 1) // NT):
                                    if m * NT + tx < C:
                                        egs[m * NT + tx] = T.if_then_else(
                                            m * NT + tx < ln, T.exp(gsc[i64(c0 + m * NT + tx) * hv + h]), T.float32(0))
                                        decs[m * NT + tx] = T.if_then_else(
                                            m * NT + tx < ln,
                                            T.exp(gsc[i64(c0 + ln - 1) * hv + h] - gsc[i64(c0 + m * NT + tx) * hv + h]),
                                            T.float32(0))
                                        if m * NT + tx == 0:
                                            egl[0] = T.exp(gsc[i64(c0 + ln - 1) * hv + h])
                                T.tvm_storage_sync("shared")
                                # V_new = U - W S (rows), Q S (rows): partial dots over this thread's
                                # state rows, reduced over the G lanes of the column
                                for i in T.unroll(C):
                                    for kk in T.unroll(NV4):
                                        for u in T.vectorized(4):
                                            wv[kk * 4 + u] = wk[i * dk + phys(tx % G * NV4 + kk) * 4 + u]
                                        for u in T.vectorized(4):
                                            qv[kk * 4 + u] = qs[i * dk + phys(tx % G * NV4 + kk) * 4 + u]
                                    pw[0] = T.float32(0)
                                    pq[0] = T.float32(0)
                                    for e in T.unroll(EPT):
                                        pw[0] = pw[0] + wv[e] * hs[e]
                                        pq[0] = pq[0] + qv[e] * hs[e]
                                    for lg in T.unroll(LOG2G):
                                        pw[0] = pw[0] + T.tvm_warp_shuffle_xor(T.uint32(mask), pw[0], (G // 2) >> lg, 32, 32)
                                        pq[0] = pq[0] + T.tvm_warp_shuffle_xor(T.uint32(mask), pq[0], (G // 2) >> lg, 32, 32)
                                    if tx % G == i % G:
                                        vns[i * DVT + tx // G] = us[i * DVT + tx // G] - pw[0]
                                        oqs[i * DVT + tx // G] = egs[i] * pq[0]
                                T.tvm_storage_sync("shared")
                                # stage K into wk (W is consumed); meanwhile O = e^g Q S + M V_new
                                for m in range((C * RV4 + NT - 1) // NT):
                                    if (m * NT + tx) // RV4 < C:
                                        if (m * NT + tx) // RV4 < ln:
                                            for u in T.vectorized(4):
                                                wk[(m * NT + tx) // RV4 * dk + phys((m * NT + tx) % RV4) * 4 + u] = k[
                                                    i64(c0 + (m * NT + tx) // RV4), h // r, (m * NT + tx) % RV4 * 4 + u]
                                        else:
                                            for u in T.vectorized(4):
                                                wk[(m * NT + tx) // RV4 * dk + phys((m * NT + tx) % RV4) * 4 + u] = T.float32(0)
                                for m in T.unroll((C + G - 1) // G):
                                    if m * G + tx // DVT < ln:
                                        acc[0] = oqs[(m * G + tx // DVT) * DVT + tx % DVT]
                                        for j in T.unroll(C):
                                            acc[0] = acc[0] + mqs[(m * G + tx // DVT) * CP + j] * vns[j * DVT + tx % DVT]
                                        o[i64(c0 + m * G + tx // DVT), h, dt * DVT + tx % DVT] = acc[0]
                                T.tvm_storage_sync("shared")
                                # S = e^(g_last) S + (K e^(g_last - g))^T V_new
                                for e in T.unroll(EPT):
                                    hs[e] = hs[e] * egl[0]
                                for i in T.unroll(C):
                                    for kk in T.unroll(NV4):
                                        for u in T.vectorized(4):
                                            wv[kk * 4 + u] = wk[i * dk + phys(tx % G * NV4 + kk) * 4 + u]
                                    acc[0] = vns[i * DVT + tx // G] * decs[i]
                                    for e in T.unroll(EPT):
                                        hs[e] = hs[e] + wv[e] * acc[0]
                                T.tvm_storage_sync("shared")
                            for e in T.unroll(EPT):
                                ssm[slot[bi], layer, h, tx % G * EPT + e, dt * DVT + tx // G] = hs[e]

    return gdn_chunk
