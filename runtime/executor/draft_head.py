"""The shortlisted MTP proposal head on the device (FR-Spec): the lm_head rows of the drafted ids, contiguous.

Why: a draft step of the full head reads the whole lm_head ([248320, 5120] bf16 = 2.5 GB at 27B, ~0.6 ms on an
H200); over N frequent ids it reads N x D. The library's mtp_head_build gathers the rows from the weights already
on the device (nothing crosses the host), once per shortlist; mtp_step_hd / mtp_prefill_hd take the weight and
`pos`, the row of each vocabulary id (-1 outside the head), and return [n, V] logits with -inf outside it, so the
device argmax picks real token ids. Verification is unchanged: the output stays lossless.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .weights import np_dtype


def draft_head_bytes(rows: int, hidden: int, vocab: int, dtype: str) -> int:
    """Device bytes of a head of `rows` ids: the weight [rows, hidden] in the activation dtype and pos [vocab]."""
    return int(rows) * int(hidden) * np_dtype(dtype).itemsize + 4 * int(vocab)


class DraftHead:
    def __init__(self, runner, ids: np.ndarray):
        """ids: sorted distinct token ids < the vocabulary size (spec/mtp.py load_shortlist)."""
        ids = np.asarray(ids, np.int32)
        vocab = int(runner.vocab_size)
        if ids.ndim != 1 or not len(ids) or int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise ValueError(f"a draft head needs token ids in [0, {vocab})")
        tvm, dev = runner.tvm, runner.dev
        self.ids = ids
        pos = np.full(vocab, -1, np.int32)
        pos[ids] = np.arange(len(ids), dtype=np.int32)
        self.pos: Any = tvm.runtime.tensor(pos, dev)
        self.weight: Any = runner.vm["mtp_head_build"](tvm.runtime.tensor(ids, dev), runner.params)

    @property
    def rows(self) -> int:
        return len(self.ids)
