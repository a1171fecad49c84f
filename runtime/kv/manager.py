"""The KV manager: sole owner of device KV pages, state slots, the prefix cache, its checkpoints and
the host tier.

A sequence's device residency is a SeqKV (state slot, page ids, length). Finished sequences are not
freed: they become cache entries that keep their pages and slot. When the device is short, the
pressure planner (planner.py, policy only) ranks the cached owners and this module carries it out:
demote to the host what the host can take, evict the cheapest otherwise. Allocation answers with a
result (None / False) instead of raising; every path that gives memory back goes through `release`,
so nothing is dropped while the host has room. Operations that fail half-way undo what they took.
"""
from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from .host_tier import HostTier
from .pages import PageAllocator, SlotAllocator
from .planner import PressurePlanner
from .prefix_cache import Entry, Match, PrefixCache

log = logging.getLogger("ninfer.kv")
_uids = itertools.count(1)


@dataclass(eq=False)
class SeqKV:
    """Device residency of one sequence: its state slot, its KV pages and how many tokens they hold."""

    slot: Optional[int]  # None once released
    pages: list = field(default_factory=list)
    length: int = 0
    uid: int = field(default_factory=lambda: next(_uids))
    media: Any = None  # the request's images (runtime/vision/media.py): what the executor needs for their rows


class KVManager:
    def __init__(self, runner, num_pages: int, num_slots: int, cache: Optional[PrefixCache] = None,
                 host: Optional[HostTier] = None, planner: Optional[PressurePlanner] = None):
        """runner: the executor whose pools hold the bytes (views, copies); pages/slots: pool sizes."""
        self.runner = runner
        self.page_size = runner.page_size
        self.pages = PageAllocator(num_pages, self.page_size)
        self.slots = SlotAllocator(num_slots)
        self.cache, self.host = cache, host
        self.planner = planner or PressurePlanner()
        self.stats = {"private_owners_demoted": 0, "private_owners_evicted": 0, "host_owners_evicted": 0,
                      "owners_evicted_total": 0, "spill_pages": 0, "partial_tail_cow_pages": 0,
                      "checkpoints_taken": 0, "checkpoints_dropped": 0, "restores_device": 0, "restores_host": 0,
                      "planner_runs": 0, "demote_failures": 0, "restore_failures": 0,
                      "redundant_evicted": 0}

    def pages_for(self, tokens: int) -> int:
        return self.pages.pages_for(tokens)

    @property
    def capacity_tokens(self) -> int:
        return self.pages.num_pages * self.page_size

    # ---- pressure ----------------------------------------------------------------------
    def make_room(self, pages: int = 0, slots: int = 0) -> bool:
        """Free device pages/slots by demoting or evicting cached owners; True when satisfied."""
        self.stats["planner_runs"] += 1
        while self.pages.free_pages < pages or self.slots.free_slots < slots:
            if self.cache is None:
                return False
            entries = self.cache.device_entries()
            waste = self.planner.redundant_victim(entries, list(self.cache.entries.values()))
            if waste is not None:
                self.stats["redundant_evicted"] += 1
                self.evict(waste)
                continue
            order = self.planner.demotion_order(entries, pages_short=self.pages.free_pages < pages)
            if not any(self.demote(e) for e in order):
                victim = self.planner.eviction_victim(entries)
                if victim is None:
                    return False
                self.evict(victim)
        return True

    def demote(self, e: Entry) -> bool:
        """Move a device entry to the host tier (pages + state); False if the host has no room."""
        host, cache, slot = self.host, self.cache, e.slot
        if host is None:
            return False
        assert cache is not None and slot is not None  # e is a device entry of the prefix cache
        if not cache.begin_move(e):
            return False
        alloc = hs = None
        done = False
        try:
            if e.pages:
                alloc = self._on_host(e, lambda: host.store_pages(e.pages))
                if alloc is None:
                    self.stats["demote_failures"] += 1
                    return False
            hs = self._on_host(e, lambda: host.store_state(slot))
            if hs is None:
                self.stats["demote_failures"] += 1
                return False
            done = True
        finally:
            if not done:  # refused or failed half-way: the entry stays on the device, the host keeps nothing
                host.free_pages(alloc)
                if hs is not None:
                    host.free_state(hs)
        self.pages.release(e.pages)
        self.slots.release(slot)
        self.stats["spill_pages"] += len(e.pages)
        e.pages, e.slot = [], None
        e.host_alloc, e.host_slot, e.tier = alloc, hs, "host"
        self.stats["private_owners_demoted"] += 1
        return True

    def _on_host(self, e: Entry, store):
        """store() into the host tier, evicting cheaper host entries while it has no room."""
        got = store()
        while got is None and self._evict_cheaper_host(e):
            got = store()
        return got

    def _evict_cheaper_host(self, than: Entry) -> bool:
        assert self.cache is not None  # only demotions of cache entries get here
        host_entries = self.cache.host_entries()
        victim = self.planner.redundant_victim(host_entries, list(self.cache.entries.values()))
        if victim is not None:
            self.stats["redundant_evicted"] += 1
        else:
            victim = self.planner.host_victim(host_entries, than)
        if victim is None:
            return False
        self.evict(victim)
        return True

    def evict(self, e: Entry) -> None:
        assert self.cache is not None  # e is an entry of the prefix cache
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
            self.pages.release(e.pages)
            if e.slot is not None:
                self.slots.release(e.slot)
        else:
            assert self.host is not None  # a host-tier entry exists only with a host tier
            self.host.free_pages(e.host_alloc)
            if e.host_slot is not None:
                self.host.free_state(e.host_slot)
        e.pages, e.slot, e.host_alloc, e.host_slot = [], None, None, None

    def enforce_entry_limit(self) -> None:
        if self.cache is None:
            return
        while len(self.cache.entries) > self.cache.max_entries:
            victim = self.planner.over_limit_victim(list(self.cache.entries.values()))
            if victim is None:
                return
            self.evict(victim)

    # ---- sequences -------------------------------------------------------------------------
    def new_seq(self) -> Optional[SeqKV]:
        """An empty sequence with a zeroed state slot, or None when no slot can be freed."""
        if not self.make_room(slots=1):
            return None
        slot = self.slots.alloc()
        assert slot is not None  # make_room freed one
        self.runner.zero_state(slot)
        return SeqKV(slot=slot)

    def admit(self, tokens, seed: int, session_key: Optional[str], max_reuse: int) -> Optional[SeqKV]:
        """A sequence restored from the longest cached prefix of `tokens` (at most max_reuse tokens),
        or an empty one; None when no state slot can be freed. The prefix is claimed before the new
        sequence's slot is taken, so making room for that slot never demotes or evicts the very entry
        about to be restored."""
        if self.cache is None or max_reuse <= 0:
            return self.new_seq()
        for _ in range(3):  # a lost seal race re-assesses
            m = self.cache.lookup(tokens, seed, session_key, max_len=max_reuse)
            if m is None:
                break
            if not self.cache.claim(m):
                continue
            ok = False
            try:
                seq = self.new_seq()
                if seq is None:
                    return None
                try:
                    ok = self._restore(m, seq)
                except Exception:  # a failed copy costs a recompute, never the request or the memory
                    self.stats["restore_failures"] += 1
                    log.exception("restoring a cached prefix of %d tokens failed; recomputing it", m.length)
                if not ok:
                    self._reset(seq)
                return seq
            finally:
                self.cache.release_claim(m.entry, hit=ok)
        return self.new_seq()

    def _reset(self, seq: SeqKV) -> None:
        """Back to an empty sequence after a refused or failed restore (pages given back, state zeroed)."""
        self.pages.release(seq.pages)
        seq.pages, seq.length = [], 0
        self.runner.zero_state(seq.slot)

    def _restore(self, m: Match, seq: SeqKV) -> bool:
        e = m.entry
        n_pages = self.pages_for(e.length)
        assert seq.slot is not None  # a live sequence holds its slot
        if e.tier == "device":
            assert e.slot is not None  # a device entry holds its state slot
            full = e.length // self.page_size
            tail = n_pages - full
            if tail and not self.make_room(pages=tail):
                return False
            self._copy_state(e.slot, seq.slot)
            shared = e.pages[:full]
            self.pages.share(shared)
            seq.pages = list(shared)
            if tail:  # the partly filled page is copied: both owners write past the frontier
                got = self.pages.alloc(1)
                assert got is not None  # make_room freed the page
                (p,) = got
                seq.pages.append(p)
                self.host.copy_page_d2d(e.pages[full], p) if self.host else self.runner.copy_page(e.pages[full], p)
                self.stats["partial_tail_cow_pages"] += 1
            self.stats["restores_device"] += 1
        else:
            if not self.make_room(pages=n_pages):
                return False
            got = self.pages.alloc(n_pages)
            assert got is not None and self.host is not None and e.host_slot is not None  # room made; a host entry
            seq.pages = got
            self.host.load_pages(e.host_alloc, seq.pages)
            self.host.load_state(e.host_slot, seq.slot)
            self.stats["restores_host"] += 1
        seq.length = e.length
        return True

    def _copy_state(self, src: int, dst: int) -> None:
        self.host.copy_state_d2d(src, dst) if self.host else self.runner.copy_state(src, dst)

    def reclaimable_pages(self) -> int:
        """Pages a new sequence could get without preempting a live one: free pages plus the pages only
        unclaimed device cache entries hold (demoting or evicting those frees them)."""
        n = self.pages.free_pages
        if self.cache is not None:
            for e in self.cache.device_entries():
                if not e.claimed:
                    n += sum(1 for p in e.pages if self.pages.refcount(p) == 1)
        return n

    def ensure(self, seq: SeqKV, new_tokens: int) -> bool:
        """Pages for seq.length + new_tokens (freeing cached owners if needed); False, with nothing
        changed, when the device cannot hold them without preempting a live sequence."""
        need = self.pages_for(seq.length + new_tokens) - len(seq.pages)
        if need <= 0:
            return True
        if self.pages.free_pages < need and not self.make_room(pages=need):
            return False
        got = self.pages.alloc(need)
        if got is None:
            return False
        seq.pages.extend(got)
        return True

    def advance(self, seq: SeqKV, n: int) -> None:
        """The executor wrote n more tokens of seq (KV and state)."""
        if seq.length + n > len(seq.pages) * self.page_size:
            raise ValueError(f"sequence {seq.uid} advanced past its reserved pages")
        seq.length += n

    def checkpoint(self, seq: SeqKV, tokens, seed: int, session_key: Optional[str]) -> Optional[Entry]:
        """Save seq's current execution point as a checkpoint entry (state copy, shared pages)."""
        if self.cache is None or self.cache.find_exact(tokens[: seq.length], seed) is not None:
            return None
        if not self.make_room(slots=1):
            return None
        slot = self.slots.alloc()
        assert slot is not None and seq.slot is not None  # make_room freed one; a live sequence holds its slot
        try:
            self._copy_state(seq.slot, slot)
        except BaseException:
            self.slots.release(slot)
            raise
        pages = seq.pages[: self.pages_for(seq.length)]
        self.pages.share(pages)
        self.stats["checkpoints_taken"] += 1
        e = self.cache.add("checkpoint", tokens[: seq.length], seed, session_key, slot, pages)
        self.enforce_entry_limit()
        return e

    def release(self, seq: SeqKV, tokens, seed: int, session_key: Optional[str], keep: bool = True) -> None:
        """End of a sequence's life on every path: keep it as a frontier entry (spilled later if
        needed) unless an identical entry exists, reuse is off, or keep is False (an interrupted
        in-place forward may have touched the state)."""
        if seq.slot is None:
            return
        toks = tokens[: seq.length]
        if not keep or self.cache is None or seq.length == 0 or self.cache.find_exact(toks, seed) is not None:
            self.pages.release(seq.pages)
            self.slots.release(seq.slot)
        else:
            used = self.pages_for(seq.length)
            if seq.pages[used:]:
                self.pages.release(seq.pages[used:])
            self.cache.add("frontier", toks, seed, session_key, seq.slot, seq.pages[:used])
            self.enforce_entry_limit()
        seq.pages, seq.slot = [], None

    # ---- state snapshots (speculative rollback) ----------------------------------------------
    def snapshot_state(self, seq: SeqKV) -> Optional[int]:
        """A slot holding a copy of seq's state (before a verification), or None when none is free."""
        if self.slots.free_slots == 0 and not self.make_room(slots=1):
            return None
        slot = self.slots.alloc()
        if slot is None:
            return None
        try:
            self.runner.copy_state(seq.slot, slot)
        except BaseException:
            self.slots.release(slot)
            raise
        return slot

    def restore_snapshot(self, seq: SeqKV, slot: int, length: int) -> None:
        """seq goes back to the snapshot taken at `length`: the snapshot slot becomes its slot."""
        assert seq.slot is not None  # a live sequence holds its slot
        self.slots.release(seq.slot)
        seq.slot, seq.length = slot, length

    def drop_snapshot(self, slot: int) -> None:
        self.slots.release(slot)

    # ---- accounting ------------------------------------------------------------------------
    def audit(self, live: tuple = ()) -> list[str]:
        """Every page, slot, claim and host extent accounted for: page reference counts equal the
        holders (live sequences + device cache entries), used slots equal their holders, the host
        arena holds exactly the cached host entries, nothing stays claimed. Returns the mismatches
        (empty when consistent). Call only while no step runs (tests, debugging)."""
        problems: list[str] = []
        refs = [0] * self.pages.num_pages
        slots: list[int] = []
        entries = list(self.cache.entries.values()) if self.cache is not None else []
        for s in live:
            if s is None or s.slot is None:
                continue
            slots.append(s.slot)
            for p in s.pages:
                refs[p] += 1
        host_allocs: list = []
        host_slots: list[int] = []
        for e in entries:
            if e.claimed:
                problems.append(f"entry {e.eid} still claimed ({e.claimed})")
            if e.tier == "device":
                if e.slot is None:
                    problems.append(f"device entry {e.eid} holds no state slot")
                else:
                    slots.append(e.slot)
                for p in e.pages:
                    refs[p] += 1
            else:
                host_allocs.append(e.host_alloc)
                if e.host_slot is None:
                    problems.append(f"host entry {e.eid} holds no host state slot")
                else:
                    host_slots.append(e.host_slot)
        for p in range(self.pages.num_pages):
            if refs[p] != self.pages.refcount(p):
                problems.append(f"page {p}: refcount {self.pages.refcount(p)}, holders {refs[p]}")
        if len(slots) != len(set(slots)):
            problems.append(f"a device state slot has two holders: {sorted(slots)}")
        used = self.slots.num_slots - self.slots.free_slots
        if used != len(set(slots)):
            problems.append(f"{used} device state slots in use, {len(set(slots))} held")
        if self.host is not None:
            arena = self.host.arena
            live_allocs = {id(a) for a in arena.live_allocations()}
            held = {id(a) for a in host_allocs if a is not None}
            if live_allocs != held:
                problems.append(f"host arena holds {len(live_allocs)} allocations, cache entries {len(held)}")
            if sorted(arena.occupied_state_slots()) != sorted(host_slots):
                problems.append(f"host state slots {arena.occupied_state_slots()} vs entries {sorted(host_slots)}")
            try:
                arena.check_invariants()
            except AssertionError as e:
                problems.append(f"host arena: {e}")
        return problems

    # ---- views -----------------------------------------------------------------------------
    def occupancy(self) -> dict:
        out = {"device_kv_pages_total": self.pages.num_pages, "device_kv_occupied_pages": self.pages.used_pages,
               "device_state_slots_total": self.slots.num_slots,
               "device_state_occupied_slots": self.slots.num_slots - self.slots.free_slots}
        if self.host is not None:
            hs = self.host.arena.stats()
            out.update(host_kv_capacity_bytes=hs["capacity_bytes"], host_kv_free_bytes=hs["free_bytes"],
                       host_state_occupied_slots=hs["state_slots_occupied"])
        return out
