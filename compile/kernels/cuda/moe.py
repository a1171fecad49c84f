"""CUDA mixture-of-experts kernels: router top-k, pairs grouped by expert, grouped expert GEMMs, combine.

compile/moe.py composes them (the llvm set instead runs compile/kernels/moe.py's per-token experts kernel; the
numerics contract is that file's). A token t has P (expert, weight) pairs p = t * P + j (the top-k, plus the
shared expert when it is folded into the expert arrays):

  moe_route(logits[n, E+1] f32) -> ids[n, K+1] i32, w[n, K+1] f32, order[n*P] i32, route[route_len(Ex, C)] i32
      up to ROUTE_FUSED_MAX tokens one block (one launch), else a top-k launch then an align launch (which also
      zeroes the C tickets after the grouping that moe_down_combine counts on):
    top-k: one warp per token: softmax over the E logits (fp32, IEEE divisions), K rounds of a warp argmax
      (larger p, then lower index), renormalised when `norm`; column K = (E, sigmoid(logits[E])).
    align: one block: pairs counted per expert (shared atomics), scanned, scattered; order = pair ids grouped by
      expert, route[e] .. route[e+1] = expert e's range in order (route[Ex] = n*P), route[Ex+1] = U, the number
      of experts with pairs, route[Ex+2 .. Ex+2+U) = those experts ascending, route[2Ex+2 + u] = row tiles of
      TILE_ROWS pairs before the u-th of them (u = 0 .. U: the last is the total; the sm_90 wgmma launch maps its
      blocks through it, compile/kernels/cuda/moe_sm90.py). Order inside a group is free: every pair's result is
      computed alone (a GEMM row / column), so it does not change the numbers.
  moe_gate_up(x[n, D], order, route, gate_up[Ex, 2I, D]...) -> h[n*P, I]
      h[s] = round(silu(round(g)) * round(u)) for the pair at position s of order (x row order[s] / P).
  moe_down(h, order, route, down[Ex, D, I]...) -> y[n*P, D]
      y[order[s]] = round(down[e] @ h[s]) (the pair's row; weighting is left to the combine).
  moe_combine(y, w[, res][, shared]) -> out[n, D]
      out[t] = round(res[t] + sum_j w[t, j] * y[t*P + j] (+ w[t, K] * shared[t])), fp32 sums in j order.
  moe_down_combine(h, order, route, down..., w, res, shared) -> y (scratch), out: the two above in one launch for
      decode-size calls (the last block of each row tile combines its rows: a ticket per tile in route; what
      compile/moe.py runs), the wgmma / FMA passes then the combine launch otherwise: the same numbers.

The expert GEMMs launch grid (row tiles, min(Ex, n*P)): block (tile, u) takes the u-th selected expert (blocks
past U exit), so decode reads only the weights of the experts its batch selected, each once, whatever the
batch. Inside, the decode GEMV's tensor-core scheme (compile/kernels/cuda/gemv.py): a warp owns 16 weight rows
(gate_up: 8 gate rows and their 8 up rows, so silu_mul pairs them in one thread) as the A operand of
mma.sync m16n8k16 and 8 of the expert's pairs as B (x rows gathered through order), warps split K, 16-byte
loads of weights (past L1) and x in the same permuted K order (no shuffles); groups of more than 8 pairs run
passes of 8 * big_tiles columns (calls of at most DECODE_TOKENS tokens, whose groups hold at most 8 pairs, launch a
kernel of the 8-pair passes alone, with __launch_bounds__ that keep a one-token grid resident at once and let ptxas
issue a pass's loads before its mma chain: decode_launch; without them it interleaved loads and mma.sync, one
latency per K step). Both pass widths
split K the same way (one unroll), so a pair's sums do not
depend on where in its group the align step's atomics put it: the results are deterministic (CUDA graph replays
equal eager calls bit for bit). NVFP4 weights (bf16 activations, K % 32 == 0): the same tiles with gemv.py's
in-register dequantization (32 codes + 2 block scales per lane per step -> bf16 A words, x re-paired by
byte_perm, row scale * 2^7 in the epilogue; all codes and scales of a pass's steps are loaded, branch-free, before
the dequantization). Other dtypes / shapes (f32 models, K % 8 != 0): an FMA path, one
thread per (row, column) of a pass.

The device code is CUDA text inside `// NINFER_ATTN_SRC_BEGIN/END` (the inline-asm helpers inside
`// NINFER_ATTN_DEV_BEGIN/END`, include-guarded), so the CPU emulator (compile/kernels/cuda/emulate) runs it
(tests/test_cuda_moe.py). Parameters: schedules/cuda_<arch>.json "kernels.moe" (registry.DEFAULT_KERNELS).
"""
from __future__ import annotations

from functools import lru_cache
from types import SimpleNamespace

from tvm.script import tirx as T

from . import attention, moe_sm90
from . import gemv as gemv_kernels

_CT = {"bfloat16": "nv_bfloat16", "float16": "half", "float32": "float"}
_MMA_T = {"bfloat16": "bf16", "float16": "f16"}
TOPK_WARPS = 4  # tokens per top-k block
COMBINE_THREADS = 256


def _dev(name: str, body: str) -> str:
    """An inline-asm helper: emulated by the CPU emulator's prelude (emulate/prelude.py MOE), include-guarded
    here (several kernels of one module carry it)."""
    g = name.upper() + "_DEFINED"
    return f"\n// NINFER_ATTN_DEV_BEGIN\n#ifndef {g}\n#define {g}\n{body.strip()}\n#endif\n// NINFER_ATTN_DEV_END\n"


def _src(name: str, body: str) -> str:
    """Device code the CPU emulator compiles as it is (guarded like _dev)."""
    g = name.upper() + "_DEFINED"
    return (f"\n// NINFER_ATTN_SRC_BEGIN\n#ifndef {g}\n#define {g}\n{body.strip()}\n#endif\n"
            "// NINFER_ATTN_SRC_END\n")


def _mma_helper(t: str) -> str:
    """attention.py's mma.sync m16n8k16 helper under this file's name, guarded."""
    body = attention._MMA_SRC["bfloat16" if t == "bf16" else "float16"][1]
    body = body.split("// NINFER_ATTN_DEV_BEGIN\n")[1].split("\n// NINFER_ATTN_DEV_END")[0]
    return _dev(f"ninfer_moe_mma_{t}", body.replace("ninfer_attn_mma_", "ninfer_moe_mma_"))


# 16 bytes of weights through the read-only path past L1 (x is re-read by every tile: cached loads)
_LDW = _dev("ninfer_moe_ldw", """
__device__ __forceinline__ uint4 ninfer_moe_ldw(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
  return r;
}""")
# loads past L1 (rows written by other blocks of the same launch) and the fence before a grid-wide ticket
_LDCG = _dev("ninfer_moe_ldcg", """
template <class T> __device__ __forceinline__ T ninfer_moe_ldcg(const T* p) { return __ldcg(p); }
__device__ __forceinline__ void ninfer_moe_fence() { __threadfence(); }""")
_ATOMIC = _dev("ninfer_moe_atomic_add", """
__device__ __forceinline__ int ninfer_moe_atomic_add(int* p, int v) { return atomicAdd(p, v); }""")
# gemv.py's NVFP4 register dequantization under this file's names (TVM emits one source per called function:
# the dense GEMV's copy is not guarded)
_BF16X2 = _dev("ninfer_moe_bf16x2_mul", gemv_kernels._BF16X2_MUL_SRC.replace("ninfer_bf16x2_mul",
                                                                            "ninfer_moe_bf16x2_mul"))
# 8 E2M1 codes (one word: element i in nibble i, dequant.py's order) and their E4M3 block scale -> 4 bf16x2 words
# in natural order (elements 2m, 2m + 1 in word m) = e2m1 * e4m3 * 2^-7, exact: _DQ32's bit trick for one B chunk
# of the sm_90 wgmma tile (moe_sm90.py), whose K order is the activations' own
_DQ8 = _src("ninfer_moe_nvfp4_dq8", """
__device__ __forceinline__ void ninfer_moe_nvfp4_dq8(unsigned* d, unsigned codes, unsigned sc) {
  unsigned s = ((sc << 4) & 0x7F0u) | ((sc << 20) & 0x7F00000u);  // s * 2^-120 in both halves
  s = ninfer_moe_bf16x2_mul(ninfer_moe_bf16x2_mul(s, 0x7B807B80u), 0x7B007B00u);  // s * 2^119
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const unsigned b = (codes >> (8 * m)) & 0xFFu;  // nibbles 2m, 2m + 1 -> bits 0..3, 16..19 -> e2m1 * 2^-126
    d[m] = ninfer_moe_bf16x2_mul((((b & 0xFu) | ((b & 0xF0u) << 12)) * 0x1040u) & 0x81C081C0u, s);
  }
}""")
_DQ32 = _src("ninfer_moe_nvfp4_dq32", gemv_kernels._NVFP4_DQ_BODY.replace("ninfer_nvfp4_dq32", "ninfer_moe_nvfp4_dq32")
             .replace("ninfer_bf16x2_mul", "ninfer_moe_bf16x2_mul"))


def _opaque(func, name: str):
    """The kernel under its symbol, marked opaque: its body is one call into CUDA text, which relax's pattern
    analysis would take for an elementwise op (and fuse with its neighbours)."""
    return func.with_attr("global_symbol", name[len("ninfer_"):]).with_attr("op_pattern", 8)


def _c(v: float) -> str:
    return repr(float(v)) + "f"


# ---------------------------------------------------------------------------------------------
# router top-k
def topk_source(name: str, E: int, K: int, norm: bool) -> str:
    EPL = (E + 31) // 32
    return _src(name, f"""
// token t by one warp: softmax over {E} router logits, top-{K} (larger p, then lower index), column {K}: shared gate;
// sids (or nullptr): a copy of the ids row in the block's shared memory (the fused route's grouping reads it there)
__device__ __forceinline__ void {name}_token(const float* __restrict__ logits, int* __restrict__ ids,
                                             float* __restrict__ w, const int t, const int lane, int* sids) {{
  const float* l = logits + (long long)t * {E + 1};
  float p[{EPL}];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < {EPL}; ++i) {{
    const int e = lane + 32 * i;
    p[i] = e < {E} ? l[e] : -INFINITY;
    m = fmaxf(m, p[i]);
  }}
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < {EPL}; ++i) {{
    p[i] = lane + 32 * i < {E} ? expf(p[i] - m) : 0.f;
    s += p[i];
  }}
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
#pragma unroll
  for (int i = 0; i < {EPL}; ++i) p[i] = __fdiv_rn(p[i], s);
  float sel = 0.f;
  for (int j = 0; j < {K}; ++j) {{
    float bv = -2.f;
    int bi = {E};
#pragma unroll
    for (int i = 0; i < {EPL}; ++i)
      if (lane + 32 * i < {E} && p[i] > bv) {{ bv = p[i]; bi = lane + 32 * i; }}
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {{
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (ov > bv || (ov == bv && oi < bi)) {{ bv = ov; bi = oi; }}
    }}
#pragma unroll
    for (int i = 0; i < {EPL}; ++i)
      if (lane + 32 * i == bi) p[i] = -1.f;  // taken
    if (lane == 0) {{
      ids[t * {K + 1} + j] = bi;
      w[t * {K + 1} + j] = bv;
      if (sids) sids[t * {K + 1} + j] = bi;
    }}
    sel += bv;
  }}
  if (lane == 0) {{
    {f"for (int j = 0; j < {K}; ++j) w[t * {K + 1} + j] = __fdiv_rn(w[t * {K + 1} + j], sel);" if norm else ""}
    ids[t * {K + 1} + {K}] = {E};
    if (sids) sids[t * {K + 1} + {K}] = {E};
    w[t * {K + 1} + {K}] = __fdiv_rn(1.f, 1.f + expf(-l[{E}]));
  }}
}}

__device__ __forceinline__ void {name}(const float* __restrict__ logits, int* __restrict__ ids,
                                       float* __restrict__ w, int n) {{
  const int t = blockIdx.x * {TOPK_WARPS} + (threadIdx.x >> 5);
  if (t < n) {name}_token(logits, ids, w, t, threadIdx.x & 31, nullptr);  // the whole warp
}}""")


# ---------------------------------------------------------------------------------------------
# pairs grouped by expert
from .moe_sm90 import TILE_ROWS  # noqa: E402 - pairs per row tile of the sm_90 wgmma launch


def route_len(slots: int, counters: int = 0) -> int:
    """int32 entries of moe_route's route buffer: the grouping (3 * slots + 3), then `counters` zeroed tickets of
    the fused down + combine (moe_down_combine: one per row tile of the down GEMM)."""
    return 3 * slots + 3 + counters


def align_threads(slots: int) -> int:
    nt = 128
    while nt < slots:
        nt *= 2
    return nt


def align_source(name: str, Ex: int, K: int, P: int, counters: int = 0) -> str:
    NT = align_threads(Ex)
    zero = (f"\n  for (int i = tid; i < {counters}; i += {NT}) route[{route_len(Ex)} + i] = 0;  // down + combine tickets"
            if counters else "")
    return _src(name, f"""
// one block of {NT}: pair p = t * {P} + j of expert ids[t, j]; counting sort by expert ({Ex} slots)
__device__ __forceinline__ void {name}(const int* __restrict__ ids, int* __restrict__ order, int* __restrict__ route,
                                       int n) {{
  __shared__ int cnt[{Ex}];
  __shared__ int cur[{Ex}];
  __shared__ int sa[{NT // 32}];
  __shared__ int sb[{NT // 32}];
  __shared__ int sc[{NT // 32}];
  const int tid = threadIdx.x, lane = tid & 31, wid = tid >> 5, np = n * {P};
  for (int e = tid; e < {Ex}; e += {NT}) cnt[e] = 0;
  __syncthreads();
  for (int q = tid; q < np; q += {NT}) ninfer_moe_atomic_add(&cnt[ids[q / {P} * {K + 1} + q % {P}]], 1);
  __syncthreads();
  const int v = tid < {Ex} ? cnt[tid] : 0, vt = (v + {TILE_ROWS - 1}) / {TILE_ROWS};
  // inclusive scans of the counts, the used flags and the row tiles: within each warp by shuffles, then the totals
  // of the warps before it (one barrier instead of two per doubling step)
  int a = v, b = v > 0, c = vt;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {{
    const int ta = __shfl_sync(0xffffffffu, a, lane - d), tb = __shfl_sync(0xffffffffu, b, lane - d),
              tc = __shfl_sync(0xffffffffu, c, lane - d);
    if (lane >= d) {{ a += ta; b += tb; c += tc; }}
  }}
  if (lane == 31) {{ sa[wid] = a; sb[wid] = b; sc[wid] = c; }}
  __syncthreads();
  for (int i = 0; i < wid; ++i) {{ a += sa[i]; b += sb[i]; c += sc[i]; }}
  if (tid < {Ex}) {{
    route[tid] = a - v;
    cur[tid] = a - v;
    if (v > 0) {{
      route[{Ex + 2} + b - 1] = tid;
      route[{2 * Ex + 2} + b - 1] = c - vt;
    }}
  }}
  if (tid == {Ex - 1}) {{ route[{Ex}] = a; route[{Ex + 1}] = b; route[{2 * Ex + 2} + b] = c; }}
  __syncthreads();
  for (int q = tid; q < np; q += {NT}) order[ninfer_moe_atomic_add(&cur[ids[q / {P} * {K + 1} + q % {P}]], 1)] = q;{zero}
}}""")


ROUTE_FUSED_MAX = 64  # tokens up to which moe_route is one block (decode, verify rows)


@lru_cache(maxsize=None)
def moe_route(n_experts: int, top_k: int, norm: bool, n_slots: int, pairs: int, counters: int = 0):
    """Router top-k then the pairs grouped by expert: logits -> ids, w, order, route. Up to ROUTE_FUSED_MAX tokens one
    block does both (its warps take the tokens' top-k, a barrier, then the counting sort: one launch per decode
    layer instead of two); more tokens launch the two kernels. counters: zeroed tickets after the grouping
    (route_len)."""
    E, K, Ex, P, C = int(n_experts), int(top_k), int(n_slots), int(pairs), int(counters)
    if Ex > 1024:
        return None
    tname = f"ninfer_moe_topk_e{E}_k{K}_{'n' if norm else 'r'}"
    aname = f"ninfer_moe_align_s{Ex}_k{K}_p{P}" + (f"_c{C}" if C else "")
    name = f"ninfer_moe_route_e{E}_k{K}_{'n' if norm else 'r'}_s{Ex}_p{P}" + (f"_c{C}" if C else "")
    NT = align_threads(Ex)
    tsrc = topk_source(tname, E, K, bool(norm))
    asrc = _ATOMIC + align_source(aname, Ex, K, P, C)
    src = tsrc + asrc + _src(name, f"""
__device__ __forceinline__ void {name}(const float* __restrict__ logits, int* __restrict__ ids, float* __restrict__ w,
                                       int* __restrict__ order, int* __restrict__ route, int n) {{
  __shared__ int sids[{ROUTE_FUSED_MAX * (K + 1)}];
  for (int t = threadIdx.x >> 5; t < n; t += {NT // 32}) {tname}_token(logits, ids, w, t, threadIdx.x & 31, sids);
  __syncthreads();
  {aname}(sids, order, route, n);  // the ids from shared memory (no round trip through L2)
}}""")

    # one input: relax's reshape-pattern check (RewriteDataflowReshape) needs a root block
    @T.prim_func(s_tir=True)
    def route_f(var_logits: T.handle, var_ids: T.handle, var_w: T.handle, var_order: T.handle, var_route: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        logits = T.match_buffer(var_logits, (n, E + 1), "float32")
        ids = T.match_buffer(var_ids, (n, K + 1), "int32")
        w = T.match_buffer(var_w, (n, K + 1), "float32")
        order = T.match_buffer(var_order, (n * P,), "int32")
        route = T.match_buffer(var_route, (route_len(Ex, C),), "int32")
        with T.sblock("root"):
            if n <= ROUTE_FUSED_MAX:
                for b in T.thread_binding(1, thread="blockIdx.x"):
                    for tx in T.thread_binding(NT, thread="threadIdx.x"):
                        T.evaluate(T.cuda.func_call(name, T.address_of(logits[0, 0]), T.address_of(ids[0, 0]),
                                                    T.address_of(w[0, 0]), T.address_of(order[0]),
                                                    T.address_of(route[0]), T.Cast("int32", n), source_code=src))
            else:
                for b in T.thread_binding((n + TOPK_WARPS - 1) // TOPK_WARPS, thread="blockIdx.x"):
                    for tx in T.thread_binding(32 * TOPK_WARPS, thread="threadIdx.x"):
                        T.evaluate(T.cuda.func_call(tname, T.address_of(logits[0, 0]), T.address_of(ids[0, 0]),
                                                    T.address_of(w[0, 0]), T.Cast("int32", n), source_code=tsrc))
                for b in T.thread_binding(1, thread="blockIdx.x"):
                    for tx in T.thread_binding(NT, thread="threadIdx.x"):
                        T.evaluate(T.cuda.func_call(aname, T.address_of(ids[0, 0]), T.address_of(order[0]),
                                                    T.address_of(route[0]), T.Cast("int32", n), source_code=asrc))

    return _opaque(route_f, name)


# ---------------------------------------------------------------------------------------------
# grouped expert GEMMs
_NVFP4_ELEM = _src("ninfer_moe_nvfp4_elem", """
// one NVFP4 weight element exactly as compile/kernels/dequant.py computes it (the FMA path)
__device__ __forceinline__ float ninfer_moe_nvfp4_elem(const unsigned char* codes, const unsigned char* scales,
                                                       float g, int k) {
  const unsigned c = (codes[k >> 1] >> ((k & 1) * 4)) & 15u, b = scales[k >> 4];
  const unsigned mag = c & 7u, ex = mag >> 1;
  const float half = (float)(mag & 1u) * 0.5f;
  float v = ex == 0u ? half : (1.f + half) * (ex == 1u ? 1.f : (ex == 2u ? 2.f : 4.f));
  if (c & 8u) v = -v;
  const unsigned se = (b >> 3) & 15u, sm = b & 7u;
  const float s = se == 0u ? (float)sm * 0.001953125f : ldexpf(1.f + (float)sm * 0.125f, (int)se - 7);
  return v * s * g;
}""")


def gemm_path(K: int, dtype: str, nvfp4: bool) -> str:
    """"mma" (16-bit weights, K % 8 == 0), "nvfp4" (bf16 activations, K % 32 == 0) or "fma"."""
    if nvfp4:
        return "nvfp4" if dtype == "bfloat16" and K % 32 == 0 else "fma"
    return "mma" if dtype in _MMA_T and K % 8 == 0 else "fma"


def gemm_tiles(O: int, silu: bool, path: str) -> int:
    OO = O // 2 if silu else O
    if path == "fma":
        return (OO + 31) // 32
    return (OO + 7) // 8 if silu else (O + 15) // 16


def gemm_threads(path: str, warps: int) -> int:
    return 256 if path == "fma" else 32 * warps


def _weight_decl(ct: str, nvfp4: bool) -> str:
    if nvfp4:
        return "const unsigned char* __restrict__ wq, const unsigned char* __restrict__ wsc, const float* __restrict__ wg"
    return f"const {ct}* __restrict__ w"


def _mma_pass(name: str, K: int, O: int, P: int, dtype: str, silu: bool, nvfp4: bool, warps: int,
              big_tiles: int, unroll: int) -> str:
    """template <NB batch tiles, UU K steps loaded at a time> one pass of up to 8 * NB pairs of expert e."""
    U = unroll
    OO = O // 2 if silu else O
    ct, t = _CT[dtype], _MMA_T[dtype]
    NW, NBT = warps, big_tiles
    STEP = 128 if nvfp4 else 32  # K elements per warp per step (4 lanes x 32 codes / x 8 elements)
    xrow = f"order[s0 + col] / {P}" if silu else "s0 + col"
    kok = "k0 < " + str(K)
    if silu:
        rows = (f"const int row_lo = tile * 8 + g, row_hi = {OO} + tile * 8 + g;\n"
                f"  const bool lo_ok = tile * 8 + g < {OO}, hi_ok = lo_ok;")
    else:
        rows = (f"const int row_lo = tile * 16 + g, row_hi = tile * 16 + 8 + g;\n"
                f"  const bool lo_ok = row_lo < {O}, hi_ok = row_hi < {O};")
    if nvfp4:
        gm = _c(2.0 ** gemv_kernels.NVFP4_SHIFT)
        wsetup = f"""
  const unsigned char* wlo = wq + ((long long)e * {O} + (lo_ok ? row_lo : 0)) * {K // 2};
  const unsigned char* whi = wq + ((long long)e * {O} + (hi_ok ? row_hi : 0)) * {K // 2};
  const unsigned short* slo = (const unsigned short*)(wsc + ((long long)e * {O} + (lo_ok ? row_lo : 0)) * {K // 16});
  const unsigned short* shi = (const unsigned short*)(wsc + ((long long)e * {O} + (hi_ok ? row_hi : 0)) * {K // 16});
  const float* ge = wg + (long long)e * {O};"""
        # every code / scale load of the UU steps first (no branches: predicated selects), then dequantization
        # and the mma chain: the warp's weight bytes of a chunk are in flight at once (SASS: S W ... then the math)
        body = f"""
    uint4 cl[UU], ch[UU];
    unsigned sl[UU], sh[UU];
#pragma unroll
    for (int uu = 0; uu < UU; ++uu) {{
      const int k0 = (it * {U} + sub + uu) * {STEP} + q * 32;  // 32 codes of rows lo / hi and their 2 block scales
      const bool kok = {kok};
      cl[uu] = kok && lo_ok ? ninfer_moe_ldw(wlo + k0 / 2) : make_uint4(0u, 0u, 0u, 0u);
      ch[uu] = kok && hi_ok ? ninfer_moe_ldw(whi + k0 / 2) : make_uint4(0u, 0u, 0u, 0u);
      // scale words at a clamped (always valid) index, then masked: loads without a branch around them
      const unsigned vl = slo[kok ? k0 / 32 : 0], vh = shi[kok ? k0 / 32 : 0];
      sl[uu] = kok && lo_ok ? vl : 0u;
      sh[uu] = kok && hi_ok ? vh : 0u;
    }}
#pragma unroll
    for (int uu = 0; uu < UU; ++uu) {{
      const int k0 = (it * {U} + sub + uu) * {STEP} + q * 32;
      const bool kok = {kok};
      unsigned al[16], ah[16];
      ninfer_moe_nvfp4_dq32(al, cl[uu].x, cl[uu].y, cl[uu].z, cl[uu].w, sl[uu]);
      ninfer_moe_nvfp4_dq32(ah, ch[uu].x, ch[uu].y, ch[uu].z, ch[uu].w, sh[uu]);
#pragma unroll
      for (int bt = 0; bt < NB; ++bt) {{
        unsigned xr[16], xq[16];
#pragma unroll
        for (int v4 = 0; v4 < 4; ++v4) {{  // xp[bt] is a valid row: a clamped load, then masked (no branch)
          const uint4 xl = *(const uint4*)(xp[bt] + (kok ? k0 : 0) + 8 * v4);
          const uint4 xv = kok && xok[bt] ? xl : make_uint4(0u, 0u, 0u, 0u);
          xr[4 * v4] = xv.x; xr[4 * v4 + 1] = xv.y; xr[4 * v4 + 2] = xv.z; xr[4 * v4 + 3] = xv.w;
        }}
#pragma unroll
        for (int m = 0; m < 4; ++m)  // x pairs in the weights' K order: pair 4m+i = (x[8m+i], x[8m+i+4])
#pragma unroll
          for (int ih = 0; ih < 2; ++ih) {{
            xq[m * 4 + ih * 2] = __byte_perm(xr[m * 4 + ih], xr[m * 4 + 2 + ih], 0x5410u);
            xq[m * 4 + ih * 2 + 1] = __byte_perm(xr[m * 4 + ih], xr[m * 4 + 2 + ih], 0x7632u);
          }}
#pragma unroll
        for (int j = 0; j < 8; ++j)
          ninfer_moe_mma_{t}(acc[bt], al[2 * j], ah[2 * j], al[2 * j + 1], ah[2 * j + 1], xq[2 * j], xq[2 * j + 1]);
      }}
    }}"""
        gate_s, up_s, plain_s = (f" * (ge[row] * {gm})", f" * (ge[{OO} + row] * {gm})", f" * (ge[row] * {gm})")
    else:
        wsetup = f"""
  const {ct}* wlo = w + ((long long)e * {O} + (lo_ok ? row_lo : 0)) * {K};
  const {ct}* whi = w + ((long long)e * {O} + (hi_ok ? row_hi : 0)) * {K};"""
        body = f"""
    uint4 wl[UU], wh[UU], xv[NB][UU];
#pragma unroll
    for (int uu = 0; uu < UU; ++uu) {{  // 8 elements of weight rows lo / hi and of each batch tile's x row g
      const int k0 = (it * {U} + sub + uu) * {STEP} + q * 8;
      const bool kok = {kok};
      wl[uu] = kok && lo_ok ? ninfer_moe_ldw(wlo + k0) : make_uint4(0u, 0u, 0u, 0u);
      wh[uu] = kok && hi_ok ? ninfer_moe_ldw(whi + k0) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
      for (int bt = 0; bt < NB; ++bt)
        xv[bt][uu] = kok && xok[bt] ? *(const uint4*)(xp[bt] + k0) : make_uint4(0u, 0u, 0u, 0u);
    }}
#pragma unroll
    for (int uu = 0; uu < UU; ++uu)
#pragma unroll
      for (int bt = 0; bt < NB; ++bt) {{
        ninfer_moe_mma_{t}(acc[bt], wl[uu].x, wh[uu].x, wl[uu].y, wh[uu].y, xv[bt][uu].x, xv[bt][uu].y);
        ninfer_moe_mma_{t}(acc[bt], wl[uu].z, wh[uu].z, wl[uu].w, wh[uu].w, xv[bt][uu].z, xv[bt][uu].w);
      }}"""
        gate_s = up_s = plain_s = ""
    if silu:  # entry (bt, row slot r < 8, col c): gate at fragment row r, up at row r + 8
        epi = f"""
  for (int ent = tid; ent < NB * 64; ent += {32 * NW}) {{
    const int bt = ent >> 6, r = (ent >> 3) & 7, c = ent & 7, ln = r * 4 + (c >> 1);
    float gs = 0.f, us = 0.f;
    for (int ww = 0; ww < {NW}; ++ww) {{
      gs += part[((ww * {NBT} + bt) * 32 + ln) * 4 + (c & 1)];
      us += part[((ww * {NBT} + bt) * 32 + ln) * 4 + 2 + (c & 1)];
    }}
    const int col = c0 + bt * 8 + c, row = tile * 8 + r;
    if (col < cnt && row < {OO}) {{
      const float gv = (float)({ct})(gs{gate_s}), uv = (float)({ct})(us{up_s});
      out[(long long)(s0 + col) * {OO} + row] = ({ct})(gv / (1.f + expf(-gv)) * uv);
    }}
  }}"""
    else:  # entry (bt, row r < 16, col c) at fragment lane (r % 8, c / 2), register (r / 8) * 2 + c % 2
        epi = f"""
  for (int ent = tid; ent < NB * 128; ent += {32 * NW}) {{
    const int bt = ent >> 7, r = (ent >> 3) & 15, c = ent & 7, ln = (r & 7) * 4 + (c >> 1);
    float v = 0.f;
    for (int ww = 0; ww < {NW}; ++ww) v += part[((ww * {NBT} + bt) * 32 + ln) * 4 + (r >> 3) * 2 + (c & 1)];
    const int col = c0 + bt * 8 + c, row = tile * 16 + r;
    if (col < cnt && row < {O}) out[(long long)order[s0 + col] * {O} + row] = ({ct})(v{plain_s});
  }}"""
    return f"""
template <int NB, int UU>
__device__ __forceinline__ void {name}_pass(const {ct}* __restrict__ x, const int* __restrict__ order,
    {_weight_decl(ct, nvfp4)}, {ct}* __restrict__ out, const int e, const int s0, const int cnt, const int c0,
    float* part) {{
  // K chunks of {U} steps; warp w takes chunks w, w + {NW}, ..., loading UU steps at a time: every pass width splits
  // and orders the K sums the same way
  constexpr int ITS = ({K} + {STEP * U - 1}) / {STEP * U};
  const int tile = blockIdx.x, tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, q = lane & 3;
  {rows}{wsetup}
  const {ct}* xp[NB];
  bool xok[NB];
#pragma unroll
  for (int bt = 0; bt < NB; ++bt) {{  // B column g of batch tile bt: the pair at position s0 + col
    const int col = c0 + bt * 8 + g;
    xok[bt] = col < cnt;
    xp[bt] = x + (long long)(xok[bt] ? {xrow} : 0) * {K};
  }}
  float acc[NB][4];
#pragma unroll
  for (int bt = 0; bt < NB; ++bt)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[bt][i] = 0.f;
  for (int it = warp; it < ITS; it += {NW})
#pragma unroll
    for (int sub = 0; sub < {U}; sub += UU) {{{body}
    }}
#pragma unroll
  for (int bt = 0; bt < NB; ++bt)
#pragma unroll
    for (int i = 0; i < 4; ++i) part[((warp * {NBT} + bt) * 32 + lane) * 4 + i] = acc[bt][i];
  __syncthreads();{epi}
  __syncthreads();
}}"""


def _fma_body(K: int, O: int, P: int, dtype: str, silu: bool, nvfp4: bool) -> str:
    """FMA path: thread (row r = tid / 8, column c = tid % 8) of a 32-row tile, passes of 8 pairs."""
    OO = O // 2 if silu else O
    ct = _CT[dtype]
    xrow = f"order[s0 + col] / {P}" if silu else "s0 + col"
    orow = "s0 + col" if silu else "order[s0 + col]"
    if nvfp4:
        def wv(row):
            return (f"(float)({ct})ninfer_moe_nvfp4_elem(wq + ((long long)e * {O} + {row}) * {K // 2}, "
                    f"wsc + ((long long)e * {O} + {row}) * {K // 16}, wg[(long long)e * {O} + {row}], k)")
    else:
        def wv(row):
            return f"(float)w[((long long)e * {O} + {row}) * {K} + k]"
    if silu:
        dot = f"""
      float a = 0.f, b = 0.f;
      for (int k = 0; k < {K}; ++k) {{
        const float xv = (float)xr[k];
        a += {wv("row")} * xv;
        b += {wv(f"({OO} + row)")} * xv;
      }}
      const float gv = (float)({ct})a, uv = (float)({ct})b;
      out[(long long)({orow}) * {OO} + row] = ({ct})(gv / (1.f + expf(-gv)) * uv);"""
    else:
        dot = f"""
      float a = 0.f;
      for (int k = 0; k < {K}; ++k) a += {wv("row")} * (float)xr[k];
      out[(long long)({orow}) * {OO} + row] = ({ct})a;"""
    return f"""
  const int tile = blockIdx.x, r = threadIdx.x >> 3, c = threadIdx.x & 7;
  const int row = tile * 32 + r;
  if (row >= {OO}) return;
  for (int c0 = 0; c0 < cnt; c0 += 8) {{
    const int col = c0 + c;
    if (col < cnt) {{
      const {ct}* xr = x + (long long)({xrow}) * {K};{dot}
    }}
  }}"""


def gemm_source(name: str, K: int, O: int, Ex: int, P: int, dtype: str, silu: bool, nvfp4: bool, *, warps: int,
                unroll: int, big_tiles: int, uu8: int | None = None) -> str:
    """CUDA of the grouped expert GEMM `name`(x, order, route, weights, out) (module docstring). uu8: K steps loaded
    at a time by the 8-pair passes (default unroll; fewer where the decode kernel's register budget is tight: it
    changes when loads are issued, not the K split or the order of the sums)."""
    path = gemm_path(K, dtype, nvfp4)
    ct = _CT[dtype]
    wargs = "wq, wsc, wg" if nvfp4 else "w"
    head = f"""
__device__ __forceinline__ void {name}(const {ct}* __restrict__ x, const int* __restrict__ order,
    const int* __restrict__ route, {_weight_decl(ct, nvfp4)}, {ct}* __restrict__ out) {{
  const int u = blockIdx.y;
  if (u >= route[{Ex + 1}]) return;  // the whole block: fewer experts selected than launched
  const int e = route[{Ex + 2} + u];
  const int s0 = route[e], cnt = route[e + 1] - s0;"""
    if path == "fma":
        return (_NVFP4_ELEM if nvfp4 else "") + _src(name, head + _fma_body(K, O, P, dtype, silu, nvfp4) + "\n}")
    main = head + f"""
  __shared__ float part[{warps * big_tiles * 128}];
  for (int c0 = 0; c0 < cnt; ) {{  // passes of 8 pairs, or {8 * big_tiles} while more than 8 are left
    if (cnt - c0 <= 8) {{
      {name}_pass<1, {uu8 or unroll}>(x, order, {wargs}, out, e, s0, cnt, c0, part);
      c0 += 8;
    }} else {{
      {name}_pass<{big_tiles}, {max(1, unroll // 2)}>(x, order, {wargs}, out, e, s0, cnt, c0, part);
      c0 += {8 * big_tiles};
    }}
  }}
}}"""
    helpers = _mma_helper(_MMA_T[dtype]) + _LDW + ((_BF16X2 + _DQ32) if nvfp4 else "")
    return helpers + _src(name, _mma_pass(name, K, O, P, dtype, silu, nvfp4, warps, big_tiles, unroll) + main)


def _expert_entry(K: int, O: int, OO: int, Ex: int, P: int, dtype: str, nvfp4: bool, run):
    """prim_func(x[rows, K], order[n*P], route, weights..., out[n*P, OO]); rows = n (gate_up) or n*P (down)
    is the first buffer's extent, so both kinds share one signature: x rows are given as `xr`."""
    if nvfp4:
        @T.prim_func
        def f(var_x: T.handle, var_order: T.handle, var_route: T.handle, var_wq: T.handle, var_wsc: T.handle,
              var_wg: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            npairs = T.int64()
            xr = T.int64()
            x = T.match_buffer(var_x, (xr, K), dtype)
            order = T.match_buffer(var_order, (npairs,), "int32")
            rl = T.int64()
            route = T.match_buffer(var_route, (rl,), "int32")  # route_len(Ex[, counters])
            wq = T.match_buffer(var_wq, (Ex, O, K // 2), "uint8")
            wsc = T.match_buffer(var_wsc, (Ex, O, K // 16), "uint8")
            wg = T.match_buffer(var_wg, (Ex, O), "float32")
            out = T.match_buffer(var_out, (npairs, OO), dtype)
            run(npairs, x, order, route, [T.address_of(wq[0, 0, 0]), T.address_of(wsc[0, 0, 0]),
                                          T.address_of(wg[0, 0])], out, wq)
    else:
        @T.prim_func
        def f(var_x: T.handle, var_order: T.handle, var_route: T.handle, var_w: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            npairs = T.int64()
            xr = T.int64()
            x = T.match_buffer(var_x, (xr, K), dtype)
            order = T.match_buffer(var_order, (npairs,), "int32")
            rl = T.int64()
            route = T.match_buffer(var_route, (rl,), "int32")  # route_len(Ex[, counters])
            w = T.match_buffer(var_w, (Ex, O, K), dtype)
            out = T.match_buffer(var_out, (npairs, OO), dtype)
            run(npairs, x, order, route, [T.address_of(w[0, 0, 0])], out, w)
    return f


DECODE_MIN_REGS = 56  # registers per thread the decode kernel's launch bounds leave ptxas at the least


def decode_launch(tiles: int, pairs: int, threads: int, unroll: int, sms: int) -> tuple[int, int]:
    """(blocks per SM, K steps loaded at a time) of the decode kernel's 8-pair passes. A one-token call launches
    tiles x pairs blocks (one per selected expert), each one short burst of loads: a block left for a second wave
    costs a whole extra load latency, so __launch_bounds__ asks for all of them at once (within DECODE_MIN_REGS
    registers a thread); and ptxas issues a pass's loads before its mma chain only when the register budget holds
    them (without a minimum it interleaves loads and mma.sync: one latency per K step instead of one per pass, in
    the SASS). Under ~80 registers the passes load half the steps at a time."""
    mb = max(1, min(-(-tiles * pairs // max(1, sms)), 2048 // threads, 32, 65536 // (DECODE_MIN_REGS * threads)))
    budget = 65536 // (mb * threads)
    return mb, (unroll if budget >= 80 else max(1, unroll // 2))


def _gemm_parts(kind: str, K: int, O: int, Ex: int, P: int, dtype: str, nvfp4: bool, warps: int, unroll: int,
                big_tiles: int, wgmma: tuple | None, sms: int = 132) -> SimpleNamespace:
    """The grouped GEMM's device functions and launch macros: small (the mma.sync / FMA passes) and big
    (moe_sm90's wgmma tile, None where it does not apply) from min_pairs pairs. fns: the passes (name, source, MB),
    then, where big_tiles > 1, the decode variant that calls of at most DECODE_TOKENS tokens launch (groups of at
    most 8 pairs: only the 8-pair passes, compiled alone with decode_launch's launch bounds, so a decode launch's
    blocks are resident at once; the same K split, so the same numbers). fns: (name, source, min blocks per SM)."""
    silu = kind == "gate_up"
    path = gemm_path(K, dtype, nvfp4)
    tag = "".join(ch if ch.isalnum() else "_" for ch in f"{kind}_{K}x{O}_s{Ex}_p{P}_{dtype}_{path}_{warps}{unroll}"
                  f"{big_tiles}")
    name = f"ninfer_moe_{tag}"
    if path == "nvfp4":  # unroll counts 128-element K steps there
        unroll = max(1, unroll // 2)
    if path != "fma":  # no warp without a K chunk (NVFP4 down, K = 512: 2 chunks): the same sums, fewer threads
        warps = max(1, min(warps, -(-K // ((128 if path == "nvfp4" else 32) * unroll))))
    TILES = gemm_tiles(O, silu, path)
    NT = gemm_threads(path, warps)
    decode = path != "fma" and big_tiles > 1
    mb, uu8 = decode_launch(TILES, P, NT, unroll, sms) if decode else (1, unroll)
    fns = [(name, gemm_source(name, K, O, Ex, P, dtype, silu, nvfp4, warps=warps, unroll=unroll,
                              big_tiles=big_tiles), 1)]
    if decode:
        fns.append((name + "_b1", gemm_source(name + "_b1", K, O, Ex, P, dtype, silu, nvfp4, warps=warps,
                                              unroll=unroll, big_tiles=1, uu8=uu8), mb))

    def passes(fn: str, src: str, MB: int):
        return _expert_grid(Ex, TILES, NT, MB, lambda x, order, route, wptrs, out: T.cuda.func_call(
            fn, T.address_of(x[0, 0]), T.address_of(order[0]), T.address_of(route[0]), *wptrs,
            T.address_of(out[0, 0]), source_code=src))

    small = _by_tokens(P, *[passes(*f) for f in fns])
    big, min_pairs = None, 0
    if wgmma is not None and path in ("mma", "nvfp4") and moe_sm90.applies(K, O, dtype, silu, wgmma[0], wgmma[1],
                                                                         nvfp4):
        bn, stages, per_expert = wgmma
        min_pairs = per_expert * Ex
        big = moe_sm90.grouped_launch(name + "_wgmma", K, O, Ex, P, dtype, silu, bn=bn, stages=stages, nvfp4=nvfp4,
                                      helpers=_BF16X2 + _DQ8 if nvfp4 else "")
    return SimpleNamespace(name=name, fns=fns, path=path, TILES=TILES, NT=NT, small=small, big=big,
                           min_pairs=min_pairs)


DECODE_TOKENS = 8  # calls of at most this many tokens launch the 8-pair passes' own kernel (_gemm_parts)


def _expert_grid(Ex: int, TILES: int, NT: int, MB: int, call):
    """The launch macro (npairs, *args) of the grid (row tiles, min(Ex, npairs)) x NT threads evaluating
    call(*args), with __launch_bounds__(NT, MB) where MB > 1 (decode_launch)."""
    if MB > 1:
        @T.macro
        def launch(npairs, *args):
            for by in T.thread_binding(T.min(Ex, npairs), thread="blockIdx.y"):
                for bx in T.thread_binding(TILES, thread="blockIdx.x"):
                    for tx in T.thread_binding(NT, thread="threadIdx.x"):
                        with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", MB):
                            T.evaluate(call(*args))
    else:
        @T.macro
        def launch(npairs, *args):
            for by in T.thread_binding(T.min(Ex, npairs), thread="blockIdx.y"):
                for bx in T.thread_binding(TILES, thread="blockIdx.x"):
                    for tx in T.thread_binding(NT, thread="threadIdx.x"):
                        T.evaluate(call(*args))
    return launch


def _by_tokens(P: int, full, decode=None):
    """The launch macro (npairs, ...) that runs `decode` for calls of at most DECODE_TOKENS tokens, else `full`."""
    if decode is None:
        return full

    @T.macro
    def launch(npairs, *args):
        if npairs <= DECODE_TOKENS * P:
            decode(npairs, *args)
        else:
            full(npairs, *args)
    return launch


def _supported(silu: bool, K: int, O: int, dtype: str, weight_format: str | None) -> bool:
    nvfp4 = weight_format == "nvfp4"
    return weight_format in (None, "nvfp4") and dtype in _CT and not (silu and O % 2) and not (nvfp4 and K % 16)


@lru_cache(maxsize=None)
def expert_gemm(kind: str, K: int, O: int, n_slots: int, pairs: int, dtype: str, weight_format: str | None, *,
                warps: int = 4, unroll: int = 4, big_tiles: int = 4, sms: int = 132,
                wgmma: tuple | None = None):
    """moe_gate_up (kind "gate_up": x [n, K], weights [Ex, O = 2I, K], out h [n*P, O/2]) or moe_down (kind "down":
    x = h [n*P, K], weights [Ex, O, K], out y [n*P, O]); None where no path applies.
    wgmma: (bn, stages, rows_per_expert) on sm_90: calls with at least rows_per_expert pairs per expert slot on
    average launch moe_sm90's grouped wgmma kernel instead (16-bit weights, or NVFP4 dequantized once per tile into
    its shared ring): its 128-row tiles pay off once the groups are large (prefill chunks of thousands of tokens),
    the mma.sync passes read each weight once below."""
    silu = kind == "gate_up"
    if not _supported(silu, K, O, dtype, weight_format):
        return None
    nvfp4 = weight_format == "nvfp4"
    Ex, P = int(n_slots), int(pairs)
    g = _gemm_parts(kind, K, O, Ex, P, dtype, nvfp4, warps, unroll, big_tiles, wgmma, sms)
    small, big, min_pairs = g.small, g.big, g.min_pairs

    if big is not None:
        @T.macro
        def run(npairs, x, order, route, wptrs, out, w):
            if npairs >= min_pairs:
                big(npairs, x, order, route, wptrs, out)
            else:
                small(npairs, x, order, route, wptrs, out)
    else:
        @T.macro
        def run(npairs, x, order, route, wptrs, out, w):
            small(npairs, x, order, route, wptrs, out)

    return _opaque(_expert_entry(K, O, O // 2 if silu else O, Ex, P, dtype, nvfp4, run), g.name)


DOWN_TILE = 16  # output rows per block of the mma.sync / NVFP4 down passes (gemm_tiles)


def down_combine_counters(hidden: int) -> int:
    """Tickets moe_down_combine needs after the grouping in the route buffer (route_len's counters)."""
    return (int(hidden) + DOWN_TILE - 1) // DOWN_TILE


def down_combine_source(fname: str, gname: str, cname: str, O: int, Ex: int, dtype: str, nvfp4: bool, NT: int) -> str:
    """{fname}: block (tile, u) of the down passes, then the last of the U blocks of its row tile (a ticket in
    route after the grouping: fence, atomic add; the align step zeroed it) combines those rows for every token.
    The combine reads only y rows this launch wrote (fenced, past L1): the same numbers as moe_combine's launch."""
    ct = _CT[dtype]
    wargs = "wq, wsc, wg" if nvfp4 else "w"
    return _ATOMIC + _src(fname, f"""
__device__ __forceinline__ void {fname}(const {ct}* __restrict__ x, const int* __restrict__ order, int* route,
    {_weight_decl(ct, nvfp4)}, {ct}* __restrict__ y, const float* __restrict__ cw, const {ct}* __restrict__ res,
    const {ct}* __restrict__ sh, {ct}* __restrict__ out, const int n) {{
  __shared__ int last[1];
  if ((int)blockIdx.y >= route[{Ex + 1}]) return;  // the whole block: fewer experts selected than launched
  {gname}(x, order, route, {wargs}, y);
  ninfer_moe_fence();  // this block's y rows, before its ticket
  __syncthreads();
  if (threadIdx.x == 0)
    last[0] = ninfer_moe_atomic_add(route + {route_len(Ex)} + blockIdx.x, 1) == route[{Ex + 1}] - 1;
  __syncthreads();
  if (!last[0]) return;
  ninfer_moe_fence();
#pragma unroll 1
  for (int i = threadIdx.x; i < n * {DOWN_TILE}; i += {NT}) {{
    const int t = i / {DOWN_TILE}, d = blockIdx.x * {DOWN_TILE} + i % {DOWN_TILE};
    if (d < {O}) out[(long long)t * {O} + d] = {cname}_at(y, cw, res, sh, t, d);
  }}
}}""")


@lru_cache(maxsize=None)
def moe_down_combine(K: int, O: int, n_slots: int, pairs: int, top_k: int, dtype: str, weight_format: str | None,
                     residual: bool, shared: bool, *, warps: int = 4, unroll: int = 4, big_tiles: int = 4,
                     sms: int = 132, wgmma: tuple | None = None):
    """moe_down then moe_combine in one prim_func(h[n*P, K], order, route, weights..., w[n, top_k+1], res[n, O],
    sh[n, O], y[n*P, O], out[n, O]) (res / sh read only when residual / shared: pass any [n, O] array otherwise).
    The mma.sync / NVFP4 passes combine in their last block per row tile (down_combine_source: one launch; the
    route buffer carries down_combine_counters(O) tickets); the wgmma and FMA paths launch moe_combine's kernel
    after the GEMM. None where no path applies."""
    if not _supported(False, K, O, dtype, weight_format):
        return None
    nvfp4 = weight_format == "nvfp4"
    Ex, P, Kt = int(n_slots), int(pairs), int(top_k)
    g = _gemm_parts("down", K, O, Ex, P, dtype, nvfp4, warps, unroll, big_tiles, wgmma, sms)
    cname = _combine_name(O, Kt, P, dtype, residual, shared)
    csrc = combine_source(cname, O, Kt, P, dtype, residual, shared)
    comb = _combine_launch(cname, csrc, O)
    small, big, min_pairs, TILES, NT = g.small, g.big, g.min_pairs, g.TILES, g.NT
    suffix = f"_k{Kt}{'_sh' if shared else ''}{'_res' if residual else ''}"

    def fused_launch(gname: str, gsrc: str, MB: int):
        fname = gname.replace("ninfer_moe_down_", "ninfer_moe_down_combine_", 1) + suffix
        src = gsrc + csrc + down_combine_source(fname, gname, cname, O, Ex, dtype, nvfp4, NT)
        return _expert_grid(Ex, TILES, NT, MB, lambda n, x, order, route, wptrs, cw, rp, sp, y, out: T.cuda.func_call(
            fname, T.address_of(x[0, 0]), T.address_of(order[0]), T.address_of(route[0]), *wptrs,
            T.address_of(y[0, 0]), T.address_of(cw[0, 0]), rp, sp, T.address_of(out[0, 0]), T.Cast("int32", n),
            source_code=src))

    fused = _by_tokens(P, *[fused_launch(*f) for f in g.fns])
    fname = g.name.replace("ninfer_moe_down_", "ninfer_moe_down_combine_", 1) + suffix

    if g.path == "fma":
        @T.macro
        def run(npairs, n, x, order, route, wptrs, cw, rp, sp, y, out):
            small(npairs, x, order, route, wptrs, y)
            comb(n, y, cw, rp, sp, out)
    elif big is not None:
        @T.macro
        def run(npairs, n, x, order, route, wptrs, cw, rp, sp, y, out):
            if npairs >= min_pairs:
                big(npairs, x, order, route, wptrs, y)
                comb(n, y, cw, rp, sp, out)
            else:
                fused(npairs, n, x, order, route, wptrs, cw, rp, sp, y, out)
    else:
        @T.macro
        def run(npairs, n, x, order, route, wptrs, cw, rp, sp, y, out):
            fused(npairs, n, x, order, route, wptrs, cw, rp, sp, y, out)

    if nvfp4:
        @T.prim_func
        def f(var_x: T.handle, var_order: T.handle, var_route: T.handle, var_wq: T.handle, var_wsc: T.handle,
              var_wg: T.handle, var_cw: T.handle, var_res: T.handle, var_sh: T.handle, var_y: T.handle,
              var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            npairs, n, rl = T.int64(), T.int64(), T.int64()
            x = T.match_buffer(var_x, (npairs, K), dtype)
            order = T.match_buffer(var_order, (npairs,), "int32")
            route = T.match_buffer(var_route, (rl,), "int32")
            wq = T.match_buffer(var_wq, (Ex, O, K // 2), "uint8")
            wsc = T.match_buffer(var_wsc, (Ex, O, K // 16), "uint8")
            wg = T.match_buffer(var_wg, (Ex, O), "float32")
            cw = T.match_buffer(var_cw, (n, Kt + 1), "float32")
            res = T.match_buffer(var_res, (n, O), dtype)
            sh = T.match_buffer(var_sh, (n, O), dtype)
            y = T.match_buffer(var_y, (npairs, O), dtype)
            out = T.match_buffer(var_out, (n, O), dtype)
            run(npairs, n, x, order, route, [T.address_of(wq[0, 0, 0]), T.address_of(wsc[0, 0, 0]),
                                             T.address_of(wg[0, 0])], cw, T.address_of(res[0, 0]),
                T.address_of(sh[0, 0]), y, out)
    else:
        @T.prim_func
        def f(var_x: T.handle, var_order: T.handle, var_route: T.handle, var_w: T.handle, var_cw: T.handle,
              var_res: T.handle, var_sh: T.handle, var_y: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            npairs, n, rl = T.int64(), T.int64(), T.int64()
            x = T.match_buffer(var_x, (npairs, K), dtype)
            order = T.match_buffer(var_order, (npairs,), "int32")
            route = T.match_buffer(var_route, (rl,), "int32")
            w = T.match_buffer(var_w, (Ex, O, K), dtype)
            cw = T.match_buffer(var_cw, (n, Kt + 1), "float32")
            res = T.match_buffer(var_res, (n, O), dtype)
            sh = T.match_buffer(var_sh, (n, O), dtype)
            y = T.match_buffer(var_y, (npairs, O), dtype)
            out = T.match_buffer(var_out, (n, O), dtype)
            run(npairs, n, x, order, route, [T.address_of(w[0, 0, 0])], cw, T.address_of(res[0, 0]),
                T.address_of(sh[0, 0]), y, out)
    return _opaque(f, fname)


# ---------------------------------------------------------------------------------------------
# combine
def combine_source(name: str, D: int, K: int, P: int, dtype: str, residual: bool, shared: bool) -> str:
    """{name}_at(y, w, res, sh, t, d): one output element; {name}(y, w, res, sh, out, n): one thread each. y is read
    past L1 (ninfer_moe_ldcg): the fused down + combine reads rows other blocks of the same launch wrote."""
    ct = _CT[dtype]
    acc = "s" if not shared else f"(float)({ct})s + (float)({ct})(w[t * {K + 1} + {K}] * (float)sh[i])"
    val = f"(float)({ct})s" if not shared else f"(float)({ct})({acc})"
    out = f"({ct})((float)res[i] + {val})" if residual else f"({ct})({val})"
    return _LDCG + _src(name, f"""
// res + round(sum_j w[t, j] * y[t*{P} + j, d]){" + round(w[t, K] * shared)" if shared else ""} at (t, d)
__device__ __forceinline__ {ct} {name}_at(const {ct}* __restrict__ y, const float* __restrict__ w,
    const {ct}* __restrict__ res, const {ct}* __restrict__ sh, const int t, const int d) {{
  const long long i = (long long)t * {D} + d;
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < {P}; ++j) s += w[t * {K + 1} + j] * (float)ninfer_moe_ldcg(y + ((long long)t * {P} + j) * {D} + d);
  return {out};
}}

__device__ __forceinline__ void {name}(const {ct}* __restrict__ y, const float* __restrict__ w,
    const {ct}* __restrict__ res, const {ct}* __restrict__ sh, {ct}* __restrict__ out, int n) {{
  const long long i = (long long)blockIdx.x * {COMBINE_THREADS} + threadIdx.x;
  if (i < (long long)n * {D}) out[i] = {name}_at(y, w, res, sh, (int)(i / {D}), (int)(i % {D}));
}}""")


def _combine_name(D: int, K: int, P: int, dtype: str, residual: bool, shared: bool) -> str:
    return (f"ninfer_moe_combine_d{D}_k{K}_p{P}_{_MMA_T.get(dtype, 'f32')}{'_res' if residual else ''}"
            f"{'_sh' if shared else ''}")


def _combine_launch(name: str, src: str, D: int):
    """The macro (n, y, w, res address, shared address, out) of one combine launch."""
    NT = COMBINE_THREADS

    @T.macro
    def run(n, y, w, rp, sp, out):
        for b in T.thread_binding((n * D + NT - 1) // NT, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                T.evaluate(T.cuda.func_call(name, T.address_of(y[0, 0]), T.address_of(w[0, 0]), rp, sp,
                                            T.address_of(out[0, 0]), T.Cast("int32", n), source_code=src))

    return run


@lru_cache(maxsize=None)
def moe_combine(hidden: int, top_k: int, pairs: int, dtype: str, residual: bool, shared: bool):
    """prim_func(y[n*P, D], w[n, K+1][, res[n, D]][, shared[n, D]], out[n, D])."""
    D, K, P = int(hidden), int(top_k), int(pairs)
    name = _combine_name(D, K, P, dtype, residual, shared)
    run = _combine_launch(name, combine_source(name, D, K, P, dtype, residual, shared), D)

    if residual and shared:
        @T.prim_func
        def f(var_y: T.handle, var_w: T.handle, var_res: T.handle, var_sh: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            w = T.match_buffer(var_w, (n, K + 1), "float32")  # binds n before y's n * P
            y = T.match_buffer(var_y, (n * P, D), dtype)
            res = T.match_buffer(var_res, (n, D), dtype)
            sh = T.match_buffer(var_sh, (n, D), dtype)
            out = T.match_buffer(var_out, (n, D), dtype)
            run(n, y, w, T.address_of(res[0, 0]), T.address_of(sh[0, 0]), out)
    elif residual:
        @T.prim_func
        def f(var_y: T.handle, var_w: T.handle, var_res: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            w = T.match_buffer(var_w, (n, K + 1), "float32")  # binds n before y's n * P
            y = T.match_buffer(var_y, (n * P, D), dtype)
            res = T.match_buffer(var_res, (n, D), dtype)
            out = T.match_buffer(var_out, (n, D), dtype)
            run(n, y, w, T.address_of(res[0, 0]), T.address_of(res[0, 0]), out)
    elif shared:
        @T.prim_func
        def f(var_y: T.handle, var_w: T.handle, var_sh: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            w = T.match_buffer(var_w, (n, K + 1), "float32")  # binds n before y's n * P
            y = T.match_buffer(var_y, (n * P, D), dtype)
            sh = T.match_buffer(var_sh, (n, D), dtype)
            out = T.match_buffer(var_out, (n, D), dtype)
            run(n, y, w, T.address_of(sh[0, 0]), T.address_of(sh[0, 0]), out)
    else:
        @T.prim_func
        def f(var_y: T.handle, var_w: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            w = T.match_buffer(var_w, (n, K + 1), "float32")  # binds n before y's n * P
            y = T.match_buffer(var_y, (n * P, D), dtype)
            out = T.match_buffer(var_out, (n, D), dtype)
            run(n, y, w, T.address_of(y[0, 0]), T.address_of(y[0, 0]), out)
    return _opaque(f, name)


__all__ = ["down_combine_counters", "expert_gemm", "gemm_path", "moe_combine", "moe_down_combine", "moe_route",
           "route_len"]
