"""RoPE scaling parameters (default / linear / YaRN) for the full-attention layers, in numpy.

Matches HF transformers 5.24 ``ROPE_INIT_FUNCTIONS`` (and the models' default init) so the cos/sin
tables the engine bakes in agree with the reference model; the float32 op order is copied on
purpose.  Only the first ``rotary_dim = int(head_dim * partial_rotary_factor)`` dims rotate
(NeoX rotate_half); the YaRN attention factor multiplies cos and sin, so it scales only those dims.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

ROPE_TYPES = ("default", "linear", "yarn")
MAX_FACTOR = 32.0


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str = "default"
    theta: float = 10000.0
    rotary_dim: int = 64
    factor: float = 1.0
    # Context the model was pretrained for (HF max_position_embeddings when not given).
    original_max_position_embeddings: int = 32768
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # explicit override (HF ``attention_factor``)
    truncate: bool = True

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ValueError(f"unsupported rope scaling type {self.rope_type!r}; expected one of {ROPE_TYPES}")
        f = self.factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f):
            raise ValueError(f"rope scaling factor must be a number, got {f!r}")
        if not 1.0 <= f <= MAX_FACTOR:
            raise ValueError(f"rope scaling factor must be in [1, {MAX_FACTOR:g}], got {f}")
        if self.rope_type == "default" and f != 1.0:
            raise ValueError(f"rope_type 'default' takes no factor (got {f}); use 'linear' or 'yarn'")
        if not self.theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {self.theta}")
        if self.rotary_dim <= 0 or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim must be a positive even number, got {self.rotary_dim}")
        if int(self.original_max_position_embeddings) <= 0:
            raise ValueError("original_max_position_embeddings must be a positive integer, "
                             f"got {self.original_max_position_embeddings}")
        if self.beta_fast < self.beta_slow:
            raise ValueError(f"yarn beta_fast ({self.beta_fast}) must be >= beta_slow ({self.beta_slow})")

    def max_context(self) -> int:
        """Longest context the table is meant for: original * factor (factor 1 for default)."""
        return int(self.original_max_position_embeddings * self.factor)

    @classmethod
    def from_hf_config(cls, config: dict, *, head_dim: int | None = None, scaling_type: str | None = None,
                       factor: float | None = None, original_context: int | None = None) -> "RopeSpec":
        """Build from an HF config dict (``rope_parameters`` or legacy ``rope_scaling``/``rope_theta``/
        ``partial_rotary_factor``; composite configs use ``text_config``) plus CLI overrides."""
        cfg = config.get("text_config") or config
        rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_type = scaling_type or rp.get("rope_type") or rp.get("type") or "default"
        theta = rp.get("rope_theta", cfg.get("rope_theta", 10000.0))
        prf = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
        hd = head_dim or cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        max_pos = cfg.get("max_position_embeddings", 32768)
        # HF: a top-level original_max_position_embeddings wins, else the dict's, else max_pos.
        orig = original_context or cfg.get("original_max_position_embeddings") \
            or rp.get("original_max_position_embeddings") or max_pos
        f: Optional[float]  # the scaling factor (config.json may omit it)
        if rope_type == "default":
            if factor not in (None, 1, 1.0):
                raise ValueError("--rope-scaling-factor needs --rope-scaling-type linear or yarn")
            f = 1.0
        else:
            f = factor if factor is not None else rp.get("factor")
            if f is None and rope_type == "yarn" and scaling_type is None:
                f = max_pos / orig  # HF yarn fallback when config.json omits the factor
            if f is None:
                raise ValueError(f"rope scaling type {rope_type!r} needs a factor (--rope-scaling-factor)")
        return cls(rope_type=rope_type, theta=float(theta), rotary_dim=int(hd * prf), factor=f,
                   original_max_position_embeddings=int(orig),
                   beta_fast=rp.get("beta_fast") or 32.0, beta_slow=rp.get("beta_slow") or 1.0,
                   mscale=rp.get("mscale"), mscale_all_dim=rp.get("mscale_all_dim"),
                   attention_factor=rp.get("attention_factor"), truncate=rp.get("truncate", True))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rope-scaling-type", choices=ROPE_TYPES, default=None)
    parser.add_argument("--rope-scaling-factor", type=float, default=None)
    parser.add_argument("--rope-scaling-original-context", type=int, default=None)


def spec_from_args(config: dict, args: argparse.Namespace, head_dim: int | None = None) -> RopeSpec:
    return RopeSpec.from_hf_config(config, head_dim=head_dim, scaling_type=args.rope_scaling_type,
                                   factor=args.rope_scaling_factor,
                                   original_context=args.rope_scaling_original_context)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_attention_factor(spec: RopeSpec) -> tuple[np.ndarray, float]:
    """(inv_freq float32 [rotary_dim/2], attention_factor) as HF computes them (float32 op order)."""
    f32 = np.float32
    dim = spec.rotary_dim
    expo = np.arange(0, dim, 2, dtype=np.float32) / f32(dim)
    # torch's float32 pow is accurate to ~1 ulp; a float64 pow rounded once is the closest match.
    pos_freqs = (spec.theta ** expo.astype(np.float64)).astype(np.float32)
    inv_extrap = (f32(1.0) / pos_freqs).astype(np.float32)
    if spec.rope_type == "default":
        return inv_extrap, 1.0
    if spec.rope_type == "linear":
        return (inv_extrap / f32(spec.factor)).astype(np.float32), 1.0

    factor = spec.factor
    att = spec.attention_factor
    if att is None:
        if spec.mscale and spec.mscale_all_dim:
            att = float(_yarn_mscale(factor, spec.mscale) / _yarn_mscale(factor, spec.mscale_all_dim))
        else:
            att = _yarn_mscale(factor)

    orig = spec.original_max_position_embeddings

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(spec.theta))

    low, high = corr_dim(spec.beta_fast), corr_dim(spec.beta_slow)
    if spec.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent singularity
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - f32(low)) / f32(high - low), 0, 1).astype(np.float32)
    extrap_w = f32(1.0) - ramp
    inv_interp = f32(1.0) / (f32(factor) * pos_freqs)
    inv = inv_interp * (f32(1.0) - extrap_w) + inv_extrap * extrap_w
    return inv.astype(np.float32), float(att)


def cos_sin(positions, inv_freq, attention_factor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [T, rotary_dim] in NeoX layout (freqs repeated twice), scaled by attention_factor.

    The angle is the float32 product position * inv_freq, as HF/vLLM compute it, so tables match
    them even far past 2^20 positions where that product is coarse."""
    pos = np.asarray(positions).astype(np.float32)
    freqs = pos[..., None] * np.asarray(inv_freq, dtype=np.float32)
    emb = np.concatenate([freqs, freqs], axis=-1).astype(np.float64)
    af = np.float32(attention_factor)
    return (np.cos(emb).astype(np.float32) * af), (np.sin(emb).astype(np.float32) * af)


def apply_partial_rope(x, positions, spec: RopeSpec) -> np.ndarray:
    """x [T, H, D] -> RoPE'd float32 copy; dims >= rotary_dim pass through untouched."""
    x = np.asarray(x, dtype=np.float32)
    rd = spec.rotary_dim
    if rd > x.shape[-1]:
        raise ValueError(f"rotary_dim {rd} exceeds head_dim {x.shape[-1]}")
    cos, sin = cos_sin(positions, *inv_freq_and_attention_factor(spec))
    cos, sin = cos[:, None, :], sin[:, None, :]
    xr = x[..., :rd]
    half = rd // 2
    rot = np.concatenate([-xr[..., half:], xr[..., :half]], axis=-1)
    out = x.copy()
    out[..., :rd] = xr * cos + rot * sin
    return out
