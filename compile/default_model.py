"""Build the embedded default model: generate the tiny HF checkpoint, compile it for llvm into dist/.

`python -m ninfer_mlc.compile.default_model` regenerates dist/qwen3x-tiny (deterministic).
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from ..paths import DEFAULT_MODEL_NAME, dist_dir
from .build import compile_model
from .tiny_default import generate


def build_default(out_dir: Path | None = None, log=print) -> Path:
    out = Path(out_dir or dist_dir() / DEFAULT_MODEL_NAME)
    with tempfile.TemporaryDirectory(prefix="ninfer_tiny_") as tmp:
        hf = generate(Path(tmp) / "qwen3x-tiny")
        return compile_model(hf, target="llvm", quant="f32", out_dir=out, name=DEFAULT_MODEL_NAME, log=log)


if __name__ == "__main__":
    build_default(Path(sys.argv[1]) if len(sys.argv) > 1 else None)
