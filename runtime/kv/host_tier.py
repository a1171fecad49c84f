"""Host tier storage: buffers behind the HostArena's extents and slots, plus transfer counters.

The arena decides placement and growth; this module owns the bytes. Each arena chunk is one
host tensor of whole KV pages, page-locked (cudaMallocHost through TVM's cuda_host device) when
the model runs on CUDA, so page and state copies are direct DMA between views; each host state
slot holds one sequence's conv tail and SSM state. Every copy is counted (pages, bytes, seconds)
for /stats.

With an MTP head (runner.mtp_kv_pool: one more attention layer on the same page ids) a host page
is the main page followed by the head's page: chunk shape (n, attn_layers + 1, 2, kv_heads, 64,
row), so a spilled prefix comes back with the head's KV too (drafts after a host restore see the
same KV as after a device restore). The arena's page_bytes (and --host-kv-mib) count both; the
kv_* transfer counters count the main pages, mtp_kv_{d2h,h2d}_bytes the head's.

Pools attached to the runner's page ids (runner.page_pools: a DFlash drafter's paged layers, any shape
and dtype) travel the same way: their page follows the main (and MTP) page in the host page, viewed
with its own shape and dtype; draft_kv_{d2h,h2d}_bytes count them.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from ..executor.weights import np_dtype
from .host_arena import Allocation, HostArena


class HostTier:
    def __init__(self, runner, host_kv_mib: float, host_state_slots: int, host_ram_reserve_mib: float,
                 meminfo_reader=None):
        self.runner = runner
        self.page_shape = tuple(runner.kv_shape[1:])
        # the MTP head's KV page (same page id, one layer) travels with the main page
        self.mtp = getattr(runner, "mtp_kv_pool", None) is not None
        self.mtp_page_shape = tuple(runner.mtp_kv_shape[1:]) if self.mtp else ()
        self.mtp_page_bytes = runner.page_bytes // self.page_shape[0] * self.mtp_page_shape[0] if self.mtp else 0
        self.host_page_bytes = runner.page_bytes + self.mtp_page_bytes
        self._chunk_tail = ((self.page_shape[0] + self.mtp_page_shape[0],) + self.page_shape[1:]) if self.mtp \
            else self.page_shape
        # [dflash hook] attached pools: (name, page shape, dtype, bytes), stored after the main (+ MTP) page
        self.extra = [(n, shape, dt, int(np.prod(shape)) * np_dtype(dt).itemsize)
                      for n, (_, shape, dt) in getattr(runner, "page_pools", {}).items()]
        self.extra_page_bytes = sum(b for *_, b in self.extra)
        if self.extra:  # host pages of mixed dtypes: a byte buffer, viewed per part
            main_bytes = self.host_page_bytes
            self.host_page_bytes += self.extra_page_bytes
            self._chunk_tail = (self.host_page_bytes,)
            self._main_bytes = main_bytes
        self.state_bytes = runner.conv_slot_bytes + runner.ssm_slot_bytes
        tvm = runner.tvm
        self.host_dev = tvm.runtime.device(3, 0) if runner.device_kind == "cuda" else tvm.cpu()  # 3 = cuda_host
        self._empty = tvm.runtime.empty
        self._chunks: dict = {}
        self._states: dict = {}  # host slot -> (conv tensor, ssm tensor), reused across stores
        kw = {"meminfo_reader": meminfo_reader} if meminfo_reader else {}
        self.arena = HostArena(
            ceiling_bytes=int(host_kv_mib * 2**20), page_bytes=self.host_page_bytes, state_slot_bytes=self.state_bytes,
            min_state_slots=host_state_slots, reserve_bytes=int(host_ram_reserve_mib * 2**20),
            on_kv_grow=self._on_grow, **kw)
        for ch in self.arena.chunks():
            self._on_grow(ch)
        self.stats: dict[str, float] = {k: 0 for k in (  # counters (int) and seconds (float)
            "kv_d2h_pages", "kv_d2h_bytes", "kv_h2d_pages", "kv_h2d_bytes", "kv_d2d_pages", "kv_d2d_bytes",
            "state_d2h_count", "state_d2h_bytes", "state_h2d_count", "state_h2d_bytes", "state_d2d_count",
            "state_d2d_bytes", "mtp_kv_d2h_bytes", "mtp_kv_h2d_bytes", "draft_kv_d2h_bytes", "draft_kv_h2d_bytes")}
        self.stats.update(kv_d2h_seconds=0.0, kv_h2d_seconds=0.0, state_d2h_seconds=0.0, state_h2d_seconds=0.0,
                          kv_d2d_seconds=0.0, state_d2d_seconds=0.0)

    def _on_grow(self, chunk) -> bool:
        dtype = "uint8" if self.extra else self.runner.kv_pool.dtype
        self._chunks[chunk.index] = self._empty((chunk.n_pages,) + self._chunk_tail, dtype, self.host_dev)
        return True

    def _host_page(self, buf, i: int):
        """(main page view, MTP page view or None, attached pools' page views...) of host page i of a chunk."""
        off = i * self.host_page_bytes
        kv_dt = self.runner.kv_pool.dtype if self.extra else buf.dtype
        main = buf._create_view(self.page_shape, kv_dt, off)
        out: tuple = (main, (buf._create_view(self.mtp_page_shape, kv_dt, off + self.runner.page_bytes)
                      if self.mtp else None))
        if self.extra:
            off += self._main_bytes
            for _, shape, dt, nbytes in self.extra:
                out += (buf._create_view(shape, dt, off),)
                off += nbytes
        return out

    def _host_pages(self, alloc: Allocation):
        """Host page views of an allocation, in logical page order."""
        for off, n in alloc.extents:
            for k in range(n):
                ci, pi = self.arena.locate(off + k)
                yield self._host_page(self._chunks[ci], pi)

    def _device_page(self, p: int):
        return (self.runner.page_view(p), self.runner.mtp_page_view(p) if self.mtp else None,
                *(self.runner.pool_page_view(n, p) for n, *_ in self.extra))

    # ---- KV pages ----------------------------------------------------------------------
    def store_pages(self, pages: list[int]) -> Optional[Allocation]:
        """Copy device pages to the host; None when the host tier has no room."""
        if not pages:
            return None
        alloc = self.arena.alloc_pages(len(pages))
        if alloc is None:
            return None
        t0 = time.perf_counter()
        for p, dst in zip(pages, self._host_pages(alloc)):
            for src_v, dst_v in zip(self._device_page(p), dst):
                if src_v is not None:
                    src_v.copyto(dst_v)
        self.runner.sync()
        self.stats["kv_d2h_pages"] += len(pages)
        self.stats["kv_d2h_bytes"] += len(pages) * self.runner.page_bytes
        self.stats["mtp_kv_d2h_bytes"] += len(pages) * self.mtp_page_bytes
        self.stats["draft_kv_d2h_bytes"] += len(pages) * self.extra_page_bytes
        self.stats["kv_d2h_seconds"] += time.perf_counter() - t0
        return alloc

    def load_pages(self, alloc: Optional[Allocation], dst_pages: list[int]) -> None:
        if alloc is None:
            return
        t0 = time.perf_counter()
        for src, p in zip(self._host_pages(alloc), dst_pages):
            for src_v, dst_v in zip(src, self._device_page(p)):
                if src_v is not None:
                    src_v.copyto(dst_v)
        self.runner.sync()
        self.stats["kv_h2d_pages"] += len(dst_pages)
        self.stats["kv_h2d_bytes"] += len(dst_pages) * self.runner.page_bytes
        self.stats["mtp_kv_h2d_bytes"] += len(dst_pages) * self.mtp_page_bytes
        self.stats["draft_kv_h2d_bytes"] += len(dst_pages) * self.extra_page_bytes
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
        conv, ssm = self.runner.state_views(dev_slot)
        if hs not in self._states:
            self._states[hs] = (self._empty(conv.shape, conv.dtype, self.host_dev),
                                self._empty(ssm.shape, ssm.dtype, self.host_dev))
        conv.copyto(self._states[hs][0])
        ssm.copyto(self._states[hs][1])
        self.runner.sync()
        self.stats["state_d2h_count"] += 1
        self.stats["state_d2h_bytes"] += self.state_bytes
        self.stats["state_d2h_seconds"] += time.perf_counter() - t0
        return hs

    def load_state(self, host_slot: int, dev_slot: int) -> None:
        t0 = time.perf_counter()
        conv, ssm = self.runner.state_views(dev_slot)
        self._states[host_slot][0].copyto(conv)
        self._states[host_slot][1].copyto(ssm)
        self.runner.sync()
        self.stats["state_h2d_count"] += 1
        self.stats["state_h2d_bytes"] += self.state_bytes
        self.stats["state_h2d_seconds"] += time.perf_counter() - t0

    def free_state(self, host_slot: int) -> None:
        self.arena.free_state_slot(host_slot)
        released = self.arena.shrink_state_slots()
        if released:  # trailing slots left the pool: drop their pinned buffers
            for hs in [h for h in self._states if h >= self.arena.state_slots_capacity]:
                del self._states[hs]

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
        self.stats["kv_d2d_bytes"] += self.runner.page_bytes  # runner.copy_page moves the MTP page too
        self.stats["kv_d2d_seconds"] += time.perf_counter() - t0
