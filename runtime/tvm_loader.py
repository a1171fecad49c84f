"""Import TVM for serving and load a compiled library into a Relax VM.

Serving needs only the TVM runtime. With TVM_USE_RUNTIME_LIB=1 (the GPU bundle) backend
libraries are not auto-loaded, so the CUDA runtime library is loaded by hand.
"""
from __future__ import annotations

import os


def import_tvm(device_kind: str):
    os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))
    import tvm

    if device_kind == "cuda" and getattr(tvm.base, "_RUNTIME_ONLY", False) and "tvm_runtime_cuda" not in tvm.base._LOADED_LIBS:
        from tvm_ffi.libinfo import load_lib_ctypes

        tvm.base._LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(
            "tvm", "tvm_runtime_cuda", "RTLD_LOCAL", extra_lib_paths=tvm.libinfo.package_lib_paths())
    return tvm


def device_for(tvm, kind: str, index: int = 0):
    dev = tvm.cpu(index) if kind == "cpu" else tvm.cuda(index)
    if not dev.exist:
        raise RuntimeError(f"device {kind}:{index} is not available")
    return dev


def load_vm(tvm, lib_path: str | os.PathLike, dev):
    from tvm.runtime.vm import VirtualMachine

    lib = tvm.runtime.load_module(str(lib_path))
    return VirtualMachine(lib, dev)
