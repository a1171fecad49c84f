"""Host<->device byte copies of the host tier: queued, then waited for once per transfer.

CUDA: the driver API on a copy stream of its own, cuMemcpyDtoHAsync_v2 / cuMemcpyHtoDAsync_v2 between the
tensors' data pointers plus byte offsets (the host tier's buffers are page-locked cuda_host tensors, so each
copy is one DMA at the pinned copy rate) and one cuStreamSynchronize in finish(). TVM's Tensor.copyto is a
synchronous cudaMemcpy on the legacy default stream per call, with Python and view overhead on each.
Elsewhere (the CPU target): TVM copies of byte views.

drain() waits for the device work queued before a transfer: the engine overlaps decode steps, so kernels that
wrote the pages a spill reads, or that still read pages a restore overwrites, may be running. On CUDA it is
cuCtxSynchronize, every stream of the context (the legacy default stream TVM launches on and the graphs'
streams). Callers time it apart from the copies: it is the device finishing compute, not copy time.
"""
from __future__ import annotations

import ctypes
from typing import Callable

from .cuda_driver import Driver

_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: not ordered with the legacy stream (drain() orders the copies)


def _bytes(t, offset: int, nbytes: int):
    return t._create_view((nbytes,), "uint8", offset)


class TvmBulkCopy:
    """Copies through TVM (the CPU target): each one completes before the call returns."""

    def __init__(self, sync: Callable[[], None]):
        self._sync = sync

    def drain(self) -> None:
        self._sync()

    def d2h(self, dev, dev_offset: int, host, host_offset: int, nbytes: int) -> None:
        _bytes(dev, dev_offset, nbytes).copyto(_bytes(host, host_offset, nbytes))

    def h2d(self, host, host_offset: int, dev, dev_offset: int, nbytes: int) -> None:
        _bytes(host, host_offset, nbytes).copyto(_bytes(dev, dev_offset, nbytes))

    def finish(self) -> None:
        self._sync()


class DriverBulkCopy:
    """Asynchronous copies on a dedicated stream (see the module docstring); finish() waits for them."""

    CALLS = {
        "cuStreamCreate": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint],
        "cuStreamSynchronize": [ctypes.c_void_p],
        "cuCtxSynchronize": [],
        "cuMemcpyDtoHAsync_v2": [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p],
        "cuMemcpyHtoDAsync_v2": [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
    }

    def __init__(self, dev, driver: Driver | None = None):
        self.dev = dev
        self.drv = driver or Driver(self.CALLS)
        dev.sync()  # makes TVM's (runtime API) primary context current on this thread
        s = ctypes.c_void_p()
        self.drv.call("cuStreamCreate", ctypes.byref(s), _STREAM_NON_BLOCKING)
        self.stream = s
        lib = self.drv.lib
        self._d2h, self._h2d = lib.cuMemcpyDtoHAsync_v2, lib.cuMemcpyHtoDAsync_v2

    def drain(self) -> None:
        self.dev.sync()  # the primary context current on the calling thread (the engine's, not the constructor's)
        self.drv.call("cuCtxSynchronize")

    def d2h(self, dev, dev_offset: int, host, host_offset: int, nbytes: int) -> None:
        rc = self._d2h(host.data_ptr() + host_offset, dev.data_ptr() + dev_offset, nbytes, self.stream)
        if rc:
            self.drv.check(rc, "cuMemcpyDtoHAsync_v2")

    def h2d(self, host, host_offset: int, dev, dev_offset: int, nbytes: int) -> None:
        rc = self._h2d(dev.data_ptr() + dev_offset, host.data_ptr() + host_offset, nbytes, self.stream)
        if rc:
            self.drv.check(rc, "cuMemcpyHtoDAsync_v2")

    def finish(self) -> None:
        self.drv.call("cuStreamSynchronize", self.stream)


def bulk_copier(runner):
    """The runner's copier: the driver's on CUDA, TVM's elsewhere."""
    return DriverBulkCopy(runner.dev) if runner.device_kind == "cuda" else TvmBulkCopy(runner.sync)
