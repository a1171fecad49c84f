"""The speculative decoder: one round = propose k drafts per row, verify every row in ONE batched
target forward, accept the longest acceptable prefix (spec/acceptance.py).

It plugs into the engine in two places and touches nothing else of it:
  - as the scheduler's `Speculation` (how many tokens to re-feed and to draft per row, and `settle`:
    how many of a round's tokens the scheduler committed, so the state can follow);
  - as the executor of decode rows (`round`) and of prefills (`prefill`, which also feeds the MTP
    head), returning the tokens each row produced for the scheduler to commit.
GDN state rollback: a row's state slot is copied (KV manager snapshot) before verification, and the verify
returns every GDN layer's projections of its rows. When not everything verified is committed, the snapshot
becomes the row's state again and the library's gdn_replay advances it over the kept prefix's rows (conv +
delta rule only, as the verify computed them: no target forward, no re-feed); the replays of a round's rows
run in one call once the last of them settles. Libraries without gdn_replay re-feed the kept tokens at the
front of the next verification instead. KV written past the committed length is harmless: attention only
reads positions <= the query's, and those get rewritten.
"""
from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np

from ..config import EngineConfig
from ..executor.model_runner import ModelRunner
from ..device_sampler import supports_device_sampler
from ..kv.manager import KVManager
from ..grammar import mask_logits
from ..sampling import Sampler, log_softmax_top
from ..scheduler.request import Request
from ..scheduler.scheduler import DecodeWork, RowResult
from ..stats import SpecCounters
from .acceptance import accept, accept_argmax, choose_draft
from .base import Proposer
from .device_round import DeviceArgmax, greedy_plain
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
                 sampler: Sampler, counters: SpecCounters, forced_acceptance: Optional[float] = None,
                 device_rounds: bool = True, refeed_max: Optional[int] = None):
        """forced_acceptance: BENCHMARK ONLY, tokens per round to force (spec/forced.py); None = lossless.
        device_rounds: plainly greedy rounds choose drafts (MTP) and accept on the device (spec/device_round.py)
        when the library has the device sampler; off: every round on the host.
        refeed_max: most rolled-back tokens a row re-feeds in a round that still drafts (default k + 1); past it
        the round re-feeds without drafts. Every rejection adds the kept tokens to the pile and only a fully
        accepted round (or a round without drafts) empties it, so a small bound costs rounds of one token and a
        large one costs verify rows (nearly free while the verify stays in the decode GEMV's row range)."""
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
        # rollbacks by replay (runner.gdn_replay): those of the round's rows settled so far, run once the round's
        # last row settles (or before anything else runs); the rows of the round not settled yet
        self._replays: list[tuple[int, Any, tuple, int, int]] = []  # (rid, sequence, verify rows, first row, count)
        self._unsettled: set[int] = set()
        self.refeed_max = draft_tokens + 1 if refeed_max is None else int(refeed_max)
        self.argmax = DeviceArgmax(runner) if device_rounds and supports_device_sampler(runner.manifest, runner.vm) \
            else None
        self._read_at: Optional[float] = None  # perf_counter of the last device round's read (counters.gap_s)

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
        if len(st.unfed or ()) > self.refeed_max:
            return 0  # a round without drafts consumes the re-fed tokens before they pile up
        k = min(self.k, room)
        return k if k > 0 and self.proposer.can_draft(req, st) else 0

    def settle(self, req: Request, committed: int) -> None:
        """The scheduler kept `committed` of the round's output tokens: make the state hold exactly the
        tokens before the last of them (which is pending)."""
        st = self.states.get(req.rid)
        if st is None or st.round is None:
            return
        t0 = time.perf_counter()
        rd, st.round = st.round, None
        self.counters.emitted_tokens += committed
        kept = committed - 1  # drafts kept (the last committed token is the correction / bonus)
        if kept == len(rd.drafts):  # the state consumed exactly what was committed
            if rd.snap is not None:
                self.kv.drop_snapshot(rd.snap[0])
            st.unfed = None
        elif rd.snap is not None and rd.gdn_rows is not None and rd.first_row >= 0:
            # the pre-verify state, advanced over the rows of what was kept (re-fed, pending, kept drafts)
            n = len(rd.refed) + 1 + kept
            self.kv.restore_snapshot(req.live_seq, rd.snap[0], rd.snap[1] + n)
            self._replays.append((req.rid, req.live_seq, rd.gdn_rows, rd.first_row, n))
            self.counters.rollbacks += 1
            self.counters.state_replays += 1
            self.counters.replayed_rows += n
            st.unfed = None
        else:
            if rd.snap is not None:
                self.kv.restore_snapshot(req.live_seq, *rd.snap)
                self.counters.rollbacks += 1
            st.unfed = rd.refed + [rd.pending] + rd.out[:kept]
        assert rd.hidden is not None  # round() stored the verify rows
        self.proposer.after_verify(req, st, rd.hidden[: kept + 1], kept, len(rd.drafts), rd.start)
        self._unsettled.discard(req.rid)
        if not self._unsettled:
            self.flush_replays()
        self.counters.settle_s += time.perf_counter() - t0

    def flush_replays(self) -> None:
        """Run the pending rollback replays (one gdn_replay per verify call): the state slots then hold exactly
        the committed tokens before each pending one."""
        if not self._replays:
            return
        by_call: dict[int, tuple] = {}
        for _, seq, rows, first, n in self._replays:
            by_call.setdefault(id(rows), (rows, []))[1].append((seq, first, n))
        self._replays = []
        for rows, items in by_call.values():
            self.runner.replay_gdn(rows, items)

    def release(self, req: Request) -> None:
        """The request ends or is preempted: run the pending replays (its state may be kept in the prefix cache),
        drop its snapshot (a failed step may leave one) and the proposer's state. Its sequence was settled; a
        readmission re-prefills what it needs."""
        self._unsettled.discard(req.rid)
        self.flush_replays()  # its state reaches its length before the KV manager caches or frees it
        st = self.states.pop(req.rid, None)
        if st is None:
            return
        if st.round is not None and st.round.snap is not None:
            self.kv.drop_snapshot(st.round.snap[0])
        self.proposer.release(st)

    # ---- the executor's side ----------------------------------------------------------------
    def prefill(self, batch: list[tuple[Request, list[int]]]) -> list[np.ndarray]:
        """The target's prefill (last-row logits per sequence); with MTP also fills the head."""
        self.flush_replays()  # (a round whose rows did not all settle)
        self._read_at = None  # the device works on the prefill: no idle gap to the next round
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
        t_round = time.perf_counter()
        self.flush_replays()  # (a round whose rows did not all settle)
        self._unsettled = {w.req.rid for w in work}
        on_device = self._device_round(work)
        # a proposer that stages its device proposal writes its waiting context in the round's one upload
        # (stage_device), or itself before it declines; without drafting rows, here
        staged_context = on_device and hasattr(self.proposer, "stage_device")
        if self.before_round is not None and not staged_context:
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
        t = time.perf_counter()
        c.snapshot_s += t - t_round
        drafting = [(w.req, self.state(w.req), w.draft) for w in work if w.draft]
        if self.before_round is not None and staged_context and not drafting:
            self.before_round()
        # a device round's chain and verify inputs go up in one host->device copy (each copy waits for the device)
        uploads = self.runner.upload_batch() if on_device else None
        try:
            chain = self._propose(drafting, on_device, uploads) if drafting else None
        except BaseException:
            if uploads is not None:
                uploads.discard()
            raise
        t, t0 = time.perf_counter(), t
        c.propose_s += t - t0
        batch = [(w.req.live_seq, w.feed + self._record(w.req).drafts) for w in work]
        at = 0
        for w, (_, toks) in zip(work, batch):
            self._record(w.req).first_row = at
            at += len(toks)
        if uploads is not None:
            results = self._verify_accept_device(work, batch, t, chain, drafting, uploads)
        else:
            self._read_at = None
            logits, hidden = self.runner.verify(batch, **self.hidden_kw)
            t, t0 = time.perf_counter(), t
            c.verify_s += t - t0
            results = {}
            for w, lg, hd in zip(work, logits, hidden):
                results[w.req.rid] = self._accept_host(w, lg, hd)
            c.accept_s += time.perf_counter() - t
        for w in work:
            rd = self._record(w.req)
            rd.gdn_rows = self.runner.verify_gdn_rows  # what a rollback replays (None: it re-feeds)
            c.draft_tokens += len(rd.drafts)
            c.accepted_tokens += results[w.req.rid].accepted
            c.verify_tokens += len(w.feed) + len(rd.drafts)
            c.recompute_tokens += len(rd.refed)
            c.no_draft_rounds += 0 if rd.drafts else 1
        c.rounds += 1
        c.row_rounds += len(work)
        c.device_rounds += int(on_device)
        c.round_s += time.perf_counter() - t_round
        return results

    def _device_round(self, work: list[DecodeWork]) -> bool:
        """Whether this round's drafts and acceptance run on the device: every row plainly greedy, and no
        forced-acceptance row asking for logprobs (forced rows keep drafts that need not be the argmax)."""
        if self.argmax is None:
            return False
        for w in work:
            if not greedy_plain(w.req.row, w.req.grammar):
                return False
            if self.forced is not None and _wants_logprobs(w.req):
                return False
        return True

    def _propose(self, drafting: list, on_device: bool, uploads=None):
        """Drafts into every drafting row's record; when the proposer will choose them on the device, its chain is
        staged (its inputs join `uploads`, unsent) and this returns the call that launches it (-> the [k, rows]
        device drafts); the records then hold k placeholders, replaced once the round reads the device."""
        stage_device = getattr(self.proposer, "stage_device", None)
        launch_device = getattr(self.proposer, "launch_device", None)
        if on_device and stage_device is not None and launch_device is not None:
            staged = stage_device(drafting, uploads)
            if staged is not None:
                for _, st, k in drafting:
                    assert st.round is not None  # opened for every row
                    st.round.drafts, st.qs = [0] * k, [None] * k  # greedy: no draft distributions
                self.counters.device_drafts += 1
                argmax = self.argmax
                return lambda: launch_device(staged, argmax)
        propose_greedy = getattr(self.proposer, "propose_greedy", None)
        if on_device and propose_greedy is not None:  # plainly greedy rows: no draft distributions, no history
            greedy = propose_greedy(drafting, self.argmax)
            if greedy is not None:
                for (_, st, _), d in zip(drafting, greedy):
                    assert st.round is not None  # opened for every row
                    st.round.drafts, st.qs = d, [None] * len(d)
                self.counters.device_drafts += 1
                return None
        drafts = self.proposer.propose(drafting, self._choose)
        for (req, st, _), d in zip(drafting, drafts):
            req.row.rollback(len(d))  # drafts leave the history; acceptance re-adds the kept ones
            assert st.round is not None  # opened for every row
            st.round.drafts = d
        return None

    def _verify_accept_device(self, work: list[DecodeWork], batch: list, t: float, chain,
                              drafting: list, uploads) -> dict[int, RowResult]:
        """The verify is staged, its inputs and the draft chain's sent in one copy, then the staged draft chain
        (chain) and the verify over its drafts are launched without a wait, then the target's argmax of every row
        (and the logprobs rows ask for) on the device; the ids are the round's one read of the device, the drafts
        come with it (the chain's and the verify's kernels finish inside it: accept_s)."""
        c = self.counters
        try:
            staged = self.runner.stage_verify(batch, uploads=uploads, **self.hidden_kw)
            uploads.send()
        except BaseException:
            uploads.discard()
            raise
        drafts = None
        if self._read_at is not None:  # the device idled from the last round's read to this first launch
            c.gap_s += time.perf_counter() - self._read_at
            c.gaps += 1
            self._read_at = None
        if chain is not None:  # (chain row, index of its first draft among the verify's tokens: after its feed)
            drafts = chain()
            where = []
            for r, (req, _, _) in enumerate(drafting):
                rd = self._record(req)
                where.append((r, rd.first_row + len(rd.refed) + 1))
        logits, cu, hid = self.runner.verify_device(staged, None if drafts is None else (drafts, where))
        lp_rows = None  # per verify row, whether its logprobs are read (only built when a row asks)
        if any(_wants_logprobs(w.req) for w in work):
            lp_rows = np.zeros(int(cu[-1]), bool)
            for i, w in enumerate(work):
                if _wants_logprobs(w.req):
                    lp_rows[cu[i] + len(self._record(w.req).refed): cu[i + 1]] = True
        assert self.argmax is not None  # _device_round checked it
        out = self.argmax.run(logits, lp_rows.tolist() if lp_rows is not None else None)
        t, t0 = time.perf_counter(), t
        c.verify_s += t - t0
        target = self.runner.read_host(out[0])
        self._read_at = time.perf_counter()
        if drafts is not None:
            cols = self.runner.read_host(drafts)
            for r, (req, _, _) in enumerate(drafting):
                self._record(req).drafts = [int(x) for x in cols[:, r]]
        hidden = self.runner.split_rows(hid, cu, bool(self.hidden_kw))
        lp_host = DeviceArgmax.read_logprobs(out) if lp_rows is not None else None
        results = {}
        for i, (w, hd) in enumerate(zip(work, hidden)):
            req, st = w.req, self.state(w.req)
            rd = self._record(req)
            n_re = len(rd.refed)
            rd.hidden = hd[n_re:]
            tg = target[cu[i] + n_re: cu[i + 1]]
            if self.forced is not None and rd.drafts:  # benchmark profile: not the model's output
                n_acc = self.forced.count(st, len(rd.drafts))
                rd.out = self.forced.accept_ids(req.row, tg, rd.drafts, n_acc)
            else:
                rd.out, n_acc = accept_argmax(req.row, tg, rd.drafts)
            lps: list = [None] * len(rd.out)
            if lp_host is not None and _wants_logprobs(req):  # the emitted tokens are the argmax of their rows
                first = int(cu[i]) + n_re
                lps = DeviceArgmax.logprobs_of(lp_host, range(first, first + len(rd.out)),
                                               [req.params.top_logprobs] * len(rd.out))
            results[req.rid] = RowResult(list(rd.out), lps, fed=len(w.feed) + len(rd.drafts),
                                         drafted=len(rd.drafts), accepted=n_acc)
        c.accept_s += time.perf_counter() - t
        return results

    def _accept_host(self, w: DecodeWork, lg: np.ndarray, hd) -> RowResult:
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
        lps = [log_softmax_top(lg[i], t, int(p.top_logprobs)) if _wants_logprobs(req) else None
               for i, t in enumerate(rd.out)]
        return RowResult(list(rd.out), lps, fed=len(w.feed) + len(rd.drafts), drafted=len(rd.drafts), accepted=n_acc)


def _wants_logprobs(req: Request) -> bool:
    return bool(req.params.logprobs or req.params.top_logprobs > 0)
