"""Host tier storage: buffers behind the HostArena's extents and slots, plus transfer counters.

The arena decides placement and growth; this module owns the bytes. Each arena chunk is one host byte
buffer of whole pages, page-locked (cudaMallocHost through TVM's cuda_host device) when the model runs on
CUDA, so copies are direct DMA; each host state slot holds one sequence's conv tail and SSM state. Every
copy is counted (pages, bytes, copies, seconds) for /stats.

A host page holds one page of every pool on the runner's page ids (parts, copy_plan.PagePart): the main
KV page; with an MTP head (runner.mtp_kv_pool: one more attention layer on the same page ids) the head's
page, so a spilled prefix comes back with the head's KV too (drafts after a host restore see the same KV as
after a device restore); and each pool attached to the page ids (runner.page_pools: a DFlash drafter's
paged layers, any shape and dtype). The arena's page_bytes (and --host-kv-mib) count them all; the kv_*
transfer counters count the main pages, mtp_kv_{d2h,h2d}_bytes the head's, draft_kv_{d2h,h2d}_bytes the
attached pools'. Chunks are part-major (copy_plan), so a run of consecutive device pages that lands on
consecutive host pages is one copy per part (kv_{d2h,h2d}_copies count them).

Transfers go through the runner's bulk copier (executor/bulk_copy.py: the CUDA driver's async copies on a
stream of their own, TVM's elsewhere): first the device drains the work queued before the transfer, timed
apart as *_wait_seconds (an overlapped decode step finishing is not copy time), then the copies are queued
and waited for once, timed as *_seconds.
"""
from __future__ import annotations

import time
from typing import Optional

import numpy as np

from ..executor.bulk_copy import bulk_copier
from ..executor.weights import np_dtype
from .copy_plan import ByteCopy, PagePart, plan_transfer
from .host_arena import Allocation, HostArena


class HostTier:
    def __init__(self, runner, host_kv_mib: float, host_state_slots: int, host_ram_reserve_mib: float,
                 meminfo_reader=None):
        self.runner = runner
        page_shape = tuple(runner.kv_shape[1:])
        # the MTP head's KV page (same page id, one layer) travels with the main page
        self.mtp = getattr(runner, "mtp_kv_pool", None) is not None
        self.mtp_page_bytes = runner.page_bytes // page_shape[0] * runner.mtp_kv_shape[1] if self.mtp else 0
        # [dflash hook] attached pools: page bytes of each, stored after the main (+ MTP) page
        self.extra = [(n, int(np.prod(shape)) * np_dtype(dt).itemsize)
                      for n, (_, shape, dt) in getattr(runner, "page_pools", {}).items()]
        self.extra_page_bytes = sum(b for _, b in self.extra)
        if {"kv", "mtp"} & {n for n, _ in self.extra}:
            raise ValueError("an attached page pool may not be named 'kv' or 'mtp' (the host tier's own parts)")
        self.parts = [PagePart("kv", runner.page_bytes)] + ([PagePart("mtp", self.mtp_page_bytes)] if self.mtp else []) \
            + [PagePart(n, b) for n, b in self.extra]
        self.host_page_bytes = sum(p.page_bytes for p in self.parts)
        self.state_bytes = runner.conv_slot_bytes + runner.ssm_slot_bytes
        tvm = runner.tvm
        self.host_dev = tvm.runtime.device(3, 0) if runner.device_kind == "cuda" else tvm.cpu()  # 3 = cuda_host
        self._empty = tvm.runtime.empty
        self.copier = bulk_copier(runner)
        self._chunks: dict = {}  # chunk index -> host byte buffer (part-major)
        self._chunk_pages: dict[int, int] = {}
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
            "kv_d2h_copies", "kv_h2d_copies",
            "state_d2h_count", "state_d2h_bytes", "state_h2d_count", "state_h2d_bytes", "state_d2d_count",
            "state_d2d_bytes", "mtp_kv_d2h_bytes", "mtp_kv_h2d_bytes", "draft_kv_d2h_bytes", "draft_kv_h2d_bytes")}
        self.stats.update({f"{k}_seconds": 0.0 for k in (
            "kv_d2h", "kv_h2d", "state_d2h", "state_h2d", "kv_d2d", "state_d2d",
            "kv_d2h_wait", "kv_h2d_wait", "state_d2h_wait", "state_h2d_wait")})

    def _on_grow(self, chunk) -> bool:
        self._chunks[chunk.index] = self._empty((chunk.n_pages * self.host_page_bytes,), "uint8", self.host_dev)
        self._chunk_pages[chunk.index] = chunk.n_pages
        return True

    def _device_pools(self) -> list:
        """The device pool of each part, in self.parts order."""
        r = self.runner
        named = {"kv": r.kv_pool, "mtp": r.mtp_kv_pool}
        return [named[p.name] if p.name in named else r.page_pools[p.name][0] for p in self.parts]

    def _plan(self, dev_pages: list[int], alloc: Allocation) -> list[ByteCopy]:
        """The byte copies between device pages (logical order) and an allocation's host pages."""
        hpb = self.host_page_bytes
        pieces = [(ci, off // hpb, n // hpb) for ci, off, n in self.arena.chunk_ranges(alloc)]
        return plan_transfer(dev_pages, pieces, self.parts, self._chunk_pages)

    def _count(self, d: str, pages: int, copies: list[ByteCopy]) -> None:
        moved = {p.name: 0 for p in self.parts}
        for c in copies:
            moved[self.parts[c.part].name] += c.nbytes
        self.stats[f"kv_{d}_pages"] += pages
        self.stats[f"kv_{d}_copies"] += len(copies)
        self.stats[f"kv_{d}_bytes"] += moved.pop("kv")
        self.stats[f"mtp_kv_{d}_bytes"] += moved.pop("mtp", 0)
        self.stats[f"draft_kv_{d}_bytes"] += sum(moved.values())

    def _drain(self, key: str) -> float:
        """Wait for the device work queued before a transfer (counted under key); the copy timer starts now."""
        t0 = time.perf_counter()
        self.copier.drain()
        t1 = time.perf_counter()
        self.stats[key] += t1 - t0
        return t1

    # ---- KV pages ----------------------------------------------------------------------
    def store_pages(self, pages: list[int]) -> Optional[Allocation]:
        """Copy device pages to the host; None when the host tier has no room."""
        if not pages:
            return None
        alloc = self.arena.alloc_pages(len(pages))
        if alloc is None:
            return None
        try:
            copies = self._plan(pages, alloc)
            pools = self._device_pools()
            t0 = self._drain("kv_d2h_wait_seconds")
            try:
                for c in copies:
                    self.copier.d2h(pools[c.part], c.dev_offset, self._chunks[c.chunk], c.host_offset, c.nbytes)
            finally:
                self.copier.finish()  # nothing may still write into an allocation freed below
        except BaseException:
            self.arena.free(alloc)
            raise
        self.stats["kv_d2h_seconds"] += time.perf_counter() - t0
        self._count("d2h", len(pages), copies)
        return alloc

    def load_pages(self, alloc: Optional[Allocation], dst_pages: list[int]) -> None:
        """Copy an allocation's host pages into device pages (one per host page, logical order)."""
        if alloc is None:
            return
        copies = self._plan(dst_pages, alloc)
        pools = self._device_pools()
        t0 = self._drain("kv_h2d_wait_seconds")
        try:
            for c in copies:
                self.copier.h2d(self._chunks[c.chunk], c.host_offset, pools[c.part], c.dev_offset, c.nbytes)
        finally:
            self.copier.finish()  # complete before any kernel reads those pages
        self.stats["kv_h2d_seconds"] += time.perf_counter() - t0
        self._count("h2d", len(dst_pages), copies)

    def free_pages(self, alloc: Optional[Allocation]) -> None:
        if alloc is not None:
            self.arena.free(alloc)

    # ---- state slots -----------------------------------------------------------------------
    def store_state(self, dev_slot: int) -> Optional[int]:
        hs = self.arena.alloc_state_slot()
        if hs is None:
            return None
        conv, ssm = self.runner.state_views(dev_slot)
        if hs not in self._states:
            self._states[hs] = (self._empty(conv.shape, conv.dtype, self.host_dev),
                                self._empty(ssm.shape, ssm.dtype, self.host_dev))
        hconv, hssm = self._states[hs]
        try:
            t0 = self._drain("state_d2h_wait_seconds")
            try:
                self.copier.d2h(conv, 0, hconv, 0, self.runner.conv_slot_bytes)
                self.copier.d2h(ssm, 0, hssm, 0, self.runner.ssm_slot_bytes)
            finally:
                self.copier.finish()
        except BaseException:
            self.arena.free_state_slot(hs)
            raise
        self.stats["state_d2h_count"] += 1
        self.stats["state_d2h_bytes"] += self.state_bytes
        self.stats["state_d2h_seconds"] += time.perf_counter() - t0
        return hs

    def load_state(self, host_slot: int, dev_slot: int) -> None:
        conv, ssm = self.runner.state_views(dev_slot)
        hconv, hssm = self._states[host_slot]
        t0 = self._drain("state_h2d_wait_seconds")
        try:
            self.copier.h2d(hconv, 0, conv, 0, self.runner.conv_slot_bytes)
            self.copier.h2d(hssm, 0, ssm, 0, self.runner.ssm_slot_bytes)
        finally:
            self.copier.finish()
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
