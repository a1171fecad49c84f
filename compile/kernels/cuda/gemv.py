"""CUDA small-batch GEMV for the decode projections (thread-bound TIR).

  gemv(x[n,K], w[O,K], [res[n,Oo]], out[n,Oo]):  y = x @ w^T accumulated in fp32, then an epilogue
    "none"      out = cast(y)
    "residual"  out = cast(res + cast(y))          (the decoder's x + proj(h), one launch)
    "silu_mul"  out = cast(silu(y[:, :O/2]) * y[:, O/2:])   (MLP gate_up; Oo = O/2)
  x, w, res share the activation dtype; out is that dtype, or float32 (lm_head).

Tensor-core path (bf16 / f16 weights, K % 8 == 0): a warp owns a tile of 16 weight rows and runs
mma.sync m16n8k16 (fp32 accumulators) with the weight tile as A and 8 batch rows as B. Lane
(g = lane/4, q = lane%4) loads 16 bytes (8 elements) of weight rows g and g+8 and of x row g at
k = k0 + 8q: K is summed in a permuted order (element 4j+{0,1} of the chunk goes to mma slot 2q+{0,1}
of step j, 4j+{2,3} to slot 2q+8+{0,1}) that is the same for A and B, so no shuffles or shared-memory
staging are needed and each weight byte is loaded once, 16 bytes per lane (ld.global.nc with
L1::no_allocate: the weight streams past L1, where x stays). Rows g and g+8 are rows 16t+g and
16t+8+g, or for silu_mul the gate row 8t+g and its up row O/2+8t+g, so the epilogue pairs them in
one thread. The cost is independent of n <= 8 (unused B columns are zeros).
  grid (tiles), block NW warps splitting K (warp w takes chunks w, w+NW, ... of 32*U elements);
  the NW partial 16x8 tiles are summed in shared memory, then the epilogue threads write out.
  NW ~ target_warps / tiles (mma_warps), and __launch_bounds__(32*NW, blocks per SM for the grid to
  be resident at once on `sms` SMs) so that ptxas issues an iteration's 2U+U loads before its mma
  chain (without the minimum it interleaves them to save registers; checked in the SASS).
Batches n > 8 take a second launch (host-side branch on n) with `big_tiles` 8-row batch tiles
per pass (more accumulators, weights read once per pass of 8*big_tiles rows).
Parameters: schedules/cuda_<arch>.json "kernels.gemv" (registry.DEFAULT_KERNELS).
gemv_rows: the same kernel (epilogue "none") over a weight whose row count m is a run-time shape (the shortlisted MTP
head, compile/model.py mtp_step_hd): grid ceil(m / 16) tiles, every row predicated, warps per block and launch
bounds planned for m = ROWS_PLAN.

FMA path (float32 weights, or K % 8 != 0): 4 weight rows x 8 batch rows per block, lanes stride
over K (coalesced scalar loads), warp-shuffle then shared-memory reduction; any n in passes of 8.

NVFP4 weights (gemv_nvfp4, or gemv(..., weight_format="nvfp4"); NVFP4Linear's buffers: codes u8 [O, K/2]
with element 2i in the low nibble, E4M3 block scales u8 [O, K/16], fp32 row scales g [O]):
  the same tiles, epilogues and n <= 8 / n > 8 launches, with the dequantization in registers. Lane
  (g, q) loads 16 bytes = 32 codes of rows g and g+8 at k = k0 + 32q (unroll steps of 128 K per warp),
  their two scale bytes (one u16) and the 32 matching x elements (4 x 16 bytes). ninfer_nvfp4_dq32 turns
  the codes into 16 bf16x2 A words, pair i of code word m = (element 8m+i, element 8m+i+4): each pair is
  a masked nibble pair times 2^6 + 2^12, masked again (the bf16 bits of e2m1 * 2^-126, 0.5 being the
  subnormal 0x0040), then one bf16x2 multiply by the block scale * 2^119 (from the E4M3 byte shifted into
  bf16, exact for E4M3 subnormals too, times 2^120 and 2^119). The products e2m1 * s * 2^-7 have <= 5
  significant bits and stay normal, so the bf16 weights are exact (today's dequant path rounds
  e2m1 * s * g to bf16; this one is closer to the fp32 reference) and the epilogue multiplies the fp32 sum
  by g * 2^7. x words are re-paired with one byte_perm each to the same K order, so the mma.sync
  m16n8k16 chain is the bf16 kernel's. About 3 ALU/FMA-pipe instructions per weight element (SASS).
  Other dtypes or K % 32 != 0: the FMA layout, each element dequantized exactly as dequant.py does.
  The kernel is bound by weight bytes in flight per SM, not by issue (Little's law: ~14 warps x 2 KiB per
  iteration = 28 KiB per SM at a loaded latency of ~3500 clocks gives the measured ~2.2 TB/s; the bf16 kernel
  keeps 2x that in flight). So by default (n <= 8, K % 64 == 0) each warp streams its codes and scale words
  through a ring of `stages` iterations in shared memory by cp.async (stages - 1 iterations in flight without
  holding registers; a lane reads back only its own slots, so cp.async.wait_group orders them and no barrier
  is needed): ~220 SASS instructions per 1152 bytes of codes + scales per warp (196 with register loads).
  Alternatives measured by bench/gemv_gpu_check.py: row_tiles 16-row tiles per warp (x fragments and their
  byte_perms shared: ~179 instructions per 1152 bytes at two), prefetch (a second register buffer, the next
  iteration's loads before this one's math).
  x_late: each step's x words are loaded at its mma chain instead of with the weights, so only the weight codes
  wait on DRAM in registers (more of them in flight per register; with prefetch, the next iteration's codes).
  A TMA ring (a producer warp streaming stages into shared memory with bulk copies on mbarriers, consumers never
  waiting on DRAM) was measured slower on every shape (run 7: 1500-2240 GB/s): the compute warps' issue, not the
  bytes in flight, bounds this dequantization.
  Parameters: NVFP4_DEFAULTS (unroll / big_unroll in 128-element K steps, big_tiles, stages; big_row_tiles,
  prefetch, big_prefetch, x_late off), overridden per shape by nvfp4_shape_params (measured) + the kernel set's
  min/max/target_warps, fma_warps and sms.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from tvm import tirx
from tvm.script import tirx as T

EPILOGUES = ("none", "residual", "silu_mul")
_MMA_TYPES = {"bfloat16": "bf16", "float16": "f16"}


def _mma_source(dtype: str) -> tuple[str, str]:
    t = _MMA_TYPES[dtype]
    name = f"ninfer_gemv_mma_{t}"
    src = (
        f"__device__ __forceinline__ void {name}(float* d, unsigned a0, unsigned a1, unsigned a2, unsigned a3,"
        " unsigned b0, unsigned b1) {\n"
        f'  asm("mma.sync.aligned.m16n8k16.row.col.f32.{t}.{t}.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, '
        '{%8,%9}, {%0,%1,%2,%3};\\n"\n'
        '      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])\n'
        '      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));\n'
        "}\n"
    )
    return name, src


# 16-byte loads, predicated inside the asm (no branch: the loads of an iteration stay one straight
# block that ptxas can issue back to back); a false predicate gives zeros and touches no memory.
# Weights stream past L1 (no_allocate) with a 256-byte L2 prefetch; x is cached in L1 (re-read by
# every tile of the SM).
_LDG_W = "ninfer_gemv_ldg_w"
_LDG_X = "ninfer_gemv_ldg_x"


def _ldg_source(name: str, qual: str) -> str:
    return (
        f"__device__ __forceinline__ uint4 {name}(const void* p, int pred) {{\n"
        "  uint4 r = make_uint4(0u, 0u, 0u, 0u);\n"
        '  asm("{\\n .reg .pred q;\\n setp.ne.b32 q, %5, 0;\\n'
        f' @q ld.global.nc{qual}.v4.u32 {{%0,%1,%2,%3}}, [%4];\\n}}"\n'
        '      : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w) : "l"(p), "r"(pred));\n'
        "  return r;\n"
        "}\n"
    )


_LDG_W_SRC = _ldg_source(_LDG_W, ".L1::no_allocate.L2::256B")
_LDG_X_SRC = _ldg_source(_LDG_X, "")

# RMS-normed input (gemv(..., norm_eps)): one bf16x2 x word -> its squares added to *ss (fp32, before the weight)
# and the word times the norm weight (g0, g1: fp32 bits), rounded to bf16 (nearest even) for the mma
_RMS_X = "ninfer_gemv_rms_x_bf16"
_RMS_X_SRC = (
    "__device__ __forceinline__ unsigned ninfer_gemv_rms_x_bf16(unsigned x, unsigned g0, unsigned g1, float* ss) {\n"
    "  float lo = __uint_as_float(x << 16), hi = __uint_as_float(x & 0xffff0000u);\n"
    "  *ss = *ss + (lo * lo + hi * hi);\n"
    "  unsigned a = __float_as_uint(lo * __uint_as_float(g0)), b = __float_as_uint(hi * __uint_as_float(g1));\n"
    "  a = (a + 0x7fffu + ((a >> 16) & 1u)) >> 16;\n"
    "  b = (b + 0x7fffu + ((b >> 16) & 1u)) & 0xffff0000u;\n"
    "  return a | b;\n"
    "}\n")

# cp.async global -> shared (NVFP4 staged path): 16 bytes (.cg, L2 prefetch as the weight loads) or 4 bytes (.ca);
# a false predicate zero-fills and reads nothing. One source string per helper (TVM emits each name's once).
_CP16 = "ninfer_gemv_cp16"
_CP16_SRC = (
    "__device__ __forceinline__ void ninfer_gemv_cp16(void* dst, const void* src, int pred) {\n"
    "  unsigned a = (unsigned)__cvta_generic_to_shared(dst);\n"
    '  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;\\n" :: "r"(a), "l"(src), '
    '"r"(pred ? 16 : 0) : "memory");\n'
    "}\n")
_CP4 = "ninfer_gemv_cp4"
_CP4_SRC = (
    "__device__ __forceinline__ void ninfer_gemv_cp4(void* dst, const void* src, int pred) {\n"
    "  unsigned a = (unsigned)__cvta_generic_to_shared(dst);\n"
    '  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\\n" :: "r"(a), "l"(src), '
    '"r"(pred ? 4 : 0) : "memory");\n'
    "}\n")
_CP_COMMIT = "ninfer_gemv_cp_commit"
_CP_COMMIT_SRC = ('__device__ __forceinline__ void ninfer_gemv_cp_commit() { asm volatile("cp.async.commit_group;\\n" '
                  '::: "memory"); }\n')


def _cp_wait(pending: int) -> tuple[str, str]:
    """cp.async.wait_group <pending>: (name, source)."""
    name = f"ninfer_gemv_cp_wait{pending}"
    return name, (f'__device__ __forceinline__ void {name}() {{ asm volatile("cp.async.wait_group {pending};\\n" '
                  '::: "memory"); }\n')


def mma_warps(K: int, O: int, epilogue: str, *, unroll: int, min_warps: int, max_warps: int,
              target_warps: int) -> int:
    """Warps per block (splitting K) of the tensor-core path: target_warps // tiles within
    [min_warps, max_warps], and no more than there are K chunks.

    Every block lives for most of the kernel (its share of the bandwidth is total / resident
    blocks), so a grid that overflows one wave leaves a tail of late blocks with too few loads in
    flight; target_warps keeps the grid of mid-size shapes resident at once (about 16 warps per SM on
    132 SMs), while huge grids (lm_head) run many short waves with plenty in flight."""
    tiles = (O // 2 + 7) // 8 if epilogue == "silu_mul" else (O + 15) // 16
    its = (K + 32 * unroll - 1) // (32 * unroll)
    lo, hi = max(1, min_warps), max(1, min(max_warps, its))
    want = min(max(target_warps // max(1, tiles), lo), hi)
    # prefer a warp count that divides the K chunks (no K predicate: ptxas then keeps the loads of an
    # iteration ahead of the mma chain), the nearest to `want`, the larger on a tie
    divs = [d for d in range(lo, hi + 1) if its % d == 0]
    return min(divs, key=lambda d: (abs(d - want), -d)) if divs else want


def resident_blocks(tiles: int, threads: int, sms: int, min_regs: int = 80) -> int:
    """Blocks per SM for the whole grid to be resident on `sms` SMs, within the SM's thread and block
    limits and leaving ptxas at least min_regs registers per thread."""
    mb = min(-(-tiles // max(1, sms)), 32, max(1, 2048 // threads), max(1, 65536 // (min_regs * threads)))
    return max(1, mb)


def supported(K: int, O: int, dtype: str, out_dtype: str, epilogue: str) -> bool:
    if epilogue not in EPILOGUES or dtype not in ("bfloat16", "float16", "float32"):
        return False
    if out_dtype not in (dtype, "float32"):
        return False
    if epilogue == "silu_mul" and O % 2:
        return False
    if epilogue == "residual" and out_dtype != dtype:
        return False
    return K >= 1 and O >= 1


def _epilogue_value(epilogue, dtype, out_dtype, v, res_val):
    if epilogue == "residual":
        return T.Cast(out_dtype, T.Cast("float32", res_val) + T.Cast("float32", T.Cast(dtype, v)))
    return T.Cast(out_dtype, v)


def _silu_mul(dtype, out_dtype, gate, up):
    g = T.Cast("float32", T.Cast(dtype, gate))
    u = T.Cast("float32", T.Cast(dtype, up))
    return T.Cast(out_dtype, g / (T.float32(1) + T.exp(-g)) * u)


def _entry(K, O, OO, dtype, out_dtype, has_res, nvfp4, run, norm=False):
    """The kernel's prim_func: x[n, K] dtype, the weight (dtype [O, K], or NVFP4: codes u8 [O, K/2], block
    scales u8 [O, K/16], row scales f32 [O]), [res[n, OO]], out[n, OO] out_dtype; its body is the macro
    run(n, x, w, ws, ws2, res, out) (ws, ws2 / res None where absent). norm: x[n, K], g[K] f32 (the RMSNorm
    weight, passed to run as ws), w, [res], out."""
    if norm and has_res:
        @T.prim_func
        def gemv(var_x: T.handle, var_g: T.handle, var_w: T.handle, var_res: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(var_x, (n, K), dtype)
            g = T.match_buffer(var_g, (K,), "float32")
            w = T.match_buffer(var_w, (O, K), dtype)
            res = T.match_buffer(var_res, (n, OO), dtype)
            out = T.match_buffer(var_out, (n, OO), out_dtype)
            run(n, x, w, g, None, res, out)
    elif norm:
        @T.prim_func
        def gemv(var_x: T.handle, var_g: T.handle, var_w: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(var_x, (n, K), dtype)
            g = T.match_buffer(var_g, (K,), "float32")
            w = T.match_buffer(var_w, (O, K), dtype)
            out = T.match_buffer(var_out, (n, OO), out_dtype)
            run(n, x, w, g, None, None, out)
    elif nvfp4 and has_res:
        @T.prim_func
        def gemv(var_x: T.handle, var_w: T.handle, var_ws: T.handle, var_ws2: T.handle, var_res: T.handle,
                 var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(var_x, (n, K), dtype)
            w = T.match_buffer(var_w, (O, K // 2), "uint8")
            ws = T.match_buffer(var_ws, (O, K // 16), "uint8")
            ws2 = T.match_buffer(var_ws2, (O,), "float32")
            res = T.match_buffer(var_res, (n, OO), dtype)
            out = T.match_buffer(var_out, (n, OO), out_dtype)
            run(n, x, w, ws, ws2, res, out)
    elif nvfp4:
        @T.prim_func
        def gemv(var_x: T.handle, var_w: T.handle, var_ws: T.handle, var_ws2: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(var_x, (n, K), dtype)
            w = T.match_buffer(var_w, (O, K // 2), "uint8")
            ws = T.match_buffer(var_ws, (O, K // 16), "uint8")
            ws2 = T.match_buffer(var_ws2, (O,), "float32")
            out = T.match_buffer(var_out, (n, OO), out_dtype)
            run(n, x, w, ws, ws2, None, out)
    elif has_res:
        @T.prim_func
        def gemv(var_x: T.handle, var_w: T.handle, var_res: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(var_x, (n, K), dtype)
            w = T.match_buffer(var_w, (O, K), dtype)
            res = T.match_buffer(var_res, (n, OO), dtype)
            out = T.match_buffer(var_out, (n, OO), out_dtype)
            run(n, x, w, None, None, res, out)
    else:
        @T.prim_func
        def gemv(var_x: T.handle, var_w: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(var_x, (n, K), dtype)
            w = T.match_buffer(var_w, (O, K), dtype)
            out = T.match_buffer(var_out, (n, OO), out_dtype)
            run(n, x, w, None, None, None, out)
    return gemv


def _mma_rows(O, epilogue):
    """Weight rows of a tensor-core tile's A fragment rows g and g+8 (silu_mul: gate row and its up row),
    and whether they exist: (row_lo, row_hi, lo_ok, hi_ok) of (tile, g)."""
    silu = epilogue == "silu_mul"
    OO = O // 2 if silu else O

    def row_lo(tile, g):
        return tile * 8 + g if silu else tile * 16 + g

    def row_hi(tile, g):
        return OO + tile * 8 + g if silu else tile * 16 + 8 + g

    def lo_ok(tile, g):
        return tile * 8 + g < OO if silu else tile * 16 + g < O

    def hi_ok(tile, g):
        return tile * 8 + g < OO if silu else tile * 16 + 8 + g < O

    return row_lo, row_hi, lo_ok, hi_ok


def _mma_epilogue(O, dtype, out_dtype, epilogue, *, NBT, NW, NT, row_pred, scale, RT=1, norm=None):
    """The tensor-core kernels' end of a batch pass: the warps' C fragments to shared memory, summed over
    warps, scale(ws2, row, sum), the epilogue and the store. -> macro (n, ps, tile, tx, acc, part, red, ws2,
    res, out, t); part is NW * NBT * 128 fp32 shared; acc holds RT tiles' fragments, batch tile bt of tile t at
    (bt * RT + t) * 4. norm (K, eps): the input rows were RMS-normed in the kernel (gemv(..., norm_eps)); part
    then holds NW * NBT * 32 more floats after the fragments, each lane's sum of squares of its x row (written
    by the body before this pass), and every sum is divided by sqrt(mean of squares + eps) of its batch row
    (red[2])."""
    silu = epilogue == "silu_mul"
    has_res = epilogue == "residual"
    NB = 8 * NBT
    NE = NBT * (64 if silu else 128)  # epilogue entries per pass
    NEP = (NE + NT - 1) // NT
    row_lo, row_hi, lo_ok, _ = _mma_rows(O, epilogue)
    SQ = NW * NBT * 128  # start of the sums of squares in part (norm)

    if norm is None:
        @T.macro
        def rms_of(red, part, lb):
            T.evaluate(0)
    else:
        NK, EPS = norm

        @T.macro
        def rms_of(red, part, lb):
            """red[2] = sqrt(mean(x^2) + eps) of the pass's batch row lb: its lanes' (q = 0..3) and warps' sums"""
            red[2] = T.float32(0)
            for w in range(NW):
                for q in T.unroll(4):
                    red[2] = red[2] + part[SQ + (w * NBT + lb // 8) * 32 + lb % 8 * 4 + q]
            red[2] = T.sqrt(red[2] / T.float32(NK) + T.float32(EPS))

    def normed(red, i):
        return red[i] if norm is None else red[i] / red[2]

    def part_index(w, bt, lane, i):
        return ((w * NBT + bt) * 32 + lane) * 4 + i

    # plain / residual entry e (< NBT*128): (bt, lane l, i) -> row slot l/4 + 8*(i//2), col 2(l%4) + i%2
    def p_part(w, e):
        return part_index(w, e // 128, e % 128 // 4, e % 4)

    def p_b(ps, e):
        return T.Cast("int64", ps * NB + e // 128 * 8 + e % 128 // 4 % 4 * 2 + e % 2)

    def p_row(tile, e):
        return tile * 16 + e % 128 // 16 + e % 4 // 2 * 8

    # silu entry e (< NBT*64): (bt, lane l, j): gate = (slot l/4, col 2(l%4)+j), up = slot + 8
    def s_part(w, e, up):
        return part_index(w, e // 64, e % 64 // 2, e % 2 + 2 * up)

    def s_b(ps, e):
        return T.Cast("int64", ps * NB + e // 64 * 8 + e % 64 // 2 % 4 * 2 + e % 2)

    def s_slot(e):
        return e % 64 // 8

    @T.macro
    def epilogue_pass(n, ps, tile, tx, acc, part, red, ws2, res, out, t):
        # C fragment: acc[(bt*RT + t)*4 + i] = (row slot g + 8*(i//2), batch col 2q + i%2)
        for bt in T.unroll(NBT):
            for i in T.unroll(4):
                part[part_index(tx // 32, bt, tx % 32, i)] = acc[(bt * RT + t) * 4 + i]
        T.tvm_storage_sync("shared")
        for e0 in range(NEP):
            if e0 * NT + tx < NE:
                if silu:
                    red[0] = T.float32(0)
                    red[1] = T.float32(0)
                    for w in range(NW):
                        red[0] = red[0] + part[s_part(w, e0 * NT + tx, 0)]
                        red[1] = red[1] + part[s_part(w, e0 * NT + tx, 1)]
                    rms_of(red, part, s_b(0, e0 * NT + tx))
                    if s_b(ps, e0 * NT + tx) < n and (lo_ok(tile, s_slot(e0 * NT + tx)) if row_pred else True):
                        out[s_b(ps, e0 * NT + tx), row_lo(tile, s_slot(e0 * NT + tx))] = _silu_mul(
                            dtype, out_dtype,
                            scale(ws2, row_lo(tile, s_slot(e0 * NT + tx)), normed(red, 0)),
                            scale(ws2, row_hi(tile, s_slot(e0 * NT + tx)), normed(red, 1)))
                else:
                    red[0] = T.float32(0)
                    for w in range(NW):
                        red[0] = red[0] + part[p_part(w, e0 * NT + tx)]
                    rms_of(red, part, p_b(0, e0 * NT + tx))
                    if p_b(ps, e0 * NT + tx) < n and (p_row(tile, e0 * NT + tx) < O if row_pred else True):
                        if has_res:
                            out[p_b(ps, e0 * NT + tx), p_row(tile, e0 * NT + tx)] = _epilogue_value(
                                epilogue, dtype, out_dtype, scale(ws2, p_row(tile, e0 * NT + tx), normed(red, 0)),
                                res[p_b(ps, e0 * NT + tx), p_row(tile, e0 * NT + tx)])
                        else:
                            out[p_b(ps, e0 * NT + tx), p_row(tile, e0 * NT + tx)] = T.Cast(
                                out_dtype, scale(ws2, p_row(tile, e0 * NT + tx), normed(red, 0)))
        T.tvm_storage_sync("shared")

    return epilogue_pass


# ---------------------------------------------------------------------------------------------
def _mma_run(K, O, dtype, out_dtype, epilogue, *, unroll, min_warps, max_warps, target_warps, big_tiles, sms,
             rolled=False, o_plan=None, norm_eps=None):
    """The tensor-core path's body: macro run(n, x, w, ws, ws2, res, out) (also the prefill GEMM's few-row launch).
    rolled: the warp-iteration loop under `#pragma unroll 1` (nvcc otherwise unrolls short loops, e.g. K = 2048's 16
    iterations, and ptxas then interleaves later iterations' loads with earlier mma.sync instead of issuing each
    iteration's loads at once as in the rolled loop of long K; a bench variant, bench/gemv_gpu_check.py).
    O may be a tirx Var (gemv_rows: weight rows known at run time); the warps per block and launch bounds are then
    those of O = o_plan, and every row is predicated.
    norm_eps (bf16 only): x rows are the un-normed hidden states and run's `ws` the RMSNorm weight g [K] (fp32): the
    lanes square their x words as they load them and feed bf16(x * g) to the mma; the epilogue divides each batch
    row's sums by sqrt(mean(x^2) + eps) (the decode's input / post-attention / final norms folded into the GEMV
    that consumes them: one launch fewer each)."""
    silu = epilogue == "silu_mul"
    norm = None if norm_eps is None else (K, float(norm_eps))
    NORM = norm is not None
    symbolic = not isinstance(O, int)
    plan = int(o_plan) if symbolic else O
    U = unroll
    OO = O // 2 if silu else O
    TILES = (OO + 7) // 8 if silu else (O + 15) // 16
    KU = K // 2  # uint32 words per row
    KC = 32 * U  # K elements per warp iteration
    ITS = (K + KC - 1) // KC
    NW = mma_warps(K, plan, epilogue, unroll=U, min_warps=min_warps, max_warps=max_warps, target_warps=target_warps)
    NIT = (ITS + NW - 1) // NW
    iter_ann = {"disable_unroll": 1} if rolled else None
    NT = 32 * NW
    min_blocks = resident_blocks((plan // 2 + 7) // 8 if silu else (plan + 15) // 16, NT, sms)
    k_pred = K % KC != 0 or ITS % NW != 0
    row_pred = symbolic or ((OO % 8 != 0) if silu else (O % 16 != 0))
    mma_name, mma_src = _mma_source(dtype)

    row_lo, row_hi, lo_ok, hi_ok = _mma_rows(O, epilogue)

    def k0(it, tx, u):
        """first K element of lane tx's 16-byte chunk u in its warp's iteration it"""
        return (it * NW + tx // 32) * KC + u * 32 + tx % 4 * 8

    def k_ok(it, tx, u):
        return k0(it, tx, u) < K if k_pred else True

    def make_body(NBT: int):
        NB = 8 * NBT
        # __launch_bounds__(NT, MB): the small-batch launch asks for the blocks per SM that keep the grid
        # resident at once; ptxas then schedules each iteration's loads ahead of the mma chain within
        # that register budget (without a minimum it trades the load batching for fewer registers)
        MB = min_blocks if NBT == 1 else 1
        epilogue_pass = _mma_epilogue(O, dtype, out_dtype, epilogue, NBT=NBT, NW=NW, NT=NT, row_pred=row_pred,
                                      scale=lambda ws2, row, v: v, norm=norm)
        SQ = NW * NBT * 128
        NPART = SQ + (NW * NBT * 32 if NORM else 0)

        def xrow(ps, bt, tx):
            """batch row whose x lane tx loads for batch tile bt (B column g = lane/4)"""
            return T.Cast("int64", ps * NB + bt * 8 + tx % 32 // 4)

        @T.macro
        def body(n, xu, wu, gn, res, out):
            for tile in T.thread_binding(TILES, thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", MB):
                        wl = T.alloc_buffer((U * 4,), "uint32", scope="local")
                        wh = T.alloc_buffer((U * 4,), "uint32", scope="local")
                        xr = T.alloc_buffer((NBT * U * 4,), "uint32", scope="local")
                        acc = T.alloc_buffer((NBT * 4,), "float32", scope="local")
                        red = T.alloc_buffer((3,), "float32", scope="local")
                        part = T.alloc_buffer((NPART,), "float32", scope="shared")
                        gw = T.alloc_buffer((U * 8 if NORM else 1,), "uint32", scope="local")
                        ssq = T.alloc_buffer((NBT,), "float32", scope="local")
                        for ps in range((n + NB - 1) // NB):
                            for i in T.unroll(NBT * 4):
                                acc[i] = T.float32(0)
                            for bt in T.unroll(NBT):
                                ssq[bt] = T.float32(0)
                            for it in T.serial(NIT, annotations=iter_ann):
                                for u in T.unroll(U):
                                    # weight rows g and g+8 of the tile and x row g of each batch tile, 16 bytes at k0
                                    wl[T.ramp(u * 4, 1, 4)] = T.cuda.func_call(
                                        _LDG_W, T.address_of(wu[row_lo(tile, tx % 32 // 4) * KU + k0(it, tx, u) // 2]),
                                        T.Cast("int32", T.And(k_ok(it, tx, u), lo_ok(tile, tx % 32 // 4) if row_pred
                                                              else True)),
                                        source_code=_LDG_W_SRC, return_type="uint32x4")
                                    wh[T.ramp(u * 4, 1, 4)] = T.cuda.func_call(
                                        _LDG_W, T.address_of(wu[row_hi(tile, tx % 32 // 4) * KU + k0(it, tx, u) // 2]),
                                        T.Cast("int32", T.And(k_ok(it, tx, u), hi_ok(tile, tx % 32 // 4) if row_pred
                                                              else True)),
                                        source_code=_LDG_W_SRC, return_type="uint32x4")
                                    for bt in T.unroll(NBT):
                                        xr[T.ramp((bt * U + u) * 4, 1, 4)] = T.cuda.func_call(
                                            _LDG_X, T.address_of(xu[xrow(ps, bt, tx) * KU + k0(it, tx, u) // 2]),
                                            T.Cast("int32", T.And(k_ok(it, tx, u), xrow(ps, bt, tx) < n)),
                                            source_code=_LDG_X_SRC, return_type="uint32x4")
                                if NORM:
                                    for u in T.unroll(U):
                                        for h in T.unroll(2):  # g[k0 .. k0 + 8) as fp32 bits
                                            gw[T.ramp(u * 8 + h * 4, 1, 4)] = T.cuda.func_call(
                                                _LDG_X, T.address_of(gn[k0(it, tx, u) + h * 4]),
                                                T.Cast("int32", k_ok(it, tx, u)),
                                                source_code=_LDG_X_SRC, return_type="uint32x4")
                                    for u in T.unroll(U):
                                        for bt in T.unroll(NBT):
                                            for j in T.unroll(4):
                                                xr[(bt * U + u) * 4 + j] = T.cuda.func_call(
                                                    _RMS_X, xr[(bt * U + u) * 4 + j], gw[u * 8 + 2 * j],
                                                    gw[u * 8 + 2 * j + 1], T.address_of(ssq[bt]),
                                                    source_code=_RMS_X_SRC, return_type="uint32")
                                for u in T.unroll(U):
                                    for bt in T.unroll(NBT):
                                        for j in T.unroll(2):
                                            T.cuda.func_call(
                                                mma_name, T.address_of(acc[bt * 4]),
                                                wl[u * 4 + 2 * j], wh[u * 4 + 2 * j],
                                                wl[u * 4 + 2 * j + 1], wh[u * 4 + 2 * j + 1],
                                                xr[(bt * U + u) * 4 + 2 * j], xr[(bt * U + u) * 4 + 2 * j + 1],
                                                source_code=mma_src)
                            if NORM:  # each lane's sum of squares of its x row, for the epilogue (after its barrier)
                                for bt in T.unroll(NBT):
                                    part[SQ + (tx // 32 * NBT + bt) * 32 + tx % 32] = ssq[bt]
                            epilogue_pass(n, ps, tile, tx, acc, part, red, None, res, out, 0)

        return body

    small = make_body(1)
    big = make_body(big_tiles)

    @T.macro
    def run(n, x, w, ws, ws2, res, out):
        xu = T.decl_buffer((n * KU,), "uint32", data=x.data)
        wu = T.decl_buffer((O * KU,), "uint32", data=w.data)
        if n <= 8:
            small(n, xu, wu, ws, res, out)
        else:
            big(n, xu, wu, ws, res, out)

    return run


def _mma_func(K, O, dtype, out_dtype, epilogue, **params):
    OO = O // 2 if epilogue == "silu_mul" else O
    return _entry(K, O, OO, dtype, out_dtype, epilogue == "residual", False,
                  _mma_run(K, O, dtype, out_dtype, epilogue, **params), norm=params.get("norm_eps") is not None)


def mma_run(K: int, O: int, dtype: str, out_dtype: str, epilogue: str, *, unroll: int = 4, min_warps: int = 1,
            max_warps: int = 8, target_warps: int = 2048, big_tiles: int = 4, sms: int = 132, **_unused):
    """The tensor-core GEMV body macro for another prim_func of the same contract, or None where that path
    does not apply (dtype, K % 8)."""
    if dtype not in _MMA_TYPES or K % 8 or not supported(K, O, dtype, out_dtype, epilogue):
        return None
    return _mma_run(K, O, dtype, out_dtype, epilogue, unroll=unroll, min_warps=min_warps, max_warps=max_warps,
                    target_warps=target_warps, big_tiles=big_tiles, sms=sms)


# ---------------------------------------------------------------------------------------------
def _fma_body(K, O, dtype, out_dtype, epilogue, *, warps, wval):
    """The FMA path's kernel body (both weight formats): 4 weight rows per block, 8 batch rows per pass,
    a warp per 32 K elements; wval(w, ws, ws2, row, k) is the fp32 weight element. -> (body macro, OO)."""
    silu = epilogue == "silu_mul"
    has_res = epilogue == "residual"
    OO = O // 2 if silu else O
    TR = 4  # weight rows per block: slots 0,1 (lo) and 2,3 (hi)
    NB = 8
    TILES = (OO + 1) // 2 if silu else (O + TR - 1) // TR
    NW = max(1, min(warps, (K + 31) // 32))
    NT = 32 * NW
    NIT = (K + NT - 1) // NT

    def row_of(tile, s):
        if silu:
            return T.Select(s < 2, tile * 2 + s, OO + tile * 2 + s - 2)
        return tile * TR + s

    def row_ok(tile, s):
        return tile * 2 + s % 2 < OO if silu else tile * TR + s < O

    @T.macro
    def body(n, x, w, ws, ws2, res, out):
        for tile in T.thread_binding(TILES, thread="blockIdx.x"):
            for tx in T.thread_binding(NT, thread="threadIdx.x"):
                acc = T.alloc_buffer((TR * NB,), "float32", scope="local")
                wv = T.alloc_buffer((TR,), "float32", scope="local")
                xv = T.alloc_buffer((1,), "float32", scope="local")
                part = T.alloc_buffer((NW * TR * NB,), "float32", scope="shared")
                red = T.alloc_buffer((2,), "float32", scope="local")
                for ps in range((n + NB - 1) // NB):
                    for i in T.unroll(TR * NB):
                        acc[i] = T.float32(0)
                    for it in range(NIT):
                        if it * NT + tx < K:
                            for s in T.unroll(TR):
                                if row_ok(tile, s):
                                    wv[s] = wval(w, ws, ws2, row_of(tile, s), it * NT + tx)
                                else:
                                    wv[s] = T.float32(0)
                            for b in T.unroll(NB):
                                if T.Cast("int64", ps * NB + b) < n:
                                    xv[0] = T.Cast("float32", x[T.Cast("int64", ps * NB + b), it * NT + tx])
                                    for s in T.unroll(TR):
                                        acc[s * NB + b] = acc[s * NB + b] + wv[s] * xv[0]
                    for i in T.unroll(TR * NB):
                        for o in T.unroll(5):
                            acc[i] = acc[i] + T.tvm_warp_shuffle_xor(T.uint32(0xFFFFFFFF), acc[i], 16 >> o, 32, 32)
                    if tx % 32 == 0:
                        for i in T.unroll(TR * NB):
                            part[tx // 32 * TR * NB + i] = acc[i]
                    T.tvm_storage_sync("shared")
                    if silu:
                        if tx < 2 * NB:
                            # (slot tx/NB, batch tx%NB) gate; slot + 2 is its up row
                            red[0] = T.float32(0)
                            red[1] = T.float32(0)
                            for ww in range(NW):
                                red[0] = red[0] + part[ww * TR * NB + tx]
                                red[1] = red[1] + part[ww * TR * NB + 2 * NB + tx]
                            if T.Cast("int64", ps * NB + tx % NB) < n and row_ok(tile, tx // NB):
                                out[T.Cast("int64", ps * NB + tx % NB), tile * 2 + tx // NB] = _silu_mul(
                                    dtype, out_dtype, red[0], red[1])
                    else:
                        if tx < TR * NB:
                            red[0] = T.float32(0)
                            for ww in range(NW):
                                red[0] = red[0] + part[ww * TR * NB + tx]
                            if T.Cast("int64", ps * NB + tx % NB) < n and row_ok(tile, tx // NB):
                                if has_res:
                                    out[T.Cast("int64", ps * NB + tx % NB), tile * TR + tx // NB] = _epilogue_value(
                                        epilogue, dtype, out_dtype, red[0],
                                        res[T.Cast("int64", ps * NB + tx % NB), tile * TR + tx // NB])
                                else:
                                    out[T.Cast("int64", ps * NB + tx % NB), tile * TR + tx // NB] = T.Cast(
                                        out_dtype, red[0])
                    T.tvm_storage_sync("shared")

    return body, OO


def _fma_func(K, O, dtype, out_dtype, epilogue, *, warps):
    body, OO = _fma_body(K, O, dtype, out_dtype, epilogue, warps=warps,
                         wval=lambda w, ws, ws2, row, k: T.Cast("float32", w[row, k]))


    return _entry(K, O, OO, dtype, out_dtype, epilogue == "residual", False, body)


# ---------------------------------------------------------------------------------------------
# NVFP4 weights (compile/kernels/dequant.py NVFP4Linear)
NVFP4_DQ_FUNC = "ninfer_nvfp4_dq32"
# bf16x2 multiply, round to nearest, subnormal inputs and outputs kept (fma with -0: sm_80+)
_BF16X2_MUL_SRC = r"""
__device__ __forceinline__ unsigned ninfer_bf16x2_mul(unsigned a, unsigned b) {
  unsigned d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}
"""
# 32 E2M1 codes of one weight row (16 bytes, element 8m+t in nibble t of word m) and their two E4M3 block
# scales (sc: byte 0 for words 0-1, byte 1 for words 2-3) -> 16 bf16x2 words d[4m+i] =
# (element 8m+i, element 8m+i+4) * scale * 2^-7, exact (no rounding: <= 5 significant bits, normal range).
# Plain C apart from ninfer_bf16x2_mul (the CPU emulator, compile/kernels/cuda/emulate, runs this text).
_NVFP4_DQ_BODY = r"""
__device__ __forceinline__ void ninfer_nvfp4_dq32(unsigned* d, unsigned w0, unsigned w1, unsigned w2, unsigned w3,
                                                  unsigned sc) {
  // E4M3 byte b -> bf16 bits (b & 0x7F) << 4 = s * 2^-120 exactly (E4M3 subnormals become bf16 subnormals);
  // * 2^120 * 2^119 -> s * 2^119 (normal, < 2^128), broadcast to both halves
  unsigned t = ((sc << 4) & 0x7F0u) | ((sc << 12) & 0x7F00000u);
  t = ninfer_bf16x2_mul(ninfer_bf16x2_mul(t, 0x7B807B80u), 0x7B007B00u);
  const unsigned s0 = __byte_perm(t, 0u, 0x1010u), s1 = __byte_perm(t, 0u, 0x3232u);
  const unsigned w[4] = {w0, w1, w2, w3};
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    const unsigned s = m < 2 ? s0 : s1;
    const unsigned h = w[m] >> 8;
    // pair i = (nibble i, nibble i+4) -> (low half, high half): the masked nibble times 2^6 + 2^12 (copies
    // at bits 6..9 and 12..15, no overlap or carry) keeps magnitude bits 6..8 and sign bit 15, i.e. the
    // bf16 bits of e2m1 * 2^-126 (0.5 is the subnormal 0x0040); times s * 2^119 -> e2m1 * s * 2^-7
    d[4 * m + 0] = ninfer_bf16x2_mul(((w[m] & 0x000F000Fu) * 0x1040u) & 0x81C081C0u, s);
    d[4 * m + 1] = ninfer_bf16x2_mul(((w[m] & 0x00F000F0u) * 0x104u) & 0x81C081C0u, s);
    d[4 * m + 2] = ninfer_bf16x2_mul(((h & 0x000F000Fu) * 0x1040u) & 0x81C081C0u, s);
    d[4 * m + 3] = ninfer_bf16x2_mul(((h & 0x00F000F0u) * 0x104u) & 0x81C081C0u, s);
  }
}
"""
_NVFP4_DQ_SRC = _BF16X2_MUL_SRC + _NVFP4_DQ_BODY
# Benchmark probes (bench/gemv_gpu_check.py only; WRONG results, timing what a cheaper dequantization could buy):
# "noscale" skips the block-scale multiply, "nodq" feeds the code words to the mma unconverted.
_PROBE_DQ = {
    "noscale": ("ninfer_nvfp4_dq32_noscale", _NVFP4_DQ_BODY.replace("ninfer_nvfp4_dq32(", "ninfer_nvfp4_dq32_noscale(")
                .replace("ninfer_bf16x2_mul(((", "(((").replace("0x81C081C0u, s);", "0x81C081C0u) ^ s;")),
    "nodq": ("ninfer_nvfp4_dq32_nodq",
             "__device__ __forceinline__ void ninfer_nvfp4_dq32_nodq(unsigned* d, unsigned w0, unsigned w1, unsigned w2, "
             "unsigned w3, unsigned sc) {\n  const unsigned w[4] = {w0, w1, w2, w3};\n#pragma unroll\n"
             "  for (int i = 0; i < 16; ++i) d[i] = w[i % 4] ^ sc;\n}\n"),
}
# the tensor-core path's bf16 weights are e2m1 * e4m3 * 2^-NVFP4_SHIFT; the epilogue multiplies the fp32 sums
# by weight_scale_2 * 2^NVFP4_SHIFT
NVFP4_SHIFT = 7
NVFP4_DEFAULTS = {"unroll": 2, "big_unroll": 1, "big_tiles": 4, "stages": 0}
# Measured on the H200 (BENCHMARKS.md run 6, bench/gemv_gpu_check.py, 27B shapes, n = 1 / 4 / 8): two 16-row tiles
# per warp win where the grid is large (gate_up+silu 2611 -> 2882 GB/s, qkv 2307 -> 2556, in_proj_qkv_z 2555 ->
# 2659 at n = 1) and lose on the O = 5120 projections (o_proj 1800 -> 1682, down 2030 -> 1920: too few tiles for
# 132 SMs); the shared-memory stage ring (stages > 0) lost on every shape (qkv 2061, gate_up 2381 at n = 1).
NVFP4_ROW_TILES_MIN_O = 8192


def nvfp4_row_tiles(O: int) -> int:
    """16-row tiles per warp of the n <= 8 launch for an output width O (see NVFP4_ROW_TILES_MIN_O)."""
    return 2 if O >= NVFP4_ROW_TILES_MIN_O else 1


def nvfp4_shape_params(O: int, epilogue: str) -> dict:
    """gemv_nvfp4 overrides of NVFP4_DEFAULTS for the model's n <= 8 launch, by shape. Measured on the H200 (BENCHMARKS
    run 7, bench/gemv_gpu_check.py, GB/s of NVFP4 bytes at n = 1, best of 13 variants): the O = 5120 projections
    take the register prefetch with x late (down 2011 -> 2351, o_proj 1800 -> 1987), the other wide ones two row tiles
    with the prefetch, x late and one 128-K step per iteration (in_proj_qkv_z 2693 -> 2999, qkv 2535 -> 2660);
    gate_up + silu keeps two row tiles (2872; every prefetching variant was slower)."""
    rt = nvfp4_row_tiles(O)
    if epilogue == "silu_mul":
        return {"row_tiles": rt}
    if rt == 1:
        return {"prefetch": True, "x_late": True}
    return {"row_tiles": rt, "prefetch": True, "x_late": True, "unroll": 1}


def nvfp4_grid(K: int, O: int, epilogue: str, *, unroll: int, row_tiles: int, prefetch: bool, min_warps: int,
               max_warps: int, target_warps: int, sms: int, x_late: bool = False) -> tuple[int, int, int]:
    """(blocks, warps per block, min blocks per SM) of the NVFP4 tensor-core launch: blocks of row_tiles 16-row
    tiles, mma_warps for that many blocks (target_warps counts warps over the grid)."""
    tiles = (O // 2 + 7) // 8 if epilogue == "silu_mul" else (O + 15) // 16
    blocks = (tiles + row_tiles - 1) // row_tiles
    regs = nvfp4_min_regs(row_tiles, prefetch, x_late)
    if row_tiles > 1 or prefetch:
        # about target_warps warps over the grid (round(target_warps / blocks) per block: mma_warps' floor of
        # target_warps // tiles would halve gate_up's), each with row_tiles x the bytes in flight, and no more
        # warps per block than keep the whole grid resident with `regs` registers per thread
        per_sm = -(-blocks // max(1, sms))
        max_warps = max(1, min(max_warps, 65536 // (per_sm * 32 * regs)))
        target_warps = target_warps * row_tiles + tiles // 2
    nw = mma_warps(K, O, epilogue, unroll=4 * unroll, min_warps=min(min_warps, max_warps), max_warps=max_warps,
                   target_warps=target_warps)
    if row_tiles > 1 or prefetch:
        # a warp count that does not divide the K chunks (a K predicate, a last partial iteration) rather than
        # a divisor far below the aim (down_proj: 68 chunks of 256 -> 4 warps where 8 are wanted)
        its = -(-K // (128 * unroll))
        want = min(max(target_warps // max(1, tiles), min_warps, 1), max_warps, its)
        nw = want if 4 * nw < 3 * want else nw
    return blocks, nw, resident_blocks(blocks, 32 * nw, sms, min_regs=regs)


def nvfp4_stages(stages: int, K: int, nw: int, unroll: int, row_tiles: int, nbt: int, blocks_per_sm: int) -> int:
    """cp.async stages of the n <= 8 launch: `stages` (0: off) within 48 KiB of static shared memory per block and
    the SM's 227 KiB over its resident blocks; 0 where fewer than 2 fit or K % 64 != 0 (4-byte scale words)."""
    if stages < 2 or K % 64 or nbt != 1:
        return 0
    per_stage = nw * row_tiles * 2 * unroll * 32 * 20  # 16 code bytes + one scale word per load and lane
    budget = min(48 * 1024, 227 * 1024 // max(1, blocks_per_sm)) - nw * nbt * 512
    s = min(stages, budget // per_stage)
    return s if s >= 2 else 0


def nvfp4_min_regs(row_tiles: int, prefetch: bool, x_late: bool = False) -> int:
    """Registers per thread the NVFP4 tensor-core kernel is left (resident_blocks' min_regs). ptxas -v on the 27B
    shapes without a bound: one tile 76 (128 kept from before), two or four tiles 104-110, prefetch 105-146."""
    if prefetch:
        return 128 if x_late else 152
    return 128 if row_tiles == 1 else 112


def nvfp4_supported(K: int, O: int, dtype: str, out_dtype: str, epilogue: str) -> bool:
    return K % 16 == 0 and supported(K, O, dtype, out_dtype, epilogue)


def _nvfp4_mma_path(K: int, dtype: str) -> bool:
    return dtype == "bfloat16" and K % 32 == 0


def _nvfp4_mma_func(K, O, dtype, out_dtype, epilogue, *, unroll, big_unroll, min_warps, max_warps, target_warps,
                    big_tiles, sms, row_tiles=1, prefetch=False, big_row_tiles=1, big_prefetch=False, stages=0,
                    x_late=False, probe=""):
    """The tensor-core path for NVFP4 weights (bf16 activations, K % 32 == 0); see gemv_nvfp4."""
    silu = epilogue == "silu_mul"
    has_res = epilogue == "residual"
    OO = O // 2 if silu else O
    TILES = (OO + 7) // 8 if silu else (O + 15) // 16
    KW = K // 8  # uint32 code words per weight row
    KS = K // 32  # uint16 scale pairs per weight row
    KU = K // 2  # uint32 words per x row
    mma_name, mma_src = _mma_source(dtype)
    gmul = float(2 ** NVFP4_SHIFT)

    row_lo, row_hi, lo_ok, hi_ok = _mma_rows(O, epilogue)
    # (a probe's source carries its own copy of the bf16x2 multiply: sources are emitted per function name)
    dq_name, dq_src = (_PROBE_DQ[probe][0], (_BF16X2_MUL_SRC + _PROBE_DQ[probe][1]).replace(
        "ninfer_bf16x2_mul", f"ninfer_bf16x2_mul_{probe}")) if probe else (NVFP4_DQ_FUNC, _NVFP4_DQ_SRC)

    def make_body(NBT: int, U: int, RT: int, PF: bool, S: int = 0, XL: bool = False):
        NB = 8 * NBT
        KC = 128 * U  # K elements per warp iteration (4 lanes x 32 codes per unroll step)
        ITS = (K + KC - 1) // KC
        BLOCKS, NW, MB = nvfp4_grid(K, O, epilogue, unroll=U, row_tiles=RT, prefetch=PF, min_warps=min_warps,
                                    max_warps=max_warps, target_warps=target_warps, sms=sms, x_late=XL)
        MB = MB if NBT == 1 else 1
        S = nvfp4_stages(S, K, NW, U, RT, NBT, -(-BLOCKS // max(1, sms))) if not PF else 0
        XL = XL and not S  # the stage ring loads x after its wait already
        J = RT * 2 * U  # 16-byte code loads per lane and iteration (tiles x lo/hi rows x steps)
        wait_name, wait_src = _cp_wait(max(0, S - 2))
        NIT = (ITS + NW - 1) // NW
        NT = 32 * NW
        NBUF = 2 if PF else 1
        NBUF_X = 1 if XL else NBUF  # x late: one step's x words, loaded right before its mma chain
        k_pred = K % KC != 0 or ITS % NW != 0
        # the last block's tiles past TILES have no rows (RT does not divide TILES)
        row_pred = ((OO % 8 != 0) if silu else (O % 16 != 0)) or TILES % RT != 0
        epilogue_pass = _mma_epilogue(O, dtype, out_dtype, epilogue, NBT=NBT, NW=NW, NT=NT, row_pred=row_pred,
                                      scale=lambda ws2, row, v: v * (ws2[row] * T.float32(gmul)), RT=RT)

        def k0(it, tx, u):
            """first K element of lane tx's 32 codes in unroll step u of its warp's iteration it"""
            return (it * NW + tx // 32) * KC + u * 128 + tx % 4 * 32

        def k_ok(it, tx, u):
            # prefetching / staging runs past NIT (the pair loop rounds NIT up to even; S - 1 stages ahead)
            return k0(it, tx, u) < K if k_pred or PF or S else True

        def w_ok(it, tx, u, ok_row):
            return T.And(k_ok(it, tx, u), ok_row if row_pred else True)

        def xrow(ps, bt, tx):
            return T.Cast("int64", ps * NB + bt * 8 + tx % 32 // 4)

        def cw_i(b, t, h, u):  # first of the 4 code words of (buffer, tile, lo/hi row, step)
            return (((b * RT + t) * 2 + h) * U + u) * 4

        def sc_i(b, t, h, u):
            return ((b * RT + t) * 2 + h) * U + u

        def xr_i(b, bt, u):
            return ((b * NBT + bt) * U + u) * 16

        def j_i(t, h, u):  # staged load j of (tile, lo/hi row, step)
            return (t * 2 + h) * U + u

        def sm_i(it, tx, j):  # lane tx's slot (16 code bytes, one scale word) of load j in the stage of iteration it
            return ((tx // 32 * S + it % S) * J + j) * 32 + tx % 32

        @T.macro
        def stage(it, tile0, tx, wu, wsw, smc, sms):
            # cp.async of iteration it's codes and scale words into its stage (each lane reads back only its own
            # slots, so no barrier: wait_group alone orders them); the aligned scale word holding the lane's pair
            for u in T.unroll(U):
                for t in T.unroll(RT):
                    T.cuda.func_call(_CP16, T.address_of(smc[sm_i(it, tx, j_i(t, 0, u)) * 4]),
                                     T.address_of(wu[row_lo(tile0 + t, tx % 32 // 4) * KW + k0(it, tx, u) // 8]),
                                     T.Cast("int32", w_ok(it, tx, u, lo_ok(tile0 + t, tx % 32 // 4))),
                                     source_code=_CP16_SRC)
                    T.cuda.func_call(_CP16, T.address_of(smc[sm_i(it, tx, j_i(t, 1, u)) * 4]),
                                     T.address_of(wu[row_hi(tile0 + t, tx % 32 // 4) * KW + k0(it, tx, u) // 8]),
                                     T.Cast("int32", w_ok(it, tx, u, hi_ok(tile0 + t, tx % 32 // 4))),
                                     source_code=_CP16_SRC)
                    T.cuda.func_call(_CP4, T.address_of(sms[sm_i(it, tx, j_i(t, 0, u))]),
                                     T.address_of(wsw[row_lo(tile0 + t, tx % 32 // 4) * (K // 64) + k0(it, tx, u) // 64]),
                                     T.Cast("int32", w_ok(it, tx, u, lo_ok(tile0 + t, tx % 32 // 4))),
                                     source_code=_CP4_SRC)
                    T.cuda.func_call(_CP4, T.address_of(sms[sm_i(it, tx, j_i(t, 1, u))]),
                                     T.address_of(wsw[row_hi(tile0 + t, tx % 32 // 4) * (K // 64) + k0(it, tx, u) // 64]),
                                     T.Cast("int32", w_ok(it, tx, u, hi_ok(tile0 + t, tx % 32 // 4))),
                                     source_code=_CP4_SRC)
            T.cuda.func_call(_CP_COMMIT, source_code=_CP_COMMIT_SRC)

        @T.macro
        def unstage(it, tx, smc, sms, cw, sc):
            for u in T.unroll(U):
                for t in T.unroll(RT):
                    for h in T.unroll(2):
                        cw[T.ramp(cw_i(0, t, h, u), 1, 4)] = smc[T.ramp(sm_i(it, tx, j_i(t, h, u)) * 4, 1, 4)]
                        # lane q's scale pair is half q % 2 of the word (the dequant reads the low 16 bits)
                        sc[sc_i(0, t, h, u)] = sms[sm_i(it, tx, j_i(t, h, u))] >> T.Cast("uint32", tx % 2 * 16)

        @T.macro
        def load_x_step(b, it, u, tx, ps, n, xu, xr):
            for bt in T.unroll(NBT):
                for v in T.unroll(4):
                    xr[T.ramp(xr_i(b, bt, u) + v * 4, 1, 4)] = T.cuda.func_call(
                        _LDG_X, T.address_of(xu[xrow(ps, bt, tx) * KU + k0(it, tx, u) // 2 + v * 4]),
                        T.Cast("int32", T.And(k_ok(it, tx, u), xrow(ps, bt, tx) < n)),
                        source_code=_LDG_X_SRC, return_type="uint32x4")

        @T.macro
        def load_x(b, it, tx, ps, n, xu, xr):
            for u in T.unroll(U):
                load_x_step(b, it, u, tx, ps, n, xu, xr)

        @T.macro
        def load(b, it, tile0, tx, ps, n, xu, wu, wsh, cw, sc, xr):
            # per step: 16 bytes (32 codes) of weight rows g and g+8 of each of the RT tiles and their 2 scale
            # bytes each; the 32 x elements of batch row g of every batch tile (4 x 16 bytes)
            for u in T.unroll(U):
                for t in T.unroll(RT):
                    cw[T.ramp(cw_i(b, t, 0, u), 1, 4)] = T.cuda.func_call(
                        _LDG_W, T.address_of(wu[row_lo(tile0 + t, tx % 32 // 4) * KW + k0(it, tx, u) // 8]),
                        T.Cast("int32", w_ok(it, tx, u, lo_ok(tile0 + t, tx % 32 // 4))),
                        source_code=_LDG_W_SRC, return_type="uint32x4")
                    cw[T.ramp(cw_i(b, t, 1, u), 1, 4)] = T.cuda.func_call(
                        _LDG_W, T.address_of(wu[row_hi(tile0 + t, tx % 32 // 4) * KW + k0(it, tx, u) // 8]),
                        T.Cast("int32", w_ok(it, tx, u, hi_ok(tile0 + t, tx % 32 // 4))),
                        source_code=_LDG_W_SRC, return_type="uint32x4")
                for t in T.unroll(RT):
                    sc[sc_i(b, t, 0, u)] = T.if_then_else(
                        w_ok(it, tx, u, lo_ok(tile0 + t, tx % 32 // 4)),
                        T.Cast("uint32", wsh[row_lo(tile0 + t, tx % 32 // 4) * KS + k0(it, tx, u) // 32]), T.uint32(0))
                    sc[sc_i(b, t, 1, u)] = T.if_then_else(
                        w_ok(it, tx, u, hi_ok(tile0 + t, tx % 32 // 4)),
                        T.Cast("uint32", wsh[row_hi(tile0 + t, tx % 32 // 4) * KS + k0(it, tx, u) // 32]), T.uint32(0))
            if not XL:
                load_x(b, it, tx, ps, n, xu, xr)

        @T.macro
        def compute(b, it, tx, ps, n, xu, cw, sc, xr, al, ah, xp, acc):
            xb = 0 if XL else b
            for u in T.unroll(U):
                if XL:
                    # x late: this step's x words now, after the weight codes of the iteration are in registers
                    load_x_step(0, it, u, tx, ps, n, xu, xr)
                # x pairs in the weights' K order: pair 4m+i = (x[8m+i], x[8m+i+4]), shared by the RT tiles
                for bt in T.unroll(NBT):
                    for m in T.unroll(4):
                        for ih in T.unroll(2):
                            xp[bt * 16 + m * 4 + ih * 2] = T.call_pure_extern(
                                "uint32", "__byte_perm", xr[xr_i(xb, bt, u) + m * 4 + ih],
                                xr[xr_i(xb, bt, u) + m * 4 + 2 + ih], T.uint32(0x5410))
                            xp[bt * 16 + m * 4 + ih * 2 + 1] = T.call_pure_extern(
                                "uint32", "__byte_perm", xr[xr_i(xb, bt, u) + m * 4 + ih],
                                xr[xr_i(xb, bt, u) + m * 4 + 2 + ih], T.uint32(0x7632))
                for t in T.unroll(RT):
                    T.cuda.func_call(dq_name, T.address_of(al[0]), cw[cw_i(b, t, 0, u)],
                                     cw[cw_i(b, t, 0, u) + 1], cw[cw_i(b, t, 0, u) + 2], cw[cw_i(b, t, 0, u) + 3],
                                     sc[sc_i(b, t, 0, u)], source_code=dq_src)
                    T.cuda.func_call(dq_name, T.address_of(ah[0]), cw[cw_i(b, t, 1, u)],
                                     cw[cw_i(b, t, 1, u) + 1], cw[cw_i(b, t, 1, u) + 2], cw[cw_i(b, t, 1, u) + 3],
                                     sc[sc_i(b, t, 1, u)], source_code=dq_src)
                    for bt in T.unroll(NBT):
                        for j in T.unroll(8):
                            T.cuda.func_call(
                                mma_name, T.address_of(acc[(bt * RT + t) * 4]),
                                al[2 * j], ah[2 * j], al[2 * j + 1], ah[2 * j + 1],
                                xp[bt * 16 + 2 * j], xp[bt * 16 + 2 * j + 1], source_code=mma_src)

        @T.macro
        def body(n, xu, wu, wsh, wsw, ws2, res, out):
            for blk in T.thread_binding(BLOCKS, thread="blockIdx.x"):
                for tx in T.thread_binding(NT, thread="threadIdx.x"):
                    with T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", MB):
                        cw = T.alloc_buffer((NBUF * RT * 2 * U * 4,), "uint32", scope="local")
                        sc = T.alloc_buffer((NBUF * RT * 2 * U,), "uint32", scope="local")
                        xr = T.alloc_buffer((NBUF_X * NBT * U * 16,), "uint32", scope="local")
                        al = T.alloc_buffer((16,), "uint32", scope="local")
                        ah = T.alloc_buffer((16,), "uint32", scope="local")
                        xp = T.alloc_buffer((NBT * 16,), "uint32", scope="local")
                        acc = T.alloc_buffer((NBT * RT * 4,), "float32", scope="local")
                        red = T.alloc_buffer((2,), "float32", scope="local")
                        part = T.alloc_buffer((NW * NBT * 128,), "float32", scope="shared")
                        smc = T.alloc_buffer((max(1, NW * S * J * 128),), "uint32", scope="shared")
                        sms = T.alloc_buffer((max(1, NW * S * J * 32),), "uint32", scope="shared")
                        for ps in range((n + NB - 1) // NB):
                            for i in T.unroll(NBT * RT * 4):
                                acc[i] = T.float32(0)
                            if S > 0:
                                # S-stage cp.async ring per warp: S - 1 iterations' weight bytes in flight
                                for it in T.unroll(S - 1):
                                    stage(it, blk * RT, tx, wu, wsw, smc, sms)
                                for it in range(NIT):
                                    T.cuda.func_call(wait_name, source_code=wait_src)
                                    unstage(it, tx, smc, sms, cw, sc)
                                    load_x(0, it, tx, ps, n, xu, xr)
                                    stage(it + S - 1, blk * RT, tx, wu, wsw, smc, sms)
                                    compute(0, it, tx, ps, n, xu, cw, sc, xr, al, ah, xp, acc)
                                T.cuda.func_call(_cp_wait(0)[0], source_code=_cp_wait(0)[1])
                            elif PF:
                                # software pipeline: iteration it + 1's loads are in flight during it's math
                                load(0, 0, blk * RT, tx, ps, n, xu, wu, wsh, cw, sc, xr)
                                for it2 in range((NIT + 1) // 2):
                                    load(1, 2 * it2 + 1, blk * RT, tx, ps, n, xu, wu, wsh, cw, sc, xr)
                                    compute(0, 2 * it2, tx, ps, n, xu, cw, sc, xr, al, ah, xp, acc)
                                    load(0, 2 * it2 + 2, blk * RT, tx, ps, n, xu, wu, wsh, cw, sc, xr)
                                    compute(1, 2 * it2 + 1, tx, ps, n, xu, cw, sc, xr, al, ah, xp, acc)
                            else:
                                for it in range(NIT):
                                    load(0, it, blk * RT, tx, ps, n, xu, wu, wsh, cw, sc, xr)
                                    compute(0, it, tx, ps, n, xu, cw, sc, xr, al, ah, xp, acc)
                            for t in T.unroll(RT):
                                epilogue_pass(n, ps, blk * RT + t, tx, acc, part, red, ws2, res, out, t)

        return body

    small = make_body(1, unroll, row_tiles, prefetch, stages, x_late)
    big = make_body(big_tiles, big_unroll, big_row_tiles, big_prefetch)

    @T.macro
    def run(n, x, w, ws, ws2, res, out):
        xu = T.decl_buffer((n * KU,), "uint32", data=x.data)
        wu = T.decl_buffer((O * KW,), "uint32", data=w.data)
        wsh = T.decl_buffer((O * KS,), "uint16", data=ws.data)
        wsw = T.decl_buffer((O * (K // 64),), "uint32", data=ws.data)
        if n <= 8:
            small(n, xu, wu, wsh, wsw, ws2, res, out)
        else:
            big(n, xu, wu, wsh, wsw, ws2, res, out)

    return _entry(K, O, OO, dtype, out_dtype, has_res, True, run)


def _nvfp4_fma_func(K, O, dtype, out_dtype, epilogue, *, warps):
    """FMA path for NVFP4 weights (any activation dtype, K % 16 == 0): the _fma_func layout, each weight
    element dequantized exactly as compile/kernels/dequant.py does (fp32 e2m1 * e4m3 * g, cast to dtype)."""
    from ..dequant import _e2m1, _e4m3

    def wval(w, ws, ws2, row, k):
        code = (T.Cast("uint32", w[row, k // 2]) >> T.Cast("uint32", k % 2 * 4)) & T.uint32(15)
        return T.Cast("float32", T.Cast(dtype, _e2m1(code) * _e4m3(ws[row, k // 16]) * ws2[row]))

    body, OO = _fma_body(K, O, dtype, out_dtype, epilogue, warps=warps, wval=wval)


    return _entry(K, O, OO, dtype, out_dtype, epilogue == "residual", True, body)


@lru_cache(maxsize=None)
def gemv_nvfp4(in_features: int, out_features: int, dtype: str, out_dtype: str | None = None,
               epilogue: str = "none", *, unroll: int = 2, big_unroll: int = 1, min_warps: int = 1,
               max_warps: int = 8, target_warps: int = 2048, big_tiles: int = 4, fma_warps: int = 4, sms: int = 132,
               row_tiles: int = 1, prefetch: bool = False, big_row_tiles: int = 1, big_prefetch: bool = False,
               stages: int = 0, x_late: bool = False, probe: str = ""):
    """y = x[n, in] @ dequant(W)^T + epilogue for NVFP4 weights, or None where it does not apply.

    prim_func(x[n, in] dtype, w[out, in/2] u8, w_scale[out, in/16] u8, w_scale_2[out] f32, [res], out), the
    buffers of NVFP4Linear. Tensor-core path (bf16, in % 32 == 0): the bf16 kernel's tiling with 16-byte
    loads of 32 codes per lane and rows; unroll / big_unroll count 128-element K steps per warp iteration
    (n <= 8 / n > 8). Otherwise the FMA path (dequant exactly as dequant.py)."""
    K, O = int(in_features), int(out_features)
    out_dtype = out_dtype or dtype
    if not nvfp4_supported(K, O, dtype, out_dtype, epilogue):
        return None
    if _nvfp4_mma_path(K, dtype):
        f = _nvfp4_mma_func(K, O, dtype, out_dtype, epilogue, unroll=unroll, big_unroll=big_unroll,
                            min_warps=min_warps, max_warps=max_warps, target_warps=target_warps, big_tiles=big_tiles,
                            sms=sms, row_tiles=row_tiles, prefetch=prefetch, big_row_tiles=big_row_tiles,
                            big_prefetch=big_prefetch, stages=stages, x_late=x_late, probe=probe)
    else:
        f = _nvfp4_fma_func(K, O, dtype, out_dtype, epilogue, warps=fma_warps)
    return f.with_attr("global_symbol", symbol(K, O, dtype, out_dtype, epilogue, "nvfp4"))


# weight rows gemv_rows plans its launch for (the shortlisted MTP head of a 27B model: 32768 ids x 5120)
ROWS_PLAN = 32768


@lru_cache(maxsize=None)
def gemv_rows(in_features: int, dtype: str, out_dtype: str | None = None, *, rows_plan: int = ROWS_PLAN,
              unroll: int = 4, min_warps: int = 1, max_warps: int = 8, target_warps: int = 2048, big_tiles: int = 4,
              sms: int = 132, rolled: bool | None = None, **_unused):
    """gemv (epilogue "none") over a weight whose row count is known only at run time: prim_func(x[n, in],
    w[m, in], out[n, m]) with m symbolic, or None where the tensor-core path does not apply (the caller keeps a
    matmul). Why: a runtime-chosen weight (the MTP head's shortlisted rows, runtime/spec/mtp.py) read at the copy
    rate like lm_head. The tensor-core kernel with m rows predicated; its warps per block and launch bounds are
    planned for m = rows_plan (the grid follows m)."""
    K = int(in_features)
    out_dtype = out_dtype or dtype
    if dtype not in _MMA_TYPES or K % 8 or not supported(K, 1, dtype, out_dtype, "none"):
        return None
    rolled = K <= ROLLED_MAX_K if rolled is None else rolled
    m = tirx.Var("m", "int64")
    run = _mma_run(K, m, dtype, out_dtype, "none", unroll=unroll, min_warps=min_warps, max_warps=max_warps,
                   target_warps=target_warps, big_tiles=big_tiles, sms=sms, rolled=rolled, o_plan=rows_plan)
    od = "" if out_dtype == dtype else f"_{_SHORT[out_dtype]}"
    return _entry(K, m, m, dtype, out_dtype, False, False, run).with_attr(
        "global_symbol", f"gemv_rows_{K}_{_SHORT[dtype]}{od}")


@lru_cache(maxsize=None)
def gemv(in_features: int, out_features: int, dtype: str, out_dtype: str | None = None, epilogue: str = "none", *,
         unroll: int = 4, min_warps: int = 1, max_warps: int = 8, target_warps: int = 2048, big_tiles: int = 4,
         fma_warps: int = 4, sms: int = 132, weight_format: str | None = None, rolled: bool | None = None,
         norm_eps: float | None = None, norm_min_k: int = 0):
    """The prim_func for y = x[n, in] @ w[out, in]^T + epilogue, or None where it does not apply
    (the caller keeps its matmul). Output [n, out] (silu_mul: [n, out/2]) in out_dtype (default dtype).
    weight_format "nvfp4": gemv_nvfp4 (NVFP4Linear's buffers) with NVFP4_DEFAULTS for its own unroll /
    big_tiles and the other parameters as given. rolled: _mma_run's (None: for K <= ROLLED_MAX_K).
    norm_eps: y = rms_norm(x, g, norm_eps) @ w^T + epilogue with g [in] fp32 the second argument (x, g, w, [res],
    out): the norm folded into the GEMV (bf16 tensor-core path with K >= norm_min_k only; None elsewhere)."""
    K, O = int(in_features), int(out_features)
    out_dtype = out_dtype or dtype
    rolled = K <= ROLLED_MAX_K if rolled is None else rolled
    if norm_eps is not None:
        if weight_format is not None or dtype != "bfloat16" or K % 8 or K < norm_min_k \
                or not supported(K, O, dtype, out_dtype, epilogue):
            return None
        f = _mma_func(K, O, dtype, out_dtype, epilogue, unroll=unroll, min_warps=min_warps, max_warps=max_warps,
                      target_warps=target_warps, big_tiles=big_tiles, sms=sms, rolled=rolled,
                      norm_eps=float(norm_eps))
        return f.with_attr("global_symbol", symbol(K, O, dtype, out_dtype, epilogue) + "_rms")
    if weight_format == "nvfp4":
        return gemv_nvfp4(K, O, dtype, out_dtype, epilogue, min_warps=min_warps, max_warps=max_warps,
                          target_warps=target_warps, fma_warps=fma_warps, sms=sms,
                          **{**NVFP4_DEFAULTS, **nvfp4_shape_params(O, epilogue)})
    if weight_format is not None:
        return None
    if not supported(K, O, dtype, out_dtype, epilogue):
        return None
    if dtype in _MMA_TYPES and K % 8 == 0:
        f = _mma_func(K, O, dtype, out_dtype, epilogue, unroll=unroll, min_warps=min_warps, max_warps=max_warps,
                      target_warps=target_warps, big_tiles=big_tiles, sms=sms, rolled=rolled)
    else:
        f = _fma_func(K, O, dtype, out_dtype, epilogue, warps=fma_warps)
    return f.with_attr("global_symbol", symbol(K, O, dtype, out_dtype, epilogue))


_SHORT = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
# K up to which the tensor-core GEMV keeps its warp-iteration loop rolled (_mma_run): at hidden 2048 / 4096 (35B-A3B)
# nvcc unrolled the 4-16 iterations and ptxas interleaved loads with mma.sync and spilled (attn qkv 2048x9216 and
# lm_head 2048x248320 at 1.5 / 2.35 TB/s on the H200, run 6 profile); the rolled loop issues each iteration's 8
# weight + 4 x loads at once as the long-K loops do (27B: K >= 5120, 86-96 % of the copy rate; unchanged)
ROLLED_MAX_K = 4096


def symbol(K: int, O: int, dtype: str, out_dtype: str, epilogue: str, weight_format: str | None = None) -> str:
    """Kernel name: gemv[_nvfp4][_residual|_silu_mul]_<K>x<O>_<dtype>[_<out dtype>] (unique per variant)."""
    ep = "" if epilogue == "none" else f"_{epilogue}"
    od = "" if out_dtype == dtype else f"_{_SHORT[out_dtype]}"
    wf = f"_{weight_format}" if weight_format else ""
    return f"gemv{wf}{ep}_{K}x{O}_{_SHORT[dtype]}{od}"


def launch_config(in_features: int, out_features: int, dtype: str, epilogue: str = "none", *, unroll: int = 4,
                  min_warps: int = 1, max_warps: int = 8, target_warps: int = 2048, big_tiles: int = 4,
                  fma_warps: int = 4, sms: int = 132, rolled: bool | None = None) -> str:
    """Human-readable launch configuration of gemv() for a shape (reports, bench tables)."""
    K, O = int(in_features), int(out_features)
    rolled = K <= ROLLED_MAX_K if rolled is None else rolled
    if dtype in _MMA_TYPES and K % 8 == 0:
        tiles = (O // 2 + 7) // 8 if epilogue == "silu_mul" else (O + 15) // 16
        nw = mma_warps(K, O, epilogue, unroll=unroll, min_warps=min_warps, max_warps=max_warps,
                       target_warps=target_warps)
        mb = resident_blocks(tiles, 32 * nw, sms)
        return (f"mma grid {tiles} x {32 * nw} threads (min {mb} blocks/SM), {32 * unroll} k per warp-iteration"
                f"{' (rolled loop)' if rolled else ''}, n>8: {8 * big_tiles} rows/pass")
    oo = O // 2 if epilogue == "silu_mul" else O
    tiles = (oo + 1) // 2 if epilogue == "silu_mul" else (O + 3) // 4
    return f"fma grid {tiles} x {32 * max(1, min(fma_warps, (K + 31) // 32))} threads"


def launch_config_nvfp4(in_features: int, out_features: int, dtype: str, epilogue: str = "none", *, unroll: int = 2,
                        big_unroll: int = 1, min_warps: int = 1, max_warps: int = 8, target_warps: int = 2048,
                        big_tiles: int = 4, fma_warps: int = 4, sms: int = 132, row_tiles: int = 1,
                        prefetch: bool = False, big_row_tiles: int = 1, big_prefetch: bool = False,
                        stages: int = 0, x_late: bool = False, probe: str = "") -> str:
    """Human-readable launch configuration of gemv_nvfp4() for a shape."""
    K, O = int(in_features), int(out_features)
    if not _nvfp4_mma_path(K, dtype):
        return "nvfp4 " + launch_config(K, O, "float32", epilogue, fma_warps=fma_warps)
    kw: dict[str, Any] = dict(min_warps=min_warps, max_warps=max_warps, target_warps=target_warps, sms=sms)
    blocks, nw, mb = nvfp4_grid(K, O, epilogue, unroll=unroll, row_tiles=row_tiles, prefetch=prefetch, x_late=x_late,
                                **kw)
    _, nwb, _ = nvfp4_grid(K, O, epilogue, unroll=big_unroll, row_tiles=big_row_tiles, prefetch=big_prefetch, **kw)
    st = 0 if prefetch else nvfp4_stages(stages, K, nw, unroll, row_tiles, 1, -(-blocks // max(1, sms)))
    pf = " prefetch" if prefetch else (f" {st} cp.async stages" if st else "")
    pf += " x late" if x_late and not st else ""
    bpf = " prefetch" if big_prefetch else ""
    return (f"nvfp4 mma grid {blocks} x {32 * nw} threads (min {mb} blocks/SM), {16 * row_tiles} rows x "
            f"{128 * unroll} k per warp-iteration{pf}, n>8: {8 * big_tiles} rows/pass x {32 * nwb} threads, "
            f"{16 * big_row_tiles} rows x {128 * big_unroll} k{bpf}")


__all__ = ["EPILOGUES", "NVFP4_DEFAULTS", "ROWS_PLAN", "gemv", "gemv_nvfp4", "gemv_rows", "nvfp4_row_tiles", "nvfp4_shape_params",
           "launch_config", "launch_config_nvfp4", "mma_warps", "nvfp4_grid", "nvfp4_supported", "resident_blocks",
           "supported", "symbol"]
