"""The grouped expert GEMMs on the Hopper tensor cores (sm_90a): gemm_sm90.py's cp.async + wgmma tile, one
expert per row tile.

Prefill-size calls of moe_gate_up / moe_down (compile/kernels/cuda/moe.py) with many pairs per expert run this
launch instead of the mma.sync passes (which re-read each weight tile once per 8 * big_tiles pairs): block b takes
row tile b / N_TILES of the concatenated per-expert row tiles (TILE_ROWS = 128 pairs each, listed by moe_route in
route[2Ex+2 ..]: a binary search over the selected experts finds the expert and the tile's first pair) and column
tile b % N_TILES; blocks past the last tile exit. A rows are gathered (gate_up: x row order[s0 + r] / P) or the
group's contiguous h rows (down); B is the expert's weight rows; the epilogue is gemm_sm90's (silu_mul for
gate_up) storing row s0 + r (h, sorted order) or order[s0 + r] (y, the pair's row). Launch grid: an upper bound
of the tile count, ceil(n*P / 128) + min(Ex, n*P), times N_TILES (no host synchronisation: CUDA graphs capture
it).

NVFP4 experts (bf16 activations) run the same tile with the B operand dequantized once per tile into the
bf16 shared ring, where the 16-bit path copies it with cp.async: each thread owns the same 8 B chunks of 8
weights (4 bytes of E2M1 codes + their E4M3 block scale) and, when the tile of step t is issued, turns the
codes it prefetched into registers during step t-1 into bf16 (gemv.py's exact bit trick: e2m1 * e4m3 * 2^-7,
no rounding) with one 16-byte st.shared at the chunk's swizzled place, then fetches step t+1's codes; the
fence.proxy.async + barrier before each wgmma makes those stores visible to it. After the K loop each
accumulator column is scaled by its weight row's weight_scale_2 * 2^7: the numbers of the mma.sync NVFP4 path
(fp32 sums of x * (e2m1 * e4m3) products, the row scale in the epilogue). The weights are read once per tile at
0.56 bytes each instead of once per 8 * big_tiles pairs with a dequantization per pass.
"""
from __future__ import annotations

from tvm.script import tirx as T

from . import gemm_sm90

TILE_ROWS = gemm_sm90.BM
NVFP4_SHIFT = 7  # gemv.NVFP4_SHIFT: the dequantized B words are e2m1 * e4m3 * 2^-7


def _swap(src: str, old: str, new: str) -> str:
    """Replace the one occurrence of `old` in gemm_sm90's generated tile (a changed template fails loudly)."""
    if src.count(old) != 1:
        raise RuntimeError(f"moe_sm90: gemm_sm90.kernel_source changed, {old.strip()[:60]!r} found "
                           f"{src.count(old)} times")
    return src.replace(old, new)


def _brow(O: int, bn: int, silu: bool, rr: str) -> tuple[str, str]:
    """(weight row, row exists) of B-tile row `rr` (gemm_sm90.kernel_source's mapping: silu tiles hold bn/2 gate
    rows, then their up rows)."""
    OO = O // 2 if silu else O
    if silu:
        return f"({rr} < {bn // 2} ? n0 + {rr} : {OO} + n0 + {rr} - {bn // 2})", f"(n0 + ({rr} & {bn // 2 - 1}) < {OO})"
    return f"(n0 + {rr})", f"(n0 + {rr} < {O})"


def _nvfp4_tile(src: str, name: str, K: int, O: int, bn: int, stages: int, silu: bool) -> str:
    """gemm_sm90's tile with the B operand dequantized from NVFP4 into the shared ring (module docstring)."""
    bk = gemm_sm90.BK
    kt = (K + bk - 1) // bk
    nb = bn * 8 // gemm_sm90.THREADS  # 8-weight chunks per thread per step
    acc = bn // 2
    row, _ = _brow(O, bn, silu, "((tid >> 3) + 32 * j)")
    arow, aok = _brow(O, bn, silu, "rr")
    kcheck = f" && k + kc < {K}" if K % bk else ""
    fetch = f"""  // NVFP4 B: codes + block scale of this thread's chunks (B rows tid / 8 + 32 j, elements kc .. kc + 7)
  const unsigned char* __restrict__ wqe = fq + (long long)e * {O * K // 2};
  const unsigned char* __restrict__ wse = fs + (long long)e * {O * K // 16};
  unsigned bq[{nb}], bs[{nb}];
  auto bfetch = [&](int t) {{
    if (t < {kt}) {{
      const int k = t * {bk};
#pragma unroll
      for (int j = 0; j < {nb}; ++j) {{
        const bool ok = bok[j]{kcheck};
        const long long r = ok ? {row} : 0;
        bq[j] = ok ? *(const unsigned*)(wqe + r * {K // 2} + (k + kc) / 2) : 0u;
        bs[j] = ok ? (unsigned)wse[r * {K // 16} + (k + kc) / 16] : 0u;
      }}
    }}
  }};
  auto load = [&](int t) {{"""
    store = f"""      for (int j = 0; j < {nb}; ++j) {{  // (after the template's #pragma unroll)
        unsigned d[4];
        ninfer_moe_nvfp4_dq8(d, bq[j], bs[j]);
        asm volatile("st.shared.v4.u32 [%0], {{%1, %2, %3, %4}};\\n"
                     :: "r"(sb + j * 4096), "r"(d[0]), "r"(d[1]), "r"(d[2]), "r"(d[3]) : "memory");
      }}
      bfetch(t + 1);"""
    scale = f"""
  {{  // accumulator column (B-tile row) rr times its weight row's weight_scale_2 * 2^{NVFP4_SHIFT}
    const float* __restrict__ ge = fg + (long long)e * {O};
#pragma unroll
    for (int a = 0; a < {acc}; ++a) {{
      const int rr = 8 * (a >> 2) + 2 * (lane & 3) + (a & 1);
      acc[a] *= {aok} ? ge[{arow}] * {float(2 ** NVFP4_SHIFT)!r}f : 0.f;
    }}
  }}"""
    bcopy = (f"      for (int j = 0; j < {nb}; ++j) {name}_cp16(sb + j * 4096, bptr[j] + k, "
             f"bok[j]{kcheck});")
    src = _swap(src, "  auto load = [&](int t) {", fetch)
    src = _swap(src, bcopy, store)
    src = _swap(src, f"  float acc[{acc}];\n", f"  bfetch(0);\n  float acc[{acc}];\n")
    src = _swap(src, '  asm volatile("cp.async.wait_group 0;\\n" ::);\n',
                '  asm volatile("cp.async.wait_group 0;\\n" ::);\n' + scale + "\n")
    return src


def grouped_source(name: str, K: int, O: int, n_slots: int, pairs: int, dtype: str, silu: bool, *, bn: int,
                   stages: int, nvfp4: bool = False) -> str:
    Ex, P = n_slots, pairs
    OO = O // 2 if silu else O
    cols = bn // 2 if silu else bn
    n_tiles = (OO + cols - 1) // cols
    ct = gemm_sm90._CT[dtype]
    tile = f"""  // row tile of expert u (route[{2 * Ex + 2} + u] tiles come before it), column tile tn
  const int U = route[{Ex + 1}];
  const int tm = blockIdx.x / {n_tiles}, tn = blockIdx.x % {n_tiles};
  if (tm >= route[{2 * Ex + 2} + U]) return;  // the whole block: past the last tile
  int lo = 0, hi = U - 1;
  while (lo < hi) {{
    const int mid = (lo + hi + 1) >> 1;
    if (route[{2 * Ex + 2} + mid] <= tm) lo = mid; else hi = mid - 1;
  }}
  const int e = route[{Ex + 2} + lo], s0 = route[e], nrows = route[e + 1] - s0;
  const int m0 = (tm - route[{2 * Ex + 2} + lo]) * {TILE_ROWS}, n0 = tn * {cols};
  const {ct}* __restrict__ wb = {"(const " + ct + "*)fq" if nvfp4 else f"w + (long long)e * {O * K}"};"""
    params = "const int* __restrict__ order, const int* __restrict__ route, "
    if nvfp4:
        params += "const unsigned char* __restrict__ fs, const float* __restrict__ fg, "  # block, row scales
    rows = {"params": params, "tile": tile,
            "a_row": f"order[s0 + r] / {P}" if silu else "s0 + r", "out_row": "s0 + r" if silu else "order[s0 + r]"}
    src = gemm_sm90.kernel_source(name, K, O, dtype, dtype, "silu_mul" if silu else "none", bn=bn, stages=stages,
                                  group_m=1, rows=rows)
    if not nvfp4:
        return src
    src = _swap(src, f"const {ct}* __restrict__ w,", "const unsigned char* __restrict__ fq,")  # the codes
    return _nvfp4_tile(src, name, K, O, bn, stages, silu)


def applies(K: int, O: int, dtype: str, silu: bool, bn: int, stages: int, nvfp4: bool = False) -> bool:
    if nvfp4 and (dtype != "bfloat16" or K % 16):
        return False
    return (gemm_sm90.supported(K, O, dtype, dtype, "silu_mul" if silu else "none") and bn in (128, 256)
            and 3 <= stages <= 8 and gemm_sm90.smem_bytes(bn, stages) <= 227 * 1024)


def grouped_launch(name: str, K: int, O: int, n_slots: int, pairs: int, dtype: str, silu: bool, *, bn: int,
                   stages: int, nvfp4: bool = False, helpers: str = ""):
    """The launch macro (npairs, x, order, route, wptrs, out) of the grouped wgmma kernel; wptrs: the weight
    buffers' addresses (one array, or NVFP4's codes / block scales / row scales). helpers: device functions the
    NVFP4 tile calls (moe.py's ninfer_moe_nvfp4_dq8 and its bf16x2 multiply)."""
    src = helpers + grouped_source(name, K, O, n_slots, pairs, dtype, silu, bn=bn, stages=stages, nvfp4=nvfp4)
    SMEM = gemm_sm90.smem_bytes(bn, stages)
    OO = O // 2 if silu else O
    cols = bn // 2 if silu else bn
    n_tiles = (OO + cols - 1) // cols
    Ex = n_slots

    @T.macro
    def launch(npairs, x, order, route, wptrs, out):
        for b in T.thread_binding(((npairs + TILE_ROWS - 1) // TILE_ROWS + T.min(Ex, npairs)) * n_tiles,
                                  thread="blockIdx.x"):
            for tx in T.thread_binding(gemm_sm90.THREADS, thread="threadIdx.x"):
                with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1):
                    smem = T.alloc_buffer((SMEM,), "uint8", scope="shared.dyn")
                    T.evaluate(T.cuda.func_call(
                        name, T.address_of(x[0, 0]), wptrs[0], T.address_of(x[0, 0]), T.address_of(out[0, 0]),
                        T.Cast("int32", npairs), T.address_of(order[0]), T.address_of(route[0]), *wptrs[1:],
                        smem.access_ptr("rw"), source_code=src))

    return launch
