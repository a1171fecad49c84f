"""Minimal safetensors reader/writer on numpy with bf16/fp8 through ml_dtypes.

The `safetensors` numpy API has no bfloat16; HF checkpoints are mostly bf16, so both the
converter and the runtime read the format directly (memory-mapped, zero-copy).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.dtype("float64"), "F32": np.dtype("float32"), "F16": np.dtype("float16"),
    "BF16": np.dtype(ml_dtypes.bfloat16), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2), "I64": np.dtype("int64"), "I32": np.dtype("int32"),
    "I16": np.dtype("int16"), "I8": np.dtype("int8"), "U8": np.dtype("uint8"), "BOOL": np.dtype("bool"),
}
_NAMES = {v: k for k, v in _DTYPES.items()}


class SafetensorsError(ValueError):
    pass


def read_header(path: str | Path) -> tuple[dict, int]:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path}: truncated safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 1024 * 1024:
            raise SafetensorsError(f"{path}: implausible header size {n}")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise SafetensorsError(f"{path}: corrupt header ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def load(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of one file as read-only memory-mapped arrays."""
    header, base = read_header(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out = {}
    for name, info in header.items():
        dt = _DTYPES.get(info["dtype"])
        if dt is None:
            raise SafetensorsError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        a, b = info["data_offsets"]
        if base + b > mm.size:
            raise SafetensorsError(f"{path}: tensor {name} runs past the end of the file")
        out[name] = mm[base + a: base + b].view(dt).reshape(info["shape"])
    return out


def save(path: str | Path, tensors: dict[str, np.ndarray], metadata: dict | None = None) -> None:
    header: dict = {}
    off = 0
    arrays = []
    for name, arr in tensors.items():
        arr = np.ascontiguousarray(arr)
        if arr.dtype not in _NAMES:
            raise SafetensorsError(f"cannot store dtype {arr.dtype} for {name}")
        header[name] = {"dtype": _NAMES[arr.dtype], "shape": list(arr.shape), "data_offsets": [off, off + arr.nbytes]}
        off += arr.nbytes
        arrays.append(arr)
    if metadata:
        header["__metadata__"] = {k: str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for arr in arrays:
            f.write(arr.tobytes())


INDEX = "model.safetensors.index.json"


def indexed_files(model_dir: str | Path) -> list[str]:
    """The shard names `model.safetensors.index.json` maps weights to ([] when there is no index)."""
    path = Path(model_dir) / INDEX
    if not path.is_file():
        return []
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        return sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SafetensorsError(f"{path}: not a safetensors index ({type(e).__name__}: {e})") from None


def weight_files(model_dir: str | Path) -> list[Path]:
    """A checkpoint's weight files: the shards its index names (a repo may also hold other
    *.safetensors, e.g. a consolidated copy), else every *.safetensors in the directory."""
    model_dir = Path(model_dir)
    names = indexed_files(model_dir)
    if not names:
        return sorted(model_dir.glob("*.safetensors"))
    missing = [n for n in names if not (model_dir / n).is_file()]
    if missing:
        raise SafetensorsError(f"{model_dir}: shards named in {INDEX} are missing: {', '.join(missing[:4])}")
    return [model_dir / n for n in names]


def load_dir(model_dir: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory (HF sharded checkpoints: the shards of the index)."""
    files = weight_files(model_dir)
    if not files:
        raise SafetensorsError(f"no *.safetensors files in {model_dir}")
    out: dict[str, np.ndarray] = {}
    for f in files:
        out.update(load(f))
    return out
