"""Host-tier pinned-memory bookkeeping: one elastic budget shared by a KV page arena and
fixed-size recurrent-state slots.

This module is pure Python and touches no GPU or buffer: it decides *where* things go and
*whether* the pinned footprint may grow. The caller owns the actual pinned buffers and maps
them onto the ranges reported here (``Chunk`` / ``Allocation.byte_ranges`` /
``HostArena.chunk_ranges`` / ``HostArena.state_slot_range``).

Budget
------
One ceiling (``ceiling_bytes``, ``--host-kv-mib``) covers both clients::

    kv_capacity_pages * page_bytes + state_slots_capacity * state_slot_bytes <= ceiling_bytes

* The KV arena starts at ``initial_kv_bytes`` (default: a quarter of the ceiling, floored to
  whole pages and to what the state-slot floor leaves) and grows on demand, one *chunk* per
  growth. A chunk is a multiple of ``grow_chunk_bytes`` (default ``ceiling/16``), large enough
  for the request that triggered it, capped by the budget left. KV growth is permanent.
* The state pool starts at ``min_state_slots`` (``--host-state-slots``), grows one slot at a
  time when every slot is occupied, and shrinks trailing-only (only free slots at the end of
  the pool are released), never below the floor. When a KV growth does not fit the budget, the
  arena first releases trailing free state slots above the floor (only if that makes the
  growth fit); those slots are idle pinned memory.

Growth policy (fail closed)
---------------------------
Every growth (KV chunk or state slot) is vetoed unless all of these hold, checked in order:

1. ``ceiling``  - the budget (after the optional trailing state-slot release) has room;
2. ``meminfo``  - the injectable reader returned MemAvailable in bytes (an unreadable or
   unparsable /proc/meminfo, a reader exception or a non-int result vetoes the growth);
3. ``reserve``  - ``MemAvailable - growth_bytes >= reserve_bytes`` (``--host-ram-reserve-mib``).
   Bytes released by the state-slot shrink are *not* credited (conservative);
4. ``backing``  - the optional ``on_kv_grow`` / ``on_state_resize`` hook (which would pin the
   new buffer) did not raise and did not return ``False``.

Each veto increments ``grow_refusals`` (and ``grow_refusals_by_reason[code]``) and sets
``last_veto`` to ``"<code>: <detail>"``.

KV placement policy
-------------------
Pages are addressed by a global page offset in ``[0, kv_capacity_pages)``; chunks tile that
space in growth order. With ``split_at_chunks=True`` (default; each chunk is a separate pinned
buffer) no extent ever crosses a chunk boundary and free extents are not coalesced across one.
With ``split_at_chunks=False`` the caller promises a contiguous backing (e.g. one reserved
virtual range registered piecewise), so chunk boundaries are ignored.

``alloc_pages(n)``:

1. *best fit*: the tightest free extent with ``size >= n`` (lowest offset among equal sizes);
   the allocation takes its first ``n`` pages.
2. otherwise, if ``scatter`` is on and total free >= n, a *scatter-gather* allocation from the
   fewest extents: take the largest free extents whole until the remainder ``r`` fits in one
   more, then take the tightest extent holding ``r`` for that last piece (this count is the
   minimum possible). Vetoed if the count exceeds ``max_extents``. Extents are returned sorted
   by offset; the allocation's logical page order is the concatenation in list order.
3. otherwise grow (sized so that step 1 or 2 then succeeds) and place again;
4. otherwise return ``None`` (``allocation_refusals += 1``).

``fragmented_misses`` counts requests for which total free pages >= n but steps 1-2 could not
place them in the existing capacity (scatter disabled, or more than ``max_extents`` extents
needed), whether or not a growth then rescued them: capacity was there, the layout was not.
``scatter_allocations`` counts allocations served with more than one extent.

``free(alloc)`` returns every extent and coalesces it with free neighbours (within a chunk when
``split_at_chunks``), so no two free extents are ever adjacent. Free extents live in a list
sorted by ``(size, offset)`` (``bisect``: O(log n) best-fit search) plus start/end dicts for
O(1) neighbour lookup.

State slots
-----------
``alloc_state_slot()`` returns the lowest free slot index (which keeps the tail free, so the
pool can shrink), growing the pool by one slot if every slot is occupied.
``state_slot_range(i)`` is ``(i * state_slot_bytes, state_slot_bytes)`` in the state pool's
own byte space.

Thread safety
-------------
Every public method takes one re-entrant lock, so the scheduler thread and HTTP threads may
call ``stats()`` while allocations happen. Hooks run under that lock.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

__all__ = [
    "MEMINFO_PATH",
    "Allocation",
    "Chunk",
    "HostArena",
    "parse_mem_available",
    "read_mem_available",
]

MEMINFO_PATH = "/proc/meminfo"
_MIB = 1 << 20

Extent = Tuple[int, int]  # (offset_pages, n_pages)
MeminfoReader = Callable[[], Optional[int]]


# --------------------------------------------------------------------------------------------
# /proc/meminfo
# --------------------------------------------------------------------------------------------


def parse_mem_available(text: str) -> Optional[int]:
    """MemAvailable in bytes from /proc/meminfo text, or ``None`` if absent or malformed.

    Strict on purpose (the caller fails closed on ``None``): the line must read
    ``MemAvailable: <non-negative int> kB``.
    """
    for line in text.splitlines():
        if not line.startswith("MemAvailable:"):
            continue
        parts = line.split()
        if len(parts) != 3 or parts[2] != "kB":
            return None
        try:
            kib = int(parts[1])
        except ValueError:
            return None
        if kib < 0:
            return None
        return kib * 1024
    return None


def read_mem_available(path: str = MEMINFO_PATH) -> Optional[int]:
    """Read MemAvailable (bytes) from ``path``; ``None`` if it cannot be read or parsed."""
    try:
        with open(path, "r", encoding="ascii", errors="strict") as fh:
            text = fh.read()
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return parse_mem_available(text)


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Chunk:
    """One growth unit of the KV arena (one pinned buffer on the caller's side)."""

    index: int
    start_page: int
    n_pages: int
    page_bytes: int

    @property
    def end_page(self) -> int:
        return self.start_page + self.n_pages

    @property
    def start_byte(self) -> int:
        return self.start_page * self.page_bytes

    @property
    def n_bytes(self) -> int:
        return self.n_pages * self.page_bytes


@dataclass(frozen=True)
class Allocation:
    """A live KV allocation: ``extents`` is a tuple of ``(offset_pages, n_pages)``."""

    alloc_id: int
    extents: Tuple[Extent, ...]
    page_bytes: int

    @property
    def n_pages(self) -> int:
        return sum(n for _, n in self.extents)

    @property
    def n_bytes(self) -> int:
        return self.n_pages * self.page_bytes

    @property
    def scattered(self) -> bool:
        return len(self.extents) > 1

    def byte_ranges(self) -> List[Tuple[int, int]]:
        """``(byte_offset, byte_length)`` per extent in the arena's global byte space."""
        pb = self.page_bytes
        return [(off * pb, n * pb) for off, n in self.extents]

    def pages(self) -> List[int]:
        """Global page offsets in logical order (for small allocations / debugging)."""
        out: List[int] = []
        for off, n in self.extents:
            out.extend(range(off, off + n))
        return out


# --------------------------------------------------------------------------------------------
# Arena
# --------------------------------------------------------------------------------------------


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class HostArena:
    """Elastic pinned host budget shared by a KV page arena and state slots (see module doc)."""

    VETO_CODES = ("ceiling", "meminfo", "reserve", "backing")

    def __init__(
        self,
        *,
        ceiling_bytes: int,
        page_bytes: int,
        state_slot_bytes: int,
        min_state_slots: int = 0,
        reserve_bytes: int = 0,
        initial_kv_bytes: Optional[int] = None,
        grow_chunk_bytes: Optional[int] = None,
        scatter: bool = True,
        max_extents: Optional[int] = None,
        split_at_chunks: bool = True,
        meminfo_reader: Optional[MeminfoReader] = None,
        on_kv_grow: Optional[Callable[[Chunk], object]] = None,
        on_state_resize: Optional[Callable[[int, int], object]] = None,
    ) -> None:
        for name, v in (
            ("ceiling_bytes", ceiling_bytes),
            ("page_bytes", page_bytes),
            ("state_slot_bytes", state_slot_bytes),
        ):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(min_state_slots, int) or min_state_slots < 0:
            raise ValueError(f"min_state_slots must be a non-negative int, got {min_state_slots!r}")
        if not isinstance(reserve_bytes, int) or reserve_bytes < 0:
            raise ValueError(f"reserve_bytes must be a non-negative int, got {reserve_bytes!r}")
        if max_extents is not None and (not isinstance(max_extents, int) or max_extents < 1):
            raise ValueError(f"max_extents must be None or >= 1, got {max_extents!r}")
        state_floor_bytes = min_state_slots * state_slot_bytes
        if state_floor_bytes > ceiling_bytes:
            raise ValueError(
                f"state-slot floor {min_state_slots} x {state_slot_bytes} B = {state_floor_bytes} B "
                f"exceeds the host ceiling {ceiling_bytes} B"
            )

        self.ceiling_bytes = ceiling_bytes
        self.page_bytes = page_bytes
        self.state_slot_bytes = state_slot_bytes
        self.min_state_slots = min_state_slots
        self.reserve_bytes = reserve_bytes
        self.scatter = bool(scatter)
        self.max_extents = max_extents
        self.split_at_chunks = bool(split_at_chunks)
        self._meminfo_reader: MeminfoReader = meminfo_reader or read_mem_available
        self._on_kv_grow = on_kv_grow
        self._on_state_resize = on_state_resize

        if initial_kv_bytes is None:
            initial_kv_bytes = ceiling_bytes // 4
        if initial_kv_bytes < 0:
            raise ValueError("initial_kv_bytes must be >= 0")
        initial_pages = min(initial_kv_bytes, ceiling_bytes - state_floor_bytes) // page_bytes
        if grow_chunk_bytes is None:
            grow_chunk_bytes = ceiling_bytes // 16
        if grow_chunk_bytes < 0:
            raise ValueError("grow_chunk_bytes must be >= 0")
        self.grow_chunk_pages = max(1, grow_chunk_bytes // page_bytes)

        self._lock = threading.RLock()

        # KV arena
        self._kv_pages = 0
        self._chunks: List[Chunk] = []
        self._chunk_starts: List[int] = []  # sorted start pages, for locate()
        self._boundaries: set = set()  # chunk starts (excluding 0) that block coalescing
        self._by_size: List[Tuple[int, int]] = []  # sorted (size, offset)
        self._free_start: Dict[int, int] = {}  # offset -> size
        self._free_end: Dict[int, int] = {}  # end -> offset
        self._free_pages = 0
        self._live: Dict[int, Allocation] = {}
        self._ids = itertools.count(1)

        # State slots
        self._slot_cap = min_state_slots
        self._slot_occupied: set = set()
        self._slot_heap: List[int] = list(range(min_state_slots))  # lazy min-heap of free idx

        # Counters
        self._grows = 0
        self._state_grows = 0
        self._state_slots_released = 0
        self._grow_refusals = 0
        self._grow_refusals_by_reason: Dict[str, int] = {c: 0 for c in self.VETO_CODES}
        self._allocation_refusals = 0
        self._fragmented_misses = 0
        self._scatter_allocations = 0
        self._allocations = 0
        self._last_veto = ""

        if initial_pages > 0:
            self._add_chunk(initial_pages)

    @classmethod
    def from_cli(
        cls,
        *,
        host_kv_mib: int,
        host_state_slots: int,
        host_ram_reserve_mib: int,
        page_bytes: int,
        state_slot_bytes: int,
        **kwargs,
    ) -> "HostArena":
        """Build from the ``--host-kv-mib`` / ``--host-state-slots`` / ``--host-ram-reserve-mib``
        flags (MiB values)."""
        return cls(
            ceiling_bytes=int(host_kv_mib) * _MIB,
            page_bytes=page_bytes,
            state_slot_bytes=state_slot_bytes,
            min_state_slots=int(host_state_slots),
            reserve_bytes=int(host_ram_reserve_mib) * _MIB,
            **kwargs,
        )

    # ---------------------------------------------------------------------------------------
    # free-extent structure
    # ---------------------------------------------------------------------------------------

    def _add_raw(self, off: int, size: int) -> None:
        bisect.insort(self._by_size, (size, off))
        self._free_start[off] = size
        self._free_end[off + size] = off
        self._free_pages += size

    def _remove_raw(self, off: int, size: int) -> None:
        i = bisect.bisect_left(self._by_size, (size, off))
        if i >= len(self._by_size) or self._by_size[i] != (size, off):  # pragma: no cover
            raise AssertionError(f"free extent ({off}, {size}) missing from size index")
        del self._by_size[i]
        del self._free_start[off]
        del self._free_end[off + size]
        self._free_pages -= size

    def _insert_free(self, off: int, size: int) -> None:
        """Insert a free extent, coalescing with free neighbours (not across chunk boundaries
        when ``split_at_chunks``)."""
        end = off + size
        left = self._free_end.get(off)
        if left is not None and off not in self._boundaries:
            lsize = self._free_start[left]
            self._remove_raw(left, lsize)
            off, size = left, size + lsize
        rsize = self._free_start.get(end)
        if rsize is not None and end not in self._boundaries:
            self._remove_raw(end, rsize)
            size += rsize
        self._add_raw(off, size)

    def _take(self, off: int, size: int, n: int) -> Extent:
        """Carve ``n`` pages off the front of free extent ``(off, size)``."""
        self._remove_raw(off, size)
        if size > n:
            # the source extent was maximal, so the remainder has no free neighbour
            self._add_raw(off + n, size - n)
        return (off, n)

    # ---------------------------------------------------------------------------------------
    # placement
    # ---------------------------------------------------------------------------------------

    def _plan(self, n: int) -> Optional[List[Tuple[int, int]]]:
        """Free extents ``(size, offset)`` to use for ``n`` pages, or ``None``. Read-only."""
        by_size = self._by_size
        i = bisect.bisect_left(by_size, (n, -1))
        if i < len(by_size):
            return [by_size[i]]  # best fit
        if not self.scatter or self._free_pages < n:
            return None
        chosen: List[Tuple[int, int]] = []
        acc = 0
        j = len(by_size) - 1
        while acc + by_size[j][0] < n:  # take largest whole while they do not finish the job
            chosen.append(by_size[j])
            acc += by_size[j][0]
            j -= 1
        rest = n - acc  # by_size[j] holds it, so the tightest holder is at index <= j
        k = bisect.bisect_left(by_size, (rest, -1), 0, j + 1)
        chosen.append(by_size[k])
        if self.max_extents is not None and len(chosen) > self.max_extents:
            return None
        return chosen

    def _apply(self, plan: List[Tuple[int, int]], n: int) -> Allocation:
        extents: List[Extent] = []
        remaining = n
        for size, off in plan:
            take = min(size, remaining)
            extents.append(self._take(off, size, take))
            remaining -= take
        assert remaining == 0
        extents.sort()
        alloc = Allocation(next(self._ids), tuple(extents), self.page_bytes)
        self._live[alloc.alloc_id] = alloc
        self._allocations += 1
        if len(extents) > 1:
            self._scatter_allocations += 1
        return alloc

    def _growth_deficit(self, n: int) -> int:
        """Pages a growth must add so that placement of ``n`` pages then succeeds."""
        trailing = 0
        if not self.split_at_chunks:
            t_off = self._free_end.get(self._kv_pages)
            if t_off is not None:
                trailing = self._free_start[t_off]
        single = (not self.scatter) or self.max_extents == 1
        if single:
            need = n - trailing
        elif self.max_extents is None:
            need = n - self._free_pages
        else:
            others = sorted((s for s, _ in self._by_size), reverse=True)
            if trailing:
                others.remove(trailing)
            need = n - trailing - sum(others[: self.max_extents - 1])
        return max(1, need)

    # ---------------------------------------------------------------------------------------
    # growth
    # ---------------------------------------------------------------------------------------

    def _budget_left(self) -> int:
        return (
            self.ceiling_bytes
            - self._kv_pages * self.page_bytes
            - self._slot_cap * self.state_slot_bytes
        )

    def _trailing_free_slots(self) -> int:
        k = 0
        cap = self._slot_cap
        while cap - k > self.min_state_slots and (cap - k - 1) not in self._slot_occupied:
            k += 1
        return k

    def _veto(self, code: str, detail: str) -> None:
        self._grow_refusals += 1
        self._grow_refusals_by_reason[code] += 1
        self._last_veto = f"{code}: {detail}"

    def _meminfo_permits(self, nbytes: int, what: str) -> bool:
        try:
            avail = self._meminfo_reader()
        except Exception as exc:  # fail closed
            self._veto("meminfo", f"reader raised {type(exc).__name__}: {exc}; {what} refused")
            return False
        if not isinstance(avail, int) or isinstance(avail, bool) or avail < 0:
            self._veto("meminfo", f"MemAvailable unreadable ({avail!r}); {what} refused")
            return False
        if avail - nbytes < self.reserve_bytes:
            self._veto(
                "reserve",
                f"MemAvailable {avail} B - {what} {nbytes} B < reserve {self.reserve_bytes} B",
            )
            return False
        return True

    @staticmethod
    def _hook_ok(hook, *args) -> Tuple[bool, str]:
        if hook is None:
            return True, ""
        try:
            res = hook(*args)
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"
        if res is False:
            return False, "hook returned False"
        return True, ""

    def _release_trailing_slots(self, k: int) -> int:
        if k <= 0:
            return 0
        old = self._slot_cap
        self._slot_cap -= k
        self._state_slots_released += k
        if self._on_state_resize is not None:
            self._on_state_resize(old, self._slot_cap)
        return k

    def _add_chunk(self, pages: int) -> Chunk:
        chunk = Chunk(len(self._chunks), self._kv_pages, pages, self.page_bytes)
        self._chunks.append(chunk)
        self._chunk_starts.append(chunk.start_page)
        if self.split_at_chunks and chunk.start_page > 0:
            self._boundaries.add(chunk.start_page)
        self._kv_pages += pages
        self._insert_free(chunk.start_page, pages)
        return chunk

    def _try_grow_kv(self, need: int) -> bool:
        pb = self.page_bytes
        want = _ceil_div(need, self.grow_chunk_pages) * self.grow_chunk_pages
        budget = self._budget_left()
        release = 0
        if budget // pb < need:
            short = need * pb - budget
            release = _ceil_div(short, self.state_slot_bytes)
            if release > self._trailing_free_slots():
                self._veto(
                    "ceiling",
                    f"KV growth of {need * pb} B needs {short} B more than the "
                    f"{budget} B left under the {self.ceiling_bytes} B ceiling",
                )
                return False
            budget += release * self.state_slot_bytes
        pages = max(need, min(want, budget // pb))
        nbytes = pages * pb
        if not self._meminfo_permits(nbytes, "KV growth"):
            return False
        self._release_trailing_slots(release)
        chunk = Chunk(len(self._chunks), self._kv_pages, pages, pb)
        ok, why = self._hook_ok(self._on_kv_grow, chunk)
        if not ok:
            self._veto("backing", f"KV growth of {nbytes} B not pinned: {why}")
            return False
        self._add_chunk(pages)
        self._grows += 1
        return True

    # ---------------------------------------------------------------------------------------
    # KV API
    # ---------------------------------------------------------------------------------------

    def alloc_pages(self, n: int) -> Optional[Allocation]:
        """Allocate ``n`` pages (best fit, else scatter-gather, else grow); ``None`` if refused."""
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            raise ValueError(f"page count must be a positive int, got {n!r}")
        with self._lock:
            plan = self._plan(n)
            if plan is not None:
                return self._apply(plan, n)
            if self._free_pages >= n:
                self._fragmented_misses += 1
            if self._try_grow_kv(self._growth_deficit(n)):
                plan = self._plan(n)
                if plan is not None:
                    return self._apply(plan, n)
            self._allocation_refusals += 1
            return None

    def can_place(self, n: int) -> bool:
        """Whether ``alloc_pages(n)`` would succeed without growing (no side effects)."""
        if n <= 0:
            return False
        with self._lock:
            return self._plan(n) is not None

    def free(self, alloc: Allocation) -> None:
        """Return every extent of a live allocation; raises ``ValueError`` on a double free."""
        with self._lock:
            live = self._live.get(alloc.alloc_id)
            if live is None or live != alloc:
                raise ValueError(f"allocation {alloc.alloc_id} is not live (double free?)")
            del self._live[alloc.alloc_id]
            for off, n in alloc.extents:
                self._insert_free(off, n)

    # ---------------------------------------------------------------------------------------
    # State slots API
    # ---------------------------------------------------------------------------------------

    def alloc_state_slot(self) -> Optional[int]:
        """Lowest free slot index, growing the pool by one slot if needed; ``None`` if vetoed."""
        with self._lock:
            heap = self._slot_heap
            while heap:
                i = heapq.heappop(heap)
                if i < self._slot_cap and i not in self._slot_occupied:
                    self._slot_occupied.add(i)
                    return i
            # every slot occupied: grow by one
            sb = self.state_slot_bytes
            budget = self._budget_left()
            if budget < sb:
                self._veto(
                    "ceiling",
                    f"state slot of {sb} B exceeds the {budget} B left under the "
                    f"{self.ceiling_bytes} B ceiling",
                )
                return None
            if not self._meminfo_permits(sb, "state-slot growth"):
                return None
            old = self._slot_cap
            ok, why = self._hook_ok(self._on_state_resize, old, old + 1)
            if not ok:
                self._veto("backing", f"state slot {old} not pinned: {why}")
                return None
            self._slot_cap = old + 1
            self._state_grows += 1
            self._slot_occupied.add(old)
            return old

    def free_state_slot(self, i: int) -> None:
        with self._lock:
            if i not in self._slot_occupied:
                raise ValueError(f"state slot {i} is not occupied")
            self._slot_occupied.discard(i)
            heapq.heappush(self._slot_heap, i)

    def shrink_state_slots(self) -> int:
        """Release trailing free slots down to the floor; returns how many were released."""
        with self._lock:
            return self._release_trailing_slots(self._trailing_free_slots())

    def state_slot_range(self, i: int) -> Tuple[int, int]:
        """``(byte_offset, byte_length)`` of slot ``i`` in the state pool's byte space."""
        with self._lock:
            if not 0 <= i < self._slot_cap:
                raise IndexError(f"state slot {i} outside pool of {self._slot_cap}")
            return (i * self.state_slot_bytes, self.state_slot_bytes)

    # ---------------------------------------------------------------------------------------
    # views
    # ---------------------------------------------------------------------------------------

    @property
    def kv_capacity_pages(self) -> int:
        return self._kv_pages

    @property
    def state_slots_capacity(self) -> int:
        return self._slot_cap

    def chunks(self) -> List[Chunk]:
        with self._lock:
            return list(self._chunks)

    def free_extents(self) -> List[Extent]:
        """Free extents ``(offset_pages, n_pages)`` sorted by offset."""
        with self._lock:
            return sorted(self._free_start.items())

    def live_allocations(self) -> List[Allocation]:
        with self._lock:
            return list(self._live.values())

    def occupied_state_slots(self) -> List[int]:
        with self._lock:
            return sorted(self._slot_occupied)

    def locate(self, page: int) -> Tuple[int, int]:
        """``(chunk_index, page_within_chunk)`` of a global page offset."""
        with self._lock:
            if not 0 <= page < self._kv_pages:
                raise IndexError(f"page {page} outside arena of {self._kv_pages} pages")
            ci = bisect.bisect_right(self._chunk_starts, page) - 1
            return ci, page - self._chunk_starts[ci]

    def chunk_ranges(self, alloc: Allocation) -> List[Tuple[int, int, int]]:
        """``(chunk_index, byte_offset_in_chunk, byte_length)`` pieces of an allocation, in
        logical order (an extent is split at chunk boundaries when ``split_at_chunks`` is off)."""
        out: List[Tuple[int, int, int]] = []
        pb = self.page_bytes
        with self._lock:
            for off, n in alloc.extents:
                while n > 0:
                    ci, within = self.locate(off)
                    c = self._chunks[ci]
                    take = min(n, c.n_pages - within)
                    out.append((ci, within * pb, take * pb))
                    off += take
                    n -= take
        return out

    def stats(self) -> dict:
        with self._lock:
            pb = self.page_bytes
            largest = self._by_size[-1][0] if self._by_size else 0
            kv_bytes = self._kv_pages * pb
            state_bytes = self._slot_cap * self.state_slot_bytes
            free_bytes = self._free_pages * pb
            return {
                "ceiling_bytes": self.ceiling_bytes,
                "reserve_bytes": self.reserve_bytes,
                "pinned_bytes": kv_bytes + state_bytes,
                "budget_left_bytes": self.ceiling_bytes - kv_bytes - state_bytes,
                "page_bytes": pb,
                "capacity_bytes": kv_bytes,
                "capacity_pages": self._kv_pages,
                "free_bytes": free_bytes,
                "free_pages": self._free_pages,
                "allocated_bytes": kv_bytes - free_bytes,
                "largest_free_run_bytes": largest * pb,
                "largest_free_run_pages": largest,
                "contiguous_free_fraction": (largest / self._free_pages) if self._free_pages else 1.0,
                "free_extents": len(self._by_size),
                "live_allocations": len(self._live),
                "chunks": len(self._chunks),
                "grows": self._grows,
                "grow_refusals": self._grow_refusals,
                "grow_refusals_by_reason": dict(self._grow_refusals_by_reason),
                "allocations": self._allocations,
                "allocation_refusals": self._allocation_refusals,
                "fragmented_misses": self._fragmented_misses,
                "scatter_allocations": self._scatter_allocations,
                "state_slot_bytes": self.state_slot_bytes,
                "state_slots_capacity": self._slot_cap,
                "state_slots_occupied": len(self._slot_occupied),
                "state_slots_min": self.min_state_slots,
                "state_capacity_bytes": state_bytes,
                "state_grows": self._state_grows,
                "state_slots_released": self._state_slots_released,
                "last_veto": self._last_veto,
            }

    def check_invariants(self) -> None:
        """Internal consistency check (debug/tests); raises ``AssertionError``."""
        with self._lock:
            cap = self._kv_pages
            assert (
                cap * self.page_bytes + self._slot_cap * self.state_slot_bytes <= self.ceiling_bytes
            ), "pinned footprint exceeds ceiling"
            assert self._slot_cap >= self.min_state_slots
            assert all(0 <= i < self._slot_cap for i in self._slot_occupied)
            pos = 0
            for idx, c in enumerate(self._chunks):
                assert c.index == idx and c.start_page == pos and c.n_pages > 0
                pos = c.end_page
            assert pos == cap
            assert self._by_size == sorted((s, o) for o, s in self._free_start.items())
            assert self._free_end == {o + s: o for o, s in self._free_start.items()}
            assert self._free_pages == sum(self._free_start.values())
            spans = sorted(list(self._free_start.items()) + [e for a in self._live.values() for e in a.extents])
            pos = 0
            for off, n in spans:
                assert n > 0 and off == pos, f"gap/overlap at page {off} (expected {pos})"
                pos = off + n
            assert pos == cap
            free = sorted(self._free_start.items())
            for (o1, s1), (o2, _) in zip(free, free[1:]):
                assert o1 + s1 < o2 or o2 in self._boundaries, f"uncoalesced free extents at {o2}"
            if self.split_at_chunks:
                for off, n in spans:
                    ci = bisect.bisect_right(self._chunk_starts, off) - 1
                    assert off + n <= self._chunks[ci].end_page, f"extent ({off},{n}) crosses a chunk"
