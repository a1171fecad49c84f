"""Prefix reuse for a hybrid model: saved execution points, found by exact token identity.

A GDN state exists only at the exact length it was taken, so an entry is an execution point:
tokens[0:L] with KV covering [0, L) and the recurrent state after token L-1. Two kinds:
  frontier   - where a finished (or preempted) request stopped;
  checkpoint - a turn boundary (before the last assistant opener), so the next turn reuses the
               history even when the client drops the reasoning of the previous answer.
Lookup picks the longest entry that is a prefix of the new prompt: rolling FNV-1a digests
shortlist, a token comparison decides. A session key (user id, Anthropic metadata) only narrows
the shortlist; a hit always needs the exact identity (tokens + template mode + media digest).

Entries live on the device (pages + state slot) or on the host (arena extents + host state
slot); the planner moves them. `claim` is the seal-window: an entry claimed for a restore
cannot be demoted or evicted until released, and a claim fails if the entry moved since it
was assessed.
"""
from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

FNV_OFFSET = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
MASK = (1 << 64) - 1


def identity_seed(mode: str = "", media_digest: str = "") -> int:
    """Digest seed that folds in everything besides tokens that shapes the KV."""
    h = FNV_OFFSET
    for b in f"{mode}\x00{media_digest}".encode():
        h = ((h ^ b) * FNV_PRIME) & MASK
    return h


def rolling_digests(tokens, seed: int) -> list[int]:
    """d[i] = digest of tokens[0:i] (d[0] = seed); FNV-1a over 32-bit token words."""
    out = [seed]
    h = seed
    for t in np.asarray(tokens, np.int64).tolist():
        h = ((h ^ (t & 0xFFFFFFFF)) * FNV_PRIME) & MASK
        out.append(h)
    return out


@dataclass(eq=False)
class Entry:
    eid: int
    kind: str  # frontier | checkpoint
    tokens: np.ndarray  # int32 [L]
    seed: int  # identity seed (template mode, media)
    digest: int
    session_key: Optional[str]
    tier: str = "device"  # device | host
    # device residency
    slot: Optional[int] = None
    pages: list = field(default_factory=list)
    # host residency
    host_alloc: Any = None
    host_slot: Optional[int] = None
    version: int = 0  # bumped on every move; a claim must see the version it assessed
    claimed: int = 0
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    hits: int = 0

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


@dataclass
class Match:
    entry: Entry
    version: int
    length: int


class PrefixCache:
    def __init__(self, max_entries: int = 64):
        self.max_entries = max_entries
        self.lock = threading.RLock()
        self._ids = itertools.count(1)
        self.entries: dict[int, Entry] = {}
        self._by_digest: dict[int, list[Entry]] = {}
        self._by_session: dict[str, set[int]] = {}
        self.stats = {"lookups": 0, "frontier_hits": 0, "checkpoint_hits": 0, "misses": 0,
                      "reused_prompt_tokens": 0, "claim_conflicts": 0, "entries_added": 0,
                      "entries_replaced": 0, "session_shortlist_hits": 0}

    # ---- insertion ---------------------------------------------------------------------
    def add(self, kind: str, tokens, seed: int, session_key: Optional[str], slot: int, pages: list) -> Entry:
        """Register a device-resident execution point; the cache now owns slot and page refs."""
        toks = np.asarray(tokens, np.int32).copy()
        dig = rolling_digests(toks, seed)[-1]
        with self.lock:
            e = Entry(next(self._ids), kind, toks, seed, dig, session_key, slot=slot, pages=list(pages))
            self.entries[e.eid] = e
            self._by_digest.setdefault(dig, []).append(e)
            if session_key:
                self._by_session.setdefault(session_key, set()).add(e.eid)
            self.stats["entries_added"] += 1
            return e

    def find_exact(self, tokens, seed: int) -> Optional[Entry]:
        toks = np.asarray(tokens, np.int32)
        dig = rolling_digests(toks, seed)[-1]
        with self.lock:
            for e in self._by_digest.get(dig, []):
                if e.seed == seed and e.length == toks.shape[0] and np.array_equal(e.tokens, toks):
                    return e
        return None

    def remove(self, e: Entry) -> None:
        with self.lock:
            self.entries.pop(e.eid, None)
            lst = self._by_digest.get(e.digest, [])
            if e in lst:
                lst.remove(e)
                if not lst:
                    del self._by_digest[e.digest]
            if e.session_key and e.session_key in self._by_session:
                self._by_session[e.session_key].discard(e.eid)
                if not self._by_session[e.session_key]:
                    del self._by_session[e.session_key]
            e.version += 1

    # ---- lookup ----------------------------------------------------------------------
    def lookup(self, prompt, seed: int, session_key: Optional[str] = None, max_len: Optional[int] = None) -> Optional[Match]:
        """Longest entry whose tokens are a prefix of `prompt` (and shorter than max_len)."""
        toks = np.asarray(prompt, np.int32)
        limit = toks.shape[0] if max_len is None else min(max_len, toks.shape[0])
        with self.lock:
            self.stats["lookups"] += 1
            shortlist: list[Entry] = []
            if session_key and session_key in self._by_session:
                shortlist = [self.entries[i] for i in self._by_session[session_key] if i in self.entries]
            best = self._best(toks, seed, limit, shortlist) if shortlist else None
            if best is not None:
                self.stats["session_shortlist_hits"] += 1
            else:
                digs = rolling_digests(toks[:limit], seed)
                cands = []
                for n in range(limit, 0, -1):  # longest first
                    for e in self._by_digest.get(digs[n], []):
                        cands.append(e)
                    if cands:
                        best = self._best(toks, seed, limit, cands)
                        if best is not None:
                            break
                        cands = []
            if best is None:
                self.stats["misses"] += 1
                return None
            return Match(best, best.version, best.length)

    @staticmethod
    def _best(toks: np.ndarray, seed: int, limit: int, cands: list[Entry]) -> Optional[Entry]:
        best = None
        for e in cands:
            if e.seed != seed or e.length > limit or e.length == 0:
                continue
            if best is not None and e.length <= best.length:
                continue
            if np.array_equal(e.tokens, toks[: e.length]):
                best = e
        return best

    # ---- seal window -------------------------------------------------------------------
    def claim(self, m: Match) -> bool:
        """Atomically pin the matched entry if it has not moved since lookup."""
        with self.lock:
            e = m.entry
            if e.eid not in self.entries or e.version != m.version:
                self.stats["claim_conflicts"] += 1
                return False
            e.claimed += 1
            return True

    def release_claim(self, e: Entry, hit: bool = True) -> None:
        with self.lock:
            e.claimed -= 1
            if hit:
                e.hits += 1
                e.last_used = time.monotonic()
                self.stats["frontier_hits" if e.kind == "frontier" else "checkpoint_hits"] += 1
                self.stats["reused_prompt_tokens"] += e.length

    def begin_move(self, e: Entry) -> bool:
        """Planner side of the seal window: refuse to move a claimed entry, else invalidate
        any assessment made before the move."""
        with self.lock:
            if e.claimed or e.eid not in self.entries:
                return False
            e.version += 1
            return True

    # ---- views ---------------------------------------------------------------------------
    def device_entries(self) -> list[Entry]:
        with self.lock:
            return [e for e in self.entries.values() if e.tier == "device"]

    def host_entries(self) -> list[Entry]:
        with self.lock:
            return [e for e in self.entries.values() if e.tier == "host"]

    def summary(self) -> dict:
        with self.lock:
            dev = [e for e in self.entries.values() if e.tier == "device"]
            host = [e for e in self.entries.values() if e.tier == "host"]
            return {**self.stats, "entries": len(self.entries), "device_entries": len(dev), "host_entries": len(host),
                    "checkpoints": sum(1 for e in self.entries.values() if e.kind == "checkpoint")}
