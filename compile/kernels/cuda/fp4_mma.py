"""NVFP4 x NVFP4 linear on the sm_120a block-scaled FP4 tensor cores (RTX 5090 class).

    y[n, O] = x[n, K] @ W[O, K]^T      W in NVFP4: codes uint8 [O, K/2] (element 2i in the low
                                       nibble), E4M3 block scales uint8 [O, K/16], FP32 per-row
                                       global weight_scale_2 [O] (compile/kernels/dequant.py)

One thread-bound prim_func `nvfp4_linear(x, w, w_scale, w_scale_2, y)` with a run-time dispatch on
the row count n (the only dynamic dimension):

* n <= max(low_batch limits) (decode / verify rows): the generic dequant path exactly as
  gpu_pipeline schedules it today: the dequant kernel (DLight Fallback) writes W in the
  activation dtype to a workspace, then DLight LowBatchGEMV(bucket) for the first limit >= n
  (FuseOps does not fuse the injective dequant into the reduction, so the generic path
  materializes W every call too). Only elementwise consumers (residual adds) are no longer fused
  into the GEMV.
* larger n (prefill): two launches.
  1. Activation quantization, a warp per row. Per-row FP32 scale (ModelOpt's encode convention,
     applied per token): enc = 448*6 / amax_row (IEEE division), so the row's largest block scale is
     448 and every block whose amax >= amax_row * 2^-6 / 448 keeps a normal E4M3 scale; a per-token
     scale needs no cross-row reduction (one launch) and one outlier token cannot push the other
     rows' scales into E4M3 subnormals, which a per-tensor scale would. Then, per 16-block exactly
     compile/nvfp4.quantize_nvfp4(x_row, global_scale=enc): s = E4M3(fp32(amax_blk*enc)/6) (RNE,
     saturating, subnormal scales kept), code = E2M1_rne_sat((x*enc) / dec(s)) (IEEE division via
     __fdiv_rn: TVM builds with --use_fast_math). Codes / scales go to a workspace laid out for
     the MMA (K padded to 64 with zeros): xq uint32 [n, Kp/8], xs uint32 [n, Kp/64] (4 scale bytes
     per 64-wide K chunk, byte j = K columns 16j..16j+15), xd fp32 [n] = 1/enc.
  2. GEMM: block = WARPS_M x WARPS_N warps, warp tile (MT*16) x (NT*8), K in steps of 64, one
     `mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64.row.col.f32.e2m1.e2m1.f32
     .ue4m3` per (m16, n8) pair, fp32 accumulate; fragments loaded straight from global memory
     (L1/L2 serve the reuse; no shared-memory staging yet). Epilogue:
     y = dtype(acc * xd[row] * w_scale_2[col]).

Fragment layouts (CUTLASS cute/atom/mma_traits_sm120.hpp SM120_16x8x64_TN_VS, shipped in the TVM
wheel under tvm/3rdparty/cutlass; PTX ISA "Matrix Fragments for mma.m16n8k64"), lane = 4*g + t:
  A reg i (i<4): row g + 8*(i&1), K columns 8t..8t+7 (+32 if i>=2)    8 nibbles, low k low nibble
  B reg j (j<2): col g,            K rows    8t..8t+7 (+32 if j==1)
  SFA: row g + 8*(lane&1) (thread-id-a 0 reads lanes t in {0,1}), SFB: col g; byte-id 0, the
       four scale bytes of the 64-wide chunk in one .b32
  C/D reg e: row g + 8*(e>>1), col 2t + (e&1)
tests/test_fp4_mma.py emulates exactly these per-lane loads and the quantizer in numpy.

The asm only assembles for sm_120a/sm_121a: compile/targets.py:cuda_build_env makes nvcc emit an
sm_120a cubin for cuda:sm_120 builds (the TVM target arch stays "sm_120" for DLight).
"""
from __future__ import annotations

import functools

from tvm import te, tirx
from tvm.script import tirx as T

from ..attention_quant import e2m1_encode, e4m3_decode_abs, e4m3_encode_abs

FP4_MMA_OP = "kind::mxf4nvf4"  # what the PTX / CUDA source of a library using this kernel contains
E4M3_MAX = 448.0
E2M1_MAX = 6.0
ROW_SCALE_CAP = 1.0e38  # a subnormal row amax would give an infinite scale

# One source string per helper: TVM emits a func_call's source once per function name.
_LD_U32 = r"""
__device__ __forceinline__ unsigned ninfer_ld_u32(const unsigned char* p) {
  return *reinterpret_cast<const unsigned*>(p);
}
"""
_MMA_NVF4_TEMPLATE = r"""
__device__ __forceinline__ void NAME(float* d, unsigned a0, unsigned a1, unsigned a2,
    unsigned a3, unsigned b0, unsigned b1, unsigned sfa, unsigned sfb) {
  // D += (A * SFA) (B * SFB); A 16x64 row, B 64x8 col, E2M1 with UE4M3 scales per 16 K (sm_120a)
  asm volatile(
    "mma.sync.aligned.kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64.row.col.f32.e2m1.e2m1.f32.ue4m3 "
    "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3}, {%10}, {%11,%12}, {%13}, {%14,%15};\n"
    : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
    : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1),
      "r"(sfa), "h"((unsigned short)0), "h"((unsigned short)0),
      "r"(sfb), "h"((unsigned short)0), "h"((unsigned short)0));
}
"""


def mma_nvf4_source(name: str) -> str:
    """CUDA text of the device function `name(d, a0..a3, b0, b1, sfa, sfb)`: one block-scaled m16n8k64 FP4 MMA
    with the fragment layouts above (the NVFP4 GEMM here and the sm_120 attention's Q K^T share it)."""
    return _MMA_NVF4_TEMPLATE.replace("NAME", name)


_MMA_NVF4 = mma_nvf4_source("ninfer_mma_nvf4")


def _u32(v):
    return tirx.const(v, "uint32")


def _fdiv_rn(a, b):
    """IEEE round-to-nearest fp32 division (TVM builds CUDA with --use_fast_math)."""
    return tirx.call_pure_extern("float32", "__fdiv_rn", a, b)


def _abs_bits(x):
    """|x| as uint32 bits; NaN -> 0 (ignored by amax, like compile/nvfp4.py)."""
    au = tirx.reinterpret("uint32", x) & _u32(0x7FFFFFFF)
    return tirx.Select(au > _u32(0x7F800000), _u32(0), au)


def _code(x, scale):
    return tirx.Select(scale > tirx.const(0.0, "float32"), e2m1_encode(_fdiv_rn(x, scale)), _u32(0))


def _ld_u32(ptr):
    return T.cuda.func_call("ninfer_ld_u32", ptr, source_code=_LD_U32, return_type="uint32")


# ---------------------------------------------------------------------------- fragment indexing
# Shared by the TIR kernel below (lane / register arguments are PrimExprs there) and the numpy
# emulation in tests/test_fp4_mma.py (plain ints). `word` = uint32 index inside one 64-wide K
# chunk of a packed row (8 E2M1 codes per word, the lowest K in the lowest nibble).

def a_frag(lane, i):
    """A register i of `lane`: (row in the m16 tile, word in the K chunk)."""
    return lane // 4 + (i % 2) * 8, lane % 4 + (i // 2) * 4


def b_frag(lane, j):
    """B register j of `lane`: (column in the n8 tile = weight row, word in the K chunk)."""
    return lane // 4, lane % 4 + j * 4


def sfa_row(lane):
    """Row whose 4 scale bytes `lane` passes as scale-a-data (thread-id-a 0 reads lanes t=0,1)."""
    return lane // 4 + (lane % 2) * 8


def sfb_col(lane):
    """Column whose 4 scale bytes `lane` passes as scale-b-data."""
    return lane // 4


def c_frag(lane, e):
    """Accumulator register e of `lane`: (row in the m16 tile, column in the n8 tile)."""
    return lane // 4 + (e // 2) * 8, (lane % 4) * 2 + e % 2


def padded_k(in_features: int) -> int:
    return (in_features + 63) // 64 * 64


def _mma_body(in_features: int, out_features: int, dtype: str, *, warps_m: int, warps_n: int, mt: int, nt: int,
              quant_rows: int):
    """The prefill path alone: prim_func(x, w, w_scale, w_scale_2, y), quantize + MMA launches."""
    K, O = in_features, out_features
    if K % 16:
        raise ValueError(f"NVFP4 needs in_features % 16 == 0, got {K}")
    KP = padded_k(K)
    KC = KP // 64  # 64-wide K chunks
    W8 = KP // 8  # uint32 code words per activation row
    NBLK = K // 16
    BM, BN = warps_m * mt * 16, warps_n * nt * 8
    NWARP = warps_m * warps_n
    QR = quant_rows
    AMAX_IT = (K + 31) // 32
    CH_IT = (KC + 31) // 32
    k_tail = K % 64 != 0  # last chunk partly beyond K: mask weight words / scale bytes

    def row0(by, wy, mi):
        return by * BM + (wy // warps_n) * (mt * 16) + mi * 16

    def col0(bx, wy, nj):
        return bx * BN + (wy % warps_n) * (nt * 8) + nj * 8

    def a_word(xq, n, r0, kc, ln, i):
        row, word = a_frag(ln, i)
        return T.if_then_else(r0 + row < n, xq[(r0 + row) * W8 + kc * 8 + word], _u32(0))

    def a_scales(xs, n, r0, kc, ln):
        return T.if_then_else(r0 + sfa_row(ln) < n, xs[(r0 + sfa_row(ln)) * KC + kc], _u32(0))

    def b_word(w, c0, kc, ln, j):
        col, word = b_frag(ln, j)
        ok = c0 + col < O
        if k_tail:  # K % 16 == 0: a word (8 K) is wholly inside or outside K
            ok = tirx.And(ok, kc * 64 + word * 8 < K)
        return T.if_then_else(ok, _ld_u32(T.address_of(w[c0 + col, kc * 32 + word * 4])), _u32(0))

    def b_scales(ws, c0, kc, ln):
        o = c0 + sfb_col(ln)
        if not k_tail:  # rows of K/16 bytes are a whole number of aligned words
            return T.if_then_else(o < O, _ld_u32(T.address_of(ws[o, kc * 4])), _u32(0))
        word = _u32(0)
        for j in range(4):
            byte = T.if_then_else(tirx.And(o < O, kc * 4 + j < NBLK), T.Cast("uint32", ws[o, kc * 4 + j]), _u32(0))
            word = word | (byte << _u32(8 * j))
        return word

    def out_ok(n, r0, c0, ln, e):
        row, col = c_frag(ln, e)
        return tirx.And(r0 + row < n, c0 + col < O)

    def out_val(acc_v, xd, ws2, r0, c0, ln, e):
        row, col = c_frag(ln, e)
        return T.Cast(dtype, acc_v * xd[r0 + row] * ws2[c0 + col])

    def y_store(y, r0, c0, ln, e, val):
        row, col = c_frag(ln, e)
        return T.buffer_store(y, val, [r0 + row, c0 + col])

    @T.prim_func(private=True)
    def mma(var_x: T.handle, var_w: T.handle, var_ws: T.handle, var_ws2: T.handle, var_y: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, K), dtype)
        w = T.match_buffer(var_w, (O, K // 2), "uint8")
        ws = T.match_buffer(var_ws, (O, K // 16), "uint8")
        ws2 = T.match_buffer(var_ws2, (O,), "float32")
        y = T.match_buffer(var_y, (n, O), dtype)
        xq = T.alloc_buffer((n * W8,), "uint32", scope="global")
        xs = T.alloc_buffer((n * KC,), "uint32", scope="global")
        xd = T.alloc_buffer((n,), "float32", scope="global")
        # ---- 1. quantize the activation rows (warp per row) ----------------------------------------
        for bq in T.thread_binding((n + QR - 1) // QR, thread="blockIdx.x"):
            for ty in T.thread_binding(QR, thread="threadIdx.y"):
                for ln in T.thread_binding(32, thread="threadIdx.x"):
                    ab = T.alloc_buffer((1,), "uint32", scope="local")
                    gs = T.alloc_buffer((1,), "float32", scope="local")
                    bb = T.alloc_buffer((1,), "uint32", scope="local")
                    sfq = T.alloc_buffer((1,), "float32", scope="local")
                    sw = T.alloc_buffer((1,), "uint32", scope="local")
                    cw = T.alloc_buffer((2,), "uint32", scope="local")
                    xv = T.alloc_buffer((16,), "float32", scope="local")
                    if bq * QR + ty < n:  # warp-uniform
                        ab[0] = T.uint32(0)
                        for e0 in range(AMAX_IT):
                            if e0 * 32 + ln < K:
                                ab[0] = T.max(ab[0], _abs_bits(T.Cast("float32", x[bq * QR + ty, e0 * 32 + ln])))
                        for o in T.unroll(5):
                            ab[0] = T.max(ab[0], T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), ab[0], 16 >> o, 32, 32))
                        gs[0] = row_encode_scale(T.reinterpret("float32", ab[0]))
                        if ln == 0:
                            xd[bq * QR + ty] = _fdiv_rn(T.float32(1.0), gs[0])
                        for c0 in range(CH_IT):
                            if c0 * 32 + ln < KC:
                                sw[0] = T.uint32(0)
                                for blk in T.unroll(4):
                                    cw[0] = T.uint32(0)
                                    cw[1] = T.uint32(0)
                                    if (c0 * 32 + ln) * 64 + blk * 16 < K:
                                        bb[0] = T.uint32(0)
                                        for e in T.unroll(16):
                                            xv[e] = T.Cast("float32", x[bq * QR + ty, (c0 * 32 + ln) * 64 + blk * 16 + e]) * gs[0]
                                            bb[0] = T.max(bb[0], _abs_bits(xv[e]))
                                        bb[0] = e4m3_encode_abs(_fdiv_rn(T.reinterpret("float32", bb[0]), T.float32(6.0)))
                                        sfq[0] = e4m3_decode_abs(bb[0])
                                        sw[0] = sw[0] | (bb[0] << T.Cast("uint32", blk * 8))
                                        for h in T.unroll(2):
                                            for e in T.unroll(8):
                                                cw[h] = cw[h] | (_code(xv[h * 8 + e], sfq[0]) << T.uint32(4 * e))
                                    for h in T.unroll(2):
                                        xq[(bq * QR + ty) * W8 + (c0 * 32 + ln) * 8 + blk * 2 + h] = cw[h]
                                xs[(bq * QR + ty) * KC + c0 * 32 + ln] = sw[0]
        # ---- 2. block-scaled FP4 MMA ---------------------------------------------------------------
        for bx in T.thread_binding((O + BN - 1) // BN, thread="blockIdx.x"):
            for by in T.thread_binding((n + BM - 1) // BM, thread="blockIdx.y"):
                for wy in T.thread_binding(NWARP, thread="threadIdx.y"):
                    for ln in T.thread_binding(32, thread="threadIdx.x"):
                        acc = T.alloc_buffer((mt * nt * 4,), "float32", scope="local")
                        a = T.alloc_buffer((mt * 5,), "uint32", scope="local")
                        b = T.alloc_buffer((nt * 3,), "uint32", scope="local")
                        for i in T.unroll(mt * nt * 4):
                            acc[i] = T.float32(0)
                        for kc in range(KC):
                            for mi in T.unroll(mt):
                                for i in T.unroll(4):
                                    a[mi * 5 + i] = a_word(xq, n, row0(by, wy, mi), kc, ln, i)
                                a[mi * 5 + 4] = a_scales(xs, n, row0(by, wy, mi), kc, ln)
                            for nj in T.unroll(nt):
                                for j in T.unroll(2):
                                    b[nj * 3 + j] = b_word(w, col0(bx, wy, nj), kc, ln, j)
                                b[nj * 3 + 2] = b_scales(ws, col0(bx, wy, nj), kc, ln)
                            for mi in T.unroll(mt):
                                for nj in T.unroll(nt):
                                    T.evaluate(T.cuda.func_call(
                                        "ninfer_mma_nvf4", T.address_of(acc[(mi * nt + nj) * 4]),
                                        a[mi * 5], a[mi * 5 + 1], a[mi * 5 + 2], a[mi * 5 + 3],
                                        b[nj * 3], b[nj * 3 + 1], a[mi * 5 + 4], b[nj * 3 + 2],
                                        source_code=_MMA_NVF4))
                        for mi in T.unroll(mt):
                            for nj in T.unroll(nt):
                                for e in T.unroll(4):
                                    if out_ok(n, row0(by, wy, mi), col0(bx, wy, nj), ln, e):
                                        y_store(y, row0(by, wy, mi), col0(bx, wy, nj), ln, e,
                                                out_val(acc[(mi * nt + nj) * 4 + e], xd, ws2, row0(by, wy, mi),
                                                        col0(bx, wy, nj), ln, e))

    return mma


def row_encode_scale(amax):
    """Encode-side per-row scale 448*6/amax (IEEE division, capped finite; 1 for amax == 0)."""
    return tirx.Select(tirx.reinterpret("uint32", amax) > _u32(0),
                       tirx.min(_fdiv_rn(tirx.const(E4M3_MAX * E2M1_MAX, "float32"), amax),
                                tirx.const(ROW_SCALE_CAP, "float32")),
                       tirx.const(1.0, "float32"))


def _int64(v: int):
    return tirx.IntImm("int64", v)


def dequant_te(in_features: int, out_features: int, dtype: str):
    """prim_func(w, w_scale, w_scale_2, wd[O, K] dtype): the generic path's dequant kernel."""
    from ..dequant import dequant_compute

    K, O = _int64(in_features), _int64(out_features)  # relax shapes are int64
    c = te.placeholder((O, _int64(in_features // 2)), "uint8", name="w")
    s = te.placeholder((O, _int64(in_features // 16)), "uint8", name="w_scale")
    g = te.placeholder((O,), "float32", name="w_scale_2")
    return te.create_prim_func([c, s, g, dequant_compute(c, s, g, O, K, dtype)])


def matmul_te(in_features: int, out_features: int, dtype: str):
    """prim_func(x[n, K], wd[O, K], y[n, O]): fp32 NT matmul + cast, as relax legalizes
    matmul(x, permute_dims(wd), out_dtype="float32").astype(dtype)."""
    K, O = _int64(in_features), _int64(out_features)
    n = tirx.Var("n", "int64")
    x = te.placeholder((n, K), dtype, name="x")
    wd = te.placeholder((O, K), dtype, name="wd")
    k = te.reduce_axis((0, K), name="k")
    acc = te.compute((n, O), lambda i, o: te.sum(x[i, k].astype("float32") * wd[o, k].astype("float32"), axis=k),
                     name="NT_matmul")
    y = acc if dtype == "float32" else te.compute((n, O), lambda i, o: acc[i, o].astype(dtype), name="y")
    return te.create_prim_func([x, wd, y])


def _remap(func, new_params):
    """Body of `func` with its parameter buffers replaced by `new_params` (buffer Vars, same
    order) and its symbolic shape vars by theirs."""
    from tvm.tirx.transform.common import BufferReplacer

    bmap = dict(zip(func.params, new_params))
    vmap = {}
    for old, new in bmap.items():
        for so, sn in zip(old.ty.shape, new.ty.shape):
            if isinstance(so, tirx.Var):
                vmap[so] = sn
    return BufferReplacer(buffer_map=bmap, var_map=vmap)(func.body)


def _schedule(func, target, rule):
    from tvm.s_tir.dlight.base.transform import _apply_rules

    sch = _apply_rules(func, target, [rule], tunable=False)
    if sch is None:
        raise RuntimeError(f"DLight {type(rule).__name__} does not apply to {func}")
    return sch[0].mod["main"]


@functools.lru_cache(maxsize=None)
def nvfp4_mma_linear(in_features: int, out_features: int, dtype: str, *, target=None,
                     low_batch: tuple = ((1, 1), (4, 4), (8, 8)), warps_m: int = 2, warps_n: int = 2, mt: int = 2,
                     nt: int = 4, quant_rows: int = 4):
    """prim_func nvfp4_linear(x[n,K], w[O,K/2] u8, w_scale[O,K/16] u8, w_scale_2[O] f32, y[n,O]).

    n <= max(low_batch limits): the generic path as gpu_pipeline would schedule it, i.e. the
    dequant kernel (DLight Fallback) into a bf16 workspace, then DLight LowBatchGEMV(bucket) for
    the first limit >= n (scheduled here for `target`, the CUDA sm_120 Target). Larger n: the FP4
    MMA path (activation quantization + block-scaled MMA). Empty low_batch: MMA for every n."""
    from tvm import s_tir
    from tvm.s_tir import dlight as dl

    mma = _mma_body(in_features, out_features, dtype, warps_m=warps_m, warps_n=warps_n, mt=mt, nt=nt,
                    quant_rows=quant_rows)
    body = mma.body
    if low_batch:
        if target is None:
            raise ValueError("the low_batch versions need the CUDA target to schedule them for")
        x, w, ws, ws2, y = mma.params
        n = x.ty.shape[0]
        wd = tirx.decl_buffer((_int64(out_features), _int64(in_features)), dtype, "wd", scope="global")
        small = None
        for limit, bucket in sorted(((int(lim), int(b)) for lim, b in low_batch), reverse=True):
            gemv = _remap(_schedule(matmul_te(in_features, out_features, dtype), target, dl.gpu.LowBatchGEMV(bucket)),
                          [x, wd, y])
            small = gemv if small is None else tirx.IfThenElse(tirx.op.tvm_thread_invariant(n <= limit), gemv, small)
        deq = _remap(_schedule(dequant_te(in_features, out_features, dtype), target, dl.gpu.Fallback()),
                     [w, ws, ws2, wd])
        lb_max = max(int(lim) for lim, _ in low_batch)
        body = tirx.IfThenElse(tirx.op.tvm_thread_invariant(n <= lb_max),
                               tirx.SeqStmt([tirx.AllocBuffer(wd), deq, small]), body)
        body = s_tir.SBlockRealize([], True, s_tir.SBlock([], [], [], "root", body))
    return mma.with_body(body).with_attr("tirx.is_scheduled", True)
