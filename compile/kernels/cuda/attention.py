"""CUDA paged gated-attention kernels (thread-bound TIR).

Same prim_func signature and buffer contract as compile/kernels/attention.py:
  attn(q[n,Hq,D], k[n,Hkv,D], v[n,Hkv,D], pos[n] i32, tseq[n] i32, pt[b,p] i32,
       pool[num_pages, n_layers, 2, Hkv, page, D] (kv_dtype), layer i32, out[n,Hq,D])

Three launches inside the one prim_func (stream order is the barrier between them):
  1. append:  grid (n, Hkv): write this call's K/V into their pages.
  2. attend:  grid (n, Hkv, nsplit), W = threads/32 warps. A block serves the G = Hq/Hkv query heads
     that share a KV head (GQA: K/V are read once for all of them) over a contiguous range of
     32-position chunks of token i's context (flash-decoding split; the range is cut from the
     token's own length, so every split has work). Warp w takes chunks w, w+W, ... with its own
     online softmax (base 2: Q or the scores are scaled by log2 e). Nothing in the per-warp loop
     touches shared memory that is also written there (TVM's ThreadSync would put __syncthreads
     into the warp-divergent loop): lanes exchange data by shuffles. Rows past the token's length
     are clamped to its last row for the loads and masked (score -inf). At the end the warps merge
     (max, sum, acc) pairwise through shared memory (log2 W rounds) and warp 0 writes `out`
     (nsplit = 1) or the split partial. nsplit = clamp(ceil(target_blocks / (n*Hkv)), 1,
     p*page/32/W): decode is split over KV so ~target_blocks blocks are busy, each warp with at
     least one chunk; prefill (large n) gets nsplit = 1.
     Tensor-core path (bf16 / f16 pages of the activation dtype, D % 64 == 0, G <= 8; the 27B
     geometry): per batch of 16 positions, lane (g = lane/4, t = lane%4) loads 16 bytes of K rows
     g and 8+g per 32-column slab and of V rows 2t, 2t+1, 2t+8, 2t+9 per 64-column group (32
     loads per lane, all issued before the first mma: one memory round trip per batch), then
       S  = Q K^T   16 x mma.m16n8k16 per 8 positions: rows = heads (Q fragments from shared
                    memory, rows >= G zero), k = head_dim in a permuted order that lets the B
                    fragment be the lane's contiguous 16 bytes;
       softmax      lane holds 4 scores of head g; max over the 4 lanes of the group (2 shuffles);
       O^T += V^T P^T   16 mma per 16 positions: rows = V columns (64q + 8g + 0..7 across the four
                    m tiles of a group), n = heads, k = positions; A is built from the loaded V
                    words with 16-bit permutes, B = the lane's own P (bf16 / f16, packed with
                    cvt.rn) exactly in the layout the S fragment left it.
     Lane (g, t) ends with heads 2t, 2t+1 x columns 64q + 8g + 0..7 in 4*D/16 fp32 registers.
     nvfp4 pages (D = 256, 16-bit activations) take the same path with f16 mma on fragments dequantized
     in registers (every code x block scale is exact in f16): lane (g, t) loads 32 code bytes of K rows
     g and 8+g (columns 64t..64t+63; its k order: word s of f16 pairs (0,2) (1,3) (4,6) (5,7) of columns
     64t + 8s, Q staged in shared memory in that order) and 16 code bytes of V rows 2t, 2t+1, 2t+8, 2t+9
     (columns 32g..32g+31, so the lane ends with columns 32g + 8q + 0..7), plus their scale bytes: 8
     16-byte and 6 4-byte loads per 16 positions (72 + 72 bytes per lane instead of 256 + 256), then per
     8 codes 2 byte permutes (magnitude from the f16 high bytes, sign), 1 f16x2 multiply by the scale.
     fp4_qk (sm_120a, asked for by the sm_120 kernel set; nvfp4 pages on this path): S = Q K^T on the
     block-scaled FP4 tensor cores instead, straight from the page bytes. The block first quantizes Q of its G
     heads to NVFP4 in shared memory (warp per head row, lane per 16-block) with fp4_mma's activation convention:
     enc = 2688 / amax of the (token, head) row (so the row's top block scale is 448 and one outlier head cannot
     push the others into E4M3 subnormals), block scale E4M3(amax_blk x enc / 6), codes E2M1(x enc / scale); lane
     (g, t) keeps head g's A fragment words t, t + 4 of every 64-column chunk, its scale words and 1/enc in
     registers. Per 16 positions it loads K code words t, t + 4 of every chunk of rows g, 8 + g (16 4-byte
     loads) and the two rows' scale words (2 16-byte loads; the f16 path: 4 16-byte + 2 4-byte), and issues one
     `mma.sync ... kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64` per chunk and 8 positions (8 instead of 32
     f16 mma, no K dequantization); the C fragment is the m16n8k16 one, scores are x 1/enc of head g, and the
     softmax and P.V (V dequantized in registers) are the nvfp4 path's. Q's NVFP4 rounding is the price
     (bench/fp4_attn_accuracy.py, Gaussian inputs: 9.4 % mean relative error of the output rows against the
     dequant path; against unquantized bf16 K/V the mean goes from 13.5 % (NVFP4 K/V alone) to 16.4 %).
     fp8 pages (16-bit activations) take it with the bf16 path's columns (rows of D + 4 bytes: 4-byte
     loads), each pair of E4M3 codes converted to f16x2 by one cvt; the K row exponent scales the lane's
     scores, the V row exponent e joins the P.V weights: P = 2^(s + e - mv) in f16 with mv the running
     max of s + e (so P stays in [0, 1] whatever the row scales), the sums keep 2^(s - m), and the
     accumulators are brought back by 2^(mv - m) before the warps merge. Both stage Q in shared memory
     as f16 (bf16 Q values are exact in f16 between 2^-14 and 65504; larger ones would overflow).
     SIMT path (f32 pages, quantized pages of other geometries, small or odd ones): lane l owns the D/32
     contiguous columns of Q (fp32 registers), of every K/V row it reads (16-byte loads where the
     row layout allows) and of the accumulators. Per batch of QB positions each lane forms
     G x QB partial dot products; a transposing butterfly (halve the position set on lane bits 16,
     8, 4, then full xor reduce) leaves lane l with the scores of position l >> (5 - log2 QB) for
     all heads (~G*(QB+1) shuffles per QB positions); P.V shuffles each p from its lane.
  2'. prefill attend (bf16 / f16 pages of the activation dtype, or fp8 / nvfp4 pages under bf16 activations,
     D % 64 == 0; calls with n >= prefill_min
     = 64 tokens, a host-side branch; nsplit is then 1): FlashAttention-2 (prefill_source, CUDA source
     called from a thin launch). Grid (ceil(n G / 64), Hkv) x 128 threads, 99 KB dynamic shared memory
     (D = 256). A block takes 64 rows R = i G + h (token i, query head h of KV head blockIdx.y; late
     tiles first), so K/V tiles are shared by the G heads; warp w owns rows 16w..16w+15. Q tile and
     K/V tiles of 32 positions go to shared memory by cp.async (K/V double-buffered, rows padded by 16
     bytes: conflict-free ldmatrix); S = Q K^T and O += P V by mma.m16n8k16 (A/B fragments by
     ldmatrix, V by ldmatrix.trans, P re-packed from the S accumulators), online softmax in base 2 per
     row, mask: position <= the row's position and row of the pass's sequence. A tile whose rows span
     several sequences walks each sequence's pages in its own pass (rows of other sequences masked).
     Quantized pages: each thread loads its (row, 16-column block) units of the next K/V tile into
     registers before the mma work on the current tile and dequantizes them into the other bf16
     shared buffer after it (exact: codes to f16 by the split path's helpers, to fp32, x the fp8 row
     scale, packed to bf16).
  2''. verify attend (paged_attention(short_rows=True): the kernel set's verify_attention, which verify / verify_t
     take under short_rows_scope; bf16 / f16 pages of the activation dtype, D % 64 == 0; every call, no prefill
     branch): grid (b, Hkv, nsplit) x 128 threads, the prefill launch's shared memory. A block takes ALL the rows
     of its sequence (tokens found in the sorted tseq; rows (token, head of its KV head) in 64-row tiles, a warp
     per 16) and reads each 32-position K/V tile of its split once for them, where the split attend reads it once
     per token: same K/V tiles and mma tile math as the prefill launch (attention_tile.py), causal mask per row,
     flash-decoding split over the context (nsplit = clamp(ceil(target_blocks / (b Hkv)), 1, p page / 64)) with
     the combine below (attention_verify.py).
  3. combine: grid (n, Hq) x 256 threads (a single idle block if nsplit = 1): every warp reduces the
     splits' (max, sum) pairs with shuffles, warp 0 stores the split weights in shared memory, the
     warps sum interleaved partial rows (8 in flight per lane) and add up through shared memory.
The split partials live in a workspace allocated inside the function (TVMBackendAllocWorkspace);
their maxima are in base-2 units. The kernels are checked against a float64 reference on the GPU
(bench/attn_gpu_check.py) and in a CPU emulation of the generated CUDA (warp shuffles and mma included;
compile/kernels/cuda/emulate, tests/test_cuda_build.py).

Quantized pages (kv_dtype fp8 | nvfp4): the llvm kernel's uint8 pool layout and bit-identical page
bytes (compile/kernels/attention_quant.py). The append launch is then one warp per (token, KV head):
for nvfp4 a lane per 16-element block (amax, E4M3 scale, E2M1 codes, packed bytes), for fp8 the
lanes split the row, reduce the row amax with shuffles and write the E4M3 codes and the E8M0 byte.
The split attend launch (SIMT path: odd geometries, f32 activations) loads the row bytes with 4-byte loads where
the row layout allows and dequantizes each element once per position to fp32 exactly (code x row /
block scale) with branch-free integer decoders (a Select on a loaded code compiles to an if / else). TVM compiles CUDA with
--use_fast_math (approximate division, flush-to-zero), so the encoders use IEEE __fdiv_rn and find
amax by comparing integer bit patterns (subnormals and NaN handled like the llvm kernel).
"""
from __future__ import annotations

import re
from functools import lru_cache

from tvm import tirx
from tvm.script import tirx as T

from ..attention_quant import (
    FP8_ROW_PAD, QUANT_KV_DTYPES, e2m1_decode, e2m1_encode, e4m3_decode, e4m3_decode_abs, e4m3_encode,
    e4m3_encode_abs, kv_row, pow2_from_e8m0,
)
from .attention_tile import tile_load_src, tile_math_src
from .attention_verify import VF_BKV, VF_MIN_TILES, VF_NT, verify_applies, verify_source
from .fp4_mma import a_frag, b_frag, mma_nvf4_source, row_encode_scale, sfa_row

NEG_BIG = -3.0e38
NVFP4_BLOCK = 16
LOG2E = 1.4426950408889634
CHUNK = 32  # positions per work unit of a warp


def _u32(v):
    return tirx.const(v, "uint32")


def _dev_src(body: str, guard: bool = False) -> str:
    # the markers let the CPU emulator (compile/kernels/cuda/emulate) swap these for its own versions. guard: an include guard
    # (named after the first function) so that several kernels' sources (prefill_source) may carry it
    if guard:
        m = re.search(r"(ninfer_attn_\w+)\(", body)
        assert m is not None, "a guarded source defines a ninfer_attn_ function"
        name = m.group(1).upper()
        body = "#ifndef " + name + "_DEFINED\n#define " + name + "_DEFINED\n" + body.strip() + "\n#endif"
    return "\n// NINFER_ATTN_DEV_BEGIN\n" + body.strip() + "\n// NINFER_ATTN_DEV_END\n"


# D[16x8] += A[16x16] B[16x8] (mma.sync m16n8k16, fp32 accumulate); c points at 4 fp32 registers
_MMA_SRC = {
    t: (f"ninfer_attn_mma_{t}", _dev_src(f"""
__forceinline__ __device__ void ninfer_attn_mma_{t}(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3,
                                                  unsigned b0, unsigned b1) {{
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 {{%0, %1, %2, %3}}, {{%4, %5, %6, %7}}, "
               "{{%8, %9}}, {{%0, %1, %2, %3}};\\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}}"""))
    for t in ("bf16", "f16")
}
_MMA_SRC = {"bfloat16": _MMA_SRC["bf16"], "float16": _MMA_SRC["f16"]}
# 16-byte load through the read-only path (the pool is not written while the attend launch runs).
# volatile keeps NVVM from moving the batch's loads; ptxas is kept from sinking them next to their mma
# (one memory round trip each) by __launch_bounds__(.., min_blocks) and the scores' zero dependency
LD_FN, LD_SRC = "ninfer_attn_ld16", _dev_src("""
__forceinline__ __device__ void ninfer_attn_ld16(unsigned* d, const void* p) {
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3]) : "l"(p));
}""")
# two fp32 -> packed 16-bit pair (round to nearest even), lo in the low half
_PACK_SRC = {
    dt: (f"ninfer_attn_pack_{t}x2", _dev_src(f"""
__forceinline__ __device__ unsigned ninfer_attn_pack_{t}x2(float lo, float hi) {{
  unsigned r;
  asm("cvt.rn.{t}x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}}"""))
    for dt, t in (("bfloat16", "bf16"), ("float16", "f16"))
}


# nvfp4 pages on tensor cores (f16 mma). NVFP4_F16X8: the 8 E2M1 codes of a word (element x in nibble x)
# times the block scale as 4 f16x2 words holding elements (0, 2), (1, 3), (4, 6), (5, 7): magnitudes by one
# byte permute from the f16 high bytes of (0, .5, 1, 1.5, 2, 3, 4, 6) (low bytes 0), signs by a second
# permute (the code's sign bit is its nibble's top bit), then one f16x2 multiply (exact: code x scale has
# at most 6 significant bits in [2^-10, 2688]). E4M3_F16X2: the block-scale byte as an f16x2 pair.
NVFP4_F16X8_FN, NVFP4_F16X8_SRC = "ninfer_attn_nvfp4_f16x8", _dev_src("""
__forceinline__ __device__ void ninfer_attn_nvfp4_f16x8(unsigned* d, unsigned w, unsigned s2) {
  const unsigned src[4] = {w << 4, w, w >> 12, w >> 16};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const unsigned mag = __byte_perm(0x3E3C3800u, 0x46444240u, src[k] & 0x7070u);
    const unsigned h = mag | (__byte_perm(src[k], 0u, 0x1404u) & 0x80008000u);
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d[k]) : "r"(h), "r"(s2));
  }
}""", guard=True)
E4M3_F16X2_FN, E4M3_F16X2_SRC = "ninfer_attn_e4m3_f16x2", _dev_src("""
__forceinline__ __device__ unsigned ninfer_attn_e4m3_f16x2(unsigned b) {
  unsigned r;
  const unsigned short x = (unsigned short)((b & 0xFFu) * 0x101u);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(x));
  return r;
}""", guard=True)
NVFP4_F16_PERM = ((0, 2), (1, 3), (4, 6), (5, 7))  # elements of the f16x2 words of NVFP4_F16X8
# fp8 pages on tensor cores: the two E4M3 codes of the low 16 bits of w as an f16x2 pair (exact)
E4M3X2_F16X2_FN, E4M3X2_F16X2_SRC = "ninfer_attn_e4m3x2_f16x2", _dev_src("""
__forceinline__ __device__ unsigned ninfer_attn_e4m3x2_f16x2(unsigned w) {
  unsigned r;
  const unsigned short x = (unsigned short)(w & 0xFFFFu);
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(r) : "h"(x));
  return r;
}""", guard=True)
# the low f16 half of h as fp32 (exact)
H2F_SRC = _dev_src("""
__forceinline__ __device__ float ninfer_attn_h2f(unsigned h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(h & 0xFFFFu)));
  return f;
}""", guard=True)


# fp4_qk (sm_120a): S = Q K^T on the block-scaled FP4 tensor cores, D[16x8] += (A x SFA)(B x SFB) with A = Q (16 rows =
# heads, 64 columns), B = K^T (64 columns x 8 positions), E2M1 operands and UE4M3 scales per 16 k (fragment layouts:
# fp4_mma.py a_frag / b_frag / sfa_row / sfb_col / c_frag); the C fragment is the m16n8k16 one the softmax reads
MMA_NVF4_FN = "ninfer_attn_mma_nvf4"
MMA_NVF4_SRC = _dev_src(mma_nvf4_source(MMA_NVF4_FN))
# 4-byte load through the read-only path (fp4_qk: the K code words of a B fragment are 4-byte pieces of the row)
LD4_FN, LD4_SRC = "ninfer_attn_ld4", _dev_src("""
__forceinline__ __device__ unsigned ninfer_attn_ld4(const void* p) {
  unsigned r;
  asm volatile("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
  return r;
}""")


def _a_word(lane, u):
    """fp4_qk: word (of a 64-column chunk) of A register 2u of `lane` (registers 1, 3: rows 8..15, zero)."""
    return a_frag(lane, 2 * u)[1]


def _b_word(lane, u):
    """fp4_qk: word (of a 64-column chunk) of B register u of `lane` (column: position lane // 4 of the tile)."""
    return b_frag(lane, u)[1]


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


def _signed(mag, sign_bit):
    """mag (float32 >= 0) with sign_bit (uint32: 0 or 1 << 31) ORed into its bits."""
    return tirx.reinterpret("float32", tirx.reinterpret("uint32", mag) | sign_bit)


def _e2m1_twice(c):
    """2 x the E2M1 value of code c & 15 (uint32), exact and branch-free: 2 x magnitude is the nibble
    (0, 1, 2, 3, 4, 6, 8, 12)[c & 7] of 0xC8643210."""
    mag = tirx.Cast("float32", tirx.Cast("int32", (_u32(0xC8643210) >> ((c & _u32(7)) << _u32(2))) & _u32(15)))
    return _signed(mag, (c & _u32(8)) << _u32(28))


def _e4m3_value(c):
    """E4M3 value of code c & 255 (uint32), exact and branch-free (0x7F: 480, as the llvm kernel): 2^9 x
    the magnitude is the integer ((c & 7) | 8 [e > 0]) << max(e - 1, 0), e = (c >> 3) & 15."""
    e = (c >> _u32(3)) & _u32(15)
    nz = (e + _u32(15)) >> _u32(4)
    mag = tirx.Cast("float32", tirx.Cast("int32", ((c & _u32(7)) | (nz << _u32(3))) << (e - nz))) * tirx.const(
        2.0 ** -9, "float32")
    return _signed(mag, (c & _u32(0x80)) << _u32(24))


def _nvfp4_code(x, scale):
    return tirx.Select(scale > tirx.const(0.0, "float32"), e2m1_encode(_fdiv_rn(x, scale)), _u32(0))


def _pow2_floor(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def _pow2_div(x: int, cap: float) -> int:
    """Largest power of two <= cap dividing x."""
    v = 1
    while v * 2 <= cap and x % (v * 2) == 0:
        v *= 2
    return v


def mma_applies(n_heads: int, n_kv: int, head_dim: int, dtype: str, kv_dtype: str | None) -> bool:
    """The tensor-core attend path: at most 8 query heads per KV head (the heads are the N = 8 side of the
    P.V mma) and 16-bit pages of the activation dtype with head_dim % 64 == 0, nvfp4 pages with
    head_dim 256 or fp8 pages with head_dim % 64 == 0 under 16-bit activations (f16 mma: every
    dequantized nvfp4 value and every E4M3 code is exact in f16; fp8 row exponents scale the scores and
    join the P.V weights' exponent)."""
    kv = kv_dtype or dtype
    if n_heads // n_kv > 8 or dtype not in ("bfloat16", "float16"):
        return False
    return (kv == dtype and head_dim % 64 == 0) or (kv == "nvfp4" and head_dim == 256) or (
        kv == "fp8" and head_dim % 64 == 0)


def fp4_qk_applies(n_heads: int, n_kv: int, head_dim: int, dtype: str, kv_dtype: str | None) -> bool:
    """The block-scaled FP4 QK (paged_attention fp4_qk, sm_120a): nvfp4 pages where the tensor-core attend path
    applies (head_dim 256, at most 8 query heads per KV head, 16-bit activations), whose P.V side it keeps."""
    return kv_dtype == "nvfp4" and mma_applies(n_heads, n_kv, head_dim, dtype, kv_dtype)


def attend_plan(n_heads: int, n_kv: int, head_dim: int, kv_dtype: str, threads: int = 128,
                qb: int | None = None, dtype: str | None = None, mma: bool | None = None) -> dict:
    """Static launch/layout choices of the attend launch (also reported by bench/attn_gpu_check.py).
    mode: "mma" (tensor cores), else the SIMT row format ("vec" 16-bit/f32 pages, "fp8v", "nvfp4v",
    "scalar"); qb: positions per batch."""
    group = n_heads // n_kv
    DL = head_dim // 32
    W = max(1, min(_pow2_floor(threads // 32), 16))
    if dtype is not None and (mma if mma is not None else True) and mma_applies(n_heads, n_kv, head_dim, dtype,
                                                                                 kv_dtype):
        return dict(group=group, DL=DL, W=W, NT=32 * W, mode="mma", vec=8, qb=16,
                    esize={"nvfp4": 0.5, "fp8": 1}.get(kv_dtype, 2), min_blocks=max(1, 8 // W))
    if kv_dtype in ("float32", "bfloat16", "float16"):
        esize: float = {"float32": 4, "bfloat16": 2, "float16": 2}[kv_dtype]
        mode = "vec"
        vec = _pow2_div(DL, 16 // esize)
        raw_words = DL * esize / 4
    elif kv_dtype == "fp8":
        esize = 1
        mode = "fp8v" if DL % 4 == 0 else "scalar"
        vec = 4
        raw_words = DL / 4 + 1 if mode == "fp8v" else DL
    else:  # nvfp4: DL/2 bytes of codes per lane, one byte of scale per 16 columns
        esize = 0.5
        lane_bytes = DL // 2
        row_bytes = head_dim // 2 + head_dim // NVFP4_BLOCK
        ok = DL % 2 == 0 and (NVFP4_BLOCK % DL == 0 or DL % NVFP4_BLOCK == 0)
        vec = _pow2_div(lane_bytes, 4) if ok else 1
        while vec > 1 and row_bytes % vec:
            vec //= 2
        mode = "nvfp4v" if ok else "scalar"
        raw_words = (lane_bytes / 4 + max(1, DL // NVFP4_BLOCK)) if ok else DL
    if qb is None:
        # registers: Q + acc (2*group*DL), partial dots (group*QB), raw K+V rows (2*QB*raw_words)
        qb = 8
        while qb > 1 and 2 * group * DL + group * qb + 2 * qb * raw_words > 200:
            qb //= 2
    return dict(group=group, DL=DL, W=W, NT=32 * W, mode=mode, vec=vec, qb=qb, esize=esize, min_blocks=max(1, 8 // W))


def attend_splits(n: int, p: int, n_kv: int, page_size: int, threads: int = 128, target_blocks: int = 264,
                  prefill_min: int | None = None) -> int:
    """Host-side mirror of the kernel's split count (grid z of the attend launch) for n tokens and a
    page table of width p (prefill_min: the kernel has the prefill path from that many tokens on: 1 split)."""
    if prefill_min is not None and n >= prefill_min:
        return 1
    w = max(1, min(_pow2_floor(threads // 32), 16))
    nk = n * n_kv
    cap = max(p * (page_size // CHUNK) // w, 1)
    return max(1, min(-(-target_blocks // nk), cap))


# ---- prefill attend (FlashAttention-2 style, tensor cores) -------------------------------------
PF_BQ = 64  # rows (token, query head) per block: 4 warps x 16
PF_BKV = 32  # positions per K/V tile
PF_NT = 128
PF_MIN_ROWS = 64  # default: calls with n >= this many tokens take the prefill path

# the prefill source's own mma / pack helpers (TVM keys helper sources by function name: the split path's
# ninfer_attn_mma_* / ninfer_attn_pack_* stay as they are)
_PF_HELPERS = {
    dt: _dev_src(_MMA_SRC[dt][1].split("// NINFER_ATTN_DEV_BEGIN\n")[1].split("\n// NINFER_ATTN_DEV_END")[0]
                 .replace("ninfer_attn_mma_", "ninfer_attn_pf_mma_"), guard=True)
    + _dev_src(_PACK_SRC[dt][1].split("// NINFER_ATTN_DEV_BEGIN\n")[1].split("\n// NINFER_ATTN_DEV_END")[0]
               .replace("ninfer_attn_pack_", "ninfer_attn_pf_pack_"), guard=True)
    for dt in ("bfloat16", "float16")
}
# ldmatrix.x4 (optionally .trans) from a generic shared-memory pointer; cp.async 16 bytes; group commit / wait
LDSM_SRC = {
    tr: (f"ninfer_attn_ldsm_x4{'_t' if tr else ''}", _dev_src(f"""
__forceinline__ __device__ void ninfer_attn_ldsm_x4{'_t' if tr else ''}(unsigned* r, const void* p) {{
  unsigned a = (unsigned)__cvta_generic_to_shared(p);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4{'.trans' if tr else ''}.shared.b16 {{%0, %1, %2, %3}}, [%4];\\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}}""", guard=True))
    for tr in (False, True)
}
CP_SRC = _dev_src("""
__forceinline__ __device__ void ninfer_attn_cp16(void* dst, const void* src) {
  unsigned a = (unsigned)__cvta_generic_to_shared(dst);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\\n" :: "r"(a), "l"(src));
}
__forceinline__ __device__ void ninfer_attn_cp_commit() { asm volatile("cp.async.commit_group;\\n" ::); }
__forceinline__ __device__ void ninfer_attn_cp_wait0() { asm volatile("cp.async.wait_group 0;\\n" ::: "memory"); }
__forceinline__ __device__ void ninfer_attn_cp_wait1() { asm volatile("cp.async.wait_group 1;\\n" ::: "memory"); }""", guard=True)


def prefill_applies(n_heads: int, n_kv: int, head_dim: int, dtype: str, kv_dtype: str | None) -> bool:
    """The prefill (FlashAttention-2) attend path: head_dim % 64 == 0 and 16-bit pages of the activation
    dtype, or fp8 / nvfp4 pages under bf16 activations (tiles dequantized into the bf16 shared tiles: every
    dequantized value is exact in bf16, not in f16)."""
    kv = kv_dtype or dtype
    if head_dim % 64 or n_heads % n_kv:
        return False
    return (kv == dtype and kv in ("bfloat16", "float16")) or (kv in QUANT_KV_DTYPES and dtype == "bfloat16")


def prefill_smem_bytes(head_dim: int) -> int:
    return (PF_BQ + 4 * PF_BKV) * (head_dim * 2 + 16)


def _quant_tile_src(kv_dtype: str, head_dim: int, page_size: int, n_kv: int, n_layers: int, pack_fn: str) -> str:
    """CUDA lambdas of the prefill block for quantized pages: qload(t) issues the global loads of K/V tile
    t (this thread's PF_BKV * head_dim / 16 / PF_NT units of (row, 16 columns), K and V) into registers,
    qstore(t) dequantizes them and writes the bf16 rows of the tile's shared buffer. Row bytes: the llvm
    kernel's layout (attention_quant): nvfp4 = D/2 code bytes (element 2j in the low nibble of byte j)
    then D/16 E4M3 block scales; fp8 = D E4M3 codes, the E8M0 row exponent, 3 pad bytes."""
    D, PS, HKV, NL = head_dim, page_size, n_kv, n_layers
    RB = kv_row(kv_dtype, D)[1]
    NBLK = D // NVFP4_BLOCK
    UPT = PF_BKV * NBLK // PF_NT  # units per thread and tile
    if PF_BKV * NBLK % PF_NT or RB % 4:
        raise ValueError(f"prefill tiles of {kv_dtype} pages need {PF_NT} | {PF_BKV * NBLK} units and 4-byte rows")
    NW = 2 if kv_dtype == "nvfp4" else 4  # 32-bit code words per unit
    code_ofs = "8 * b" if kv_dtype == "nvfp4" else "16 * b"
    scale_ofs = f"{D // 2} + b" if kv_dtype == "nvfp4" else f"{D}"
    if kv_dtype == "nvfp4":
        # f16x2 pairs (0,2) (1,3) (4,6) (5,7) of each 8 codes (x block scale, exact), re-paired as fp32
        dequant = f"""
        unsigned h[8];
        const unsigned s2 = ninfer_attn_e4m3_f16x2(sc & 0x7Fu);
        ninfer_attn_nvfp4_f16x8(h, wd[0], s2);
        ninfer_attn_nvfp4_f16x8(h + 4, wd[1], s2);
#pragma unroll
        for (int x = 0; x < 8; x += 2) {{
          const unsigned* g = h + x;  // words (0,2)+(1,3) or (4,6)+(5,7) of 8 codes
          pk[x] = {pack_fn}(ninfer_attn_h2f(g[0]), ninfer_attn_h2f(g[1]));
          pk[x + 1] = {pack_fn}(ninfer_attn_h2f(g[0] >> 16), ninfer_attn_h2f(g[1] >> 16));
        }}"""
    else:
        dequant = f"""
        union {{ float f; unsigned u; }} rs;
        rs.u = (unsigned)sc << 23;  // 2^(byte - 127), byte in [1, 253]
#pragma unroll
        for (int x = 0; x < 8; ++x) {{
          const unsigned h = ninfer_attn_e4m3x2_f16x2(wd[x >> 1] >> (16 * (x & 1)));
          pk[x] = {pack_fn}(ninfer_attn_h2f(h) * rs.f, ninfer_attn_h2f(h >> 16) * rs.f);
        }}"""
    return f"""
    // quantized pages: this thread's units (row, 16-column block) of K and V, raw bytes in registers
    unsigned qw[2][{UPT}][{NW}];
    unsigned char qs[2][{UPT}];
    auto qload = [&](int t) {{
      const int t0 = t * {PF_BKV};
      const long long base = (((long long)ptr[t0 / {PS}] * {NL} + layer) * {2 * HKV} + kvh) * {PS * RB}LL;
#pragma unroll
      for (int k = 0; k < {UPT}; ++k) {{
        const int u = tid + k * {PF_NT}, r = u / {NBLK}, b = u % {NBLK};
        // positions past the sequence's length: its last row (finite values, masked)
        const unsigned char* src = qpool + base + (long long)(t0 % {PS} + min(r, lmax - 1 - t0)) * {RB};
#pragma unroll
        for (int c = 0; c < 2; ++c) {{
          const unsigned char* row = src + c * {HKV * PS * RB}LL;
#pragma unroll
          for (int x = 0; x < {NW}; ++x) qw[c][k][x] = ((const unsigned*)(row + {code_ofs}))[x];
          qs[c][k] = row[{scale_ofs}];
        }}
      }}
    }};
    auto qstore = [&](int t) {{
#pragma unroll
      for (int k = 0; k < {UPT}; ++k) {{
        const int u = tid + k * {PF_NT}, r = u / {NBLK}, b = u % {NBLK};
#pragma unroll
        for (int c = 0; c < 2; ++c) {{
        const unsigned* wd = qw[c][k];
        const unsigned sc = qs[c][k];
        unsigned pk[8];{dequant}
        uint4* dst = (uint4*)((c ? sV : sK) + (t & 1) * {PF_BKV * (D * 2 + 16)} + r * {D * 2 + 16} + 32 * b);
        dst[0] = make_uint4(pk[0], pk[1], pk[2], pk[3]);
        dst[1] = make_uint4(pk[4], pk[5], pk[6], pk[7]);
        }}
      }}
    }};"""


def prefill_source(name: str, n_heads: int, n_kv: int, head_dim: int, page_size: int, n_layers: int, dtype: str,
                   scale2: float, kv_dtype: str | None = None) -> str:
    """CUDA of the prefill attend block (see the module docstring): Q tile of PF_BQ (token, head) rows of
    KV head blockIdx.y in shared memory, K/V tiles of PF_BKV positions double-buffered by cp.async,
    S = Q K^T and O += P V by mma.m16n8k16 with ldmatrix fragments, online softmax (base 2) per row,
    causal / sequence mask per row; one pass over the K/V of every sequence present in the tile.
    kv_dtype fp8 / nvfp4: the K/V tiles are loaded into registers one tile ahead (before the mma work on
    the current tile) and dequantized into the bf16 shared buffers after it (_quant_tile_src)."""
    D, G, HQ, HKV, PS, NL = head_dim, n_heads // n_kv, n_heads, n_kv, page_size, n_layers
    quant = kv_dtype in QUANT_KV_DTYPES
    SROW = D * 2 + 16  # bytes per shared row (16 bytes of padding: conflict-free ldmatrix)
    mma_fn = _MMA_SRC[dtype][0].replace("ninfer_attn_mma_", "ninfer_attn_pf_mma_")
    pack_fn = _PACK_SRC[dtype][0].replace("ninfer_attn_pack_", "ninfer_attn_pf_pack_")
    BQ, BKV, NT = PF_BQ, PF_BKV, PF_NT
    # (the 16-bit pages' source stays byte-identical: an older build of it may share a module, by name)
    qpool = "\n  const unsigned char* qpool = (const unsigned char*)poolv;" if quant else ""
    if quant:
        assert kv_dtype is not None  # quant implies an fp8 / nvfp4 kv_dtype
        qtile = _quant_tile_src(kv_dtype, D, PS, HKV, NL, pack_fn)
        first_tile = """    qload(0);
    qstore(0);"""
        next_tile = """
      if (t + 1 < nkv) qload(t + 1);
      if (t == 0) ninfer_attn_cp_wait0();  // the Q tile"""
        store_next = """
      if (t + 1 < nkv) qstore(t + 1);  // the other buffer: last read before the previous barrier"""
    else:
        qtile, store_next = "", ""
        first_tile = """    load(0);"""
        next_tile = """
      if (t + 1 < nkv) {
        load(t + 1);
        ninfer_attn_cp_wait1();
      } else {
        ninfer_attn_cp_wait0();
      }"""
    tile = tile_math_src(D, BKV, SROW, mma_fn, pack_fn, scale2, "mask: position <= the row's, row of this sequence")
    load = tile_load_src(D, PS, NL, HKV, BKV, SROW, NT, "the sequence's length")
    return f"""
// NINFER_ATTN_SRC_BEGIN (kept by the CPU emulator, compile/kernels/cuda/emulate)
__device__ __forceinline__ void {name}(const void* __restrict__ qv, const void* __restrict__ poolv,
    const int* __restrict__ pos, const int* __restrict__ tseq, const int* __restrict__ pt, void* __restrict__ outv,
    int n, int p, int layer, unsigned char* smem) {{
  const unsigned short* q = (const unsigned short*)qv;
  const unsigned short* pool = (const unsigned short*)poolv;{qpool}
  unsigned* out = (unsigned*)outv;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int nrows = n * {G};
  const int ntiles = (nrows + {BQ - 1}) / {BQ};
  const int r0 = (ntiles - 1 - (int)blockIdx.x) * {BQ};  // late (long-context) tiles first
  const int kvh = blockIdx.y;
  const int rend = min(r0 + {BQ}, nrows);
  const int i_lo = r0 / {G}, i_hi = (rend - 1) / {G};
  unsigned char* sQ = smem;
  unsigned char* sK = smem + {BQ * SROW};
  unsigned char* sV = sK + {2 * BKV * SROW};
  // Q tile (rows past the end: the last row, never stored)
  for (int c = tid; c < {BQ * (D // 8)}; c += {NT}) {{
    const int r = c / {D // 8}, ch = c % {D // 8};
    const int R = min(r0 + r, nrows - 1);
    const int i = R / {G}, h = R - i * {G};
    ninfer_attn_cp16(sQ + r * {SROW} + ch * 16, q + ((long long)i * {HQ} + kvh * {G} + h) * {D} + ch * 8);
  }}
  ninfer_attn_cp_commit();
  // this lane's rows: warp * 16 + gq (+ 8)
  int rpos[2], rseq[2];
  bool rok[2];
  for (int rr = 0; rr < 2; ++rr) {{
    const int R = r0 + warp * 16 + gq + 8 * rr;
    rok[rr] = R < nrows;
    const int i = min(R, nrows - 1) / {G};
    rpos[rr] = pos[i];
    rseq[rr] = tseq[i];
  }}
  float o[{D // 8}][4];
#pragma unroll
  for (int d = 0; d < {D // 8}; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
  float m[2] = {{{NEG_BIG:e}f, {NEG_BIG:e}f}}, l[2] = {{0.f, 0.f}};
  const long long vofs = (long long){HKV * PS * D};
  for (int it = i_lo; it <= i_hi; ++it) {{
    // one pass per sequence of the tile (its first token in the tile)
    const int sq = tseq[it];
    bool first = true;
    for (int j = i_lo; j < it; ++j) first = first && tseq[j] != sq;
    if (!first) continue;
    int lmax = 0;
    for (int j = it; j <= i_hi; ++j) if (tseq[j] == sq) lmax = max(lmax, pos[j] + 1);
    const int* ptr = pt + (long long)sq * p;
    const int nkv = (lmax + {BKV - 1}) / {BKV};{qtile}
{load}
    bool act[2];
    for (int rr = 0; rr < 2; ++rr) act[rr] = rok[rr] && rseq[rr] == sq;
{first_tile}
    for (int t = 0; t < nkv; ++t) {{{next_tile}
      __syncthreads();
{tile}{store_next}
      __syncthreads();
    }}
  }}
  ninfer_attn_cp_wait0();
  // row sums over the quad, normalize, store (columns 8d + 2tq, +1 of rows gq, gq + 8)
#pragma unroll
  for (int rr = 0; rr < 2; ++rr) {{
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
    l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
    if (rok[rr]) {{
      const int R = r0 + warp * 16 + gq + 8 * rr;
      const int i = R / {G}, h = R - i * {G};
      const float inv = 1.f / l[rr];
      unsigned* dst = out + (((long long)i * {HQ} + kvh * {G} + h) * {D} + 2 * tq) / 2;
#pragma unroll
      for (int d = 0; d < {D // 8}; ++d) dst[4 * d] = {pack_fn}(o[d][2 * rr] * inv, o[d][2 * rr + 1] * inv);
    }}
  }}
}}
// NINFER_ATTN_SRC_END
"""


@lru_cache(maxsize=None)
def paged_attention(
    n_heads: int, n_kv: int, head_dim: int, page_size: int, n_layers: int, dtype: str, sm_scale: float,
    kv_dtype: str | None = None, *, threads: int = 128, target_blocks: int = 264, qb: int | None = None,
    mma: bool | None = None, prefill: bool | None = None, prefill_min: int = PF_MIN_ROWS, fp4_qk: bool = False,
    short_rows: bool = False,
):
    """kv_dtype: page dtype (None = dtype); float32 / bfloat16 / float16 pages, or the quantized
    uint8 page rows fp8 / nvfp4 (same layout and bytes as the llvm kernel). threads: block size of
    the attend launch (a power of two number of warps); qb: positions per QK batch of the SIMT path
    (None: chosen from the register budget); mma: use the tensor-core path (None: wherever it
    applies, i.e. bf16 / f16 pages with the same activation dtype); prefill: calls with n >= prefill_min
    tokens take the FlashAttention-2 attend launch (None: wherever prefill_applies); fp4_qk: the split attend
    launch computes Q K^T on the sm_120a block-scaled FP4 tensor cores wherever fp4_qk_applies (the kernel set
    asks for it on cuda:sm_120 with nvfp4 pages; the code only assembles for sm_120a / sm_121a); short_rows: the
    verify attend launch (attention_verify.py: a block per sequence, KV head and split takes all the sequence's
    rows) for every call instead of the split / prefill attends (calls with few rows per sequence: verify)."""
    kv_dt = kv_dtype or dtype
    quant = kv_dt in QUANT_KV_DTYPES
    if not quant and kv_dt not in ("float32", "bfloat16", "float16"):
        raise NotImplementedError(f"CUDA paged attention has no kernel for {kv_dt} KV pages")
    pool_dt, row_bytes = kv_row(kv_dt, head_dim)
    nvfp4 = kv_dt == "nvfp4"
    half = head_dim // 2
    nblk = head_dim // NVFP4_BLOCK
    D = head_dim
    PS = page_size
    if D % 32 or PS % CHUNK or n_heads % n_kv:
        raise ValueError(f"CUDA attention needs head_dim and page_size multiples of 32 (got {D}, {PS})")
    plan = attend_plan(n_heads, n_kv, head_dim, kv_dt, threads, qb)  # the SIMT layout (also built for mma)
    mma_ok = mma_applies(n_heads, n_kv, head_dim, dtype, kv_dt)
    G = plan["group"]
    DL = plan["DL"]  # columns per lane
    W = plan["W"]  # warps per attend block
    NT = plan["NT"]
    MODE = plan["mode"]
    VEC = plan["vec"]
    QB = plan["qb"]
    if QB not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"qb must be a power of two <= 32, got {QB}")
    NH = QB.bit_length() - 1  # halving steps of the butterfly
    SH = 5 - NH  # lane >> SH = position in the batch
    NB = CHUNK // QB  # batches per chunk
    CPP = PS // CHUNK  # chunks per page
    LOGW = W.bit_length() - 1
    WH = max(W // 2, 1)  # merge slots
    # raw row storage per (K|V, row) and lane
    if MODE == "vec":
        RW, RAW_DT = DL, pool_dt
    elif MODE == "fp8v":
        RW, RAW_DT = DL, "uint8"
    elif MODE == "nvfp4v":
        RW, RAW_DT = DL // 2, "uint8"
    else:
        RW, RAW_DT = DL, "float32"
    NSB = max(1, DL // NVFP4_BLOCK) if MODE == "nvfp4v" else 1  # scale bytes per lane-row
    if MODE == "scalar":
        VEC = 1
    if row_bytes % VEC or RW % VEC:
        raise AssertionError(f"vector width {VEC} does not divide the row ({row_bytes}) / lane ({RW}) extents")
    RBV = row_bytes // VEC  # row length in vectors
    MMA = bool(mma) if mma is not None else mma_ok
    if MMA and not mma_ok:
        raise ValueError(f"the tensor-core path needs {dtype} == KV dtype in (bfloat16, float16), head_dim % 64 == 0, "
                         f"or nvfp4 KV with head_dim 256, and at most 8 query heads per KV head "
                         f"(got {kv_dt}, {head_dim}, {G})")
    NSLAB = D // 32  # 32-column slabs of a K row (two k16 steps each)
    NQ = D // 64  # 64-column groups of a V row (four 16-row m tiles each)
    NACC = NQ * 16  # fp32 accumulators per lane (heads 2tig, 2tig+1 x 8 columns per group)
    MMAQ = MMA and nvfp4  # tensor cores over nvfp4 pages (f16 mma on fragments dequantized in registers)
    MMAF4 = MMAQ and fp4_qk and fp4_qk_applies(n_heads, n_kv, head_dim, dtype, kv_dt)  # ... with Q K^T in FP4
    NKC = D // 64  # fp4_qk: 64-column chunks of a row (one m16n8k64 each)
    if MMAF4 and NKC != 4:
        raise AssertionError("fp4_qk loads a K row's 4 scale words at once (head_dim 256)")
    NQB = D // NVFP4_BLOCK  # fp4_qk: 16-column blocks of a Q row (one lane each when quantizing)
    MMA8 = MMA and kv_dt == "fp8"  # tensor cores over fp8 pages (f16 mma on the converted codes, row exponents)
    RBW = (row_bytes // 16 if nvfp4 else 1 if quant else D // 8) if MMA else 1  # row in 16-byte units (uint32 x 4)
    RBU = row_bytes // 4  # row length in 32-bit words
    QROW = D // 2 + 16  # words per Q row in shared memory (padded: a 16-byte read of rows g, g+1 is conflict-free)
    MIN_BLOCKS = plan["min_blocks"]  # attend blocks per SM the register budget must allow (8 warps)
    MMA_FN, MMA_SRC = _MMA_SRC["bfloat16" if kv_dt == "bfloat16" else "float16"]
    PACK_FN, PACK_SRC = _PACK_SRC["bfloat16" if kv_dt == "bfloat16" else "float16"]
    CNT = 256  # combine threads (CW warps)
    CW = CNT // 32
    CU = 8 if DL <= 8 else 4  # partial rows per lane in flight
    MAXS = max(1, -(-target_blocks // n_kv))  # nsplit <= ceil(target_blocks / n_kv)
    CMS = (MAXS + 31) // 32  # (max, sum) pairs per lane
    CVEC = _pow2_div(DL, 4)  # 16-byte loads of the lane's columns where possible
    APPEND_T = min(D, 256)
    neg_big = NEG_BIG
    pf_ok = prefill_applies(n_heads, n_kv, head_dim, dtype, kv_dt)
    SR = bool(short_rows)
    if SR and not verify_applies(n_heads, n_kv, head_dim, dtype, kv_dt):
        raise ValueError(f"the verify attend needs {dtype} == KV dtype in (bfloat16, float16) and head_dim % 64 == 0 "
                         f"(got {kv_dt}, {head_dim})")
    PF = (bool(prefill) if prefill is not None else pf_ok) and not SR
    if PF and not pf_ok:
        raise ValueError(f"the prefill path needs {dtype} == KV dtype in (bfloat16, float16), or fp8 / nvfp4 KV under "
                         f"bfloat16, and head_dim % 64 == 0 (got {kv_dt}, {head_dim})")
    PF_MIN = max(1, int(prefill_min))
    PF_SMEM = prefill_smem_bytes(D)
    PF_NAME = "ninfer_attn_prefill_" + "_".join(str(x) for x in (n_heads, n_kv, D, PS, n_layers)) + (
        "_bf16" if dtype == "bfloat16" else "_f16") + ("_" + kv_dt if quant else "") + "_s" + format(
        float(sm_scale), ".9e").replace(".", "p").replace("-", "m").replace("+", "")
    PF_SRC = (_PF_HELPERS.get(dtype, "") + LDSM_SRC[False][1]
              + LDSM_SRC[True][1] + CP_SRC
              + (NVFP4_F16X8_SRC + E4M3_F16X2_SRC + E4M3X2_F16X2_SRC + H2F_SRC if quant and PF else "")
              + (prefill_source(PF_NAME, n_heads, n_kv, D, PS, n_layers, dtype, float(sm_scale) * LOG2E,
                                kv_dt if quant else None) if PF else ""))
    scale2 = float(sm_scale) * LOG2E
    VF_NAME = PF_NAME.replace("ninfer_attn_prefill_", "ninfer_attn_verify_")
    VF_SRC = (_PF_HELPERS[dtype] + LDSM_SRC[False][1] + LDSM_SRC[True][1] + CP_SRC + verify_source(
        VF_NAME, n_heads, n_kv, D, PS, n_layers, scale2, _MMA_SRC[dtype][0].replace("ninfer_attn_mma_", "ninfer_attn_pf_mma_"),
        _PACK_SRC[dtype][0].replace("ninfer_attn_pack_", "ninfer_attn_pf_pack_"), NEG_BIG)) if SR else ""

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

    def elem(raw, sf, c, j, e):
        """fp32 column e (of the lane's DL) of raw row (c, j): branch-free decoders (a Select on a loaded
        code became an if / else per element and head in the generated CUDA: ~2500 instructions per
        position and warp, the nvfp4 decode ran at ~37 GB/s)."""
        r = (c * QB + j) * RW
        if MODE == "vec" or MODE == "scalar":
            return T.Cast("float32", raw[r + e])
        if MODE == "fp8v":
            return _e4m3_value(T.Cast("uint32", raw[r + e])) * sf[c * QB + j]
        byte = T.Cast("uint32", raw[r + e // 2])
        code = byte >> (T.Cast("uint32", e % 2) * _u32(4))
        return _e2m1_twice(code) * sf[(c * QB + j) * NSB + e // NVFP4_BLOCK]  # sf holds half the block scale

    def _or_words(buf, nvec):
        """OR of the first word of each of the nvec loaded 16-byte vectors in buf."""
        e = buf[0]
        for k_ in range(1, nvec):
            e = e | buf[4 * k_]
        return e

    def src(k, v, c, i, h, d):
        """fp32 K (c=0) or V (c=1) element of this call."""
        return T.if_then_else(c == 0, T.Cast("float32", k[i, h, d]), T.Cast("float32", v[i, h, d]))

    def _nsplit(n, p, b):
        """int32 number of KV splits; n, p, b are the int64 shape vars."""
        if SR:  # verify attend: a block per (sequence, KV head, split); attention_verify.verify_splits
            nb = T.Cast("int32", b) * n_kv
            cap = T.max(T.truncdiv(T.Cast("int32", p) * (PS // VF_BKV), VF_MIN_TILES), 1)
            return T.max(1, T.min(T.truncdiv(target_blocks + nb - 1, nb), cap))
        nk = T.Cast("int32", n) * n_kv
        cap = T.max(T.truncdiv(T.Cast("int32", p) * CPP, W), 1)
        ns = T.max(1, T.min(T.truncdiv(target_blocks + nk - 1, nk), cap))
        return T.Select(n >= PF_MIN, 1, ns) if PF else ns  # the prefill path has no splits

    def _ws_size(n, p, b, per):
        ns = T.Cast("int64", _nsplit(n, p, b))
        return T.Select(ns > 1, n * n_heads * ns * per, T.int64(1))

    QF = 3 * NKC + 1 if MMAF4 else 4  # Q fragment registers (fp4_qk: codes, scale words, 1/enc of head gid)
    KSC = 2 * NKC if MMAF4 else 4  # K scale words per lane and batch
    NKLD = 2 * 2 if MMAQ else 2 * NSLAB  # 16-byte K / V loads per lane and batch
    NVLD = 4 if MMAQ else 4 * NQ
    RBX = RBU if MMA8 else RBW  # unit of the row base rb (fp8 rows: 4-byte words)

    def _f4_kword(rb, b0, r, L, word):
        """fp4_qk: poolu index of 32-bit word `word` of K row r of the batch at position b0 (rows past the token's
        length: its last row, masked)."""
        return (rb[0] + T.Cast("int64", b0 % PS + T.min(r, L - 1 - b0)) * RBW) * 4 + T.Cast("int64", word)

    def _kexp(ksc, r, qf):
        """fp8: 2^(e - 127) of the K row of score r (E8M0 byte e); fp4_qk: 1/enc of the lane's head (Q's row scale);
        1 otherwise."""
        if MMAF4:
            return T.reinterpret("float32", qf[3 * NKC])
        return pow2_from_e8m0(ksc[r] & T.uint32(0xFF)) if MMA8 else T.float32(1)
    PACKH_FN, PACKH_SRC = _PACK_SRC["float16"]

    def _or_scales(ksc, vsc, kr_all=None, vr_all=None):
        """nvfp4: OR of the batch's block-scale words (the zero dependency also holds their loads before the
        first mma: ptxas sinks them next to their use otherwise); 0 for 16-bit pages."""
        if MMA8:  # (and the second word of every 8-byte K / V piece)
            e = ksc[0] | ksc[1] | ksc[2] | ksc[3] | vsc[0] | vsc[1] | vsc[2] | vsc[3]
            for k_ in range(2 * NSLAB):
                e = e | kr_all[k_ * 4 + 1]
            for k_ in range(4 * NQ):
                e = e | vr_all[k_ * 4 + 1]
            return e
        if MMAF4:  # (every K word: they are 4-byte loads)
            e = vsc[0] | vsc[1] | vsc[2] | vsc[3]
            for k_ in range(2 * NKC):
                e = e | ksc[k_] | kr_all[2 * k_] | kr_all[2 * k_ + 1]
            return e
        if not MMAQ:
            return T.uint32(0)
        return ksc[0] | ksc[1] | vsc[0] | vsc[1] | vsc[2] | vsc[3]

    def _qcol(q, i, g, wi, off):
        """fp32 Q element off (0: low, 1: high half) of word wi of the staged f16 rows (see the Q staging)."""
        r, c = wi // (D // 2), wi % (D // 2)
        if MMA8:  # the natural column order of the 16-bit path
            col = 2 * c + off
        else:
            col = 64 * (c // 4 % 4) + 8 * (c // 16) + c % 4 % 2 + 4 * (c % 4 // 2) + 2 * off
        return T.Cast("float32", q[i, g * G + T.min(r, G - 1), col])

    def _vw(vr, fd, rr, q0, j):
        """f16x2 / bf16x2 word j of V row rr, column group q0 (the P.V A fragment's source)."""
        return fd[rr * 4 + j] if MMAQ or MMA8 else vr[(rr * NQ + q0) * 4 + j]

    def _ocol(j, r):
        """column (of the lane's 8) of accumulator element r of m tile j."""
        return j % 2 + 4 * (j // 2) + 2 * r if MMAQ else 2 * j + r

    def _ogrp(q0, gid):
        """the lane's 8-column group (16-byte unit of a bf16 row) of column group q0."""
        return 4 * gid + q0 if MMAQ else 8 * q0 + gid

    def _ws(i, h, s, n, p, b):
        """int64 flat index of (token i, q head h, split s) in the workspace (times per-entry size)."""
        return (i * n_heads + h) * T.Cast("int64", _nsplit(n, p, b)) + T.Cast("int64", s)

    @T.macro
    def quad_running_max(sc, tm, st, k):
        # mma path: new running max st[k] of the scores sc[0, 1, 4, 5] of the 4 lanes of a group -> tm[0],
        # rescale factor of the old sums 2^(old - new) -> tm[1]
        tm[0] = T.max(T.max(sc[0], sc[1]), T.max(sc[4], sc[5]))
        tm[0] = T.max(tm[0], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), tm[0], 1, 32, 32))
        tm[0] = T.max(tm[0], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), tm[0], 2, 32, 32))
        tm[0] = T.max(tm[0], st[k])
        tm[1] = T.exp2(st[k] - tm[0])
        st[k] = tm[0]

    @T.macro
    def attend_split(n, p, b, q, pos, tseq, pt, pool, layer, out, poolv, poolw, poolu, qw1, outv, ws_ml, ws_ov):
        # the split attend launch (decode, few rows, other page formats) ------------------------------------------
        if MMA:
            # tensor-core path (bf16 / f16 pages of the activation dtype), see the module docstring
            for i in T.thread_binding(n, thread="blockIdx.x"):
                for g in T.thread_binding(n_kv, thread="blockIdx.y"):
                    for s in T.thread_binding(_nsplit(n, p, b), thread="blockIdx.z"):
                        for tx in T.thread_binding(NT, thread="threadIdx.x"):
                            qf = T.alloc_buffer((QF,), "uint32", scope="local")
                            qsm = T.alloc_buffer((8 * QROW,), "uint32", scope="shared")
                            acc = T.alloc_buffer((NACC,), "float32", scope="local")
                            kr = T.alloc_buffer((2 * NSLAB * 4,), "uint32", scope="local")
                            vr = T.alloc_buffer((4 * NQ * 4,), "uint32", scope="local")
                            sc = T.alloc_buffer((8,), "float32", scope="local")
                            pk = T.alloc_buffer((2,), "uint32", scope="local")
                            st = T.alloc_buffer((8,), "float32", scope="local")
                            tm = T.alloc_buffer((4,), "float32", scope="local")
                            rb = T.alloc_buffer((1,), "int64", scope="local")
                            ob = T.alloc_buffer((8,), dtype, scope="local")
                            ksc = T.alloc_buffer((KSC,), "uint32", scope="local")  # nvfp4 / fp8: scale words
                            vsc = T.alloc_buffer((4,), "uint32", scope="local")
                            fd = T.alloc_buffer((4 * 4,), "uint32", scope="local")  # nvfp4: dequantized f16x2
                            mg = T.alloc_buffer((WH * 32 * (NACC + 4),), "float32", scope="shared")
                            qsm4 = T.decl_buffer((2 * QROW, 4), "uint32", data=qsm.data, scope="shared")
                            w = tx // 32
                            lane = tx % 32
                            gid = lane // 4
                            tig = lane % 4
                            L = pos[i] + 1
                            nch = (L + CHUNK - 1) // CHUNK
                            cps = (nch + _nsplit(n, p, b) - 1) // _nsplit(n, p, b)
                            c_lo = s * cps
                            c_hi = T.min(c_lo + cps, nch)
                            row = tseq[i]
                            if MMAF4:
                                # fp4_qk: Q of the group's heads quantized to NVFP4 in shared memory, per head row as
                                # fp4_mma's activation quantizer (enc = 2688 / amax of the row, block scales E4M3 of
                                # the 16-blocks x enc, E2M1 codes): warp w takes heads w, w + W, ..., lane l the block
                                # l % NQB. Row h of qsm: D/8 code words, NKC scale words (byte j: block 4 kc + j), the
                                # bits of 1/enc. Scratch registers: acc (the block x enc), tm (enc, block scale), vsc
                                # (amax bits, scale byte / word), pk (code words)
                                for hh in range((G + W - 1) // W):
                                    if hh * W + w < G:
                                        vsc[0] = T.uint32(0)
                                        for e in T.unroll(NVFP4_BLOCK):
                                            acc[e] = T.Cast("float32", q[i, g * G + hh * W + w, lane % NQB * NVFP4_BLOCK + e])
                                            vsc[0] = T.max(vsc[0], _abs_bits(acc[e]))
                                        for o in T.unroll(5):
                                            vsc[0] = T.max(vsc[0], T.tvm_warp_shuffle_xor(
                                                T.uint32(0xFFFFFFFF), vsc[0], 16 >> o, 32, 32))
                                        tm[0] = row_encode_scale(T.reinterpret("float32", vsc[0]))
                                        vsc[1] = T.uint32(0)
                                        for e in T.unroll(NVFP4_BLOCK):
                                            acc[e] = acc[e] * tm[0]
                                            vsc[1] = T.max(vsc[1], _abs_bits(acc[e]))
                                        vsc[1] = e4m3_encode_abs(_fdiv_rn(T.reinterpret("float32", vsc[1]), T.float32(6.0)))
                                        tm[1] = e4m3_decode_abs(vsc[1])
                                        for hw in T.unroll(2):
                                            pk[hw] = T.uint32(0)
                                            for e in T.unroll(8):
                                                pk[hw] = pk[hw] | (_nvfp4_code(acc[hw * 8 + e], tm[1]) << T.uint32(4 * e))
                                        # the chunk's scale word from the 4 lanes of its blocks
                                        vsc[1] = vsc[1] << T.Cast("uint32", 8 * (lane % 4))
                                        vsc[1] = vsc[1] | T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), vsc[1], 1, 32, 32)
                                        vsc[1] = vsc[1] | T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), vsc[1], 2, 32, 32)
                                        if lane < NQB:
                                            for hw in T.unroll(2):
                                                qsm[(hh * W + w) * QROW + 2 * lane + hw] = pk[hw]
                                            if lane % 4 == 0:
                                                qsm[(hh * W + w) * QROW + D // 8 + lane // 4] = vsc[1]
                                            if lane == 0:
                                                qsm[(hh * W + w) * QROW + D // 8 + NKC] = T.reinterpret(
                                                    "uint32", _fdiv_rn(T.float32(1.0), tm[0]))
                            else:
                                # Q of the group's heads in shared memory as bf16 pairs, rows padded (no bank
                                # conflicts), rows G..7 zero; read as mma fragments in the loop
                                for e in range((8 * D // 2 + NT - 1) // NT):
                                    if e * NT + tx < 8 * D // 2:
                                        if MMAQ or MMA8:
                                            # f16 pairs in the k order of the nvfp4 fragments: word k of 16-byte unit
                                            # 4 s0 + t holds columns c + PERM[k], c = 64 t + 8 s0
                                            qsm[(e * NT + tx) // (D // 2) * QROW + (e * NT + tx) % (D // 2)] = T.Select(
                                                (e * NT + tx) // (D // 2) < G, T.cuda.func_call(
                                                    PACKH_FN, _qcol(q, i, g, e * NT + tx, 0), _qcol(q, i, g, e * NT + tx, 1),
                                                    source_code=PACKH_SRC, return_type="uint32"), T.uint32(0))
                                        else:
                                            qsm[(e * NT + tx) // (D // 2) * QROW + (e * NT + tx) % (D // 2)] = T.Select(
                                                (e * NT + tx) // (D // 2) < G, qw1[(T.Cast("int64", i) * n_heads + g * G + T.min(
                                                    (e * NT + tx) // (D // 2), G - 1)) * (D // 2) + (e * NT + tx) % (D // 2)],
                                                T.uint32(0))
                            T.tvm_storage_sync("shared")
                            if MMAF4:
                                # this lane's A fragments (fp4_mma.a_frag: head gid, words tig, tig + 4 of each chunk;
                                # rows 8..15 are zero, as are heads >= G), its scale words (sfa_row) and 1/enc of head gid
                                for kc in T.unroll(NKC):
                                    for u in T.unroll(2):
                                        qf[2 * kc + u] = T.Select(gid < G, qsm[T.min(gid, G - 1) * QROW + 8 * kc + _a_word(
                                            lane, u)], T.uint32(0))
                                    qf[2 * NKC + kc] = T.Select(sfa_row(lane) < G, qsm[T.min(sfa_row(lane), G - 1) * QROW
                                                                                      + D // 8 + kc], T.uint32(0))
                                qf[3 * NKC] = qsm[T.min(gid, G - 1) * QROW + D // 8 + NKC]
                            with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", MIN_BLOCKS):
                                # __launch_bounds__(NT, 8 warps / W): without a minimum ptxas caps the registers
                                # lower and sinks the batch's loads next to their mma (a round trip each)
                                st[0] = T.float32(neg_big)  # running max of head gid (base 2)
                            st[6] = T.float32(neg_big)  # fp8: running max of score + V row exponent
                            st[1] = T.float32(0)  # running sum of head gid (this lane's positions)
                            for a in T.unroll(NACC):
                                acc[a] = T.float32(0)
                            for ci in range((T.max(c_hi - c_lo - w, 0) + W - 1) // W):
                                t0 = (c_lo + w + ci * W) * CHUNK
                                page = pt[row, t0 // PS]
                                rb[0] = (T.Cast("int64", page) * n_layers + T.Cast("int64", layer)) * (
                                    2 * n_kv * PS * RBX) + T.Cast("int64", g) * (PS * RBX)
                                for bt in range(CHUNK // 16):
                                    if t0 + bt * 16 < L:
                                        if MMA8:
                                            # -- fp8 (rows of D + 4 bytes: 4-byte loads): the 16-bit path's columns,
                                            # K rows gid, 8 + gid: 8 codes per 32-column slab (two words)
                                            for tile in T.unroll(2):
                                                for s0 in T.unroll(NSLAB):
                                                    for u in T.unroll(2):
                                                        kr[(tile * NSLAB + s0) * 4 + u] = poolu[
                                                            rb[0] + T.Cast("int64", (t0 + bt * 16) % PS + T.min(
                                                                tile * 8 + gid, L - 1 - t0 - bt * 16)) * RBU
                                                            + T.Cast("int64", 8 * s0 + 2 * tig + u)]
                                                # the row exponents of this lane's score positions tile * 8 + 2 tig + r
                                                for r in T.unroll(2):
                                                    ksc[tile * 2 + r] = poolu[rb[0] + T.Cast("int64", (t0 + bt * 16) % PS + T.min(
                                                        tile * 8 + 2 * tig + r, L - 1 - t0 - bt * 16)) * RBU + T.Cast("int64", D // 4)]
                                            # -- V rows 2tig, 2tig+1, 2tig+8, 2tig+9: columns 64 q + 8 gid + 0..7, exponents
                                            for rr in T.unroll(4):
                                                for q0 in T.unroll(NQ):
                                                    for u in T.unroll(2):
                                                        vr[(rr * NQ + q0) * 4 + u] = poolu[
                                                            rb[0] + T.Cast("int64", n_kv * PS + (t0 + bt * 16) % PS + T.min(
                                                                2 * tig + rr % 2 + 8 * (rr // 2), L - 1 - t0 - bt * 16)) * RBU
                                                            + T.Cast("int64", 16 * q0 + 2 * gid + u)]
                                                vsc[rr] = poolu[rb[0] + T.Cast("int64", n_kv * PS + (t0 + bt * 16) % PS + T.min(
                                                    2 * tig + rr % 2 + 8 * (rr // 2), L - 1 - t0 - bt * 16)) * RBU
                                                    + T.Cast("int64", D // 4)]
                                        elif MMAQ:
                                            if MMAF4:
                                                # -- fp4_qk: K rows gid, 8 + gid (the B fragments' column, fp4_mma.b_frag):
                                                # code words tig, tig + 4 of each 64-column chunk, then the rows' scale words
                                                for tile in T.unroll(2):
                                                    for kc in T.unroll(NKC):
                                                        for u in T.unroll(2):
                                                            kr[(tile * NKC + kc) * 2 + u] = T.cuda.func_call(
                                                                LD4_FN, T.address_of(poolu[_f4_kword(
                                                                    rb, t0 + bt * 16, tile * 8 + gid, L, 8 * kc + _b_word(lane, u))]),
                                                                source_code=LD4_SRC, return_type="uint32")
                                                    # the row's NKC = 4 scale words (byte j of word kc: block
                                                    # 4 kc + j) in one 16-byte load (offset D/2: 16-byte aligned)
                                                    T.evaluate(T.cuda.func_call(
                                                        LD_FN, T.address_of(ksc[tile * NKC]), T.address_of(
                                                            poolu[_f4_kword(rb, t0 + bt * 16, tile * 8 + gid, L, D // 8)]),
                                                        source_code=LD_SRC))
                                            else:
                                                # -- nvfp4: K rows gid, 8 + gid: code bytes 32 tig .. +31 (columns 64 tig ..
                                                # +63: word s0 = columns 64 tig + 8 s0 + 0..7) and their 4 block scales
                                                for tile in T.unroll(2):
                                                    for u in T.unroll(2):
                                                        T.evaluate(T.cuda.func_call(LD_FN, T.address_of(kr[(tile * 2 + u) * 4]),
                                                            T.address_of(poolw[
                                                                rb[0] + T.Cast("int64", (t0 + bt * 16) % PS + T.min(
                                                                    tile * 8 + gid, L - 1 - t0 - bt * 16)) * RBW
                                                                + T.Cast("int64", 2 * tig + u), 0]), source_code=LD_SRC))
                                                    ksc[tile] = poolu[(rb[0] + T.Cast("int64", (t0 + bt * 16) % PS + T.min(
                                                        tile * 8 + gid, L - 1 - t0 - bt * 16)) * RBW) * 4 + T.Cast("int64", D // 8 + tig)]
                                            # -- V rows 2tig, 2tig+1, 2tig+8, 2tig+9: code bytes 16 gid .. +15 (word q0 =
                                            # columns 32 gid + 8 q0 + 0..7), the scale pair of blocks 2 gid, 2 gid + 1
                                            for rr in T.unroll(4):
                                                T.evaluate(T.cuda.func_call(LD_FN, T.address_of(vr[rr * 4]),
                                                    T.address_of(poolw[
                                                        rb[0] + T.Cast("int64", n_kv * PS + (t0 + bt * 16) % PS + T.min(
                                                            2 * tig + rr % 2 + 8 * (rr // 2), L - 1 - t0 - bt * 16)) * RBW
                                                        + T.Cast("int64", gid), 0]), source_code=LD_SRC))
                                                vsc[rr] = poolu[(rb[0] + T.Cast("int64", n_kv * PS + (t0 + bt * 16) % PS + T.min(
                                                    2 * tig + rr % 2 + 8 * (rr // 2), L - 1 - t0 - bt * 16)) * RBW) * 4
                                                    + T.Cast("int64", D // 8 + gid // 2)] >> T.Cast("uint32", 16 * (gid % 2))
                                        else:
                                            # -- K rows gid (tile 0) and 8 + gid (tile 1), 16 bytes per 32-column slab
                                            # (volatile asm loads: all 16 are issued before the first mma)
                                            for tile in T.unroll(2):
                                                for s0 in T.unroll(NSLAB):
                                                    T.evaluate(T.cuda.func_call(LD_FN, T.address_of(kr[(tile * NSLAB + s0) * 4]),
                                                        T.address_of(poolw[
                                                            rb[0] + T.Cast("int64", (t0 + bt * 16) % PS + T.min(
                                                                tile * 8 + gid, L - 1 - t0 - bt * 16)) * RBW
                                                            + T.Cast("int64", 4 * s0 + tig), 0]), source_code=LD_SRC))
                                            # -- V rows 2tig, 2tig+1, 2tig+8, 2tig+9; columns 64q + 8gid + 0..7
                                            for rr in T.unroll(4):
                                                for q0 in T.unroll(NQ):
                                                    T.evaluate(T.cuda.func_call(LD_FN, T.address_of(vr[(rr * NQ + q0) * 4]),
                                                        T.address_of(poolw[
                                                            rb[0] + T.Cast("int64", n_kv * PS + (t0 + bt * 16) % PS + T.min(
                                                                2 * tig + rr % 2 + 8 * (rr // 2), L - 1 - t0 - bt * 16)) * RBW
                                                            + T.Cast("int64", 8 * q0 + gid), 0]), source_code=LD_SRC))
                                        # -- S = Q K^T: rows = heads, columns = 8 positions per tile
                                        # scores start at +0.0 computed from a word of every K and V vector of the
                                        # batch ANDed with a runtime zero (layer >> 30): ptxas must then issue all 32
                                        # loads before the first mma (otherwise it sinks some past the mma, and the
                                        # warp stalls on K before it requests the rest: two round trips per batch)
                                        tm[0] = T.reinterpret("float32", T.Cast("uint32", T.shift_right(layer, 30)) & (
                                            _or_words(vr, NVLD) | _or_words(kr, NKLD) | _or_scales(ksc, vsc, kr, vr)))
                                        for r in T.unroll(8):
                                            sc[r] = tm[0]
                                        if MMAF4:
                                            # fp4_qk: one m16n8k64 per 64-column chunk and 8 positions, straight from
                                            # the page's codes and block scales
                                            for kc in T.unroll(NKC):
                                                for tile in T.unroll(2):
                                                    T.evaluate(T.cuda.func_call(
                                                        MMA_NVF4_FN, T.address_of(sc[tile * 4]), qf[2 * kc], T.uint32(0),
                                                        qf[2 * kc + 1], T.uint32(0), kr[(tile * NKC + kc) * 2],
                                                        kr[(tile * NKC + kc) * 2 + 1], qf[2 * NKC + kc], ksc[tile * NKC + kc],
                                                        source_code=MMA_NVF4_SRC))
                                        else:
                                            for s0 in T.unroll(NSLAB):
                                                # fragment of head gid, columns 32 s0 + 8 tig + 0..7
                                                for e in T.vectorized(4):
                                                    qf[e] = qsm4[gid * (QROW // 4) + 4 * s0 + tig, e]
                                                for tile in T.unroll(2):
                                                    if MMA8:
                                                        for j in T.unroll(4):
                                                            fd[j] = T.cuda.func_call(
                                                                E4M3X2_F16X2_FN, kr[(tile * NSLAB + s0) * 4 + j // 2] >> T.Cast(
                                                                    "uint32", 16 * (j % 2)), source_code=E4M3X2_F16X2_SRC,
                                                                return_type="uint32")
                                                        for hk in T.unroll(2):
                                                            T.evaluate(T.cuda.func_call(
                                                                MMA_FN, T.address_of(sc[tile * 4]), qf[2 * hk], T.uint32(0),
                                                                qf[2 * hk + 1], T.uint32(0), fd[2 * hk], fd[2 * hk + 1],
                                                                source_code=MMA_SRC))
                                                    elif MMAQ:
                                                        # word s0 of the row: 8 codes, scale byte s0 // 2 of the lane's 4
                                                        T.evaluate(T.cuda.func_call(
                                                            NVFP4_F16X8_FN, T.address_of(fd[0]), kr[tile * 8 + s0],
                                                            T.cuda.func_call(E4M3_F16X2_FN, ksc[tile] >> T.Cast("uint32", 8 * (s0 // 2)),
                                                                             source_code=E4M3_F16X2_SRC, return_type="uint32"),
                                                            source_code=NVFP4_F16X8_SRC))
                                                        for hk in T.unroll(2):
                                                            T.evaluate(T.cuda.func_call(
                                                                MMA_FN, T.address_of(sc[tile * 4]), qf[2 * hk], T.uint32(0),
                                                                qf[2 * hk + 1], T.uint32(0), fd[2 * hk], fd[2 * hk + 1],
                                                                source_code=MMA_SRC))
                                                    else:
                                                        for hk in T.unroll(2):
                                                            T.evaluate(T.cuda.func_call(
                                                                MMA_FN, T.address_of(sc[tile * 4]), qf[2 * hk], T.uint32(0),
                                                                qf[2 * hk + 1], T.uint32(0),
                                                                kr[(tile * NSLAB + s0) * 4 + 2 * hk],
                                                                kr[(tile * NSLAB + s0) * 4 + 2 * hk + 1], source_code=MMA_SRC))
                                        # -- online softmax of head gid over the 16 positions (4 per lane)
                                        for tile in T.unroll(2):
                                            for r in T.unroll(2):
                                                sc[tile * 4 + r] = T.Select(
                                                    T.And(gid < G, t0 + bt * 16 + tile * 8 + 2 * tig + r < L),
                                                    sc[tile * 4 + r] * T.float32(scale2) * _kexp(ksc, tile * 2 + r, qf),
                                                    T.float32("-inf"))
                                        quad_running_max(sc, tm, st, 0)
                                        if MMA8:
                                            # the denominator from 2^(s - m); the P.V weights 2^(s + e - mv) (e: V row
                                            # exponent, mv: running max of s + e), so that P in f16 stays in [0, 1]
                                            st[1] = st[1] * tm[1] + ((T.exp2(sc[0] - tm[0]) + T.exp2(sc[1] - tm[0]))
                                                                     + (T.exp2(sc[4] - tm[0]) + T.exp2(sc[5] - tm[0])))
                                            for tile in T.unroll(2):
                                                for r in T.unroll(2):
                                                    sc[tile * 4 + r] = sc[tile * 4 + r] + T.Cast("float32", T.Cast(
                                                        "int32", vsc[tile * 2 + r] & T.uint32(0xFF)) - 127)
                                            quad_running_max(sc, tm, st, 6)
                                        for tile in T.unroll(2):
                                            for r in T.unroll(2):
                                                sc[tile * 4 + r] = T.exp2(sc[tile * 4 + r] - tm[0])
                                        if not MMA8:
                                            st[1] = st[1] * tm[1] + ((sc[0] + sc[1]) + (sc[4] + sc[5]))
                                        pk[0] = T.cuda.func_call(PACK_FN, sc[0], sc[1], source_code=PACK_SRC,
                                                                 return_type="uint32")
                                        pk[1] = T.cuda.func_call(PACK_FN, sc[4], sc[5], source_code=PACK_SRC,
                                                                 return_type="uint32")
                                        # rescale of heads 2tig, 2tig+1 (the accumulator layout)
                                        tm[2] = T.tvm_warp_shuffle(T.uint32(0xFFFFFFFF), tm[1], 8 * tig, 32, 32)
                                        tm[3] = T.tvm_warp_shuffle(T.uint32(0xFFFFFFFF), tm[1], 8 * tig + 4, 32, 32)
                                        for a in T.unroll(NACC):
                                            acc[a] = acc[a] * tm[2 + a % 2]
                                        # -- O^T += V^T P^T: rows = columns of V, columns = heads
                                        for q0 in T.unroll(NQ):
                                            if MMA8:
                                                for rr in T.unroll(4):
                                                    for j in T.unroll(4):
                                                        fd[rr * 4 + j] = T.cuda.func_call(
                                                            E4M3X2_F16X2_FN, vr[(rr * NQ + q0) * 4 + j // 2] >> T.Cast(
                                                                "uint32", 16 * (j % 2)), source_code=E4M3X2_F16X2_SRC,
                                                            return_type="uint32")
                                            if MMAQ:
                                                # word q0 of the 4 V rows as f16x2 (columns 32 gid + 8 q0 + PERM[j])
                                                for rr in T.unroll(4):
                                                    T.evaluate(T.cuda.func_call(
                                                        NVFP4_F16X8_FN, T.address_of(fd[rr * 4]), vr[rr * 4 + q0],
                                                        T.cuda.func_call(E4M3_F16X2_FN, vsc[rr] >> T.Cast("uint32", 8 * (q0 // 2)),
                                                                         source_code=E4M3_F16X2_SRC, return_type="uint32"),
                                                        source_code=NVFP4_F16X8_SRC))
                                            for j in T.unroll(4):
                                                T.evaluate(T.cuda.func_call(
                                                    MMA_FN, T.address_of(acc[(q0 * 4 + j) * 4]),
                                                    (_vw(vr, fd, 0, q0, j) & T.uint32(0xFFFF))
                                                    | (_vw(vr, fd, 1, q0, j) << T.uint32(16)),
                                                    (_vw(vr, fd, 0, q0, j) >> T.uint32(16))
                                                    | (_vw(vr, fd, 1, q0, j) & T.uint32(0xFFFF0000)),
                                                    (_vw(vr, fd, 2, q0, j) & T.uint32(0xFFFF))
                                                    | (_vw(vr, fd, 3, q0, j) << T.uint32(16)),
                                                    (_vw(vr, fd, 2, q0, j) >> T.uint32(16))
                                                    | (_vw(vr, fd, 3, q0, j) & T.uint32(0xFFFF0000)),
                                                    pk[0], pk[1], source_code=MMA_SRC))
                            if MMA8:
                                # acc holds sum 2^(s + e - mv) v: back to the 2^(s - m) scale of the sums
                                for hb in T.unroll(2):
                                    tm[2 + hb] = T.exp2(
                                        T.tvm_warp_shuffle(T.uint32(0xFFFFFFFF), st[6], 8 * tig + 4 * hb, 32, 32)
                                        - T.tvm_warp_shuffle(T.uint32(0xFFFFFFFF), st[0], 8 * tig + 4 * hb, 32, 32))
                                for a in T.unroll(NACC):
                                    acc[a] = acc[a] * tm[2 + a % 2]
                            # row sums over the quad, then (max, sum) of heads 2tig, 2tig+1 into st[2..5]
                            st[1] = st[1] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[1], 1, 32, 32)
                            st[1] = st[1] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), st[1], 2, 32, 32)
                            for hb in T.unroll(2):
                                st[2 + 2 * hb] = T.tvm_warp_shuffle(T.uint32(0xFFFFFFFF), st[0], 8 * tig + 4 * hb, 32, 32)
                                st[3 + 2 * hb] = T.tvm_warp_shuffle(T.uint32(0xFFFFFFFF), st[1], 8 * tig + 4 * hb, 32, 32)
                            # ---- merge the warps pairwise (same lane layout in every warp)
                            for r in T.unroll(LOGW):
                                if w >= (W >> (r + 1)):
                                    if w < (W >> r):
                                        for a in T.unroll(NACC):
                                            mg[((w - (W >> (r + 1))) * 32 + lane) * (NACC + 4) + a] = acc[a]
                                        for e in T.unroll(4):
                                            mg[((w - (W >> (r + 1))) * 32 + lane) * (NACC + 4) + NACC + e] = st[2 + e]
                                T.tvm_storage_sync("shared")
                                if w < (W >> (r + 1)):
                                    for hb in T.unroll(2):
                                        tm[0] = T.max(st[2 + 2 * hb], mg[(w * 32 + lane) * (NACC + 4) + NACC + 2 * hb])
                                        tm[1] = T.exp2(st[2 + 2 * hb] - tm[0])
                                        tm[2] = T.exp2(mg[(w * 32 + lane) * (NACC + 4) + NACC + 2 * hb] - tm[0])
                                        st[2 + 2 * hb] = tm[0]
                                        st[3 + 2 * hb] = st[3 + 2 * hb] * tm[1] + mg[
                                            (w * 32 + lane) * (NACC + 4) + NACC + 2 * hb + 1] * tm[2]
                                        for a in T.unroll(NACC // 2):
                                            acc[2 * a + hb] = acc[2 * a + hb] * tm[1] + mg[
                                                (w * 32 + lane) * (NACC + 4) + 2 * a + hb] * tm[2]
                                T.tvm_storage_sync("shared")
                            if w == 0:
                                for hb in T.unroll(2):
                                    if 2 * tig + hb < G:
                                        if _nsplit(n, p, b) == 1:
                                            for q0 in T.unroll(NQ):
                                                for j in T.unroll(4):
                                                    for r in T.unroll(2):
                                                        ob[_ocol(j, r)] = T.Cast(dtype, acc[(q0 * 4 + j) * 4 + 2 * r + hb]
                                                                                 / st[3 + 2 * hb])
                                                for e in T.vectorized(8):
                                                    outv[(T.Cast("int64", i) * n_heads + g * G + 2 * tig + hb) * (D // 8)
                                                         + _ogrp(q0, gid), e] = ob[e]
                                        else:
                                            for q0 in T.unroll(NQ):
                                                for j in T.unroll(4):
                                                    for r in T.unroll(2):
                                                        sc[_ocol(j, r)] = acc[(q0 * 4 + j) * 4 + 2 * r + hb]
                                                for v0 in T.unroll(8 // CVEC):
                                                    for e in T.vectorized(CVEC):
                                                        ws_ov[_ws(i, g * G + 2 * tig + hb, s, n, p, b) * (D // CVEC)
                                                              + T.Cast("int64", 8 * _ogrp(q0, gid) // CVEC + v0), e] = sc[
                                                            v0 * CVEC + e]
                                            if gid == 0:
                                                ws_ml[_ws(i, g * G + 2 * tig + hb, s, n, p, b) * 2] = st[2 + 2 * hb]
                                                ws_ml[_ws(i, g * G + 2 * tig + hb, s, n, p, b) * 2 + 1] = st[3 + 2 * hb]
        else:
            for i in T.thread_binding(n, thread="blockIdx.x"):
                for g in T.thread_binding(n_kv, thread="blockIdx.y"):
                    for s in T.thread_binding(_nsplit(n, p, b), thread="blockIdx.z"):
                        for tx in T.thread_binding(NT, thread="threadIdx.x"):
                            qr = T.alloc_buffer((G * DL,), "float32", scope="local")
                            acc = T.alloc_buffer((G * DL,), "float32", scope="local")
                            mr = T.alloc_buffer((G,), "float32", scope="local")
                            lr = T.alloc_buffer((G,), "float32", scope="local")
                            pr = T.alloc_buffer((G,), "float32", scope="local")
                            tm = T.alloc_buffer((2,), "float32", scope="local")
                            part = T.alloc_buffer((G * QB,), "float32", scope="local")
                            raw = T.alloc_buffer((2 * QB * RW,), RAW_DT, scope="local")
                            sf = T.alloc_buffer((2 * QB * NSB,), "float32", scope="local")
                            xv = T.alloc_buffer((DL,), "float32", scope="local")
                            rb = T.alloc_buffer((1,), "int64", scope="local")
                            ob = T.alloc_buffer((DL,), dtype, scope="local")
                            mg = T.alloc_buffer((WH * G * D,), "float32", scope="shared")
                            mgl = T.alloc_buffer((WH * G * 2,), "float32", scope="shared")
                            w = tx // 32
                            lane = tx % 32
                            L = pos[i] + 1
                            nch = (L + CHUNK - 1) // CHUNK
                            cps = (nch + _nsplit(n, p, b) - 1) // _nsplit(n, p, b)
                            c_lo = s * cps
                            c_hi = T.min(c_lo + cps, nch)
                            row = tseq[i]
                            with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", MIN_BLOCKS):
                                for h in T.unroll(G):
                                    mr[h] = T.float32(neg_big)
                                    lr[h] = T.float32(0)
                                    for e in T.unroll(DL):
                                        qr[h * DL + e] = T.Cast("float32", q[i, g * G + h, lane * DL + e]) * T.float32(
                                            scale2)
                                        acc[h * DL + e] = T.float32(0)
                            for ci in range((T.max(c_hi - c_lo - w, 0) + W - 1) // W):
                                t0 = (c_lo + w + ci * W) * CHUNK
                                page = pt[row, t0 // PS]
                                rb[0] = (T.Cast("int64", page) * n_layers + T.Cast("int64", layer)) * (2 * n_kv * PS * RBV) + T.Cast(
                                    "int64", g) * (PS * RBV)
                                for bt in range(NB):
                                    if t0 + bt * QB < L:
                                        # -- load the batch's K and V rows (clamped to the last valid row)
                                        for c in T.unroll(2):
                                            for j in T.unroll(QB):
                                                if MODE == "scalar":
                                                    for e in T.unroll(DL):
                                                        raw[(c * QB + j) * RW + e] = load(
                                                            pool, page, layer, c, g,
                                                            (t0 + bt * QB) % PS + T.min(j, L - 1 - t0 - bt * QB),
                                                            lane * DL + e)
                                                else:
                                                    # rows are addressed in VEC units off a device-computed
                                                    # base, so the vector loads are provably aligned
                                                    for v0 in T.unroll(RW // VEC):
                                                        for e in T.vectorized(VEC):
                                                            raw[(c * QB + j) * RW + v0 * VEC + e] = poolv[
                                                                rb[0] + T.Cast("int64", c * n_kv * PS + (t0 + bt * QB) % PS
                                                                               + T.min(j, L - 1 - t0 - bt * QB)) * RBV
                                                                + T.Cast("int64", lane * (RW // VEC) + v0), e]
                                                if MODE == "fp8v":
                                                    sf[c * QB + j] = pow2_from_e8m0(T.Cast("uint32", pool[
                                                        page, layer, c, g,
                                                        (t0 + bt * QB) % PS + T.min(j, L - 1 - t0 - bt * QB), D]))
                                                if MODE == "nvfp4v":
                                                    for eb in T.unroll(NSB):
                                                        # half the block scale: the codes decode to twice their value
                                                        sf[(c * QB + j) * NSB + eb] = _e4m3_value(T.Cast("uint32", pool[
                                                            page, layer, c, g,
                                                            (t0 + bt * QB) % PS + T.min(j, L - 1 - t0 - bt * QB),
                                                            half + (lane * DL) // NVFP4_BLOCK + eb]) & _u32(0x7F)) * T.float32(0.5)
                                        # -- partial dot products over the lane's columns
                                        # (each element decoded once into xv, then used by every head)
                                        for j in T.unroll(QB):
                                            for e in T.unroll(DL):
                                                xv[e] = elem(raw, sf, 0, j, e)
                                            for h in T.unroll(G):
                                                part[h * QB + j] = T.float32(0)
                                                for e in T.unroll(DL):
                                                    part[h * QB + j] = part[h * QB + j] + qr[h * DL + e] * xv[e]
                                        # -- transposing butterfly: halve the positions on lane bits 16, 8, ...
                                        for st in T.unroll(NH):
                                            for h in T.unroll(G):
                                                for j in T.unroll(max(QB // 2, 1)):
                                                    if j < (QB >> (st + 1)):
                                                        part[h * QB + j] = T.Select(
                                                            (lane & (16 >> st)) != 0,
                                                            part[h * QB + j + (QB >> (st + 1))], part[h * QB + j],
                                                        ) + T.tvm_warp_shuffle_xor(
                                                            T.uint32(0xFFFFFFFF),
                                                            T.Select((lane & (16 >> st)) != 0, part[h * QB + j],
                                                                     part[h * QB + j + (QB >> (st + 1))]),
                                                            16 >> st, 32, 32)
                                        # -- ... then sum the rest: lane holds position lane >> SH
                                        for st in T.unroll(SH):
                                            for h in T.unroll(G):
                                                part[h * QB] = part[h * QB] + T.tvm_warp_shuffle_xor(
                                                    T.uint32(0xFFFFFFFF), part[h * QB], (1 << SH) >> (st + 1), 32, 32)
                                        # -- online softmax (base 2) over the batch
                                        for h in T.unroll(G):
                                            pr[h] = T.Select(t0 + bt * QB + (lane >> SH) < L, part[h * QB],
                                                             T.float32("-inf"))
                                            part[h * QB] = pr[h]
                                            for st in T.unroll(NH):
                                                part[h * QB] = T.max(part[h * QB], T.tvm_warp_shuffle_xor(
                                                    T.uint32(0xFFFFFFFF), part[h * QB], 16 >> st, 32, 32))
                                            tm[0] = T.max(part[h * QB], mr[h])  # new max
                                            tm[1] = T.exp2(mr[h] - tm[0])  # rescale of the old sums
                                            mr[h] = tm[0]
                                            pr[h] = T.exp2(pr[h] - tm[0])
                                            lr[h] = lr[h] * tm[1] + pr[h]
                                            for e in T.unroll(DL):
                                                acc[h * DL + e] = acc[h * DL + e] * tm[1]
                                        # -- P.V: p of row j comes from lane j << SH
                                        for j in T.unroll(QB):
                                            for h in T.unroll(G):
                                                part[h * QB + j] = T.tvm_warp_shuffle(
                                                    T.uint32(0xFFFFFFFF), pr[h], j << SH, 32, 32)
                                            for e in T.unroll(DL):
                                                xv[e] = elem(raw, sf, 1, j, e)
                                            for e in T.unroll(DL):
                                                for h in T.unroll(G):
                                                    acc[h * DL + e] = acc[h * DL + e] + part[h * QB + j] * xv[e]
                            # row sums: lanes of one position group hold equal partials
                            for h in T.unroll(G):
                                for st in T.unroll(NH):
                                    lr[h] = lr[h] + T.tvm_warp_shuffle_xor(
                                        T.uint32(0xFFFFFFFF), lr[h], 16 >> st, 32, 32)
                            # ---- merge the warps pairwise through shared memory
                            for r in T.unroll(LOGW):
                                if w >= (W >> (r + 1)):
                                    if w < (W >> r):
                                        for h in T.unroll(G):
                                            for e in T.unroll(DL):
                                                mg[((w - (W >> (r + 1))) * G + h) * D + lane * DL + e] = acc[h * DL + e]
                                            if lane == 0:
                                                mgl[((w - (W >> (r + 1))) * G + h) * 2] = mr[h]
                                                mgl[((w - (W >> (r + 1))) * G + h) * 2 + 1] = lr[h]
                                T.tvm_storage_sync("shared")
                                if w < (W >> (r + 1)):
                                    for h in T.unroll(G):
                                        pr[h] = T.max(mr[h], mgl[(w * G + h) * 2])
                                        tm[0] = T.exp2(mr[h] - pr[h])
                                        tm[1] = T.exp2(mgl[(w * G + h) * 2] - pr[h])
                                        mr[h] = pr[h]
                                        lr[h] = lr[h] * tm[0] + mgl[(w * G + h) * 2 + 1] * tm[1]
                                        for e in T.unroll(DL):
                                            acc[h * DL + e] = acc[h * DL + e] * tm[0] + mg[
                                                (w * G + h) * D + lane * DL + e] * tm[1]
                                T.tvm_storage_sync("shared")
                            if w == 0:
                                if _nsplit(n, p, b) == 1:
                                    for h in T.unroll(G):
                                        for e in T.unroll(DL):
                                            ob[e] = T.Cast(dtype, acc[h * DL + e] / lr[h])
                                        for e in T.unroll(DL):
                                            out[i, g * G + h, lane * DL + e] = ob[e]
                                else:
                                    for h in T.unroll(G):
                                        for v0 in T.unroll(DL // CVEC):
                                            for e in T.vectorized(CVEC):
                                                ws_ov[_ws(i, g * G + h, s, n, p, b) * (D // CVEC)
                                                      + T.Cast("int64", lane * (DL // CVEC) + v0), e] = acc[h * DL + v0 * CVEC + e]
                                        if lane == 0:
                                            ws_ml[_ws(i, g * G + h, s, n, p, b) * 2] = mr[h]
                                            ws_ml[_ws(i, g * G + h, s, n, p, b) * 2 + 1] = lr[h]

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
        poolv = T.decl_buffer((npages * (n_layers * 2 * n_kv * PS * RBV), VEC), pool_dt, data=pool.data)
        poolw = T.decl_buffer((npages * (n_layers * 2 * n_kv * PS * RBW), 4), "uint32", data=pool.data)
        poolu = T.decl_buffer((npages * (n_layers * 2 * n_kv * PS * RBU),), "uint32", data=pool.data)
        qw1 = T.decl_buffer((n * (n_heads * D // 2),), "uint32", data=q.data)
        outv = T.decl_buffer((n * (n_heads * D // 8), 8), dtype, data=out.data)
        ws_o = T.alloc_buffer((_ws_size(n, p, b, D),), "float32", scope="global")
        ws_ml = T.alloc_buffer((_ws_size(n, p, b, 2),), "float32", scope="global")
        ws_ov = T.decl_buffer((T.max(_ws_size(n, p, b, D) // CVEC, T.int64(1)), CVEC), "float32", data=ws_o.data)
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
        # ---- 2. attend ------------------------------------------------------------------------------
        if SR:
            # verify: a block per (sequence, KV head, split) over all the sequence's rows (attention_verify.py)
            for sq in T.thread_binding(b, thread="blockIdx.x"):
                for g in T.thread_binding(n_kv, thread="blockIdx.y"):
                    for s in T.thread_binding(_nsplit(n, p, b), thread="blockIdx.z"):
                        for tx in T.thread_binding(VF_NT, thread="threadIdx.x"):
                            with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 2):
                                smem = T.alloc_buffer((PF_SMEM,), "uint8", scope="shared.dyn")
                                T.evaluate(T.cuda.func_call(
                                    VF_NAME, T.address_of(q[0, 0, 0]), T.address_of(pool[0, 0, 0, 0, 0, 0]),
                                    T.address_of(pos[0]), T.address_of(tseq[0]), T.address_of(pt[0, 0]),
                                    T.address_of(out[0, 0, 0]), T.address_of(ws_o[0]), T.address_of(ws_ml[0]),
                                    T.Cast("int32", n), T.Cast("int32", p), layer, _nsplit(n, p, b), smem.data,
                                    source_code=VF_SRC))
        elif PF:
            if n >= PF_MIN:
                # prefill: FlashAttention-2 tiles of (token, query head) rows (prefill_source)
                for bx in T.thread_binding((n * G + PF_BQ - 1) // PF_BQ, thread="blockIdx.x"):
                    for g in T.thread_binding(n_kv, thread="blockIdx.y"):
                        for tx in T.thread_binding(PF_NT, thread="threadIdx.x"):
                            with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 2):
                                smem = T.alloc_buffer((PF_SMEM,), "uint8", scope="shared.dyn")
                                T.evaluate(T.cuda.func_call(
                                    PF_NAME, T.address_of(q[0, 0, 0]), T.address_of(pool[0, 0, 0, 0, 0, 0]),
                                    T.address_of(pos[0]), T.address_of(tseq[0]), T.address_of(pt[0, 0]),
                                    T.address_of(out[0, 0, 0]), T.Cast("int32", n), T.Cast("int32", p), layer,
                                    smem.data, source_code=PF_SRC))
            else:
                attend_split(n, p, b, q, pos, tseq, pt, pool, layer, out, poolv, poolw, poolu, qw1, outv, ws_ml, ws_ov)
        else:
            attend_split(n, p, b, q, pos, tseq, pt, pool, layer, out, poolv, poolw, poolu, qw1, outv, ws_ml, ws_ov)
        # ---- 3. combine split partials -------------------------------------------------------------
        # block (token, q head), CW warps. Every warp reads all (max, sum) pairs (lane-strided,
        # registers), reduces max and denominator with shuffles; warp 0 stores the split weights
        # 2^(m_s - M) (0 for an empty split: sum exactly 0) in shared memory. Then warp w sums the
        # partial rows s = w + CW k (CU of them in flight per lane, 16-byte loads of the lane's
        # columns) and the warps' sums are added through shared memory. Without splits (prefill) the
        # launch is a single idle block instead of n x Hq of them.
        for i in T.thread_binding(T.Select(_nsplit(n, p, b) > 1, n, T.int64(1)), thread="blockIdx.x"):
            for h in T.thread_binding(n_heads, thread="blockIdx.y"):
                for tx in T.thread_binding(CNT, thread="threadIdx.x"):
                    cm = T.alloc_buffer((CMS,), "float32", scope="local")
                    cl = T.alloc_buffer((CMS,), "float32", scope="local")
                    cr = T.alloc_buffer((4,), "float32", scope="local")
                    ca = T.alloc_buffer((DL,), "float32", scope="local")
                    cv = T.alloc_buffer((CU * DL,), "float32", scope="local")
                    wsm = T.alloc_buffer((MAXS + CW * CU,), "float32", scope="shared")
                    red = T.alloc_buffer((CW * D,), "float32", scope="shared")
                    cw = tx // 32
                    cln = tx % 32
                    if _nsplit(n, p, b) > 1:
                        cr[0] = T.float32(neg_big)
                        for k0 in T.unroll(CMS):
                            cm[k0] = T.float32(neg_big)
                            cl[k0] = T.float32(0)
                            if k0 * 32 + cln < _nsplit(n, p, b):
                                cm[k0] = ws_ml[_ws(i, h, k0 * 32 + cln, n, p, b) * 2]
                                cl[k0] = ws_ml[_ws(i, h, k0 * 32 + cln, n, p, b) * 2 + 1]
                            cr[0] = T.max(cr[0], cm[k0])
                        for o in T.unroll(5):
                            cr[0] = T.max(cr[0], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), cr[0], 16 >> o, 32, 32))
                        cr[1] = T.float32(0)
                        for k0 in T.unroll(CMS):
                            # an empty split has sum exactly 0 (and max NEG_BIG); a NaN sum propagates
                            cm[k0] = T.Select(cl[k0] == T.float32(0), T.float32(0), T.exp2(cm[k0] - cr[0]))
                            cr[1] = cr[1] + cl[k0] * cm[k0]
                        for o in T.unroll(5):
                            cr[1] = cr[1] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), cr[1], 16 >> o, 32, 32)
                        if cw == 0:
                            for k0 in T.unroll((MAXS + CW * CU + 31) // 32):
                                if k0 * 32 + cln < MAXS + CW * CU:
                                    wsm[k0 * 32 + cln] = T.float32(0)
                            for k0 in T.unroll(CMS):
                                if k0 * 32 + cln < _nsplit(n, p, b):
                                    wsm[k0 * 32 + cln] = cm[k0]
                        T.tvm_storage_sync("shared")
                        for e in T.unroll(DL):
                            ca[e] = T.float32(0)
                        for k in range((_nsplit(n, p, b) + CW * CU - 1) // (CW * CU)):
                            for u in T.unroll(CU):
                                # rows past nsplit have weight 0; their index is clamped to a written row
                                for v0 in T.unroll(DL // CVEC):
                                    for e in T.vectorized(CVEC):
                                        cv[u * DL + v0 * CVEC + e] = ws_ov[
                                            _ws(i, h, T.min((k * CU + u) * CW + cw, _nsplit(n, p, b) - 1), n, p, b) * (D // CVEC)
                                            + T.Cast("int64", cln * (DL // CVEC) + v0), e]
                            for u in T.unroll(CU):
                                for e in T.unroll(DL):
                                    ca[e] = ca[e] + wsm[(k * CU + u) * CW + cw] * cv[u * DL + e]
                        for e in T.unroll(DL):
                            red[cw * D + cln * DL + e] = ca[e]
                        T.tvm_storage_sync("shared")
                        for c0 in range((D + CNT - 1) // CNT):
                            if c0 * CNT + tx < D:
                                cr[2] = T.float32(0)
                                for w2 in T.unroll(CW):
                                    cr[2] = cr[2] + red[w2 * D + c0 * CNT + tx]
                                out[i, h, c0 * CNT + tx] = T.Cast(dtype, cr[2] / cr[1])

    return attn
