"""Accuracy of the sm_120 NVFP4-KV attention's FP4 QK (paged_attention fp4_qk) against the dequant path, on the CPU.

    .venv/bin/python bench/fp4_attn_accuracy.py [--ctx 512 4096] [--seeds 3]

Both paths read the same NVFP4 K/V pages; the dequant path (f16 mma on K dequantized in registers, Q in f16) is
exact up to f16/fp32 rounding, so its error against the float64 reference over the dequantized pages is ~1e-3
(the CPU emulator measures it: tests/test_cuda_build.py). The FP4 QK adds Q's NVFP4 quantization (per (token, head)
row scale enc = 2688 / amax, E4M3 block scales per 16, E2M1 codes: compile/kernels/cuda/emulate/attention.py
quantize_q_nvfp4). This prints, per input kind and context length (float64, 27B geometry: 24 q / 4 kv heads,
D = 256, scale 1/16), max and mean over (token, head) rows of |o - o_ref|_2 / |o_ref|_2 and max|o - o_ref| /
max|o_ref| (the emulator checks' rel_err) of
  fp4_vs_dequant   attention with the quantized Q against the exact Q, same dequantized pages (what fp4_qk adds)
  dequant_vs_bf16  the dequant path against attention over the unquantized bf16 K/V (the NVFP4 KV error itself)
  fp4_vs_bf16      the FP4 QK path against the unquantized K/V (both errors)
The kernel itself matches the Q-quantized reference to ~1e-3 (bf16 output; tests/test_fp4_attn.py).

Inputs (n_tok query tokens per case, K/V rows through the page codec):
  random    q, k, v ~ N(0, 1)
  outliers  as random, then 4 of the 256 channels x 20 in q and k (massive-activation channels), k rows scaled by
            exp(U(-2, 2)), a few q entries x 50 (per-row spikes)
"""
from __future__ import annotations

import argparse
import sys

import numpy as np

from ninfer_mlc.compile import nvfp4 as F
from ninfer_mlc.compile.kernels.cuda.emulate.attention import quantize_q_nvfp4

HQ, HKV, D = 24, 4, 256


def make_inputs(kind: str, ctx: int, n_tok: int, seed: int):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((n_tok, HQ, D)).astype(np.float32)
    k = rng.standard_normal((ctx, HKV, D)).astype(np.float32)
    v = rng.standard_normal((ctx, HKV, D)).astype(np.float32)
    if kind == "outliers":
        ch = rng.choice(D, 4, replace=False)
        q[..., ch] *= 20
        k[..., ch] *= 20
        k *= np.exp(rng.uniform(-2, 2, (ctx, HKV, 1))).astype(np.float32)
        spikes = rng.random(q.shape) < 0.002
        q[spikes] *= 50
    elif kind != "random":
        raise ValueError(kind)
    import ml_dtypes

    q, k, v = (x.astype(ml_dtypes.bfloat16).astype(np.float32) for x in (q, k, v))  # the activations are bf16
    kd = F.unpack_kv_nvfp4(F.pack_kv_nvfp4(k), D).astype(np.float64)
    vd = F.unpack_kv_nvfp4(F.pack_kv_nvfp4(v), D).astype(np.float64)
    return q, kd, vd, k.astype(np.float64), v.astype(np.float64)


def attend(q, K, V, scale: float):
    """q [n, Hq, D], K/V [L, Hkv, D] float64 -> [n, Hq, D] (every query over all L positions)."""
    g = HQ // HKV
    qg = q.reshape(q.shape[0], HKV, g, D)
    s = np.einsum("nkgd,lkd->nkgl", qg, K) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("nkgl,lkd->nkgd", p, V) / p.sum(-1, keepdims=True)
    return o.reshape(q.shape)


def _errs(got, ref) -> dict:
    row = np.linalg.norm(got - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
    return dict(row_max=float(row.max()), row_mean=float(row.mean()),
                rel_err=float(np.abs(got - ref).max() / np.abs(ref).max()))


def q_quant_error(kind: str, ctx: int, seed: int, n_tok: int = 8) -> dict:
    """{"fp4_vs_dequant": FP4 QK against the dequant path (same pages: Q's quantization alone), "dequant_vs_bf16" /
    "fp4_vs_bf16": either path against attention over the unquantized (bf16) K/V: the NVFP4 KV error it adds to}."""
    q, K, V, Kb, Vb = make_inputs(kind, ctx, n_tok, seed)
    deq = attend(q.astype(np.float64), K, V, D ** -0.5)
    fp4 = attend(quantize_q_nvfp4(q).astype(np.float64), K, V, D ** -0.5)
    bf16 = attend(q.astype(np.float64), Kb, Vb, D ** -0.5)
    return dict(fp4_vs_dequant=_errs(fp4, deq), dequant_vs_bf16=_errs(deq, bf16), fp4_vs_bf16=_errs(fp4, bf16))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--seeds", type=int, default=3)
    a = ap.parse_args(argv)
    print("input     ctx   comparison        row-rel-L2 max  row-rel-L2 mean  max|err|/max|ref|")
    for kind in ("random", "outliers"):
        for ctx in a.ctx:
            rs = [q_quant_error(kind, ctx, s) for s in range(a.seeds)]
            for cmp in ("fp4_vs_dequant", "dequant_vs_bf16", "fp4_vs_bf16"):
                e = [r[cmp] for r in rs]
                print(f"{kind:9s} {ctx:5d} {cmp:16s} {max(x['row_max'] for x in e):14.4f}  "
                      f"{np.mean([x['row_mean'] for x in e]):15.4f}  {max(x['rel_err'] for x in e):17.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
