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


def make_hf_vlm(seed: int = 7, vocab_size: int | None = None, tokens=(IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END),
                eos: int | None = None):
    """tokens: (image, video, vision_start, vision_end) ids."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(GEOMETRY, rope_parameters=ROPE, **({"vocab_size": vocab_size} if vocab_size else {}),
                **({"eos_token_id": eos} if eos is not None else {}))
    image, video, start, end = tokens
    cfg = Qwen3_5Config(text_config=text, vision_config=dict(VISION), image_token_id=image, video_token_id=video,
                        vision_start_token_id=start, vision_end_token_id=end)
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


# ---- a servable tiny VLM: the embedded model's tokenizer + chat template with Qwen's vision tokens -----
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def make_servable_vlm_dir(out: Path, seed: int = 3) -> Path:
    """A Qwen3_5ForConditionalGeneration directory `ninfer compile` + `ninfer serve` take: the tiny default
    model's BPE tokenizer (2000 ids) plus the four vision tokens (2000..2003), its ChatML template, and a
    random tiny VLM over a 2048-token vocabulary."""
    import shutil

    from tokenizers import AddedToken, Tokenizer

    from ninfer_mlc.paths import default_model_dir

    src = default_model_dir()
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    ids = [tok.token_to_id(t) for t in VISION_TOKENS]
    start, end, image, video = ids
    eos = tok.token_to_id("<|im_end|>")
    save_hf_vlm(make_hf_vlm(seed, vocab_size=2048, tokens=(image, video, start, end), eos=eos), out)
    tok.save(str(out / "tokenizer.json"))
    for f in ("tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (src / f).is_file():
            shutil.copy2(src / f, out / f)
    return out
