"""NVFP4 / FP8 numerics oracle in numpy (what the TIR KV kernels must match bit for bit).

Encoding follows the production per-block routine (TRT-LLM/FlashInfer/vLLM ``cvt_warp_fp16_to_fp4``),
written with integer logic and explicit tables so that tests can compare it against ml_dtypes.

Conventions (fixed here, the kernels copy them):

* Block of 16 along the last axis. ``amax`` = max |x| over the block; NaN elements are ignored
  for amax (``fmaxf`` semantics), +-Inf participates (so the scale saturates to 448).
* ``global_scale`` is the *encode-side* FP32 factor ``enc_gs`` (TRT ``SFScaleVal``):
  ``sf = fp32(fp32(amax * gs) / 6)``, stored as E4M3 with RNE and saturation to 448 (subnormal
  E4M3 scales allowed, no clamp to 2^-9: a block whose scale rounds to 0 is flushed to zero,
  i.e. amax * gs <= 6 * 2^-10).  ``None`` means gs = 1, the KV-cache convention (NInfer).
* Elements: ``q = fp32(fp32(x * gs) / sf_decoded)`` (IEEE division, *not* an rcp multiply),
  then E2M1 RNE with saturation to +-6.  The sign bit is the IEEE sign of q, so -0.0 and small
  negatives that round to zero encode as code 8 (-0), as ``cvt.rn.satfinite`` and ml_dtypes do.
  NaN encodes as +6 (code 7, PTX ``.satfinite``).  All-zero blocks (and blocks whose scale
  underflows) get scale byte 0 and codes 0 (canonical +0).
* Decode: ``x = e2m1 * e4m3 / gs`` (the product is exact in fp32/bf16/fp16).
* Packing: two codes per byte, element 2i in the LOW nibble.
"""

from __future__ import annotations

import numpy as np

BLOCK = 16

# E2M1: low 3 bits magnitude, bit 3 sign.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
# Midpoints between consecutive magnitudes; a tie rounds to the even code.
_E2M1_BOUNDS = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
_E2M1_TIE_UP = np.array([False, True, False, True, False, True, False])  # lower code odd -> go up

E4M3_MAX = 448.0


def _e4m3_table() -> np.ndarray:
    """All 256 E4M3FN bit patterns decoded (0x7F/0xFF are NaN)."""
    b = np.arange(256)
    e, m = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    mag = np.where(e == 0, m * 2.0 ** -9, (1.0 + m / 8.0) * 2.0 ** (e - 7.0))
    mag[(b & 0x7F) == 0x7F] = np.nan
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


E4M3_VALUES = _e4m3_table()


# ---------------------------------------------------------------------------- scalar codecs

def encode_e4m3(x) -> np.ndarray:
    """float32 -> E4M3FN bytes, RNE, saturating to +-448 (``satfinite``); NaN -> 0x7F."""
    x = np.asarray(x, dtype=np.float32)
    u = x.view(np.uint32).astype(np.int64)
    sign = ((u >> 31) & 1).astype(np.uint8) << 7
    a = np.where(np.isnan(x), np.float32(0), np.abs(x))
    ua = a.view(np.uint32).astype(np.int64)
    e = (ua >> 23) - 127
    # Normal E4M3 (e >= -6): re-bias exponent to 7 and round the 23-bit mantissa to 3 bits.
    rebias = ((e + 7) << 23) | (ua & 0x7FFFFF)
    normal = (rebias + 0x7FFFF + ((rebias >> 20) & 1)) >> 20
    # Subnormal E4M3 (value < 2^-6): code = RNE(a * 2^9); the scaling is exact in fp32, and
    # code 8 (carry) is exactly the smallest normal.
    sub = np.rint(np.minimum(a, np.float32(2.0 ** -6)) * np.float32(512.0)).astype(np.int64)
    mag = np.where(e >= -6, normal, sub)
    mag = np.where(a > E4M3_MAX, 0x7E, mag)
    out = (mag.astype(np.uint8) & 0x7F) | sign
    return np.where(np.isnan(x), np.uint8(0x7F), out).astype(np.uint8)


def decode_e4m3(b) -> np.ndarray:
    return E4M3_VALUES[np.asarray(b, dtype=np.uint8)]


def encode_e2m1(q) -> np.ndarray:
    """float32 -> 4-bit E2M1 codes (uint8 0..15), RNE ties-to-even, saturating to +-6, NaN -> +6."""
    q = np.asarray(q, dtype=np.float32)
    a = np.abs(q)[..., None]
    mag = (a > _E2M1_BOUNDS).sum(-1) + ((a == _E2M1_BOUNDS) & _E2M1_TIE_UP).sum(-1)
    sign = np.signbit(q) & ~np.isnan(q)
    mag = np.where(np.isnan(q), 7, mag)
    return (mag + 8 * sign).astype(np.uint8)


def decode_e2m1(c) -> np.ndarray:
    return E2M1_VALUES[np.asarray(c, dtype=np.uint8) & 0xF]


def pack_nibbles(c: np.ndarray) -> np.ndarray:
    """[..., n] codes -> [..., n/2] bytes, element 2i in the low nibble."""
    c = np.asarray(c, dtype=np.uint8)
    return (c[..., 0::2] & 0xF) | ((c[..., 1::2] & 0xF) << 4)


def unpack_nibbles(b: np.ndarray) -> np.ndarray:
    b = np.asarray(b, dtype=np.uint8)
    return np.stack([b & 0xF, b >> 4], axis=-1).reshape(*b.shape[:-1], b.shape[-1] * 2)


# ---------------------------------------------------------------------------- NVFP4 blocks

def quantize_nvfp4(x, block: int = BLOCK, global_scale: float | None = None):
    """x float32 [..., n] -> (codes uint8 [..., n/2], scales uint8 E4M3 [..., n/block])."""
    x = np.asarray(x, dtype=np.float32)
    n = x.shape[-1]
    if n % block or block % 2:
        raise ValueError(f"last dim {n} must be a multiple of block {block} (even)")
    gs = np.float32(1.0 if global_scale is None else global_scale)
    xb = (x * gs).reshape(*x.shape[:-1], n // block, block)
    amax = np.where(np.isnan(xb), 0, np.abs(xb)).max(axis=-1)
    sf = encode_e4m3(amax / np.float32(6.0))
    sfq = decode_e4m3(sf)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = xb / sfq[..., None]
    codes = np.where(sfq[..., None] > 0, encode_e2m1(q), np.uint8(0))
    return pack_nibbles(codes.reshape(x.shape)), sf


def dequantize_nvfp4(codes, scales, n: int | None = None, block: int = BLOCK,
                     global_scale: float | None = None) -> np.ndarray:
    """Inverse of quantize_nvfp4 -> float32 [..., n]."""
    vals = decode_e2m1(unpack_nibbles(codes))
    n = vals.shape[-1] if n is None else n
    vals = vals[..., :n].reshape(*vals.shape[:-1], n // block, block)
    out = vals * decode_e4m3(scales)[..., None]
    if global_scale is not None:
        out = out / np.float32(global_scale)
    return out.reshape(*out.shape[:-2], n).astype(np.float32)


# ---------------------------------------------------------------------------- KV page layout

def nvfp4_row_bytes(head_dim: int) -> int:
    """Bytes per token per KV head for K (or V): D/2 codes + D/16 scales (144 at D=256)."""
    return head_dim // 2 + head_dim // BLOCK


def pack_kv_nvfp4(x) -> np.ndarray:
    """[..., D] float -> [..., D/2 + D/16] uint8 rows: codes, then the natural row-major scales."""
    codes, scales = quantize_nvfp4(x)
    return np.concatenate([codes, scales], axis=-1)


def unpack_kv_nvfp4(rows, head_dim: int) -> np.ndarray:
    rows = np.asarray(rows, dtype=np.uint8)
    h = head_dim // 2
    return dequantize_nvfp4(rows[..., :h], rows[..., h:h + head_dim // BLOCK], head_dim)


_KV_BYTES_PER_ELEM = {"bf16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1.0 / BLOCK, "f32": 4.0}


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: str) -> int:
    """K + V bytes per token over all attention layers (fp8's per-tensor scale amortises to 0)."""
    if dtype not in _KV_BYTES_PER_ELEM:
        raise ValueError(f"unknown KV dtype {dtype!r}; expected one of {sorted(_KV_BYTES_PER_ELEM)}")
    if dtype == "nvfp4" and head_dim % BLOCK:
        raise ValueError(f"nvfp4 needs head_dim % {BLOCK} == 0, got {head_dim}")
    return int(2 * num_layers * kv_heads * head_dim * _KV_BYTES_PER_ELEM[dtype])


# ---------------------------------------------------------------------------- FP8 per-tensor

def fp8_scale(x) -> np.float32:
    """Per-tensor decode scale amax/448 (1.0 for an all-zero tensor)."""
    amax = np.float32(np.nanmax(np.abs(np.asarray(x, dtype=np.float32)), initial=0.0))
    return np.float32(amax / np.float32(E4M3_MAX)) if amax > 0 else np.float32(1.0)


def quantize_fp8(x, scale=None):
    """x -> (E4M3 bytes of x/scale, scale). ``scale`` is the decode scale (calibrated for KV)."""
    x = np.asarray(x, dtype=np.float32)
    s = fp8_scale(x) if scale is None else np.float32(scale)
    return encode_e4m3(x / s), s


def dequantize_fp8(codes, scale) -> np.ndarray:
    return decode_e4m3(codes) * np.float32(scale)


# ---------------------------------------------------------------------------- Hadamard

def hadamard(x, axis: int = -1) -> np.ndarray:
    """Orthonormal Sylvester Walsh-Hadamard transform along ``axis`` (size a power of two).

    H is symmetric and H @ H = I, so applying it twice is the identity; applied to Q and K after
    RoPE it leaves QK^T unchanged while spreading channel outliers before NVFP4 quantization.
    """
    x = np.asarray(x)
    dt = x.dtype.type if x.dtype in (np.float32, np.float64) else np.float32
    y = np.moveaxis(x.astype(dt), axis, -1)
    n = y.shape[-1]
    if n < 1 or n & (n - 1):
        raise ValueError(f"hadamard size must be a power of two, got {n}")
    lead = y.shape[:-1]
    h = 1
    while h < n:
        v = y.reshape(*lead, n // (2 * h), 2, h)
        a, b = v[..., 0, :].copy(), v[..., 1, :].copy()
        v[..., 0, :], v[..., 1, :] = a + b, a - b
        y = v.reshape(*lead, n)
        h *= 2
    y = y * dt(1.0 / np.sqrt(n))
    return np.moveaxis(y, -1, axis)


def hadamard_matrix(n: int) -> np.ndarray:
    return hadamard(np.eye(n, dtype=np.float64), axis=0)
