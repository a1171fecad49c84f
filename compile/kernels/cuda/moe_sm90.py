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
it). 16-bit weights only; NVFP4 experts keep the mma.sync path.
"""
from __future__ import annotations

from tvm.script import tirx as T

from . import gemm_sm90

TILE_ROWS = gemm_sm90.BM


def grouped_source(name: str, K: int, O: int, n_slots: int, pairs: int, dtype: str, silu: bool, *, bn: int,
                   stages: int) -> str:
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
  const {ct}* __restrict__ wb = w + (long long)e * {O * K};"""
    rows = {"params": "const int* __restrict__ order, const int* __restrict__ route, ", "tile": tile,
            "a_row": f"order[s0 + r] / {P}" if silu else "s0 + r", "out_row": "s0 + r" if silu else "order[s0 + r]"}
    return gemm_sm90.kernel_source(name, K, O, dtype, dtype, "silu_mul" if silu else "none", bn=bn, stages=stages,
                                   group_m=1, rows=rows)


def applies(K: int, O: int, dtype: str, silu: bool, bn: int, stages: int) -> bool:
    return (gemm_sm90.supported(K, O, dtype, dtype, "silu_mul" if silu else "none") and bn in (128, 256)
            and 3 <= stages <= 8 and gemm_sm90.smem_bytes(bn, stages) <= 227 * 1024)


def grouped_launch(name: str, K: int, O: int, n_slots: int, pairs: int, dtype: str, silu: bool, *, bn: int,
                   stages: int):
    """The launch macro (npairs, x, order, route, w, out) of the grouped wgmma kernel."""
    src = grouped_source(name, K, O, n_slots, pairs, dtype, silu, bn=bn, stages=stages)
    SMEM = gemm_sm90.smem_bytes(bn, stages)
    OO = O // 2 if silu else O
    cols = bn // 2 if silu else bn
    n_tiles = (OO + cols - 1) // cols
    Ex = n_slots

    @T.macro
    def launch(npairs, x, order, route, w, out):
        for b in T.thread_binding(((npairs + TILE_ROWS - 1) // TILE_ROWS + T.min(Ex, npairs)) * n_tiles,
                                  thread="blockIdx.x"):
            for tx in T.thread_binding(gemm_sm90.THREADS, thread="threadIdx.x"):
                with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1):
                    smem = T.alloc_buffer((SMEM,), "uint8", scope="shared.dyn")
                    T.evaluate(T.cuda.func_call(
                        name, T.address_of(x[0, 0]), T.address_of(w[0, 0, 0]), T.address_of(x[0, 0]),
                        T.address_of(out[0, 0]), T.Cast("int32", npairs), T.address_of(order[0]),
                        T.address_of(route[0]), smem.access_ptr("rw"), source_code=src))

    return launch
