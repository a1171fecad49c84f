"""Build a relax module into a shared library, reusing a cached copy of identical builds.

NINFER_LIB_CACHE=DIR keeps one library per build key (compile/libcache.py: geometry, dtypes, target, TVM
version and the syntax trees of the compiler code), so test suites and repeated compiles build once; a hit
skips the module export as well.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from . import libcache
from .targets import TargetSpec, cuda_build_env


def build(mod, target: TargetSpec, lib_path: Path) -> None:
    """Our build pipelines (CUDA: DLight + our kernels under the stub-driver env; llvm: the CPU schedules of
    compile/cpu_pipeline.py) -> lib_path."""
    tgt = target.tvm_target()
    if target.kind == "cuda":
        from .gpu_pipeline import build_cuda

        with cuda_build_env(tgt):
            ex = build_cuda(mod, tgt)
    else:
        from .cpu_pipeline import build_llvm

        ex = build_llvm(mod, tgt)
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    ex.export_library(str(lib_path))


def build_cached(target: TargetSpec, lib_path: Path, key: str, export: Callable[[], tuple]) -> list:
    """The library of build key `key` at lib_path: copied from the cache, or export() -> (relax module,
    parameter list [(name, shape, dtype)]) built and cached. Returns the parameter list."""
    specs = libcache.fetch(key, lib_path)
    if specs is not None:
        return specs
    mod, specs = export()
    build(mod, target, lib_path)
    libcache.store(key, lib_path, specs)
    return specs
