"""A smaller compiled model with the same tokenizer as the proposer. It has its own runner and its
own KV manager (pages and state slots of the drafter are nobody else's), catches up lazily on the
committed tokens and keeps a snapshot of its state while it drafts, so rejected drafts cost nothing."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..executor.model_runner import ModelRunner
from ..kv.manager import KVManager, SeqKV
from .base import Choose
from .state import SpecState


def _fit_vocab(row: np.ndarray, vocab: int) -> np.ndarray:
    """Draft logits over the target vocabulary (a drafter may pad its vocabulary differently)."""
    if row.shape[0] == vocab:
        return row
    if row.shape[0] > vocab:
        return row[:vocab]
    out = np.full(vocab, -np.inf, np.float32)
    out[: row.shape[0]] = row
    return out


def check_same_tokenizer(target_dir: Path, draft_dir: Path) -> None:
    from ..tokenizer import load_tokenizer

    if not (draft_dir / "manifest.json").is_file():
        raise ValueError(f"{draft_dir}: not a compiled model directory (manifest.json missing)")
    try:
        a, b = load_tokenizer(target_dir), load_tokenizer(draft_dir)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"{draft_dir}: cannot load its tokenizer ({e})") from None
    if a.get_vocab(with_added_tokens=True) != b.get_vocab(with_added_tokens=True):
        raise ValueError(f"{draft_dir}: its tokenizer differs from the target model's; a drafter must share the "
                         "vocabulary")


class DraftModelProposer:
    name = "draft"
    wants_prefill_hidden = False

    def __init__(self, target: ModelRunner, target_pages: int, draft_dir: str | Path, slots: int, chunk: int,
                 max_batch: int):
        draft_dir = Path(draft_dir)
        check_same_tokenizer(target.art_dir, draft_dir)
        self.dr = ModelRunner(draft_dir, device=target.device_kind)
        self.dr.allocate(target_pages, slots, max_batch, cuda_graphs=False)
        self.kv = KVManager(self.dr, target_pages, slots)
        self.vocab = target.sample_vocab
        self.chunk = max(1, chunk)

    def after_prefill(self, items) -> None:  # the drafter catches up lazily in propose
        pass

    def can_draft(self, req, st: SpecState) -> bool:
        if st.draft_seq is None:
            st.draft_seq = self.kv.new_seq()
        return st.draft_seq is not None

    def propose(self, items, choose: Choose) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in items]
        todo = {}  # index -> tokens still to feed: committed history + the pending token
        for i, (req, st, k) in enumerate(items):
            feed = req.all_tokens()[st.draft_seq.length:]
            if feed and self.kv.ensure(st.draft_seq, len(feed) + k - 1):
                todo[i] = feed
        first = {}
        while todo:  # chunked catch-up; the final chunk's last row gives draft 1
            batch = [(i, f[: self.chunk]) for i, f in todo.items()]
            seqs: list[SeqKV] = [items[i][1].draft_seq for i, _ in batch]
            out = self.dr.prefill([(s, t) for s, (_, t) in zip(seqs, batch)])
            for s, (i, t), lg in zip(seqs, batch, out):
                self.kv.advance(s, len(t))
                todo[i] = todo[i][len(t):]
                if not todo[i]:
                    del todo[i]
                    first[i] = lg
        live = sorted(first)
        for i in live:
            req, st, k = items[i]
            if k > 1:  # the drafter will swallow speculative tokens: keep its committed state
                slot = self.kv.snapshot_state(st.draft_seq)
                if slot is not None:
                    st.draft_snap = (slot, st.draft_seq.length)
            drafts[i].append(choose(req, _fit_vocab(first[i], self.vocab), 0))
        for j in range(1, max([k for _, _, k in items] + [0])):
            live = [i for i in live if items[i][2] > j and items[i][1].draft_snap is not None]
            if not live:
                break
            seqs = [items[i][1].draft_seq for i in live]
            lg = self.dr.decode(seqs, [drafts[i][-1] for i in live])
            for s in seqs:
                self.kv.advance(s, 1)
            for r, i in enumerate(live):
                drafts[i].append(choose(items[i][0], _fit_vocab(lg[r], self.vocab), j))
        return drafts

    def after_verify(self, req, st: SpecState, hidden, kept: int, k: int, start: int) -> None:
        if st.draft_snap is None:
            return
        slot, length = st.draft_snap
        st.draft_snap = None
        ds = st.draft_seq
        if kept >= ds.length - length:  # every draft the drafter consumed was kept
            self.kv.drop_snapshot(slot)
        else:
            self.kv.restore_snapshot(ds, slot, length)

    def release(self, st: SpecState) -> None:
        if st.draft_snap is not None:
            self.kv.drop_snapshot(st.draft_snap[0])
            st.draft_snap = None
        if st.draft_seq is not None:
            self.kv.release(st.draft_seq, [], 0, None, keep=False)
            st.draft_seq = None
