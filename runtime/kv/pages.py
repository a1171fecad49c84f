"""Device KV page and state-slot allocators (owned by the KV manager, nobody else).

Pages are 64-token blocks with reference counts, so a prefix cache entry and a live sequence share
full pages; a page returns to the free list when its last holder lets go. Allocation answers None
when there is not enough: the KV manager decides what to free, the scheduler what to preempt.
"""
from __future__ import annotations

from typing import Optional


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1:
            raise ValueError("the KV pool needs at least one page")
        self.num_pages, self.page_size = num_pages, page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low ids first
        self._refs = [0] * num_pages

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def alloc(self, n: int) -> Optional[list[int]]:
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._refs[p] = 1
        return out

    def share(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self._refs[p] += 1

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def release(self, pages: list[int]) -> None:
        """Pushed last page first, so a later alloc hands a released run back in its order: a host-tier
        restore into pages a spill just freed gets ascending ids, one copy per run (kv/copy_plan.py)."""
        for p in reversed(pages):
            if self._refs[p] <= 0:
                raise ValueError(f"double free of KV page {p}")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)


class SlotAllocator:
    """Recurrent-state slots (conv tail + SSM state of every GDN layer for one sequence)."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError("need at least one state slot")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def alloc(self) -> Optional[int]:
        if not self._free:
            return None
        s = self._free.pop()
        self._used.add(s)
        return s

    def release(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"state slot {slot} is not allocated")
        self._used.discard(slot)
        self._free.append(slot)
