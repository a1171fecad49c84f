"""The FlashAttention-2 tile load and math shared by the CUDA attention's prefill and verify attend launches
(compile/kernels/cuda/attention.py prefill_source, attention_verify.py verify_source): one K/V tile of the shared
double buffer against a warp's 16 query rows."""
from __future__ import annotations


def tile_math_src(head_dim: int, bkv: int, srow: int, mma_fn: str, pack_fn: str, scale2: float, mask_note: str) -> str:
    """CUDA statements (6-space indent, inside the loop over K/V tiles t): S = Q K^T of the warp's 16 rows of sQ
    (rows warp * 16 ..) against tile t of sK (buffer t & 1, bkv = 32 positions, srow bytes per row) by ldmatrix +
    mma.m16n8k16, the online softmax in base 2 of the lane's rows gq, gq + 8 (scores x scale2; a score counts
    where act[rr] && position <= rpos[rr]: running max m[rr], sum l[rr], accumulators o[d][4] rescaled), P packed
    by pack_fn, O += P V with V fragments by ldmatrix.trans. mask_note: the comment on the mask."""
    D, BKV, SROW = head_dim, bkv, srow
    return f"""      const unsigned char* kb = sK + (t & 1) * {BKV * SROW};
      const unsigned char* vb = sV + (t & 1) * {BKV * SROW};
      // S = Q K^T (16 rows x 32 positions per warp)
      float s[4][4];
#pragma unroll
      for (int j = 0; j < 4; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < {D // 16}; ++kk) {{
        unsigned a[4];
        ninfer_attn_ldsm_x4(a, sQ + (warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * {SROW} + kk * 32 + (lane >> 4) * 16);
#pragma unroll
        for (int np = 0; np < 2; ++np) {{
          unsigned b[4];
          ninfer_attn_ldsm_x4(b, kb + (np * 16 + (lane & 7) + (lane >> 4) * 8) * {SROW} + kk * 32 + ((lane >> 3) & 1) * 16);
          {mma_fn}(s[2 * np], a[0], a[1], a[2], a[3], b[0], b[1]);
          {mma_fn}(s[2 * np + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
        }}
      }}
      // online softmax (base 2) of rows gq, gq + 8; {mask_note}
      unsigned pa[2][4];
#pragma unroll
      for (int rr = 0; rr < 2; ++rr) {{
        float mx = -INFINITY;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {{
            const int kp = t * {BKV} + 8 * j + 2 * tq + e;
            const float x = (act[rr] && kp <= rpos[rr]) ? s[j][2 * rr + e] * {scale2!r}f : -INFINITY;
            s[j][2 * rr + e] = x;
            mx = fmaxf(mx, x);
          }}
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mn = fmaxf(m[rr], mx);
        const float al = exp2f(m[rr] - mn);
        m[rr] = mn;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {{
            const float pv = exp2f(s[j][2 * rr + e] - mn);
            s[j][2 * rr + e] = pv;
            sum += pv;
          }}
        l[rr] = l[rr] * al + sum;
#pragma unroll
        for (int d = 0; d < {D // 8}; ++d) {{
          o[d][2 * rr] *= al;
          o[d][2 * rr + 1] *= al;
        }}
      }}
#pragma unroll
      for (int kk = 0; kk < 2; ++kk) {{
        pa[kk][0] = {pack_fn}(s[2 * kk][0], s[2 * kk][1]);
        pa[kk][1] = {pack_fn}(s[2 * kk][2], s[2 * kk][3]);
        pa[kk][2] = {pack_fn}(s[2 * kk + 1][0], s[2 * kk + 1][1]);
        pa[kk][3] = {pack_fn}(s[2 * kk + 1][2], s[2 * kk + 1][3]);
      }}
      // O += P V (V fragments by ldmatrix.trans)
#pragma unroll
      for (int kk = 0; kk < 2; ++kk)
#pragma unroll
        for (int dp = 0; dp < {D // 16}; ++dp) {{
          unsigned b[4];
          ninfer_attn_ldsm_x4_t(b, vb + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * {SROW} + dp * 32 + (lane >> 4) * 16);
          {mma_fn}(o[2 * dp], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b[0], b[1]);
          {mma_fn}(o[2 * dp + 1], pa[kk][0], pa[kk][1], pa[kk][2], pa[kk][3], b[2], b[3]);
        }}"""


def tile_load_src(head_dim: int, page_size: int, n_layers: int, n_kv: int, bkv: int, srow: int, nt: int,
                  past: str) -> str:
    """CUDA lambda `load(t)` (4-space indent): cp.async of K/V tile t (bkv positions of the page table row ptr, KV
    head kvh of layer `layer`) into buffer t & 1 of sK / sV (16-bit pages), one commit group. Positions from lmax
    on read row lmax - 1 (past: what lmax is, for the comment)."""
    D, PS, NL, HKV, BKV, SROW, NT = head_dim, page_size, n_layers, n_kv, bkv, srow, nt
    return f"""    auto load = [&](int t) {{
      const int t0 = t * {BKV};
      const long long base = (((long long)ptr[t0 / {PS}] * {NL} + layer) * {2 * HKV} + kvh) * {PS * D};
      unsigned char* dk = sK + (t & 1) * {BKV * SROW};
      unsigned char* dv = sV + (t & 1) * {BKV * SROW};
      for (int c = tid; c < {BKV * (D // 8)}; c += {NT}) {{
        const int r = c / {D // 8}, ch = c % {D // 8};
        // positions past {past}: its last row (finite values, masked)
        const unsigned short* src = pool + base + (long long)(t0 % {PS} + min(r, lmax - 1 - t0)) * {D} + ch * 8;
        ninfer_attn_cp16(dk + r * {SROW} + ch * 16, src);
        ninfer_attn_cp16(dv + r * {SROW} + ch * 16, src + vofs);
      }}
      ninfer_attn_cp_commit();
    }};"""
