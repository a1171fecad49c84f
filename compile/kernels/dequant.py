"""NVFP4 weight dequantization as a tensor expression, so relax fuses it into the consuming
matmul (the decode GEMV reads 4.5 bits per weight instead of 16).

E2M1 and E4M3 are decoded with integer ops and an exact bit-level float construction: TVM's
LLVM fp8/fp4 casts are wrong (research/tvm_probe.md Q5), and this also keeps CUDA and CPU
bit-identical.
"""
from __future__ import annotations

from tvm import te, tirx
from tvm.relax.frontend import nn


def _e4m3(b):
    """E4M3FN byte -> fp32, exact (NaN patterns are never produced by the quantizer)."""
    b = b.astype("uint32")
    e = (b >> 3) & 15
    m = b & 7
    normal = tirx.reinterpret("float32", ((e + 120) << 23) | (m << 20))
    sub = m.astype("float32") * tirx.const(2.0 ** -9, "float32")
    return tirx.if_then_else(e == 0, sub, normal)


def _e2m1(code):
    """4-bit E2M1 code -> fp32: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 is the sign."""
    mag = code & 7
    e = mag >> 1
    half = (mag & 1).astype("float32") * tirx.const(0.5, "float32")
    scale = tirx.if_then_else(e == 1, tirx.const(1.0, "float32"),
                              tirx.if_then_else(e == 2, tirx.const(2.0, "float32"), tirx.const(4.0, "float32")))
    val = tirx.if_then_else(e == 0, half, (tirx.const(1.0, "float32") + half) * scale)
    return tirx.if_then_else((code & 8) != 0, -val, val)


def dequantize_nvfp4_weight(codes: nn.Tensor, scales: nn.Tensor, global_scale: nn.Tensor, dtype: str,
                            name: str = "dequant_nvfp4") -> nn.Tensor:
    out_f = int(codes.shape[0])
    in_f = int(codes.shape[1]) * 2

    def compute(c: te.Tensor, s: te.Tensor, g: te.Tensor):
        def elem(o, i):
            byte = c[o, i // 2].astype("uint32")
            code = (byte >> ((i % 2) * 4).astype("uint32")) & 15
            return (_e2m1(code) * _e4m3(s[o, i // 16]) * g[o]).astype(dtype)

        return te.compute((out_f, in_f), elem, name=name)

    return nn.tensor_expr_op(compute, name, [codes, scales, global_scale])


class NVFP4Linear(nn.Module):
    """y = x @ dequant(W)^T with W stored as NVFP4 (no bias)."""

    def __init__(self, in_features: int, out_features: int, dtype: str):
        if in_features % 16:
            raise ValueError(f"NVFP4 linear needs in_features % 16 == 0, got {in_features}")
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.weight = nn.Parameter((out_features, in_features // 2), "uint8")
        self.weight_scale = nn.Parameter((out_features, in_features // 16), "uint8")
        # per output row, so fused projections keep each source tensor's scale exactly
        self.weight_scale_2 = nn.Parameter((out_features,), "float32")

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        w = dequantize_nvfp4_weight(self.weight, self.weight_scale, self.weight_scale_2, self.dtype)
        y = nn.op.matmul(x, nn.op.permute_dims(w), out_dtype="float32")
        return y if self.dtype == "float32" else y.astype(self.dtype)
