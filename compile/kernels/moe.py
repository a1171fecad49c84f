"""Mixture-of-experts kernels, portable (llvm) versions: router top-k and the routed SwiGLU experts.

Contract shared with the CUDA set (compile/kernels/cuda/moe.py), so compile/moe.py composes either:

  moe_topk(logits[n, E+1] f32) -> ids[n, K+1] int32, weights[n, K+1] f32
      logits: the router's E expert logits, then the shared expert's gate logit (one fused projection).
      p = softmax(logits[:E]) in fp32; the K largest p, ties to the lower expert index (vLLM / SGLang /
      TensorRT-LLM fused top-k; torch.topk on CPU orders ties by its selection algorithm, on CUDA by
      index); weights p / sum(selected p) when `norm` (norm_topk_prob) else p. Column K is the shared
      expert: id E, weight sigmoid(logits[E]).
  moe_experts(x[n, D], ids, weights, gate_up, down) -> out[n, D] (activation dtype)
      out[t] = sum_{j < P} weights[t, j] * round(down[e] @ h_j), h_j = round(silu(round(g)) * round(u)),
      (g | u) = gate_up[e] @ x[t], e = ids[t, j], sums in fp32; round() = to the activation dtype (the
      rounding points of the decode GEMV's silu_mul epilogue). P = K, or K + 1 when the shared expert is
      stored as expert E of the same arrays (compile/moe.py: equal intermediate sizes).
  Expert weights: gate_up [Ex, 2I, D] (gate rows, then up rows), down [Ex, D, I] in the activation dtype, or
  NVFP4 (NVFP4Linear's three buffers per array with a leading expert axis: codes u8 [Ex, O, in/2], E4M3
  block scales u8 [Ex, O, in/16], fp32 row scales [Ex, O]), dequantized per element as dequant.py does.

Plain loops, tokens in parallel; each token reads only its selected experts' weights.
"""
from __future__ import annotations

from tvm.script import tirx as T

from .dequant import _e2m1, _e4m3


def moe_topk(n_experts: int, top_k: int, norm: bool):
    E, K = int(n_experts), int(top_k)

    @T.prim_func(s_tir=True)  # a root block: relax's reshape-pattern check (one input) requires it
    def topk(var_logits: T.handle, var_ids: T.handle, var_w: T.handle):
        T.func_attr({"tirx.noalias": True})
        n = T.int64()
        logits = T.match_buffer(var_logits, (n, E + 1), "float32")
        ids = T.match_buffer(var_ids, (n, K + 1), "int32")
        w = T.match_buffer(var_w, (n, K + 1), "float32")
        with T.sblock("root"):
            # per-token scratch at function level (a root block for relax's pattern analysis), rows in parallel
            p = T.alloc_buffer((n, E), "float32")
            red = T.alloc_buffer((n, 3), "float32")
            best = T.alloc_buffer((n,), "int32")
            for t in T.parallel(n):
                red[t, 0] = logits[t, 0]
                for e in range(1, E):
                    red[t, 0] = T.max(red[t, 0], logits[t, e])
                red[t, 1] = T.float32(0)
                for e in range(E):
                    p[t, e] = T.exp(logits[t, e] - red[t, 0])
                    red[t, 1] = red[t, 1] + p[t, e]
                for e in range(E):
                    p[t, e] = p[t, e] / red[t, 1]
                red[t, 2] = T.float32(0)
                for j in range(K):
                    best[t] = 0
                    for e in range(1, E):  # strict >: the lower index wins a tie; taken experts hold -1
                        if p[t, e] > p[t, best[t]]:
                            best[t] = T.Cast("int32", e)
                    ids[t, j] = best[t]
                    w[t, j] = p[t, best[t]]
                    red[t, 2] = red[t, 2] + p[t, best[t]]
                    p[t, best[t]] = T.float32(-1)
                if norm:
                    for j in range(K):
                        w[t, j] = w[t, j] / red[t, 2]
                ids[t, K] = E
                w[t, K] = T.float32(1) / (T.float32(1) + T.exp(-logits[t, E]))

    return topk


def _rnd(dtype, v):
    """fp32 value rounded to the activation dtype and back."""
    return T.Cast("float32", T.Cast(dtype, v))


def moe_experts(hidden: int, inter: int, n_slots: int, top_k: int, pairs: int, dtype: str,
                weight_format: str | None = None):
    """Routed SwiGLU experts over each token's first `pairs` (ids, weights) columns; n_slots experts
    in the arrays (num_experts, + 1 with the shared expert folded in)."""
    D, I, Ex, K, P = int(hidden), int(inter), int(n_slots), int(top_k), int(pairs)
    nvfp4 = weight_format == "nvfp4"
    if weight_format not in (None, "nvfp4"):
        raise ValueError(f"moe_experts: unknown weight format {weight_format!r}")
    if nvfp4 and (D % 16 or I % 16):
        raise ValueError(f"NVFP4 experts need hidden and intermediate sizes divisible by 16, got {D}, {I}")

    if nvfp4:
        def wval(codes, scales, gs, e, row, k):
            code = (T.Cast("uint32", codes[e, row, k // 2]) >> T.Cast("uint32", k % 2 * 4)) & T.uint32(15)
            return T.Cast("float32", T.Cast(dtype, _e2m1(code) * _e4m3(scales[e, row, k // 16]) * gs[e, row]))
    else:
        def wval(wt, _s, _g, e, row, k):
            return T.Cast("float32", wt[e, row, k])

    @T.macro
    def run(n, x, ids, w, gu, gus, gug, dn, dns, dng, out):
        h = T.alloc_buffer((n, I), "float32")
        acc = T.alloc_buffer((n, D), "float32")
        red = T.alloc_buffer((n, 2), "float32")
        for t in T.parallel(n):
            for d in range(D):
                acc[t, d] = T.float32(0)
            for j in range(P):
                for i in range(I):
                    red[t, 0] = T.float32(0)
                    red[t, 1] = T.float32(0)
                    for d in range(D):
                        red[t, 0] = red[t, 0] + wval(gu, gus, gug, ids[t, j], i, d) * T.Cast("float32", x[t, d])
                        red[t, 1] = red[t, 1] + wval(gu, gus, gug, ids[t, j], I + i, d) * T.Cast("float32", x[t, d])
                    red[t, 0] = _rnd(dtype, red[t, 0])
                    h[t, i] = _rnd(dtype, red[t, 0] / (T.float32(1) + T.exp(-red[t, 0])) * _rnd(dtype, red[t, 1]))
                for d in range(D):
                    red[t, 0] = T.float32(0)
                    for i in range(I):
                        red[t, 0] = red[t, 0] + wval(dn, dns, dng, ids[t, j], d, i) * h[t, i]
                    acc[t, d] = acc[t, d] + w[t, j] * _rnd(dtype, red[t, 0])
            for d in range(D):
                out[t, d] = T.Cast(dtype, acc[t, d])

    if nvfp4:
        @T.prim_func
        def experts(var_x: T.handle, var_ids: T.handle, var_w: T.handle, var_gu: T.handle, var_gus: T.handle,
                    var_gug: T.handle, var_dn: T.handle, var_dns: T.handle, var_dng: T.handle, var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(var_x, (n, D), dtype)
            ids = T.match_buffer(var_ids, (n, K + 1), "int32")
            w = T.match_buffer(var_w, (n, K + 1), "float32")
            gu = T.match_buffer(var_gu, (Ex, 2 * I, D // 2), "uint8")
            gus = T.match_buffer(var_gus, (Ex, 2 * I, D // 16), "uint8")
            gug = T.match_buffer(var_gug, (Ex, 2 * I), "float32")
            dn = T.match_buffer(var_dn, (Ex, D, I // 2), "uint8")
            dns = T.match_buffer(var_dns, (Ex, D, I // 16), "uint8")
            dng = T.match_buffer(var_dng, (Ex, D), "float32")
            out = T.match_buffer(var_out, (n, D), dtype)
            run(n, x, ids, w, gu, gus, gug, dn, dns, dng, out)
    else:
        @T.prim_func
        def experts(var_x: T.handle, var_ids: T.handle, var_w: T.handle, var_gu: T.handle, var_dn: T.handle,
                    var_out: T.handle):
            T.func_attr({"tirx.noalias": True})
            n = T.int64()
            x = T.match_buffer(var_x, (n, D), dtype)
            ids = T.match_buffer(var_ids, (n, K + 1), "int32")
            w = T.match_buffer(var_w, (n, K + 1), "float32")
            gu = T.match_buffer(var_gu, (Ex, 2 * I, D), dtype)
            dn = T.match_buffer(var_dn, (Ex, D, I), dtype)
            out = T.match_buffer(var_out, (n, D), dtype)
            run(n, x, ids, w, gu, None, None, dn, None, None, out)

    return experts
