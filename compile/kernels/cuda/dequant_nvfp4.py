"""NVFP4 weight -> bf16 / f16 at copy speed: the dequant of the sm_90 prefill projections.

On sm_90 a prefill NVFP4Linear (compile/kernels/dequant.py) dequantizes its weight once per call into a
dense [O, K] tensor that the wgmma GEMM (gemm_sm90.py) reads. The tensor-expression dequant got DLight's
Fallback schedule (one thread per output element, byte loads and 2-byte stores, float selects): far below
the copy rate, the main cost between NVFP4 and bf16 prefill (5.2k vs 9.4k tok/s, 27B on the H200). This kernel
reads the codes 4 bytes (8 elements) per thread and writes 16 bytes, both coalesced across the warp; the
output is a relax tensor like the one it replaces, so the memory planner reuses one buffer for every
projection of the prefill function.

Numerics are dequant.py's exactly: W[o, i] = cast(e2m1(code) * e4m3(scale[o, i/16]) * g[o]), the product
e2m1 * e4m3 exact and one fp32 rounding for * g, then the cast (round to nearest even). The exact product comes
from gemv.py's in-register decode (ninfer_nvfp4_dq32, for one code word): bf16x2 pairs (element j, element j+4)
of e2m1 * e4m3 * 2^-7, exact; each half widened to fp32 (exact) times g * 2^7 (exact scaling of g) is the same
real product as dequant.py's, rounded once in fp32 the same way; two results at a time packed with
cvt.rn to the output dtype, in element order. About 10 PTX instructions per element,
estimated under the memory time on the H200; bench/nvfp4_prefill_check.py measures GB/s against the copy rate.

Launch: item i = code word i = 8 elements of row i / (K/8) (the codes, block scales and the output are
contiguous in the same order: word i, scale byte i/2, output 16-byte chunk i); blocks of THREADS threads take
UNROLL * THREADS consecutive items, thread t items t, t + THREADS, ... with all loads issued before the
arithmetic. The device code sits between the emulator's source markers, so compile/kernels/cuda/emulate runs
it on the CPU (tests/test_cuda_build.py).
"""
from __future__ import annotations

from functools import lru_cache

from tvm.script import tirx as T

from .gemv import _BF16X2_MUL_SRC, NVFP4_SHIFT

THREADS = 256
UNROLL = 4
_CT = {"bfloat16": "nv_bfloat16", "float16": "half"}


def supported(K: int, O: int, dtype: str) -> bool:
    """The activation dtypes of the wgmma GEMM; K % 16 == 0 (NVFP4Linear's own condition)."""
    return dtype in _CT and K % 16 == 0 and K >= 16 and O >= 1 and O * K // 8 + UNROLL * THREADS < 2 ** 31


# packing two fp32 values into one word of the output dtype, round to nearest even (a in the low half); the CPU
# emulator has its own versions (emulate/prelude.py DEQUANT), and of gemv.py's bf16x2 multiply under this file's name
PACK_SRC = {
    "bfloat16": """
__device__ __forceinline__ unsigned ninfer_dqw_pack_bf16(float a, float b) {
  __nv_bfloat162 h = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<unsigned*>(&h);
}""",
    "float16": """
__device__ __forceinline__ unsigned ninfer_dqw_pack_f16(float a, float b) {
  __half2 h = __floats2half2_rn(a, b);
  return *reinterpret_cast<unsigned*>(&h);
}""",
}


def _guarded(name: str, body: str) -> str:
    """Device code defined once per CUDA module (several kernels of a library carry it)."""
    g = name.upper() + "_DEFINED"
    return f"#ifndef {g}\n#define {g}\n{body.strip()}\n#endif\n"


def kernel_source(name: str, K: int, O: int, dtype: str) -> str:
    """CUDA of the device function `name`(codes, scales, g, out): one block's UNROLL * THREADS items."""
    items = O * K // 8
    per_row = K // 8
    pack = "ninfer_dqw_pack_" + ("bf16" if dtype == "bfloat16" else "f16")
    guard = name.upper() + "_DEFINED"
    mul = _BF16X2_MUL_SRC.strip().replace("ninfer_bf16x2_mul", "ninfer_dqw_bf16x2_mul")
    dev = "// NINFER_ATTN_DEV_BEGIN\n" + _guarded("ninfer_dqw_bf16x2_mul", mul) + _guarded(pack, PACK_SRC[dtype]) \
        + "// NINFER_ATTN_DEV_END\n"
    return dev + f"""
// NINFER_ATTN_SRC_BEGIN
#ifndef {guard}
#define {guard}
// W[o, i] = cast(e2m1 * e4m3 * g[o]) for 8 elements per item ({items} items, {per_row} per row)
__device__ __forceinline__ void {name}(const void* __restrict__ codes_p, const void* __restrict__ scales_p,
                                       const float* __restrict__ g, void* __restrict__ out_p) {{
  const unsigned* codes = (const unsigned*)codes_p;
  const unsigned char* scales = (const unsigned char*)scales_p;
  uint4* out = (uint4*)out_p;
  const int base = (int)blockIdx.x * {UNROLL * THREADS} + (int)threadIdx.x;
  unsigned cw[{UNROLL}], sb[{UNROLL}];
  float gr[{UNROLL}];
#pragma unroll
  for (int u = 0; u < {UNROLL}; ++u) {{
    const int i = base + u * {THREADS};
    const bool ok = i < {items};
    cw[u] = ok ? codes[i] : 0u;
    sb[u] = ok ? (unsigned)scales[i >> 1] : 0u;
    gr[u] = ok ? g[i / {per_row}] : 0.f;
  }}
#pragma unroll
  for (int u = 0; u < {UNROLL}; ++u) {{
    const int i = base + u * {THREADS};
    if (i >= {items}) continue;
    // the block scale as bf16 s * 2^119 in both halves (gemv.py ninfer_nvfp4_dq32: E4M3 bits shifted into bf16
    // are s * 2^-120, exact for E4M3 subnormals too, then * 2^120 * 2^119)
    unsigned t = ((sb[u] << 4) & 0x7F0u) | ((sb[u] << 20) & 0x7F00000u);
    const unsigned s = ninfer_dqw_bf16x2_mul(ninfer_dqw_bf16x2_mul(t, 0x7B807B80u), 0x7B007B00u);
    // pair j = (element j, element j + 4) as bf16 e2m1 * s * 2^-{NVFP4_SHIFT}, exact (<= 5 significant bits, normal)
    const unsigned w = cw[u], h = w >> 8;
    const unsigned p0 = ninfer_dqw_bf16x2_mul(((w & 0x000F000Fu) * 0x1040u) & 0x81C081C0u, s);
    const unsigned p1 = ninfer_dqw_bf16x2_mul(((w & 0x00F000F0u) * 0x104u) & 0x81C081C0u, s);
    const unsigned p2 = ninfer_dqw_bf16x2_mul(((h & 0x000F000Fu) * 0x1040u) & 0x81C081C0u, s);
    const unsigned p3 = ninfer_dqw_bf16x2_mul(((h & 0x00F000F0u) * 0x104u) & 0x81C081C0u, s);
    // exact fp32 of each half times g * 2^{NVFP4_SHIFT}: one fp32 rounding of e2m1 * e4m3 * g, as dequant.py's
    const float gs = gr[u] * {float(2 ** NVFP4_SHIFT):.1f}f;
#define LO(p) (__uint_as_float((p) << 16) * gs)
#define HI(p) (__uint_as_float((p) & 0xFFFF0000u) * gs)
    out[i] = make_uint4({pack}(LO(p0), LO(p1)), {pack}(LO(p2), LO(p3)), {pack}(HI(p0), HI(p1)),
                        {pack}(HI(p2), HI(p3)));
#undef LO
#undef HI
  }}
}}
#endif
// NINFER_ATTN_SRC_END
"""


def blocks(K: int, O: int) -> int:
    return (O * K // 8 + UNROLL * THREADS - 1) // (UNROLL * THREADS)


@lru_cache(maxsize=None)
def dequant_nvfp4(in_features: int, out_features: int, dtype: str):
    """prim_func(w[out, in/2] u8, w_scale[out, in/16] u8, w_scale_2[out] f32, out[out, in] dtype): NVFP4Linear's
    buffers dequantized as compile/kernels/dequant.py does, or None where the kernel does not apply."""
    K, O = int(in_features), int(out_features)
    if not supported(K, O, dtype):
        return None
    name = f"ninfer_dequant_nvfp4_{K}x{O}_{'bf16' if dtype == 'bfloat16' else 'f16'}"
    src = kernel_source(name, K, O, dtype)
    nb = blocks(K, O)

    @T.prim_func
    def dequant(var_w: T.handle, var_ws: T.handle, var_ws2: T.handle, var_out: T.handle):
        T.func_attr({"tirx.noalias": True})
        w = T.match_buffer(var_w, (O, K // 2), "uint8")
        ws = T.match_buffer(var_ws, (O, K // 16), "uint8")
        ws2 = T.match_buffer(var_ws2, (O,), "float32")
        out = T.match_buffer(var_out, (O, K), dtype)
        for b in T.thread_binding(nb, thread="blockIdx.x"):
            for tx in T.thread_binding(THREADS, thread="threadIdx.x"):
                T.evaluate(T.cuda.func_call(name, T.address_of(w[0, 0]), T.address_of(ws[0, 0]),
                                            T.address_of(ws2[0]), T.address_of(out[0, 0]), source_code=src))

    return dequant.with_attr("global_symbol", name[len("ninfer_"):])


__all__ = ["THREADS", "UNROLL", "dequant_nvfp4", "kernel_source", "supported"]
