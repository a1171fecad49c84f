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
        # limits common to sm_90 and sm_120 (48 KiB static shared memory per block)
        return Target({"kind": "cuda", "arch": self.arch, "max_shared_memory_per_block": 49152,
                       "max_threads_per_block": 1024, "thread_warp_size": 32}, host={"kind": "llvm"})

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


_CUDA_RUNTIME_LOADED = False


def _load_cuda_runtime(stub_dir: Path) -> None:
    """Make `ffi.Module.create.cuda` exist in this process, whether or not a GPU is present.

    `import tvm` tries to load libtvm_runtime_cuda.so and silently gives up when libcuda.so.1 is
    missing; codegen then embeds raw CUDA source. We load a stub libcuda.so.1 RTLD_GLOBAL first
    (so the dynamic linker resolves the runtime's driver symbols against it), then load the TVM
    CUDA runtime by hand, after tvm was imported (tvm_probe.md Q3/Q4). Once per process.
    """
    global _CUDA_RUNTIME_LOADED
    import ctypes

    import tvm
    import tvm_ffi

    if _CUDA_RUNTIME_LOADED or tvm_ffi.get_global_func("ffi.Module.create.cuda", allow_missing=True) is not None:
        _CUDA_RUNTIME_LOADED = True
        return
    try:  # a real driver (GPU machine) wins over the stub
        ctypes.CDLL("libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
    except OSError:
        src = stub_dir / "stub.c"
        src.write_text(_STUB_SRC)
        subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub_dir / "libcuda.so.1"), str(src)], check=True)
        ctypes.CDLL(str(stub_dir / "libcuda.so.1"), mode=ctypes.RTLD_GLOBAL)
    from tvm_ffi.libinfo import load_lib_ctypes

    tvm.base._LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(
        "tvm", "tvm_runtime_cuda", "RTLD_LOCAL", extra_lib_paths=tvm.libinfo.package_lib_paths())
    if tvm_ffi.get_global_func("ffi.Module.create.cuda", allow_missing=True) is None:
        raise TargetError("libtvm_runtime_cuda.so loaded but registered no CUDA module loader")
    _CUDA_RUNTIME_LOADED = True


@contextmanager
def cuda_build_env(target):
    """Let TVM compile cubins with nvcc on a machine without a GPU.

    libtvm_runtime_cuda.so needs a libcuda.so.1 to load; without it TVM silently embeds raw CUDA
    source that only a full compiler install can JIT. A stub library (loaded before the TVM CUDA
    runtime), nvcc mode and an open target scope make codegen emit real fatbins.
    """
    if shutil.which("nvcc") is None:
        raise TargetError("CUDA targets need nvcc on PATH (CUDA 12.8+ for sm_120)")
    tmp = Path(tempfile.mkdtemp(prefix="ninfer_cudastub_"))
    old = {k: os.environ.get(k) for k in ("TVM_CUDA_COMPILE_MODE", "CUDA_PATH")}
    os.environ["TVM_CUDA_COMPILE_MODE"] = "nvcc"
    if old["CUDA_PATH"] is None and Path("/usr/local/cuda/include").is_dir():
        os.environ["CUDA_PATH"] = "/usr/local/cuda"
    try:
        _load_cuda_runtime(tmp)
        with target:
            yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)
