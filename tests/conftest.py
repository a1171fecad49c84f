"""Shared test setup.

Compiled tiny-model libraries are cached under build/libcache (keyed by geometry, dtype,
target, TVM version and the compiler sources), so a suite run compiles each geometry once.
"""
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("NINFER_LIB_CACHE", str(ROOT / "build" / "libcache"))
os.environ.setdefault("TVM_NUM_THREADS", "2")
