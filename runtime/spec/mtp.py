"""The model's own MTP head as the proposer (compile/model.py MTPHead; runner.mtp_prefill / mtp_step).

Row i of the head pairs the main model's final post-norm hidden h_i with the token at i + 1 and
writes the head's KV at position i; drafts chain by feeding the head's own output hidden. The
head's KV needs no rollback: attention reads only positions <= the query's, and those are rewritten.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from ..executor.model_runner import ModelRunner
from .base import Choose
from .state import SpecState


def load_shortlist(spec: str, vocab_size: int, always: list[int]) -> np.ndarray:
    """lm_head_draft: an integer N (ids 0..N-1: a byte-level BPE vocabulary is ordered by merge rank,
    so low ids are the frequent tokens) or a file of token ids (JSON list or whitespace separated).
    `always` (EOS ids) is added so drafts can end a sequence."""
    spec = str(spec).strip()
    if spec.isdigit():
        ids = list(range(min(int(spec), vocab_size)))
    else:
        text = Path(spec).read_text()
        try:
            ids = [int(x) for x in json.loads(text)]
        except (json.JSONDecodeError, TypeError, ValueError):
            ids = [int(x) for x in text.split()]
    ids = sorted({i for i in list(ids) + list(always) if 0 <= i < vocab_size})
    if not ids:
        raise ValueError("lm_head_draft selects no token ids")
    return np.asarray(ids, np.int32)


def shortlist_rows(spec: str, vocab_size: int) -> int:
    """At most how many ids load_shortlist selects for spec (its EOS ids join it: a few rows of slack)."""
    return len(load_shortlist(spec, vocab_size, [])) + 8


def _next_tokens(req, st: SpecState) -> list[int]:
    """The token after each pending MTP row (the head pairs h_i with token i + 1), read out of the request's
    history without copying all of it (a long context is thousands of tokens a round)."""
    assert st.mtp_hidden is not None  # can_draft checked it
    return req.tokens_between(st.mtp_pos + 1, st.mtp_pos + 1 + len(st.mtp_hidden))


def pending_position(req, st: SpecState) -> int:
    """Position of the pending (committed, not yet fed) token: after the state and the unfed tokens."""
    return req.seq.length + len(st.unfed or ())


class MTPProposer:
    name = "mtp"
    wants_prefill_hidden = True

    def __init__(self, runner: ModelRunner, shortlist: Optional[np.ndarray] = None):
        if not runner.has_mtp:
            raise ValueError(f"{runner.art_dir.name} has no MTP head (the checkpoint has no mtp.* weights, or "
                             "the artifact predates MTP support: recompile it)")
        self.runner, self.shortlist = runner, shortlist
        self.vocab = runner.sample_vocab
        # device rounds draft over the shortlist with the head built on the device (executor/draft_head.py);
        # a library without it keeps shortlisted drafting in host rounds
        self.device_head = shortlist is not None and runner.set_draft_head(shortlist)

    def _dense(self, rows: np.ndarray) -> np.ndarray:
        if self.shortlist is None:
            return rows
        out = np.full((rows.shape[0], self.vocab), -np.inf, np.float32)
        out[:, self.shortlist] = rows
        return out

    @staticmethod
    def _add_rows(st: SpecState, start: int, hidden: np.ndarray) -> None:
        if st.mtp_hidden is not None and st.mtp_pos + len(st.mtp_hidden) == start:
            st.mtp_hidden = np.concatenate([st.mtp_hidden, hidden])
        else:  # not contiguous (a preempted request re-prefilled): start over from these rows
            st.mtp_pos, st.mtp_hidden = start, hidden

    def after_prefill(self, items) -> None:
        """Runs the head over every pending row whose next token is known (fills the head's KV for the
        prompt); the last row waits for the sampled token."""
        work = []
        for req, st, start, hidden in items:
            self._add_rows(st, start, hidden)
            known = req.all_tokens()
            r = min(len(st.mtp_hidden), len(known) - 1 - st.mtp_pos)
            if r > 0:
                work.append((req, st, r, known))
        if not work:
            return
        self.runner.mtp_prefill([(req.seq, st.mtp_hidden[:r], known[st.mtp_pos + 1: st.mtp_pos + 1 + r], st.mtp_pos)
                                 for req, st, r, known in work])
        for _, st, r, _ in work:
            st.mtp_pos += r
            st.mtp_hidden = st.mtp_hidden[r:] if r < len(st.mtp_hidden) else None

    def can_draft(self, req, st: SpecState) -> bool:
        # the pending rows must end right before the pending token's position (h_{C-1} pairs with it)
        return st.mtp_hidden is not None and st.mtp_pos + len(st.mtp_hidden) == pending_position(req, st)

    def propose(self, items, choose: Choose) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in items]
        logits, hid = self.runner.mtp_prefill(
            [(req.seq, st.mtp_hidden, _next_tokens(req, st), st.mtp_pos) for req, st, _ in items],
            shortlist=self.shortlist)
        logits = self._dense(logits)
        for i, (req, st, _) in enumerate(items):
            st.mtp_pos, st.mtp_hidden = pending_position(req, st), None
            drafts[i].append(choose(req, logits[i], 0))
        live = list(range(len(items)))
        for j in range(1, max(k for _, _, k in items)):
            live = [i for i in live if items[i][2] > j]
            if not live:
                break
            # draft j + 1: the head's own hidden paired with draft j, at position C + j - 1
            logits, h = self.runner.mtp_step([items[i][0].seq for i in live], hid[live], [drafts[i][-1] for i in live],
                                             [pending_position(*items[i][:2]) + j - 1 for i in live],
                                             shortlist=self.shortlist)
            logits = self._dense(logits)
            hid = hid.copy()
            hid[live] = h
            for r, i in enumerate(live):
                drafts[i].append(choose(items[i][0], logits[r], j))
        return drafts

    def stage_device(self, items, uploads=None):
        """propose() for plainly greedy rows with the chain on the device, part one: stage it (runner.
        stage_draft_chain; launch_device runs it), its inputs joining `uploads` (an executor UploadBatch the
        caller sends before the launch; default: sent now). None when the chain cannot run there (a shortlist
        the library cannot draft over on the device, or rows with different draft counts): propose() then."""
        ks = {k for _, _, k in items}
        if (self.shortlist is not None and not self.device_head) or len(ks) != 1:
            return None
        staged = self.runner.stage_draft_chain(
            [(req.seq, st.mtp_hidden, _next_tokens(req, st), st.mtp_pos) for req, st, _ in items], ks.pop(), uploads,
            head=self.shortlist is not None)
        for req, st, _ in items:
            st.mtp_pos, st.mtp_hidden = pending_position(req, st), None
        return staged

    def launch_device(self, staged, argmax):
        """Part two: every step's drafts are the device's argmax (spec/device_round.py DeviceArgmax) and feed the
        next step there; nothing is read back. Returns the [k, rows] device drafts for the verify to consume.
        With a shortlist the logits are -inf outside it, so the argmax is the host round's choice."""
        return self.runner.run_draft_chain(staged, lambda logits: argmax.run(logits)[0])

    def after_verify(self, req, st: SpecState, hidden: np.ndarray, kept: int, k: int, start: int) -> None:
        self._add_rows(st, start, hidden[: kept + 1])

    def release(self, st: SpecState) -> None:
        st.mtp_hidden = None
