"""`ninfer compile DRAFTER_DIR`: a DFlash / DFlash2 drafter -> dist/NAME/ (library, weights, manifest).

The artifact holds the drafter's own weights only: it runs with the target's embedding table and
lm_head, which the runtime passes in (runtime/spec/dflash_runner.py). The manifest's config is the
parsed DrafterConfig and extras.dflash says what the runtime must check against the target: kind,
block size, tap layers and the pool shapes. Compile it with the target's activation dtype (bf16 on
CUDA, f32 on the CPU); the target needs `ninfer compile --tap-layers DRAFTER_DIR`.
"""
from __future__ import annotations

import contextlib
import shutil
import time
from pathlib import Path

import numpy as np

from ...contract import safetensors_io
from ...contract.manifest import Manifest, write_manifest
from ...contract.pool_layout import PAGE_SIZE
from ..config import ConfigError
from ..convert import ConversionError
from ..model import FUSED_PROJECTIONS
from ..rope_scaling import RopeSpec, inv_freq_and_attention_factor
from ..targets import parse_target
from .config import DrafterConfig, load_drafter_config
from .model import DFlashDrafter

DRAFTER_QUANTS = {"f32": "float32", "bf16": "bfloat16"}
# checkpoint layers fused into one projection of the compiled drafter, in this order
FUSED = {"self_attn.kv_proj": ("self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": FUSED_PROJECTIONS["mlp.gate_up_proj"]}


def rope_tables(cfg: DrafterConfig) -> tuple[np.ndarray, float, dict]:
    try:
        spec = RopeSpec.from_hf_config(dict(cfg.rope), head_dim=cfg.head_dim)
    except ValueError as e:
        raise ConfigError(f"drafter rope: {e}") from None
    if spec.rotary_dim != cfg.head_dim:
        raise ConfigError(f"drafter rope: partial rotary ({spec.rotary_dim} of {cfg.head_dim} dims) is not supported")
    inv_freq, factor = inv_freq_and_attention_factor(spec)
    info = {"type": spec.rope_type, "theta": spec.theta, "rotary_dim": spec.rotary_dim, "factor": spec.factor,
            "original_context": spec.original_max_position_embeddings, "attention_factor": float(factor)}
    return inv_freq, float(factor), info


def drafter_params(tensors: dict, specs: list, inv_freq: np.ndarray, factor: float, cast) -> dict:
    """HF drafter state dict -> the compiled parameter list [(name, shape, dtype)]: projections reading
    the same input fused, codebooks stored without `.weight` (released checkpoints) accepted, RMSNorm
    weights as they are (Qwen3 norms are plain scales)."""
    src = {}
    for name, arr in tensors.items():
        n = name[len("model."):] if name.startswith("model.") else name
        if n.endswith(("predecessor_codebook", "successor_codebook")):
            n += ".weight"
        src[n] = arr
    for name, _, _ in specs:
        for fused, parts in FUSED.items():
            if name.endswith(fused + ".weight") and name not in src:
                prefix = name[: -len(fused + ".weight")]
                srcs = [prefix + p + ".weight" for p in parts]
                if all(p in src for p in srcs):
                    src[name] = np.concatenate([np.asarray(src[p]) for p in srcs], axis=0)
    src["rope_inv_freq"] = np.asarray(inv_freq, np.float32)
    src["rope_attn_factor"] = np.array([factor], np.float32)
    out, missing = {}, []
    for name, shape, dtype in specs:
        if name not in src:
            missing.append(name)
            continue
        arr = np.asarray(src[name])
        if tuple(arr.shape) != tuple(shape):
            raise ConversionError(f"drafter weight {name}: checkpoint shape {tuple(arr.shape)} != model shape {tuple(shape)}")
        out[name] = cast(arr, dtype)
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ConversionError(f"drafter checkpoint lacks weights: {', '.join(missing[:5])}{more}")
    return out


def compile_drafter(model_dir: str | Path, target: str = "llvm", quant: str = "f32", out_dir: str | Path | None = None,
                    name: str | None = None, random_weights: int | None = None, max_prefill_chunk: int | None = None,
                    log=print) -> Path:
    from tvm import __version__ as tvm_version

    from ..build import _np_dtype, write_weights
    from ..lib_build import build_cached
    from ..libcache import build_key
    from ..memory_bounds import DEFAULT_MAX_ROWS, bound_chunk_rows

    model_dir = Path(model_dir)
    cfg = load_drafter_config(model_dir)
    tspec = parse_target(target)
    if quant not in DRAFTER_QUANTS:
        raise ConfigError(f"a DFlash drafter compiles with --quant f32 or bf16 (the target's activation dtype: bf16 on "
                          f"CUDA, f32 on the CPU), got {quant!r}")
    dtype = DRAFTER_QUANTS[quant]
    inv_freq, factor, rope_info = rope_tables(cfg)
    if random_weights is None and not list(model_dir.glob("*.safetensors")):
        raise ConfigError(f"{model_dir} has no *.safetensors weights (--random-weights builds a benchmark artifact "
                          "from config.json alone)")
    name = name or f"{model_dir.name}-{quant}-{tspec.name}" + ("-random" if random_weights is not None else "")
    out = Path(out_dir or Path("dist") / name)
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.time()

    arch_scope = tspec.tvm_target() if tspec.kind == "cuda" else contextlib.nullcontext()
    with arch_scope:
        model = DFlashDrafter(cfg, dtype, tspec.kind)
    max_rows = int(max_prefill_chunk or DEFAULT_MAX_ROWS)

    def export():
        mod, pspec = model.export_tvm(spec=model.export_spec())
        mod = bound_chunk_rows(mod, max_rows, functions=("ctx",))  # ctx takes a prefill chunk's tap rows
        return mod, [(n, [int(s) for s in p.shape], p.dtype) for n, p in pspec]

    lib_rel = f"{name}.so"
    specs = build_cached(tspec, out / lib_rel, build_key([cfg.to_dict(), dtype, "dflash-drafter", max_rows], tspec), export)
    log(f"built {tspec.name} {cfg.kind} drafter library in {time.time() - t0:.1f}s")

    t1 = time.time()
    if random_weights is None:
        tensors = safetensors_io.load_dir(model_dir)
        params = drafter_params(tensors, specs, inv_freq, factor,
                                lambda a, dt: np.asarray(a, np.float32).astype(_np_dtype(dt)))
    else:
        params = {"rope_inv_freq": np.asarray(inv_freq, np.float32), "rope_attn_factor": np.array([factor], np.float32)}
    shards = write_weights(params, out)
    log(f"wrote {len(params)} drafter weights in {time.time() - t1:.1f}s"
        + (f" (random weights, seed {random_weights}: drawn at load time)" if random_weights is not None else ""))
    shutil.copy2(model_dir / "config.json", out / "config.json")
    write_manifest(out, Manifest(
        name=name, config=cfg.to_dict(), target=tspec.name, dtype=dtype, kv_dtype=dtype, page_size=PAGE_SIZE,
        max_context=cfg.max_position_embeddings, library=lib_rel, params=specs, weight_shards=shards,
        tvm_version=tvm_version, rope=rope_info,
        extras={"dflash": {"kind": cfg.kind, "block_size": cfg.block_size, "target_layer_ids": cfg.target_layer_ids,
                           "pools": {k: list(v) for k, v in model.pool_shapes().items()}},
                "max_prefill_chunk": max_rows,
                **({"random_weights": {"seed": int(random_weights)}} if random_weights is not None else {})},
    ))
    log(f"wrote {out}")
    return out
