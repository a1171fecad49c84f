"""The Qwen3.x hybrid decoder in tvm.relax.frontend.nn.

Exported functions (all KV and recurrent state is runtime-owned and updated in place):
  prefill(tokens[n], positions[n], token_seq[n], cu_seqlens[b+1], page_table[b,p], slot_ids[b],
          logit_rows[r], kv_pool, conv_pool, ssm_pool) -> (logits[r,V] f32, kv_pool, conv_pool, ssm_pool)
      ragged chunk of tokens for one or more sequences; GDN uses the chunked (64) form.
  decode(tokens[b], positions[b], page_table[b,p], slot_ids[b], kv_pool, conv_pool, ssm_pool)
      -> (logits[b,V] f32, ...) one token per sequence; GDN uses the recurrent step.
Speculative decoding (final hidden states are post-norm, fp32):
  prefill_h(same as prefill) -> (logits[r,V], hidden[n,D], pools...)
  verify(tokens, positions, token_seq, cu_seqlens, page_table, slot_ids, pools...)
      -> (logits[n,V], hidden[n,D], qkvz_rows[L,n,conv_dim+value_dim], ba_rows[L,n,2Hv], pools...)
      qkvz_rows / ba_rows: the L GDN layers' projections of every row (models with GDN layers)
  gdn_replay(qkvz_rows, ba_rows, rows[m], cu_seqlens[b+1], slot_ids[b], conv_pool, ssm_pool) -> (conv_pool, ssm_pool)
      advances each slot's conv + recurrent state over the chosen verify rows (a partly accepted round's
      prefix, from the pre-verify state) as the verify did: speculative rollback without a re-feed
  with the MTP head (mtp=True; mtp_kv_pool [num_pages, 1, 2, kv_heads, 64, head_dim], the main page tables):
  mtp_step(hidden[n,D], next_tokens[n], positions[n], token_seq[n], page_table, mtp_kv_pool)
      -> (logits[n,V], hidden_out[n,D], mtp_kv_pool)
  mtp_prefill(..., logit_rows[r], mtp_kv_pool) -> (logits[r,V], hidden_out[r,D], mtp_kv_pool)
  mtp_step_sl(..., shortlist[m], mtp_kv_pool) -> (logits[n,m] over the shortlisted ids, hidden_out, mtp_kv_pool)
  with the shortlisted proposal head on the device (manifest extras.mtp_head_draft; runtime/spec/mtp.py):
  mtp_head_build(head_ids[m]) -> head_w[m,D] (lm_head / tied embedding rows, activation dtype; once per shortlist)
  mtp_step_hd(hidden, next_tokens, positions, token_seq, page_table, head_w[m,D], head_pos[V], mtp_kv_pool)
      -> (logits[n,V], hidden_out[n,D], mtp_kv_pool): logits only over head_w's rows (head_pos[v]: the row of id
      v, -1 for ids outside the head, whose logits are -inf), so the device sampler's [n, V] contract holds
  mtp_prefill_hd(..., logit_rows[r], head_w, head_pos, mtp_kv_pool) -> (logits[r,V], hidden_out[r,D], mtp_kv_pool)
With tap layers (a DFlash drafter's target_layer_ids, `ninfer compile --tap-layers`):
  prefill_t(same as prefill) -> (logits[r,V], taps[n, T*D], pools...)
  verify_t(same as verify) -> (logits[n,V], taps[n, T*D], qkvz_rows, ba_rows, pools...)
      taps: the outputs of decoder layers tap_layers (HF hidden_states[id + 1]), concatenated, in the
      activation dtype; the plain functions are unchanged.
Images (multimodal=True, Qwen3_5ForConditionalGeneration checkpoints):
  prefill_mm(tokens, positions, rope_positions[n,3], token_seq, cu_seqlens, page_table, slot_ids, logit_rows,
             image_embeds[m,D] f32, row_src[n], pools...) -> (logits[r,V], pools...)
  decode_mrope(tokens[b], positions[b], rope_positions[b], page_table, slot_ids, pools...) -> (logits[b,V], ...)
  (positions = cache slots / causal order; rope_positions = what RoPE rotates by, M-RoPE per token)
The builder adds the device sampler's functions (sample, sampler_counts_add: compile/sampler_module.py), which
take the logits these functions return.

Parameter names follow transformers (model.layers.{i}.linear_attn.conv1d.weight ...), except that
projections reading the same input are fused (FUSED_PROJECTIONS: gate_up_proj, qkv_proj,
in_proj_qkv_z, in_proj_ba) and zero-centred norm weights carry the folded +1 (compile/convert.py).
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Protocol

import numpy as np
from tvm import te, tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .config import ModelConfig
from ..contract.pool_layout import PAGE_SIZE, PoolLayout
from .kernels.dequant import _GEMV, NVFP4Linear
from .kernels.registry import kernel_set
from .nvfp4 import hadamard_matrix
from .kernels.rope import apply_rope

MROPE_SECTION = [11, 11, 10]  # transformers' default when rope_parameters has no mrope_section


def _i32(v: int):
    return tirx.IntImm("int32", v)


# the kernel set's rms_norm factory while the model is constructed (None: relax rms_norm)
_NORM: contextvars.ContextVar = contextvars.ContextVar("ninfer_norm", default=None)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis in fp32; the weight already includes the +1 offset.

    With a kernel set that has rms_norm (CUDA) it is one launch instead of a cast plus a norm."""

    def __init__(self, dim: int, eps: float):
        self.weight = nn.Parameter((dim,), "float32")
        self.dim, self.eps = dim, eps
        self._factory = _NORM.get()

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        if self._factory is not None and len(x.shape) >= 2:
            shape = list(x.shape)
            rows = shape[0]
            for d in shape[1:-1]:
                rows = rows * d
            flat = op.reshape(x, (rows, self.dim)) if len(shape) > 2 else x
            y = op.tensor_ir_op(self._factory(self.dim, x.dtype, self.eps), "rms_norm", [flat, self.weight],
                                nn.Tensor.placeholder((rows, self.dim), x.dtype))
            return op.reshape(y, shape) if len(shape) > 2 else y
        y = op.rms_norm(x.astype("float32"), self.weight, axes=[-1], epsilon=self.eps)
        return y.astype(x.dtype)


class Weight(nn.Module):
    """A bare parameter under a module name (conv1d.weight) so names match transformers."""

    def __init__(self, shape, dtype):
        self.weight = nn.Parameter(shape, dtype)


# True while a function whose sequences have few rows each (verify, verify_t, gdn_replay) is traced: GDN runs the
# kernel set's short_delta_rule (row by row, the state in registers) instead of the chunked form where it has one,
# full attention the kernel set's verify_attention (a block per sequence reads its K/V once for all its rows)
_SHORT_ROWS: contextvars.ContextVar = contextvars.ContextVar("ninfer_short_rows", default=False)


@contextlib.contextmanager
def short_rows_scope():
    token = _SHORT_ROWS.set(True)
    try:
        yield
    finally:
        _SHORT_ROWS.reset(token)


# weight format of the projections being built (None | "nvfp4"); set by Qwen3xForCausalLM
_WEIGHT_QUANT: contextvars.ContextVar = contextvars.ContextVar("ninfer_weight_quant", default=None)
# _GEMV (defined in kernels/dequant.py, shared with NVFP4Linear): the kernel set's gemv factory while a
# decode-rows function is traced (decode, mtp_step) on a target that has one (CUDA): projections then run
# as one hand-written GEMV launch with fused epilogues (NVFP4 weights: NVFP4Linear.decode_gemv)


# the kernel set's gemv_norm while a decode function is traced (decode, decode_mrope), None elsewhere: the RMSNorms
# whose every reader is a dense decode GEMV run inside those GEMVs (gemv.py norm_eps) instead of as their own launch
_GEMV_NORM: contextvars.ContextVar = contextvars.ContextVar("ninfer_gemv_norm", default=None)


class NormedRows:
    """norm(x) not computed yet: a decode GEMV that reads it takes x and the norm's weight (one launch fewer); any
    other reader gets the norm's output, computed once (materialize)."""

    def __init__(self, x: nn.Tensor, norm: "RMSNorm"):
        self.x, self.norm = x, norm
        self._y: nn.Tensor | None = None

    @property
    def shape(self):
        return self.x.shape

    @property
    def dtype(self):
        return self.x.dtype

    def materialize(self) -> nn.Tensor:
        if self._y is None:
            self._y = self.norm(self.x)
        return self._y


def _normed(norm: "RMSNorm", x: nn.Tensor, readers: list) -> "nn.Tensor | NormedRows":
    """norm(x), or NormedRows(x, norm) where gemv_norm is in scope and every reader (the modules, or bare weights,
    that project it) is a dense Linear or a dense weight, so no reader needs the normed tensor itself."""
    dense = bool(readers) and all(isinstance(r, Linear) or (isinstance(r, nn.Parameter) and len(r.shape) == 2)
                                  for r in readers)
    if _GEMV_NORM.get() is None or len(x.shape) != 2 or not dense:
        return norm(x)
    return NormedRows(x, norm)


def _rows(x) -> nn.Tensor:
    """The tensor a non-GEMV reader needs (NormedRows: the norm's output)."""
    return x.materialize() if isinstance(x, NormedRows) else x


def _gemv_normed(x: NormedRows, weight: nn.Parameter, out_dtype: str | None, epilogue: str,
                 residual: nn.Tensor | None, name: str) -> nn.Tensor | None:
    """rms_norm(x) @ weight^T (+ epilogue) in one gemv_norm launch, or None where it does not apply."""
    factory = _GEMV_NORM.get()
    if factory is None or len(weight.shape) != 2 or x.dtype != weight.dtype:
        return None
    o, k = (int(d) for d in weight.shape)
    out_dtype = out_dtype or x.dtype
    func = factory(k, o, x.dtype, out_dtype, epilogue, norm_eps=x.norm.eps)
    if func is None:
        return None
    args = [x.x, x.norm.weight, weight] + ([residual] if residual is not None else [])
    out = nn.Tensor.placeholder((x.shape[0], o // 2 if epilogue == "silu_mul" else o), out_dtype)
    return op.tensor_ir_op(func, name + "_rms", args, out)


def _gemv(x, weight: nn.Parameter, out_dtype: str | None = None, epilogue: str = "none",
          residual: nn.Tensor | None = None, name: str = "gemv") -> nn.Tensor | None:
    """x[n, K] @ weight[O, K]^T (+ epilogue) through the kernel set's GEMV, or None where it does not
    apply (not in a decode function, no gemv in the kernel set, or a shape/dtype it does not take).
    x may be NormedRows: gemv_norm where it applies, else the norm's output through the plain path."""
    if isinstance(x, NormedRows):
        y = _gemv_normed(x, weight, out_dtype, epilogue, residual, name)
        if y is not None:
            return y
        x = x.materialize()
    factory = _GEMV.get()
    if factory is None or len(x.shape) != 2 or len(weight.shape) != 2 or x.dtype != weight.dtype:
        return None
    o, k = (int(d) for d in weight.shape)
    out_dtype = out_dtype or x.dtype
    func = factory(k, o, x.dtype, out_dtype, epilogue)
    if func is None:
        return None
    args = [x, weight] + ([residual] if residual is not None else [])
    out = nn.Tensor.placeholder((x.shape[0], o // 2 if epilogue == "silu_mul" else o), out_dtype)
    return op.tensor_ir_op(func, name, args, out)


def _project(linear: nn.Module, x: nn.Tensor, residual: nn.Tensor | None = None) -> nn.Tensor:
    """linear(x), or residual + linear(x) (one fused GEMV launch where the decode GEMV applies)."""
    if residual is None:
        return linear(x)
    y = None
    if isinstance(linear, Linear):
        y = _gemv(x, linear.weight, epilogue="residual", residual=residual, name="gemv_residual")
    elif isinstance(linear, NVFP4Linear):
        y = linear.decode_gemv(x, epilogue="residual", residual=residual)
    if y is not None:
        return y
    return residual + linear(x)


@contextlib.contextmanager
def prefill_gemm_scope(gemm):
    """Trace a prefill-rows function: projections through the kernel set's prefill GEMM (the decode GEMV's
    contract and epilogues; sm_90 only). NVFP4 weights ask for weight_format "nvfp4" (no such GEMM: None)
    and then "dequantized" (the dense GEMM over the weight dequantized once per call); other targets keep
    their path."""

    def factory(k, o, dtype, out_dtype, epilogue, weight_format=None):
        if weight_format not in (None, "dequantized"):
            return None
        return gemm(k, o, dtype, out_dtype, epilogue)

    token = _GEMV.set(factory if gemm is not None else None)
    try:
        yield
    finally:
        _GEMV.reset(token)


@contextlib.contextmanager
def decode_gemv_scope(gemv):
    """Trace a decode-rows function (rows = batch, or a few per sequence): projections through the kernel
    set's GEMV (None: relax matmuls)."""
    token = _GEMV.set(gemv)
    try:
        yield
    finally:
        _GEMV.reset(token)


class Linear(nn.Module):
    """y = x W^T without bias, accumulated in fp32 and cast back (bf16 sums over 17k inputs drift)."""

    def __init__(self, i: int, o: int, dtype: str):
        self.in_features, self.out_features, self.dtype = i, o, dtype
        self.weight = nn.Parameter((o, i), dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        y = _gemv(x, self.weight)
        if y is not None:
            return y
        x = _rows(x)
        y = op.matmul(x, op.permute_dims(self.weight), out_dtype="float32")
        return y if self.dtype == "float32" else y.astype(self.dtype)


def _linear(i: int, o: int, dtype: str, quantizable: bool = True) -> nn.Module:
    if quantizable and _WEIGHT_QUANT.get() == "nvfp4" and i % 16 == 0:
        return NVFP4Linear(i, o, dtype)
    return Linear(i, o, dtype)


# Projections that read the same input are one matmul (one launch, one weight stream); the
# converter concatenates the checkpoint's matrices along the output dim in this order.
FUSED_PROJECTIONS = {
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "linear_attn.in_proj_qkv_z": ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z"),
    "linear_attn.in_proj_ba": ("linear_attn.in_proj_b", "linear_attn.in_proj_a"),
    # MoE (compile/moe.py): the router and the shared expert's gate; an unfolded shared expert's gate / up
    "mlp.router": ("mlp.gate", "mlp.shared_expert_gate"),
    "mlp.shared_expert.gate_up_proj": ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"),
}


def _feed_forward(cfg: ModelConfig, dtype: str, index: int, kernels) -> nn.Module:
    """The layer's MLP: the sparse MoE block where the config puts one (compile/moe.py), else the dense SwiGLU."""
    if cfg.is_moe_layer(index):
        from .moe import SparseMoeBlock  # moe.py builds on this module's Linear / MLP

        return SparseMoeBlock(cfg, dtype, kernels)
    return MLP(cfg, dtype)


class MLPDims(Protocol):
    """What MLP reads of a config: the target's ModelConfig or a DFlash drafter's DrafterConfig."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def intermediate_size(self) -> int: ...


class MLP(nn.Module):
    def __init__(self, cfg: MLPDims, dtype: str, intermediate: int | None = None):
        """intermediate: the hidden size of the SwiGLU (default: the config's dense intermediate_size)."""
        inter = intermediate or cfg.intermediate_size
        self.gate_up_proj = _linear(cfg.hidden_size, 2 * inter, dtype)
        self.down_proj = _linear(inter, cfg.hidden_size, dtype)

    def forward(self, x, residual=None):
        """residual: return residual + mlp(x) (fused into the down projection by the decode GEMV)."""
        h = None
        if isinstance(self.gate_up_proj, Linear):
            h = _gemv(x, self.gate_up_proj.weight, epilogue="silu_mul", name="gemv_silu_mul")
        elif isinstance(self.gate_up_proj, NVFP4Linear):
            h = self.gate_up_proj.decode_gemv(x, epilogue="silu_mul")
        if h is None:
            gate, up = op.split(self.gate_up_proj(_rows(x)), 2, axis=-1)
            h = op.silu(gate) * up
        return _project(self.down_proj, h, residual)


def _hadamard(x: nn.Tensor, dim: int) -> nn.Tensor:
    """Normalised Walsh-Hadamard over the last axis (fp32 matmul with the symmetric H)."""
    h = nn.Tensor.from_const(hadamard_matrix(dim).astype(np.float32))
    return op.matmul(x.astype("float32"), h).astype(x.dtype)


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: str, slot: int, kernels, kv_hadamard: bool = False,
                 n_layers: int | None = None):
        """n_layers: layers of the KV pool this attention writes into (None = the main model's)."""
        self.cfg, self.dtype, self.slot, self.kv_hadamard = cfg, dtype, slot, kv_hadamard
        hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv_proj = _linear(cfg.hidden_size, hq * 2 * dh + 2 * hkv * dh, dtype)
        self.o_proj = _linear(hq * dh, cfg.hidden_size, dtype)
        self.q_norm = RMSNorm(dh, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(dh, cfg.rms_norm_eps)
        self.kernel = kernels.paged_attention(hq, hkv, dh, PAGE_SIZE, n_layers or len(cfg.attn_layers), dtype,
                                              dh ** -0.5)
        verify = getattr(kernels, "verify_attention", None)
        self.short_kernel = verify(hq, hkv, dh, PAGE_SIZE, n_layers or len(cfg.attn_layers), dtype,
                                   dh ** -0.5) if verify else None
        if n_layers is not None:  # the MTP head's kernel (another pool shape) needs its own symbol
            self.kernel = self.kernel.with_attr("global_symbol", "attn_mtp")
        if self.short_kernel is not None:
            self.short_kernel = self.short_kernel.with_attr(
                "global_symbol", "attn_mtp_verify" if n_layers is not None else "attn_verify")
        # the split + q/k norms + RoPE in one launch (CUDA); the Hadamard rotation keeps the unfused path
        self.qk_prep = None if kv_hadamard else getattr(kernels, "qk_norm_rope", None)

    def forward(self, x, rope, positions, token_seq, page_table, kv_pool, residual=None, rope_positions=None):
        """residual: return residual + attention(x) (fused into o_proj by the decode GEMV).
        rope_positions: what RoPE rotates by when it differs from the cache position (M-RoPE: [n, 3] or
        [n] text positions shifted by the sequence's rope delta); None = positions."""
        cfg = self.cfg
        n = x.shape[0]
        hq, dh = cfg.num_attention_heads, cfg.head_dim
        rp = positions if rope_positions is None else rope_positions
        section = cfg.rope.get("mrope_section") or MROPE_SECTION
        prep = self.qk_prep
        if prep is not None:
            q, gate, k, v = self._fused_prep(prep, self.qkv_proj(x), rp, rope, section)
        else:
            q, gate, k, v = self._prep(self.qkv_proj(x), rp, rope, section)
        short = _SHORT_ROWS.get() and self.short_kernel is not None
        kv_pool, o = op.tensor_ir_inplace_op(
            self.short_kernel if short else self.kernel, "paged_attention_verify" if short else "paged_attention",
            [q, k, v, positions, token_seq, page_table, kv_pool, _i32(self.slot)],
            [6, -1], [kv_pool, nn.Tensor.placeholder((n, hq, dh), self.dtype)],
        )
        o = o * op.sigmoid(gate)
        return _project(self.o_proj, op.reshape(o, (n, hq * dh)), residual), kv_pool

    def _prep(self, qkv, rp, rope, section):
        """(q, gate, k, v) of the projection: split, q/k RMS norms, RoPE (and the Hadamard rotation)."""
        cfg = self.cfg
        n = qkv.shape[0]
        hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg, k, v = op.split(qkv, [hq * 2 * dh, hq * 2 * dh + hkv * dh], axis=1)
        q, gate = op.split(op.reshape(qg, (n, hq, 2 * dh)), 2, axis=2)
        k = op.reshape(k, (n, hkv, dh))
        v = op.reshape(v, (n, hkv, dh))
        inv_freq, factor = rope
        q = apply_rope(self.q_norm(q), rp, inv_freq, factor, cfg.rotary_dim, "rope_q", section)
        k = apply_rope(self.k_norm(k), rp, inv_freq, factor, cfg.rotary_dim, "rope_k", section)
        if self.kv_hadamard:  # rotate Q and K after RoPE (QK^T unchanged); V stays unrotated
            q, k = _hadamard(q, dh), _hadamard(k, dh)
        return q, gate, k, v

    def _fused_prep(self, prep, qkv, rp, rope, section):
        """_prep in one launch reading the projection in place (prep: the kernel set's qk_norm_rope): the same
        values bit for bit; [n, 3] positions take the M-RoPE variant."""
        cfg = self.cfg
        n = qkv.shape[0]
        hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        mrope = tuple(int(s) for s in section) if len(rp.shape) == 2 else None
        func = prep(hq, hkv, dh, cfg.rotary_dim, self.dtype, self.q_norm.eps, mrope)
        inv_freq, factor = rope
        args = [qkv, rp, inv_freq, factor, self.q_norm.weight, self.k_norm.weight]
        return op.tensor_ir_op(func, "qk_norm_rope", args,  # q, gate, k, v
                               [nn.Tensor.placeholder((n, h, dh), self.dtype) for h in (hq, hq, hkv, hkv)])


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: str, slot: int, kernels):
        self.cfg, self.dtype, self.slot = cfg, dtype, slot
        hv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        n_gdn = len(cfg.gdn_layers)
        self.in_proj_qkv_z = _linear(cfg.hidden_size, cfg.conv_dim + cfg.value_dim, dtype)
        self.in_proj_ba = _linear(cfg.hidden_size, 2 * hv, dtype, quantizable=False)  # tiny gate projections
        self.conv1d = Weight((cfg.conv_dim, cfg.linear_conv_kernel_dim), dtype)
        self.dt_bias = nn.Parameter((hv,), "float32")
        self.A_log = nn.Parameter((hv,), "float32")
        self.norm = Weight((dv,), "float32")
        self.out_proj = _linear(cfg.value_dim, cfg.hidden_size, dtype)
        hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
        self.conv_kernel = kernels.causal_conv(cfg.conv_dim, cfg.linear_conv_kernel_dim, n_gdn, dtype)
        self.chunk_kernel = kernels.chunked_delta_rule(hk, hv, dk, dv, n_gdn, act_dtype=dtype)
        self.step_kernel = kernels.recurrent_delta_rule(hk, hv, dk, dv, n_gdn)
        short = getattr(kernels, "short_delta_rule", None)
        self.short_kernel = short(hk, hv, dk, dv, n_gdn) if short else None
        fused = getattr(kernels, "gdn_decode", None)
        self.decode_kernel = fused(hk, hv, dk, dv, n_gdn, dtype, cfg.rms_norm_eps) if fused else None
        fused_conv = getattr(kernels, "gdn_decode_conv", None)
        self.decode_conv_kernel = fused_conv(hk, hv, dk, dv, cfg.linear_conv_kernel_dim, n_gdn, dtype,
                                             cfg.rms_norm_eps) if fused_conv else None
        prep, gated = getattr(kernels, "gdn_prep", None), getattr(kernels, "gdn_gated_norm", None)
        self.prep_kernel = prep(hk, hv, dk, dv, cfg.linear_conv_kernel_dim, n_gdn, dtype) if prep else None
        self.gated_norm_kernel = gated(hk, hv, dk, dv, dtype, cfg.rms_norm_eps) if gated else None

    def _l2norm(self, x):
        ss = op.sum(x * x, axis=[-1], keepdims=True)
        return x / op.sqrt(ss + 1e-6)

    def forward(self, x, cu_seqlens, slot_ids, conv_pool, ssm_pool, recurrent: bool, residual=None,
                keep: list | None = None):
        """residual: return residual + gdn(x) (fused into out_proj by the decode GEMV).
        keep: a list that receives this layer's (qkvz, ba) projections, the inputs replay() needs."""
        qkvz = self.in_proj_qkv_z(x)
        ba = self.in_proj_ba(x)
        if keep is not None:
            keep.append((qkvz, ba))
        o, conv_pool, ssm_pool = self._mix(qkvz, ba, cu_seqlens, slot_ids, conv_pool, ssm_pool, recurrent)
        return _project(self.out_proj, o, residual), conv_pool, ssm_pool

    def replay(self, qkvz, ba, cu_seqlens, slot_ids, conv_pool, ssm_pool):
        """Advance the conv and recurrent state over rows whose projections a verify kept, as that verify's
        (chunked) forward did, without the output: the accepted prefix of a speculative round."""
        _, conv_pool, ssm_pool = self._mix(qkvz, ba, cu_seqlens, slot_ids, conv_pool, ssm_pool, False, output=False)
        return conv_pool, ssm_pool

    def _mix(self, qkvz, ba, cu_seqlens, slot_ids, conv_pool, ssm_pool, recurrent: bool, output: bool = True):
        """Conv + delta rule over the projections: (gated-normed output [n, value_dim] or None, pools)."""
        cfg = self.cfg
        n = qkvz.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if recurrent and (self.decode_conv_kernel is not None or self.decode_kernel is not None):
            return self._fused_decode(qkvz, ba, cu_seqlens, slot_ids, conv_pool, ssm_pool)
        fused_prefill = not recurrent and self.prep_kernel is not None and self.gated_norm_kernel is not None
        if not fused_prefill:
            qkv, z = op.split(qkvz, [cfg.conv_dim], axis=1)
            z = op.reshape(z, (n, hv, dv))
        b, a = op.split(ba, 2, axis=1)
        beta = op.sigmoid(b).astype("float32")
        a = a.astype("float32")
        g = op.negative(op.exp(self.A_log)) * op.softplus(a + self.dt_bias)
        if fused_prefill:
            return self._fused_prefill(qkvz, g, beta, cu_seqlens, slot_ids, conv_pool, ssm_pool, output)
        conv_pool, u = op.tensor_ir_inplace_op(
            self.conv_kernel, "gdn_conv",
            [qkv, cu_seqlens, slot_ids, conv_pool, self.conv1d.weight, _i32(self.slot)],
            [3, -1], [conv_pool, nn.Tensor.placeholder((n, cfg.conv_dim), self.dtype)],
        )
        u = u.astype("float32")
        q, k, v = op.split(u, [cfg.key_dim, 2 * cfg.key_dim], axis=1)
        q = self._l2norm(op.reshape(q, (n, hk, dk))) * (dk ** -0.5)
        k = self._l2norm(op.reshape(k, (n, hk, dk)))
        v = op.reshape(v, (n, hv, dv))
        out = nn.Tensor.placeholder((n, hv, dv), "float32")
        if recurrent:
            ssm_pool, o = op.tensor_ir_inplace_op(
                self.step_kernel, "gdn_step",
                [q, k, v, g, beta, slot_ids, ssm_pool, _i32(self.slot)], [6, -1], [ssm_pool, out],
            )
        else:
            ssm_pool, o = op.tensor_ir_inplace_op(
                self.chunk_kernel, "gdn_chunk",
                [q, k, v, g, beta, cu_seqlens, slot_ids, ssm_pool, _i32(self.slot)], [7, -1], [ssm_pool, out],
            )
        if not output:
            return None, conv_pool, ssm_pool
        # gated RMSNorm: normalise in fp32, plain weight, times silu(z)
        o = op.rms_norm(o, self.norm.weight, axes=[-1], epsilon=cfg.rms_norm_eps).astype(self.dtype)
        o = (o.astype("float32") * op.silu(z.astype("float32"))).astype(self.dtype)
        return op.reshape(o, (n, cfg.value_dim)), conv_pool, ssm_pool

    def _fused_prefill(self, qkvz, g, beta, cu_seqlens, slot_ids, conv_pool, ssm_pool, output: bool = True):
        """Prefill (CUDA): conv + q/k/v split + L2 norms in one launch, the chunked delta rule, then the
        gated RMSNorm reading z in place from the projection (no split copies)."""
        cfg = self.cfg
        n = qkvz.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_pool, q, k, v = op.tensor_ir_inplace_op(
            self.prep_kernel, "gdn_prep",
            [qkvz, cu_seqlens, slot_ids, conv_pool, self.conv1d.weight, _i32(self.slot)], [3, -1, -1, -1],
            [conv_pool, nn.Tensor.placeholder((n, hk, dk), "float32"), nn.Tensor.placeholder((n, hk, dk), "float32"),
             nn.Tensor.placeholder((n, hv, dv), "float32")],
        )
        short = _SHORT_ROWS.get() and self.short_kernel is not None
        ssm_pool, o = op.tensor_ir_inplace_op(
            self.short_kernel if short else self.chunk_kernel, "gdn_short" if short else "gdn_chunk",
            [q, k, v, g, beta, cu_seqlens, slot_ids, ssm_pool, _i32(self.slot)], [7, -1],
            [ssm_pool, nn.Tensor.placeholder((n, hv, dv), "float32")],
        )
        if not output:
            return None, conv_pool, ssm_pool
        o = op.tensor_ir_op(self.gated_norm_kernel, "gdn_gated_norm", [o, qkvz, self.norm.weight],
                            nn.Tensor.placeholder((n, cfg.value_dim), self.dtype))
        return o, conv_pool, ssm_pool

    def _fused_decode(self, qkvz, ba, cu_seqlens, slot_ids, conv_pool, ssm_pool):
        """Decode rows (one token per sequence, cu_seqlens the identity): conv + gates + L2 norms + recurrent
        step + gated RMSNorm in one launch reading the projection in place, then the conv tails' launch
        (gdn_decode_conv); kernel sets without it: split of qkv | z, the conv's two launches, gdn_decode."""
        cfg = self.cfg
        n = qkvz.shape[0]
        out = nn.Tensor.placeholder((n, cfg.value_dim), self.dtype)
        if self.decode_conv_kernel is not None:
            conv_pool, ssm_pool, o = op.tensor_ir_inplace_op(
                self.decode_conv_kernel, "gdn_decode_conv",
                [qkvz, cu_seqlens, ba, conv_pool, self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight,
                 slot_ids, ssm_pool, _i32(self.slot)],
                [3, 9, -1], [conv_pool, ssm_pool, out],
            )
            return o, conv_pool, ssm_pool
        qkv, z = op.split(qkvz, [cfg.conv_dim], axis=1)
        z = op.reshape(z, (n, cfg.linear_num_value_heads, cfg.linear_value_head_dim))
        conv_pool, u = op.tensor_ir_inplace_op(
            self.conv_kernel, "gdn_conv",
            [qkv, cu_seqlens, slot_ids, conv_pool, self.conv1d.weight, _i32(self.slot)],
            [3, -1], [conv_pool, nn.Tensor.placeholder((n, cfg.conv_dim), self.dtype)],
        )
        ssm_pool, o = op.tensor_ir_inplace_op(
            self.decode_kernel, "gdn_decode",
            [u, ba, z, self.A_log, self.dt_bias, self.norm.weight, slot_ids, ssm_pool, _i32(self.slot)],
            [7, -1], [ssm_pool, out],
        )
        return o, conv_pool, ssm_pool


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: str, index: int, kernels, kv_hadamard: bool = False):
        self.kind = cfg.layer_types[index]
        if self.kind == "full_attention":
            self.self_attn = GatedAttention(cfg, dtype, cfg.attn_layers.index(index), kernels, kv_hadamard)
        else:
            self.linear_attn = GatedDeltaNet(cfg, dtype, cfg.gdn_layers.index(index), kernels)
        self.mlp = _feed_forward(cfg, dtype, index, kernels)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: str, kernels, kv_hadamard: bool = False):
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList([DecoderLayer(cfg, dtype, i, kernels, kv_hadamard)
                                     for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPLayer(nn.Module):
    """The MTP head's decoder layer: always full attention, writing its own one-layer KV pool."""

    def __init__(self, cfg: ModelConfig, dtype: str, kernels, kv_hadamard: bool = False):
        self.self_attn = GatedAttention(cfg, dtype, 0, kernels, kv_hadamard, n_layers=1)
        self.mlp = _feed_forward(cfg, dtype, 0, kernels)  # MoE in MoE checkpoints (vLLM: layer index 0)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MTPHead(nn.Module):
    """Multi-token prediction head (vLLM's Qwen3_5MultiTokenPredictor; parameters under mtp.*):
    x = fc([norm_e(embed(next token)); norm_h(h)]), one full-attention layer, mtp.norm, shared lm_head."""

    def __init__(self, cfg: ModelConfig, dtype: str, kernels, kv_hadamard: bool = False):
        d = cfg.hidden_size
        self.fc = _linear(2 * d, d, dtype)
        self.pre_fc_norm_embedding = RMSNorm(d, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(d, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([MTPLayer(cfg, dtype, kernels, kv_hadamard)])
        self.norm = RMSNorm(d, cfg.rms_norm_eps)


class Qwen3xForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: str, target_kind: str = "llvm", kv_dtype: str | None = None,
                 kv_hadamard: bool = False, mtp: bool = False, weight_quant: str | None = None,
                 multimodal: bool = False, tap_layers: tuple = ()):
        """weight_quant: None (weights in dtype) or "nvfp4" (decoder projections in NVFP4).
        multimodal: also export prefill_mm / decode_mrope (image embeddings, M-RoPE positions).
        kv_dtype: KV page dtype (None = dtype; float32 | bfloat16 | fp8 | nvfp4).
        kv_hadamard: rotate Q and K by a normalised Walsh-Hadamard after RoPE.
        mtp: compile the MTP head (mtp.* parameters, mtp_kv_pool, mtp_prefill / mtp_step / mtp_step_sl, and the
        shortlisted head on the device: mtp_head_build / mtp_step_hd / mtp_prefill_hd).
        tap_layers: compile prefill_t / verify_t, which return the outputs of these decoder layers (a
        DFlash drafter's target_layer_ids); empty: the functions do not exist."""
        self.cfg, self.dtype = cfg, dtype
        self.tap_layers = tuple(int(i) for i in tap_layers)
        self.kv_dtype = kv_dtype or dtype
        self.weight_quant = weight_quant
        self.multimodal = bool(multimodal)
        kernels = kernel_set(target_kind, None if self.kv_dtype == dtype else self.kv_dtype)
        self._gemv_factory = getattr(kernels, "gemv", None)
        self._gemm_factory = getattr(kernels, "gemm", None)
        self._gemv_rows_factory = getattr(kernels, "gemv_rows", None)
        self._gemv_norm_factory = getattr(kernels, "gemv_norm", None)
        token = _WEIGHT_QUANT.set(weight_quant)
        norm_token = _NORM.set(getattr(kernels, "rms_norm", None))
        try:
            self._build(cfg, dtype, kernels, kv_hadamard, mtp)
        finally:
            _NORM.reset(norm_token)
            _WEIGHT_QUANT.reset(token)

    def _build(self, cfg: ModelConfig, dtype: str, kernels, kv_hadamard: bool, mtp: bool) -> None:
        self.model = TextModel(cfg, dtype, kernels, kv_hadamard)
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size, dtype, quantizable=False)
        self.rope_inv_freq = nn.Parameter((cfg.rotary_dim // 2,), "float32")
        self.rope_attn_factor = nn.Parameter((1,), "float32")
        self.has_mtp = bool(mtp)
        if self.has_mtp:
            self.mtp = MTPHead(cfg, dtype, kernels, kv_hadamard)

    def _prefill_gemm(self):
        return prefill_gemm_scope(self._gemm_factory)

    def _decode_gemv(self):
        return decode_gemv_scope(self._gemv_factory)

    @contextlib.contextmanager
    def _decode_norms(self):
        """Trace decode / decode_mrope: the norms read only by dense decode GEMVs run inside them (gemv_norm)."""
        token = _GEMV_NORM.set(self._gemv_norm_factory)
        try:
            yield
        finally:
            _GEMV_NORM.reset(token)

    def _body(self, x, positions, token_seq, cu_seqlens, page_table, slot_ids,
              kv_pool, conv_pool, ssm_pool, recurrent: bool, rope_positions=None, taps: list | None = None,
              keep: list | None = None):
        """taps: a list that receives the output of every decoder layer in self.tap_layers, in order.
        keep: a list that receives every GDN layer's (qkvz, ba) projections, in order (GatedDeltaNet.forward)."""
        rope = (self.rope_inv_freq, self.rope_attn_factor)
        rp = {} if rope_positions is None else {"rope_positions": rope_positions}
        tap_at = {i: self.tap_layers.index(i) for i in self.tap_layers} if taps is not None else {}
        tapped: list = taps if taps is not None else []  # tap_at is empty without taps
        if tap_at:
            tapped.extend([None] * len(tap_at))
        if _GEMV.get() is not None:  # residual adds fused into o_proj / out_proj / down_proj
            for li, layer in enumerate(self.model.layers):
                if layer.kind == "full_attention":
                    h = _normed(layer.input_layernorm, x, [layer.self_attn.qkv_proj])
                    x, kv_pool = layer.self_attn(h, rope, positions, token_seq, page_table, kv_pool, residual=x, **rp)
                else:
                    la = layer.linear_attn
                    h = _normed(layer.input_layernorm, x, [la.in_proj_qkv_z, la.in_proj_ba] if keep is None else [])
                    x, conv_pool, ssm_pool = la(h, cu_seqlens, slot_ids, conv_pool, ssm_pool, recurrent, residual=x,
                                                keep=keep)
                mlp = layer.mlp
                x = mlp(_normed(layer.post_attention_layernorm, x,
                                [mlp.gate_up_proj] if isinstance(mlp, MLP) else []), residual=x)
                if li in tap_at:
                    tapped[tap_at[li]] = x
            return x, kv_pool, conv_pool, ssm_pool
        for li, layer in enumerate(self.model.layers):
            h = layer.input_layernorm(x)
            if layer.kind == "full_attention":
                h, kv_pool = layer.self_attn(h, rope, positions, token_seq, page_table, kv_pool, **rp)
            else:
                h, conv_pool, ssm_pool = layer.linear_attn(h, cu_seqlens, slot_ids, conv_pool, ssm_pool, recurrent,
                                                           keep=keep)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            if li in tap_at:
                tapped[tap_at[li]] = x
        return x, kv_pool, conv_pool, ssm_pool

    def _logits(self, h):
        head = self._head_weight() if self.cfg.tie_word_embeddings else self.lm_head
        return self._head(_normed(self.model.norm, h, [head]))

    def prefill(self, tokens, positions, token_seq, cu_seqlens, page_table, slot_ids, logit_rows,
                kv_pool, conv_pool, ssm_pool):
        with self._prefill_gemm():
            x = self.model.embed_tokens(tokens)
            x, kv_pool, conv_pool, ssm_pool = self._body(
                x, positions, token_seq, cu_seqlens, page_table, slot_ids, kv_pool, conv_pool, ssm_pool, False)
            logits = self._logits(op.take(x, logit_rows, axis=0))
            return logits, kv_pool, conv_pool, ssm_pool

    def decode(self, tokens, positions, page_table, slot_ids, kv_pool, conv_pool, ssm_pool):
        return self._decode_rows(tokens, positions, page_table, slot_ids, kv_pool, conv_pool, ssm_pool)

    def _decode_rows(self, tokens, positions, page_table, slot_ids, kv_pool, conv_pool, ssm_pool,
                     rope_positions=None):
        with self._decode_gemv(), self._decode_norms():
            b = tokens.shape[0]
            rows = op.arange(0, b, dtype="int32")
            cu = op.arange(0, b + 1, dtype="int32")
            x = self.model.embed_tokens(tokens)
            x, kv_pool, conv_pool, ssm_pool = self._body(
                x, positions, rows, cu, page_table, slot_ids, kv_pool, conv_pool, ssm_pool, True,
                rope_positions=rope_positions)
            return self._logits(x), kv_pool, conv_pool, ssm_pool

    # ---- images (multimodal=True): embeddings in, M-RoPE positions -----------------------------
    def prefill_mm(self, tokens, positions, rope_positions, token_seq, cu_seqlens, page_table, slot_ids,
                   logit_rows, image_embeds, row_src, kv_pool, conv_pool, ssm_pool):
        """prefill whose rows may be image embeddings and whose RoPE follows rope_positions [n, 3].
        Row i's input is embed(tokens[i]) for row_src[i] == i, else image_embeds[row_src[i] - n]
        (image_embeds [m, D] fp32; the runtime sends one unreferenced row when a chunk has none);
        positions stay the cache positions."""
        with self._prefill_gemm():
            x = op.concat([self.model.embed_tokens(tokens), image_embeds.astype(self.dtype)], dim=0)
            x = op.take(x, row_src, axis=0)
            x, kv_pool, conv_pool, ssm_pool = self._body(
                x, positions, token_seq, cu_seqlens, page_table, slot_ids, kv_pool, conv_pool, ssm_pool, False,
                rope_positions=rope_positions)
            logits = self._logits(op.take(x, logit_rows, axis=0))
            return logits, kv_pool, conv_pool, ssm_pool

    def decode_mrope(self, tokens, positions, rope_positions, page_table, slot_ids, kv_pool, conv_pool, ssm_pool):
        """decode with text RoPE positions apart from the cache positions (position + the sequence's
        rope delta after images)."""
        return self._decode_rows(tokens, positions, page_table, slot_ids, kv_pool, conv_pool, ssm_pool,
                                 rope_positions)

    # ---- speculative decoding: post-norm hidden states, multi-token verification, MTP head --------
    def _head_weight(self):
        """The lm_head's weight (the embedding table when tied): [vocab, hidden]."""
        return self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def _head(self, hn):
        """Shared lm_head on already-normalised hidden states -> fp32 logits."""
        w = self._head_weight()
        if self.cfg.tie_word_embeddings or isinstance(self.lm_head, Linear):
            logits = _gemv(hn, w, out_dtype="float32", name="gemv_lm_head")  # decode GEMV: fp32 out
            if logits is not None:
                return logits
        if self.cfg.tie_word_embeddings:
            logits = op.matmul(_rows(hn), op.permute_dims(self.model.embed_tokens.weight))
        else:
            logits = self.lm_head(_rows(hn))
        return logits.astype("float32")

    def prefill_h(self, tokens, positions, token_seq, cu_seqlens, page_table, slot_ids, logit_rows,
                  kv_pool, conv_pool, ssm_pool):
        """prefill, plus the final post-norm hidden state of every row (fp32 [n, D])."""
        with self._prefill_gemm():
            x = self.model.embed_tokens(tokens)
            x, kv_pool, conv_pool, ssm_pool = self._body(
                x, positions, token_seq, cu_seqlens, page_table, slot_ids, kv_pool, conv_pool, ssm_pool, False)
            hn = self.model.norm(x)
            logits = self._head(op.take(hn, logit_rows, axis=0))
            return logits, hn.astype("float32"), kv_pool, conv_pool, ssm_pool

    def verify(self, tokens, positions, token_seq, cu_seqlens, page_table, slot_ids, kv_pool, conv_pool, ssm_pool):
        """Ragged multi-token forward -> logits and post-norm hidden of every row, and every GDN
        layer's projections of every row (gdn_replay's input: the accepted prefix's state without a re-feed).
        Rows are batch x (draft tokens + 1), few: projections take the decode GEMV where there is one, GDN the
        row-by-row kernel (short_rows_scope)."""
        with self._decode_gemv(), short_rows_scope():
            keep: list = []
            x = self.model.embed_tokens(tokens)
            x, kv_pool, conv_pool, ssm_pool = self._body(
                x, positions, token_seq, cu_seqlens, page_table, slot_ids, kv_pool, conv_pool, ssm_pool, False,
                keep=keep)
            hn = self.model.norm(x)
            return (self._head(hn), hn.astype("float32"), *self._stack_kept(keep), kv_pool, conv_pool, ssm_pool)

    @staticmethod
    def _stack_kept(keep: list) -> tuple:
        """The kept GDN projections as two outputs: qkvz [L, n, conv_dim + value_dim], ba [L, n, 2 Hv]."""
        if not keep:  # no GDN layer
            return ()
        return tuple(op.concat([op.unsqueeze(t[i], 0) for t in keep], dim=0) for i in range(2))

    def gdn_replay(self, qkvz_rows, ba_rows, rows, cu_seqlens, slot_ids, conv_pool, ssm_pool):
        """Advance the state slots over verify rows: the rows `rows` of a verify's kept projections (qkvz_rows,
        ba_rows: its outputs 2 and 3), sequence b owning rows[cu[b]:cu[b+1]], each starting from its slot.
        After a partly accepted round the runtime puts back the pre-verify state and replays the accepted
        prefix: exactly the state that verify reached at that row, with no re-feed of the target (the same GDN
        kernel as verify's: short_rows_scope)."""
        with short_rows_scope():
            return self._gdn_replay(qkvz_rows, ba_rows, rows, cu_seqlens, slot_ids, conv_pool, ssm_pool)

    def _gdn_replay(self, qkvz_rows, ba_rows, rows, cu_seqlens, slot_ids, conv_pool, ssm_pool):
        qkvz = op.take(qkvz_rows, rows, axis=1)
        ba = op.take(ba_rows, rows, axis=1)
        m = rows.shape[0]
        gdn = [layer.linear_attn for layer in self.model.layers if layer.kind != "full_attention"]
        qkvz_l = op.split(qkvz, len(gdn), axis=0) if len(gdn) > 1 else [qkvz]
        ba_l = op.split(ba, len(gdn), axis=0) if len(gdn) > 1 else [ba]
        for attn, q, b in zip(gdn, qkvz_l, ba_l):
            conv_pool, ssm_pool = attn.replay(op.reshape(q, (m, q.shape[2])), op.reshape(b, (m, b.shape[2])),
                                              cu_seqlens, slot_ids, conv_pool, ssm_pool)
        return conv_pool, ssm_pool

    # ---- DFlash drafters: the tap layers' outputs (residual stream, activation dtype) -----------------
    def prefill_t(self, tokens, positions, token_seq, cu_seqlens, page_table, slot_ids, logit_rows,
                  kv_pool, conv_pool, ssm_pool):
        """prefill, plus the tap layers' outputs of every row concatenated ([n, len(tap_layers) * D])."""
        with self._prefill_gemm():
            taps: list = []
            x = self.model.embed_tokens(tokens)
            x, kv_pool, conv_pool, ssm_pool = self._body(
                x, positions, token_seq, cu_seqlens, page_table, slot_ids, kv_pool, conv_pool, ssm_pool, False, taps=taps)
            logits = self._logits(op.take(x, logit_rows, axis=0))
            return logits, op.concat(taps, dim=-1), kv_pool, conv_pool, ssm_pool

    def verify_t(self, tokens, positions, token_seq, cu_seqlens, page_table, slot_ids, kv_pool, conv_pool, ssm_pool):
        """verify with the tap layers' outputs of every row instead of the final hidden state (and the kept GDN
        projections, as verify's)."""
        with self._decode_gemv(), short_rows_scope():
            taps: list = []
            keep: list = []
            x = self.model.embed_tokens(tokens)
            x, kv_pool, conv_pool, ssm_pool = self._body(
                x, positions, token_seq, cu_seqlens, page_table, slot_ids, kv_pool, conv_pool, ssm_pool, False, taps=taps,
                keep=keep)
            return (self._logits(x), op.concat(taps, dim=-1), *self._stack_kept(keep), kv_pool, conv_pool, ssm_pool)

    def _mtp(self, hidden, next_tokens, positions, token_seq, page_table, mtp_kv_pool):
        """MTP rows: row i pairs the main hidden h at positions[i] with the token at positions[i] + 1;
        its K/V go to mtp_kv_pool at positions[i]. Returns mtp.norm(x) (logits input and next hidden)."""
        m = self.mtp
        e = m.pre_fc_norm_embedding(self.model.embed_tokens(next_tokens))
        h = m.pre_fc_norm_hidden(hidden.astype(self.dtype))
        x = m.fc(op.concat([e, h], dim=-1))
        layer = m.layers[0]
        rope = (self.rope_inv_freq, self.rope_attn_factor)
        if _GEMV.get() is not None:  # residual adds fused into o_proj / down_proj
            x, mtp_kv_pool = layer.self_attn(layer.input_layernorm(x), rope, positions, token_seq, page_table,
                                             mtp_kv_pool, residual=x)
            x = layer.mlp(layer.post_attention_layernorm(x), residual=x)
            return m.norm(x), mtp_kv_pool
        a, mtp_kv_pool = layer.self_attn(layer.input_layernorm(x), rope, positions, token_seq, page_table, mtp_kv_pool)
        x = x + a
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.norm(x), mtp_kv_pool

    def mtp_step(self, hidden, next_tokens, positions, token_seq, page_table, mtp_kv_pool):
        with self._decode_gemv():
            hn, mtp_kv_pool = self._mtp(hidden, next_tokens, positions, token_seq, page_table, mtp_kv_pool)
            return self._head(hn), hn.astype("float32"), mtp_kv_pool

    def mtp_prefill(self, hidden, next_tokens, positions, token_seq, page_table, logit_rows, mtp_kv_pool):
        """mtp_step over many rows (prompt fill / accepted rows) with logits + hidden only at logit_rows."""
        with self._prefill_gemm():
            hn, mtp_kv_pool = self._mtp(hidden, next_tokens, positions, token_seq, page_table, mtp_kv_pool)
            hr = op.take(hn, logit_rows, axis=0)
            return self._head(hr), hr.astype("float32"), mtp_kv_pool

    def mtp_step_sl(self, hidden, next_tokens, positions, token_seq, page_table, shortlist, mtp_kv_pool):
        """mtp_step with a shortlisted proposal head: logits [n, m] for the token ids in shortlist."""
        hn, mtp_kv_pool = self._mtp(hidden, next_tokens, positions, token_seq, page_table, mtp_kv_pool)
        logits = op.matmul(hn, op.permute_dims(op.take(self._head_weight(), shortlist, axis=0)))
        return logits.astype("float32"), hn.astype("float32"), mtp_kv_pool

    # ---- the shortlisted proposal head on the device (FR-Spec: drafts over the frequent ids only) --------
    def mtp_head_build(self, head_ids):
        """The shortlisted head's weight: the lm_head rows of head_ids [m] ([m, D], activation dtype), made on
        the device once per shortlist (never copied through the host)."""
        return op.take(self._head_weight(), head_ids, axis=0)

    def _head_draft(self, hn, head_w, head_pos):
        """Logits [n, V] f32 of the shortlisted head: hn [n, D] @ head_w [m, D]^T read once (the rows-symbolic
        decode GEMV where the kernel set has one, else a matmul), spread to the vocabulary by head_pos [V] (the
        row of each id, -1 outside the head: -inf)."""
        part = None
        if self._gemv_rows_factory is not None and hn.dtype == head_w.dtype:
            func = self._gemv_rows_factory(int(head_w.shape[1]), hn.dtype, "float32")
            if func is not None:
                part = op.tensor_ir_op(func, "gemv_rows", [hn, head_w],
                                       nn.Tensor.placeholder((hn.shape[0], head_w.shape[0]), "float32"))
        if part is None:
            part = op.matmul(hn, op.permute_dims(head_w), out_dtype="float32")
        vocab = self.cfg.vocab_size

        def spread(p: te.Tensor, pos: te.Tensor) -> te.Tensor:
            return te.compute((p.shape[0], vocab), lambda b, v: tirx.Select(
                pos[v] >= 0, p[b, tirx.Max(pos[v], 0)], tirx.const(float("-inf"), "float32")), name="head_draft_logits")

        return nn.tensor_expr_op(spread, "head_draft_logits", [part, head_pos])

    def mtp_step_hd(self, hidden, next_tokens, positions, token_seq, page_table, head_w, head_pos, mtp_kv_pool):
        """mtp_step with the shortlisted head (head_w / head_pos: mtp_head_build's weight and the id -> row map)."""
        with self._decode_gemv():
            hn, mtp_kv_pool = self._mtp(hidden, next_tokens, positions, token_seq, page_table, mtp_kv_pool)
            return self._head_draft(hn, head_w, head_pos), hn.astype("float32"), mtp_kv_pool

    def mtp_prefill_hd(self, hidden, next_tokens, positions, token_seq, page_table, logit_rows, head_w, head_pos,
                       mtp_kv_pool):
        """mtp_prefill with the shortlisted head (a draft round's first step)."""
        with self._prefill_gemm():
            hn, mtp_kv_pool = self._mtp(hidden, next_tokens, positions, token_seq, page_table, mtp_kv_pool)
        hr = op.take(hn, logit_rows, axis=0)
        return self._head_draft(hr, head_w, head_pos), hr.astype("float32"), mtp_kv_pool

    # ------------------------------------------------------------------------------------
    def pool_specs(self) -> dict:
        lay = self.pool_layout()
        return {
            "kv_pool": nn.spec.Tensor(["num_pages", *lay.kv_page], lay.kv_dtype),
            "conv_pool": nn.spec.Tensor(["num_slots", *lay.conv_slot], self.dtype),
            "ssm_pool": nn.spec.Tensor(["num_slots", *lay.ssm_slot], "float32"),
        }

    def pool_layout(self) -> PoolLayout:
        return PoolLayout.of(self.cfg.to_dict(), self.dtype, self.kv_dtype, PAGE_SIZE)

    def export_spec(self) -> dict:
        i32 = "int32"
        mode = {"param_mode": "packed", "effect_mode": "none"}
        pools = self.pool_specs()
        return {
            "prefill": {
                "tokens": nn.spec.Tensor(["n"], i32),
                "positions": nn.spec.Tensor(["n"], i32),
                "token_seq": nn.spec.Tensor(["n"], i32),
                "cu_seqlens": nn.spec.Tensor(["bp1"], i32),
                "page_table": nn.spec.Tensor(["b", "p"], i32),
                "slot_ids": nn.spec.Tensor(["b"], i32),
                "logit_rows": nn.spec.Tensor(["r"], i32),
                **pools,
                "$": mode,
            },
            "decode": {
                "tokens": nn.spec.Tensor(["b"], i32),
                "positions": nn.spec.Tensor(["b"], i32),
                "page_table": nn.spec.Tensor(["b", "p"], i32),
                "slot_ids": nn.spec.Tensor(["b"], i32),
                **pools,
                "$": mode,
            },
            **self._spec_export_spec(pools, mode),
            **self._multimodal_export_spec(pools, mode),
        }

    def _multimodal_export_spec(self, pools: dict, mode: dict) -> dict:
        if not self.multimodal:
            return {}
        i32 = "int32"
        return {
            "prefill_mm": {
                "tokens": nn.spec.Tensor(["n"], i32),
                "positions": nn.spec.Tensor(["n"], i32),
                "rope_positions": nn.spec.Tensor(["n", 3], i32),
                "token_seq": nn.spec.Tensor(["n"], i32),
                "cu_seqlens": nn.spec.Tensor(["bp1"], i32),
                "page_table": nn.spec.Tensor(["b", "p"], i32),
                "slot_ids": nn.spec.Tensor(["b"], i32),
                "logit_rows": nn.spec.Tensor(["r"], i32),
                "image_embeds": nn.spec.Tensor(["m", self.cfg.hidden_size], "float32"),
                "row_src": nn.spec.Tensor(["n"], i32),
                **pools,
                "$": mode,
            },
            "decode_mrope": {
                "tokens": nn.spec.Tensor(["b"], i32),
                "positions": nn.spec.Tensor(["b"], i32),
                "rope_positions": nn.spec.Tensor(["b"], i32),
                "page_table": nn.spec.Tensor(["b", "p"], i32),
                "slot_ids": nn.spec.Tensor(["b"], i32),
                **pools,
                "$": mode,
            },
        }

    def mtp_pool_spec(self):
        lay = self.pool_layout()
        return nn.spec.Tensor(["num_pages", *lay.mtp_page], lay.kv_dtype)

    def _spec_export_spec(self, pools: dict, mode: dict) -> dict:
        """prefill_h / verify always; the MTP functions when the head is compiled; prefill_t / verify_t with tap layers."""
        i32 = "int32"
        ragged = {
            "tokens": nn.spec.Tensor(["n"], i32),
            "positions": nn.spec.Tensor(["n"], i32),
            "token_seq": nn.spec.Tensor(["n"], i32),
            "cu_seqlens": nn.spec.Tensor(["bp1"], i32),
            "page_table": nn.spec.Tensor(["b", "p"], i32),
            "slot_ids": nn.spec.Tensor(["b"], i32),
        }
        cfg = self.cfg
        out = {
            "prefill_h": {**ragged, "logit_rows": nn.spec.Tensor(["r"], i32), **pools, "$": mode},
            "verify": {**ragged, **pools, "$": mode},
        }
        if cfg.gdn_layers:  # verify keeps the GDN projections; gdn_replay advances the state over them
            out["gdn_replay"] = {
                "qkvz_rows": nn.spec.Tensor([len(cfg.gdn_layers), "n", cfg.conv_dim + cfg.value_dim], self.dtype),
                "ba_rows": nn.spec.Tensor([len(cfg.gdn_layers), "n", 2 * cfg.linear_num_value_heads], self.dtype),
                "rows": nn.spec.Tensor(["m"], i32),
                "cu_seqlens": nn.spec.Tensor(["bp1"], i32),
                "slot_ids": nn.spec.Tensor(["b"], i32),
                "conv_pool": pools["conv_pool"],
                "ssm_pool": pools["ssm_pool"],
                "$": mode,
            }
        if self.tap_layers:
            out["prefill_t"] = {**ragged, "logit_rows": nn.spec.Tensor(["r"], i32), **pools, "$": mode}
            out["verify_t"] = {**ragged, **pools, "$": mode}
        if self.has_mtp:
            rows = {
                "hidden": nn.spec.Tensor(["n", self.cfg.hidden_size], "float32"),
                "next_tokens": nn.spec.Tensor(["n"], i32),
                "positions": nn.spec.Tensor(["n"], i32),
                "token_seq": nn.spec.Tensor(["n"], i32),
                "page_table": nn.spec.Tensor(["b", "p"], i32),
            }
            out["mtp_step"] = {**rows, "mtp_kv_pool": self.mtp_pool_spec(), "$": mode}
            out["mtp_prefill"] = {**rows, "logit_rows": nn.spec.Tensor(["r"], i32),
                                  "mtp_kv_pool": self.mtp_pool_spec(), "$": mode}
            out["mtp_step_sl"] = {**rows, "shortlist": nn.spec.Tensor(["m"], i32),
                                  "mtp_kv_pool": self.mtp_pool_spec(), "$": mode}
            head = {"head_w": nn.spec.Tensor(["m", self.cfg.hidden_size], self.dtype),
                    "head_pos": nn.spec.Tensor([self.cfg.vocab_size], i32)}
            out["mtp_head_build"] = {"head_ids": nn.spec.Tensor(["m"], i32), "$": mode}
            out["mtp_step_hd"] = {**rows, **head, "mtp_kv_pool": self.mtp_pool_spec(), "$": mode}
            out["mtp_prefill_hd"] = {**rows, "logit_rows": nn.spec.Tensor(["r"], i32), **head,
                                     "mtp_kv_pool": self.mtp_pool_spec(), "$": mode}
        return out

