"""Compile targets: parse `--target`, make TVM Target objects, prepare GPU-less CUDA builds.

TVM 0.27 rejects CLI target strings, so targets are dicts. DLight only tensorizes for arch
strings exactly "sm_90"/"sm_120" (no letter suffix), see research/tvm_probe.md Q3.

nvcc arch vs TVM arch: TVM 0.27 compiles a CUDA module through the global func
`tvm_callback_cuda_compile(code)` (tvm/support/nvcc.py), which derives `-gencode
arch=compute_XX,code=sm_XX` from the TVM target arch. For cuda:sm_120 the NVFP4 MMA kernel
(compile/kernels/cuda/fp4_mma.py) uses `mma.sync ... kind::mxf4nvf4.block_scale`, which ptxas
accepts only for the arch-specific sm_120a. So while a build is inside `cuda_build_env`, that
callback is replaced by one that passes `-gencode arch=compute_120a,code=sm_120a` (NVCC_ARCH) and
the TVM target arch stays "sm_120" (DLight's WMMA rules and our schedule file key on it). The
library then carries one sm_120a cubin (runs on CC 12.0 only, i.e. RTX 50xx / RTX PRO 6000
Blackwell; no PTX for JIT). Likewise cuda:sm_90 compiles for sm_90a (H100 / H200 / GH200 only): the
prefill GEMM (compile/kernels/cuda/gemm_sm90.py) issues wgmma, which exists only there.
Set NINFER_CUDA_SOURCE_DIR=dir to keep a copy of every generated CUDA source there
(`<arch>-<sha256[:12]>.cu`, e.g. to grep for `kind::mxf4nvf4`).
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
# TVM target arch -> nvcc gencode arch where they differ (the FP4 MMA needs the 'a' variant)
NVCC_ARCH = {"sm_120": "sm_120a", "sm_90": "sm_90a"}
SOURCE_DIR_ENV = "NINFER_CUDA_SOURCE_DIR"

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


def nvcc_arch(arch: str) -> str:
    """The sm_XX[a] nvcc compiles a TVM target arch for (sm_120 -> sm_120a)."""
    return NVCC_ARCH.get(arch, arch)


def _compile_callback(arch: str):
    """tvm_callback_cuda_compile replacement: nvcc fatbin for nvcc_arch(arch), every kernel opening with the
    grid-dependency wait on sm_90+ (compile/grid_dependency.py), and a copy of the CUDA source under
    $NINFER_CUDA_SOURCE_DIR when set."""
    import hashlib

    from tvm.support import nvcc

    from . import grid_dependency

    suffix = nvcc_arch(arch)[3:]
    gencode = ["-gencode", f"arch=compute_{suffix},code=sm_{suffix}"]

    def compile_cuda(code, *_rest):
        if grid_dependency.arch_supports(arch):
            from .kernels.cuda.registry import kernel_params

            gd = kernel_params(arch)["grid_dependency"]
            code = grid_dependency.inject(code, gd["trigger"], tuple(gd["exit_kernels"]))
        dump = os.environ.get(SOURCE_DIR_ENV)
        if dump:
            Path(dump).mkdir(parents=True, exist_ok=True)
            digest = hashlib.sha256(code.encode()).hexdigest()[:12]
            (Path(dump) / f"{nvcc_arch(arch)}-{digest}.cu").write_text(code)
        return nvcc.compile_cuda(code, target_format="fatbin", arch=gencode, compiler="nvcc")

    return compile_cuda


@contextmanager
def cuda_build_env(target):
    """Let TVM compile cubins with nvcc on a machine without a GPU.

    libtvm_runtime_cuda.so needs a libcuda.so.1 to load; without it TVM silently embeds raw CUDA
    source that only a full compiler install can JIT. A stub library (loaded before the TVM CUDA
    runtime), nvcc mode and an open target scope make codegen emit real fatbins. For the duration,
    `tvm_callback_cuda_compile` is our nvcc call (gencode from NVCC_ARCH, optional source dump);
    the previous callback is restored afterwards.
    """
    import tvm_ffi

    if shutil.which("nvcc") is None:
        raise TargetError("CUDA targets need nvcc on PATH (CUDA 12.8+ for sm_120)")
    tmp = Path(tempfile.mkdtemp(prefix="ninfer_cudastub_"))
    old = {k: os.environ.get(k) for k in ("TVM_CUDA_COMPILE_MODE", "CUDA_PATH")}
    os.environ["TVM_CUDA_COMPILE_MODE"] = "nvcc"
    if old["CUDA_PATH"] is None and Path("/usr/local/cuda/include").is_dir():
        os.environ["CUDA_PATH"] = "/usr/local/cuda"
    prev_cb = None
    try:
        _load_cuda_runtime(tmp)
        import tvm.support.nvcc  # noqa: F401 - registers the default callback we replace

        arch = str(getattr(target, "arch", "") or "")
        if arch.startswith("sm_"):
            prev_cb = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
            tvm_ffi.register_global_func("tvm_callback_cuda_compile", _compile_callback(arch), override=True)
        with target:
            yield
    finally:
        if prev_cb is not None:
            tvm_ffi.register_global_func("tvm_callback_cuda_compile", prev_cb, override=True)
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(tmp, ignore_errors=True)
