"""NVFP4 weight quantization (E2M1 in groups of 16 along the input dim, E4M3 group scales, one
FP32 per-tensor scale), in ModelOpt's on-disk form so both paths meet in one parameter set:

  weight          uint8 [out, in/2]   two E2M1 codes per byte, element 2i in the low nibble
  weight_scale    uint8 [out, in/16]  E4M3 bit patterns
  weight_scale_2  fp32  [1]           decode-side global: w = e2m1 * e4m3 * weight_scale_2
                                      (the compiled model keeps it per output row, see convert.py)

A bf16/f32 checkpoint is quantized here with the production rule (compile/nvfp4.py, global
encode scale 448*6/amax); a ModelOpt NVFP4 checkpoint (weight / weight_scale / weight_scale_2)
is taken as is.
"""
from __future__ import annotations

import numpy as np

from .nvfp4 import BLOCK, E4M3_MAX, dequantize_nvfp4, quantize_nvfp4

SUFFIXES = ("weight", "weight_scale", "weight_scale_2")


def quantize_weight(w: np.ndarray) -> dict[str, np.ndarray]:
    w = np.asarray(w, np.float32)
    if w.ndim != 2 or w.shape[1] % BLOCK:
        raise ValueError(f"NVFP4 needs a 2-D weight with in-features divisible by {BLOCK}, got {w.shape}")
    amax = float(np.nanmax(np.abs(w))) if w.size else 0.0
    gs = (E4M3_MAX * 6.0) / amax if amax > 0 else 1.0
    codes, scales = quantize_nvfp4(w, global_scale=gs)
    return {"weight": codes.astype(np.uint8), "weight_scale": scales.astype(np.uint8),
            "weight_scale_2": np.array([1.0 / gs], np.float32)}


def dequantize_weight(q: dict[str, np.ndarray]) -> np.ndarray:
    """Reference dequantization (what the compiled kernels compute)."""
    codes, scales = np.asarray(q["weight"], np.uint8), np.asarray(q["weight_scale"]).view(np.uint8)
    w = dequantize_nvfp4(codes, scales, n=codes.shape[-1] * 2)
    return (w * np.float32(np.asarray(q["weight_scale_2"], np.float32).reshape(-1)[0])).astype(np.float32)


def from_modelopt(tensors: dict[str, np.ndarray], base: str) -> dict[str, np.ndarray] | None:
    """The three NVFP4 tensors of layer `base` (e.g. "model.layers.0.mlp.up_proj") if the checkpoint
    stores it in ModelOpt NVFP4 form, else None."""
    w = tensors.get(base + ".weight")
    s = tensors.get(base + ".weight_scale")
    g = tensors.get(base + ".weight_scale_2")
    if w is None or s is None or g is None or np.asarray(w).dtype != np.uint8:
        return None
    return {"weight": np.asarray(w, np.uint8), "weight_scale": np.asarray(s).view(np.uint8),
            "weight_scale_2": np.asarray(g, np.float32).reshape(1)}
