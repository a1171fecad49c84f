"""Persistent input buffers for the library's per-call arguments.

A step's small inputs (token ids, positions, ragged offsets, page table, slot ids, logit rows) are
written into host staging arrays that live as long as the runner and copied with one host->device
copy each into device buffers of fixed address (views of the needed shape). The page table is kept
per batch row and updated incrementally: a row remembers which sequence it held and how many of its
pages it already has, so a growing sequence writes only its new page ids. Decode buffers never move,
so CUDA graphs captured over their views stay valid; ragged (prefill/verify) buffers grow when a call
needs more rows than they hold, and `generation` counts those moves so graphs over them can be dropped.
"""
from __future__ import annotations

import itertools
import math
from typing import Any, Optional, Protocol, Sequence, cast

import numpy as np

from .host_copy import HostCopy
from .upload_batch import UploadBatch
from .view_cache import ViewCache


class SeqLike(Protocol):
    uid: int
    slot: Optional[int]  # a released sequence's is None; the rows of a call always hold one
    pages: list
    length: int


def _row_slots(seqs: Sequence[SeqLike]) -> list[int]:
    """The rows' state slots (every row of a call is a live sequence, which holds one)."""
    slots = [s.slot for s in seqs]
    if None in slots:
        raise ValueError("a released sequence (no state slot) cannot be a row of a call")
    return cast("list[int]", slots)


class _Buffer:
    """One int32 host staging array + a device tensor of the same capacity, and its views by shape (made
    once: the same object, at the same address, every time a shape recurs)."""

    MAX_VIEWS = 256

    def __init__(self, tvm, dev, capacity: int):
        self.host = np.zeros(max(1, capacity), np.int32)
        self.dev = tvm.runtime.empty((self.host.size,), "int32", dev)
        self._views: dict[tuple, Any] = {}
        self._at = ViewCache()  # views at offsets (view())
        self._copy = HostCopy(tvm)

    @property
    def capacity(self) -> int:
        return self.host.size

    def view(self, shape: tuple, offset: int = 0):
        """Device view of `shape` at element `offset`, without a copy (filled on the device)."""
        return self._at(self.dev, tuple(int(x) for x in shape), "int32", 4 * int(offset))

    def upload(self, shape: tuple, uploads: Optional[UploadBatch] = None):
        """Device view of the first prod(shape) staged values (copied now, or added to `uploads`)."""
        view = self._views.get(shape)
        if view is None:
            if len(self._views) >= self.MAX_VIEWS:
                self._views.clear()
            view = self._views[shape] = self.dev._create_view(tuple(int(s) for s in shape), "int32", 0)
        if uploads is not None:
            uploads.add(view, self.host[: math.prod(shape)])
        else:
            self._copy(view, self.host[: math.prod(shape)], 4)
        return view


class PageTableRows:
    """Page ids per batch row [rows, max_pages], rewritten only where a row's sequence changed."""

    def __init__(self, rows: int, max_pages: int):
        self.table = np.zeros((rows, max_pages), np.int32)
        self._owner = [-1] * rows
        self._filled = [0] * rows

    def fill(self, seqs: Sequence[SeqLike]) -> int:
        """Bring rows 0..len(seqs)-1 up to date; returns the widest row (in pages)."""
        width = 1
        for i, s in enumerate(seqs):
            n = len(s.pages)
            if n > self.table.shape[1]:
                raise ValueError(f"sequence holds {n} pages; the page table has room for {self.table.shape[1]}")
            if self._owner[i] != s.uid or self._filled[i] > n:
                self.table[i, :] = 0
                self._owner[i], self._filled[i] = s.uid, 0
            if self._filled[i] < n:
                self.table[i, self._filled[i]:n] = s.pages[self._filled[i]:]
                self._filled[i] = n
            width = max(width, n)
        return width


class StepInputs:
    """The runner's persistent argument buffers (one set for ragged calls, one for decode)."""

    def __init__(self, tvm, dev, max_batch: int, max_pages: int, ragged_tokens: int = 1024):
        self.tvm, self.dev = tvm, dev
        self.max_batch, self.max_pages = max_batch, max_pages
        self.generation = 0  # bumped whenever the ragged buffers move (graphs recorded over them are stale)
        # decode: fixed capacity (graph-safe)
        self.d_tokens = _Buffer(tvm, dev, max_batch)
        self.d_positions = _Buffer(tvm, dev, max_batch)
        self.d_slots = _Buffer(tvm, dev, max_batch)
        self.d_pages = _Buffer(tvm, dev, max_batch * max_pages)
        self.d_rows = PageTableRows(max_batch, max_pages)
        # ragged: grows with the largest call
        self._alloc_ragged(ragged_tokens)
        self.r_cu = _Buffer(tvm, dev, max_batch + 1)
        self.r_slots = _Buffer(tvm, dev, max_batch)
        self.r_pages = _Buffer(tvm, dev, max_batch * max_pages)
        self.r_rows = PageTableRows(max_batch, max_pages)
        self.uploads = UploadBatch(tvm, dev)  # a ragged call's inputs go up in one copy

    def _alloc_ragged(self, n: int) -> None:
        self.generation += 1
        self.r_tokens = _Buffer(self.tvm, self.dev, n)
        self.r_positions = _Buffer(self.tvm, self.dev, n)
        self.r_seq = _Buffer(self.tvm, self.dev, n)
        self.r_out = _Buffer(self.tvm, self.dev, n)
        self._hidden: Any = None  # float32 hidden-state rows (MTP input; a tvm.runtime.Tensor), allocated on first use

    def _check_batch(self, b: int) -> None:
        if not 1 <= b <= self.max_batch:
            raise ValueError(f"a step takes 1..{self.max_batch} sequences, got {b}")

    @staticmethod
    def _stage_table(rows: PageTableRows, buf: _Buffer, b: int, width: int, uploads: Optional[UploadBatch] = None):
        staged = buf.host[: b * width].reshape(b, width)
        np.copyto(staged, rows.table[:b, :width])
        return buf.upload((b, width), uploads)

    # ---- decode -------------------------------------------------------------------------
    def decode(self, seqs: Sequence[SeqLike], tokens: Sequence[int], width_of=None) -> list:
        """[tokens, positions, page_table, slot_ids] views for one token per sequence."""
        b = len(seqs)
        self._check_batch(b)
        self.d_tokens.host[:b] = tokens
        self.d_positions.host[:b] = [s.length for s in seqs]
        self.d_slots.host[:b] = _row_slots(seqs)
        width = self.d_rows.fill(seqs)
        if width_of is not None:
            width = min(width_of(width), self.max_pages)
        return [self.d_tokens.upload((b,)), self.d_positions.upload((b,)),
                self._stage_table(self.d_rows, self.d_pages, b, width), self.d_slots.upload((b,))]

    # ---- ragged (prefill / verify) --------------------------------------------------------
    def hidden(self, h: np.ndarray):
        """Device view of hidden-state rows [n, D] (float32) staged in a persistent buffer."""
        h = np.ascontiguousarray(h, np.float32)
        view = self.hidden_view(h.shape)
        view.copyfrom(h)
        return view

    def hidden_view(self, shape: tuple):
        """The persistent hidden-state buffer as a float32 view of `shape` (filled by the caller: from the host,
        or on the device from the previous MTP step's output)."""
        size = int(np.prod(shape))
        held = 0 if self._hidden is None else int(self._hidden.shape[0])
        if held < size:
            self.generation += 1
            self._hidden = self.tvm.runtime.empty((max(size, 2 * held),), "float32", self.dev)
        return self._hidden._create_view(tuple(int(x) for x in shape), "float32", 0)

    def ragged(self, seqs: Sequence[SeqLike], chunks: Sequence[Sequence[int] | np.ndarray],
               out_rows: Optional[np.ndarray] = None,
               starts: Optional[Sequence[int]] = None, width_of=None,
               uploads: Optional[UploadBatch] = None) -> tuple[list, np.ndarray, object]:
        """[tokens, positions, token_seq, cu_seqlens, page_table, slot_ids] views, the cu_seqlens
        values, and (when out_rows is given) a view of those row indices. Chunk i sits at positions
        starts[i].. (default: the sequence's length, i.e. appended). The values go up in one host->device
        copy, now, or with the caller's `uploads` (sent by the caller before anything reads them)."""
        b = len(seqs)
        self._check_batch(b)
        lens = [len(t) for t in chunks]
        n = int(sum(lens))
        if n > self.r_tokens.capacity:
            self._alloc_ragged(max(n, 2 * self.r_tokens.capacity))
        cu = self.r_cu.host[: b + 1]
        cu[0] = 0
        cu[1:] = list(itertools.accumulate(lens))  # (np.cumsum over a short list costs ~10x more)
        off = 0
        for i, (s, t) in enumerate(zip(seqs, chunks)):
            k = len(t)
            p0 = s.length if starts is None else int(starts[i])
            self.r_tokens.host[off:off + k] = t
            self.r_positions.host[off:off + k] = np.arange(p0, p0 + k, dtype=np.int32)
            self.r_seq.host[off:off + k] = i
            off += k
        self.r_slots.host[:b] = _row_slots(seqs)
        width = self.r_rows.fill(seqs)
        if width_of is not None:
            width = min(width_of(width), self.max_pages)
        batch = self.uploads if uploads is None else uploads
        args = [self.r_tokens.upload((n,), batch), self.r_positions.upload((n,), batch),
                self.r_seq.upload((n,), batch), self.r_cu.upload((b + 1,), batch),
                self._stage_table(self.r_rows, self.r_pages, b, width, batch), self.r_slots.upload((b,), batch)]
        rows_view = None
        if out_rows is not None:
            self.r_out.host[: out_rows.size] = out_rows
            rows_view = self.r_out.upload((out_rows.size,), batch)
        if uploads is None:
            batch.send()
        return args, cu.copy(), rows_view

    def tensor(self, a, dtype: str = "int32"):
        """A one-off device tensor (rare arguments: MTP positions, shortlists)."""
        return self.tvm.runtime.tensor(np.ascontiguousarray(a, dtype=dtype), self.dev)


class ChainInputs:
    """Fixed-address inputs of a chain of one-row-per-sequence MTP steps that run back to back on the device.

    Everything a chain's steps differ in is staged before its first step: the positions of every step (a
    [steps, b] table, one host->device copy), the page table and row ids; a step then only copies on the
    device: its positions row, the previous step's drafts and output hidden. TVM's host->device copies wait
    for the device, so staging between steps would stall the chain; these copies do not. The buffers never
    move once sized for (max_batch, steps, D), so graphs over them stay valid (`generation` counts moves)."""

    def __init__(self, tvm, dev, max_batch: int, max_pages: int):
        self.tvm, self.dev = tvm, dev
        self.max_batch, self.max_pages = max_batch, max_pages
        self.generation = 0
        self.steps = self.width = 0
        self.rows = PageTableRows(max_batch, max_pages)
        self.pages = _Buffer(tvm, dev, max_batch * max_pages)
        self.seq = _Buffer(tvm, dev, max_batch)
        self.tokens = _Buffer(tvm, dev, max_batch)
        self.positions = _Buffer(tvm, dev, max_batch)
        self.table: Any = None  # [steps, b] int32 positions of every step
        self.drafts: Any = None  # [steps + 1, b] int32: each step's drafts, copied out of the sampler's outputs
        self.hidden: Any = None  # [max_batch, D] float32
        self._b = 0
        # the mtp_prefill that starts a chain (eager: these may grow): its rows' tokens, positions, row ids, the
        # row of each sequence's logits, and the hidden rows [m, D]
        self.p_tokens = _Buffer(tvm, dev, 64)
        self.p_positions = _Buffer(tvm, dev, 64)
        self.p_seq = _Buffer(tvm, dev, 64)
        self.p_rows = _Buffer(tvm, dev, max_batch)
        self.p_hidden: Any = None
        self._views = ViewCache()  # the rows of table and drafts

    def stage(self, seqs: Sequence[SeqLike], first: Sequence[int], steps: int, uploads: UploadBatch,
              width_of=None) -> list:
        """Stage a chain of `steps` steps whose step j puts row i at position first[i] + j; returns the step's
        input views [hidden, tokens, positions, token_seq, page_table] (mtp_step's order, no cu_seqlens). The
        values join `uploads` (the caller sends them)."""
        b = len(seqs)
        if not 1 <= b <= self.max_batch:
            raise ValueError(f"a chain takes 1..{self.max_batch} sequences, got {b}")
        if self.table is None or steps > self.steps:
            self.steps = max(steps, 8)
            self.table = self.tvm.runtime.empty((self.steps * self.max_batch,), "int32", self.dev)
            self.drafts = self.tvm.runtime.empty(((self.steps + 1) * self.max_batch,), "int32", self.dev)
            self.generation += 1
        if steps:
            table = np.array([f + j for j in range(steps) for f in first], np.int32)  # [steps, b] step-major
            uploads.add(self._views(self.table, (steps * b,), "int32"), table)
        self._b = b
        self.seq.host[:b] = np.arange(b, dtype=np.int32)
        width = self.rows.fill(seqs)
        if width_of is not None:
            width = min(width_of(width), self.max_pages)
        return [None, self.tokens.view((b,)), self.positions.view((b,)), self.seq.upload((b,), uploads),
                StepInputs._stage_table(self.rows, self.pages, b, width, uploads)]

    def stage_prefill(self, hidden: np.ndarray, tokens: Sequence[Sequence[int]], starts: Sequence[int],
                      page_table, uploads: UploadBatch) -> list:
        """Inputs of the chain's first call, mtp_prefill: hidden rows [m, D] (all sequences), each sequence's
        next tokens and first position; page_table: the chain's (stage() first). Returns [hidden, tokens,
        positions, token_seq, page_table, logit_rows]; the values join `uploads` (the caller sends them)."""
        lens = [len(t) for t in tokens]
        m = int(sum(lens))
        if m > self.p_tokens.capacity:
            cap = max(m, 2 * self.p_tokens.capacity)
            self.p_tokens, self.p_positions, self.p_seq = (_Buffer(self.tvm, self.dev, cap) for _ in range(3))
        off = 0
        for i, (t, p0) in enumerate(zip(tokens, starts)):
            self.p_tokens.host[off:off + len(t)] = t
            self.p_positions.host[off:off + len(t)] = np.arange(p0, p0 + len(t), dtype=np.int32)
            self.p_seq.host[off:off + len(t)] = i
            off += len(t)
        self.p_rows.host[: len(lens)] = [n - 1 for n in itertools.accumulate(lens)]  # each sequence's last row
        h = np.ascontiguousarray(hidden, np.float32)
        if self.p_hidden is None or int(self.p_hidden.shape[0]) < h.size:
            self.p_hidden = self.tvm.runtime.empty((max(h.size, 2 * (0 if self.p_hidden is None else
                                                                      int(self.p_hidden.shape[0])), 1),),
                                                   "float32", self.dev)
        hv = self._views(self.p_hidden, tuple(h.shape), "float32")
        uploads.add(hv, h)
        return [hv, self.p_tokens.upload((m,), uploads), self.p_positions.upload((m,), uploads),
                self.p_seq.upload((m,), uploads), page_table, self.p_rows.upload((len(lens),), uploads)]

    def hidden_view(self, b: int, d: int):
        if self.hidden is None or int(self.hidden.shape[1]) != d:
            self.hidden = self.tvm.runtime.empty((self.max_batch, d), "float32", self.dev)
            self.generation += 1
        return self._views(self.hidden, (b, d), "float32")

    def positions_row(self, j: int):
        """Device view of step j's positions (staged by `stage`)."""
        return self._views(self.table, (self._b,), "int32", j * self._b * 4)

    def drafts_row(self, j: int):
        """Device view of the chain's j-th drafts [b] (j = 0: the drafts of the prefill that starts the chain)."""
        return self._views(self.drafts, (self._b,), "int32", j * self._b * 4)

    def drafts_rows(self, n: int):
        """The first n rows of drafts as one [n, b] view (read once, after the round's verify)."""
        return self._views(self.drafts, (n, self._b), "int32")
