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


class TiledTensorCoreMatmul(GPUScheduleRule):
    """WMMA matmul with configurable tiles (fp32 accumulation, f16/bf16 inputs).

    The same steps as DLight's MatmulTensorization (reindex to C[S,I,J] += A[S,I,K] B[S,J,K], pad,
    16x16x16 blocks, register-staged double buffering through dynamic shared memory, fragment
    loads, fused epilogue), but the block/warp tiling is a parameter instead of DLight's fixed
    128x128 block of 16 warps with 32x32 warp tiles: larger warp tiles load each shared-memory
    fragment for more mma ops.
      warps_m, warps_n   warps along rows / columns of a block tile
      frags_m, frags_n   16x16 accumulator fragments per warp along rows / columns
      k_frags            16-wide K steps per shared-memory stage
    """

    def __init__(self, warps_m: int = 4, warps_n: int = 4, frags_m: int = 2, frags_n: int = 2, k_frags: int = 4,
                 vector: int = 4):
        self.wm, self.wn, self.fm, self.fn, self.kf, self.vec = warps_m, warps_n, frags_m, frags_n, k_frags, vector

    def apply(self, func, target, tunable):  # noqa: C901 - one linear schedule
        from tvm import s_tir
        from tvm.s_tir.dlight.analysis import get_root_block
        from tvm.s_tir.dlight.gpu.matmul import (
            auto_inline_consumer_chain, auto_inline_producers, get_index_map, get_reduction_blocks,
        )

        if not self.is_target_available(target) or "dlight.do_not_tensorize" in (func.attrs or {}):
            return None
        sch = s_tir.Schedule(func)
        blocks = sch.get_child_blocks(get_root_block(sch))
        reduction = get_reduction_blocks(sch, blocks)
        if reduction is None:
            return None
        main = reduction[0]
        dtypes = {str(r.source.dtype) for r in sch.get(main).reads}
        if len(dtypes) != 1 or next(iter(dtypes)) not in ("float16", "bfloat16"):
            return None
        if str(sch.get(main).writes[0].source.dtype) != "float32":
            return None
        in_dtype = next(iter(dtypes))
        rea, reb, rec = (sch.reindex(main, ("read", 0)), sch.reindex(main, ("read", 1)),
                         sch.reindex(main, ("write", 0)))
        maps = get_index_map(sch.get(main))
        if maps is None:
            return None
        mm_map, a_map, b_map, c_map = maps
        sch.transform_layout(rea, ("write", 0), a_map)
        sch.transform_layout(reb, ("write", 0), b_map)
        sch.transform_layout(rec, ("read", 0), c_map)
        sch.transform_block_layout(main, mm_map)
        wm, wn, fm, fn, kf = self.wm, self.wn, self.fm, self.fn, self.kf
        sch.pad_einsum(main, [1, 16 * wm * fm, 16 * wn * fn, 16 * kf])
        batch, i, j, k = sch.get_loops(main)
        i, ii = sch.split(i, [None, 16])
        j, ji = sch.split(j, [None, 16])
        k, ki = sch.split(k, [None, 16])
        sch.reorder(i, j, k, ii, ji, ki)
        inner = main
        outer = sch.blockize(ii)
        i0, i1, i2, i3 = sch.split(i, [None, 1, wm, fm])
        j0, j1, j2, j3 = sch.split(j, [1, None, wn, fn])
        k0, k1 = sch.split(k, [None, kf])
        sch.annotate(k0, "software_pipeline_order", [0, 3, 1, 4, 5, 2, 6])
        sch.annotate(k0, "software_pipeline_stage", [0, 0, 0, 0, 0, 1, 1])
        sch.annotate(k1, "software_pipeline_order", [0, 1, 2])
        sch.annotate(k1, "software_pipeline_stage", [0, 0, 1])
        sch.reorder(i0, j0, i1, j1, j2, i2, k0, k1, i3, j3)
        sch.bind(batch, "blockIdx.z")
        sch.bind(sch.fuse(i0, j0), "blockIdx.x")
        sch.bind(sch.fuse(i1, j1), "blockIdx.y")
        ty = sch.fuse(j2, i2)
        sch.bind(ty, "threadIdx.y")
        n_warps = wm * wn

        def to_shared(idx):
            rd = sch.cache_read(outer, idx, "shared.dyn")
            sch.compute_at(rd, k0)
            fused = sch.fuse(*sch.get_loops(rd)[-2:])
            _, f1, f2, f3 = sch.split(fused, [None, n_warps, 32, self.vec])
            sch.bind(f2, "threadIdx.x")
            sch.bind(f1, "threadIdx.y")
            sch.vectorize(f3)
            sch.storage_align(rd, 0, axis=-2, factor=16, offset=8)
            sch.annotate(rd, "tirx.manifest_shared_memory_local_stage", 1)
            sch.annotate(rd, "double_buffer_scope", 0)
            return rd

        a_s, b_s = to_shared(0), to_shared(1)
        auto_inline_producers(sch, a_s)
        auto_inline_producers(sch, b_s)
        a_f = sch.cache_read(outer, 0, "wmma.matrix_a")
        b_f = sch.cache_read(outer, 1, "wmma.matrix_b")
        sch.compute_at(a_f, k1)
        sch.compute_at(b_f, k1)
        c_s = sch.cache_write(outer, 0, "shared.dyn")
        sch.storage_align(c_s, 0, -2, 16, 4)
        c_f = sch.cache_write(outer, 0, "wmma.accumulator")
        sch.reverse_compute_at(c_f, ty)
        sch.reverse_compute_at(c_s, ty)
        x, y = sch.get_loops(c_f)[-2:]
        x0, x1 = sch.split(x, [None, 16])
        y0, y1 = sch.split(y, [None, 16])
        sch.reorder(x0, y0, x1, y1)
        init = sch.get_child_blocks(sch.decompose_reduction(outer, k0))[0]
        _register_bf16_intrinsics()
        with (_bf16_intrinsic_group() if in_dtype == "bfloat16" else _no_change()):
            from tvm.s_tir.tensor_intrin.cuda import get_wmma_intrin_group

            grp = get_wmma_intrin_group(load_scope="shared.dyn", store_scope="shared.dyn", in_dtype="float16",
                                        out_dtype="float32", trans_b=True)
        try:
            for frag, key in ((a_f, "load_a"), (b_f, "load_b")):
                x, y = sch.get_loops(frag)[-2:]
                x0, x1 = sch.split(x, [None, 16])
                y0, y1 = sch.split(y, [None, 16])
                sch.reorder(x0, y0, x1, y1)
                sch.unroll(x0)
                sch.unroll(y0)
                sch.tensorize(x1, grp[key])
            sch.tensorize(sch.get_loops(init)[-2], grp["init"])
            sch.tensorize(sch.get_loops(c_f)[-2], grp["store"])
            sch.tensorize(sch.get_loops(inner)[-3], grp["compute"])
        except Exception:  # noqa: BLE001 - not this pattern
            return None
        auto_inline_consumer_chain(sch, c_s)
        fused = sch.fuse(*sch.get_loops(c_s)[-2:])
        _, f1, f2 = sch.split(fused, [None, 32, self.vec])
        sch.bind(f1, "threadIdx.x")
        sch.vectorize(f2)
        return sch


@contextmanager
def _no_change():
    yield
