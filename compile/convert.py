"""HF safetensors -> the compiled model's parameter set.

What changes on the way: Qwen3-Next's grouped in_proj_qkvz / in_proj_ba are split into the
Qwen3.5 layout (one model definition serves both); conv1d weights drop their singleton axis;
zero-centred RMSNorm weights get the +1 folded in (not linear_attn.norm, which is a plain scale);
MoE experts are stacked into per-layer arrays from either checkpoint layout (convert_moe.py);
VLM prefixes are stripped; mtp.* weights (the MTP head) keep their names and are used when the model
compiles the head; dtypes are set per parameter; the rope frequency table is added.
"""
from __future__ import annotations

import re
from typing import Callable, Iterable

import numpy as np

from .config import ModelConfig
from .model import FUSED_PROJECTIONS
from .weight_quant import from_modelopt, quantize_weight

_ZERO_CENTRED = re.compile(r"(input_layernorm|post_attention_layernorm|q_norm|k_norm|pre_fc_norm_\w+)\.weight$"
                           r"|^model\.norm\.weight$|^mtp\.norm\.weight$")
_IGNORED = re.compile(r"^(model\.visual\.|visual\.)")  # mtp.* flows through when the model compiles the head


class ConversionError(ValueError):
    pass


def _canonical_name(name: str) -> str:
    for pre, repl in (("model.language_model.", "model."), ("language_model.model.", "model."),
                      ("language_model.lm_head.", "lm_head.")):
        if name.startswith(pre):
            return repl + name[len(pre):]
    return name


def checkpoint_has_mtp(names: Iterable[str]) -> bool:
    """True when a checkpoint carries the MTP head's weights (vLLM names, mtp.fc.weight ...)."""
    return any(_canonical_name(n).startswith("mtp.fc.") for n in names)


def _split_next_qkvz(w: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk
    g = w.reshape(hk, 2 * dk + 2 * r * dv, -1)
    q, k = g[:, :dk], g[:, dk:2 * dk]
    v, z = g[:, 2 * dk:2 * dk + r * dv], g[:, 2 * dk + r * dv:]
    flat = lambda t: t.reshape(-1, w.shape[-1])  # noqa: E731
    return np.concatenate([flat(q), flat(k), flat(v)], 0), flat(z)


def _split_next_ba(w: np.ndarray, cfg: ModelConfig) -> tuple[np.ndarray, np.ndarray]:
    hk = cfg.linear_num_key_heads
    r = cfg.linear_num_value_heads // hk
    g = w.reshape(hk, 2 * r, -1)
    return g[:, :r].reshape(-1, w.shape[-1]), g[:, r:].reshape(-1, w.shape[-1])


def _parts(base: str) -> list[str]:
    """Checkpoint layers that make up a (possibly fused) projection of the model."""
    for fused, parts in FUSED_PROJECTIONS.items():
        if base.endswith(fused):
            prefix = base[: -len(fused)]
            return [prefix + p for p in parts]
    return [base]


def _nvfp4_part(src: dict[str, np.ndarray], part: str) -> dict[str, np.ndarray] | None:
    q = from_modelopt(src, part)
    if q is None and part + ".weight" in src:
        q = quantize_weight(np.asarray(src[part + ".weight"], np.float32))
    if q is not None:  # per-row global scale, so fused parts keep their own tensor scales exactly
        q = dict(q, weight_scale_2=np.full(q["weight"].shape[0], q["weight_scale_2"].reshape(-1)[0], np.float32))
    return q


def _untracked(items, *_):
    return items


def _assemble_projections(src: dict[str, np.ndarray], param_names: list[str], track: Callable = _untracked) -> None:
    """Build every fused and/or NVFP4 projection the model asks for from the checkpoint's layers."""
    nvfp4 = {n[: -len(".weight_scale_2")] for n in param_names if n.endswith(".weight_scale_2")}
    weights = [n for n in param_names if n.endswith(".weight")]
    if nvfp4:  # quantizing is the slow part; fusing alone is quick
        weights = track(weights, "quantize weights", len(weights), "weight")
    for name in weights:
        base = name[: -len(".weight")]
        parts = _parts(base)
        if base in nvfp4:
            qs = [q for q in (_nvfp4_part(src, p) for p in parts) if q is not None]
            if len(qs) < len(parts):
                continue  # reported as missing below
            for k in ("weight", "weight_scale", "weight_scale_2"):
                src[f"{base}.{k}"] = np.concatenate([q[k] for q in qs], axis=0)
        elif len(parts) > 1 and all(p + ".weight" in src for p in parts):
            src[name] = np.concatenate([np.asarray(src[p + ".weight"]) for p in parts], axis=0)


def hf_to_params(
    tensors: dict[str, np.ndarray],
    cfg: ModelConfig,
    param_specs: Iterable[tuple[str, tuple, str]],
    rope_tables: tuple[np.ndarray, float],
    cast: Callable[[np.ndarray, str], np.ndarray] | None = None,
    track: Callable = _untracked,
) -> dict[str, np.ndarray]:
    """Map an HF state dict onto the compiled parameter list [(name, shape, dtype)].

    track(items, desc, total, unit) -> items: wraps the long loops (a progress bar)."""
    src: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        name = _canonical_name(name)
        if _IGNORED.match(name):
            continue
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            base = name[: -len("in_proj_qkvz.weight")]
            src[base + "in_proj_qkv.weight"], src[base + "in_proj_z.weight"] = _split_next_qkvz(arr, cfg)
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            base = name[: -len("in_proj_ba.weight")]
            src[base + "in_proj_b.weight"], src[base + "in_proj_a.weight"] = _split_next_ba(arr, cfg)
        else:
            src[name] = arr
    param_specs = list(param_specs)
    names = [n for n, _, _ in param_specs]
    built = set()
    if cfg.num_experts:  # MoE: stacked expert arrays (compile/convert_moe.py), router + shared gate fused below
        from .convert_moe import assemble_experts
        from .moe import shared_folded

        built = assemble_experts(src, names, cfg, shared_folded(cfg))
    _assemble_projections(src, [n for n in names if n not in built], track)
    inv_freq, factor = rope_tables
    src["rope_inv_freq"] = np.asarray(inv_freq, np.float32)
    src["rope_attn_factor"] = np.array([factor], np.float32)

    cast = cast or (lambda a, dt: a.astype(dt))
    out: dict[str, np.ndarray] = {}
    missing = []
    for name, shape, dtype in track(param_specs, "convert weights", len(param_specs), "weight"):
        if name not in src:
            missing.append(name)
            continue
        arr = np.asarray(src[name])
        if name.endswith("conv1d.weight") and arr.ndim == 3:
            arr = arr[:, 0, :]
        if _ZERO_CENTRED.search(name):
            arr = arr.astype(np.float32) + 1.0
        if tuple(arr.shape) != tuple(shape):
            raise ConversionError(f"weight {name}: checkpoint shape {tuple(arr.shape)} != model shape {tuple(shape)}")
        out[name] = cast(arr, dtype)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ConversionError(f"checkpoint lacks weights: {', '.join(missing[:5])}{more}")
    return out
