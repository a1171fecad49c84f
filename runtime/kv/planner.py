"""Pressure policy: which cached owners leave the device when pages or slots run short.

Mechanism (moving bytes, freeing pages) lives in the KV manager; this module only ranks. A cached
owner is a prefix-cache entry nobody has claimed. Re-prefilling an entry costs its linear GEMM work
plus the quadratic attention part, so the expensive ones are worth a trip to the host and the cheap
ones are evicted. When only state slots run short, the entry that frees a slot for the fewest bytes
moved goes first: demoting a 100k-token prefix (gigabytes over PCIe, and back on its next hit) to
free one state slot would cost more than it saves.
"""
from __future__ import annotations

from typing import Optional, Sequence

from .prefix_cache import Entry

DEMOTE_TRIES = 4  # most expensive owners tried for demotion before one is evicted


def reprefill_cost(tokens: int) -> float:
    """Relative cost of recomputing an entry: linear GEMM work plus the quadratic attention part."""
    return tokens + tokens * tokens / 8192.0


class PressurePlanner:
    def demotion_order(self, device_entries: Sequence[Entry], pages_short: bool = True) -> list[Entry]:
        """Unclaimed device entries worth demoting: most expensive to recompute first when pages are short
        (they free the most pages and are worth keeping); fewest pages, then least recently used, first
        when only a state slot is needed."""
        free = [e for e in device_entries if not e.claimed]
        if pages_short:
            free.sort(key=lambda e: reprefill_cost(e.length), reverse=True)
        else:
            free.sort(key=lambda e: (len(e.pages), e.last_used))
        return free[:DEMOTE_TRIES]

    def eviction_victim(self, device_entries: Sequence[Entry]) -> Optional[Entry]:
        """The cheapest unclaimed device entry (evicted when nothing could be demoted)."""
        free = [e for e in device_entries if not e.claimed]
        return min(free, key=lambda e: (reprefill_cost(e.length), e.last_used)) if free else None

    def host_victim(self, host_entries: Sequence[Entry], than: Entry) -> Optional[Entry]:
        """A host entry cheaper than `than` to make host room for it, or None."""
        cands = [h for h in host_entries if not h.claimed and h.length < than.length]
        return min(cands, key=lambda h: (reprefill_cost(h.length), h.last_used)) if cands else None

    def over_limit_victim(self, entries: Sequence[Entry]) -> Optional[Entry]:
        """Past the entry limit: host entries before device ones, cheapest and oldest first."""
        cands = [e for e in entries if not e.claimed]
        return min(cands, key=lambda e: (e.tier == "device", reprefill_cost(e.length), e.last_used)) if cands else None
