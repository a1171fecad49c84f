"""Build a relax module into a shared library, reusing a cached copy of identical builds.

NINFER_LIB_CACHE=DIR keeps one `<key>.so` per build key (geometry, dtypes, target, TVM version and
the compiler sources hashed by the caller), so test suites and repeated compiles build once.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from .targets import TargetSpec, cuda_build_env


def build_cached(mod, target: TargetSpec, lib_path: Path, key: str) -> None:
    """Our build pipelines (CUDA: DLight + our kernels under the stub-driver env; llvm: the CPU schedules of
    compile/cpu_pipeline.py) -> lib_path."""
    cache = os.environ.get("NINFER_LIB_CACHE")
    cached = Path(cache) / f"{key}.so" if cache else None
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    if cached is not None and cached.is_file():
        shutil.copy2(cached, lib_path)
        return
    tgt = target.tvm_target()
    if target.kind == "cuda":
        from .gpu_pipeline import build_cuda

        with cuda_build_env(tgt):
            ex = build_cuda(mod, tgt)
    else:
        from .cpu_pipeline import build_llvm

        ex = build_llvm(mod, tgt)
    ex.export_library(str(lib_path))
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        shutil.copy2(lib_path, tmp)
        os.replace(tmp, cached)
