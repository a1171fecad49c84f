"""Row ranges of a 2-D device tensor (a forward's output) that are sliced without copies.

The target's tap-layer outputs feed a DFlash drafter on the device: the decoder slices them per
sequence and per accepted prefix like host arrays, and the drafter reads them as tensor views, so
nothing crosses to the host. `gather` makes one contiguous [n, W] tensor of several ranges: the
tensor itself when they are its leading rows, else device copies into a staging buffer (compiled
functions take no argument with a byte offset, so a view of later rows cannot be passed as is)."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


class DeviceRows:
    def __init__(self, base, start: int = 0, count: Optional[int] = None):
        self.base, self.start = base, int(start)
        self.count = int(base.shape[0]) - self.start if count is None else int(count)

    @property
    def width(self) -> int:
        return int(self.base.shape[1])

    @property
    def dtype(self) -> str:
        return str(self.base.dtype)

    @property
    def row_bytes(self) -> int:
        return self.width * _ITEMSIZE[self.dtype]

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, key: slice) -> "DeviceRows":
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("DeviceRows takes contiguous slices only")
        lo, hi, _ = key.indices(self.count)
        return DeviceRows(self.base, self.start + lo, max(0, hi - lo))

    def view(self):
        """The rows as a [count, width] tensor sharing the base's memory."""
        return self.base._create_view((self.count, self.width), self.dtype, self.start * self.row_bytes)

    def numpy(self) -> np.ndarray:
        return self.view().numpy()


class RowStage:
    """A growing device buffer for gathering non-contiguous row ranges."""

    def __init__(self, tvm, dev):
        self.tvm, self.dev = tvm, dev
        self.buf = None

    def gather(self, parts: Sequence[DeviceRows]):
        parts = [p for p in parts if len(p)]
        if not parts:
            raise ValueError("nothing to gather")
        base, n = parts[0].base, sum(len(p) for p in parts)
        if parts[0].start == 0 and all(p.base is base for p in parts) and all(
                b.start == a.start + a.count for a, b in zip(parts, parts[1:])):
            return DeviceRows(base, 0, n).view()
        w, dt = parts[0].width, parts[0].dtype
        if self.buf is None or self.buf.shape[0] < n or int(self.buf.shape[1]) != w or str(self.buf.dtype) != dt:
            rows = max(n, 2 * (self.buf.shape[0] if self.buf is not None else 0), 64)
            self.buf = self.tvm.runtime.empty((rows, w), dt, self.dev)
        stage = DeviceRows(self.buf, 0, n)
        off = 0
        for p in parts:
            p.view().copyto(stage[off: off + len(p)].view())
            off += len(p)
        return stage.view()
