"""Compile targets: parse `--target`, make TVM Target objects, prepare GPU-less CUDA builds.

TVM 0.27 rejects CLI target strings, so targets are dicts. DLight only tensorizes for arch
strings exactly "sm_90"/"sm_120" (no letter suffix), see research/tvm_probe.md Q3.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_CUDA_ARCHES = {"sm_90", "sm_120"}

# Driver symbols libtvm_runtime_cuda.so imports; every stub fails with CUDA_ERROR_NO_DEVICE.
_STUB_SRC = r"""
#define STUB(name) int name(void) { return 100; }
STUB(cuDeviceGetName) STUB(cuFuncSetAttribute) STUB(cuLaunchKernelEx)
STUB(cuModuleGetFunction) STUB(cuModuleLoadData) STUB(cuModuleUnload) STUB(cuTensorMapEncodeTiled)
STUB(cuInit) STUB(cuDriverGetVersion) STUB(cuGetProcAddress) STUB(cuGetProcAddress_v2)
int cuGetErrorName(int e, const char** s) { *s = "CUDA_ERROR_STUB"; return 0; }
int cuGetErrorString(int e, const char** s) { *s = "stub libcuda (no GPU)"; return 0; }
"""


class TargetError(ValueError):
    pass


@dataclass(frozen=True)
class TargetSpec:
    kind: str  # "llvm" | "cuda"
    arch: str = ""  # sm_90 / sm_120 for cuda

    @property
    def name(self) -> str:
        return self.kind if self.kind == "llvm" else f"cuda-{self.arch}"

    def tvm_target(self):
        from tvm.target import Target

        if self.kind == "llvm":
            return Target({"kind": "llvm"})
        return Target({"kind": "cuda", "arch": self.arch}, host={"kind": "llvm"})

    @property
    def device_type(self) -> str:
        return "cpu" if self.kind == "llvm" else "cuda"


def parse_target(text: str) -> TargetSpec:
    t = text.strip().lower()
    if t in ("llvm", "cpu"):
        return TargetSpec("llvm")
    if t.startswith("cuda:"):
        arch = t.split(":", 1)[1]
        if arch not in _CUDA_ARCHES:
            raise TargetError(f"--target {text!r}: CUDA arch must be one of {sorted(_CUDA_ARCHES)}")
        return TargetSpec("cuda", arch)
    raise TargetError(f"--target {text!r} is not supported; use llvm, cuda:sm_90 or cuda:sm_120")


@contextmanager
def cuda_build_env(target):
    """Let TVM compile cubins with nvcc on a machine without a GPU.

    libtvm_runtime_cuda.so needs a libcuda.so.1 to load; without it TVM silently embeds raw CUDA
    source that only a full compiler install can JIT. A stub library, nvcc mode and an open
    target scope make codegen emit real fatbins.
    """
    if shutil.which("nvcc") is None:
        raise TargetError("CUDA targets need nvcc on PATH (CUDA 12.8+ for sm_120)")
    tmp = Path(tempfile.mkdtemp(prefix="ninfer_cudastub_"))
    src = tmp / "stub.c"
    src.write_text(_STUB_SRC)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp / "libcuda.so.1"), str(src)], check=True)
    old = {k: os.environ.get(k) for k in ("LD_LIBRARY_PATH", "TVM_CUDA_COMPILE_MODE")}
    os.environ["TVM_CUDA_COMPILE_MODE"] = "nvcc"
    os.environ["LD_LIBRARY_PATH"] = f"{tmp}:{old['LD_LIBRARY_PATH'] or ''}"
    import ctypes

    ctypes.CDLL(str(tmp / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
    try:
        with target:
            yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)
