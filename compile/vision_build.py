"""Compile the vision tower of a Qwen3_5ForConditionalGeneration checkpoint into the artifact.

The artifact always carries an llvm library (`vision-llvm.so`: `ninfer serve --vision-cpu` runs the
ViT on the host threads with fp32 weights in host RAM, leaving device memory to KV) and, for CUDA
targets, a library for the GPU (`vision-cuda-sm_XX.so`, activations in the LM dtype). Both read the
same fp32 weight shards (params/vision_*.safetensors); the runtime casts them to the library dtype.
Described in manifest extras["vision"] (runtime/vision_encoder.py reads it).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..contract import safetensors_io
from . import libcache
from .config import ConfigError
from .lib_build import build_cached
from .targets import TargetSpec
from .vision_config import VisionConfig

_PREFIXES = ("model.visual.", "visual.")


def vision_weights(tensors: dict[str, np.ndarray], vcfg: VisionConfig,
                   specs: list[tuple[str, list, str]]) -> dict[str, np.ndarray]:
    """Checkpoint visual.* tensors -> the encoder's parameters (fp32); the Conv3d kernel flattened."""
    src = {}
    for name, arr in tensors.items():
        for pre in _PREFIXES:
            if name.startswith(pre):
                src[name[len(pre):]] = arr
    out, missing = {}, []
    for name, shape, _ in specs:
        if name not in src:
            missing.append(name)
            continue
        a = np.asarray(src[name], dtype=np.float32)
        if name == "patch_embed.proj.weight" and a.size == int(np.prod(shape)):
            a = a.reshape(vcfg.hidden_size, -1)  # [D, C, T, P, P] -> [D, C*T*P*P], the patch layout
        if list(a.shape) != list(shape):
            raise ConfigError(f"vision weight {name}: checkpoint shape {a.shape} != model shape {tuple(shape)}")
        out[name] = np.ascontiguousarray(a)
    if missing:
        raise ConfigError(f"checkpoint lacks vision weights: {', '.join(missing[:5])}"
                          + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""))
    return out


def has_vision_weights(names) -> bool:
    return any(n.startswith(_PREFIXES) for n in names)


def build_vision_library(vcfg: VisionConfig, dtype: str, target: TargetSpec, lib_path: Path) -> list:
    """Export + build the encoder for one target; returns [(name, shape, dtype)] in call order."""
    from .vision_model import Qwen35VisionEncoder

    def export():
        model = Qwen35VisionEncoder(vcfg, dtype, target.kind)
        mod, pspec = model.export_tvm(spec=model.export_spec())
        return mod, [(n, [int(s) for s in p.shape], p.dtype) for n, p in pspec]

    return build_cached(target, lib_path, libcache.vision_key(vcfg, dtype, target), export)


def compile_vision(vcfg: VisionConfig, tensors: dict[str, np.ndarray], target: TargetSpec, lm_dtype: str,
                   out: Path, log=print) -> dict:
    """Build the vision libraries, write the weights; returns the manifest section."""
    libraries = {}
    specs = build_vision_library(vcfg, "float32", TargetSpec("llvm"), out / "vision-llvm.so")
    libraries["cpu"] = {"library": "vision-llvm.so", "dtype": "float32", "target": "llvm"}
    if target.kind == "cuda":
        name = f"vision-{target.name}.so"
        build_vision_library(vcfg, lm_dtype, target, out / name)
        libraries["cuda"] = {"library": name, "dtype": lm_dtype, "target": target.name}
    weights = vision_weights(tensors, vcfg, specs)
    (out / "params").mkdir(parents=True, exist_ok=True)
    shard = "params/vision_00000.safetensors"
    safetensors_io.save(out / shard, weights)
    log(f"vision tower: {vcfg.depth} blocks, {sum(w.size for w in weights.values()) / 1e6:.1f}M parameters, "
        f"libraries {', '.join(v['library'] for v in libraries.values())}")
    return {"config": vcfg.to_dict(), "libraries": libraries, "params": specs, "weight_shards": [shard]}
