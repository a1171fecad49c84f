"""rms_norm(x) @ w^T (+ epilogue) as one portable TIR kernel with the roundings of the CUDA fold (cuda/gemv.py
norm_eps): the reference build that lets the folded decode be checked on the CPU.

The CUDA decode can run each RMSNorm read only by dense GEMVs inside them (kernels.fused.norm_gemv): the products
take bf16(x * g) and the fp32 sums are divided by sqrt(mean(x^2) + eps), instead of the products taking
bf16(x / sqrt(mean(x^2) + eps) * g). That is a different rounding, not a different function, and a tiny random
model turns different roundings into visibly different logits. An llvm build with this kernel in the same place
(registry.llvm_norm_gemv_scope) rounds as the CUDA one does, so a GPU check can hold the folded build to the tight
bound the unfolded one meets, and the model wiring of the fold (which norm weight, eps, residual, epilogue) is
checked numerically on the CPU in f32, where both forms agree to fp32 rounding.

  norm_gemv(x[n, K], g[K] f32, w[O, K], [res[n, OO]]) -> out[n, OO]     (silu_mul: OO = O / 2, gate rows first)
"""
from __future__ import annotations

from tvm.script import tirx as T

EPILOGUES = ("none", "residual", "silu_mul")
COLS = 16  # output columns per parallel task (the row's sum of squares is recomputed per task: K of CB * K)


def supported(k: int, o: int, dtype: str, out_dtype: str, epilogue: str) -> bool:
    if epilogue not in EPILOGUES or dtype not in ("bfloat16", "float16", "float32"):
        return False
    if out_dtype not in (dtype, "float32") or (epilogue == "residual" and out_dtype != dtype):
        return False
    return k >= 1 and o >= 1 and not (epilogue == "silu_mul" and o % 2)


def norm_gemv(in_features: int, out_features: int, dtype: str, out_dtype: str | None = None, epilogue: str = "none",
              *, norm_eps: float, min_k: int = 0):
    """The prim_func (x, g, w, [res], out), or None where it does not apply (K < min_k: the CUDA schedule's
    norm_gemv.min_k, so both builds fold the same norms); the caller then keeps its norm and matmul."""
    K, O = int(in_features), int(out_features)
    out_dtype = out_dtype or dtype
    if K < min_k or not supported(K, O, dtype, out_dtype, epilogue):
        return None
    silu, has_res = epilogue == "silu_mul", epilogue == "residual"
    OO = O // 2 if silu else O
    blocks = (OO + COLS - 1) // COLS
    EPS = float(norm_eps)

    def f32(v):
        return T.Cast("float32", v)

    def rounded(v):
        """v (fp32) rounded to dtype, as fp32. bf16 by bits (nearest even): TVM's llvm lowering drops an fp32 ->
        bf16 -> fp32 cast pair inside a kernel, so Cast would not round at all."""
        if dtype != "bfloat16":
            return f32(T.Cast(dtype, v))
        u = T.reinterpret("uint32", v)
        return T.reinterpret("float32", (u + T.uint32(0x7FFF) + ((u >> T.uint32(16)) & T.uint32(1)))
                             & T.uint32(0xFFFF0000))

    @T.macro
    def body(n, x, g, w, res, out):
        for task in T.parallel(n * blocks):
            r = task // blocks
            c0 = task % blocks * COLS
            rms = T.alloc_buffer((1,), "float32", scope="local")
            acc = T.alloc_buffer((2,), "float32", scope="local")
            rms[0] = T.float32(0)
            for k in range(K):
                rms[0] = rms[0] + f32(x[r, k]) * f32(x[r, k])
            rms[0] = T.sqrt(rms[0] / T.float32(K) + T.float32(EPS))
            for c in range(COLS):
                if c0 + c < OO:
                    acc[0] = T.float32(0)
                    acc[1] = T.float32(0)
                    for k in range(K):
                        acc[0] = acc[0] + rounded(f32(x[r, k]) * g[k]) * f32(w[c0 + c, k])
                        if silu:
                            acc[1] = acc[1] + rounded(f32(x[r, k]) * g[k]) * f32(w[OO + c0 + c, k])
                    if silu:
                        gate = rounded(acc[0] / rms[0])
                        up = rounded(acc[1] / rms[0])
                        out[r, c0 + c] = T.Cast(out_dtype, gate / (T.float32(1) + T.exp(-gate)) * up)
                    elif has_res:
                        out[r, c0 + c] = T.Cast(out_dtype, f32(res[r, c0 + c]) + rounded(acc[0] / rms[0]))
                    else:
                        out[r, c0 + c] = T.Cast(out_dtype, acc[0] / rms[0])

    if has_res:
        @T.prim_func
        def func(var_x: T.handle, var_g: T.handle, var_w: T.handle, var_res: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(var_x, (n, K), dtype)
            g = T.match_buffer(var_g, (K,), "float32")
            w = T.match_buffer(var_w, (O, K), dtype)
            res = T.match_buffer(var_res, (n, OO), dtype)
            out = T.match_buffer(var_out, (n, OO), out_dtype)
            body(n, x, g, w, res, out)
    else:
        @T.prim_func
        def func(var_x: T.handle, var_g: T.handle, var_w: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(var_x, (n, K), dtype)
            g = T.match_buffer(var_g, (K,), "float32")
            w = T.match_buffer(var_w, (O, K), dtype)
            out = T.match_buffer(var_out, (n, OO), out_dtype)
            body(n, x, g, w, None, out)

    short = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}
    return func.with_attr("global_symbol", f"norm_gemv_{K}x{O}_{short[dtype]}_{short[out_dtype]}_{epilogue}")
