"""Tiered KV policy: acquire (with prefix restore), checkpoint, release (spill before evict) and
the pressure planner.

Device memory is the page pool plus the state slots. Finished sequences are not freed: they
become cache entries that keep their pages and slot. When the device is short, the planner
ranks the cached (private, unclaimed) owners by what re-prefilling them would cost, demotes the
most expensive that the host tier can take and evicts the cheapest otherwise. Every release path
goes through `release`, so nothing is dropped while the host has room.
"""
from __future__ import annotations

from typing import Optional

from .host_tier import HostTier
from .kv_pages import OutOfPages
from .model_runner import ModelRunner, SeqKV
from .prefix_cache import Entry, Match, PrefixCache


def reprefill_cost(tokens: int) -> float:
    """Relative cost of recomputing an entry: linear GEMM work plus the quadratic attention part."""
    return tokens + tokens * tokens / 8192.0


class TieredKV:
    def __init__(self, runner: ModelRunner, cache: Optional[PrefixCache], host: Optional[HostTier]):
        self.runner, self.cache, self.host = runner, cache, host
        self.stats = {"private_owners_demoted": 0, "private_owners_evicted": 0, "host_owners_evicted": 0,
                      "owners_evicted_total": 0, "spill_pages": 0, "partial_tail_cow_pages": 0,
                      "checkpoints_taken": 0, "checkpoints_dropped": 0, "restores_device": 0, "restores_host": 0,
                      "planner_runs": 0, "demote_failures": 0}

    # ---- planner -----------------------------------------------------------------------
    def make_room(self, pages: int = 0, slots: int = 0) -> bool:
        """Free device pages/slots by demoting or evicting cached owners; True when satisfied."""
        r = self.runner
        self.stats["planner_runs"] += 1
        while r.pages.free_pages < pages or r.slots.free_slots < slots:
            if self.cache is None:
                return False
            victims = [e for e in self.cache.device_entries() if not e.claimed]
            if not victims:
                return False
            victims.sort(key=lambda e: reprefill_cost(e.length), reverse=True)
            if not any(self.demote(v) for v in victims[:4]):
                self.evict(victims[-1])
        return True

    def demote(self, e: Entry) -> bool:
        """Move a device entry to the host tier (pages + state); False if the host has no room."""
        if self.host is None or not self.cache.begin_move(e):
            return False
        alloc = self._host_pages(e)
        if alloc is False:
            self.stats["demote_failures"] += 1
            return False
        hs = self.host.store_state(e.slot)
        while hs is None and self._evict_cheaper_host(e):
            hs = self.host.store_state(e.slot)
        if hs is None:
            self.host.free_pages(alloc)
            self.stats["demote_failures"] += 1
            return False
        self.runner.pages.release(e.pages)
        self.runner.slots.release(e.slot)
        self.stats["spill_pages"] += len(e.pages)
        e.pages, e.slot = [], None
        e.host_alloc, e.host_slot, e.tier = alloc, hs, "host"
        self.stats["private_owners_demoted"] += 1
        return True

    def _host_pages(self, e: Entry):
        if not e.pages:
            return None
        alloc = self.host.store_pages(e.pages)
        while alloc is None and self._evict_cheaper_host(e):
            alloc = self.host.store_pages(e.pages)
        return False if alloc is None else alloc

    def _evict_cheaper_host(self, than: Entry) -> bool:
        cands = [h for h in self.cache.host_entries() if not h.claimed and h.length < than.length]
        if not cands:
            return False
        self.evict(min(cands, key=lambda h: (reprefill_cost(h.length), h.last_used)))
        return True

    def evict(self, e: Entry) -> None:
        if not self.cache.begin_move(e):
            return
        self._drop_storage(e)
        self.cache.remove(e)
        self.stats["owners_evicted_total"] += 1
        self.stats["host_owners_evicted" if e.tier == "host" else "private_owners_evicted"] += 1
        if e.kind == "checkpoint":
            self.stats["checkpoints_dropped"] += 1

    def _drop_storage(self, e: Entry) -> None:
        if e.tier == "device":
            self.runner.pages.release(e.pages)
            if e.slot is not None:
                self.runner.slots.release(e.slot)
        else:
            self.host.free_pages(e.host_alloc)
            if e.host_slot is not None:
                self.host.free_state(e.host_slot)
        e.pages, e.slot, e.host_alloc, e.host_slot = [], None, None, None

    def enforce_entry_limit(self) -> None:
        if self.cache is None:
            return
        while len(self.cache.entries) > self.cache.max_entries:
            cands = [e for e in self.cache.entries.values() if not e.claimed]
            if not cands:
                return
            self.evict(min(cands, key=lambda e: (e.tier == "device", reprefill_cost(e.length), e.last_used)))

    # ---- sequences -------------------------------------------------------------------------
    def acquire(self, tokens, seed: int, session_key: Optional[str], max_reuse: int) -> SeqKV:
        """A fresh sequence, restored from the longest cached prefix of `tokens` (<= max_reuse)."""
        if not self.make_room(slots=1):
            raise OutOfPages("no state slot free")
        seq = self.runner.new_seq()
        if self.cache is None or max_reuse <= 0:
            return seq
        for _ in range(3):  # a lost seal race re-assesses
            m = self.cache.lookup(tokens, seed, session_key, max_len=max_reuse)
            if m is None:
                return seq
            if self.cache.claim(m):
                try:
                    ok = self._restore(m, seq)
                finally:
                    self.cache.release_claim(m.entry, hit=ok)
                return seq
        return seq

    def _restore(self, m: Match, seq: SeqKV) -> bool:
        e, r = m.entry, self.runner
        n_pages = r.pages.pages_for(e.length)
        if e.tier == "device":
            full = e.length // r.page_size
            tail = n_pages - full
            if tail and not self.make_room(pages=tail):
                return False
            self.host.copy_state_d2d(e.slot, seq.slot) if self.host else r.copy_state(e.slot, seq.slot)
            shared = e.pages[:full]
            r.pages.share(shared)
            seq.pages = list(shared)
            if tail:  # the partly filled page is copied: both owners write past the frontier
                (p,) = r.pages.alloc(1)
                self.host.copy_page_d2d(e.pages[full], p) if self.host else r.copy_page(e.pages[full], p)
                seq.pages.append(p)
                self.stats["partial_tail_cow_pages"] += 1
            self.stats["restores_device"] += 1
        else:
            if not self.make_room(pages=n_pages):
                return False
            seq.pages = r.pages.alloc(n_pages)
            self.host.load_pages(e.host_alloc, seq.pages)
            self.host.load_state(e.host_slot, seq.slot)
            self.stats["restores_host"] += 1
        seq.length = e.length
        return True

    def checkpoint(self, seq: SeqKV, tokens, seed: int, session_key: Optional[str]) -> Optional[Entry]:
        """Save seq's current execution point as a checkpoint entry (state copy, shared pages)."""
        if self.cache is None or self.cache.find_exact(tokens[: seq.length], seed) is not None:
            return None
        if not self.make_room(slots=1):
            return None
        slot = self.runner.slots.alloc()
        if self.host:
            self.host.copy_state_d2d(seq.slot, slot)
        else:
            self.runner.copy_state(seq.slot, slot)
        pages = seq.pages[: self.runner.pages.pages_for(seq.length)]
        self.runner.pages.share(pages)
        self.stats["checkpoints_taken"] += 1
        e = self.cache.add("checkpoint", tokens[: seq.length], seed, session_key, slot, pages)
        self.enforce_entry_limit()
        return e

    def release(self, seq: SeqKV, tokens, seed: int, session_key: Optional[str], keep: bool = True) -> None:
        """End of a sequence's life on every path: keep it as a frontier entry (spilled later if
        needed) unless an identical entry exists or reuse is off."""
        if seq.slot is None:
            return
        toks = tokens[: seq.length]
        if not keep or self.cache is None or seq.length == 0 or self.cache.find_exact(toks, seed) is not None:
            self.runner.free_seq(seq)
        else:
            used = self.runner.pages.pages_for(seq.length)
            extra = seq.pages[used:]
            if extra:
                self.runner.pages.release(extra)
            self.cache.add("frontier", toks, seed, session_key, seq.slot, seq.pages[:used])
            self.enforce_entry_limit()
        seq.pages, seq.slot = [], None

    def occupancy(self) -> dict:
        r = self.runner
        out = {"device_kv_pages_total": r.pages.num_pages, "device_kv_occupied_pages": r.pages.used_pages,
               "device_state_slots_total": r.slots.num_slots,
               "device_state_occupied_slots": r.slots.num_slots - r.slots.free_slots}
        if self.host is not None:
            hs = self.host.arena.stats()
            out.update(host_kv_capacity_bytes=hs["capacity_bytes"], host_kv_free_bytes=hs["free_bytes"],
                       host_state_occupied_slots=hs["state_slots_occupied"])
        return out
