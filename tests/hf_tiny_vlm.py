"""A tiny random Qwen3_5ForConditionalGeneration (vision tower + hybrid decoder), every weight redrawn.

Vision: 2 blocks, width 32, 2 heads (head_dim 16), patch 4, merge 2 (factor 8), a 4x4 learned
position table; text: tests/hf_tiny.py's geometry with M-RoPE section [2, 1, 1] over its 4 rotary
frequencies (so T, H and W all rotate something). Images of a few dozen pixels a side.
"""
from __future__ import annotations

import json
from pathlib import Path

from hf_tiny import GEOMETRY, redraw

IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 300, 301, 302, 303
MIN_PIXELS, MAX_PIXELS = 16 * 16, 64 * 64
VISION = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=GEOMETRY["hidden_size"], num_position_embeddings=16)
ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "mrope_section": [2, 1, 1],
        "mrope_interleaved": True}


def make_hf_vlm(seed: int = 7):
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    cfg = Qwen3_5Config(text_config=dict(**GEOMETRY, rope_parameters=ROPE), vision_config=dict(VISION),
                        image_token_id=IMAGE_TOKEN, video_token_id=VIDEO_TOKEN, vision_start_token_id=VISION_START,
                        vision_end_token_id=VISION_END)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    cfg.vision_config._attn_implementation = "eager"
    return redraw(Qwen3_5ForConditionalGeneration(cfg).eval().float(), _draw_visual)


def _draw_visual(name: str, p) -> bool:
    """Vision weights: LayerNorm scales around 1 (not zero-centred), the rest N(0, 0.2)."""
    import torch

    if "visual" not in name:
        return False
    if "norm" in name and name.endswith("weight"):
        p.copy_(torch.randn_like(p) * 0.3 + 1.0)
    else:
        p.copy_(torch.randn_like(p) * 0.2)
    return True


def image_processor():
    """transformers' PIL image processor configured as our tiny model's preprocessor_config.json."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(patch_size=VISION["patch_size"], merge_size=VISION["spatial_merge_size"],
                                    temporal_patch_size=VISION["temporal_patch_size"], min_pixels=MIN_PIXELS,
                                    max_pixels=MAX_PIXELS, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def save_hf_vlm(model, out: Path) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    (out / "preprocessor_config.json").write_text(json.dumps({
        "image_processor_type": "Qwen2VLImageProcessor", "patch_size": VISION["patch_size"],
        "merge_size": VISION["spatial_merge_size"], "temporal_patch_size": VISION["temporal_patch_size"],
        "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}))
    return out


def make_image(w: int, h: int, seed: int):
    """A deterministic RGB test picture (smooth gradients + noise, so resizing matters)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / max(w - 1, 1), y * 255 / max(h - 1, 1), (x + y) * 127 / max(w + h - 2, 1)], -1)
    img = np.clip(base + rng.normal(0, 40, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(img, "RGB")
