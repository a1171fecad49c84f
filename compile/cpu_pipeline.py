"""The llvm (CPU) build: TVM's generic CPU relax pipeline plus a schedule for the matmuls.

Legalized matmuls are plain ``i, j, k`` loop nests: one scalar multiply-add chain per output,
reading the ``[K, N]`` weight down a column. That made them a third of the tiny model's CPU
prefill. The schedule below turns each ``C[i, j] += A[i, k] * B[k, j]`` block into register tiles
of 4 rows x one SIMD vector of columns, swept along ``k`` (contiguous weight rows, the four row
values broadcast), with the tiles spread over the thread pool: the same arithmetic in the same
order per output element, so results do not change.
"""
from __future__ import annotations

import tvm
from tvm import relax

ROWS = 4  # output rows per register tile


def _lanes(n: int) -> int:
    return next(w for w in (8, 4, 2, 1) if n % w == 0)


def _is_nn_matmul(block, loops) -> bool:
    """C[i, j] (+)= A[i, k] * B[k, j] with loops (i, j, k): spatial, spatial, reduction."""
    iters = block.iter_vars
    if len(loops) != 3 or len(iters) != 3 or [int(v.iter_type) for v in iters] != [0, 0, 2]:
        return False
    i, j, k = (v.var for v in iters)
    if len(block.writes) != 1 or len(block.reads) < 2:
        return False
    w = block.writes[0].region
    if len(w) != 2 or not (w[0].min.same_as(i) and w[1].min.same_as(j)):
        return False
    reads = [r.region for r in block.reads if len(r.region) == 2]
    has_a = any(r[0].min.same_as(i) and r[1].min.same_as(k) for r in reads)
    has_b = any(r[0].min.same_as(k) and r[1].min.same_as(j) for r in reads)
    return has_a and has_b


def schedule_matmul(func: tvm.tirx.PrimFunc) -> tvm.tirx.PrimFunc | None:
    """The tiled schedule for a function with an NN matmul block named ``matmul``; None otherwise."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    try:
        blk = sch.get_sblock("matmul")
    except Exception:  # no such block: not a matmul
        return None
    loops = sch.get_loops(blk)
    if not _is_nn_matmul(sch.get(blk), loops):
        return None
    i, j, k = loops
    n = sch.get(j).extent
    if not isinstance(n, tvm.tirx.IntImm):
        return None
    lanes = _lanes(int(n))
    io, ii = sch.split(i, [None, ROWS])
    jo, ji = sch.split(j, [None, lanes])
    sch.reorder(io, jo, k, ii, ji)
    sch.parallel(sch.fuse(io, jo))
    sch.unroll(ii)
    sch.vectorize(ji)
    sch.decompose_reduction(blk, k)
    return sch.mod["main"]


@tvm.transform.module_pass(opt_level=0, name="NinferCPUMatmul")
def schedule_cpu_matmuls(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
    for gv, func in list(mod.functions.items()):
        if isinstance(func, tvm.tirx.PrimFunc) and not func.attrs.get("tirx.is_scheduled", False):
            done = schedule_matmul(func)
            if done is not None:
                mod[gv] = done.with_attr("tirx.is_scheduled", True)
    return mod


def relax_pipeline(target) -> tvm.transform.Pass:
    from tvm.relax.backend.cpu_generic import pipeline as cpu

    @tvm.transform.module_pass(opt_level=0, name="NinferCPUPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            seq = tvm.transform.Sequential(
                cpu.library_dispatch_passes(target) + cpu.legalize_passes(target) + [schedule_cpu_matmuls]
                + cpu.dataflow_lower_passes(target) + cpu.finalize_passes(target))
            return seq(mod)

    return _pipeline


def build_llvm(mod: tvm.IRModule, target):
    """Build a relax module for the llvm target; returns the relax executable."""
    return relax.build(mod, target=target, relax_pipeline=relax_pipeline(target))
