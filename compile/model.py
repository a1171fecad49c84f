"""The Qwen3.x hybrid decoder in tvm.relax.frontend.nn.

Exported functions (all KV and recurrent state is runtime-owned and updated in place):
  prefill(tokens[n], positions[n], token_seq[n], cu_seqlens[b+1], page_table[b,p], slot_ids[b],
          logit_rows[r], kv_pool, conv_pool, ssm_pool) -> (logits[r,V] f32, kv_pool, conv_pool, ssm_pool)
      ragged chunk of tokens for one or more sequences; GDN uses the chunked (64) form.
  decode(tokens[b], positions[b], page_table[b,p], slot_ids[b], kv_pool, conv_pool, ssm_pool)
      -> (logits[b,V] f32, ...) one token per sequence; GDN uses the recurrent step.
Speculative decoding (final hidden states are post-norm, fp32):
  prefill_h(same as prefill) -> (logits[r,V], hidden[n,D], pools...)
  verify(tokens, positions, token_seq, cu_seqlens, page_table, slot_ids, pools...) -> (logits[n,V], hidden[n,D], pools...)
  with the MTP head (mtp=True; mtp_kv_pool [num_pages, 1, 2, kv_heads, 64, head_dim], the main page tables):
  mtp_step(hidden[n,D], next_tokens[n], positions[n], token_seq[n], page_table, mtp_kv_pool)
      -> (logits[n,V], hidden_out[n,D], mtp_kv_pool)
  mtp_prefill(..., logit_rows[r], mtp_kv_pool) -> (logits[r,V], hidden_out[r,D], mtp_kv_pool)
  mtp_step_sl(..., shortlist[m], mtp_kv_pool) -> (logits[n,m] over the shortlisted ids, hidden_out, mtp_kv_pool)

Parameter names follow transformers (model.layers.{i}.linear_attn.conv1d.weight ...), except that
projections reading the same input are fused (FUSED_PROJECTIONS: gate_up_proj, qkv_proj,
in_proj_qkv_z, in_proj_ba) and zero-centred norm weights carry the folded +1 (compile/convert.py).
"""
from __future__ import annotations

import contextvars

import numpy as np
from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .config import ModelConfig
from .kernels.attention_quant import kv_pool_layout
from .kernels.dequant import NVFP4Linear
from .kernels.registry import kernel_set
from .nvfp4 import hadamard_matrix
from .kernels.rope import apply_rope

PAGE_SIZE = 64


def _i32(v: int):
    return tirx.IntImm("int32", v)


class RMSNorm(nn.Module):
    """RMSNorm over the last axis in fp32; the weight already includes the +1 offset."""

    def __init__(self, dim: int, eps: float):
        self.weight = nn.Parameter((dim,), "float32")
        self.eps = eps

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        y = op.rms_norm(x.astype("float32"), self.weight, axes=[-1], epsilon=self.eps)
        return y.astype(x.dtype)


class Weight(nn.Module):
    """A bare parameter under a module name (conv1d.weight) so names match transformers."""

    def __init__(self, shape, dtype):
        self.weight = nn.Parameter(shape, dtype)


# weight format of the projections being built (None | "nvfp4"); set by Qwen3xForCausalLM
_WEIGHT_QUANT: contextvars.ContextVar = contextvars.ContextVar("ninfer_weight_quant", default=None)


class Linear(nn.Module):
    """y = x W^T without bias, accumulated in fp32 and cast back (bf16 sums over 17k inputs drift)."""

    def __init__(self, i: int, o: int, dtype: str):
        self.in_features, self.out_features, self.dtype = i, o, dtype
        self.weight = nn.Parameter((o, i), dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
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
}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: str):
        self.gate_up_proj = _linear(cfg.hidden_size, 2 * cfg.intermediate_size, dtype)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, dtype)

    def forward(self, x):
        gate, up = op.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(op.silu(gate) * up)


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

    def forward(self, x, rope, positions, token_seq, page_table, kv_pool):
        cfg = self.cfg
        n = x.shape[0]
        hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg, k, v = op.split(self.qkv_proj(x), [hq * 2 * dh, hq * 2 * dh + hkv * dh], axis=1)
        q, gate = op.split(op.reshape(qg, (n, hq, 2 * dh)), 2, axis=2)
        k = op.reshape(k, (n, hkv, dh))
        v = op.reshape(v, (n, hkv, dh))
        inv_freq, factor = rope
        q = apply_rope(self.q_norm(q), positions, inv_freq, factor, cfg.rotary_dim, "rope_q")
        k = apply_rope(self.k_norm(k), positions, inv_freq, factor, cfg.rotary_dim, "rope_k")
        if self.kv_hadamard:  # rotate Q and K after RoPE (QK^T unchanged); V stays unrotated
            q, k = _hadamard(q, dh), _hadamard(k, dh)
        kv_pool, o = op.tensor_ir_inplace_op(
            self.kernel, "paged_attention",
            [q, k, v, positions, token_seq, page_table, kv_pool, _i32(self.slot)],
            [6, -1], [kv_pool, nn.Tensor.placeholder((n, hq, dh), self.dtype)],
        )
        o = o * op.sigmoid(gate)
        return self.o_proj(op.reshape(o, (n, hq * dh))), kv_pool


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
        self.chunk_kernel = kernels.chunked_delta_rule(hk, hv, dk, dv, n_gdn)
        self.step_kernel = kernels.recurrent_delta_rule(hk, hv, dk, dv, n_gdn)

    def _l2norm(self, x):
        ss = op.sum(x * x, axis=[-1], keepdims=True)
        return x / op.sqrt(ss + 1e-6)

    def forward(self, x, cu_seqlens, slot_ids, conv_pool, ssm_pool, recurrent: bool):
        cfg = self.cfg
        n = x.shape[0]
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        qkv, z = op.split(self.in_proj_qkv_z(x), [cfg.conv_dim], axis=1)
        z = op.reshape(z, (n, hv, dv))
        b, a = op.split(self.in_proj_ba(x), 2, axis=1)
        beta = op.sigmoid(b).astype("float32")
        a = a.astype("float32")
        g = op.negative(op.exp(self.A_log)) * op.softplus(a + self.dt_bias)
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
        # gated RMSNorm: normalise in fp32, plain weight, times silu(z)
        o = op.rms_norm(o, self.norm.weight, axes=[-1], epsilon=cfg.rms_norm_eps).astype(self.dtype)
        o = (o.astype("float32") * op.silu(z.astype("float32"))).astype(self.dtype)
        return self.out_proj(op.reshape(o, (n, cfg.value_dim))), conv_pool, ssm_pool


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: str, index: int, kernels, kv_hadamard: bool = False):
        self.kind = cfg.layer_types[index]
        if self.kind == "full_attention":
            self.self_attn = GatedAttention(cfg, dtype, cfg.attn_layers.index(index), kernels, kv_hadamard)
        else:
            self.linear_attn = GatedDeltaNet(cfg, dtype, cfg.gdn_layers.index(index), kernels)
        self.mlp = MLP(cfg, dtype)
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
        self.mlp = MLP(cfg, dtype)
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
                 kv_hadamard: bool = False, mtp: bool = False, weight_quant: str | None = None):
        """weight_quant: None (weights in dtype) or "nvfp4" (decoder projections in NVFP4).
        kv_dtype: KV page dtype (None = dtype; float32 | bfloat16 | fp8 | nvfp4).
        kv_hadamard: rotate Q and K by a normalised Walsh-Hadamard after RoPE.
        mtp: compile the MTP head (mtp.* parameters, mtp_kv_pool, mtp_prefill / mtp_step / mtp_step_sl)."""
        self.cfg, self.dtype = cfg, dtype
        self.kv_dtype = kv_dtype or dtype
        self.weight_quant = weight_quant
        kernels = kernel_set(target_kind, None if self.kv_dtype == dtype else self.kv_dtype)
        token = _WEIGHT_QUANT.set(weight_quant)
        try:
            self._build(cfg, dtype, kernels, kv_hadamard, mtp)
        finally:
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

    def _body(self, x, positions, token_seq, cu_seqlens, page_table, slot_ids,
              kv_pool, conv_pool, ssm_pool, recurrent: bool):
        rope = (self.rope_inv_freq, self.rope_attn_factor)
        for layer in self.model.layers:
            h = layer.input_layernorm(x)
            if layer.kind == "full_attention":
                h, kv_pool = layer.self_attn(h, rope, positions, token_seq, page_table, kv_pool)
            else:
                h, conv_pool, ssm_pool = layer.linear_attn(h, cu_seqlens, slot_ids, conv_pool, ssm_pool, recurrent)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return x, kv_pool, conv_pool, ssm_pool

    def _logits(self, h):
        return self._head(self.model.norm(h))

    def prefill(self, tokens, positions, token_seq, cu_seqlens, page_table, slot_ids, logit_rows,
                kv_pool, conv_pool, ssm_pool):
        x = self.model.embed_tokens(tokens)
        x, kv_pool, conv_pool, ssm_pool = self._body(
            x, positions, token_seq, cu_seqlens, page_table, slot_ids, kv_pool, conv_pool, ssm_pool, False)
        logits = self._logits(op.take(x, logit_rows, axis=0))
        return logits, kv_pool, conv_pool, ssm_pool

    def decode(self, tokens, positions, page_table, slot_ids, kv_pool, conv_pool, ssm_pool):
        b = tokens.shape[0]
        rows = op.arange(0, b, dtype="int32")
        cu = op.arange(0, b + 1, dtype="int32")
        x = self.model.embed_tokens(tokens)
        x, kv_pool, conv_pool, ssm_pool = self._body(
            x, positions, rows, cu, page_table, slot_ids, kv_pool, conv_pool, ssm_pool, True)
        return self._logits(x), kv_pool, conv_pool, ssm_pool

    # ---- speculative decoding: post-norm hidden states, multi-token verification, MTP head --------
    def _head(self, hn):
        """Shared lm_head on already-normalised hidden states -> fp32 logits."""
        if self.cfg.tie_word_embeddings:
            logits = op.matmul(hn, op.permute_dims(self.model.embed_tokens.weight))
        else:
            logits = self.lm_head(hn)
        return logits.astype("float32")

    def prefill_h(self, tokens, positions, token_seq, cu_seqlens, page_table, slot_ids, logit_rows,
                  kv_pool, conv_pool, ssm_pool):
        """prefill, plus the final post-norm hidden state of every row (fp32 [n, D])."""
        x = self.model.embed_tokens(tokens)
        x, kv_pool, conv_pool, ssm_pool = self._body(
            x, positions, token_seq, cu_seqlens, page_table, slot_ids, kv_pool, conv_pool, ssm_pool, False)
        hn = self.model.norm(x)
        logits = self._head(op.take(hn, logit_rows, axis=0))
        return logits, hn.astype("float32"), kv_pool, conv_pool, ssm_pool

    def verify(self, tokens, positions, token_seq, cu_seqlens, page_table, slot_ids, kv_pool, conv_pool, ssm_pool):
        """Ragged multi-token forward (chunked GDN) -> logits and post-norm hidden of every row."""
        x = self.model.embed_tokens(tokens)
        x, kv_pool, conv_pool, ssm_pool = self._body(
            x, positions, token_seq, cu_seqlens, page_table, slot_ids, kv_pool, conv_pool, ssm_pool, False)
        hn = self.model.norm(x)
        return self._head(hn), hn.astype("float32"), kv_pool, conv_pool, ssm_pool

    def _mtp(self, hidden, next_tokens, positions, token_seq, page_table, mtp_kv_pool):
        """MTP rows: row i pairs the main hidden h at positions[i] with the token at positions[i] + 1;
        its K/V go to mtp_kv_pool at positions[i]. Returns mtp.norm(x) (logits input and next hidden)."""
        m = self.mtp
        e = m.pre_fc_norm_embedding(self.model.embed_tokens(next_tokens))
        h = m.pre_fc_norm_hidden(hidden.astype(self.dtype))
        x = m.fc(op.concat([e, h], dim=-1))
        layer = m.layers[0]
        rope = (self.rope_inv_freq, self.rope_attn_factor)
        a, mtp_kv_pool = layer.self_attn(layer.input_layernorm(x), rope, positions, token_seq, page_table, mtp_kv_pool)
        x = x + a
        x = x + layer.mlp(layer.post_attention_layernorm(x))
        return m.norm(x), mtp_kv_pool

    def mtp_step(self, hidden, next_tokens, positions, token_seq, page_table, mtp_kv_pool):
        hn, mtp_kv_pool = self._mtp(hidden, next_tokens, positions, token_seq, page_table, mtp_kv_pool)
        return self._head(hn), hn.astype("float32"), mtp_kv_pool

    def mtp_prefill(self, hidden, next_tokens, positions, token_seq, page_table, logit_rows, mtp_kv_pool):
        """mtp_step over many rows (prompt fill / accepted rows) with logits + hidden only at logit_rows."""
        hn, mtp_kv_pool = self._mtp(hidden, next_tokens, positions, token_seq, page_table, mtp_kv_pool)
        hr = op.take(hn, logit_rows, axis=0)
        return self._head(hr), hr.astype("float32"), mtp_kv_pool

    def mtp_step_sl(self, hidden, next_tokens, positions, token_seq, page_table, shortlist, mtp_kv_pool):
        """mtp_step with a shortlisted proposal head: logits [n, m] for the token ids in shortlist."""
        hn, mtp_kv_pool = self._mtp(hidden, next_tokens, positions, token_seq, page_table, mtp_kv_pool)
        w = self.model.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight
        logits = op.matmul(hn, op.permute_dims(op.take(w, shortlist, axis=0)))
        return logits.astype("float32"), hn.astype("float32"), mtp_kv_pool

    # ------------------------------------------------------------------------------------
    def pool_specs(self) -> dict:
        cfg = self.cfg
        kv_dt, row = kv_pool_layout(self.kv_dtype, cfg.head_dim)
        return {
            "kv_pool": nn.spec.Tensor(
                ["num_pages", len(cfg.attn_layers), 2, cfg.num_key_value_heads, PAGE_SIZE, row], kv_dt),
            "conv_pool": nn.spec.Tensor(
                ["num_slots", len(cfg.gdn_layers), cfg.conv_dim, cfg.linear_conv_kernel_dim - 1], self.dtype),
            "ssm_pool": nn.spec.Tensor(
                ["num_slots", len(cfg.gdn_layers), cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                 cfg.linear_value_head_dim], "float32"),
        }

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
        }

    def mtp_pool_spec(self):
        cfg = self.cfg
        kv_dt, row = kv_pool_layout(self.kv_dtype, cfg.head_dim)
        return nn.spec.Tensor(["num_pages", 1, 2, cfg.num_key_value_heads, PAGE_SIZE, row], kv_dt)

    def _spec_export_spec(self, pools: dict, mode: dict) -> dict:
        """prefill_h / verify always; the MTP functions when the head is compiled."""
        i32 = "int32"
        ragged = {
            "tokens": nn.spec.Tensor(["n"], i32),
            "positions": nn.spec.Tensor(["n"], i32),
            "token_seq": nn.spec.Tensor(["n"], i32),
            "cu_seqlens": nn.spec.Tensor(["bp1"], i32),
            "page_table": nn.spec.Tensor(["b", "p"], i32),
            "slot_ids": nn.spec.Tensor(["b"], i32),
        }
        out = {
            "prefill_h": {**ragged, "logit_rows": nn.spec.Tensor(["r"], i32), **pools, "$": mode},
            "verify": {**ragged, **pools, "$": mode},
        }
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
        return out

