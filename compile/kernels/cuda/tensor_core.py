"""Tensor-core matmuls for bf16 as well as f16 (WMMA 16x16x16, fp32 accumulation).

DLight's MatmulTensorization only knows float16 intrinsics. WMMA supports bf16 on sm_80+, so the
bf16 load/mma intrinsics are registered here and swapped into that rule's intrinsic group; the
schedule itself (tiling, shared-memory staging, fused epilogue) is DLight's.
"""
from __future__ import annotations

from contextlib import contextmanager

from tvm.s_tir.dlight.gpu.base import GPUScheduleRule

_REGISTERED = False


def _register_bf16_intrinsics() -> None:
    global _REGISTERED
    if _REGISTERED:
        return
    from tvm.s_tir import TensorIntrin
    from tvm.s_tir.tensor_intrin import cuda as ci

    for scope in ("shared", "shared.dyn"):
        tag = scope.replace(".", "_")
        TensorIntrin.register(f"wmma_load_16x16x16_bf16_a_{tag}",
                              *ci.get_wmma_load_intrin(16, 16, 16, "bfloat16", scope, False, False))
        TensorIntrin.register(f"wmma_load_16x16x16_bf16_b_trans_{tag}",
                              *ci.get_wmma_load_intrin(16, 16, 16, "bfloat16", scope, True, True))
        TensorIntrin.register(f"wmma_load_16x16x16_bf16_b_{tag}",
                              *ci.get_wmma_load_intrin(16, 16, 16, "bfloat16", scope, True, False))
    TensorIntrin.register("wmma_sync_16x16x16_bf16bf16f32_trans",
                          *ci.get_wmma_sync_intrin(16, 16, 16, "bfloat16", "float32", True))
    TensorIntrin.register("wmma_sync_16x16x16_bf16bf16f32",
                          *ci.get_wmma_sync_intrin(16, 16, 16, "bfloat16", "float32", False))
    _REGISTERED = True


@contextmanager
def _bf16_intrinsic_group():
    from tvm.s_tir.tensor_intrin import cuda as ci

    orig = ci.get_wmma_intrin_group

    def bf16_group(load_scope, store_scope, in_dtype, out_dtype, trans_b):
        if out_dtype != "float32":  # bf16 WMMA accumulates in fp32 only
            raise ValueError("bf16 WMMA needs an fp32 accumulator")
        group = orig(load_scope, store_scope, in_dtype, out_dtype, trans_b)
        return {k: v.replace("_f16_a", "_bf16_a").replace("_f16_b", "_bf16_b").replace("f16f16", "bf16bf16")
                for k, v in group.items()}

    ci.get_wmma_intrin_group = bf16_group
    try:
        yield
    finally:
        ci.get_wmma_intrin_group = orig


class TensorCoreMatmul(GPUScheduleRule):
    """DLight's WMMA matmul schedule for f16 inputs, and the same with bf16 intrinsics."""

    def apply(self, func, target, tunable):
        from tvm.s_tir.dlight.gpu.matmul import MatmulTensorization

        if not self.is_target_available(target):
            return None
        try:
            sch = MatmulTensorization().apply(func, target, tunable)
        except Exception:  # noqa: BLE001 - not a matmul it can tensorize
            sch = None
        if sch is not None:
            return sch
        _register_bf16_intrinsics()
        with _bf16_intrinsic_group():
            try:
                return MatmulTensorization().apply(func, target, tunable)
            except Exception:  # noqa: BLE001
                return None
