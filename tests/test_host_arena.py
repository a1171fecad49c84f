"""Tests for ninfer_mlc.runtime.kv.host_arena (pure bookkeeping, no GPU)."""

from __future__ import annotations

import random
import threading

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from ninfer_mlc.runtime.kv.host_arena import (
    Allocation,
    HostArena,
    parse_mem_available,
    read_mem_available,
)

PLENTY = 1 << 50
MIB = 1 << 20


def plenty():
    return PLENTY


def make(**kw) -> HostArena:
    base = dict(
        ceiling_bytes=64 * 4096,
        page_bytes=4096,
        state_slot_bytes=8 * 4096,
        min_state_slots=1,
        reserve_bytes=0,
        meminfo_reader=plenty,
    )
    base.update(kw)
    return HostArena(**base)


# --------------------------------------------------------------------------------------------
# Reference helpers (independent of the implementation)
# --------------------------------------------------------------------------------------------


def min_extent_count(sizes, n):
    """Fewest free extents whose sizes sum to >= n (None if impossible)."""
    acc = 0
    for k, s in enumerate(sorted(sizes, reverse=True), 1):
        acc += s
        if acc >= n:
            return k
    return None


def placeable(sizes, n, scatter, max_extents):
    if any(s >= n for s in sizes):
        return True
    if not scatter:
        return False
    k = min_extent_count(sizes, n)
    return k is not None and (max_extents is None or k <= max_extents)


def check_layout(arena: HostArena):
    """Independent invariants on the public views."""
    cap = arena.kv_capacity_pages
    chunks = arena.chunks()
    # chunks tile [0, cap) in order
    pos = 0
    for i, c in enumerate(chunks):
        assert c.index == i and c.start_page == pos and c.n_pages > 0
        pos = c.end_page
    assert pos == cap
    chunk_starts = {c.start_page for c in chunks}
    chunk_of = {}
    for c in chunks:
        for p in range(c.start_page, c.end_page):
            chunk_of[p] = c.index

    owner = [None] * cap
    free = arena.free_extents()
    for off, n in free:
        assert n > 0 and 0 <= off and off + n <= cap, "free extent outside capacity"
        for p in range(off, off + n):
            assert owner[p] is None, f"free extents overlap at page {p}"
            owner[p] = "free"
    for a in arena.live_allocations():
        assert a.n_pages == sum(n for _, n in a.extents) and a.extents
        for off, n in a.extents:
            assert n > 0 and 0 <= off and off + n <= cap, "live extent outside capacity"
            for p in range(off, off + n):
                assert owner[p] is None, f"page {p} double-owned (alloc {a.alloc_id})"
                owner[p] = a.alloc_id
            if arena.split_at_chunks:
                assert chunk_of[off] == chunk_of[off + n - 1], "extent crosses a chunk boundary"
    # free + allocated == capacity (every page owned exactly once)
    assert all(o is not None for o in owner)
    # coalescing: no two adjacent free extents (except across a chunk boundary when split)
    for (o1, s1), (o2, _) in zip(free, free[1:]):
        if o1 + s1 == o2:
            assert arena.split_at_chunks and o2 in chunk_starts, f"uncoalesced free at {o2}"
    if arena.split_at_chunks:
        for off, n in free:
            assert chunk_of[off] == chunk_of[off + n - 1], "free extent crosses a chunk"
    # budget
    slots_cap = arena.state_slots_capacity
    assert cap * arena.page_bytes + slots_cap * arena.state_slot_bytes <= arena.ceiling_bytes
    assert slots_cap >= arena.min_state_slots
    assert all(0 <= i < slots_cap for i in arena.occupied_state_slots())
    # stats agree
    s = arena.stats()
    free_pages = sum(n for _, n in free)
    assert s["capacity_bytes"] == cap * arena.page_bytes
    assert s["free_bytes"] == free_pages * arena.page_bytes
    assert s["allocated_bytes"] == s["capacity_bytes"] - s["free_bytes"]
    assert s["largest_free_run_bytes"] == max((n for _, n in free), default=0) * arena.page_bytes
    assert s["chunks"] == len(chunks)
    assert s["free_extents"] == len(free)
    assert s["state_slots_capacity"] == slots_cap
    assert s["state_slots_occupied"] == len(arena.occupied_state_slots())
    assert s["pinned_bytes"] <= arena.ceiling_bytes
    assert s["grow_refusals"] == sum(s["grow_refusals_by_reason"].values())
    arena.check_invariants()


# --------------------------------------------------------------------------------------------
# Stateful test
# --------------------------------------------------------------------------------------------


class ArenaMachine(RuleBasedStateMachine):
    allocs = Bundle("allocs")
    slots = Bundle("slots")

    @initialize(
        page_bytes=st.sampled_from([1, 16, 4096]),
        ceiling_pages=st.integers(8, 96),
        ceiling_slack=st.integers(0, 15),
        slot_pages=st.integers(1, 6),
        slot_slack=st.integers(0, 15),
        min_slots=st.integers(0, 3),
        initial_frac=st.sampled_from([None, 0, 1, 8]),
        chunk_pages=st.integers(1, 8),
        scatter=st.booleans(),
        max_extents=st.sampled_from([None, 1, 2, 3]),
        split=st.booleans(),
    )
    def setup(self, page_bytes, ceiling_pages, ceiling_slack, slot_pages, slot_slack, min_slots,
              initial_frac, chunk_pages, scatter, max_extents, split):
        ceiling = ceiling_pages * page_bytes + ceiling_slack % page_bytes
        slot_bytes = slot_pages * page_bytes + slot_slack % page_bytes
        min_slots = min(min_slots, (ceiling // 2) // slot_bytes)
        self.reserve = 1000 * page_bytes
        self.mem = PLENTY
        self.backing_ok = True
        self.pinned_chunks = []
        self.ceiling = ceiling
        initial = None if initial_frac is None else initial_frac * page_bytes
        self.arena = HostArena(
            ceiling_bytes=ceiling,
            page_bytes=page_bytes,
            state_slot_bytes=slot_bytes,
            min_state_slots=min_slots,
            reserve_bytes=self.reserve,
            initial_kv_bytes=initial,
            grow_chunk_bytes=chunk_pages * page_bytes,
            scatter=scatter,
            max_extents=max_extents,
            split_at_chunks=split,
            meminfo_reader=self.read_mem,
            on_kv_grow=self.on_kv_grow,
            on_state_resize=self.on_state_resize,
        )
        self.P = page_bytes
        self.slot_bytes = slot_bytes
        self.min_slots = min_slots
        self.max_kv_pages_seen = self.arena.kv_capacity_pages

    def on_kv_grow(self, chunk):
        if self.backing_ok:
            self.pinned_chunks.append(chunk)
        return self.backing_ok

    def on_state_resize(self, old, new):
        return self.backing_ok or new < old  # a release cannot be vetoed

    def read_mem(self):
        if self.mem == "raise":
            raise OSError("boom")
        return self.mem

    # -- KV -----------------------------------------------------------------------------

    @rule(target=allocs, n=st.integers(1, 40))
    def alloc(self, n):
        a = self.arena
        pre_free = a.free_extents()
        pre_sizes = [s for _, s in pre_free]
        pre_cap = a.kv_capacity_pages
        pre_stats = a.stats()
        pre_slots = a.occupied_state_slots()
        could_place = placeable(pre_sizes, n, a.scatter, a.max_extents)
        assert a.can_place(n) == could_place

        res = a.alloc_pages(n)
        post_cap = a.kv_capacity_pages
        st_ = a.stats()
        grew = post_cap > pre_cap

        # state slot occupancy is never touched by a KV allocation
        assert a.occupied_state_slots() == pre_slots
        # fragmented-miss definition: enough free pages, no placement without growth
        frag = sum(pre_sizes) >= n and not could_place
        assert st_["fragmented_misses"] - pre_stats["fragmented_misses"] == int(frag)
        # growth only when needed, and only when meminfo allowed it
        if grew:
            assert not could_place, "grew although the request fit"
            assert isinstance(self.mem, int)
            assert self.mem - (post_cap - pre_cap) * self.P >= self.reserve
            assert st_["grows"] == pre_stats["grows"] + 1
            assert st_["chunks"] == pre_stats["chunks"] + 1
        else:
            assert st_["grows"] == pre_stats["grows"]

        if res is None:
            assert not could_place and not grew
            assert st_["allocation_refusals"] == pre_stats["allocation_refusals"] + 1
            assert st_["grow_refusals"] == pre_stats["grow_refusals"] + 1
            assert st_["last_veto"].split(":")[0] in HostArena.VETO_CODES
            return multiple()

        assert isinstance(res, Allocation) and res.n_pages == n
        # the free list at placement time (pre list, plus the grown region)
        place_free = list(pre_free)
        if grew:
            new = (pre_cap, post_cap - pre_cap)
            if not a.split_at_chunks:
                trailing = [e for e in place_free if e[0] + e[1] == pre_cap]
                if trailing:
                    place_free.remove(trailing[0])
                    new = (trailing[0][0], trailing[0][1] + new[1])
            place_free.append(new)
        sizes = [s for _, s in place_free]

        def containing(ext):
            off, m = ext
            hits = [e for e in place_free if e[0] <= off and off + m <= e[0] + e[1]]
            assert len(hits) == 1, f"extent {ext} not carved from one free extent"
            return hits[0]

        if len(res.extents) == 1:
            src = containing(res.extents[0])
            assert src[1] == min(s for s in sizes if s >= n), "best fit not the tightest"
        else:
            assert a.scatter, "multi-extent allocation with scatter disabled"
            assert all(s < n for s in sizes), "multi-extent used although one extent fit"
            assert len(res.extents) == min_extent_count(sizes, n), "not the fewest extents"
            if a.max_extents is not None:
                assert len(res.extents) <= a.max_extents
            srcs = [containing(e) for e in res.extents]
            assert len(set(srcs)) == len(srcs)
        assert list(res.extents) == sorted(res.extents)
        br = res.byte_ranges()
        assert br == [(o * self.P, m * self.P) for o, m in res.extents]
        assert sum(length for _, _, length in a.chunk_ranges(res)) == n * self.P
        return res

    @rule(alloc=consumes(allocs))
    def free(self, alloc):
        pre_free_pages = self.arena.stats()["free_pages"]
        self.arena.free(alloc)
        assert self.arena.stats()["free_pages"] == pre_free_pages + alloc.n_pages
        with pytest.raises(ValueError):
            self.arena.free(alloc)

    # -- state slots ------------------------------------------------------------------------

    @rule(target=slots)
    def alloc_slot(self):
        a = self.arena
        pre_cap = a.state_slots_capacity
        pre_occ = set(a.occupied_state_slots())
        free_idx = sorted(set(range(pre_cap)) - pre_occ)
        i = a.alloc_state_slot()
        if free_idx:
            assert i == free_idx[0], "not the lowest free slot"
            assert a.state_slots_capacity == pre_cap
        elif i is None:
            assert a.state_slots_capacity == pre_cap
            assert a.stats()["last_veto"].split(":")[0] in HostArena.VETO_CODES
        else:
            assert i == pre_cap and a.state_slots_capacity == pre_cap + 1
            assert isinstance(self.mem, int) and self.mem - self.slot_bytes >= self.reserve
        if i is None:
            return multiple()
        assert i not in pre_occ
        assert a.state_slot_range(i) == (i * self.slot_bytes, self.slot_bytes)
        return i

    @rule(i=consumes(slots))
    def free_slot(self, i):
        self.arena.free_state_slot(i)
        with pytest.raises(ValueError):
            self.arena.free_state_slot(i)

    @rule()
    def shrink(self):
        a = self.arena
        pre_cap = a.state_slots_capacity
        occ = a.occupied_state_slots()
        released = a.shrink_state_slots()
        expected = max(self.min_slots, (max(occ) + 1) if occ else 0)
        assert a.state_slots_capacity == expected, "shrink must release exactly the free tail"
        assert released == pre_cap - expected
        assert a.occupied_state_slots() == occ

    # -- environment --------------------------------------------------------------------

    @rule(mode=st.sampled_from(["plenty", "tight", "none", "raise", "garbage"]), extra=st.integers(0, 40))
    def set_meminfo(self, mode, extra):
        self.mem = {
            "plenty": PLENTY,
            "tight": self.reserve + extra * self.P,
            "none": None,
            "raise": "raise",
            "garbage": 3.5,
        }[mode]

    @rule(ok=st.booleans())
    def set_backing(self, ok):
        self.backing_ok = ok

    # -- invariants ---------------------------------------------------------------------

    @invariant()
    def layout(self):
        check_layout(self.arena)

    @invariant()
    def chunks_match_pinned_buffers(self):
        # every chunk after the initial one was confirmed by the backing hook
        chunks = self.arena.chunks()
        initial = len(chunks) - len(self.pinned_chunks)
        assert initial in (0, 1) and chunks[initial:] == self.pinned_chunks

    @invariant()
    def kv_growth_is_permanent(self):
        cap = self.arena.kv_capacity_pages
        assert cap >= self.max_kv_pages_seen
        self.max_kv_pages_seen = cap


TestArenaStateful = ArenaMachine.TestCase
TestArenaStateful.settings = settings(
    max_examples=300,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


# --------------------------------------------------------------------------------------------
# meminfo parsing / fail-closed growth
# --------------------------------------------------------------------------------------------


def test_parse_mem_available():
    text = "MemTotal:       32000000 kB\nMemFree:  100 kB\nMemAvailable:   16000000 kB\n"
    assert parse_mem_available(text) == 16000000 * 1024
    assert parse_mem_available("MemTotal: 5 kB\n") is None
    assert parse_mem_available("MemAvailable: lots kB\n") is None
    assert parse_mem_available("MemAvailable: 12 MB\n") is None
    assert parse_mem_available("MemAvailable: -3 kB\n") is None
    assert parse_mem_available("") is None


def test_read_mem_available(tmp_path):
    p = tmp_path / "meminfo"
    p.write_text("MemAvailable:   2048 kB\n")
    assert read_mem_available(str(p)) == 2048 * 1024
    assert read_mem_available(str(tmp_path / "missing")) is None
    p.write_bytes(b"\xff\xfe garbage")
    assert read_mem_available(str(p)) is None
    real = read_mem_available()  # the host's own /proc/meminfo, if Linux
    assert real is None or real >= 0


def _grow_once(arena: HostArena):
    """Fill the initial arena, then ask for one more page (forces a growth)."""
    first = arena.alloc_pages(arena.kv_capacity_pages)
    assert first is not None
    return arena.alloc_pages(1)


@pytest.mark.parametrize(
    "reader, code",
    [
        (lambda: None, "meminfo"),
        (lambda: (_ for _ in ()).throw(OSError("no /proc")), "meminfo"),
        (lambda: "16000000", "meminfo"),
        (lambda: -1, "meminfo"),
    ],
)
def test_growth_fails_closed_when_meminfo_unreadable(reader, code):
    a = make(meminfo_reader=reader)
    cap = a.kv_capacity_pages
    assert _grow_once(a) is None
    s = a.stats()
    assert a.kv_capacity_pages == cap
    assert s["grows"] == 0 and s["grow_refusals"] == 1 and s["allocation_refusals"] == 1
    assert s["grow_refusals_by_reason"][code] == 1
    assert s["last_veto"].startswith(code + ":")


def test_growth_fails_closed_on_unreadable_meminfo_file(tmp_path):
    path = str(tmp_path / "nope")
    a = make(meminfo_reader=lambda: read_mem_available(path))
    assert _grow_once(a) is None
    assert a.stats()["last_veto"].startswith("meminfo:")


def test_growth_reserve_boundary():
    P = 4096
    reserve = 100 * P
    # chunk = 4 pages; growth for 1 page rounds up to one chunk of 4 pages
    for avail, ok in [(reserve + 4 * P, True), (reserve + 4 * P - 1, False), (reserve, False)]:
        a = make(reserve_bytes=reserve, grow_chunk_bytes=4 * P, meminfo_reader=lambda v=avail: v)
        cap = a.kv_capacity_pages
        got = _grow_once(a)
        s = a.stats()
        if ok:
            assert got is not None and a.kv_capacity_pages == cap + 4
            assert s["grows"] == 1 and s["chunks"] == 2 and s["last_veto"] == ""
        else:
            assert got is None and a.kv_capacity_pages == cap
            assert s["grow_refusals_by_reason"]["reserve"] == 1
            assert s["last_veto"].startswith("reserve:")


def test_growth_refused_at_ceiling():
    P = 4096
    a = make(ceiling_bytes=16 * P, state_slot_bytes=4 * P, min_state_slots=1,
             grow_chunk_bytes=4 * P)
    assert a.kv_capacity_pages == 4  # a quarter of the ceiling
    big = a.alloc_pages(4)
    assert a.alloc_pages(8) is not None  # grows to 12 pages: 12 + 4 (slot) = 16
    assert a.kv_capacity_pages == 12
    assert a.alloc_pages(1) is None
    s = a.stats()
    assert s["grow_refusals_by_reason"]["ceiling"] == 1 and s["last_veto"].startswith("ceiling:")
    assert s["pinned_bytes"] == 16 * P and s["budget_left_bytes"] == 0
    a.free(big)


def test_growth_chunk_capped_by_budget():
    P = 1
    a = make(ceiling_bytes=20, page_bytes=P, state_slot_bytes=2, min_state_slots=1,
             initial_kv_bytes=4, grow_chunk_bytes=10)
    a.alloc_pages(4)
    got = a.alloc_pages(3)  # wants a 10-page chunk, only 14 bytes left: chunk = 10
    assert got is not None and a.kv_capacity_pages == 14
    got = a.alloc_pages(5)  # 4 left in budget, needs 5 - 7 free... total free = 7 >= 5
    assert got is not None and a.kv_capacity_pages == 14
    got = a.alloc_pages(4)  # free = 2, budget 4: grows by min(10, 4) = 4 >= need 2
    assert got is not None and a.kv_capacity_pages == 18
    assert a.stats()["pinned_bytes"] == 20


def test_kv_growth_releases_trailing_free_state_slots():
    P = 4096
    a = make(ceiling_bytes=16 * P, state_slot_bytes=2 * P, min_state_slots=1,
             grow_chunk_bytes=2 * P)
    assert a.kv_capacity_pages == 4
    s0 = a.alloc_state_slot()
    s1 = a.alloc_state_slot()  # grows the pool to 2 slots
    s2 = a.alloc_state_slot()  # 3 slots = 6 pages of budget
    assert (s0, s1, s2) == (0, 1, 2) and a.state_slots_capacity == 3
    a.free_state_slot(s1)
    a.free_state_slot(s2)
    # budget left: 16 - 4 - 6 = 6 pages. Fill the KV arena, then ask for more pages.
    keep = a.alloc_pages(4)
    got = a.alloc_pages(8)  # needs 8 pages, 6 left: releases only trailing slot 2
    assert got is not None and a.state_slots_capacity == 2
    a.free(got)  # 8 free pages in chunk 1; budget left 0
    assert a.alloc_pages(12) is None  # needs 4 more pages = 2 slots; only slot 1 is free
    assert a.state_slots_capacity == 2  # a refused growth releases nothing
    got = a.alloc_pages(10)  # scatter 8 + needs 2 more: releases slot 1
    assert got is not None
    assert a.state_slots_capacity == 1 and a.occupied_state_slots() == [0]
    assert a.stats()["state_slots_released"] == 2
    check_layout(a)
    a.free(keep)


def test_kv_growth_does_not_release_occupied_or_floor_slots():
    P = 4096
    a = make(ceiling_bytes=16 * P, state_slot_bytes=2 * P, min_state_slots=2,
             grow_chunk_bytes=2 * P)
    a.alloc_state_slot(), a.alloc_state_slot(), a.alloc_state_slot()
    a.free_state_slot(1)  # a hole, but the tail (slot 2) is occupied
    a.alloc_pages(a.kv_capacity_pages)
    assert a.alloc_pages(16) is None
    assert a.state_slots_capacity == 3
    assert a.stats()["last_veto"].startswith("ceiling:")


def test_backing_hook_veto_and_notification():
    seen = []

    def on_grow(chunk):
        seen.append(chunk)
        return len(seen) > 1  # refuse the first pin, accept later ones

    resizes = []
    a = make(on_kv_grow=on_grow, on_state_resize=lambda o, n: resizes.append((o, n)))
    a.alloc_pages(a.kv_capacity_pages)
    assert a.alloc_pages(1) is None
    assert a.stats()["last_veto"].startswith("backing:")
    got = a.alloc_pages(1)
    assert got is not None and seen[-1].index == 1 and seen[-1].start_page == 16
    assert a.chunks()[1] == seen[-1]
    assert a.chunk_ranges(got) == [(1, 0, 4096)]
    assert a.locate(16) == (1, 0)
    i = a.alloc_state_slot()
    j = a.alloc_state_slot()
    assert (i, j) == (0, 1) and resizes == [(1, 2)]
    a.free_state_slot(j)
    assert a.shrink_state_slots() == 1 and resizes[-1] == (2, 1)


def test_state_slot_growth_fails_closed():
    a = make(meminfo_reader=lambda: None, min_state_slots=1)
    assert a.alloc_state_slot() == 0
    assert a.alloc_state_slot() is None
    assert a.state_slots_capacity == 1
    assert a.stats()["last_veto"].startswith("meminfo:")


# --------------------------------------------------------------------------------------------
# placement
# --------------------------------------------------------------------------------------------


def test_best_fit_picks_tightest_extent():
    a = make(ceiling_bytes=80, page_bytes=1, state_slot_bytes=1, min_state_slots=0,
             initial_kv_bytes=40, meminfo_reader=lambda: None)
    # carve holes of sizes 5, 3, 8 separated by live pages
    parts = [a.alloc_pages(k) for k in (5, 1, 3, 1, 8, 1)]
    rest = a.alloc_pages(a.stats()["free_pages"])
    for p in (parts[0], parts[2], parts[4]):
        a.free(p)
    assert sorted(s for _, s in a.free_extents()) == [3, 5, 8]
    got = a.alloc_pages(4)
    assert got.extents == ((0, 4),)  # the 5-hole, not the 8-hole
    got2 = a.alloc_pages(3)
    assert got2.extents == ((6, 3),)
    del rest


def test_scatter_gather_fewest_extents_and_last_piece_best_fit():
    a = make(ceiling_bytes=80, page_bytes=1, state_slot_bytes=1, min_state_slots=0,
             initial_kv_bytes=40, meminfo_reader=lambda: None)
    sizes = [2, 7, 4, 6, 3]
    parts = []
    for k in sizes:
        parts.append(a.alloc_pages(k))
        parts.append(a.alloc_pages(1))
    a.alloc_pages(a.stats()["free_pages"])
    for p in parts[0::2]:
        a.free(p)
    # 10 pages: 7 (largest) + 3 (tightest holding the rest of 3) -> 2 extents
    got = a.alloc_pages(10)
    assert got is not None and got.scattered
    assert sorted(n for _, n in got.extents) == [3, 7]
    assert sorted(s for _, s in a.free_extents()) == [2, 4, 6]
    assert a.stats()["scatter_allocations"] == 1
    assert a.stats()["fragmented_misses"] == 0


def test_fragmented_miss_without_scatter_and_with_max_extents():
    for kw in ({"scatter": False}, {"max_extents": 2}):
        a = make(ceiling_bytes=40, page_bytes=1, state_slot_bytes=1, min_state_slots=0,
                 initial_kv_bytes=12, meminfo_reader=lambda: None, **kw)
        parts = [a.alloc_pages(1) for _ in range(12)]
        for p in parts[0::2]:
            a.free(p)  # six isolated 1-page holes
        assert a.stats()["free_pages"] == 6 and a.stats()["largest_free_run_bytes"] == 1
        assert a.alloc_pages(3) is None
        s = a.stats()
        assert s["fragmented_misses"] == 1 and s["allocation_refusals"] == 1
        assert a.alloc_pages(7) is None  # not enough free at all: not a fragmented miss
        assert a.stats()["fragmented_misses"] == 1


def test_free_coalesces_neighbours():
    a = make(ceiling_bytes=64, page_bytes=1, state_slot_bytes=1, min_state_slots=0,
             initial_kv_bytes=16)
    x, y, z = a.alloc_pages(4), a.alloc_pages(4), a.alloc_pages(4)
    a.free(x)
    a.free(z)
    assert a.free_extents() == [(0, 4), (8, 8)]
    a.free(y)
    assert a.free_extents() == [(0, 16)]
    with pytest.raises(ValueError):
        a.free(y)


def test_no_coalescing_across_chunks_when_split():
    for split, expect in ((True, [(0, 4), (4, 4)]), (False, [(0, 8)])):
        a = make(ceiling_bytes=64, page_bytes=1, state_slot_bytes=1, min_state_slots=0,
                 initial_kv_bytes=4, grow_chunk_bytes=4, split_at_chunks=split)
        x = a.alloc_pages(4)
        y = a.alloc_pages(4)  # forces one growth
        assert a.stats()["chunks"] == 2
        a.free(x)
        a.free(y)
        assert a.free_extents() == expect
        got = a.alloc_pages(6)  # split: needs scatter (4+... no: 4+4 > 6 -> 2 extents)
        if split:
            assert got.scattered and a.chunk_ranges(got)[0][0] != a.chunk_ranges(got)[-1][0]
        else:
            assert got.extents == ((0, 6),)
            assert a.chunk_ranges(got) == [(0, 0, 4), (1, 0, 2)]


def test_invalid_arguments():
    with pytest.raises(ValueError):
        make(ceiling_bytes=0)
    with pytest.raises(ValueError):
        make(min_state_slots=100)  # floor exceeds the ceiling
    with pytest.raises(ValueError):
        make(max_extents=0)
    a = make()
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError):
            a.alloc_pages(bad)
    with pytest.raises(ValueError):
        a.free_state_slot(0)
    with pytest.raises(IndexError):
        a.state_slot_range(99)
    with pytest.raises(IndexError):
        a.locate(a.kv_capacity_pages)


# --------------------------------------------------------------------------------------------
# state slots
# --------------------------------------------------------------------------------------------


def test_state_slots_floor_and_trailing_only_shrink():
    a = make(ceiling_bytes=64 * 4096, state_slot_bytes=4096, min_state_slots=2)
    assert a.state_slots_capacity == 2
    ids = [a.alloc_state_slot() for _ in range(5)]
    assert ids == [0, 1, 2, 3, 4] and a.state_slots_capacity == 5
    a.free_state_slot(2)  # a hole in the middle: nothing to shrink
    assert a.shrink_state_slots() == 0 and a.state_slots_capacity == 5
    assert a.alloc_state_slot() == 2  # lowest free index is reused
    a.free_state_slot(2)
    a.free_state_slot(4)
    assert a.shrink_state_slots() == 1 and a.state_slots_capacity == 4
    a.free_state_slot(3)
    assert a.shrink_state_slots() == 2 and a.state_slots_capacity == 2  # slots 3 and 2
    for i in (0, 1):
        a.free_state_slot(i)
    assert a.shrink_state_slots() == 0 and a.state_slots_capacity == 2  # floor
    s = a.stats()
    assert s["state_slots_occupied"] == 0 and s["state_slots_min"] == 2
    assert s["state_grows"] == 3 and s["state_slots_released"] == 3


def test_state_slot_growth_limited_by_ceiling():
    P = 4096
    a = make(ceiling_bytes=16 * P, state_slot_bytes=5 * P, min_state_slots=1)
    # KV arena has 4 pages, 1 slot = 5 pages: 7 pages left -> one more slot, not two
    assert [a.alloc_state_slot() for _ in range(3)] == [0, 1, None]
    assert a.stats()["last_veto"].startswith("ceiling:")


# --------------------------------------------------------------------------------------------
# stats / thread safety / cli
# --------------------------------------------------------------------------------------------


def test_stats_fields():
    a = make()
    s = a.stats()
    for key in (
        "capacity_bytes", "free_bytes", "largest_free_run_bytes", "chunks", "grows",
        "grow_refusals", "allocation_refusals", "fragmented_misses", "state_slots_capacity",
        "state_slots_occupied", "last_veto", "ceiling_bytes", "pinned_bytes", "budget_left_bytes",
        "scatter_allocations", "grow_refusals_by_reason", "contiguous_free_fraction",
    ):
        assert key in s, key
    assert s["capacity_bytes"] == 16 * 4096  # a quarter of 64 pages
    assert s["free_bytes"] == s["capacity_bytes"] == s["largest_free_run_bytes"]
    assert s["chunks"] == 1 and s["grows"] == 0 and s["last_veto"] == ""
    assert s["state_slots_capacity"] == 1 and s["state_slots_occupied"] == 0
    assert s["pinned_bytes"] == 16 * 4096 + 8 * 4096


def test_from_cli():
    a = HostArena.from_cli(host_kv_mib=1024, host_state_slots=2, host_ram_reserve_mib=4096,
                           page_bytes=64 * 33792, state_slot_bytes=151 * MIB,
                           meminfo_reader=plenty)
    s = a.stats()
    assert s["ceiling_bytes"] == 1024 * MIB and s["reserve_bytes"] == 4096 * MIB
    assert s["state_slots_capacity"] == 2
    assert s["capacity_bytes"] <= 256 * MIB and s["capacity_bytes"] % (64 * 33792) == 0


def test_thread_safety_smoke():
    a = make(ceiling_bytes=4096 * 4096, state_slot_bytes=64 * 4096, min_state_slots=2,
             grow_chunk_bytes=64 * 4096)
    errors = []

    def worker(seed):
        rng = random.Random(seed)
        mine, slots = [], []
        try:
            for _ in range(400):
                r = rng.random()
                if r < 0.45:
                    got = a.alloc_pages(rng.randint(1, 24))
                    if got is not None:
                        mine.append(got)
                elif r < 0.8 and mine:
                    a.free(mine.pop(rng.randrange(len(mine))))
                elif r < 0.88:
                    i = a.alloc_state_slot()
                    if i is not None:
                        slots.append(i)
                elif r < 0.95 and slots:
                    a.free_state_slot(slots.pop())
                else:
                    a.stats()
                    a.shrink_state_slots()
            for m in mine:
                a.free(m)
            for i in slots:
                a.free_state_slot(i)
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    check_layout(a)
    s = a.stats()
    assert s["free_bytes"] == s["capacity_bytes"] and s["live_allocations"] == 0
    # fully free: one free extent per chunk
    assert s["free_extents"] == s["chunks"]
    assert a.shrink_state_slots() >= 0 and a.state_slots_capacity == 2
