"""HF mixture-of-experts weights -> the expert arrays of compile/moe.py.

Checkpoints carry the routed experts in one of two layouts, both taken:
  per expert   mlp.experts.{i}.{gate,up,down}_proj.weight   (transformers' save_pretrained, Qwen3-Next releases,
                                                              ModelOpt NVFP4: + .weight_scale / .weight_scale_2)
  fused        mlp.experts.gate_up_proj [E, 2I, D] (gate rows first), mlp.experts.down_proj [E, D, I]
               (transformers 5.x in memory; some Qwen3.5-MoE releases), with or without a `.weight` suffix
The shared expert (mlp.shared_expert.{gate,up,down}_proj) becomes expert E of the arrays when the model folds it
in (compile/moe.py shared_folded). NVFP4 parameters get each source matrix's own quantization (ModelOpt tensors
as they are, float ones quantized per gate / up / down matrix), so both layouts give the same codes.
"""
from __future__ import annotations

import re
from typing import Optional

import numpy as np

from .config import ModelConfig

_EXPERT_PARAM = re.compile(r"^(?P<prefix>.*\.mlp\.)experts\.(?P<kind>gate_up_proj|down_proj)\.weight$")


class _Missing(Exception):
    pass


def _fused(src: dict, prefix: str, kind: str, shape: tuple) -> np.ndarray | None:
    for name in (f"{prefix}experts.{kind}", f"{prefix}experts.{kind}.weight"):
        arr = src.get(name)
        if arr is not None and np.asarray(arr).ndim == 3:
            if tuple(arr.shape) != shape:
                from .convert import ConversionError

                raise ConversionError(f"fused expert weight {name}: shape {tuple(arr.shape)}, expected {shape} "
                                      "(experts x out x in, gate rows before up rows)")
            return arr
    return None


def _sources(src: dict, prefix: str, kind: str, cfg: ModelConfig, fold: bool) -> list[list]:
    """Per expert slot, the source matrices (name, float array or None) of its rows, in order."""
    e, d, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    parts = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
    fused = _fused(src, prefix, kind, (e, 2 * i, d) if kind == "gate_up_proj" else (e, d, i))
    slots: list[list] = []
    for x in range(e):
        row: list[tuple[str, Optional[np.ndarray]]] = []
        for j, p in enumerate(parts):
            name = f"{prefix}experts.{x}.{p}"
            if fused is not None and name + ".weight" not in src:
                arr = np.asarray(fused[x])
                row.append((name, arr[j * i:(j + 1) * i] if kind == "gate_up_proj" else arr))
            else:
                row.append((name, None))
        slots.append(row)
    if fold:
        slots.append([(f"{prefix}shared_expert.{p}", None) for p in parts])
    return slots


def assemble_experts(src: dict, param_names: list[str], cfg: ModelConfig, fold: bool) -> set[str]:
    """Put the expert arrays the model asks for into `src` (stacked over experts, NVFP4 where the model's
    parameter list has scales); returns the parameter names it built."""
    from .convert import ConversionError, _nvfp4_part

    names = set(param_names)
    built: set[str] = set()
    missing: list[str] = []
    for pname in param_names:
        m = _EXPERT_PARAM.match(pname)
        if not m:
            continue
        base = pname[: -len(".weight")]
        nvfp4 = base + ".weight_scale_2" in names
        stacked: dict[str, list] = {}
        for slot in _sources(src, m["prefix"], m["kind"], cfg, fold):
            mats: list = []  # NVFP4 parts ({key: array}) or float arrays
            for name, arr in slot:
                if nvfp4:
                    q = _nvfp4_part(src if arr is None else {name + ".weight": arr}, name)
                    if q is None:
                        missing.append(name + ".weight")
                    mats.append(q)
                elif arr is not None or name + ".weight" in src:
                    mats.append(np.asarray(src[name + ".weight"] if arr is None else arr))
                else:
                    missing.append(name + ".weight")
            if missing:
                continue
            if nvfp4:
                for key in ("weight", "weight_scale", "weight_scale_2"):
                    stacked.setdefault(key, []).append(np.concatenate([q[key] for q in mats], axis=0))
            else:
                stacked.setdefault("weight", []).append(np.concatenate(mats, axis=0) if len(mats) > 1 else mats[0])
        if missing:
            continue
        for key, arrs in stacked.items():
            src[f"{base}.{key}"] = np.stack(arrs, axis=0)
            built.add(f"{base}.{key}")
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ConversionError(f"checkpoint lacks expert weights: {', '.join(missing[:5])}{more}")
    return built
