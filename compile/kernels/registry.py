"""Pick kernel factories per target and KV dtype.

Every factory of a set has the same signature and buffer contract as the portable (llvm) one in
attention.py / gdn.py, so the model definition never changes with the target.
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager
from functools import partial
from types import SimpleNamespace

from . import attention, gdn, moe, norm_gemv, sampling

# Set inside llvm_norm_gemv_scope(min_k): llvm decode folds its RMSNorms into the GEMVs of >= min_k inputs that
# read them, with the CUDA fold's roundings (norm_gemv.py): the reference a GPU check of a CUDA build with
# kernels.fused.norm_gemv needs. None (the default): the norms stay their own ops.
_LLVM_NORM_GEMV: contextvars.ContextVar = contextvars.ContextVar("ninfer_llvm_norm_gemv", default=None)


@contextmanager
def llvm_norm_gemv_scope(min_k: int | None):
    """llvm kernel sets made inside fold decode's norms into GEMVs of >= min_k inputs (None: no fold)."""
    tok = _LLVM_NORM_GEMV.set(None if min_k is None else int(min_k))
    try:
        yield
    finally:
        _LLVM_NORM_GEMV.reset(tok)


def llvm_norm_gemv() -> int | None:
    """The min_k of the llvm norm fold in scope, or None (part of an llvm library's cache key)."""
    return _LLVM_NORM_GEMV.get()


def _chunked_delta_rule(hk: int, hv: int, dk: int, dv: int, n_layers: int, chunk: int = gdn.CHUNK,
                        act_dtype: str | None = None):
    """The portable kernel (fp32 throughout; act_dtype only matters to the CUDA set's precision choice)."""
    return gdn.chunked_delta_rule(hk, hv, dk, dv, n_layers, chunk)


def kernel_set(target_kind: str = "llvm", kv_dtype: str | None = None) -> SimpleNamespace:
    if target_kind == "cuda":
        from .cuda import registry as cuda_registry

        return cuda_registry.kernel_set(kv_dtype)
    if target_kind != "llvm":
        raise ValueError(f"no kernels for target kind {target_kind!r}")
    # kv_dtype None: pages in the activation dtype; float32 | bfloat16 | fp8 | nvfp4 otherwise
    return SimpleNamespace(
        paged_attention=partial(attention.paged_attention, kv_dtype=kv_dtype),
        causal_conv=gdn.causal_conv,
        chunked_delta_rule=_chunked_delta_rule,
        recurrent_delta_rule=gdn.recurrent_delta_rule,
        gemv=None,  # decode projections stay relax matmuls (CUDA: kernels/cuda/gemv.py)
        gemv_rows=None,  # the shortlisted MTP head stays a relax matmul (CUDA: gemv.py gemv_rows)
        # decode's RMSNorms stay their own ops (CUDA: folded into the bf16 GEMVs, gemv.py norm_eps; llvm inside
        # llvm_norm_gemv_scope: norm_gemv.py, the same roundings)
        gemv_norm=None if _LLVM_NORM_GEMV.get() is None else partial(norm_gemv.norm_gemv, min_k=_LLVM_NORM_GEMV.get()),
        rms_norm=None,  # relax rms_norm (CUDA: one launch, kernels/cuda/norm.py)
        qk_norm_rope=None,  # attention's split + q/k norms + RoPE stay separate (CUDA: kernels/cuda/qk_norm_rope.py)
        gdn_decode=None,  # unfused GDN decode math (CUDA: one launch, kernels/cuda/gdn_decode.py)
        gdn_decode_conv=None,  # decode's conv stays its own kernel (CUDA: folded into the step, gdn_decode.py)
        gdn_prep=None,  # relax split / cast / L2 norm around the prefill conv (CUDA: kernels/cuda/gdn_prep.py)
        gdn_gated_norm=None,
        sampler=sampling.sampler_kernels,  # sampler(vocab) -> process / select / logprobs / append / counts_add
        # mixture of experts (compile/moe.py): softmax top-k router, experts read per token
        moe_topk=moe.moe_topk,
        moe_experts=moe.moe_experts,
    )
