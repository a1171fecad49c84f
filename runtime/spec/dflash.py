"""DFlash / DFlash2 block drafters as the proposer (compile/dflash; runtime/spec/dflash_runner.py).

Context: the target's tap-layer outputs (prefill_t / verify_t, DeviceRows that stay on the device) of
every committed, fed position. After a prefill they are written into the drafter's KV at once; the
rows a verification keeps (settle -> after_verify) wait and are written at the start of the next
round in one batched call (before_round), before its verify can replay a CUDA graph over them (or at
release, so a finished sequence's pages carry the drafter's KV into the prefix cache and the host
tier). Positions only ever get K/V of committed tokens, so rollback is free.

Drafting: one forward of the block [last committed token, MASK x (B-1)] per request (all requests
of the round in one call), positions start..start+B-1 where start is the pending token's position;
draft j is row j + 1: chosen independently per row (DFlash) or along the candidate selector's path
(DFlash2, runtime/spec/selector.py). The block writes its own K/V on the sequence's pages beyond
start (reserved here) and into the ring; later context writes replace them.

After a restore from the prefix cache (device or host), the paged layers find the restored prefix
in the target's pages; the ring layers' window is rebuilt from the rows prefilled after the restore
point (`ring_lo`: the ring holds positions >= it). Preemption releases the request's state; its
readmission is such a restore.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ...contract.sampler_abi import top_logprob_slots
from ..kv.manager import KVManager
from ..sampling import penalised_logits
from .base import Choose
from .dflash_runner import DrafterRunner
from .mtp import pending_position
from .selector import CandidateSelector
from .state import SpecState

log = logging.getLogger("ninfer.spec")


@dataclass
class DFlashSeq:
    """One request's drafter context."""

    lane: int  # ring lane
    seq: object  # the target SeqKV whose page ids hold the paged layers' KV
    written: int  # positions < written are in the drafter's KV (ring: from ring_lo on)
    ring_lo: int
    pending: list = field(default_factory=list)  # [(first position, DeviceRows)] not yet written

    @property
    def end(self) -> int:
        return self.written + sum(len(r) for _, r in self.pending)


class DFlashProposer:
    wants_prefill_hidden = True
    target_hidden = "taps"  # prefill / verify return the tap layers' outputs (runner: taps=True)

    def __init__(self, runner, kv: KVManager, draft_dir: str | Path, kind: str, lanes: int, max_batch: int):
        self.runner, self.kv = runner, kv
        self.dr = DrafterRunner(draft_dir, runner, lanes, max_batch)
        if self.dr.cfg.kind != kind:
            raise ValueError(f"{Path(draft_dir).name} is a {self.dr.cfg.kind} drafter; use --spec {self.dr.cfg.kind}")
        self.name = kind
        self.block = self.dr.cfg.block_size
        self.free_lanes = list(range(lanes))[::-1]
        self.contexts: dict[int, DFlashSeq] = {}  # lane -> the context living there
        self.selector = CandidateSelector(*self.dr.codebooks(), self.dr.cfg.selector_top_k) if kind == "dflash2" \
            else None

    # ---- context ------------------------------------------------------------------------------
    def _state(self, req, st: SpecState, start: int) -> Optional[DFlashSeq]:
        d = st.dflash
        if d is not None and d.seq is req.seq:
            return d
        if d is not None:  # another residency of the request (not reached: release runs on preemption)
            st.dflash = None
            self.contexts.pop(d.lane, None)
            self.free_lanes.append(d.lane)
        if not self.free_lanes:
            return None
        d = st.dflash = DFlashSeq(self.free_lanes.pop(), req.seq, written=start, ring_lo=start)
        self.contexts[d.lane] = d
        return d

    def _add(self, req, st: SpecState, start: int, rows) -> None:
        d = self._state(req, st, start)
        if d is None or not len(rows):
            return
        if d.end != start:  # rows went missing (cannot happen on the engine's paths): restart the context here
            log.warning("dflash: context of request %s jumps from %d to %d", req.rid, d.end, start)
            d.pending, d.written, d.ring_lo = [], start, start
        d.pending.append((start, rows))

    def _flush(self, states) -> None:
        todo = [d for d in states if d is not None and d.pending]
        if not todo:
            return
        self.dr.ctx([(d.seq, d.lane, d.written, [r for _, r in d.pending]) for d in todo])
        for d in todo:
            d.written, d.pending = d.end, []

    def after_prefill(self, items) -> None:
        for req, st, start, rows in items:
            self._add(req, st, start, rows)
        self._flush([st.dflash for _, st, _, _ in items])

    def after_verify(self, req, st: SpecState, hidden, kept: int, k: int, start: int) -> None:
        self._add(req, st, start, hidden)

    def before_round(self) -> None:
        """Write every context's waiting verify rows (drafting this round or not) in one call: on CUDA
        they live in a verify graph's output buffer, which this round's verify may replay over."""
        self._flush(list(self.contexts.values()))

    def release(self, st: SpecState) -> None:
        d = st.dflash
        if d is None:
            return
        st.dflash = None
        try:  # committed rows still waiting: their K/V go into the pages the prefix cache keeps
            self._flush([d])
        except Exception:  # noqa: BLE001 - a failed step may have left the device unusable; drafts are optional
            log.exception("dflash: writing the context of a released request failed")
        self.contexts.pop(d.lane, None)
        self.free_lanes.append(d.lane)

    # ---- drafting -----------------------------------------------------------------------------
    def can_draft(self, req, st: SpecState) -> bool:
        d = st.dflash
        return d is not None and d.seq is req.seq and d.end == pending_position(req, st)

    def _live(self, items) -> list[int]:
        """Indices of the items whose block fits the context and their sequence's pages."""
        self._flush([st.dflash for _, st, _ in items])
        return self._fitting(items)

    def _fitting(self, items) -> list[int]:
        limit = self.runner.manifest.max_context
        live = []
        for i, (req, st, _) in enumerate(items):
            start = st.round.start
            if start + self.block <= limit and self.kv.ensure(req.seq, start + self.block - req.seq.length):
                live.append(i)
        return live

    def _draft(self, items, live: list[int], on_device: bool = False):
        return self.dr.draft([(items[i][0].seq, items[i][1].dflash.lane, items[i][1].round.start,
                               items[i][1].round.pending, items[i][1].dflash.ring_lo,
                               min(items[i][2], self.block - 1)) for i in live], on_device=on_device)

    def stage_device(self, items, uploads):
        """Plainly greedy rows with the whole proposal on the device, part one: the waiting context rows of every
        lane (before_round's flush), the block forward and the walk's anchors join `uploads`, the round's batch
        (the caller sends it with the verify's inputs, then launch_device). None where this does not apply (a
        drafter without select_walk, rows with different draft counts, a block that does not fit, DFlash with
        more than one row): the contexts are flushed now and the decoder proposes another way."""
        ks = {min(k, self.block - 1) for _, _, k in items}
        ok = len(ks) == 1 and (self.dr.has_walk if self.selector is not None else len(items) == 1)
        if not ok or len(self._fitting(items)) != len(items):
            self.before_round()
            return None
        k = ks.pop()
        pending = [d for d in self.contexts.values() if d.pending]
        ctx = self.dr.stage_ctx([(d.seq, d.lane, d.written, [r for _, r in d.pending]) for d in pending], uploads)
        for d in pending:
            d.written, d.pending = d.end, []
        draft = self.dr.stage_draft([(req.seq, st.dflash.lane, st.round.start, st.round.pending, st.dflash.ring_lo, k)
                                     for req, st, _ in items], uploads)
        anchors = self.dr.stage_walk([st.round.pending for _, st, _ in items], uploads) if self.selector else None
        return ctx, draft, anchors, k

    def launch_device(self, staged, argmax):
        """Part two: context, block forward, candidates (the device sampler's top logprobs) and the walk run back to
        back with nothing read; returns the [k, rows] device drafts the verify consumes (DFlash: one row's argmax)."""
        ctx, draft, anchors, k = staged
        if ctx is not None:
            self.dr.run_ctx(ctx)
        out = self.dr.run_draft(draft)
        if self.selector is None:
            return self.dr.hold_drafts(argmax.run(out[0])[0], 1)
        top = argmax.run(out[0], [True] * int(out[0].shape[0]))
        return self.dr.run_walk(top[3], top[4], out[1], anchors)

    def propose_greedy(self, items, argmax) -> Optional[list[list[int]]]:
        """Drafts of plainly greedy rows (the decoder's device rounds) with DFlash2's candidates taken on the
        device: the device sampler's top logprobs of every block row (argmax: spec.device_round.DeviceArgmax), so
        [rows, K] ids and values come to the host instead of [rows, vocab] fp32 logits, and no vocabulary-wide
        work runs there. None where this does not apply (DFlash, or more candidates than the sampler's top
        slots): the decoder then calls propose."""
        if self.selector is None or self.selector.top_k > top_logprob_slots(self.runner.vocab_size):
            return None
        drafts: list[list[int]] = [[] for _ in items]
        live = self._live(items)
        if not live:
            return drafts
        logits, sel = self._draft(items, live, on_device=True)
        assert sel is not None  # a DFlash2 drafter returns the selector's hidden rows
        out = argmax.run(logits, [True] * int(logits.shape[0]))
        top_ids, top_vals = self.runner.read_host(out[3]), self.runner.read_host(out[4])
        row = 0
        for i in live:
            _, st, k = items[i]
            k = min(k, self.block - 1)
            drafts[i] = self.selector.walk_greedy(top_ids[row: row + k], top_vals[row: row + k], sel[row: row + k],
                                                  st.round.pending)
            row += k
        return drafts

    def propose(self, items, choose: Choose) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in items]
        live = self._live(items)
        if not live:
            return drafts
        logits, sel = self._draft(items, live)
        logits = logits[:, : self.runner.sample_vocab]  # ids the tokenizer can produce, as for the target
        row = 0
        for i in live:
            req, st, k = items[i]
            k = min(k, self.block - 1)
            block = logits[row: row + k]
            if self.selector is not None:
                assert sel is not None  # a DFlash2 drafter returns the selector's hidden rows
                drafts[i] = self.selector.walk(block, sel[row: row + k], st.round.pending,
                                               lambda j, r: choose(req, r, j),  # called within walk()
                                               lambda r: penalised_logits(r, req.params, req.row))
            else:
                drafts[i] = [choose(req, block[j], j) for j in range(k)]
            row += k
        return drafts
