"""Host-to-device copies of the small arrays a step stages, without the per-call overhead of
`Tensor.copyfrom` (dtype and layout checks, `ctypes.data_as`: ~35-55 us a call on a slow host core, four
to six calls per decode step, all of it in the device's idle gap between overlapped steps). The copy
is TVM's own (`TVMTensorCopyFromBytes`, which waits for the device like `copyfrom`); only the Python
wrapper is skipped, so the caller hands a C-contiguous array of exactly the view's size.

`HostRead` is the other direction for a speculative round's reads (target ids, drafts, hidden rows):
`Tensor.numpy()` spends ~20 us a call on dtype handling before TVM's `TVMTensorCopyToBytes`; this ~5 us.
"""
from __future__ import annotations

import ctypes
import math

import numpy as np


class HostCopy:
    def __init__(self, tvm):
        ffi = getattr(tvm.runtime, "_ffi_api", None)
        self._copy = getattr(ffi, "TVMTensorCopyFromBytes", None)  # None: a TVM without it, use copyfrom

    def __call__(self, dst, src: np.ndarray, itemsize: int) -> None:
        """Copy src (C-contiguous, dst's element size and element count) into the device tensor dst."""
        if not src.flags.c_contiguous or src.itemsize != itemsize or src.size != math.prod(dst.shape):
            raise ValueError(f"host array {src.dtype} {list(src.shape)} does not fill the device view "
                             f"{dst.dtype} {list(dst.shape)}")
        if self._copy is None:
            dst.copyfrom(src.reshape(tuple(dst.shape)))
            return
        self._copy(dst, ctypes.c_void_p(src.ctypes.data), src.nbytes)


_PLAIN = {"int32": np.int32, "float32": np.float32, "int64": np.int64, "float64": np.float64}


class HostRead:
    def __init__(self, tvm):
        ffi = getattr(tvm.runtime, "_ffi_api", None)
        self._read = getattr(ffi, "TVMTensorCopyToBytes", None)  # None: a TVM without it, use numpy()

    def __call__(self, src) -> np.ndarray:
        """A new host array holding the device tensor src (waits for the device, as Tensor.numpy())."""
        dt = _PLAIN.get(str(src.dtype))
        if dt is None or self._read is None:
            return src.numpy()
        out = np.empty(tuple(src.shape), dt)
        self._read(src, ctypes.c_void_p(out.ctypes.data), out.nbytes)
        return out
