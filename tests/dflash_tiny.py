"""Tiny DFlash / DFlash2 drafters for the tests, next to a tap-enabled build of the embedded tiny model.

The drafters are the PyPI `dflash` package's PyTorch models (the independent reference) with every
weight redrawn (default init gives near-flat logits), saved with save_pretrained and compiled with
`ninfer compile` like a downloaded drafter. The target is dist/qwen3x-tiny regenerated from its
deterministic HF checkpoint (compile/tiny_default.py) and compiled with the drafters' tap layers.
Geometries exercise what the engine must get right: a ring narrower than the contexts (window 16 / 24),
a paged full-attention layer, causal sliding and non-causal full layers, embedding / output scales
and soft-capping (DFlash), the grouped convolutions and the candidate selector (DFlash2).
"""
from __future__ import annotations

from pathlib import Path

TAPS = [0, 2]  # target layers (of 4) whose outputs the drafters read
DRAFTERS = {
    "dflash": dict(block=4, layer_types=["full_attention", "sliding_attention"], window=16,
                   extra=dict(input_embedding_scale=1.5, output_multiplier=0.8, final_logit_softcapping=30.0)),
    "dflash2": dict(block=8, layer_types=["sliding_attention", "full_attention"], window=24,
                    extra=dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)),
}
MASK_ID = 2040


def drafter_config(kind: str):
    from transformers import Qwen3Config

    d = DRAFTERS[kind]
    return Qwen3Config(vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, layer_types=d["layer_types"],
                       use_sliding_window=True, sliding_window=d["window"], max_position_embeddings=8192,
                       rope_theta=10000.0, num_target_layers=4,
                       dflash_config={"target_layer_ids": TAPS, "block_size": d["block"], "mask_token_id": MASK_ID,
                                      **d["extra"]})


def make_drafter(kind: str, out: Path, seed: int):
    """The reference model with random weights, saved to `out` as an HF checkpoint; returns the model."""
    import torch
    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    torch.manual_seed(seed)
    model = (DFlash2DraftModel if kind == "dflash2" else DFlashDraftModel)(drafter_config(kind)).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("base_kernel"):
                p.copy_(0.5 * torch.randn_like(p))
            elif "codebook" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(out)
    return model


def build(root: Path) -> dict:
    """{"hf": the tiny target's HF dir, "target": its artifact with taps, kind: (drafter artifact, model)}."""
    from ninfer_mlc.compile.build import compile_model
    from ninfer_mlc.compile.tiny_default import generate

    quiet = lambda *a: None  # noqa: E731
    hf = generate(root / "qwen3x-tiny-hf")
    out = {"hf": hf, "target": compile_model(hf, out_dir=root / "target-taps", name="qwen3x-tiny-taps",
                                             tap_layers=",".join(map(str, TAPS)), log=quiet)}
    for i, kind in enumerate(DRAFTERS):
        model = make_drafter(kind, root / f"{kind}-hf", seed=10 + i)
        out[kind] = (compile_model(root / f"{kind}-hf", out_dir=root / kind, name=f"tiny-{kind}", log=quiet), model)
    return out
