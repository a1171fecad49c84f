"""Host-tier transfer planning (kv/copy_plan.py) and the driver copier's calls (executor/bulk_copy.py), on the CPU:
byte-exact round trips through numpy buffers standing in for the device pools and the pinned chunks."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from ninfer_mlc.runtime.executor.bulk_copy import DriverBulkCopy
from ninfer_mlc.runtime.executor.cuda_driver import CudaError, Driver
from ninfer_mlc.runtime.kv.copy_plan import ByteCopy, PagePart, PageRun, page_runs, part_offsets, plan_transfer
from ninfer_mlc.runtime.kv.host_arena import HostArena
from ninfer_mlc.runtime.kv.pages import PageAllocator

KV, MTP, DRAFT = PagePart("kv", 96), PagePart("mtp", 12), PagePart("draft", 40)  # the drafter's pool: another dtype


def test_a_run_of_pages_is_one_copy_per_part():
    copies = plan_transfer([5, 6, 7], [(0, 2, 3)], [KV, MTP], {0: 10})
    assert copies == [ByteCopy(0, 5 * 96, 0, 2 * 96, 3 * 96),
                      ByteCopy(1, 5 * 12, 0, 10 * 96 + 2 * 12, 3 * 12)]  # part-major chunk: MTP after all 10 KV pages
    assert part_offsets([KV, MTP, DRAFT], 10) == [0, 960, 1080]


def test_runs_break_where_device_ids_or_host_chunks_do():
    # device ids 3,4 | 9 | 10,11 (9 and 10 consecutive, but the host pages change chunk between them) | 2
    pieces = [(0, 6, 3), (1, 0, 2), (2, 4, 1)]
    assert page_runs([3, 4, 9, 10, 11, 2], pieces) == [
        PageRun(3, 0, 6, 2), PageRun(9, 0, 8, 1), PageRun(10, 1, 0, 2), PageRun(2, 2, 4, 1)]
    assert page_runs([7, 6, 5], [(0, 0, 3)]) == [PageRun(7, 0, 0, 1), PageRun(6, 0, 1, 1), PageRun(5, 0, 2, 1)]
    assert page_runs([], []) == []


@pytest.mark.parametrize("pages, pieces, chunks, msg", [
    ([1, 2], [(0, 0, 3)], {0: 4}, "2 device pages for a host allocation of 3"),
    ([1, 2], [(0, 3, 2)], {0: 4}, "outside chunk 0"),
    ([1, 2], [(5, 0, 2)], {0: 4}, "chunk 5 does not exist"),
    ([-1], [(0, 0, 1)], {0: 4}, "negative device page"),
    ([1], [(0, 0, 0), (0, 0, 1)], {0: 4}, "bad host piece"),
])
def test_bad_plans_are_refused(pages, pieces, chunks, msg):
    with pytest.raises(ValueError, match=msg):
        plan_transfer(pages, pieces, [KV], chunks)


def _fragmented_arena(rng) -> tuple[HostArena, list]:
    """An arena of three chunks whose free space is scattered, and allocations placed across it."""
    arena = HostArena(ceiling_bytes=64 * 148, page_bytes=148, state_slot_bytes=1, initial_kv_bytes=16 * 148,
                      grow_chunk_bytes=16 * 148, meminfo_reader=lambda: 1 << 40)
    live = [arena.alloc_pages(int(n)) for n in rng.integers(1, 6, 12)]
    for a in live[::2]:
        arena.free(a)
    got = [arena.alloc_pages(n) for n in (9, 3, 14)]
    assert all(got) and any(a.scattered for a in got) and len(arena.chunks()) >= 2
    return arena, got


class _Memory:
    """numpy buffers standing in for the device pools (one per part) and the host chunks."""

    def __init__(self, rng, parts, n_dev_pages, arena):
        self.parts = parts
        self.dev = [rng.integers(0, 256, n_dev_pages * p.page_bytes, dtype=np.uint8) for p in parts]
        self.chunk_pages = {c.index: c.n_pages for c in arena.chunks()}
        self.host = {c.index: np.zeros(c.n_pages * sum(p.page_bytes for p in parts), np.uint8) for c in arena.chunks()}

    def host_page(self, ci: int, i: int, j: int) -> np.ndarray:
        """Part j of page i of chunk ci, by the documented part-major layout (not by the planner)."""
        pb = self.parts[j].page_bytes
        at = sum(p.page_bytes for p in self.parts[:j]) * self.chunk_pages[ci] + i * pb
        return self.host[ci][at:at + pb]

    def dev_page(self, j: int, p: int) -> np.ndarray:
        pb = self.parts[j].page_bytes
        return self.dev[j][p * pb:(p + 1) * pb]


def _pieces(arena, alloc):
    pb = arena.page_bytes
    return [(ci, off // pb, n // pb) for ci, off, n in arena.chunk_ranges(alloc)]


def test_round_trip_through_fragmented_chunks_is_byte_exact():
    rng = np.random.default_rng(0)
    arena, allocs = _fragmented_arena(rng)
    parts = [KV, MTP, DRAFT]
    mem = _Memory(rng, parts, 64, arena)
    for alloc in allocs:
        src = rng.permutation(64)[: alloc.n_pages].tolist()  # scattered device ids ...
        src[: alloc.n_pages // 2] = sorted(src[: alloc.n_pages // 2])  # ... with some ascending stretches
        copies = plan_transfer(src, _pieces(arena, alloc), parts, mem.chunk_pages)
        for c in copies:  # store
            mem.host[c.chunk][c.host_offset:c.host_offset + c.nbytes] = mem.dev[c.part][c.dev_offset:c.dev_offset + c.nbytes]
        for logical, g in enumerate(alloc.pages()):
            ci, i = arena.locate(g)
            for j in range(len(parts)):
                np.testing.assert_array_equal(mem.host_page(ci, i, j), mem.dev_page(j, src[logical]))
        dst = rng.permutation(64)[: alloc.n_pages].tolist()
        want = [[mem.dev_page(j, p).copy() for j in range(len(parts))] for p in src]
        for c in plan_transfer(dst, _pieces(arena, alloc), parts, mem.chunk_pages):  # load elsewhere
            mem.dev[c.part][c.dev_offset:c.dev_offset + c.nbytes] = mem.host[c.chunk][c.host_offset:c.host_offset + c.nbytes]
        for p, w in zip(dst, want):
            for j in range(len(parts)):
                np.testing.assert_array_equal(mem.dev_page(j, p), w[j])


def test_released_pages_come_back_in_their_order():
    pages = PageAllocator(16, 64)
    first = pages.alloc(6)
    other = pages.alloc(2)
    pages.release(first)
    assert pages.alloc(6) == first  # a restore into a spill's pages: one run, not six
    pages.release(other)
    with pytest.raises(ValueError, match="double free"):
        pages.release(other)


# ---- the driver path, with a fake libcuda whose copies are memmoves ----------------------------------------
class _Buf:
    """A numpy buffer with a TVM tensor's data_ptr()."""

    def __init__(self, arr: np.ndarray):
        self.arr = arr

    def data_ptr(self) -> int:
        return self.arr.ctypes.data


class _FakeLib:
    def __init__(self):
        self.calls: list = []
        self.fail = False

    def cuMemcpyDtoHAsync_v2(self, dst, src, n, stream):
        self.calls.append(("d2h", n, stream))
        ctypes.memmove(dst, src, n)
        return 1 if self.fail else 0

    def cuMemcpyHtoDAsync_v2(self, dst, src, n, stream):
        self.calls.append(("h2d", n, stream))
        ctypes.memmove(dst, src, n)
        return 0

    def cuStreamCreate(self, ptr, flags):
        self.calls.append(("create", flags))
        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_void_p))[0] = 1234
        return 0

    def cuStreamSynchronize(self, s):
        self.calls.append(("sync", s.value))
        return 0

    def cuCtxSynchronize(self):
        self.calls.append(("ctx",))
        return 0

    def cuGetErrorString(self, rc, msg):
        return 0


class _FakeDriver(Driver):
    def __init__(self):
        self.lib, self.missing = _FakeLib(), []


class _Dev:
    def sync(self):
        pass


def test_driver_copies_move_the_planned_bytes_on_one_stream():
    rng = np.random.default_rng(1)
    arena, allocs = _fragmented_arena(rng)
    parts = [KV, MTP]
    mem = _Memory(rng, parts, 64, arena)
    cp = DriverBulkCopy(_Dev(), driver=_FakeDriver())
    lib = cp.drv.lib
    assert lib.calls == [("create", 1)]  # a non-blocking stream
    dev = [_Buf(a) for a in mem.dev]
    host = {ci: _Buf(a) for ci, a in mem.host.items()}
    alloc = allocs[2]
    src = list(range(20, 20 + alloc.n_pages))
    copies = plan_transfer(src, _pieces(arena, alloc), parts, mem.chunk_pages)
    assert len(copies) == 2 * len(arena.chunk_ranges(alloc))  # one run per host piece: ascending device ids
    cp.drain()
    for c in copies:
        cp.d2h(dev[c.part], c.dev_offset, host[c.chunk], c.host_offset, c.nbytes)
    cp.finish()
    assert lib.calls[1] == ("ctx",) and lib.calls[-1] == ("sync", 1234)
    assert all(c[2].value == 1234 for c in lib.calls if c[0] == "d2h")
    want = [mem.dev_page(0, p).copy() for p in src]
    mem.dev[0][:] = 0
    dst = list(range(alloc.n_pages - 1, -1, -1))
    for c in plan_transfer(dst, _pieces(arena, alloc), parts, mem.chunk_pages):
        cp.h2d(host[c.chunk], c.host_offset, dev[c.part], c.dev_offset, c.nbytes)
    for p, w in zip(dst, want):
        np.testing.assert_array_equal(mem.dev_page(0, p), w)
    lib.fail = True
    with pytest.raises(CudaError, match="cuMemcpyDtoHAsync_v2"):
        cp.d2h(dev[0], 0, host[0], 0, 8)
