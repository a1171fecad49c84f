"""`ninfer compile`: HF model directory -> dist/NAME/ (library, weight shards, manifest)."""
from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from ..contract import safetensors_io
from ..contract.manifest import Manifest, write_manifest
from . import grid_dependency, libcache
from .config import ConfigError, ModelConfig, load_config
from .convert import checkpoint_has_mtp, hf_to_params
from .lib_build import build_cached
from .memory_bounds import DEFAULT_MAX_ROWS, bound_chunk_rows
from .model import PAGE_SIZE, Qwen3xForCausalLM
from .progress import SILENT, Progress
from .rope_scaling import RopeSpec, inv_freq_and_attention_factor
from .sampler_module import ABI_VERSION as SAMPLER_ABI_VERSION, add_device_sampler
from .targets import TargetSpec, parse_target
from .vision_build import compile_vision, has_vision_weights
from .vision_config import load_vision_config

# --quant -> (activation dtype, weight format). nvfp4: decoder projections in NVFP4 (fused dequant),
# activations bf16 on CUDA and f32 on CPU (where bf16 arithmetic is emulated).
QUANT_MODES = {"f32": ("float32", None), "bf16": ("bfloat16", None), "nvfp4": (None, "nvfp4")}
# --kv-dtype -> manifest kv_dtype. fp8: E4M3 + per-(token, head) E8M0 scale; nvfp4: E2M1 + E4M3 per 16
# (layouts in compile/kernels/attention_quant.py). Default: the model dtype.
KV_DTYPES = {"f32": "float32", "bf16": "bfloat16", "fp8": "fp8", "nvfp4": "nvfp4"}
SHARD_BYTES = 1 << 30
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json", "special_tokens_map.json", "config.json", "preprocessor_config.json")
EXTRA_TEMPLATES = "additional_chat_templates"  # named chat templates (*.jinja) beside the default one


def _np_dtype(dtype: str):
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)


def rope_tables_for(cfg: ModelConfig, overrides: dict) -> tuple[np.ndarray, float, dict]:
    """Frequency table + attention factor for the rope setup, with CLI overrides applied.

    overrides: scaling_type / factor / original_context (None = from config.json).
    """
    hf = {"rope_parameters": cfg.rope, "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_position_embeddings}
    try:
        spec = RopeSpec.from_hf_config(hf, head_dim=cfg.head_dim, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as e:
        raise ConfigError(str(e)) from None
    inv_freq, factor = inv_freq_and_attention_factor(spec)
    info = {"type": spec.rope_type, "theta": spec.theta, "rotary_dim": spec.rotary_dim, "factor": spec.factor,
            "original_context": spec.original_max_position_embeddings, "attention_factor": float(factor),
            "max_context": max(spec.max_context(), cfg.max_position_embeddings if spec.factor == 1.0 else 0)}
    return inv_freq, float(factor), info


def fp4_mma_default(target: TargetSpec, weight_quant: str | None) -> bool:
    """--fp4-mma default: on for cuda:sm_120 with NVFP4 weights (the only place it can run)."""
    return target.kind == "cuda" and target.arch == "sm_120" and weight_quant == "nvfp4"


def _fp4_mma_options(target: TargetSpec) -> dict:
    """NVFP4Linear options of the FP4 MMA path: the target its decode-row GEMVs are scheduled for
    and the schedule file's low-batch buckets (rows <= the largest keep the dequant path)."""
    from .gpu_pipeline import schedule_for

    tgt = target.tvm_target()
    return {"target": tgt, "low_batch": schedule_for(tgt)["dlight"].get("low_batch") or []}


def build_library(cfg: ModelConfig, dtype: str, target: TargetSpec, lib_path: Path, kv_dtype: str | None = None,
                  kv_hadamard: bool = False, mtp: bool = False, weight_quant: str | None = None,
                  fp4_mma: bool = False, multimodal: bool = False, tap_layers: tuple = (),
                  max_rows: int = DEFAULT_MAX_ROWS, fp4_qk: bool = True) -> list:
    """Export the relax module, build it for the target, write the shared library.

    fp4_mma: NVFP4 projections run prefill rows on the block-scaled FP4 tensor cores
    (compile/kernels/cuda/fp4_mma.py; cuda:sm_120 + weight_quant nvfp4 only).
    multimodal: also compile prefill_mm / decode_mrope (checkpoints with a vision tower).
    tap_layers: also export prefill_t / verify_t for a DFlash drafter (compile/model.py).
    max_rows: the most rows a prefill-chunk function takes per call; their memory is planned for it
    (compile/memory_bounds.py).
    Returns the parameter list [(name, shape, dtype)] in call order. Set NINFER_LIB_CACHE to a
    directory to reuse libraries of identical geometry (compile/libcache.py; the test suite does).
    """
    from .kernels.cuda.registry import fp4_qk_default, fp4_qk_scope
    from .kernels.dequant import fp4_mma_scope

    kv_dtype = kv_dtype or dtype
    fp4_qk_off = not fp4_qk and target.kind == "cuda" and fp4_qk_default(target.arch, kv_dtype)
    if fp4_mma and not fp4_mma_default(target, weight_quant):
        raise ConfigError("--fp4-mma on needs --target cuda:sm_120 and --quant nvfp4")
    key = libcache.library_key(cfg, dtype, target, kv_dtype, kv_hadamard, mtp, weight_quant, fp4_mma, multimodal,
                                tap_layers, max_rows) + ("-nofp4qk" if fp4_qk_off else "")

    def export():
        # inside the target scope: the CUDA kernel set reads the arch (schedule file, arch-only kernels)
        arch_scope = target.tvm_target() if target.kind == "cuda" else contextlib.nullcontext()
        with fp4_mma_scope(_fp4_mma_options(target) if fp4_mma else None), fp4_qk_scope(not fp4_qk_off), arch_scope:
            model = Qwen3xForCausalLM(cfg, dtype, target.kind, kv_dtype, kv_hadamard, mtp=mtp,
                                      weight_quant=weight_quant, multimodal=multimodal, tap_layers=tap_layers)
        mod, pspec = model.export_tvm(spec=model.export_spec())
        with arch_scope:  # the sampler kernels read the arch's schedule file like the model's
            mod = add_device_sampler(mod, cfg.vocab_size, target.kind)
        mod = bound_chunk_rows(mod, max_rows)
        return mod, [(n, [int(s) for s in p.shape], p.dtype) for n, p in pspec]

    return build_cached(target, lib_path, key, export)


def write_weights(params: dict[str, np.ndarray], out_dir: Path, progress: Progress = SILENT) -> list[str]:
    shards: list[dict[str, np.ndarray]] = []
    cur: dict[str, np.ndarray] = {}
    size = 0
    for name, arr in params.items():
        if cur and size + arr.nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = arr
        size += arr.nbytes
    if cur:
        shards.append(cur)
    names = []
    (out_dir / "params").mkdir(parents=True, exist_ok=True)
    for i, shard in enumerate(progress.iterate(shards, "write weights", unit="shard")):
        rel = f"params/params_{i:05d}.safetensors"
        safetensors_io.save(out_dir / rel, shard)
        names.append(rel)
    return names


def compile_model(model_dir: str | Path, target: str = "llvm", quant: str = "f32", max_context: int | None = None,
                  out_dir: str | Path | None = None, name: str | None = None, rope_overrides: dict | None = None,
                  kv_dtype: str | None = None, kv_hadamard: bool = False, fp4_mma: str | bool | None = None,
                  fp4_qk: str | bool | None = None, random_weights: int | None = None, vision: bool = True,
                  tap_layers: str | list | None = None, max_prefill_chunk: int | None = None, log=print,
                  progress: Progress = SILENT) -> Path:
    """fp4_mma: "on" / "off" / None (default: on for cuda:sm_120 + --quant nvfp4).
    fp4_qk: "on" / "off" / None (default: on for cuda:sm_120 + --kv-dtype nvfp4): nvfp4 pages' decode attention
    computes Q K^T on the block-scaled FP4 tensor cores (Q quantized to NVFP4 on the fly).
    random_weights: a seed -> a benchmark artifact without converted weights: only config.json (and the
    tokenizer files) are read, the rope tables are stored, every other parameter is drawn on the device at
    load time (runtime/executor/random_weights.py). Labelled in the manifest; `ninfer serve` refuses it
    unless asked (--allow-random-weights).
    vision: compile the vision tower when the checkpoint has one (compile/vision_build.py).
    tap_layers: decoder layers whose outputs prefill_t / verify_t return for a DFlash drafter: ids
    ("5,19,33") or a drafter directory (its target_layer_ids); None: no tap functions.
    A DFlash / DFlash2 drafter directory (config.json architectures DFlashDraftModel / DFlash2DraftModel)
    compiles as a drafter artifact instead (compile/dflash/build.py).
    max_prefill_chunk: the most tokens one prefill call takes (default DEFAULT_MAX_ROWS); the chunk
    functions' memory is planned for it once (compile/memory_bounds.py) and the engine's prefill_chunk may
    not exceed it (manifest extras.max_prefill_chunk).
    progress: bars for the library build, the weight conversion and the shard writes."""
    model_dir = Path(model_dir)
    from .dflash.config import is_drafter_config, parse_tap_layers, read_raw_config

    if is_drafter_config(read_raw_config(model_dir)):
        if tap_layers is not None or rope_overrides and any(v is not None for v in rope_overrides.values()) \
                or kv_dtype is not None or kv_hadamard or fp4_mma not in (None, "auto", "off", False) \
                or fp4_qk not in (None, "auto", "off", False):
            raise ConfigError(f"{model_dir} is a DFlash drafter: --tap-layers, --kv-dtype, --kv-hadamard, --fp4-mma, --fp4-qk "
                              "and rope overrides apply to target models only")
        from .dflash.build import compile_drafter

        return compile_drafter(model_dir, target=target, quant=quant, out_dir=out_dir, name=name,
                               random_weights=random_weights, max_prefill_chunk=max_prefill_chunk, log=log)
    cfg = load_config(model_dir)
    taps = parse_tap_layers(tap_layers, cfg.num_hidden_layers) if tap_layers is not None else ()
    vcfg = load_vision_config(model_dir) if vision else None
    tspec = parse_target(target)
    if quant not in QUANT_MODES:
        raise ConfigError(f"--quant {quant!r} is not supported; use one of {sorted(QUANT_MODES)}")
    dtype, weight_quant = QUANT_MODES[quant]
    dtype = dtype or ("bfloat16" if tspec.kind == "cuda" else "float32")
    if fp4_mma in (None, "auto"):
        use_fp4_mma = fp4_mma_default(tspec, weight_quant)
    elif fp4_mma in (True, False, "on", "off"):
        use_fp4_mma = fp4_mma in (True, "on")
    else:
        raise ConfigError(f"--fp4-mma {fp4_mma!r}: use on or off")
    if use_fp4_mma and not fp4_mma_default(tspec, weight_quant):
        raise ConfigError("--fp4-mma on needs --target cuda:sm_120 and --quant nvfp4")
    if kv_dtype is not None and kv_dtype not in KV_DTYPES:
        raise ConfigError(f"--kv-dtype {kv_dtype!r} is not supported; use one of {sorted(KV_DTYPES)}")
    kv = KV_DTYPES[kv_dtype] if kv_dtype else dtype
    from .kernels.cuda.registry import fp4_qk_default

    qk_possible = tspec.kind == "cuda" and fp4_qk_default(tspec.arch, kv)
    if fp4_qk in (None, "auto"):
        use_fp4_qk = qk_possible
    elif fp4_qk in (True, False, "on", "off"):
        use_fp4_qk = fp4_qk in (True, "on")
    else:
        raise ConfigError(f"--fp4-qk {fp4_qk!r}: use on or off")
    if use_fp4_qk and not qk_possible:
        raise ConfigError("--fp4-qk on needs --target cuda:sm_120 and --kv-dtype nvfp4")
    if kv == "nvfp4" and cfg.head_dim % 16:
        raise ConfigError(f"--kv-dtype nvfp4 needs head_dim % 16 == 0 (head_dim is {cfg.head_dim})")
    if kv != dtype and tspec.kind not in ("llvm", "cuda"):
        raise ConfigError(f"--kv-dtype {kv_dtype} is only implemented for --target llvm and cuda so far")
    if kv_hadamard and cfg.head_dim & (cfg.head_dim - 1):
        raise ConfigError(f"--kv-hadamard needs a power-of-two head_dim (head_dim is {cfg.head_dim})")
    inv_freq, factor, rope_info = rope_tables_for(cfg, rope_overrides or {})
    limit = rope_info["max_context"]
    max_context = int(max_context or min(limit, cfg.max_position_embeddings))
    if max_context < 1:
        raise ConfigError("--max-context must be positive")
    max_rows = int(DEFAULT_MAX_ROWS if max_prefill_chunk is None else max_prefill_chunk)
    if max_rows < 1:
        raise ConfigError("--max-prefill-chunk must be positive")
    if max_context > limit:
        raise ConfigError(f"--max-context {max_context} exceeds what the rope setup supports ({limit}); "
                          "raise --rope-scaling-factor")
    name = name or f"{model_dir.name}-{quant}-{tspec.name}" + ("-random" if random_weights is not None else "")
    out = Path(out_dir or Path("dist") / name)
    weight_files: list = []
    if random_weights is None:
        try:
            weight_files = safetensors_io.weight_files(model_dir)
        except safetensors_io.SafetensorsError as e:
            raise ConfigError(str(e)) from None
        if not weight_files:
            raise ConfigError(f"{model_dir} has no *.safetensors weights (--random-weights builds a benchmark "
                              "artifact from config.json alone)")
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.time()
    lib_rel = f"{name}.so"
    # MTP head: config asks for it and the checkpoint carries mtp.* (transformers-saved checkpoints drop it)
    names = [n for f in weight_files for n in safetensors_io.read_header(f)[0]]
    mtp = cfg.mtp_num_hidden_layers >= 1 and (random_weights is not None or checkpoint_has_mtp(names))
    if vcfg is not None and (random_weights is not None or not has_vision_weights(names)):
        vcfg = None  # a VLM config whose checkpoint was saved text-only (or a text-only benchmark artifact)
    with progress.step(f"build {tspec.name} library"):
        specs = build_library(cfg, dtype, tspec, out / lib_rel, kv, kv_hadamard, mtp=mtp, weight_quant=weight_quant,
                              fp4_mma=use_fp4_mma, multimodal=vcfg is not None, tap_layers=taps, max_rows=max_rows,
                              fp4_qk=use_fp4_qk)
    log(f"built {tspec.name} library in {time.time() - t0:.1f}s")

    t1 = time.time()
    vision_section = None
    if random_weights is None:
        np_dt = {d: _np_dtype(d) for d in ("float32", "bfloat16")}
        tensors = safetensors_io.load_dir(model_dir)
        vision_section = compile_vision(vcfg, tensors, tspec, dtype, out, log) if vcfg is not None else None
        params = hf_to_params(tensors, cfg, specs, (inv_freq, factor),
                              cast=lambda a, dt: a if a.dtype == np_dt.get(dt, np.dtype(dt)) else
                              np.asarray(a, dtype=np.float32).astype(np_dt.get(dt, np.dtype(dt))),
                              track=progress.iterate)
    else:  # only the exact tables; the runtime draws the rest
        params = {"rope_inv_freq": np.asarray(inv_freq, np.float32), "rope_attn_factor": np.array([factor], np.float32)}
    shards = write_weights(params, out, progress)
    log(f"wrote {len(params)} weights into {len(shards)} shard(s) in {time.time() - t1:.1f}s"
        + (f" (random weights, seed {random_weights}: drawn at load time)" if random_weights is not None else ""))
    for f in TOKENIZER_FILES:
        if (model_dir / f).is_file():
            shutil.copy2(model_dir / f, out / f)
    for tpl in sorted((model_dir / EXTRA_TEMPLATES).glob("*.jinja")):
        (out / EXTRA_TEMPLATES).mkdir(exist_ok=True)
        shutil.copy2(tpl, out / EXTRA_TEMPLATES / tpl.name)

    import tvm

    write_manifest(out, Manifest(
        name=name, config=cfg.to_dict(), target=tspec.name, dtype=dtype, kv_dtype=kv, page_size=PAGE_SIZE,
        max_context=max_context, library=lib_rel, params=specs, weight_shards=shards,
        tvm_version=tvm.__version__, rope=rope_info,
        extras={"kv_hadamard": bool(kv_hadamard), "mtp": bool(mtp), "weight_quant": weight_quant or dtype,
                # the shortlisted MTP head runs in device rounds (mtp_head_build / mtp_step_hd / mtp_prefill_hd)
                "mtp_head_draft": bool(mtp),
                "fp4_mma": bool(use_fp4_mma), "fp4_qk": bool(use_fp4_qk), "device_sampler": SAMPLER_ABI_VERSION,
                "max_prefill_chunk": max_rows,
                # every kernel opens with griddepcontrol.wait (compile/grid_dependency.py): graphs may use PDL edges
                "grid_dependency_wait": tspec.kind == "cuda" and grid_dependency.arch_supports(tspec.arch),
                **({"tap_layers": list(taps)} if taps else {}),
                **({"random_weights": {"seed": int(random_weights)}} if random_weights is not None else {}),
                **({"vision": vision_section} if vision_section else {})},
    ))
    log(f"wrote {out}")
    return out


def describe(out: Path) -> str:
    return json.dumps(json.loads((out / "manifest.json").read_text())["files"], indent=1)
