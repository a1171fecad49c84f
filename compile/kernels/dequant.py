"""NVFP4 weight dequantization as a tensor expression feeding a relax matmul. (On CUDA the relax
pipeline does not fuse this injective op into the matmul's reduction: it runs as its own kernel
writing W in the activation dtype, then the DLight GEMV/matmul reads that; checked with
gpu_pipeline.last_report(), "dequant_nvfp4*: Fallback".)

E2M1 and E4M3 are decoded with integer ops and an exact bit-level float construction: TVM's
LLVM fp8/fp4 casts are wrong (research/tvm_probe.md Q5), and this also keeps CUDA and CPU
bit-identical.

CUDA sm_120 builds can instead run NVFP4Linear on the block-scaled FP4 tensor cores
(compile/kernels/cuda/fp4_mma.py): activations are quantized to NVFP4 on the fly for prefill-size
row counts, decode row counts keep this dequant path. compile/build.py turns it on with
`fp4_mma_scope(...)` around model construction (`--fp4-mma on|off`, default on for
cuda:sm_120 + --quant nvfp4).

Prefill functions on sm_90 run NVFP4Linear as one dequantize into the activation dtype, then the wgmma GEMM
(decode_gemv's "dequantized" path); that dequantize is the hand-written copy-rate kernel of
compile/kernels/cuda/dequant_nvfp4.py (the same numbers; the tensor expression below got DLight's Fallback
schedule, far from the copy rate).

Decode functions (decode, mtp_step) on CUDA bypass both: NVFP4Linear.decode_gemv runs the hand-written
NVFP4 GEMV (compile/kernels/cuda/gemv.py gemv_nvfp4), which reads the codes and scales directly, with the
bf16 Linear's fused residual / silu_mul epilogues (compile/model.py _project, MLP).
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager

from tvm import te, tirx
from tvm.relax.frontend import nn

# The kernel set's gemv factory while a decode-rows function is traced (decode, mtp_step) on a target that
# has one (CUDA); compile/model.py imports it as its _GEMV. NVFP4Linear then runs as one hand-written GEMV
# launch over its NVFP4 buffers (compile/kernels/cuda/gemv.py gemv_nvfp4, via weight_format="nvfp4"):
# 4.5 bits per weight streamed instead of a dequant kernel writing the whole weight in bf16 every call.
_GEMV: contextvars.ContextVar = contextvars.ContextVar("ninfer_gemv", default=None)

# None, or the options of the FP4 MMA path: {"target": tvm Target (cuda sm_120), "low_batch":
# [[max_rows, bucket], ...]} (rows <= a max_rows keep the dequant + LowBatchGEMV path)
_FP4_MMA: contextvars.ContextVar = contextvars.ContextVar("ninfer_fp4_mma", default=None)


@contextmanager
def fp4_mma_scope(options: dict | None):
    """NVFP4Linear modules constructed inside use the FP4 MMA kernel when `options` is set."""
    token = _FP4_MMA.set(options)
    try:
        yield
    finally:
        _FP4_MMA.reset(token)


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
    return nn.tensor_expr_op(lambda c, s, g: dequant_compute(c, s, g, out_f, in_f, dtype, name), name,
                             [codes, scales, global_scale])


def dequant_compute(c: te.Tensor, s: te.Tensor, g: te.Tensor, out_f, in_f, dtype: str,
                    name: str = "dequant_nvfp4") -> te.Tensor:
    """W[o, i] = e2m1(code) * e4m3(scale[o, i/16]) * g[o], in dtype (shared with fp4_mma.py)."""

    def elem(o, i):
        byte = c[o, i // 2].astype("uint32")
        code = (byte >> ((i % 2) * 4).astype("uint32")) & 15
        return (_e2m1(code) * _e4m3(s[o, i // 16]) * g[o]).astype(dtype)

    return te.compute((out_f, in_f), elem, name=name)


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
        self.fp4_mma = _FP4_MMA.get()

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        y = self.decode_gemv(x)
        if y is not None:
            return y
        if self.fp4_mma is not None:
            return self._forward_fp4_mma(x)
        w = dequantize_nvfp4_weight(self.weight, self.weight_scale, self.weight_scale_2, self.dtype)
        y = nn.op.matmul(x, nn.op.permute_dims(w), out_dtype="float32")
        return y if self.dtype == "float32" else y.astype(self.dtype)

    def decode_gemv(self, x: nn.Tensor, epilogue: str = "none", residual: nn.Tensor | None = None,
                    out_dtype: str | None = None) -> nn.Tensor | None:
        """x[n, in] @ dequant(W)^T + epilogue ("none" | "residual": residual + y | "silu_mul": silu(gate) * up
        of the two output halves) through the decode GEMV, or None outside a decode-rows function, without a
        gemv in the kernel set, or where it does not apply (the caller keeps its path)."""
        factory = _GEMV.get()
        if factory is None or len(x.shape) != 2 or x.dtype != self.dtype:
            return None
        out_dtype = out_dtype or x.dtype
        func = factory(self.in_features, self.out_features, x.dtype, out_dtype, epilogue, weight_format="nvfp4")
        weights = [self.weight, self.weight_scale, self.weight_scale_2]
        name = "gemv_nvfp4"
        if func is None:  # the prefill GEMM: one dequantize to the activation dtype, then the dense kernel
            func = factory(self.in_features, self.out_features, x.dtype, out_dtype, epilogue,
                           weight_format="dequantized")
            if func is None:
                return None
            weights = [self._dequantized_for_gemm()]
            name = "gemm_dequantized"
        args = [x] + weights + ([residual] if residual is not None else [])
        o = self.out_features // 2 if epilogue == "silu_mul" else self.out_features
        name += "" if epilogue == "none" else f"_{epilogue}"
        return nn.op.tensor_ir_op(func, name, args, nn.Tensor.placeholder((x.shape[0], o), out_dtype))

    def _dequantized_for_gemm(self) -> nn.Tensor:
        """The weight in the activation dtype for the sm_90 prefill GEMM: the hand-written copy-rate dequant
        (compile/kernels/cuda/dequant_nvfp4.py, the same numbers as dequantize_nvfp4_weight), else the tensor
        expression."""
        from .cuda.dequant_nvfp4 import dequant_nvfp4

        func = dequant_nvfp4(self.in_features, self.out_features, self.dtype)
        if func is None:
            return dequantize_nvfp4_weight(self.weight, self.weight_scale, self.weight_scale_2, self.dtype)
        return nn.op.tensor_ir_op(func, "dequant_nvfp4_cuda", [self.weight, self.weight_scale, self.weight_scale_2],
                                  nn.Tensor.placeholder((self.out_features, self.in_features), self.dtype))

    def _forward_fp4_mma(self, x: nn.Tensor) -> nn.Tensor:
        """One thread-bound call: dequant + LowBatchGEMV for decode row counts, activation NVFP4
        quantization + block-scaled FP4 MMA above them (compile/kernels/cuda/fp4_mma.py)."""
        from .cuda.fp4_mma import nvfp4_mma_linear

        opts = self.fp4_mma
        lead = list(x.shape[:-1])
        x2 = x if len(lead) == 1 else nn.op.reshape(x, [-1, self.in_features])
        func = nvfp4_mma_linear(self.in_features, self.out_features, self.dtype, target=opts["target"],
                                low_batch=tuple(tuple(int(v) for v in lb) for lb in opts.get("low_batch", ())))
        y = nn.op.tensor_ir_op(func, "nvfp4_linear", args=[x2, self.weight, self.weight_scale, self.weight_scale_2],
                               out=nn.Tensor.placeholder([x2.shape[0], self.out_features], self.dtype))
        return y if len(lead) == 1 else nn.op.reshape(y, lead + [self.out_features])
