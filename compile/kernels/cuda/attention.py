"""CUDA paged gated-attention kernels (thread-bound TIR).

Same prim_func signature and buffer contract as compile/kernels/attention.py:
  attn(q[n,Hq,D], k[n,Hkv,D], v[n,Hkv,D], pos[n] i32, tseq[n] i32, pt[b,p] i32,
       pool[num_pages, n_layers, 2, Hkv, page, D] (kv_dtype), layer i32, out[n,Hq,D])

Three launches inside the one prim_func (stream order is the barrier between them):
  1. append:  grid (n, Hkv), threads over D: write this call's K/V into their pages.
  2. attend:  grid (n, Hkv, nsplit), NT threads. One block serves the `group` query heads that
     share a KV head (GQA: K/V are read once for all of them) over a contiguous range of pages
     (flash-decoding split). Per page (64 positions) a warp computes a position's dot products
     for all group heads (lanes stride D, shuffle reduction), then warps run the online-softmax
     update per head, then every thread accumulates P.V for D/NT output columns in registers.
     nsplit = clamp(ceil(target_blocks / (n*Hkv)), 1, p): decode (small n) is split over KV so
     ~target_blocks blocks are busy; prefill (large n) gets nsplit = 1 and writes `out` directly.
  3. combine: grid (n, Hq): merge the nsplit partial (acc, max, sum) triples (no-op if nsplit=1).
The split partials live in a workspace allocated inside the function (TVMBackendAllocWorkspace).

Quantized pages (kv_dtype fp8 | nvfp4): the llvm kernel's uint8 pool layout and bit-identical page
bytes (compile/kernels/attention_quant.py). The append launch is then one warp per (token, KV head):
for nvfp4 a lane per 16-element block (amax, E4M3 scale, E2M1 codes, packed bytes), for fp8 the
lanes split the row, reduce the row amax with shuffles and write the E4M3 codes and the E8M0 byte.
The attend launch dequantizes each element to fp32 as it loads it. TVM compiles CUDA with
--use_fast_math (approximate division, flush-to-zero), so the encoders use IEEE __fdiv_rn and find
amax by comparing integer bit patterns (subnormals and NaN handled like the llvm kernel).
"""
from __future__ import annotations

from tvm import tirx
from tvm.script import tirx as T

from ..attention_quant import (
    FP8_ROW_PAD, QUANT_KV_DTYPES, e2m1_decode, e2m1_encode, e4m3_decode, e4m3_decode_abs, e4m3_encode,
    e4m3_encode_abs, kv_pool_layout, pow2_from_e8m0,
)

NEG_BIG = -3.0e38
NVFP4_BLOCK = 16


def _u32(v):
    return tirx.const(v, "uint32")


def _fdiv_rn(a, b):
    """IEEE round-to-nearest fp32 division (TVM builds CUDA with --use_fast_math)."""
    return tirx.call_pure_extern("float32", "__fdiv_rn", a, b)


def _abs_bits(x):
    """|x| as uint32 bits; NaN maps to 0 (ignored by amax like the llvm kernel's fabs compare)."""
    au = tirx.reinterpret("uint32", x) & _u32(0x7FFFFFFF)
    return tirx.Select(au > _u32(0x7F800000), _u32(0), au)


def _fp8_exponent_bits(ab):
    """E8M0 byte for a row whose amax has bits ab (attention_quant.fp8_row_exponent_tir, but with an
    integer zero test so a subnormal amax is not flushed)."""
    b = tirx.Cast("int32", ab >> _u32(23)) - 8 + tirx.Cast("int32", (ab & _u32(0x7FFFFF)) > _u32(0x600000))
    b = tirx.max(tirx.min(b, 253), 1)
    return tirx.Select(ab > _u32(0), tirx.Cast("uint32", b), _u32(127))


def _nvfp4_code(x, scale):
    return tirx.Select(scale > tirx.const(0.0, "float32"), e2m1_encode(_fdiv_rn(x, scale)), _u32(0))


def paged_attention(
    n_heads: int, n_kv: int, head_dim: int, page_size: int, n_layers: int, dtype: str, sm_scale: float,
    kv_dtype: str | None = None, *, threads: int = 128, target_blocks: int = 264,
):
    """kv_dtype: page dtype (None = dtype); float32 / bfloat16 / float16 pages, or the quantized
    uint8 page rows fp8 / nvfp4 (same layout and bytes as the llvm kernel)."""
    kv_dt = kv_dtype or dtype
    quant = kv_dt in QUANT_KV_DTYPES
    if not quant and kv_dt not in ("float32", "bfloat16", "float16"):
        raise NotImplementedError(f"CUDA paged attention has no kernel for {kv_dt} KV pages")
    pool_dt, row_bytes = kv_pool_layout(kv_dt, head_dim)
    nvfp4 = kv_dt == "nvfp4"
    half = head_dim // 2
    nblk = head_dim // NVFP4_BLOCK
    group = n_heads // n_kv
    D = head_dim
    PS = page_size
    if D % 32 or PS % 32 or n_heads % n_kv:
        raise ValueError(f"CUDA attention needs head_dim and page_size multiples of 32 (got {D}, {PS})")
    NT = min(threads, D)
    while D % NT:
        NT -= 32
    W = NT // 32  # warps
    DL = D // 32  # elements of a dot product per lane
    DT = D // NT  # output columns per thread
    PL = PS // 32  # softmax entries per lane
    HW = (group + W - 1) // W  # heads per warp in the softmax step
    APPEND_T = min(D, 256)
    neg_big = NEG_BIG

    def load(pool, pg, layer, c, h, slot, d):
        """fp32 value of element d of a page row (dequantized for fp8 / nvfp4)."""
        if not quant:
            return T.Cast("float32", pool[pg, layer, c, h, slot, d])
        if nvfp4:
            byte = tirx.Cast("uint32", pool[pg, layer, c, h, slot, d // 2])
            code = (byte >> (tirx.Cast("uint32", d % 2) * _u32(4))) & _u32(15)
            sf = e4m3_decode_abs(tirx.Cast("uint32", pool[pg, layer, c, h, slot, half + d // NVFP4_BLOCK]))
            return e2m1_decode(code) * sf
        code = tirx.Cast("uint32", pool[pg, layer, c, h, slot, d])
        return e4m3_decode(code) * pow2_from_e8m0(tirx.Cast("uint32", pool[pg, layer, c, h, slot, head_dim]))

    def src(k, v, c, i, h, d):
        """fp32 K (c=0) or V (c=1) element of this call."""
        return T.if_then_else(c == 0, T.Cast("float32", k[i, h, d]), T.Cast("float32", v[i, h, d]))

    def _nsplit(n, p):
        """int32 number of KV splits; n, p are the int64 shape vars."""
        nk = T.Cast("int32", n) * n_kv
        return T.max(1, T.min(T.truncdiv(target_blocks + nk - 1, nk), T.Cast("int32", p)))

    def _ws_size(n, p, per):
        ns = T.Cast("int64", _nsplit(n, p))
        return T.Select(ns > 1, n * n_heads * ns * per, T.int64(1))

    def _ws(i, h, s, n, p):
        """int64 flat index of (token i, q head h, split s) in the workspace (times per-entry size)."""
        return (i * n_heads + h) * T.Cast("int64", _nsplit(n, p)) + T.Cast("int64", s)

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
        pool = T.match_buffer(var_pool, (npages, n_layers, 2, n_kv, page_size, row_bytes), pool_dt)
        out = T.match_buffer(var_out, (n, n_heads, head_dim), dtype)
        ws_o = T.alloc_buffer((_ws_size(n, p, D),), "float32", scope="global")
        ws_ml = T.alloc_buffer((_ws_size(n, p, 2),), "float32", scope="global")
        # ---- 1. append this call's K/V ---------------------------------------------------------
        if quant:
            # one warp per (token, KV head): lanes 0-31 handle K, then V (c), of one row
            for i in T.thread_binding(n, thread="blockIdx.x"):
                for h in T.thread_binding(n_kv, thread="blockIdx.y"):
                    for ln in T.thread_binding(32, thread="threadIdx.x"):
                        ab = T.alloc_buffer((1,), "uint32", scope="local")
                        sfq = T.alloc_buffer((1,), "float32", scope="local")
                        eb = T.alloc_buffer((1,), "uint32", scope="local")
                        xs = T.alloc_buffer((max(NVFP4_BLOCK, D // 32),), "float32", scope="local")
                        for c in range(2):
                            if nvfp4:
                                for b0 in range((nblk + 31) // 32):
                                    if b0 * 32 + ln < nblk:
                                        ab[0] = T.uint32(0)
                                        for e in T.unroll(NVFP4_BLOCK):
                                            xs[e] = src(k, v, c, i, h, (b0 * 32 + ln) * NVFP4_BLOCK + e)
                                            ab[0] = T.max(ab[0], _abs_bits(xs[e]))
                                        eb[0] = e4m3_encode_abs(
                                            _fdiv_rn(T.reinterpret("float32", ab[0]), T.float32(6.0)))
                                        pool[pt[tseq[i], pos[i] // page_size], layer, c, h, pos[i] % page_size,
                                             half + b0 * 32 + ln] = T.Cast("uint8", eb[0])
                                        sfq[0] = e4m3_decode_abs(eb[0])
                                        for j in T.unroll(NVFP4_BLOCK // 2):
                                            pool[pt[tseq[i], pos[i] // page_size], layer, c, h, pos[i] % page_size,
                                                 (b0 * 32 + ln) * (NVFP4_BLOCK // 2) + j] = T.Cast(
                                                "uint8",
                                                _nvfp4_code(xs[2 * j], sfq[0])
                                                | (_nvfp4_code(xs[2 * j + 1], sfq[0]) << T.uint32(4)))
                            else:
                                ab[0] = T.uint32(0)
                                for e in T.unroll(D // 32):
                                    xs[e] = src(k, v, c, i, h, e * 32 + ln)
                                    ab[0] = T.max(ab[0], _abs_bits(xs[e]))
                                for o in T.unroll(5):
                                    ab[0] = T.max(ab[0], T.tvm_warp_shuffle_xor(
                                        T.uint32(0xFFFFFFFF), ab[0], 16 >> o, 32, 32))
                                eb[0] = _fp8_exponent_bits(ab[0])
                                # 2^-e as an exact power of two: biased exponent 254 - b
                                sfq[0] = pow2_from_e8m0(T.uint32(254) - eb[0])
                                for e in T.unroll(D // 32):
                                    pool[pt[tseq[i], pos[i] // page_size], layer, c, h, pos[i] % page_size,
                                         e * 32 + ln] = T.Cast("uint8", e4m3_encode(xs[e] * sfq[0]))
                                if ln < FP8_ROW_PAD:
                                    pool[pt[tseq[i], pos[i] // page_size], layer, c, h, pos[i] % page_size,
                                         head_dim + ln] = T.Cast("uint8", T.Select(ln == 0, eb[0], T.uint32(0)))
        else:
            for i in T.thread_binding(n, thread="blockIdx.x"):
                for h in T.thread_binding(n_kv, thread="blockIdx.y"):
                    for tx in T.thread_binding(APPEND_T, thread="threadIdx.x"):
                        for d0 in range((D + APPEND_T - 1) // APPEND_T):
                            if d0 * APPEND_T + tx < D:
                                pool[pt[tseq[i], pos[i] // page_size], layer, 0, h, pos[i] % page_size,
                                     d0 * APPEND_T + tx] = T.Cast(pool_dt, k[i, h, d0 * APPEND_T + tx])
                                pool[pt[tseq[i], pos[i] // page_size], layer, 1, h, pos[i] % page_size,
                                     d0 * APPEND_T + tx] = T.Cast(pool_dt, v[i, h, d0 * APPEND_T + tx])
        # ---- 2. attend (split over KV pages) ----------------------------------------------------
        for i in T.thread_binding(n, thread="blockIdx.x"):
            for g in T.thread_binding(n_kv, thread="blockIdx.y"):
                for s in T.thread_binding(_nsplit(n, p), thread="blockIdx.z"):
                    for tx in T.thread_binding(NT, thread="threadIdx.x"):
                        qs = T.alloc_buffer((group, D), "float32", scope="shared")
                        sc = T.alloc_buffer((group, PS), "float32", scope="shared")
                        pb = T.alloc_buffer((group, PS), "float32", scope="shared")
                        al = T.alloc_buffer((group,), "float32", scope="shared")
                        ml = T.alloc_buffer((group, 2), "float32", scope="shared")
                        acc = T.alloc_buffer((group, DT), "float32", scope="local")
                        kreg = T.alloc_buffer((DL,), "float32", scope="local")
                        mreg = T.alloc_buffer((HW,), "float32", scope="local")
                        lreg = T.alloc_buffer((HW,), "float32", scope="local")
                        red = T.alloc_buffer((1,), "float32", scope="local")
                        red2 = T.alloc_buffer((1,), "float32", scope="local")
                        mnew = T.alloc_buffer((1,), "float32", scope="local")
                        for e in range((group * D + NT - 1) // NT):
                            if e * NT + tx < group * D:
                                qs[(e * NT + tx) // D, (e * NT + tx) % D] = T.Cast(
                                    "float32", q[i, g * group + (e * NT + tx) // D, (e * NT + tx) % D]
                                ) * T.float32(sm_scale)
                        for h0 in T.unroll(HW):
                            mreg[h0] = T.float32(neg_big)
                            lreg[h0] = T.float32(0)
                        for hh in T.unroll(group):
                            for dd in T.unroll(DT):
                                acc[hh, dd] = T.float32(0)
                        T.tvm_storage_sync("shared")
                        pps = (T.Cast("int32", p) + _nsplit(n, p) - 1) // _nsplit(n, p)
                        lo = s * pps * PS
                        hi = T.min(lo + pps * PS, pos[i] + 1)
                        row = tseq[i]
                        w = tx // 32
                        lane = tx % 32
                        for pi in range(T.max((hi - lo + PS - 1) // PS, 0)):
                            t0 = lo + pi * PS
                            tl = T.min(PS, hi - t0)
                            page = pt[row, t0 // PS]
                            # scores: warp w takes positions w, w+W, ...
                            for j0 in range((PS + W - 1) // W):
                                if j0 * W + w < tl:
                                    for e in T.unroll(DL):
                                        kreg[e] = load(pool, page, layer, 0, g, j0 * W + w, e * 32 + lane)
                                    for hh in T.unroll(group):
                                        red[0] = T.float32(0)
                                        for e in T.unroll(DL):
                                            red[0] = red[0] + qs[hh, e * 32 + lane] * kreg[e]
                                        for o in T.unroll(5):
                                            red[0] = red[0] + T.tvm_warp_shuffle_xor(
                                                T.uint32(0xFFFFFFFF), red[0], 16 >> o, 32, 32)
                                        if lane == 0:
                                            sc[hh, j0 * W + w] = red[0]
                            T.tvm_storage_sync("shared")
                            # online softmax per head: warp w owns heads w, w+W, ... (m, l in registers)
                            for h0 in T.unroll(HW):
                                if h0 * W + w < group:
                                    red[0] = T.float32(neg_big)
                                    for e in T.unroll(PL):
                                        if e * 32 + lane < tl:
                                            red[0] = T.max(red[0], sc[h0 * W + w, e * 32 + lane])
                                    for o in T.unroll(5):
                                        red[0] = T.max(red[0], T.tvm_warp_shuffle_xor(
                                            T.uint32(0xFFFFFFFF), red[0], 16 >> o, 32, 32))
                                    mnew[0] = T.max(mreg[h0], red[0])
                                    red2[0] = T.float32(0)
                                    for e in T.unroll(PL):
                                        if e * 32 + lane < tl:
                                            pb[h0 * W + w, e * 32 + lane] = T.exp(sc[h0 * W + w, e * 32 + lane] - mnew[0])
                                            red2[0] = red2[0] + T.exp(sc[h0 * W + w, e * 32 + lane] - mnew[0])
                                    for o in T.unroll(5):
                                        red2[0] = red2[0] + T.tvm_warp_shuffle_xor(
                                            T.uint32(0xFFFFFFFF), red2[0], 16 >> o, 32, 32)
                                    lreg[h0] = lreg[h0] * T.exp(mreg[h0] - mnew[0]) + red2[0]
                                    if lane == 0:
                                        al[h0 * W + w] = T.exp(mreg[h0] - mnew[0])
                                    mreg[h0] = mnew[0]
                            T.tvm_storage_sync("shared")
                            # P.V: thread owns columns dd*NT + tx
                            for hh in T.unroll(group):
                                for dd in T.unroll(DT):
                                    acc[hh, dd] = acc[hh, dd] * al[hh]
                            for jj in range(tl):
                                for dd in T.unroll(DT):
                                    red[0] = load(pool, page, layer, 1, g, jj, dd * NT + tx)
                                    for hh in T.unroll(group):
                                        acc[hh, dd] = acc[hh, dd] + pb[hh, jj] * red[0]
                            T.tvm_storage_sync("shared")
                        for h0 in T.unroll(HW):
                            if h0 * W + w < group:
                                if lane == 0:
                                    ml[h0 * W + w, 0] = mreg[h0]
                                    ml[h0 * W + w, 1] = lreg[h0]
                        T.tvm_storage_sync("shared")
                        if _nsplit(n, p) == 1:
                            for hh in T.unroll(group):
                                for dd in T.unroll(DT):
                                    out[i, g * group + hh, dd * NT + tx] = T.Cast(dtype, acc[hh, dd] / ml[hh, 1])
                        else:
                            for hh in T.unroll(group):
                                for dd in T.unroll(DT):
                                    ws_o[_ws(i, g * group + hh, s, n, p) * D + dd * NT + tx] = acc[hh, dd]
                            if tx < group:
                                ws_ml[_ws(i, g * group + tx, s, n, p) * 2] = ml[tx, 0]
                                ws_ml[_ws(i, g * group + tx, s, n, p) * 2 + 1] = ml[tx, 1]
        # ---- 3. combine split partials -------------------------------------------------------------
        for i in T.thread_binding(n, thread="blockIdx.x"):
            for h in T.thread_binding(n_heads, thread="blockIdx.y"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    mx = T.alloc_buffer((1,), "float32", scope="local")
                    den = T.alloc_buffer((1,), "float32", scope="local")
                    o_acc = T.alloc_buffer((DT,), "float32", scope="local")
                    if _nsplit(n, p) > 1:
                        mx[0] = T.float32(neg_big)
                        den[0] = T.float32(0)
                        for dd in T.unroll(DT):
                            o_acc[dd] = T.float32(0)
                        for s in range(_nsplit(n, p)):
                            mx[0] = T.max(mx[0], ws_ml[_ws(i, h, s, n, p) * 2])
                        for s in range(_nsplit(n, p)):
                            if ws_ml[_ws(i, h, s, n, p) * 2 + 1] > T.float32(0):
                                den[0] = den[0] + ws_ml[_ws(i, h, s, n, p) * 2 + 1] * T.exp(
                                    ws_ml[_ws(i, h, s, n, p) * 2] - mx[0])
                                for dd in T.unroll(DT):
                                    o_acc[dd] = o_acc[dd] + ws_o[_ws(i, h, s, n, p) * D + dd * NT + tx] * T.exp(
                                        ws_ml[_ws(i, h, s, n, p) * 2] - mx[0])
                        for dd in T.unroll(DT):
                            out[i, h, dd * NT + tx] = T.Cast(dtype, o_acc[dd] / den[0])

    return attn
