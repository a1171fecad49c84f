"""The speculative decoder: one round = propose k drafts per row, verify every row in ONE batched
target forward, accept the longest acceptable prefix (spec/acceptance.py).

It plugs into the engine in two places and touches nothing else of it:
  - as the scheduler's `Speculation` (how many tokens to re-feed and to draft per row, and `settle`:
    how many of a round's tokens the scheduler committed, so the state can follow);
  - as the executor of decode rows (`round`) and of prefills (`prefill`, which also feeds the MTP
    head), returning the tokens each row produced for the scheduler to commit.
GDN state rollback: a row's state slot is copied (KV manager snapshot) before verification. When not
everything verified is committed, the snapshot becomes the row's state again and the kept tokens are
re-fed at the front of the next verification. KV written past the committed length is harmless:
attention only reads positions <= the query's, and those get rewritten.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..config import EngineConfig
from ..executor.model_runner import ModelRunner
from ..kv.manager import KVManager
from ..grammar import mask_logits
from ..sampling import Sampler, log_softmax_top
from ..scheduler.request import Request
from ..scheduler.scheduler import DecodeWork, RowResult
from ..stats import SpecCounters
from .acceptance import accept, choose_draft
from .base import Proposer
from .draft import DraftModelProposer
from .forced import ForcedAcceptance
from .mtp import MTPProposer, load_shortlist
from .state import RoundRecord, SpecState


def make_proposer(cfg: EngineConfig, runner: ModelRunner, kv: KVManager, eos_ids: list[int]) -> Proposer:
    if not runner.has_verify:
        raise ValueError(f"{runner.art_dir.name} lacks the verify/prefill_h functions; recompile it with this "
                         "version of `ninfer compile`")
    if cfg.spec == "mtp":
        shortlist = load_shortlist(cfg.lm_head_draft, runner.sample_vocab, eos_ids) if cfg.lm_head_draft else None
        return MTPProposer(runner, shortlist)
    if cfg.spec == "draft":
        assert cfg.draft_model and cfg.prefill_chunk is not None  # validate() checked it; assemble() sets the chunk
        return DraftModelProposer(runner, kv.pages.num_pages, cfg.draft_model, slots=2 * cfg.max_concurrency + 1,
                                  chunk=cfg.prefill_chunk, max_batch=cfg.max_concurrency)
    if cfg.spec in ("dflash", "dflash2"):
        from .dflash import DFlashProposer

        assert cfg.draft_model  # validate() checked it
        return DFlashProposer(runner, kv, cfg.draft_model, cfg.spec, lanes=cfg.max_concurrency,
                              max_batch=cfg.max_concurrency)
    raise ValueError(f"unknown speculative method {cfg.spec!r}")


class SpeculativeDecoder:
    def __init__(self, runner: ModelRunner, kv: KVManager, proposer: Proposer, draft_tokens: int,
                 sampler: Sampler, counters: SpecCounters, forced_acceptance: Optional[float] = None):
        """forced_acceptance: BENCHMARK ONLY, tokens per round to force (spec/forced.py); None = lossless."""
        self.runner, self.kv, self.proposer, self.k = runner, kv, proposer, draft_tokens
        self.sampler, self.counters = sampler, counters
        counters.backend, counters.draft_tokens_max = proposer.name, draft_tokens
        self.forced = ForcedAcceptance(forced_acceptance, draft_tokens) if forced_acceptance is not None else None
        counters.forced_acceptance = forced_acceptance
        # what the target's prefill / verify return besides logits for the proposer: the final hidden
        # state (MTP) or, for DFlash drafters, the tap layers' outputs
        self.hidden_kw = {"taps": True} if getattr(proposer, "target_hidden", "final") == "taps" else {}
        self.before_round = getattr(proposer, "before_round", None)
        self.states: dict[int, SpecState] = {}

    def state(self, req: Request) -> SpecState:
        st = self.states.get(req.rid)
        if st is None:
            st = self.states[req.rid] = SpecState()
        return st

    # ---- the scheduler's side ---------------------------------------------------------------
    def refeed(self, req: Request) -> list[int]:
        st = self.states.get(req.rid)
        return list(st.unfed) if st is not None and st.unfed else []

    def draft_budget(self, req: Request, room: int) -> int:
        st = self.state(req)
        if req.grammar is not None:
            return 0  # constrained requests decode without drafts (their one token is masked)
        if len(st.unfed or ()) > self.k + 1:
            return 0  # a round without drafts consumes the re-fed tokens before they pile up
        k = min(self.k, room)
        return k if k > 0 and self.proposer.can_draft(req, st) else 0

    def settle(self, req: Request, committed: int) -> None:
        """The scheduler kept `committed` of the round's output tokens: make the state hold exactly the
        tokens before the last of them (which is pending)."""
        st = self.states.get(req.rid)
        if st is None or st.round is None:
            return
        rd, st.round = st.round, None
        self.counters.emitted_tokens += committed
        kept = committed - 1  # drafts kept (the last committed token is the correction / bonus)
        if kept == len(rd.drafts):  # the state consumed exactly what was committed
            if rd.snap is not None:
                self.kv.drop_snapshot(rd.snap[0])
            st.unfed = None
        else:
            if rd.snap is not None:
                self.kv.restore_snapshot(req.live_seq, *rd.snap)
                self.counters.rollbacks += 1
            st.unfed = rd.refed + [rd.pending] + rd.out[:kept]
        assert rd.hidden is not None  # round() stored the verify rows
        self.proposer.after_verify(req, st, rd.hidden[: kept + 1], kept, len(rd.drafts), rd.start)

    def release(self, req: Request) -> None:
        """The request ends or is preempted: drop its snapshot (a failed step may leave one) and the
        proposer's state. Its sequence was settled; a readmission re-prefills what it needs."""
        st = self.states.pop(req.rid, None)
        if st is None:
            return
        if st.round is not None and st.round.snap is not None:
            self.kv.drop_snapshot(st.round.snap[0])
        self.proposer.release(st)

    # ---- the executor's side ----------------------------------------------------------------
    def prefill(self, batch: list[tuple[Request, list[int]]]) -> list[np.ndarray]:
        """The target's prefill (last-row logits per sequence); with MTP also fills the head."""
        for req, _ in batch:  # a (re)admitted request's feed already holds any unfed tokens
            self.state(req).unfed = None
        if not self.proposer.wants_prefill_hidden:
            return self.runner.prefill([(req.live_seq, t) for req, t in batch])
        starts = [req.live_seq.length for req, _ in batch]
        logits, hidden = self.runner.prefill_h([(req.live_seq, t) for req, t in batch], **self.hidden_kw)
        self.proposer.after_prefill([(req, self.state(req), s, h) for (req, _), s, h in zip(batch, starts, hidden)])
        return logits

    def _record(self, req: Request) -> RoundRecord:
        """The record of req's round in progress (round() opens one for every row first)."""
        rd = self.state(req).round
        assert rd is not None
        return rd

    def _choose(self, req: Request, logits_row: np.ndarray, j: int) -> int:
        t, q = choose_draft(req.row, logits_row)
        self.state(req).qs.append(q)
        req.row.append(t)  # drafts join the history while drafting (penalties see them)
        return t

    def round(self, work: list[DecodeWork]) -> dict[int, RowResult]:
        c = self.counters
        if self.before_round is not None:
            self.before_round()
        for w in work:
            st = self.state(w.req)
            seq = w.req.live_seq
            st.qs = []
            snap: Optional[tuple[int, int]] = None
            if w.draft:
                slot = self.kv.snapshot_state(seq)
                if slot is None:
                    w.draft = 0
                else:
                    snap = (slot, seq.length)
            st.round = RoundRecord(refed=w.feed[:-1], pending=w.feed[-1], drafts=[], out=[],
                                   start=seq.length + len(w.feed) - 1, snap=snap)
        drafting = [(w.req, self.state(w.req), w.draft) for w in work if w.draft]
        if drafting:
            for (req, st, _), d in zip(drafting, self.proposer.propose(drafting, self._choose)):
                assert st.round is not None  # opened above for every row
                st.round.drafts = d
                req.row.rollback(len(d))  # drafts leave the history; acceptance re-adds the kept ones
        logits, hidden = self.runner.verify([(w.req.live_seq, w.feed + self._record(w.req).drafts) for w in work],
                                            **self.hidden_kw)
        results = {}
        for w, lg, hd in zip(work, logits, hidden):
            req, st = w.req, self.state(w.req)
            rd = self._record(req)
            n_re = len(rd.refed)
            lg, rd.hidden = lg[n_re:], hd[n_re:]  # rows of the pending token and the drafts
            if req.grammar is not None:  # no drafts: the one token it samples follows the grammar
                lg = mask_logits([req.grammar], lg)
            if self.forced is not None and rd.drafts:  # benchmark profile: not the model's output
                n_acc = self.forced.count(st, len(rd.drafts))
                rd.out = self.forced.accept(req.row, lg, rd.drafts, n_acc, self.sampler)
            else:
                rd.out, n_acc = accept(req.row, lg, rd.drafts, st.qs, self.sampler)
            p = req.params
            want_lp = p.logprobs or p.top_logprobs > 0
            lps = [log_softmax_top(lg[i], t, int(p.top_logprobs)) if want_lp else None for i, t in enumerate(rd.out)]
            results[req.rid] = RowResult(list(rd.out), lps, fed=len(w.feed) + len(rd.drafts),
                                         drafted=len(rd.drafts), accepted=n_acc)
            c.draft_tokens += len(rd.drafts)
            c.accepted_tokens += n_acc
            c.verify_tokens += len(w.feed) + len(rd.drafts)
            c.recompute_tokens += n_re
            c.no_draft_rounds += 0 if rd.drafts else 1
        c.rounds += 1
        c.row_rounds += len(work)
        return results
