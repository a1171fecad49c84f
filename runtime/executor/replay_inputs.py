"""Fixed-address inputs of gdn_replay (speculative rollback without a re-feed), so its call can be a CUDA graph.

A replay reads a verify's kept GDN projections (qkvz_rows, ba_rows: the verify's outputs, whose addresses
differ between an eager verify and each graph's buffers) and three small index arrays. Staged here, every
input of a given shape lives at the same device address on every call, which is what a graph replay bakes in
(executor/cuda_graph.py); the projections are copied on the device (a few MB at 27B: the verify rows of one
round). Buffers grow, never shrink; `generation` changes when one moved (graphs over the old ones are stale).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from .host_copy import HostCopy
from .view_cache import ViewCache


class ReplayInputs:
    def __init__(self, tvm, dev):
        self.tvm, self.dev = tvm, dev
        self.generation = 0
        self._bufs: dict[str, Any] = {}  # name -> flat device tensor
        self._views = ViewCache()
        self._copy = HostCopy(tvm)
        self._index = np.zeros(64, np.int32)  # host staging of the three index arrays (grown on demand)

    def _view(self, name: str, shape: tuple, dtype: str):
        size = math.prod(shape)
        buf = self._bufs.get(name)
        held = int(buf.shape[0]) if buf is not None else 0
        if held < size:
            self.generation += 1
            buf = self._bufs[name] = self.tvm.runtime.empty((max(size, 2 * held),), dtype, self.dev)
        return self._views(buf, shape, dtype)

    def stage(self, gdn_rows: tuple, items: Sequence[tuple[int, int, int]]) -> list:
        """[qkvz_rows, ba_rows, rows, cu_seqlens, slot_ids] views holding this call's values (for given shapes, at
        the same addresses on every call); items: (state slot, first verify row, row count) per sequence."""
        out = []
        for name, src in zip(("qkvz", "ba"), gdn_rows):
            view = self._view(name, tuple(src.shape), str(src.dtype))
            src.copyto(view)
            out.append(view)
        # the three index arrays (rows, cu_seqlens, slots) staged in one host array and uploaded in one copy (a
        # host->device copy waits for the device), then split on the device into buffers of their own (a kernel
        # argument must start its allocation)
        n_rows = sum(n for _, _, n in items)
        b = len(items)
        size = n_rows + 2 * b + 1
        if self._index.size < size:
            self._index = np.zeros(2 * size, np.int32)
        idx = self._index
        at, total = 0, 0
        cu = idx[n_rows: n_rows + b + 1]
        cu[0] = 0
        for i, (slot, first, n) in enumerate(items):
            idx[at: at + n] = range(first, first + n)
            at += n
            total += n
            cu[i + 1] = total
            idx[n_rows + b + 1 + i] = slot
        self._copy(self._view("index", (size,), "int32"), idx[:size], 4)
        at = 0
        for name, n in (("rows", n_rows), ("cu", b + 1), ("slots", b)):
            view = self._view(name, (n,), "int32")
            self._views(self._bufs["index"], (n,), "int32", 4 * at).copyto(view)
            out.append(view)
            at += n
        return out
