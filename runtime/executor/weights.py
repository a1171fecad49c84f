"""Load an artifact's parameters onto the device, in the order its library takes them.

Weights come from the artifact's shards; a random-weights benchmark artifact has only its exact
tables there and the rest is drawn on the device (random_weights.py). Shared by the target's runner
and the DFlash drafter's."""
from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np

from ...contract import safetensors_io
from ...contract.manifest import Manifest


def np_dtype(dt: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(dt)


def load_params(manifest: Manifest, art_dir: Path, dev, tvm) -> tuple[list, int, bool]:
    """(device tensors in call order, their bytes, whether they were drawn at random)."""
    m = manifest
    arrays: dict[str, np.ndarray] = {}
    for rel in m.weight_shards:
        arrays.update(safetensors_io.load(art_dir / rel))
    drawn: dict = {}
    random_weights = bool(m.extras.get("random_weights"))
    if random_weights:
        from .random_weights import generate

        drawn = generate(m.params, set(arrays), int(m.extras["random_weights"].get("seed", 0)), dev, tvm)
    out = []
    nbytes = 0
    for name, shape, dtype in m.params:
        a = arrays.get(name)
        if a is None and name in drawn:
            nbytes += int(np.prod(shape)) * np_dtype(dtype).itemsize
            out.append(drawn[name])
            continue
        if a is None:
            raise RuntimeError(f"{art_dir}: weight {name} missing from the shards")
        if list(a.shape) != list(shape):
            raise RuntimeError(f"{art_dir}: weight {name} has shape {a.shape}, library expects {shape}")
        nbytes += a.nbytes
        out.append(tvm.runtime.tensor(np.ascontiguousarray(a), dev))
    return out, nbytes, random_weights
