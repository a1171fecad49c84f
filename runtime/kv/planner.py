"""Pressure policy: which cached owners leave the device when pages or slots run short.

Mechanism (moving bytes, freeing pages) lives in the KV manager; this module only ranks. A cached
owner is a prefix-cache entry nobody has claimed. Redundant entries (`redundant`: another entry serves
what they would) are evicted first and never moved. Re-prefilling an entry costs its linear GEMM work
plus the quadratic attention part, so when pages are short the expensive ones are worth a trip to the
host and the cheap ones are evicted. When only a state slot is short, the entry that frees one for the
fewest bytes moved goes first: demoting a 100k-token prefix (gigabytes over PCIe, and back on its next
hit) to free one state slot would cost more than it saves.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .prefix_cache import Entry

DEMOTE_TRIES = 4  # most expensive owners tried for demotion before one is evicted


def reprefill_cost(tokens: int) -> float:
    """Relative cost of recomputing an entry: linear GEMM work plus the quadratic attention part."""
    return tokens + tokens * tokens / 8192.0


def _covers(f: Entry, e: Entry) -> bool:
    """f's tokens extend e's (same identity): every prompt f serves, e serves with a shorter prefix."""
    n = e.length
    return (f.seed == e.seed and f.length > n and n > 0 and int(f.tokens[n - 1]) == int(e.tokens[-1])
            and np.array_equal(f.tokens[:n], e.tokens))


def _common_prefix(a: Entry, b: Entry) -> int:
    n = min(a.length, b.length)
    diff = np.flatnonzero(a.tokens[:n] != b.tokens[:n])
    return int(diff[0]) if diff.size else n


def redundant(e: Entry, others: Sequence[Entry]) -> bool:
    """An entry worth less than the bytes and the slot it holds, given the others:
      - a later entry of the same session extends it, and either it is a frontier or the later one is a
        checkpoint (the conversation moved past it: the next turn's checkpoint covers the previous one); across
        sessions, or without a session key, a shorter entry may be the shared prefix of other conversations;
      - a frontier whose own checkpoint holds >= 90 % of it (losing it costs at most the generated tail);
      - a frontier of a session whose later entry shares >= half of it and then diverges (the client
        dropped the reasoning or edited the tail: the frontier cannot match that conversation again).
    A checkpoint that only a frontier extends is kept: the next turn needs the checkpoint when the client
    drops the frontier's reasoning."""
    for f in others:
        if f is e or f.seed != e.seed:
            continue
        later = f.created > e.created
        same_session = bool(e.session_key) and f.session_key == e.session_key
        if same_session and later and _covers(f, e) and (e.kind == "frontier" or f.kind == "checkpoint"):
            return True
        if e.kind != "frontier":
            continue
        if f.kind == "checkpoint" and f.length >= 0.9 * e.length and _covers(e, f):
            return True
        if (later and e.session_key and f.session_key == e.session_key and not _covers(f, e)
                and _common_prefix(e, f) >= e.length // 2):
            return True
    return False


class PressurePlanner:
    def redundant_victim(self, candidates: Sequence[Entry], everything: Sequence[Entry]) -> Optional[Entry]:
        """The least recently used unclaimed candidate that `redundant` finds (evicted, never moved)."""
        for e in sorted((c for c in candidates if not c.claimed), key=lambda c: c.last_used):
            if redundant(e, everything):
                return e
        return None

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
