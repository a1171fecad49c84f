"""Greedy choices of a speculative round made on the device: the library's sampler kernels (`sample`, the
device sampler's ABI) run at temperature 0 over logits that never leave the device.

Used for the MTP draft chain (each step's draft is fed to the next step on the device) and for the
verification (the target's argmax of every verify row, plus the logprobs rows ask for), so what crosses to
the host per round is token ids, not [rows, vocab] logits. Only rows that decode plainly greedily qualify
(temperature 0, no logit bias or penalties, no grammar): their choice is the argmax, which the sampler's
select kernel picks as runtime/sampling.argmax does (lowest id on ties). Ids past the tokenizer's vocabulary
(`sample_vocab`) are masked, as the host path cuts them. The same compiled function runs on the CPU (llvm)
and on CUDA; no new kernels.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from ...contract import sampler_abi as abi
from ..device_sampler import supports_device_sampler
from ..executor.view_cache import ViewCache
from ..sampling import RowState, TokenLogprobs, needs_logit_edit


def greedy_plain(row: RowState, grammar: Any = None) -> bool:
    """Every token of the row's round is the plain argmax of its logits (what the device choice computes): greedy,
    no grammar, and no logit edit now or once the round's tokens join the history (penalties count them)."""
    p = row.params
    return (grammar is None and p.temperature == 0 and not p.logit_bias and p.repetition_penalty == 1.0
            and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0 and not needs_logit_edit(p, row))


class DeviceArgmax:
    """argmax per row of a device logits tensor [n, vocab_size] f32 (optionally with logprobs), through the
    library's `sample` function; results stay on the device until read."""

    def __init__(self, runner):
        if not supports_device_sampler(runner.manifest, runner.vm):
            raise ValueError(f"{runner.art_dir.name} has no device sampler (recompile it)")
        tvm, dev = runner.tvm, runner.dev
        self.tvm, self.dev, self.runner = tvm, dev, runner
        self.vocab = V = int(runner.vocab_size)
        self.words = abi.mask_words(V)
        self._fn = runner.vm[abi.SAMPLE_FUNCTION]
        zeros = lambda shape, dt: tvm.runtime.tensor(np.zeros(shape, dt), dev)  # noqa: E731
        # one penalty lane the greedy rows never read (no F_BIAS / F_REPETITION / F_FREQ_PRES / F_APPEND)
        self.counts, self.prompt, self.bias = zeros((1, V), np.int32), zeros((1, self.words), np.int32), \
            zeros((1, V), np.float32)
        self._limit = -1  # sample_vocab the mask was built for
        self._mask: Any = None
        self._mask_views = ViewCache()  # views of the mask's first rows
        self._tables: dict = {}  # (rows, logprob row flags) -> device params table

    def _mask_rows(self, n: int):
        """[n, W] bitmask allowing ids < sample_vocab (the host path cuts the logits there)."""
        limit = int(self.runner.sample_vocab)
        if self._mask is None or self._limit != limit or int(self._mask.shape[0]) < n:
            rows = max(n, 2 * (int(self._mask.shape[0]) if self._mask is not None else 0), 16)
            words = np.zeros(self.words, np.uint32)
            w, b = divmod(limit, 32)
            words[:w] = 0xFFFFFFFF
            if b:
                words[w] = (1 << b) - 1
            self._mask = self.tvm.runtime.tensor(np.tile(words.view(np.int32), (rows, 1)), self.dev)
            self._limit = limit
            self._tables.clear()  # the flags carry F_MASK or not
        return self._mask_views(self._mask, (n, self.words), "int32")

    def _params(self, n: int, logprobs: tuple):
        key = (n, logprobs)
        t = self._tables.get(key)
        if t is None:
            masked = self.runner.sample_vocab < self.vocab
            table = np.zeros((n, abi.NUM_PARAMS), np.float64)
            table[:, abi.P_TOP_P] = 1.0
            table[:, abi.P_REPETITION] = 1.0
            for i in range(n):
                flags = abi.F_MASK if masked else 0
                if logprobs and logprobs[i]:  # processed: over the unmasked ids, as the host's cut logits
                    flags |= abi.F_LOGPROBS | abi.F_LP_PROCESSED
                table[i, abi.P_FLAGS] = flags
            t = self._tables[key] = self.tvm.runtime.tensor(table, self.dev)
            if len(self._tables) > 256:  # a long-running server sees few shapes; bound it anyway
                self._tables.pop(next(iter(self._tables)))
        return t

    def run(self, logits, logprobs: Optional[Sequence[bool]] = None):
        """The sampler's outputs (tokens [n] i32, token_logprob, rank, top_ids, top_logprobs) as device tensors;
        logprobs: per row, whether its logprob outputs are wanted."""
        n = int(logits.shape[0])
        if int(logits.shape[1]) != self.vocab:
            raise ValueError(f"logits must be [n, {self.vocab}], got {list(logits.shape)}")
        lp = tuple(bool(x) for x in logprobs) if logprobs is not None and any(logprobs) else ()
        return self._fn(logits, self._params(n, lp), self._mask_rows(n), self.counts, self.prompt, self.bias)

    @staticmethod
    def read_logprobs(out) -> tuple:
        """Host copies of a run()'s (tokens, token_logprob, rank, top_ids, top_logprobs), for logprobs_of."""
        return tuple(o.numpy() for o in out[:5])

    @staticmethod
    def logprobs_of(host: tuple, rows: Sequence[int], n_top: Sequence[int]) -> list[TokenLogprobs]:
        """TokenLogprobs of the given rows of a run() with logprobs (host: read_logprobs of it)."""
        tokens, tok_lp, rank, top_ids, top_lp = host
        res = []
        for r, k in zip(rows, n_top):
            k = min(int(k), top_ids.shape[1])
            res.append(TokenLogprobs(int(tokens[r]), float(tok_lp[r]), int(rank[r]),
                                     top_ids[r, :k].astype(np.int32), top_lp[r, :k].astype(np.float32)))
        return res
