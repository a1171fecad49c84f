"""The CUDA driver API through ctypes (libcuda.so.1): no torch, no cudart binding needed.

Each user declares the entry points it calls (name -> argument types, all returning CUresult); `call`
raises CudaError with the driver's message on a non-zero result. CUDA graphs (cuda_graph.py) and the host
tier's bulk copies (bulk_copy.py) use it.
"""
from __future__ import annotations

import ctypes
from typing import Optional


class CudaError(RuntimeError):
    pass


class Driver:
    def __init__(self, calls: dict, optional: Optional[dict] = None):
        """calls: entry points that must exist; optional: ones a driver may lack (listed in self.missing)."""
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._declare({"cuGetErrorString": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)], **calls}, required=True)
        self.missing = self._declare(optional or {}, required=False)

    def _declare(self, calls: dict, required: bool) -> list[str]:
        missing = []
        for name, args in calls.items():
            fn = getattr(self.lib, name) if required else getattr(self.lib, name, None)
            if fn is None:
                missing.append(name)
                continue
            fn.argtypes, fn.restype = args, ctypes.c_int
        return missing

    def check(self, rc: int, what: str) -> None:
        if rc:
            msg = ctypes.c_char_p()
            self.lib.cuGetErrorString(rc, ctypes.byref(msg))
            raise CudaError(f"{what}: CUDA error {rc} ({(msg.value or b'?').decode()})")

    def call(self, name: str, *args) -> None:
        self.check(getattr(self.lib, name)(*args), name)

