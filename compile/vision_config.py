"""Vision tower geometry and image-processor settings of a Qwen3_5ForConditionalGeneration directory.

Read from config.json ("vision_config", the vision token ids, the text rope's mrope_section) and
preprocessor_config.json (pixel bounds, mean/std). The result is stored in the artifact manifest
(extras["vision"]) so the runtime can preprocess images and lay out positions without TVM.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .config import ConfigError

# Qwen3.5 / 3.6 defaults (transformers Qwen3_5VisionConfig, Qwen3_5Config, Qwen2VLImageProcessorFast as the
# released checkpoints configure it: research/anchors_2.md §4)
DEFAULT_MIN_PIXELS = 65536
DEFAULT_MAX_PIXELS = 16777216
DEFAULT_MROPE_SECTION = [11, 11, 10]


@dataclass
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    rope_theta: float
    hidden_act: str
    image_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    mrope_section: list[int] = field(default_factory=lambda: list(DEFAULT_MROPE_SECTION))
    # image processor (pixels are counted after resizing, as smart_resize does)
    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    image_mean: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])
    image_std: list[float] = field(default_factory=lambda: [0.5, 0.5, 0.5])

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Length of one flattened patch: channels x temporal x patch x patch (the Conv3d kernel)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size

    @property
    def merge_unit(self) -> int:
        return self.spatial_merge_size ** 2

    @property
    def num_grid_per_side(self) -> int:
        return int(round(self.num_position_embeddings ** 0.5))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "VisionConfig":
        return cls(**d)


def _int(d: dict, key: str, default=None) -> int:
    v = d.get(key, default)
    if isinstance(v, (list, tuple)):  # patch sizes may be given per axis; ours are square
        if len(set(v)) != 1:
            raise ConfigError(f"vision_config.{key} {v!r}: only equal sizes per axis are supported")
        v = v[0]
    if v is None:
        raise ConfigError(f"vision_config lacks required field {key!r}")
    return int(v)


def parse_vision_config(raw: dict, preprocessor: dict | None = None) -> VisionConfig | None:
    """The vision tower of a composite config (None when the checkpoint has none)."""
    v = raw.get("vision_config")
    if not isinstance(v, dict):
        return None
    if v.get("deepstack_visual_indexes"):
        raise ConfigError("vision_config.deepstack_visual_indexes is not supported (Qwen3.5 has none)")
    rp = v.get("rope_parameters") or {}
    if rp.get("rope_type", "axial") != "axial":
        raise ConfigError(f"vision rope_type {rp.get('rope_type')!r} is not supported (expected axial)")
    act = v.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu"):
        raise ConfigError(f"vision hidden_act {act!r} is not supported (gelu_pytorch_tanh or gelu)")
    text = raw.get("text_config") or {}
    trp = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = list(trp.get("mrope_section") or DEFAULT_MROPE_SECTION)
    if len(section) != 3:
        raise ConfigError(f"mrope_section {section!r} must have 3 entries (T, H, W)")
    pp = preprocessor or {}
    size = pp.get("size") or {}
    cfg = VisionConfig(
        depth=_int(v, "depth", 27), hidden_size=_int(v, "hidden_size", 1152),
        intermediate_size=_int(v, "intermediate_size", 4304), num_heads=_int(v, "num_heads", 16),
        in_channels=_int(v, "in_channels", 3), patch_size=_int(v, "patch_size", 16),
        temporal_patch_size=_int(v, "temporal_patch_size", 2), spatial_merge_size=_int(v, "spatial_merge_size", 2),
        out_hidden_size=_int(v, "out_hidden_size", 3584),
        num_position_embeddings=_int(v, "num_position_embeddings", 2304),
        rope_theta=float(rp.get("rope_theta", 10000.0)), hidden_act=act,
        image_token_id=int(raw.get("image_token_id", 248056)),
        vision_start_token_id=int(raw.get("vision_start_token_id", 248053)),
        vision_end_token_id=int(raw.get("vision_end_token_id", 248054)),
        mrope_section=[int(s) for s in section],
        min_pixels=int(pp.get("min_pixels") or size.get("shortest_edge") or DEFAULT_MIN_PIXELS),
        max_pixels=int(pp.get("max_pixels") or size.get("longest_edge") or DEFAULT_MAX_PIXELS),
        image_mean=[float(x) for x in pp.get("image_mean", [0.5, 0.5, 0.5])],
        image_std=[float(x) for x in pp.get("image_std", [0.5, 0.5, 0.5])],
    )
    if cfg.hidden_size % cfg.num_heads or cfg.head_dim % 4:
        raise ConfigError(f"vision head_dim {cfg.hidden_size}/{cfg.num_heads} must be a multiple of 4 (axial rope)")
    if cfg.num_grid_per_side ** 2 != cfg.num_position_embeddings:
        raise ConfigError(f"vision num_position_embeddings {cfg.num_position_embeddings} is not a square")
    for key in ("patch_size", "temporal_patch_size", "spatial_merge_size"):
        if key in pp and int(pp[key]) != getattr(cfg, key):
            raise ConfigError(f"preprocessor_config.json {key} {pp[key]} disagrees with vision_config")
    if cfg.min_pixels > cfg.max_pixels:
        raise ConfigError(f"image processor min_pixels {cfg.min_pixels} > max_pixels {cfg.max_pixels}")
    return cfg


def load_vision_config(model_dir: str | Path) -> VisionConfig | None:
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    pp_path = model_dir / "preprocessor_config.json"
    pp = json.loads(pp_path.read_text()) if pp_path.is_file() else None
    return parse_vision_config(raw, pp)
