"""CUDA kernel set: same factory names, prim_func signatures and buffer contracts as the llvm set.

Kernel variant parameters (threads per block, split target, GDN chunk and dv tile) come from the
"kernels" section of schedules/cuda_<arch>.json (gemv: the decode GEMV of gemv.py; its sizes are
per shape, see gemv.mma_warps), the same file the relax pipeline
(compile/gpu_pipeline.py) reads its DLight choices from (NINFER_SCHEDULE_DIR overrides the folder).
The arch is the one of the current target scope (`with Target(...)`), else NINFER_CUDA_ARCH, else
sm_90. compile/build.py constructs the model inside the target scope, so a build reads its own
arch's file; arch-specific kernels (ARCH_ONLY: the wgmma prefill GEMM) are left out of other arches' sets.
"""
from __future__ import annotations

import contextvars
import json
import os
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from . import attention, attention_verify, gdn, gdn_decode, gdn_prep, gemm_sm90, moe, norm, qk_norm_rope, sampling
from . import gemv as gemv_kernels

SCHEDULE_DIR = Path(__file__).resolve().parents[3] / "schedules"
DEFAULT_KERNELS: dict[str, dict[str, Any]] = {
    "paged_attention": {"threads": 128, "target_blocks": 264},
    "causal_conv": {"threads": 256},
    # mma: None = tensor cores (mma.sync tf32) where the geometry allows; mma_tile: value columns per block
    # of the sequential pass; tf32x3: each product as 3 tf32 mma (fp32-level error, ~1e-6) instead of 1
    # (~5e-4, well under bf16's rounding), "auto": 3 for fp32 activations, 1 for bf16 / f16 models
    "chunked_delta_rule": {"chunk": 32, "state_tile": 16, "ept": 16, "mma": None, "mma_tile": 32, "tf32x3": "auto"},
    "recurrent_delta_rule": {},
    "rms_norm": {"threads": 256},
    # programmatic dependent launch (compile/grid_dependency.py): when a kernel lets its successor launch. "entry":
    # right after its own wait (the successor's blocks become resident while this grid runs); "exit": only the
    # implicit trigger as its blocks exit (the successor is launched once this grid's blocks are done, before the
    # grid's completion is signalled); exit_kernels: name prefixes that keep "exit" under "entry"
    "grid_dependency": {"trigger": "exit", "exit_kernels": []},
    "gemv": {"unroll": 4, "min_warps": 1, "max_warps": 8, "target_warps": 2048, "big_tiles": 4, "fma_warps": 4,
             "sms": 132},
    # prefill GEMM (gemm_sm90.py, sm_90 only): tile columns, cp.async ring depth, grouped tile order, and
    # the row count up to which a call runs the decode GEMV's launch instead
    "gemm": {"bn": 256, "stages": 4, "group_m": 8, "small_rows": 32},
    # device sampler (sampling.py): threads of the per-row select / logprobs blocks, of the process launch
    "sampler": {"threads": 1024, "process_threads": 256},
    # grouped expert GEMMs (moe.py): warps splitting K, 16-bit K steps of 32 per warp iteration (NVFP4: half as
    # many steps of 128), batch tiles of 8 pairs per pass when more than 8 pairs share an expert; sms: the decode
    # kernel's launch bounds keep a one-token grid resident (moe.decode_launch)
    "moe": {"warps": 4, "unroll": 4, "big_tiles": 4, "sms": 132},
    # sm_90: calls of the grouped expert GEMMs with at least rows_per_expert (token, expert) pairs per expert slot
    # on average run the wgmma kernel (moe_sm90.py, gemm's tile with bn columns and a stages-deep ring) instead
    # of the mma.sync passes
    "moe_wgmma": {"bn": 256, "stages": 4, "rows_per_expert": 48},
    # launches that replace several (each measured or checked against the unfused sequence it replaces); false
    # builds the unfused sequence, for before/after measurements from one commit (NINFER_SCHEDULE_DIR) or as an
    # off switch: verify_attention (attention_verify.py: verify calls read each sequence's KV once), gdn_decode_conv
    # (gdn_decode.py: the decode step's causal conv inside the GDN launch, no split of the projection), qk_norm_rope
    # (qk_norm_rope.py: the attention's split + q/k norms + RoPE in one launch), norm_gemv (gemv.py norm_eps: decode's
    # input / post-attention / final RMSNorms inside the bf16 GEMVs that read them; OFF by default: 27B decode
    # 0.8-1.0 ms faster on the H100 (run 11) but the tiny bf16 GPU check's decode top-1 agreement with llvm fell to
    # 84 % (an unfolded llvm reference; bench/gpu_bench.py prep now folds its llvm reference the same way, and on the
    # CPU the fold moves the tiny bf16 logits by only 3e-3) and the 35B-A3B's short-K GEMVs got slower (norm_gemv.min_k
    # below); on only through a schedule override until that check passes on a GPU)
    "fused": {"verify_attention": True, "gdn_decode_conv": True, "qk_norm_rope": True, "norm_gemv": False},
    # the norm fold (fused.norm_gemv) only into GEMVs of at least min_k inputs: the 35B-A3B's K = 2048 GEMVs got
    # slower with the per-word squares and scales (run 11: 3.99 vs 3.77 ms per b=1 step), the 27B's K = 5120 faster
    "norm_gemv": {"min_k": 4096},
}
# kernels that exist for one arch only (wgmma: sm_90a)
ARCH_ONLY = {"gemm": ("sm_90",), "moe_wgmma": ("sm_90",)}
# arches whose nvfp4 attention takes the block-scaled FP4 QK (mma kind::mxf4nvf4: sm_120a, the RTX 50xx cubins)
FP4_QK_ARCHES = ("sm_120",)
# Off inside fp4_qk_scope(False) (`ninfer compile --fp4-qk off`): nvfp4 pages keep the dequantized-K path on sm_120 too
_FP4_QK: contextvars.ContextVar = contextvars.ContextVar("ninfer_fp4_qk", default=True)


@contextmanager
def fp4_qk_scope(enabled: bool):
    """Whether kernel sets made inside compute Q K^T of nvfp4 pages on the FP4 tensor cores (where they can)."""
    tok = _FP4_QK.set(bool(enabled))
    try:
        yield
    finally:
        _FP4_QK.reset(tok)


def fp4_qk_default(arch: str | None, kv_dtype: str | None) -> bool:
    """Where the FP4 QK runs unless turned off: sm_120 (sm_120a cubins) with nvfp4 KV pages."""
    return arch in FP4_QK_ARCHES and kv_dtype == "nvfp4"


def current_arch() -> str:
    try:
        from tvm.target import Target

        t = Target.current(allow_none=True)
        if t is not None and t.kind.name == "cuda" and str(getattr(t, "arch", "")).startswith("sm_"):
            return str(t.arch)
    except Exception:  # noqa: BLE001 - no target scope / runtime-only tvm
        pass
    return os.environ.get("NINFER_CUDA_ARCH", "sm_90")


def schedule_file(arch: str) -> Path:
    """schedules/cuda_<arch>.json, or the same name under NINFER_SCHEDULE_DIR."""
    return Path(os.environ.get("NINFER_SCHEDULE_DIR") or SCHEDULE_DIR) / f"cuda_{arch}.json"


def load_schedule(arch: str) -> dict:
    f = schedule_file(arch)
    return json.loads(f.read_text()) if f.is_file() else {}


def kernel_params(arch: str | None = None) -> dict:
    sched = load_schedule(arch or current_arch()).get("kernels", {})
    out = {}
    for name, defaults in DEFAULT_KERNELS.items():
        given = {k: v for k, v in sched.get(name, {}).items() if k in defaults}
        out[name] = {**defaults, **given}
    return out


def kernel_set(kv_dtype: str | None = None, arch: str | None = None) -> SimpleNamespace:
    """kv_dtype: KV page dtype (None = activation dtype): float32 / bfloat16 / float16, or the
    quantized fp8 / nvfp4 page rows (same layout and bytes as the llvm kernel)."""
    arch = arch or current_arch()
    p = kernel_params(arch)
    cp = p["chunked_delta_rule"]

    def chunked_delta_rule(hk: int, hv: int, dk: int, dv: int, n_layers: int, chunk: int | None = None,
                           act_dtype: str | None = None):
        """act_dtype: the model's activation dtype (picks the tf32x3 "auto" precision; None: fp32-level)."""
        x3 = cp["tf32x3"]
        if x3 == "auto":
            x3 = act_dtype not in ("bfloat16", "float16")
        return gdn.chunked_delta_rule(hk, hv, dk, dv, n_layers, chunk or cp["chunk"], state_tile=cp["state_tile"],
                                      ept=cp["ept"], mma=cp["mma"], mma_tile=cp["mma_tile"], tf32x3=bool(x3))

    def verify_attention(n_heads: int, n_kv: int, head_dim: int, page_size: int, n_layers: int, dtype: str,
                         sm_scale: float):
        """paged_attention's contract for calls of few rows per sequence (verify): the verify attend launch, or
        None where it does not apply (those keep paged_attention)."""
        if not p["fused"]["verify_attention"] or not attention_verify.verify_applies(n_heads, n_kv, head_dim, dtype,
                                                                                       kv_dtype):
            return None
        return attention.paged_attention(n_heads, n_kv, head_dim, page_size, n_layers, dtype, sm_scale, kv_dtype=kv_dtype,
                                         **p["paged_attention"], short_rows=True)

    mw = p["moe_wgmma"]
    moe_wgmma = (mw["bn"], mw["stages"], mw["rows_per_expert"]) if arch in ARCH_ONLY["moe_wgmma"] else None
    return SimpleNamespace(
        # fp4_qk: nvfp4 pages on sm_120 (sm_120a cubins) compute Q K^T on the block-scaled FP4 tensor cores
        paged_attention=partial(attention.paged_attention, kv_dtype=kv_dtype, **p["paged_attention"],
                                **({"fp4_qk": True} if fp4_qk_default(arch, kv_dtype) and _FP4_QK.get() else {})),
        # verify_attention(same arguments) -> paged_attention's contract, a block per sequence (verify calls), or None
        verify_attention=verify_attention,
        causal_conv=partial(gdn.causal_conv, **p["causal_conv"]),
        chunked_delta_rule=chunked_delta_rule,
        recurrent_delta_rule=gdn.recurrent_delta_rule,
        # short_delta_rule(hk, hv, dk, dv, n_layers) -> gdn_chunk's contract, row by row (verify / replay calls)
        short_delta_rule=gdn.short_delta_rule,
        # gemv(in, out, dtype, out_dtype=None, epilogue="none") -> prim_func or None (decode projections)
        gemv=partial(gemv_kernels.gemv, **p["gemv"]),
        # gemv_norm(in, out, dtype, out_dtype, epilogue, norm_eps=eps) -> gemv of rms_norm(x, g) (args x, g, w, [res],
        # out), or None where it does not apply (bf16 dense weights only): the decode's norms fold into their GEMVs
        gemv_norm=partial(gemv_kernels.gemv, **p["gemv"], norm_min_k=p["norm_gemv"]["min_k"])
        if p["fused"]["norm_gemv"] else None,
        # gemv_rows(in, dtype, out_dtype=None) -> gemv over a weight of run-time rows (the shortlisted MTP head)
        gemv_rows=partial(gemv_kernels.gemv_rows, **p["gemv"]),
        # rms_norm(dim, dtype, eps) -> one-launch RMSNorm over the last axis (every function)
        rms_norm=partial(norm.rms_norm, **p["rms_norm"]),
        # qk_norm_rope(hq, hkv, dh, rotary_dim, dtype, eps, mrope_section=None) -> the gated attention's split of
        # the qkv projection + q/k RMS norms + RoPE in one launch (rms_norm's threads: its reduction order)
        qk_norm_rope=partial(qk_norm_rope.qk_norm_rope, **p["rms_norm"]) if p["fused"]["qk_norm_rope"] else None,
        # gdn_decode(hk, hv, dk, dv, n_layers, dtype, eps) -> the whole GDN decode step in one launch
        gdn_decode=gdn_decode.fused_gdn_decode,
        # gdn_decode_conv(hk, hv, dk, dv, kernel, n_layers, dtype, eps) -> the same step with the causal conv in it,
        # reading the qkv+z projection in place (one launch, then the conv tails' launch): what decode rows run
        gdn_decode_conv=partial(gdn_decode.fused_gdn_decode_conv, **p["causal_conv"])
        if p["fused"]["gdn_decode_conv"] else None,
        # prefill GDN around the chunked kernel: conv + q/k/v split + L2 norms in one launch, gated RMSNorm
        # reading z in place (None for geometries they do not take)
        gdn_prep=gdn_prep.gdn_prep,
        gdn_gated_norm=gdn_prep.gdn_gated_norm,
        # gemm(in, out, dtype, out_dtype=None, epilogue="none") -> prim_func or None: prefill projections
        # (gemv's contract; few rows run the gemv launch inside it). None where the arch has no such kernel.
        # sampler(vocab) -> process / select / logprobs / append / counts_add (the llvm set's contract)
        sampler=partial(sampling.sampler_kernels, **p["sampler"]),
        gemm=partial(gemm_sm90.gemm, **p["gemm"], gemv_params=tuple(sorted(p["gemv"].items())))
        if arch in ARCH_ONLY["gemm"] else None,
        # mixture of experts (compile/moe.py; moe.py's docstring for the contracts): router top-k with the pairs
        # grouped by expert, grouped gate_up / down GEMMs over the selected experts, weighted combine (+ residual)
        moe_route=moe.moe_route,  # top-k + pairs grouped by expert (one launch for decode-size calls)
        moe_route_len=moe.route_len,  # int32 entries of moe_route's route buffer for a number of expert slots
        moe_gate_up=lambda hidden, inter, slots, pairs, dtype, weight_format=None: moe.expert_gemm(
            "gate_up", hidden, 2 * inter, slots, pairs, dtype, weight_format, **p["moe"], wgmma=moe_wgmma),
        moe_down=lambda hidden, inter, slots, pairs, dtype, weight_format=None: moe.expert_gemm(
            "down", inter, hidden, slots, pairs, dtype, weight_format, **p["moe"], wgmma=moe_wgmma),
        moe_combine=moe.moe_combine,
        # down GEMM + combine (+ residual, + unfolded shared expert) in one prim_func: what compile/moe.py runs
        moe_down_combine=lambda hidden, inter, slots, pairs, top_k, dtype, weight_format, residual, shared:
        moe.moe_down_combine(inter, hidden, slots, pairs, top_k, dtype, weight_format, residual, shared, **p["moe"],
                             wgmma=moe_wgmma),
        moe_down_combine_counters=moe.down_combine_counters,  # its tickets in the route buffer (moe_route_len)
        moe_experts=None,  # the llvm set's per-token kernel
    )
