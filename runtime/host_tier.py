"""Host tier storage: buffers behind the HostArena's extents and slots, plus transfer counters.

The arena decides placement and growth; this module owns the bytes. Each arena chunk is one
host buffer (pinned on CUDA builds when available) of whole KV pages; each state slot holds one
sequence's conv tail and SSM state. Every copy is counted (pages, bytes, seconds) for /stats.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from .host_arena import Allocation, HostArena


class HostTier:
    def __init__(self, runner, host_kv_mib: float, host_state_slots: int, host_ram_reserve_mib: float,
                 meminfo_reader=None):
        self.runner = runner
        self.page_shape = runner.kv_shape[1:]
        self.kv_dtype = runner._np_kv
        self.state_bytes = runner.conv_slot_bytes + runner.ssm_slot_bytes
        self._chunks: dict[int, np.ndarray] = {}
        self._states: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        kw = {"meminfo_reader": meminfo_reader} if meminfo_reader else {}
        self.arena = HostArena(
            ceiling_bytes=int(host_kv_mib * 2**20), page_bytes=runner.page_bytes, state_slot_bytes=self.state_bytes,
            min_state_slots=host_state_slots, reserve_bytes=int(host_ram_reserve_mib * 2**20),
            on_kv_grow=self._on_grow, **kw)
        for ch in self.arena.chunks():
            self._on_grow(ch)
        self.stats = {k: 0 for k in (
            "kv_d2h_pages", "kv_d2h_bytes", "kv_h2d_pages", "kv_h2d_bytes", "kv_d2d_pages", "kv_d2d_bytes",
            "state_d2h_count", "state_d2h_bytes", "state_h2d_count", "state_h2d_bytes", "state_d2d_count",
            "state_d2d_bytes")}
        self.stats.update(kv_d2h_seconds=0.0, kv_h2d_seconds=0.0, state_d2h_seconds=0.0, state_h2d_seconds=0.0,
                          kv_d2d_seconds=0.0, state_d2d_seconds=0.0)

    def _on_grow(self, chunk) -> bool:
        self._chunks[chunk.index] = np.zeros((chunk.n_pages,) + tuple(self.page_shape), self.kv_dtype)
        return True

    # ---- KV pages ----------------------------------------------------------------------
    def _page_slices(self, alloc: Allocation):
        for off, n in alloc.extents:
            while n > 0:
                ci, pi = self.arena.locate(off)
                buf = self._chunks[ci]
                take = min(n, buf.shape[0] - pi)
                yield buf, pi, take
                off += take
                n -= take

    def store_pages(self, pages: list[int]) -> Optional[Allocation]:
        """Copy device pages to the host; None when the host tier has no room."""
        alloc = self.arena.alloc_pages(len(pages)) if pages else None
        if pages and alloc is None:
            return None
        t0 = time.perf_counter()
        data = self.runner.read_pages(pages)
        i = 0
        if alloc is not None:
            for buf, pi, take in self._page_slices(alloc):
                buf[pi:pi + take] = data[i:i + take]
                i += take
        self.stats["kv_d2h_pages"] += len(pages)
        self.stats["kv_d2h_bytes"] += len(pages) * self.runner.page_bytes
        self.stats["kv_d2h_seconds"] += time.perf_counter() - t0
        return alloc

    def load_pages(self, alloc: Optional[Allocation], dst_pages: list[int]) -> None:
        if alloc is None:
            return
        t0 = time.perf_counter()
        parts = [buf[pi:pi + take] for buf, pi, take in self._page_slices(alloc)]
        self.runner.write_pages(dst_pages, np.concatenate(parts) if len(parts) > 1 else parts[0])
        self.stats["kv_h2d_pages"] += len(dst_pages)
        self.stats["kv_h2d_bytes"] += len(dst_pages) * self.runner.page_bytes
        self.stats["kv_h2d_seconds"] += time.perf_counter() - t0

    def free_pages(self, alloc: Optional[Allocation]) -> None:
        if alloc is not None:
            self.arena.free(alloc)

    # ---- state slots -----------------------------------------------------------------------
    def store_state(self, dev_slot: int) -> Optional[int]:
        hs = self.arena.alloc_state_slot()
        if hs is None:
            return None
        t0 = time.perf_counter()
        self._states[hs] = self.runner.read_state(dev_slot)
        self.stats["state_d2h_count"] += 1
        self.stats["state_d2h_bytes"] += self.state_bytes
        self.stats["state_d2h_seconds"] += time.perf_counter() - t0
        return hs

    def load_state(self, host_slot: int, dev_slot: int) -> None:
        t0 = time.perf_counter()
        conv, ssm = self._states[host_slot]
        self.runner.write_state(dev_slot, conv, ssm)
        self.stats["state_h2d_count"] += 1
        self.stats["state_h2d_bytes"] += self.state_bytes
        self.stats["state_h2d_seconds"] += time.perf_counter() - t0

    def free_state(self, host_slot: int) -> None:
        self._states.pop(host_slot, None)
        self.arena.free_state_slot(host_slot)
        self.arena.shrink_state_slots()

    # ---- device-side copies (checkpoints, copy-on-write) -------------------------------------
    def copy_state_d2d(self, src: int, dst: int) -> None:
        t0 = time.perf_counter()
        self.runner.copy_state(src, dst)
        self.stats["state_d2d_count"] += 1
        self.stats["state_d2d_bytes"] += self.state_bytes
        self.stats["state_d2d_seconds"] += time.perf_counter() - t0

    def copy_page_d2d(self, src: int, dst: int) -> None:
        t0 = time.perf_counter()
        self.runner.copy_page(src, dst)
        self.stats["kv_d2d_pages"] += 1
        self.stats["kv_d2d_bytes"] += self.runner.page_bytes
        self.stats["kv_d2d_seconds"] += time.perf_counter() - t0
