"""Where the prebuilt libraries live: dist/ beside the package (editable install) or $NINFER_DIST."""
from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "qwen3x-tiny"


def dist_dir() -> Path:
    env = os.environ.get("NINFER_DIST")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "dist"


def default_model_dir() -> Path:
    return dist_dir() / DEFAULT_MODEL_NAME
