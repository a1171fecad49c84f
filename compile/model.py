"""The Qwen3.x hybrid decoder in tvm.relax.frontend.nn.

Exported functions (all KV and recurrent state is runtime-owned and updated in place):
  prefill(tokens[n], positions[n], token_seq[n], cu_seqlens[b+1], page_table[b,p], slot_ids[b],
          logit_rows[r], kv_pool, conv_pool, ssm_pool) -> (logits[r,V] f32, kv_pool, conv_pool, ssm_pool)
      ragged chunk of tokens for one or more sequences; GDN uses the chunked (64) form.
  decode(tokens[b], positions[b], page_table[b,p], slot_ids[b], kv_pool, conv_pool, ssm_pool)
      -> (logits[b,V] f32, ...) one token per sequence; GDN uses the recurrent step.

Parameter names follow transformers (model.layers.{i}.linear_attn.in_proj_qkv.weight ...), but
zero-centred norm weights carry the folded +1 (compile/convert.py does it).
"""
from __future__ import annotations

from tvm import tirx
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .config import ModelConfig
from .kernels.registry import kernel_set
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


def _linear(i: int, o: int, dtype: str) -> nn.Linear:
    return nn.Linear(i, o, bias=False, dtype=dtype)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: str):
        self.gate_proj = _linear(cfg.hidden_size, cfg.intermediate_size, dtype)
        self.up_proj = _linear(cfg.hidden_size, cfg.intermediate_size, dtype)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, dtype)

    def forward(self, x):
        return self.down_proj(op.silu(self.gate_proj(x)) * self.up_proj(x))


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: str, slot: int, kernels):
        self.cfg, self.dtype, self.slot = cfg, dtype, slot
        hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = _linear(cfg.hidden_size, hq * 2 * dh, dtype)
        self.k_proj = _linear(cfg.hidden_size, hkv * dh, dtype)
        self.v_proj = _linear(cfg.hidden_size, hkv * dh, dtype)
        self.o_proj = _linear(hq * dh, cfg.hidden_size, dtype)
        self.q_norm = RMSNorm(dh, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(dh, cfg.rms_norm_eps)
        self.kernel = kernels.paged_attention(hq, hkv, dh, PAGE_SIZE, len(cfg.attn_layers), dtype, dh ** -0.5)

    def forward(self, x, rope, positions, token_seq, page_table, kv_pool):
        cfg = self.cfg
        n = x.shape[0]
        hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qg = op.reshape(self.q_proj(x), (n, hq, 2 * dh))
        q, gate = op.split(qg, 2, axis=2)
        k = op.reshape(self.k_proj(x), (n, hkv, dh))
        v = op.reshape(self.v_proj(x), (n, hkv, dh))
        inv_freq, factor = rope
        q = apply_rope(self.q_norm(q), positions, inv_freq, factor, cfg.rotary_dim, "rope_q")
        k = apply_rope(self.k_norm(k), positions, inv_freq, factor, cfg.rotary_dim, "rope_k")
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
        self.in_proj_qkv = _linear(cfg.hidden_size, cfg.conv_dim, dtype)
        self.in_proj_z = _linear(cfg.hidden_size, cfg.value_dim, dtype)
        self.in_proj_b = _linear(cfg.hidden_size, hv, dtype)
        self.in_proj_a = _linear(cfg.hidden_size, hv, dtype)
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
        qkv = self.in_proj_qkv(x)
        z = op.reshape(self.in_proj_z(x), (n, hv, dv))
        beta = op.sigmoid(self.in_proj_b(x)).astype("float32")
        a = self.in_proj_a(x).astype("float32")
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
    def __init__(self, cfg: ModelConfig, dtype: str, index: int, kernels):
        self.kind = cfg.layer_types[index]
        if self.kind == "full_attention":
            self.self_attn = GatedAttention(cfg, dtype, cfg.attn_layers.index(index), kernels)
        else:
            self.linear_attn = GatedDeltaNet(cfg, dtype, cfg.gdn_layers.index(index), kernels)
        self.mlp = MLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class TextModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: str, kernels):
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList([DecoderLayer(cfg, dtype, i, kernels) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Qwen3xForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: str, target_kind: str = "llvm"):
        self.cfg, self.dtype = cfg, dtype
        self.model = TextModel(cfg, dtype, kernel_set(target_kind))
        if not cfg.tie_word_embeddings:
            self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size, dtype)
        self.rope_inv_freq = nn.Parameter((cfg.rotary_dim // 2,), "float32")
        self.rope_attn_factor = nn.Parameter((1,), "float32")

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
        h = self.model.norm(h)
        if self.cfg.tie_word_embeddings:
            logits = op.matmul(h, op.permute_dims(self.model.embed_tokens.weight))
        else:
            logits = self.lm_head(h)
        return logits.astype("float32")

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

    # ------------------------------------------------------------------------------------
    def pool_specs(self) -> dict:
        cfg = self.cfg
        return {
            "kv_pool": nn.spec.Tensor(
                ["num_pages", len(cfg.attn_layers), 2, cfg.num_key_value_heads, PAGE_SIZE, cfg.head_dim], self.dtype),
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
        }

