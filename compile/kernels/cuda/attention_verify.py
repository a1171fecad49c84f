"""Verify attend of the CUDA paged attention (compile/kernels/cuda/attention.py, launch 2''): calls whose sequences
have few consecutive rows each (speculative verification: k + 1 rows per sequence, the relax functions traced under
short_rows_scope). The split attend gives a block one token, so the R rows of a sequence read its K/V R times; here
a block takes every row of its sequence.

Grid (b, Hkv, nsplit) x 128 threads (4 warps), prefill_smem_bytes(D) of dynamic shared memory. Block (sequence sq,
KV head g, split s): the sequence's tokens are [i0, i1) of the call (tseq is sorted: two binary searches), its
rows R = (i - i0) G + h (token i, query head h of g) form tiles of VF_BQ = 64 rows (m16 tiles: warp w owns rows
16w..16w+15; a warp with no rows skips the math; R G > 64 rows, e.g. 16 rows of G = 6, take a second pass over
the same K/V). Per tile the block walks the K/V tiles of 32 positions of its split: the tile's longest context
lmax (its last row's position + 1) in ceil(lmax / 32) tiles cut into nsplit contiguous ranges (trailing ranges
may be empty). K/V tiles go to shared memory by cp.async, double-buffered, and are read ONCE for all rows and
heads of the tile: S = Q K^T and O += P V by mma.m16n8k16 with ldmatrix fragments (the prefill launch's
FlashAttention-2 tile code), online softmax in base 2 per row, causal mask per row (position <= the row's).
nsplit = 1 writes `out`; otherwise every (row, split) writes its unnormalized partial row and (max, sum) to the
split workspace of the combine launch (an empty range writes zeros and sum 0: weight 0 there).
nsplit = clamp(ceil(target_blocks / (b Hkv)), 1, p page / 32 / VF_MIN_TILES) (verify_splits).
Pages: bf16 / f16 of the activation dtype (verify_applies); other page formats keep the split attend.
"""
from __future__ import annotations

from .attention_tile import tile_load_src, tile_math_src

VF_BQ = 64  # rows (token, query head) per tile: 4 warps x 16
VF_BKV = 32  # positions per K/V tile
VF_NT = 128
VF_MIN_TILES = 2  # K/V tiles per split at least, at the page table's full width


def verify_applies(n_heads: int, n_kv: int, head_dim: int, dtype: str, kv_dtype: str | None) -> bool:
    """16-bit pages of the activation dtype and head_dim % 64 == 0 (the prefill tile code's fragments)."""
    kv = kv_dtype or dtype
    return kv == dtype and dtype in ("bfloat16", "float16") and head_dim % 64 == 0 and n_heads % n_kv == 0


def verify_splits(b: int, p: int, n_kv: int, page_size: int, target_blocks: int = 264) -> int:
    """Host-side mirror of the verify attend's split count for b sequences and a page table of width p."""
    cap = max(p * page_size // VF_BKV // VF_MIN_TILES, 1)
    return max(1, min(-(-target_blocks // (b * n_kv)), cap))


def verify_source(name: str, n_heads: int, n_kv: int, head_dim: int, page_size: int, n_layers: int, scale2: float,
                  mma_fn: str, pack_fn: str, neg_big: float) -> str:
    """CUDA of the verify attend block (module docstring). mma_fn / pack_fn: the m16n8k16 mma and the fp32 pair ->
    16-bit pair helpers of the activation dtype (their sources come with the launch: attention.py)."""
    D, G, HQ, HKV, PS, NL = head_dim, n_heads // n_kv, n_heads, n_kv, page_size, n_layers
    BQ, BKV, NT = VF_BQ, VF_BKV, VF_NT
    SROW = D * 2 + 16  # bytes per shared row (16 bytes of padding: conflict-free ldmatrix)
    tile = tile_math_src(D, BKV, SROW, mma_fn, pack_fn, scale2, "causal mask: position <= the row's")
    load = tile_load_src(D, PS, NL, HKV, BKV, SROW, NT, "the tile's longest context")
    return f"""
// NINFER_ATTN_SRC_BEGIN (kept by the CPU emulator, compile/kernels/cuda/emulate)
__device__ __forceinline__ void {name}(const void* __restrict__ qv, const void* __restrict__ poolv,
    const int* __restrict__ pos, const int* __restrict__ tseq, const int* __restrict__ pt, void* __restrict__ outv,
    float* __restrict__ ws_o, float* __restrict__ ws_ml, int n, int p, int layer, int nsplit, unsigned char* smem) {{
  const unsigned short* q = (const unsigned short*)qv;
  const unsigned short* pool = (const unsigned short*)poolv;
  unsigned* out = (unsigned*)outv;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, gq = lane >> 2, tq = lane & 3;
  const int sq = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
  // this sequence's tokens [i0, i1) (tseq is sorted)
  int lo = 0, hi = n;
  while (lo < hi) {{
    const int mid = (lo + hi) >> 1;
    if (tseq[mid] < sq) lo = mid + 1; else hi = mid;
  }}
  const int i0 = lo;
  hi = n;
  while (lo < hi) {{
    const int mid = (lo + hi) >> 1;
    if (tseq[mid] <= sq) lo = mid + 1; else hi = mid;
  }}
  const int nrows = (lo - i0) * {G};
  const int* ptr = pt + (long long)sq * p;
  unsigned char* sQ = smem;
  unsigned char* sK = smem + {BQ * SROW};
  unsigned char* sV = sK + {2 * BKV * SROW};
  const long long vofs = (long long){HKV * PS * D};
  for (int r0 = 0; r0 < nrows; r0 += {BQ}) {{
    const int rend = min(r0 + {BQ}, nrows);
    // Q tile (rows past the end: the last row, never stored)
    for (int c = tid; c < {BQ * (D // 8)}; c += {NT}) {{
      const int r = c / {D // 8}, ch = c % {D // 8};
      const int R = min(r0 + r, nrows - 1);
      const int i = i0 + R / {G}, h = R - R / {G} * {G};
      ninfer_attn_cp16(sQ + r * {SROW} + ch * 16, q + ((long long)i * {HQ} + kvh * {G} + h) * {D} + ch * 8);
    }}
    ninfer_attn_cp_commit();
    // this lane's rows: warp * 16 + gq (+ 8)
    int rpos[2];
    bool act[2];
    for (int rr = 0; rr < 2; ++rr) {{
      const int R = r0 + warp * 16 + gq + 8 * rr;
      act[rr] = R < rend;
      rpos[rr] = pos[i0 + min(R, nrows - 1) / {G}];
    }}
    const bool wact = r0 + warp * 16 < rend;
    int lmax = 0;
    for (int i = i0 + r0 / {G}; i <= i0 + (rend - 1) / {G}; ++i) lmax = max(lmax, pos[i] + 1);
    const int nkv = (lmax + {BKV - 1}) / {BKV};
    const int cps = (nkv + nsplit - 1) / nsplit;
    const int t_lo = min(split * cps, nkv), t_hi = min(t_lo + cps, nkv);
    float o[{D // 8}][4];
#pragma unroll
    for (int d = 0; d < {D // 8}; ++d) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0.f;
    float m[2] = {{{neg_big:e}f, {neg_big:e}f}}, l[2] = {{0.f, 0.f}};
{load}
    if (t_lo < t_hi) load(t_lo);
    for (int t = t_lo; t < t_hi; ++t) {{
      if (t + 1 < t_hi) {{
        load(t + 1);
        ninfer_attn_cp_wait1();
      }} else {{
        ninfer_attn_cp_wait0();
      }}
      __syncthreads();
      if (wact) {{
{tile}
      }}
      __syncthreads();
    }}
    ninfer_attn_cp_wait0();  // (the Q tile, when the range is empty)
    // row sums over the quad; out (one split) or the split's partial rows (columns 8d + 2tq, +1 of rows gq, gq + 8)
#pragma unroll
    for (int rr = 0; rr < 2; ++rr) {{
      l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 1);
      l[rr] += __shfl_xor_sync(0xffffffffu, l[rr], 2);
      if (act[rr]) {{
        const int R = r0 + warp * 16 + gq + 8 * rr;
        const int i = i0 + R / {G}, h = kvh * {G} + R - R / {G} * {G};
        if (nsplit == 1) {{
          const float inv = 1.f / l[rr];
          unsigned* dst = out + (((long long)i * {HQ} + h) * {D} + 2 * tq) / 2;
#pragma unroll
          for (int d = 0; d < {D // 8}; ++d) dst[4 * d] = {pack_fn}(o[d][2 * rr] * inv, o[d][2 * rr + 1] * inv);
        }} else {{
          const long long w = ((long long)i * {HQ} + h) * nsplit + split;
          float2* dst = (float2*)(ws_o + w * {D} + 2 * tq);
#pragma unroll
          for (int d = 0; d < {D // 8}; ++d) dst[4 * d] = make_float2(o[d][2 * rr], o[d][2 * rr + 1]);
          if (tq == 0) {{
            ws_ml[2 * w] = m[rr];
            ws_ml[2 * w + 1] = l[rr];
          }}
        }}
      }}
    }}
    __syncthreads();  // the next tile's Q overwrites sQ
  }}
}}
// NINFER_ATTN_SRC_END
"""
