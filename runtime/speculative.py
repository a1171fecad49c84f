"""Speculative decoding for the engine: propose k draft tokens, verify them in ONE batched target
forward, keep the longest acceptable prefix (lossless for greedy and for sampling).

Proposers
  mtp    the model's own MTP head (compile/model.py MTPHead; runner.mtp_prefill / mtp_step). Row i of
         the head pairs the main model's final post-norm hidden h_i with the token at i + 1 and writes
         the head's KV at position i; drafts chain by feeding the head's own output hidden.
  draft  a second compiled artifact with the same tokenizer (its own runner, pages and state slots).

Acceptance (per sequence, drafts d_1..d_k, target rows 0..k of the verification forward)
  greedy     accept while d_i == argmax(target row i-1); the first mismatch is replaced by that argmax;
             all accepted -> bonus argmax of row k. Token-for-token what plain decoding produces.
  sampling   standard speculative rejection sampling: accept d_i with probability min(1, p(d_i)/q(d_i)),
             on reject draw from norm(max(0, p - q)); all accepted -> bonus draw from p(row k). p and q
             are both `probs_after_processing` (temperature, top-k/p, min-p, bias, penalties over the
             history including the drafts accepted so far), so the output distribution is the target's.

GDN state rollback: the sequence's state slot is copied to a scratch slot before verification. When a
draft is rejected the scratch copy becomes the sequence's slot again and the accepted tokens are
re-run (one batched prefill over every sequence that needs it). KV written past the accepted length
is harmless: attention only reads positions <= the query's, and those get rewritten. The MTP head's
KV needs no rollback for the same reason.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from .grammar import mask_logits
from .kv_pages import OutOfPages
from .model_runner import ContextLimitError, ModelRunner, SeqKV
from .sampling import _argmax, _log_softmax_top, _needs_logit_edit, probs_after_processing, sample_from_probs

SPEC_METHODS = ("none", "mtp", "draft")
MAX_DRAFT_TOKENS = 5


@dataclass
class SpecRow:
    """Speculative state of one request."""

    mtp_pos: int = 0  # position of the first pending MTP row
    mtp_hidden: Optional[np.ndarray] = None  # [m, D] main hidden rows not yet run through the MTP head
    snap: Optional[tuple[int, int]] = None  # (scratch slot, state length) while a verification is open
    unfed: Optional[list] = None  # committed tokens the GDN state has not consumed yet (after a rollback)
    seq: Optional[SeqKV] = None  # the device sequence `unfed` refers to (a readmitted request gets a new one)
    draft_seq: Optional[SeqKV] = None  # draft-model path: the drafter's sequence
    draft_snap: Optional[tuple[int, int]] = None
    draft_n: int = 0
    draft_accepted: int = 0


# ---- shortlist (--lm-head-draft) ---------------------------------------------------------------
def load_shortlist(spec: str, vocab_size: int, always: list[int]) -> np.ndarray:
    """--lm-head-draft: an integer N (ids 0..N-1: a byte-level BPE vocabulary is ordered by merge rank,
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
        raise ValueError("--lm-head-draft selects no token ids")
    return np.asarray(ids, np.int32)


def _fit_vocab(row: np.ndarray, vocab: int) -> np.ndarray:
    """Draft logits over the target vocabulary (a drafter may pad its vocabulary differently)."""
    if row.shape[0] == vocab:
        return row
    if row.shape[0] > vocab:
        return row[:vocab]
    out = np.full(vocab, -np.inf, np.float32)
    out[: row.shape[0]] = row
    return out


# ---- proposers ---------------------------------------------------------------------------------
class MTPProposer:
    name = "mtp"

    def __init__(self, runner: ModelRunner, shortlist: Optional[np.ndarray] = None):
        if not runner.has_mtp:
            raise ValueError(f"--spec mtp: {runner.art_dir.name} has no MTP head (the checkpoint has no mtp.* "
                             "weights, or the artifact predates MTP support: recompile it)")
        self.runner, self.shortlist = runner, shortlist
        self.vocab = runner.vocab_size

    def _dense(self, rows: np.ndarray) -> np.ndarray:
        if self.shortlist is None:
            return rows
        out = np.full((rows.shape[0], self.vocab), -np.inf, np.float32)
        out[:, self.shortlist] = rows
        return out

    @staticmethod
    def _add_rows(st: SpecRow, start: int, hidden: np.ndarray) -> None:
        if st.mtp_hidden is not None and st.mtp_pos + len(st.mtp_hidden) == start:
            st.mtp_hidden = np.concatenate([st.mtp_hidden, hidden])
        else:  # not contiguous (a preempted request re-prefilled): start over from these rows
            st.mtp_pos, st.mtp_hidden = start, hidden

    def after_prefill(self, items) -> None:
        """items: [(a, st, start position, hidden [n, D])]. Runs the head over every pending row whose next
        token is known (fills the head's KV for the prompt); the last row waits for the sampled token."""
        work = []
        for a, st, start, hidden in items:
            self._add_rows(st, start, hidden)
            known = list(a.req.prompt_ids) + a.generated
            r = min(len(st.mtp_hidden), len(known) - 1 - st.mtp_pos)
            if r > 0:
                work.append((a, st, r, known))
        if not work:
            return
        self.runner.mtp_prefill([(a.seq, st.mtp_hidden[:r], known[st.mtp_pos + 1: st.mtp_pos + 1 + r], st.mtp_pos)
                                 for a, st, r, known in work])
        for _, st, r, _ in work:
            st.mtp_pos += r
            st.mtp_hidden = st.mtp_hidden[r:] if r < len(st.mtp_hidden) else None

    def can_draft(self, a, st: SpecRow) -> bool:
        # the pending rows must end right before the pending token's position (h_{C-1} pairs with it)
        return st.mtp_hidden is not None and st.mtp_pos + len(st.mtp_hidden) == _pending_pos(a, st)

    def propose(self, items, choose) -> list[list[int]]:
        """items: [(a, st, k)] with k >= 1. Returns the drafts of each; choose(a, logits_row, j) -> token."""
        drafts = [[] for _ in items]
        known = [list(a.req.prompt_ids) + a.generated for a, _, _ in items]
        logits, hid = self.runner.mtp_prefill(
            [(a.seq, st.mtp_hidden, kn[st.mtp_pos + 1: st.mtp_pos + 1 + len(st.mtp_hidden)], st.mtp_pos)
             for (a, st, _), kn in zip(items, known)], shortlist=self.shortlist)
        logits = self._dense(logits)
        for i, (a, st, _) in enumerate(items):
            st.mtp_pos, st.mtp_hidden = _pending_pos(a, st), None
            drafts[i].append(choose(a, logits[i], 0))
        live = list(range(len(items)))
        for j in range(1, max(k for _, _, k in items)):
            live = [i for i in live if items[i][2] > j]
            if not live:
                break
            seqs = [items[i][0].seq for i in live]
            # draft j + 1: the head's own hidden paired with draft j, at position C + j - 1
            logits, h = self.runner.mtp_step(seqs, hid[live], [drafts[i][-1] for i in live],
                                             [_pending_pos(*items[i][:2]) + j - 1 for i in live],
                                             shortlist=self.shortlist)
            logits = self._dense(logits)
            hid = hid.copy()
            hid[live] = h
            for r, i in enumerate(live):
                drafts[i].append(choose(items[i][0], logits[r], j))
        return drafts

    def after_verify(self, a, st: SpecRow, hidden: np.ndarray, n_acc: int, k: int, start: int) -> None:
        """hidden: the verification rows of the pending token and the accepted drafts (positions start..)."""
        self._add_rows(st, start, hidden[: n_acc + 1])

    def release(self, st: SpecRow) -> None:
        st.mtp_hidden = None


class DraftModelProposer:
    """A smaller compiled model with the same tokenizer proposes the drafts (greedy/sampled from its logits)."""

    name = "draft"

    def __init__(self, target: ModelRunner, draft_dir: str | Path, slots: int, chunk: int):
        draft_dir = Path(draft_dir)
        _check_same_tokenizer(target.art_dir, draft_dir)
        cap = target.pages.num_pages * target.page_size
        self.dr = ModelRunner(draft_dir, device=target.device_kind, kv_capacity_tokens=cap, num_slots=slots)
        self.vocab = target.vocab_size
        self.chunk = max(1, chunk)

    def after_prefill(self, items) -> None:  # the drafter catches up lazily in propose
        pass

    def can_draft(self, a, st: SpecRow) -> bool:
        if st.draft_seq is None:
            try:
                st.draft_seq = self.dr.new_seq()
            except OutOfPages:
                return False
        return True

    def _reserve(self, seq: SeqKV, n: int) -> bool:
        try:
            self.dr.reserve(seq, n)
            return True
        except (OutOfPages, ContextLimitError):
            return False

    def propose(self, items, choose) -> list[list[int]]:
        drafts = [[] for _ in items]
        dr = self.dr
        todo = []  # (index, tokens still to feed: committed history + the pending token)
        for i, (a, st, k) in enumerate(items):
            known = list(a.req.prompt_ids) + a.generated
            feed = known[st.draft_seq.length:]
            if not feed or not self._reserve(st.draft_seq, len(feed) + k - 1):
                continue
            todo.append((i, feed))
        first, left = {}, dict(todo)
        while left:  # chunked catch-up; the final chunk's last row gives draft 1
            batch = [(i, f[: self.chunk]) for i, f in left.items()]
            out = dr.prefill([(items[i][1].draft_seq, t) for i, t in batch])
            for (i, t), lg in zip(batch, out):
                left[i] = left[i][len(t):]
                if not left[i]:
                    del left[i]
                    first[i] = lg
        live = sorted(first)
        for i in live:
            a, st, k = items[i]
            if k > 1:  # the drafter will swallow speculative tokens: keep its committed state
                slot = dr.slots.alloc()
                if slot is not None:
                    dr.copy_state(st.draft_seq.slot, slot)
                    st.draft_snap = (slot, st.draft_seq.length)
            drafts[i].append(choose(a, _fit_vocab(first[i], self.vocab), 0))
        for j in range(1, max([k for _, _, k in items] + [0])):
            live = [i for i in live if items[i][2] > j and items[i][1].draft_snap is not None]
            if not live:
                break
            lg = dr.decode([items[i][1].draft_seq for i in live], [drafts[i][-1] for i in live])
            for r, i in enumerate(live):
                drafts[i].append(choose(items[i][0], _fit_vocab(lg[r], self.vocab), j))
        return drafts

    def after_verify(self, a, st: SpecRow, hidden, n_acc: int, k: int, start: int) -> None:
        if st.draft_snap is None:
            return
        slot, length = st.draft_snap
        st.draft_snap = None
        ds = st.draft_seq
        if n_acc >= ds.length - length:  # every draft the drafter consumed was accepted
            self.dr.slots.release(slot)
        else:
            self.dr.slots.release(ds.slot)
            ds.slot, ds.length = slot, length

    def release(self, st: SpecRow) -> None:
        if st.draft_snap is not None:
            self.dr.slots.release(st.draft_snap[0])
            st.draft_snap = None
        if st.draft_seq is not None:
            self.dr.free_seq(st.draft_seq)
            st.draft_seq = None


def _pending_pos(a, st: SpecRow) -> int:
    """Position of the pending (sampled, not yet fed) token: after the state and the unfed tokens."""
    return a.seq.length + len(st.unfed or ())


def _check_same_tokenizer(target_dir: Path, draft_dir: Path) -> None:
    from .tokenizer import load_tokenizer

    if not (draft_dir / "manifest.json").is_file():
        raise ValueError(f"--draft-model {draft_dir}: not a compiled model directory (manifest.json missing)")
    try:
        a, b = load_tokenizer(target_dir), load_tokenizer(draft_dir)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"--draft-model {draft_dir}: cannot load its tokenizer ({e})") from None
    if a.get_vocab(with_added_tokens=True) != b.get_vocab(with_added_tokens=True):
        raise ValueError(f"--draft-model {draft_dir}: its tokenizer differs from the target model's; "
                         "a drafter must share the vocabulary")


# ---- the engine side ---------------------------------------------------------------------------
class Speculator:
    """Owned by runtime.engine.Engine when EngineOptions.spec != "none"; runs on the engine thread."""

    def __init__(self, engine):
        self.eng = engine
        opt, runner = engine.opt, engine.runner
        self.k = int(opt.draft_tokens)
        if not runner.has_verify:
            raise ValueError(f"--spec {opt.spec}: {runner.art_dir.name} lacks the verify/prefill_h functions; "
                             "recompile it with this version of `ninfer compile`")
        if opt.spec == "mtp":
            shortlist = None
            if opt.lm_head_draft:
                shortlist = load_shortlist(opt.lm_head_draft, runner.vocab_size, sorted(engine.eos_ids))
            self.proposer = MTPProposer(runner, shortlist)
        elif opt.spec == "draft":
            self.proposer = DraftModelProposer(runner, opt.draft_model, slots=2 * opt.max_concurrency + 1,
                                               chunk=opt.prefill_chunk)
        else:
            raise ValueError(f"--spec must be one of {SPEC_METHODS}, got {opt.spec!r}")
        self.rows: dict[int, SpecRow] = {}
        engine.stats.update({
            "spec_backend": opt.spec, "spec_draft_tokens_max": self.k, "spec_rounds": 0, "spec_row_rounds": 0,
            "spec_draft_tokens": 0, "spec_accepted_tokens": 0, "spec_emitted_tokens": 0,
            "spec_acceptance_rate": 0.0, "spec_tokens_per_round": 0.0, "spec_verify_tokens": 0,
            "spec_recompute_tokens": 0, "spec_rollbacks": 0, "spec_no_draft_rounds": 0,
        })

    def row(self, a) -> SpecRow:
        st = self.rows.get(a.rid)
        if st is None:
            st = self.rows[a.rid] = SpecRow()
        return st

    # ---- prefill -------------------------------------------------------------------------------
    def prefill(self, batch) -> list[np.ndarray]:
        """Engine._prefill_step's forward: last-token logits per sequence; with MTP also fills the head."""
        r = self.eng.runner
        for a, _ in batch:  # a (re)admitted request's feed already holds any unfed tokens
            st = self.row(a)
            st.seq, st.unfed = a.seq, None
        if not isinstance(self.proposer, MTPProposer):
            return r.prefill([(a.seq, t) for a, t in batch])
        starts = [a.seq.length for a, _ in batch]
        logits, hidden = r.prefill_h([(a.seq, t) for a, t in batch])
        self.proposer.after_prefill([(a, self.row(a), s, h) for (a, _), s, h in zip(batch, starts, hidden)])
        return logits

    # ---- one decode round ----------------------------------------------------------------------
    def _budget(self, a, st: SpecRow) -> int:
        room = a.max_tokens - len(a.generated) - 1  # this round emits up to k + 1 tokens
        limit = min(self.eng.opt.max_context, self.eng.runner.manifest.max_context) - _pending_pos(a, st) - 1
        k = max(0, min(self.k, room, limit))
        if getattr(a, "grammar", None) is not None:  # [grammar hook] constrained requests decode without drafts
            return 0
        return k if k and self.proposer.can_draft(a, st) else 0

    def _try_reserve(self, a, n: int) -> bool:
        try:
            self.eng.runner.reserve(a.seq, n)
            return True
        except (OutOfPages, ContextLimitError):
            return False

    def _snapshot(self, a, st: SpecRow) -> bool:
        eng = self.eng
        if eng.runner.slots.free_slots == 0 and not eng.kv.make_room(slots=1):
            return False
        slot = eng.runner.slots.alloc()
        if slot is None:
            return False
        eng.runner.copy_state(a.seq.slot, slot)
        st.snap = (slot, a.seq.length)
        return True

    def _rollback(self, a, st: SpecRow) -> None:
        slot, length = st.snap
        st.snap = None
        self.eng.runner.slots.release(a.seq.slot)
        a.seq.slot, a.seq.length = slot, length
        self.eng.stats["spec_rollbacks"] += 1

    def _drop_snapshot(self, st: SpecRow) -> None:
        if st.snap is not None:
            self.eng.runner.slots.release(st.snap[0])
            st.snap = None

    def _choose(self, a, logits_row: np.ndarray, j: int) -> int:
        """Draft token from the proposer's logits (same processing as the target's); the draft
        distribution q is kept for the rejection test. Drafts join the history while drafting."""
        row, params = a.row, a.row.params
        if params.temperature == 0:
            t = _argmax(logits_row) if not _needs_logit_edit(params, row) else \
                int(np.argmax(probs_after_processing(logits_row, params, row)))
            q = None
        else:
            q = probs_after_processing(logits_row, params, row)
            t = sample_from_probs(q, row.rng)
        self._q[a.rid].append(q)
        row.append(t)
        return int(t)

    def _accept(self, a, logits: np.ndarray, drafts: list[int], qs: list) -> tuple[list[int], int]:
        """Tokens to emit (accepted drafts + one correction/bonus token) and the number accepted.
        Appends them to the row's sampling history."""
        row, params = a.row, a.row.params
        out: list[int] = []
        plain = params.temperature == 0 and not _needs_logit_edit(params, row)
        for i, d in enumerate(drafts):
            if plain:
                t = _argmax(logits[i])
                ok = t == d
            elif params.temperature == 0:
                t = int(np.argmax(probs_after_processing(logits[i], params, row)))
                ok = t == d
            else:
                p, q = probs_after_processing(logits[i], params, row), qs[i]
                ok = q[d] > 0 and row.rng.random() * q[d] < p[d]  # accept with probability min(1, p/q)
                if not ok:
                    resid = np.maximum(p - q, 0.0)
                    t = sample_from_probs(resid if resid.sum() > 0 else p, row.rng)
            if ok:
                out.append(d)
                row.append(d)
            else:
                out.append(int(t))
                row.append(int(t))
                return out, i
        last = logits[len(drafts): len(drafts) + 1]
        if getattr(a, "grammar", None) is not None:  # [grammar hook] constrained: mask the one token it samples
            last = mask_logits([a.grammar], last)
        bonus = self.eng.sampler.sample(last, [row])  # appends to the history
        out.append(int(bonus[0]))
        return out, len(drafts)

    def decode_step(self) -> None:
        eng, r = self.eng, self.eng.runner
        rows = [a for a in eng._active.values() if a.decoding]
        ok, plan = [], {}
        for a in rows:
            if a.rid not in eng._active:
                continue
            st = self.row(a)
            if st.seq is not a.seq:  # preempted and readmitted: its feed re-ran the unfed tokens
                st.seq, st.unfed = a.seq, None
            n_unfed = len(st.unfed or ())
            k = self._budget(a, st)
            if not (k and self._try_reserve(a, n_unfed + 1 + k)):
                k = 0
                if not eng._reserve(a, n_unfed + 1, protect={b.rid for b in ok}):
                    continue
            ok.append(a)
            plan[a.rid] = k
        rows = [a for a in ok if a.rid in eng._active]
        if not rows:
            return
        for a in rows:
            if plan[a.rid] and not self._snapshot(a, self.row(a)):
                plan[a.rid] = 0
        # ---- draft
        self._q = {a.rid: [] for a in rows}
        drafting = [(a, self.row(a), plan[a.rid]) for a in rows if plan[a.rid]]
        drafts = {a.rid: [] for a in rows}
        if drafting:
            for (a, _, _), d in zip(drafting, self.proposer.propose(drafting, self._choose)):
                drafts[a.rid] = d
                a.row.rollback(len(d))  # drafts leave the history again; the acceptance re-adds the kept ones
        for a in rows:
            if not drafts[a.rid]:
                self._drop_snapshot(self.row(a))
        # ---- verify: one batched target forward over [unfed..., pending token, drafts...] of every row
        unfed = {a.rid: list(self.row(a).unfed or ()) for a in rows}
        logits, hidden = r.verify([(a.seq, unfed[a.rid] + [a.pending_token] + drafts[a.rid]) for a in rows])
        st_ = eng.stats
        st_["decode_rounds"] += 1
        st_["decode_row_rounds"] += len(rows)
        st_["spec_rounds"] += 1
        st_["spec_row_rounds"] += len(rows)
        st_["spec_verify_tokens"] += sum(len(unfed[a.rid]) + len(drafts[a.rid]) + 1 for a in rows)
        st_["spec_recompute_tokens"] += sum(len(u) for u in unfed.values())
        now = time.monotonic()
        refeed = []
        for a, lg, hd in zip(rows, logits, hidden):
            st, d, u = self.row(a), drafts[a.rid], unfed[a.rid]
            lg, hd = lg[len(u):], hd[len(u):]  # rows of the pending token and the drafts
            pending = a.pending_token
            start = a.seq.length - len(d) - 1  # the pending token's position (verify grew the length)
            out, n_acc = self._accept(a, lg, d, self._q[a.rid])
            st.draft_n += len(d)
            st.draft_accepted += n_acc
            st_["spec_draft_tokens"] += len(d)
            st_["spec_accepted_tokens"] += n_acc
            if not d:
                st_["spec_no_draft_rounds"] += 1
            if n_acc < len(d):
                # a draft was rejected: back to the state before verification; the accepted tokens are
                # re-run at the front of the next verification (or now, when too many have piled up)
                self._rollback(a, st)
                st.unfed = u + [pending] + d[:n_acc]
            else:
                st.unfed = None  # the snapshot stays until the tokens are committed (see on_finish)
            self.proposer.after_verify(a, st, hd, n_acc, len(d), start)
            want_lp = a.req.params.logprobs or a.req.params.top_logprobs > 0
            a.pending_token = None
            for i, t in enumerate(out):
                lp = _log_softmax_top(lg[i], t, int(a.req.params.top_logprobs)) if want_lp else None
                st_["spec_emitted_tokens"] += 1
                if not eng._commit_token(a, t, lp, now):
                    break
            else:
                self._drop_snapshot(st)
                if st.unfed and len(st.unfed) > self.k + 1:
                    refeed.append(a)
        refeed = [a for a in refeed if a.rid in eng._active]
        if refeed:
            r.prefill([(a.seq, self.row(a).unfed) for a in refeed])
            st_["spec_recompute_tokens"] += sum(len(self.row(a).unfed) for a in refeed)
            for a in refeed:
                self.row(a).unfed = None
        if st_["spec_draft_tokens"]:
            st_["spec_acceptance_rate"] = round(st_["spec_accepted_tokens"] / st_["spec_draft_tokens"], 6)
        st_["spec_tokens_per_round"] = round(st_["spec_emitted_tokens"] / st_["spec_row_rounds"], 6)

    # ---- request end ---------------------------------------------------------------------------
    def on_finish(self, a) -> dict:
        """Called by Engine._finish before the sequence is released: never hand the cache a state that
        has consumed tokens the request did not commit. Returns the request's draft timings."""
        st = self.rows.pop(a.rid, None)
        if st is None:
            return {}
        if st.snap is not None:
            committed = len(a.req.prompt_ids) + len(a.generated)
            if a.seq is not None and a.seq.length > committed:
                self._rollback(a, st)
            else:
                self._drop_snapshot(st)
        self.proposer.release(st)
        return {"draft_n": st.draft_n, "draft_n_accepted": st.draft_accepted}
