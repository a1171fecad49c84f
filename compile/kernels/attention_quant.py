"""Quantized KV pages for the portable (llvm) attention kernel: NVFP4 and FP8 rows.

Both formats store one uint8 row per (page slot, KV head) in a pool of shape
[num_pages, n_attn_layers, 2, kv_heads, page_size, row_bytes]:

* ``nvfp4``: D/2 bytes of packed E2M1 codes (element 2i in the low nibble), then D/16 E4M3 block
  scales in natural order (144 B at D=256). Bit-exact with ``compile/nvfp4.pack_kv_nvfp4``:
  scale = E4M3_rne_sat(fp32(amax/6)) with subnormal scales, code = E2M1_rne_sat(x / scale) with an
  IEEE division, zero/underflowed blocks -> scale 0 and codes 0, NaN -> +6, the sign from q.
* ``fp8``: D E4M3 codes, then one E8M0 byte (scale 2^(b-127)) and 3 zero bytes (rows stay 4-byte
  aligned: 260 B at D=256). The scale is per (token, head) and the smallest power of two with
  amax/scale <= 448, so amax lands in (224, 448]; no calibration, no saturation of finite rows,
  and both x/scale and code*scale are exact. code = E4M3_rne_sat(x / scale) (= nvfp4.encode_e4m3);
  an all-zero row gets byte 127 (scale 1). ``pack_kv_fp8`` below is the numpy reference.

The encoders are written with integer and plain float ops: TVM's LLVM fp8/fp4 casts are wrong
(research/tvm_probe.md Q5). Decoding is exact in fp32. New K/V are quantized by the attention
kernel as it appends them (no separate pass) and dequantized to fp32 as it reads them.
"""
from __future__ import annotations

import numpy as np
from tvm import tirx
from tvm.script import tirx as T

from .. import nvfp4 as F

from ...contract.pool_layout import FP8_ROW_PAD, QUANT_KV_DTYPES, kv_row  # noqa: F401  (the page row contract)


# ---------------------------------------------------------------------------- numpy reference (fp8)

def fp8_row_exponent(x) -> np.ndarray:
    """E8M0 byte per row (last axis) for the fp8 KV rows."""
    x = np.asarray(x, np.float32)
    amax = np.where(np.isnan(x), 0, np.abs(x)).max(-1).astype(np.float32)
    u = amax.view(np.uint32).astype(np.int64)
    b = (u >> 23) - 8 + ((u & 0x7FFFFF) > 0x600000)
    return np.where(amax > 0, np.clip(b, 1, 253), 127).astype(np.uint8)


def pack_kv_fp8(x) -> np.ndarray:
    """[..., D] float -> [..., D + 4] uint8 rows (E4M3 codes, E8M0 scale byte, 3 zero bytes)."""
    x = np.asarray(x, np.float32)
    eb = fp8_row_exponent(x)
    scale = (eb.astype(np.uint32) << 23).view(np.float32)
    codes = F.encode_e4m3(x / scale[..., None])
    pad = np.zeros(x.shape[:-1] + (FP8_ROW_PAD - 1,), np.uint8)
    return np.concatenate([codes, eb[..., None], pad], axis=-1)


def unpack_kv_fp8(rows, head_dim: int) -> np.ndarray:
    rows = np.asarray(rows, np.uint8)
    scale = (rows[..., head_dim].astype(np.uint32) << 23).view(np.float32)
    with np.errstate(over="ignore"):  # only rows that held +-inf overflow back to inf
        return F.decode_e4m3(rows[..., :head_dim]) * scale[..., None]


def unpack_kv(rows, kv_dtype: str, head_dim: int) -> np.ndarray:
    """Raw page rows -> float32 [..., head_dim] for any KV dtype."""
    if kv_dtype == "nvfp4":
        return F.unpack_kv_nvfp4(rows, head_dim)
    if kv_dtype == "fp8":
        return unpack_kv_fp8(rows, head_dim)
    return np.asarray(rows, np.float32)[..., :head_dim]


# ---------------------------------------------------------------------------- TIR codecs

def _u32(v):
    return tirx.const(v, "uint32")


def _f32(v):
    return tirx.const(v, "float32")


def _bits(x):
    return tirx.reinterpret("uint32", x)


def _float(u):
    return tirx.reinterpret("float32", u)


def e4m3_encode_abs(a):
    """a: float32 >= 0 or +inf (never NaN) -> E4M3 magnitude code (uint32, <= 0x7E), RNE, saturating.

    Normal range: re-bias the exponent and round the 23-bit mantissa to 3 bits with the
    add-half-minus-one-plus-lsb trick. Subnormal range (< 2^-6): RNE(a * 2^9), exact scaling; a
    carry into code 8 is exactly the smallest normal. All unsigned, so no poison in either arm."""
    u = _bits(a)
    ebits = u >> _u32(23)
    rebias = ((ebits - _u32(120)) << _u32(23)) | (u & _u32(0x7FFFFF))
    normal = (rebias + _u32(0x7FFFF) + ((rebias >> _u32(20)) & _u32(1))) >> _u32(20)
    v = tirx.min(a, _f32(2.0 ** -6)) * _f32(512.0)
    fl = tirx.floor(v)
    fr = v - fl
    fli = tirx.Cast("uint32", fl)
    up = tirx.Or(fr > _f32(0.5), tirx.And(fr == _f32(0.5), (fli & _u32(1)) == _u32(1)))
    sub = fli + tirx.Cast("uint32", up)
    return tirx.Select(a > _f32(448.0), _u32(0x7E), tirx.Select(ebits >= _u32(121), normal, sub))


def e4m3_decode_abs(c):
    """E4M3 magnitude code (uint32 < 0x7F) -> float32 (exact)."""
    e = c >> _u32(3)
    m = c & _u32(7)
    normal = _float(((e + _u32(120)) << _u32(23)) | (m << _u32(20)))
    return tirx.Select(e == _u32(0), tirx.Cast("float32", m) * _f32(2.0 ** -9), normal)


def e4m3_encode(x):
    """float32 -> E4M3FN code (uint32 < 256): sign | magnitude, saturating, NaN -> 0x7F."""
    u = _bits(x)
    au = u & _u32(0x7FFFFFFF)
    mag = e4m3_encode_abs(_float(tirx.Select(au > _u32(0x7F800000), _u32(0), au)))
    return tirx.Select(au > _u32(0x7F800000), _u32(0x7F), mag | ((u >> _u32(31)) << _u32(7)))


def e4m3_decode(c):
    v = e4m3_decode_abs(c & _u32(0x7F))
    return tirx.Select((c & _u32(0x80)) != _u32(0), -v, v)


def e2m1_encode(q):
    """float32 -> E2M1 code (uint32 0..15): RNE ties-to-even, saturating to +-6, NaN -> 7 (+6).

    The magnitude is the number of midpoints below |q| (a tie counts when the lower code is odd);
    the sign is q's IEEE sign bit, so -0 and small negatives give code 8 like cvt.rn.satfinite."""
    u = _bits(q)
    au = u & _u32(0x7FFFFFFF)
    a = _float(au)
    mag = _u32(0)
    for bound, tie_up in zip((0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0), (0, 1, 0, 1, 0, 1, 0)):
        cmp = a >= _f32(bound) if tie_up else a > _f32(bound)
        mag = mag + tirx.Cast("uint32", cmp)
    return tirx.Select(au > _u32(0x7F800000), _u32(7), mag | ((u >> _u32(31)) << _u32(3)))


def e2m1_decode(c):
    """E2M1 code (uint32 0..15) -> float32: 0, 0.5 below code 2, else (1 + m/2) * 2^(e-1)."""
    m = c & _u32(7)
    big = _float((((m >> _u32(1)) + _u32(126)) << _u32(23)) | ((m & _u32(1)) << _u32(22)))
    v = tirx.Select(m < _u32(2), tirx.Cast("float32", m) * _f32(0.5), big)
    return tirx.Select((c & _u32(8)) != _u32(0), -v, v)


def nvfp4_code(x, scale):
    """Element code for x in a block with decoded scale (0 for a zero / flushed block)."""
    return tirx.Select(scale > _f32(0.0), e2m1_encode(x / scale), _u32(0))


def fp8_row_exponent_tir(amax):
    """E8M0 byte (uint32) for a row with the given NaN-free amax; mirrors fp8_row_exponent."""
    u = _bits(amax)
    b = tirx.Cast("int32", u >> _u32(23)) - 8 + tirx.Cast("int32", (u & _u32(0x7FFFFF)) > _u32(0x600000))
    b = tirx.max(tirx.min(b, 253), 1)
    return tirx.Select(amax > _f32(0.0), tirx.Cast("uint32", b), _u32(127))


def pow2_from_e8m0(b):
    """2^(b - 127) for b in [1, 254] (exact)."""
    return _float(b << _u32(23))


# ---------------------------------------------------------------------------- kernel

def paged_attention_quant(
    n_heads: int, n_kv: int, head_dim: int, page_size: int, n_layers: int, dtype: str, sm_scale: float,
    kv_dtype: str,
):
    """attention.paged_attention with uint8 NVFP4 / FP8 pages (same arguments and semantics).

    Append: each new K/V row of a (token, KV head) is staged in fp32 and quantized straight into
    its page row. Attend: page rows are dequantized element by element into fp32.
    """
    if kv_dtype not in QUANT_KV_DTYPES:
        raise ValueError(f"quantized KV dtype must be one of {QUANT_KV_DTYPES}, got {kv_dtype!r}")
    _, row_bytes = kv_row(kv_dtype, head_dim)
    group = n_heads // n_kv
    neg_big = -3.0e38
    half = head_dim // 2
    nblk = head_dim // F.BLOCK
    nvfp4 = kv_dtype == "nvfp4"

    def load(pool, pg, layer, c, h, slot, d):
        """fp32 value of element d of a page row."""
        if nvfp4:
            byte = tirx.Cast("uint32", pool[pg, layer, c, h, slot, d // 2])
            code = (byte >> (tirx.Cast("uint32", d % 2) * _u32(4))) & _u32(15)
            sf = e4m3_decode_abs(tirx.Cast("uint32", pool[pg, layer, c, h, slot, half + d // F.BLOCK]))
            return e2m1_decode(code) * sf
        code = tirx.Cast("uint32", pool[pg, layer, c, h, slot, d])
        return e4m3_decode(code) * pow2_from_e8m0(tirx.Cast("uint32", pool[pg, layer, c, h, slot, head_dim]))

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
        pool = T.match_buffer(var_pool, (npages, n_layers, 2, n_kv, page_size, row_bytes), "uint8")
        out = T.match_buffer(var_out, (n, n_heads, head_dim), dtype)
        row = T.alloc_buffer((2, head_dim), "float32", scope="local")
        amax = T.alloc_buffer((1,), "float32", scope="local")
        sfq = T.alloc_buffer((1,), "float32", scope="local")
        mx = T.alloc_buffer((1,), "float32", scope="local")
        den = T.alloc_buffer((1,), "float32", scope="local")
        sc = T.alloc_buffer((1,), "float32", scope="local")
        acc = T.alloc_buffer((head_dim,), "float32", scope="local")
        # ---- fused append: quantize this call's K/V rows into their page slots
        for i, h in T.grid(n, n_kv):
            for d in range(head_dim):
                row[0, d] = T.Cast("float32", k[i, h, d])
                row[1, d] = T.Cast("float32", v[i, h, d])
            for c in range(2):
                if nvfp4:
                    for blk in range(nblk):
                        amax[0] = T.float32(0)
                        for e in range(F.BLOCK):
                            # NaN never compares greater, so it is ignored (fmaxf); +-inf saturates
                            if T.fabs(row[c, blk * F.BLOCK + e]) > amax[0]:
                                amax[0] = T.fabs(row[c, blk * F.BLOCK + e])
                        pool[pt[tseq[i], pos[i] // page_size], layer, c, h, pos[i] % page_size, half + blk] = \
                            T.Cast("uint8", e4m3_encode_abs(amax[0] / T.float32(6.0)))
                        sfq[0] = e4m3_decode_abs(e4m3_encode_abs(amax[0] / T.float32(6.0)))
                        for j in range(F.BLOCK // 2):
                            pool[pt[tseq[i], pos[i] // page_size], layer, c, h, pos[i] % page_size,
                                 blk * (F.BLOCK // 2) + j] = T.Cast(
                                "uint8",
                                nvfp4_code(row[c, blk * F.BLOCK + 2 * j], sfq[0])
                                | (nvfp4_code(row[c, blk * F.BLOCK + 2 * j + 1], sfq[0]) << T.uint32(4)))
                else:
                    amax[0] = T.float32(0)
                    for d in range(head_dim):
                        if T.fabs(row[c, d]) > amax[0]:
                            amax[0] = T.fabs(row[c, d])
                    # 2^-e as an exact power of two: biased exponent 254 - b
                    sfq[0] = pow2_from_e8m0(T.uint32(254) - fp8_row_exponent_tir(amax[0]))
                    for d in range(head_dim):
                        pool[pt[tseq[i], pos[i] // page_size], layer, c, h, pos[i] % page_size, d] = \
                            T.Cast("uint8", e4m3_encode(row[c, d] * sfq[0]))
                    pool[pt[tseq[i], pos[i] // page_size], layer, c, h, pos[i] % page_size, head_dim] = \
                        T.Cast("uint8", fp8_row_exponent_tir(amax[0]))
                    for d in range(FP8_ROW_PAD - 1):
                        pool[pt[tseq[i], pos[i] // page_size], layer, c, h, pos[i] % page_size,
                             head_dim + 1 + d] = T.uint8(0)
        # ---- attend, dequantizing page rows to fp32 on read
        for i, h in T.grid(n, n_heads):
            mx[0] = T.float32(neg_big)
            den[0] = T.float32(0)
            for d in range(head_dim):
                acc[d] = T.float32(0)
            for j in T.serial(pos[i] + 1):
                sc[0] = T.float32(0)
                for d in range(head_dim):
                    sc[0] = sc[0] + T.Cast("float32", q[i, h, d]) * load(
                        pool, pt[tseq[i], j // page_size], layer, 0, h // group, j % page_size, d)
                sc[0] = sc[0] * T.float32(sm_scale)
                if sc[0] > mx[0]:
                    den[0] = den[0] * T.exp(mx[0] - sc[0])
                    for d in range(head_dim):
                        acc[d] = acc[d] * T.exp(mx[0] - sc[0])
                    mx[0] = sc[0]
                den[0] = den[0] + T.exp(sc[0] - mx[0])
                for d in range(head_dim):
                    acc[d] = acc[d] + T.exp(sc[0] - mx[0]) * load(
                        pool, pt[tseq[i], j // page_size], layer, 1, h // group, j % page_size, d)
            for d in range(head_dim):
                out[i, h, d] = T.Cast(dtype, acc[d] / den[0])

    return attn
