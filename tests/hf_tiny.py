"""Tiny random Qwen3.x checkpoints built with transformers, every weight re-randomised.

Default init (std 0.02, zero norm offsets) gives near-flat logits and hides (1+w) bugs, so all
parameters are redrawn (research/qwen3x_arch.md §7). The checkpoint is written with
save_pretrained so the compiler reads it exactly as it would a downloaded model.

MoE families (8 experts): "qwen3_5_moe" (top-2, renormalised, shared expert of the routed size: folded
into the expert arrays) and "qwen3_next_moe" (top-4, not renormalised, a larger shared expert, layer 1
dense via mlp_only_layers). Expert DUPLICATE is a copy of expert ORIGINAL (router row and weights), so
routing ties occur on every token that picks either, and any tie rule gives the same output.
"""
from __future__ import annotations

from pathlib import Path

GEOMETRY = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=1024,
)


MOE = {
    "qwen3_5_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32),
    "qwen3_next_moe": dict(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=32,
                           shared_expert_intermediate_size=48, norm_topk_prob=False, mlp_only_layers=[1]),
}
ORIGINAL, DUPLICATE = 2, 5


def make_hf_model(family: str, seed: int, tie: bool = False, rope_parameters: dict | None = None, **moe):
    """moe: overrides of the MoE family's MOE entry (e.g. shared_expert_intermediate_size)."""
    import torch

    torch.manual_seed(seed)
    rope = rope_parameters or {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    if family == "qwen3_5_moe":
        from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        geo = {k: v for k, v in GEOMETRY.items() if k != "intermediate_size"}
        cfg = Qwen3_5MoeTextConfig(**geo, **{**MOE[family], **moe}, tie_word_embeddings=tie, rope_parameters=rope)
        cls = Qwen3_5MoeForCausalLM
    elif family == "qwen3_next_moe":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(**GEOMETRY, **{**MOE[family], **moe}, tie_word_embeddings=tie, rope_parameters=rope)
        cls = Qwen3NextForCausalLM
    elif family == "qwen3_5":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(**GEOMETRY, tie_word_embeddings=tie, rope_parameters=rope)
        cls = Qwen3_5ForCausalLM
    else:
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        cfg = Qwen3NextConfig(**GEOMETRY, tie_word_embeddings=tie, rope_parameters=rope, num_experts=0)
        cls = Qwen3NextForCausalLM
    cfg._attn_implementation = "eager"
    return redraw(cls(cfg).eval().float())


def redraw(model, special=None):
    """Redraw every parameter; special(name, param) -> True when it drew that one itself."""
    import torch

    with torch.no_grad():
        for n, p in model.named_parameters():
            if special is not None and special(n, p):
                continue
            if n.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 4).log())
            elif n.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.5)
            elif "norm" in n:
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "linear_attn.norm" in n else 0.0))
            else:
                p.copy_(torch.randn_like(p) * 0.15)
        for n, p in model.named_parameters():  # routing ties: one expert duplicated in every MoE layer
            if n.endswith(("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
                p[DUPLICATE] = p[ORIGINAL]
    return model


def router_choices(model, ids) -> list:
    """Per MoE layer, the [tokens, top_k] expert ids transformers' router picks on `ids`."""
    import torch

    picks, hooks = [], []
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None:
            hooks.append(gate.register_forward_hook(lambda _m, _i, out: picks.append(out[2].clone())))
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    return picks


def save_fused_vlm(model, out: Path) -> Path:
    """A Qwen3_5MoeForConditionalGeneration-style checkpoint of a Qwen3_5MoeForCausalLM: the text config nested
    under text_config, weights under model.language_model.*, experts in the fused [E, 2I, D] / [E, D, I]
    layout (transformers 5.x in memory), with a vision_config but no visual.* weights (a text-only save of a
    VLM: the compiler builds the text model only)."""
    import json

    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    text = model.config.to_dict()
    raw = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": text, "vision_config": {"depth": 1}, "tie_word_embeddings": text["tie_word_embeddings"]}
    (out / "config.json").write_text(json.dumps(raw))
    sd = {}
    for k, v in model.state_dict().items():
        name = "model.language_model." + k[len("model."):] if k.startswith("model.") else k
        sd[name] = v.detach().contiguous().clone()
    save_file(sd, str(out / "model.safetensors"))
    return out


def save_hf(model, out: Path) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    return out
