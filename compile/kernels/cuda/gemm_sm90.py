"""Prefill GEMM on the Hopper tensor cores: cp.async multistage + wgmma (sm_90a), fused epilogues.

  gemm(x[n,K], w[O,K], [res[n,Oo]], out[n,Oo]):  y = x @ w^T in fp32, then the decode GEMV's epilogues
    "none" out = cast(y) | "residual" out = cast(res + cast(y)) | "silu_mul" out = cast(silu(y_gate) * y_up)
  (the prim_func contract of gemv.py, so model.py swaps one for the other; n <= small_rows runs the
  decode GEMV's launch inside the same prim_func, larger n the kernel below).

DLight only emits WMMA (~190 TFLOP/s on the H200, a quarter of cuBLAS); wgmma is the instruction that
reaches Hopper's peak. One block computes a BM x BN output tile (BM = 128: two consumer warpgroups of
64 rows; BN = 256 or 128) with all 256 threads both loading and issuing:
  * K runs in BK = 64 steps (128 bytes of bf16 per row = one 128-byte-swizzle row). Each step's A tile
    (BM x 64) and B tile (BN x 64, the weight rows: both operands K-major, the "TN" GEMM) go to shared
    memory with cp.async 16-byte copies (zero-filled past n / O / K), chunk c of row r stored at chunk
    c ^ (r % 8): the canonical SWIZZLE_128B K-major layout, 8-row atoms 1024 bytes apart, so the wgmma
    descriptors are (addr >> 4) | LBO 1 << 16 | SBO 64 << 32 | 1 << 62, plus 2 per 16-element K slice.
  * STAGES ring slots; tile t+STAGES-2 is fetched while tile t is multiplied: per step
    cp.async.wait -> fence.proxy.async (generic-proxy writes made visible to the async proxy) ->
    __syncthreads -> wgmma x4 (m64nBNk16, async) -> cp.async of the next tile into the slot whose
    wgmma group retired (wait_group 1 before the barrier guarantees it for both warpgroups) -> commit.
  * Blocks walk the tiles in groups of GROUP_M row tiles (Triton's grouped order), so the blocks
    resident at once share a few A and B tiles in L2 instead of streaming every weight once per row tile.
  * Epilogue straight from the accumulator fragments (thread (warp w, lane l) of a warpgroup holds
    rows 16w + l/4 (+8), columns 8i + 2(l%4) (+1)), two adjacent outputs per store; silu_mul tiles hold
    BN/2 gate columns and the matching BN/2 up columns, so gate i and up i + BN/16 meet in one thread.
Shapes: K % 8 == 0 (cp.async granularity), any n and O. Parameters: schedules/cuda_sm_90.json
"kernels.gemm" (bn, stages, group_m, small_rows); the kernel is built only for sm_90 targets
(nvcc gets sm_90a, compile/targets.py), other targets keep DLight's matmul.
Measured on the H200 (bench/gemm_gpu_check.py, BENCHMARKS.md run 4): 700-758 TFLOP/s on the 27B projections
at 2048 / 8192 rows against cuBLAS's 720-801 (bn 128 or 3 stages: 364-594).
"""
from __future__ import annotations

from functools import lru_cache

from tvm.script import tirx as T

from . import gemv as gemv_kernels

BM = 128
BK = 64
THREADS = 256
_CT = {"bfloat16": "nv_bfloat16", "float16": "half"}
_WG_TYPE = {"bfloat16": "bf16", "float16": "f16"}


def supported(K: int, O: int, dtype: str, out_dtype: str, epilogue: str) -> bool:
    if dtype not in _CT or out_dtype not in (dtype, "float32") or K % 8 or K < 8:
        return False
    if epilogue == "silu_mul":
        return O % 2 == 0
    if epilogue == "residual":
        return out_dtype == dtype
    return epilogue == "none"


def smem_bytes(bn: int, stages: int) -> int:
    return stages * (BM + bn) * BK * 2 + 1024  # + 1024: the ring is aligned to 1024 bytes inside


def _wgmma_source(name: str, n: int, ab: str) -> str:
    """D[64 x n] += A(desc) B(desc)^T, fp32 accumulators d[0 .. n/2)."""
    regs = n // 2
    dl = ", ".join(f"%{i}" for i in range(regs))
    outs = ", ".join(f'"+f"(d[{i}])' for i in range(regs))
    return (
        f"__device__ __forceinline__ void {name}(float* d, unsigned long long da, unsigned long long db) {{\n"
        '  asm volatile("{\\n .reg .pred p;\\n setp.ne.b32 p, %' + str(regs + 2) + ', 0;\\n'
        f' wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{ab}.{ab} {{{dl}}}, %{regs}, %{regs + 1}, p, 1, 1, 0, 0;\\n}}\\n"\n'
        f"    : {outs}\n"
        '    : "l"(da), "l"(db), "r"(1));\n'
        "}\n"
    )


def kernel_source(name: str, K: int, O: int, dtype: str, out_dtype: str, epilogue: str, *, bn: int, stages: int,
                  group_m: int, rows: dict | None = None) -> str:
    """CUDA of the device function `name`(x, w, res, out, n, smem): one block's whole tile.

    rows: the grouped (MoE) variant's hooks (compile/kernels/cuda/moe_sm90.py), C text: "params" (extra
    parameters after `n`), "tile" (the block's tile: defines m0, n0, nrows = rows of the group, wb = the
    group's weights; may return), "a_row" / "out_row" (the x / out row of group row `r`). None: the plain GEMM
    (rows 0..n of x and out, the grouped tile order)."""
    silu = epilogue == "silu_mul"
    OO = O // 2 if silu else O
    ct = _CT[dtype]
    ot = "float" if out_dtype == "float32" else ct
    ab = _WG_TYPE[dtype]
    cols = bn // 2 if silu else bn  # output columns per tile
    n_tiles = (OO + cols - 1) // cols
    kt = (K + BK - 1) // BK
    a_chunks = BM * 8 // THREADS  # 16-byte copies per thread per stage
    b_chunks = bn * 8 // THREADS
    stage_bytes = (BM + bn) * BK * 2
    acc = bn // 2  # fp32 accumulators per thread (64 x bn per warpgroup / 128 threads)
    mma = f"{name}_wgmma"
    to_out = "(float)" if ot == "float" else f"({ot})"

    def cast_in(v):  # round to the activation dtype and back (the GEMV epilogues' cast(y))
        return f"(float)(({ct})({v}))"

    hooks = rows or {}
    nrows = "nrows" if rows else "n"
    out_row = f"({hooks['out_row']})" if rows else "r"

    if silu:
        store = f"""
      // gate column c (i < {acc // 8}) and its up column (i + {acc // 8}) are in this thread
#pragma unroll
      for (int i = 0; i < {acc // 8}; ++i) {{
        int c = n0 + 8 * i + 2 * (lane & 3);
#pragma unroll
        for (int h = 0; h < 2; ++h) {{
          int r = m0 + wg * 64 + 16 * warp + (lane >> 2) + 8 * h;
          {ot} v[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {{
            float g = {cast_in("acc[4 * i + 2 * h + e]")};
            float u = {cast_in(f"acc[4 * (i + {acc // 8}) + 2 * h + e]")};
            v[e] = {to_out}(g / (1.0f + __expf(-g)) * u);
          }}
          if (r < {nrows} && c + 1 < {OO} && {int(OO % 2 == 0)}) {{
            {"float2 pr = make_float2(v[0], v[1]);" if ot == "float" else f"{ot}2 pr; pr.x = v[0]; pr.y = v[1];"}
            *({"float2" if ot == "float" else ot + "2"}*)(out + (long long){out_row} * {OO} + c) = pr;
          }} else if (r < {nrows}) {{
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (c + e < {OO}) out[(long long){out_row} * {OO} + c + e] = v[e];
          }}
        }}
      }}"""
    else:
        if epilogue == "residual":
            val = f"(float)res[(long long)r * {OO} + c + e] + {cast_in('acc[4 * i + 2 * h + e]')}"
        else:
            val = "acc[4 * i + 2 * h + e]"
        store = f"""
#pragma unroll
      for (int i = 0; i < {acc // 4}; ++i) {{
        int c = n0 + 8 * i + 2 * (lane & 3);
#pragma unroll
        for (int h = 0; h < 2; ++h) {{
          int r = m0 + wg * 64 + 16 * warp + (lane >> 2) + 8 * h;
          if (r >= {nrows}) continue;
          if (c + 1 < {OO} && {int(OO % 2 == 0)}) {{
            {ot} v0 = {to_out}({val.replace('+ e', '+ 0')}), v1 = {to_out}({val.replace('+ e', '+ 1')});
            {"float2 pr = make_float2(v0, v1);" if ot == "float" else f"{ot}2 pr; pr.x = v0; pr.y = v1;"}
            *({"float2" if ot == "float" else ot + "2"}*)(out + (long long){out_row} * {OO} + c) = pr;
          }} else {{
#pragma unroll
            for (int e = 0; e < 2; ++e)
              if (c + e < {OO}) out[(long long){out_row} * {OO} + c + e] = {to_out}({val});
          }}
        }}
      }}"""

    # weight row of B-tile row rr (silu: the first bn/2 rows are gate rows, the rest their up rows)
    if silu:
        brow = f"(rr < {bn // 2} ? n0 + rr : {OO} + n0 + rr - {bn // 2})"
        bok = f"(n0 + (rr & {bn // 2 - 1}) < {OO})"
    else:
        brow = "(n0 + rr)"
        bok = f"(n0 + rr < {O})"
    k_pred = K % BK != 0
    kcheck = f" && k + kc < {K}" if k_pred else ""
    tile_order = f"""  const int m_tiles = (n + {BM - 1}) / {BM};
  // grouped tile order: GROUP_M row tiles x all column tiles, rows fastest within a group
  const int bid = blockIdx.x, per_group = {group_m} * {n_tiles};
  const int first_m = bid / per_group * {group_m};
  const int gsize = min(m_tiles - first_m, {group_m});
  const int tm = first_m + (bid % per_group) % gsize, tn = (bid % per_group) / gsize;
  const int m0 = tm * {BM}, n0 = tn * {cols};"""

    return _wgmma_source(mma, bn, ab) + f"""
__device__ __forceinline__ void {name}_cp16(unsigned dst, const void* src, bool ok) {{
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\\n" :: "r"(dst), "l"(src), "r"(ok ? 16 : 0));
}}

__device__ __forceinline__ unsigned long long {name}_desc(unsigned addr) {{
  return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | (64ull << 32) | (1ull << 62);
}}

// one block: output tile (m0.., n0..) of out[n, {OO}] = epilogue(x[n, {K}] @ w[{O}, {K}]^T)
__device__ __forceinline__ void {name}(const {ct}* __restrict__ x, const {ct}* __restrict__ w,
                                       const {ct}* __restrict__ res, {ot}* __restrict__ out, int n,
                                       {hooks.get("params", "")}void* smem_raw) {{
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
{hooks.get("tile") or tile_order}
  unsigned base = (unsigned)__cvta_generic_to_shared(smem_raw);
  base = (base + 1023u) & ~1023u;
  // this thread's copies: chunk kc of A rows (tid / 8 + 32 j) and of B rows (tid / 8 + 32 j)
  const int kc = (tid & 7) * 8;
  const unsigned soff = (unsigned)((tid >> 3) * 128 + (((tid & 7) ^ ((tid >> 3) & 7)) << 4));
  const {ct}* aptr[{a_chunks}];
  bool aok[{a_chunks}];
  const {ct}* bptr[{b_chunks}];
  bool bok[{b_chunks}];
#pragma unroll
  for (int j = 0; j < {a_chunks}; ++j) {{
    int r = m0 + (tid >> 3) + 32 * j;
    aok[j] = r < {nrows};
    aptr[j] = x + (long long)(aok[j] ? {f"({hooks['a_row']})" if rows else "r"} : 0) * {K} + kc;
  }}
#pragma unroll
  for (int j = 0; j < {b_chunks}; ++j) {{
    int rr = (tid >> 3) + 32 * j;
    bok[j] = {bok};
    bptr[j] = {"wb" if rows else "w"} + (long long)(bok[j] ? {brow} : 0) * {K} + kc;
  }}
  auto load = [&](int t) {{
    if (t < {kt}) {{
      const unsigned sa = base + (unsigned)((t % {stages}) * {stage_bytes}) + soff;
      const unsigned sb = sa + {BM * 128};
      const int k = t * {BK};
#pragma unroll
      for (int j = 0; j < {a_chunks}; ++j) {name}_cp16(sa + j * 4096, aptr[j] + k, aok[j]{kcheck});
#pragma unroll
      for (int j = 0; j < {b_chunks}; ++j) {name}_cp16(sb + j * 4096, bptr[j] + k, bok[j]{kcheck});
    }}
    asm volatile("cp.async.commit_group;\\n" ::);
  }};
  float acc[{acc}];
#pragma unroll
  for (int i = 0; i < {acc}; ++i) acc[i] = 0.f;
#pragma unroll
  for (int s = 0; s < {stages - 2}; ++s) load(s);
  for (int t = 0; t < {kt}; ++t) {{
    asm volatile("cp.async.wait_group {stages - 3};\\n" ::);
    asm volatile("fence.proxy.async.shared::cta;\\n" ::: "memory");
    __syncthreads();
    const unsigned sa = base + (unsigned)((t % {stages}) * {stage_bytes}) + wg * {64 * 128};
    const unsigned sb = base + (unsigned)((t % {stages}) * {stage_bytes}) + {BM * 128};
    asm volatile("wgmma.fence.sync.aligned;\\n" ::: "memory");
#pragma unroll
    for (int ks = 0; ks < {BK // 16}; ++ks)
      {mma}(acc, {name}_desc(sa) + 2 * ks, {name}_desc(sb) + 2 * ks);
    asm volatile("wgmma.commit_group.sync.aligned;\\n" ::: "memory");
    load(t + {stages - 2});
    asm volatile("wgmma.wait_group.sync.aligned 1;\\n" ::: "memory");
  }}
  asm volatile("wgmma.wait_group.sync.aligned 0;\\n" ::: "memory");
  asm volatile("cp.async.wait_group 0;\\n" ::);
  {{{store}
  }}
}}
"""


def _launch_tiles(n, OO, cols):
    return (n + BM - 1) // BM * ((OO + cols - 1) // cols)


@lru_cache(maxsize=None)
def gemm(K: int, O: int, dtype: str, out_dtype: str | None = None, epilogue: str = "none", *, bn: int = 256,
         stages: int = 4, group_m: int = 8, small_rows: int = 32, gemv_params: tuple = ()):
    """The prim_func of the contract above, or None where the kernel does not apply."""
    out_dtype = out_dtype or dtype
    if not supported(K, O, dtype, out_dtype, epilogue) or bn not in (128, 256) or not 3 <= stages <= 8:
        return None
    if smem_bytes(bn, stages) > 227 * 1024:
        return None
    silu = epilogue == "silu_mul"
    has_res = epilogue == "residual"
    OO = O // 2 if silu else O
    cols = bn // 2 if silu else bn
    sig = f"{K}_{O}_{dtype}_{out_dtype}_{epilogue}_{bn}_{stages}_{group_m}"
    name = "ninfer_gemm_sm90_" + "".join(ch if ch.isalnum() else "_" for ch in sig)
    src = kernel_source(name, K, O, dtype, out_dtype, epilogue, bn=bn, stages=stages, group_m=group_m)
    SMEM = smem_bytes(bn, stages)
    small_run = gemv_kernels.mma_run(K, O, dtype, out_dtype, epilogue, **dict(gemv_params)) if small_rows > 0 \
        else None
    limit = small_rows if small_run is not None else 0

    @T.macro
    def big(n, x, w, res, out):
        for b in T.thread_binding(_launch_tiles(n, OO, cols), thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", 1):
                    # access_ptr (the whole extent): TVM sizes the dynamic shared memory of a launch from the
                    # accessed region of the buffer, and address_of(smem[0]) alone would launch with 1 byte
                    smem = T.alloc_buffer((SMEM,), "uint8", scope="shared.dyn")
                    T.evaluate(T.cuda.func_call(
                        name, T.address_of(x[0, 0]), T.address_of(w[0, 0]),
                        T.address_of(res[0, 0]) if has_res else T.address_of(x[0, 0]),
                        T.address_of(out[0, 0]), T.Cast("int32", n), smem.access_ptr("rw"),
                        source_code=src))

    if small_run is not None:
        @T.macro
        def run(n, x, w, ws, ws2, res, out):
            if n <= limit:
                small_run(n, x, w, ws, ws2, res, out)
            else:
                big(n, x, w, res, out)
    else:
        @T.macro
        def run(n, x, w, ws, ws2, res, out):
            big(n, x, w, res, out)

    symbol = "gemm" + gemv_kernels.symbol(K, O, dtype, out_dtype, epilogue)[4:]
    return gemv_kernels._entry(K, O, OO, dtype, out_dtype, has_res, False, run).with_attr("global_symbol", symbol)

