"""y = x W^T + b on the CPU as one parallel, vectorised TIR kernel (llvm).

The llvm relax pipeline leaves matmuls as single-threaded scalar loops (no CPU schedule exists in
TVM 0.27's default pipeline), which makes the vision tower take minutes per image on the host
(`--vision-cpu`). Here every task computes a block of 4 rows x CB columns: a 4 x 4 micro tile keeps
16 accumulators of 16 lanes along K (contiguous loads of x and W rows, vector FMAs) and folds the
lanes at the end; the 4 rows of x stay in cache while the task walks its columns.

  cpu_linear(x[n, K] f32, w[O, K] f32, b[O] f32) -> y[n, O] f32      (K % 16 == 0, O % 16 == 0)
"""
from __future__ import annotations

from tvm.script import tirx as T

LANES = 16
MR = 4  # rows of a micro tile
MC = 4  # columns of a micro tile


def applies(k: int, o: int) -> bool:
    return k % LANES == 0 and o % 16 == 0


def cpu_linear(k: int, o: int):
    cb = 64 if o % 64 == 0 else 16  # columns per task
    col_blocks = o // cb

    @T.prim_func
    def linear(var_x: T.handle, var_w: T.handle, var_b: T.handle, var_y: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        x = T.match_buffer(var_x, (n, k), "float32")
        w = T.match_buffer(var_w, (o, k), "float32")
        b = T.match_buffer(var_b, (o,), "float32")
        y = T.match_buffer(var_y, (n, o), "float32")
        for task in T.parallel((n + MR - 1) // MR * col_blocks):
            acc = T.alloc_buffer((MR, MC, LANES), "float32", scope="local")
            r0 = task // col_blocks * MR
            for cg in range(cb // MC):
                c0 = task % col_blocks * cb + cg * MC
                for r in T.unroll(MR):
                    for c in T.unroll(MC):
                        for lane in T.vectorized(LANES):
                            acc[r, c, lane] = T.float32(0)
                for k0 in range(k // LANES):
                    for r in T.unroll(MR):
                        for c in T.unroll(MC):
                            for lane in T.vectorized(LANES):
                                acc[r, c, lane] = acc[r, c, lane] + x[T.min(r0 + r, n - 1), k0 * LANES + lane] * \
                                    w[c0 + c, k0 * LANES + lane]
                for r, c in T.grid(MR, MC):
                    if r0 + r < n:
                        y[r0 + r, c0 + c] = b[c0 + c]
                        for lane in range(LANES):
                            y[r0 + r, c0 + c] = y[r0 + r, c0 + c] + acc[r, c, lane]

    return linear.with_attr("global_symbol", f"cpu_linear_{k}x{o}")
