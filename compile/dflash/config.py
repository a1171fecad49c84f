"""A DFlash / DFlash2 drafter's geometry, read from its Hugging Face config.json.

Semantics follow the PyPI `dflash` package (dflash/model.py, the reference implementation):
  - a value is read from `dflash_config` first, then from the top level (`_draft_value`);
  - target_layer_ids default to round(1 + i (L - 4) / (n - 1)) over the target's L layers;
  - the config is a transformers Qwen3Config: `sliding_window` counts only with `use_sliding_window`,
    and layer_types default to sliding for layers >= max_window_layers when a window is set;
  - a layer is causal when `is_causal` says so, else exactly when it is a sliding layer.
A sliding layer with a window keeps only that window of context (a ring per sequence, so long
contexts fit); every other layer keeps the whole context (paged, on the target's page ids).
"""
from __future__ import annotations

import json
from pathlib import Path

from ...contract.drafter import DrafterConfig
from ..config import ConfigError

DRAFTER_ARCHS = {"DFlashDraftModel": "dflash", "DFlash2DraftModel": "dflash2"}
LAYER_TYPES = ("full_attention", "sliding_attention")


class DrafterConfigError(ConfigError):
    """A drafter config.json we cannot compile; the message says why."""


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference's build_target_layer_ids."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 3 - 1
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def is_drafter_config(raw: dict) -> bool:
    return any(a in DRAFTER_ARCHS for a in raw.get("architectures") or [])


def parse_drafter_config(raw: dict) -> DrafterConfig:
    archs = raw.get("architectures") or []
    kind = next((DRAFTER_ARCHS[a] for a in archs if a in DRAFTER_ARCHS), None)
    if kind is None:
        raise DrafterConfigError(f"not a DFlash drafter: architectures {archs!r} (expected one of {sorted(DRAFTER_ARCHS)})")
    dc = raw.get("dflash_config") or {}

    def value(name, default=None):
        return dc.get(name, raw.get(name, default))

    if raw.get("hidden_act", "silu") != "silu":
        raise DrafterConfigError(f"hidden_act {raw.get('hidden_act')!r} is not supported (expected silu)")
    if raw.get("attention_bias"):
        raise DrafterConfigError("attention_bias is not supported")
    try:
        n = int(raw["num_hidden_layers"])
        heads = int(raw["num_attention_heads"])
        window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
        layer_types = raw.get("layer_types")
        if layer_types is None:
            mwl = int(raw.get("max_window_layers", 28))
            layer_types = ["sliding_attention" if window is not None and i >= mwl else "full_attention"
                           for i in range(n)]
        layer_types = list(layer_types)
        is_causal = raw.get("is_causal")
        num_target = int(value("num_target_layers", 0) or 0)
        ids = value("target_layer_ids")
        if ids is None:
            if num_target <= 0:
                raise DrafterConfigError("config lacks target_layer_ids and num_target_layers")
            ids = default_target_layer_ids(num_target, n)
        mask = value("mask_token_id")
        if mask is None:
            raise DrafterConfigError("config lacks dflash_config.mask_token_id")
        softcap = value("final_logit_softcapping")
        cfg = DrafterConfig(
            kind=kind, vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]), num_hidden_layers=n, num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads", heads)),
            head_dim=int(raw.get("head_dim") or int(raw["hidden_size"]) // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), layer_types=layer_types,
            causal=[(t == "sliding_attention") if is_causal is None else bool(is_causal) for t in layer_types],
            sliding_window=None if window is None else int(window), target_layer_ids=[int(i) for i in ids],
            num_target_layers=num_target, block_size=int(value("block_size", 16)), mask_token_id=int(mask),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap is not None and float(softcap) > 0 else None,
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            rope={k: raw[k] for k in ("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor",
                                      "max_position_embeddings", "original_max_position_embeddings") if k in raw},
        )
        if kind == "dflash2":
            cfg.conv_kernel_size = int(value("conv_kernel_size"))
            cfg.conv_group_size = int(value("conv_group_size"))
            cfg.selector_rank = int(value("selector_rank"))
            cfg.selector_top_k = int(value("selector_top_k"))
    except KeyError as e:
        raise DrafterConfigError(f"config.json lacks required field {e.args[0]!r}") from None
    except TypeError as e:
        raise DrafterConfigError(f"config.json: a DFlash2 field is missing or not a number ({e})") from None
    _check(cfg)
    return cfg


def _check(c: DrafterConfig) -> None:
    if len(c.layer_types) != c.num_hidden_layers:
        raise DrafterConfigError(f"layer_types has {len(c.layer_types)} entries but num_hidden_layers is "
                                 f"{c.num_hidden_layers}")
    bad = sorted(set(c.layer_types) - set(LAYER_TYPES))
    if bad:
        raise DrafterConfigError(f"unsupported layer types {bad}; expected {list(LAYER_TYPES)}")
    if c.num_attention_heads % c.num_key_value_heads:
        raise DrafterConfigError("num_attention_heads must be a multiple of num_key_value_heads")
    if c.block_size < 2:
        raise DrafterConfigError(f"block_size must be >= 2, got {c.block_size}")
    if not c.target_layer_ids or len(set(c.target_layer_ids)) != len(c.target_layer_ids):
        raise DrafterConfigError(f"target_layer_ids must be distinct layer indices, got {c.target_layer_ids}")
    if c.sliding_window is not None and c.sliding_window < 1:
        raise DrafterConfigError(f"sliding_window must be >= 1, got {c.sliding_window}")
    if not 0 <= c.mask_token_id < c.vocab_size:
        raise DrafterConfigError(f"mask_token_id {c.mask_token_id} lies outside the vocabulary ({c.vocab_size})")
    if c.kind == "dflash2":
        if c.conv_kernel_size < 1 or c.conv_group_size < 1 or c.hidden_size % c.conv_group_size:
            raise DrafterConfigError(f"conv_group_size {c.conv_group_size} must divide hidden_size {c.hidden_size} "
                                     f"and conv_kernel_size ({c.conv_kernel_size}) be >= 1")
        if c.selector_rank < 1 or not 1 <= c.selector_top_k <= c.vocab_size:
            raise DrafterConfigError(f"selector_rank {c.selector_rank} / selector_top_k {c.selector_top_k} out of range")


def load_drafter_config(model_dir: str | Path) -> DrafterConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise DrafterConfigError(f"{path} not found: a drafter directory needs config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DrafterConfigError(f"{path} is not valid JSON: {e}") from None
    return parse_drafter_config(raw)


def read_raw_config(model_dir: str | Path) -> dict:
    """config.json of a directory, or {} (callers only sniff the architecture)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def parse_tap_layers(spec, num_layers: int) -> tuple:
    """`--tap-layers`: "5,19,33", a list, or a drafter directory (its target_layer_ids). Every id names a
    decoder layer other than the last: HF's last hidden state is the final-normed output, not a layer's."""
    if isinstance(spec, (list, tuple)):
        ids = list(spec)
    elif Path(str(spec)).is_dir():
        ids = load_drafter_config(spec).target_layer_ids
    else:
        try:
            ids = [int(x) for x in str(spec).replace(" ", "").split(",") if x]
        except ValueError:
            raise DrafterConfigError(f"--tap-layers {spec!r}: give layer ids like 1,16,31 or a drafter directory") \
                from None
    ids = [int(i) for i in ids]
    if not ids or len(set(ids)) != len(ids) or not all(0 <= i < num_layers - 1 for i in ids):
        raise DrafterConfigError(f"--tap-layers {ids}: need distinct decoder layers in 0..{num_layers - 2} "
                                 f"(the model has {num_layers})")
    return tuple(ids)
