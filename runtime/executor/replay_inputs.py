"""Fixed-address inputs of gdn_replay (speculative rollback without a re-feed), so its call can be a CUDA graph.

A replay reads a verify's kept GDN projections (qkvz_rows, ba_rows: the verify's outputs, whose addresses
differ between an eager verify and each graph's buffers) and three small index arrays. Staged here, every
input of a given shape lives at the same device address on every call, which is what a graph replay bakes in
(executor/cuda_graph.py); the projections are copied on the device (a few MB at 27B: the verify rows of one
round). Buffers grow, never shrink; `generation` changes when one moved (graphs over the old ones are stale).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .view_cache import ViewCache


class ReplayInputs:
    def __init__(self, tvm, dev):
        self.tvm, self.dev = tvm, dev
        self.generation = 0
        self._bufs: dict[str, Any] = {}  # name -> flat device tensor
        self._views = ViewCache()

    def _view(self, name: str, shape: tuple, dtype: str):
        size = int(np.prod(shape))
        held = int(self._bufs[name].shape[0]) if name in self._bufs else 0
        if held < size:
            self.generation += 1
            self._bufs[name] = self.tvm.runtime.empty((max(size, 2 * held),), dtype, self.dev)
        return self._views(self._bufs[name], tuple(int(x) for x in shape), dtype)

    def stage(self, gdn_rows: tuple, rows: np.ndarray, cu: np.ndarray, slots: np.ndarray) -> list:
        """[qkvz_rows, ba_rows, rows, cu_seqlens, slot_ids] views holding this call's values (for given shapes, at
        the same addresses on every call)."""
        out = []
        for name, src in zip(("qkvz", "ba"), gdn_rows):
            view = self._view(name, tuple(int(x) for x in src.shape), str(src.dtype))
            src.copyto(view)
            out.append(view)
        # the three index arrays uploaded in one copy (a host->device copy waits for the device), then split on the
        # device into buffers of their own (a kernel argument must start its allocation)
        packed = np.concatenate([np.asarray(a, np.int32).ravel() for a in (rows, cu, slots)])
        self._view("index", packed.shape, "int32").copyfrom(packed)
        at = 0
        for name, a in (("rows", rows), ("cu", cu), ("slots", slots)):
            view = self._view(name, (len(a),), "int32")
            self._views(self._bufs["index"], (len(a),), "int32", 4 * at).copyto(view)
            out.append(view)
            at += len(a)
        return out
