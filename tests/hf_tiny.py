"""Tiny random Qwen3.x checkpoints built with transformers, every weight re-randomised.

Default init (std 0.02, zero norm offsets) gives near-flat logits and hides (1+w) bugs, so all
parameters are redrawn (research/qwen3x_arch.md §7). The checkpoint is written with
save_pretrained so the compiler reads it exactly as it would a downloaded model.
"""
from __future__ import annotations

from pathlib import Path

GEOMETRY = dict(
    vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=8,
    linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=1024,
)


def make_hf_model(family: str, seed: int, tie: bool = False, rope_parameters: dict | None = None):
    import torch

    torch.manual_seed(seed)
    rope = rope_parameters or {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    if family == "qwen3_5":
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
    return model


def save_hf(model, out: Path) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    return out
