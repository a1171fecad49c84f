"""Sampling on the device: the model library's `sample` function run on the logits tensor a model call returned.

Only token ids (and the logprobs rows ask for) cross to the host; runtime/sampling.py stays the reference and
the fallback for libraries built without the sampler (`supports_device_sampler`). The semantics are the same:
each row's uniform comes from its RowState's generator exactly as Sampler draws it (one per non-greedy row),
so seeded requests reproduce whatever batch they land in. Penalty state lives on the device per *lane*
(generated-token counts, prompt-token bits, dense logit_bias): `bind` a lane to a request's RowState once
(prompt + any generated history), then every `sample` with `update_state` appends the drawn token on the
device (and to the RowState). Tokens added or removed outside `sample` (speculative decoding) go through
`add_tokens` / `remove_tokens`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from ..contract import sampler_abi as abi
from .executor.host_copy import HostCopy
from .sampling import RowState, SamplingError, TokenLogprobs

__all__ = ["AllTokensMaskedError", "DeviceSampler", "PendingDraw", "supports_device_sampler"]


class AllTokensMaskedError(SamplingError):
    """A bitmask row allows no token of the vocabulary (a grammar dead end)."""

    def __init__(self, row: int):
        self.row = row
        super().__init__("bitmask", f"row {row} allows no token of the vocabulary")


def supports_device_sampler(manifest, vm=None) -> bool:
    """True if the artifact's library carries this runtime's sampler ABI (else: sample with runtime/sampling.py)."""
    if (manifest.extras or {}).get("device_sampler") != abi.ABI_VERSION:
        return False
    if vm is None:
        return True
    has = vm.module.implements_function
    return bool(has(abi.SAMPLE_FUNCTION) and has(abi.COUNTS_ADD_FUNCTION))


def _needs_counts(p) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


class DeviceSampler:
    """The device sampler of one loaded library.

    tvm: the imported tvm module; vm: the library's relax VirtualMachine; device: its device;
    max_lanes: penalty-state lanes (one per concurrently sampled sequence); logprobs_mode: as Sampler's.
    """

    def __init__(self, tvm, vm, device, vocab_size: int, max_lanes: int, logprobs_mode: str = "raw"):
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError("logprobs_mode must be 'raw' or 'processed'")
        if max_lanes < 1:
            raise ValueError("max_lanes must be at least 1")
        has = vm.module.implements_function
        if not (has(abi.SAMPLE_FUNCTION) and has(abi.COUNTS_ADD_FUNCTION)):
            raise ValueError("the library has no device sampler (compiled before it existed); use runtime/sampling.py")
        self.tvm, self.vm, self.dev = tvm, vm, device
        self.vocab_size = V = int(vocab_size)
        self.max_lanes = int(max_lanes)
        self.logprobs_mode = logprobs_mode
        self.words = abi.mask_words(V)
        self._sample_fn = vm[abi.SAMPLE_FUNCTION]
        self._counts_add_fn = vm[abi.COUNTS_ADD_FUNCTION]
        empty = tvm.runtime.empty
        self.counts = empty((self.max_lanes, V), "int32", device)
        self.prompt = empty((self.max_lanes, self.words), "int32", device)
        self.bias = empty((self.max_lanes, V), "float32", device)
        self._rows = 0
        self._params: Any = None  # tvm.runtime.Tensor (no type information), sized by _reserve_rows
        self._mask: Any = None
        self._views: dict[int, tuple] = {}  # rows -> views of the first rows of _params and _mask
        self._copy = HostCopy(tvm)
        self._reserve_rows(max(8, self.max_lanes))
        self._bound: dict[int, RowState] = {}
        self._mask_src: Any = None  # the host bitmask whose rows the device mask buffer holds (skip re-uploads)

    # ---- lanes -----------------------------------------------------------------------------------
    def _lane_view(self, buf, lane: int, width: int, dtype: str, itemsize: int):
        return buf._create_view((width,), dtype, lane * width * itemsize)

    def _check_lane(self, lane: int) -> int:
        lane = int(lane)
        if not 0 <= lane < self.max_lanes:
            raise ValueError(f"lane {lane} is out of range [0, {self.max_lanes})")
        return lane

    def bind(self, lane: int, row: RowState) -> None:
        """Give `lane` the penalty state of `row` (its prompt ids, generated tokens so far, logit_bias)."""
        lane = self._check_lane(lane)
        p, V = row.params, self.vocab_size
        if _needs_counts(p):
            counts = np.zeros(V, np.int32)
            ids, n = row.output_count_arrays()
            ok = (ids >= 0) & (ids < V)
            counts[ids[ok]] = n[ok].astype(np.int32)
            self._lane_view(self.counts, lane, V, "int32", 4).copyfrom(counts)
        if p.repetition_penalty != 1.0:
            words = np.zeros(self.words, np.uint32)
            ids = row.prompt_ids
            ids = ids[(ids >= 0) & (ids < V)]
            np.bitwise_or.at(words, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
            self._lane_view(self.prompt, lane, self.words, "int32", 4).copyfrom(words.view(np.int32))
        if p.logit_bias:
            bias = np.zeros(V, np.float32)
            for tid, val in p.logit_bias.items():
                if 0 <= int(tid) < V:
                    bias[int(tid)] = np.float32(val)
            self._lane_view(self.bias, lane, V, "float32", 4).copyfrom(bias)
        self._bound[lane] = row

    def release(self, lane: int) -> None:
        self._bound.pop(self._check_lane(lane), None)

    def bound(self, lane: int) -> Optional[RowState]:
        return self._bound.get(int(lane))

    def add_tokens(self, lane: int, tokens: Sequence[int]) -> None:
        """Count `tokens` as generated on the device (tokens the RowState took outside `sample`)."""
        self._counts_add(lane, tokens, 1)

    def remove_tokens(self, lane: int, tokens: Sequence[int]) -> None:
        """Undo `add_tokens` / sampled tokens (rejected speculative tokens; RowState.rollback on the host)."""
        self._counts_add(lane, tokens, -1)

    def _counts_add(self, lane: int, tokens: Sequence[int], delta: int) -> None:
        lane = self._check_lane(lane)
        row = self._bound.get(lane)
        if row is None:
            raise ValueError(f"lane {lane} is not bound")
        toks = np.asarray(tokens, np.int32).reshape(-1)
        if toks.size == 0 or not _needs_counts(row.params):
            return
        if toks.min() < 0 or toks.max() >= self.vocab_size:
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        T = lambda a: self.tvm.runtime.tensor(np.ascontiguousarray(a, np.int32), self.dev)  # noqa: E731
        self._counts_add_fn(T(np.full(toks.size, lane)), T(toks), T(np.full(toks.size, delta)), self.counts)

    # ---- sampling --------------------------------------------------------------------------------
    def _reserve_rows(self, n: int) -> bool:
        """Room for n rows; True when the buffers were replaced (their contents are gone)."""
        if n <= self._rows:
            return False
        rows = max(n, 2 * self._rows)
        self._params = self.tvm.runtime.empty((rows, abi.NUM_PARAMS), "float64", self.dev)
        self._mask = self.tvm.runtime.empty((rows, self.words), "int32", self.dev)
        self._views = {}
        self._rows = rows
        return True

    def _row_params(self, rows: Sequence[RowState], lanes: Sequence[int], masked: bool, return_logprobs: bool,
                    update_state: bool) -> np.ndarray:
        table = np.zeros((len(rows), abi.NUM_PARAMS), np.float64)
        seen = set()
        for i, (r, lane) in enumerate(zip(rows, lanes)):
            lane = self._check_lane(lane)
            if self._bound.get(lane) is not r:
                raise ValueError(f"row {i}: lane {lane} is not bound to this row's state (DeviceSampler.bind)")
            p = r.params
            flags = 0
            if p.logit_bias:
                flags |= abi.F_BIAS
            if p.repetition_penalty != 1.0:
                flags |= abi.F_REPETITION
            if p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                flags |= abi.F_FREQ_PRES
            if masked:
                flags |= abi.F_MASK
            if update_state and _needs_counts(p):
                if lane in seen:
                    raise ValueError(f"lane {lane} appears twice in a batch that updates state")
                seen.add(lane)
                flags |= abi.F_APPEND
            if return_logprobs and (p.logprobs or p.top_logprobs > 0):
                flags |= abi.F_LOGPROBS | (abi.F_LP_PROCESSED if self.logprobs_mode == "processed" else 0)
            table[i, abi.P_LANE] = lane
            table[i, abi.P_TOP_K] = p.effective_top_k
            table[i, abi.P_FLAGS] = flags
            table[i, abi.P_TEMPERATURE] = p.temperature
            table[i, abi.P_TOP_P] = p.top_p
            table[i, abi.P_MIN_P] = p.min_p
            table[i, abi.P_REPETITION] = p.repetition_penalty
            table[i, abi.P_FREQUENCY] = p.frequency_penalty
            table[i, abi.P_PRESENCE] = p.presence_penalty
            # Sampler draws one uniform per non-greedy row, in row order
            table[i, abi.P_UNIFORM] = float(r.rng.random()) if p.temperature != 0 else 0.0
        return table

    def _check_mask(self, bitmask, n: int) -> np.ndarray:
        m = np.ascontiguousarray(bitmask)
        if m.shape != (n, self.words) or m.dtype.itemsize != 4 or m.dtype.kind not in "iu":
            raise ValueError(f"bitmask must be int32 [{n}, {self.words}], got {m.dtype} {list(m.shape)}")
        m = m.view(np.int32)
        tail = self.vocab_size % 32
        live = m.copy()
        if tail:
            live[:, -1] &= np.int32((1 << tail) - 1)
        dead = np.flatnonzero(~live.any(axis=1))
        if dead.size:
            raise AllTokensMaskedError(int(dead[0]))
        return m

    def sample(self, logits, rows: Sequence[RowState], lanes: Sequence[int], bitmask=None,
               return_logprobs: bool = False, update_state: bool = True):
        """Draw one token per row of `logits` (the device tensor [n, V] f32 a model call returned).

        rows: each row's RowState (params + generator); lanes: the lane each row's RowState is bound to;
        bitmask: optional int32 [n, ceil(V / 32)] host array in xgrammar's layout (bit j of word i allows token
        32 i + j); the same array object passed again is not uploaded again (do not modify one after passing
        it: pass a new array). Returns int32 [n]; with return_logprobs, (tokens, [TokenLogprobs | None]) as Sampler.sample.
        update_state: append each token to its RowState and (when penalties need it) to the lane's device counts.
        """
        return self.collect(self.launch(logits, rows, lanes, bitmask, return_logprobs, update_state))

    def launch(self, logits, rows: Sequence[RowState], lanes: Sequence[int], bitmask=None,
               return_logprobs: bool = False, update_state: bool = True) -> "PendingDraw":
        """`sample` up to the sampler call, which is queued on the device; `collect` reads its result
        (`prepare` then `start`). The next draw's inputs overwrite this one's: collect it first."""
        return self.start(logits, self.prepare(rows, lanes, bitmask, return_logprobs, update_state))

    def prepare(self, rows: Sequence[RowState], lanes: Sequence[int], bitmask=None, return_logprobs: bool = False,
                update_state: bool = True) -> "PendingDraw":
        """Everything before the sampler call: the row parameters (the generators' uniforms are drawn here, so
        draws keep their order however prepares and collects interleave) and the mask, uploaded. An upload
        waits for the device stream, so an overlapped step prepares its draw before it queues its forward
        (after it, the upload would wait for that forward to finish). `start` the draw before preparing another."""
        n = len(rows)
        if len(lanes) != n:
            raise ValueError(f"got {n} row states and {len(lanes)} lanes")
        if n == 0:
            return PendingDraw(None, list(rows), None, return_logprobs, update_state)
        resident = bitmask is not None and bitmask is self._mask_src and len(bitmask) == n
        mask = None if bitmask is None or resident else self._check_mask(bitmask, n)
        table = self._row_params(rows, lanes, bitmask is not None, return_logprobs, update_state)
        grown = self._reserve_rows(n)
        params, mask_dev = self._row_views(n)
        self._copy(params, table, 8)
        if mask is not None or (resident and grown):
            self._copy(mask_dev, np.ascontiguousarray(mask if mask is not None else bitmask).view(np.int32), 4)
            self._mask_src = bitmask  # the same array object next time: its rows are already on the device
        return PendingDraw(None, list(rows), table, return_logprobs, update_state, (params, mask_dev))

    def start(self, logits, draw: "PendingDraw") -> "PendingDraw":
        """Queue the sampler call of a prepared draw over `logits` (the device tensor [n, V] f32 a model call
        returned); returns the draw."""
        shape = tuple(int(s) for s in logits.shape)
        n = len(draw.rows)
        if len(shape) != 2 or shape[1] != self.vocab_size or str(logits.dtype) != "float32":
            raise ValueError(f"logits must be float32 [n, {self.vocab_size}], got {logits.dtype} {list(shape)}")
        if shape[0] != n:
            raise ValueError(f"got {n} row states for {shape[0]} logits rows")
        if draw.out is not None:
            raise ValueError("this draw was started already")
        if draw.inputs is not None:
            params, mask_dev = draw.inputs
            draw.out = self._sample_fn(logits, params, mask_dev, self.counts, self.prompt, self.bias)
        return draw

    def _row_views(self, n: int) -> tuple:
        """Views of the first n rows of the params and mask buffers (made once per n)."""
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = (self._params._create_view((n, abi.NUM_PARAMS), "float64", 0),
                                      self._mask._create_view((n, self.words), "int32", 0))
        return views

    def collect(self, pending: "PendingDraw"):
        """The tokens (and logprobs) of a launched draw, as `sample` returns them."""
        rows, out, table, n = pending.rows, pending.out, pending.table, len(pending.rows)
        if table is None:
            tokens = np.zeros(0, np.int32)
            return (tokens, []) if pending.return_logprobs else tokens
        if out is None:
            raise ValueError("this draw was prepared but never started")
        tokens = out[0].numpy()
        if (tokens < 0).any():  # the host check above makes this unreachable; never hand out garbage
            raise AllTokensMaskedError(int(np.flatnonzero(tokens < 0)[0]))
        if pending.update_state:
            for r, t in zip(rows, tokens):
                r.append(int(t))
        if not pending.return_logprobs:
            return tokens
        lps: list[Optional[TokenLogprobs]] = [None] * n
        want = [i for i in range(n) if int(table[i, abi.P_FLAGS]) & abi.F_LOGPROBS]
        if want:
            tok_lp, rank, top_ids, top_lp = (o.numpy() for o in out[1:5])
            for i in want:
                k = min(int(rows[i].params.top_logprobs), top_ids.shape[1])
                lps[i] = TokenLogprobs(int(tokens[i]), float(tok_lp[i]), int(rank[i]),
                                       top_ids[i, :k].astype(np.int32), top_lp[i, :k].astype(np.float32))
        return tokens, lps


@dataclass
class PendingDraw:
    """A draw prepared (DeviceSampler.prepare), then queued on the device (start), not yet read (collect)."""

    out: Any  # the sampler's output tuple (device tensors) once started; None before, and for an empty batch
    rows: list
    table: Optional[np.ndarray]  # the row parameters; None for an empty batch
    return_logprobs: bool
    update_state: bool
    inputs: Optional[tuple] = None  # the uploaded (params, mask) views the sampler call reads
