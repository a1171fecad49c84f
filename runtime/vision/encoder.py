"""Run the compiled vision tower: images -> one embedding row per merged patch (the LM's width, fp32).

The artifact (manifest extras["vision"], written by compile/vision_build.py) carries an llvm library
and, for CUDA artifacts, a CUDA one. `VisionEncoder(art, manifest, "cpu")` is `--vision-cpu`: fp32
weights in host RAM, the ViT on the host threads; "cuda" keeps its weights on the GPU in the
library's dtype. Images of one call are packed into few library calls (attention stays within each
image via cu_seqlens); counters feed /stats.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from ...contract import safetensors_io
from .image_processing import PreparedImage, ProcessorSettings
from ..tvm_loader import device_for, import_tvm, load_vm
from .inputs import vision_tables

MAX_PATCHES_PER_CALL = 1 << 16  # several small images share a call; a big one gets its own


class VisionUnavailable(RuntimeError):
    pass


VISION_MODES = ("auto", "cpu", "off")


def open_vision(runner, mode: str = "auto") -> "VisionEncoder | None":
    """The encoder for a runner's artifact: "auto" = on the runner's device when the artifact has a library
    for it (else the host), "cpu" = `--vision-cpu`, "off" = none. None when the artifact has no tower."""
    if mode not in VISION_MODES:
        raise ValueError(f"vision mode must be one of {VISION_MODES}, got {mode!r}")
    section = vision_section(runner.manifest)
    if mode == "off" or section is None:
        return None
    device = "cuda" if mode == "auto" and runner.device_kind == "cuda" and "cuda" in section["libraries"] else "cpu"
    return VisionEncoder(runner.art_dir, runner.manifest, device, getattr(runner.dev, "index", 0) if device == "cuda"
                         else 0)


def vision_section(manifest) -> dict | None:
    return (manifest.extras or {}).get("vision")


class VisionEncoder:
    def __init__(self, art_dir: str | Path, manifest, device: str = "cpu", device_index: int = 0):
        section = vision_section(manifest)
        if section is None:
            raise VisionUnavailable(f"{manifest.name} has no vision tower (compile a Qwen3_5ForConditionalGeneration "
                                    "checkpoint that carries model.visual.* weights)")
        lib = section["libraries"].get(device)
        if lib is None:
            raise VisionUnavailable(f"{manifest.name} has no vision library for {device!r} "
                                    f"(has {sorted(section['libraries'])})")
        self.config = section["config"]
        self.settings = ProcessorSettings.from_vision_config(self.config)
        self.device_kind = device
        self.dtype = lib["dtype"]
        art_dir = Path(art_dir)
        t0 = time.time()
        self.tvm = import_tvm(device)
        self.dev = device_for(self.tvm, device, device_index)
        self.vm = load_vm(self.tvm, art_dir / lib["library"], self.dev)
        self.params, self.weights_bytes = self._load_params(art_dir, section)
        self.load_seconds = time.time() - t0
        self._lock = threading.Lock()  # one library call at a time (server threads and the engine thread)
        self.stats = {"images_encoded": 0, "patches_encoded": 0, "calls": 0, "encode_seconds_total": 0.0,
                      "encode_ms_last": 0.0, "encode_ms_max": 0.0}

    def _load_params(self, art_dir: Path, section: dict):
        import ml_dtypes

        arrays: dict[str, np.ndarray] = {}
        for rel in section["weight_shards"]:
            arrays.update(safetensors_io.load(art_dir / rel))
        np_dt = np.dtype(ml_dtypes.bfloat16) if self.dtype == "bfloat16" else np.dtype(self.dtype)
        out, total = [], 0
        for name, shape, _ in section["params"]:
            a = arrays.get(name)
            if a is None or list(a.shape) != list(shape):
                raise RuntimeError(f"{art_dir}: vision weight {name} missing or of the wrong shape")
            a = np.ascontiguousarray(a.astype(np_dt))
            total += a.nbytes
            out.append(self.tvm.runtime.tensor(a, self.dev))
        return out, total

    @property
    def merge(self) -> int:
        return int(self.config["spatial_merge_size"])

    @property
    def out_dim(self) -> int:
        return int(self.config["out_hidden_size"])

    def encode(self, images: list[PreparedImage]) -> list[np.ndarray]:
        """[tokens_k, out_hidden] fp32 per image, in order."""
        out: list[np.ndarray] = []
        group: list[PreparedImage] = []
        for img in images:
            if group and sum(g.num_patches for g in group) + img.num_patches > MAX_PATCHES_PER_CALL:
                out.extend(self._call(group))
                group = []
            group.append(img)
        if group:
            out.extend(self._call(group))
        return out

    def _call(self, images: list[PreparedImage]) -> list[np.ndarray]:
        c = self.config
        tables = vision_tables([img.grid for img in images], self.merge, int(round(c["num_position_embeddings"] ** 0.5)),
                               int(c["hidden_size"]) // int(c["num_heads"]), float(c["rope_theta"]))
        patches = np.concatenate([img.patches for img in images])
        tensor = self.tvm.runtime.tensor
        args = [tensor(np.ascontiguousarray(patches, np.float32), self.dev)] + [
            tensor(tables[k], self.dev) for k in ("interp_idx", "interp_w", "rope_cos", "rope_sin", "cu_seqlens", "seg")]
        with self._lock:
            t0 = time.perf_counter()
            emb = self.vm["encode"](*args, self.params).numpy()
            dt = time.perf_counter() - t0
            s = self.stats
            s["images_encoded"] += len(images)
            s["patches_encoded"] += int(patches.shape[0])
            s["calls"] += 1
            s["encode_seconds_total"] += dt
            s["encode_ms_last"] = dt * 1000
            s["encode_ms_max"] = max(s["encode_ms_max"], dt * 1000)
        sizes = np.cumsum([img.num_tokens(self.merge) for img in images])[:-1]
        return np.split(emb, sizes)

    def note(self, **counts) -> None:
        """Add request-side counters (images, fetch / preprocess time) to the /stats section."""
        with self._lock:
            for k, v in counts.items():
                self.stats[k] = self.stats.get(k, 0) + v

    def snapshot(self) -> dict:
        """/stats: where the tower runs, its memory and its time."""
        with self._lock:
            return {"device": self.device_kind, "dtype": self.dtype, "weights_bytes": self.weights_bytes,
                    "load_seconds": round(self.load_seconds, 3), **{k: (round(v, 3) if isinstance(v, float) else v)
                                                                    for k, v in self.stats.items()}}
