"""Benchmark-only forced acceptance: every round keeps a set number of drafts, whatever the target says.

Random-weight models give no real acceptance, so the cost of a speculative round and the decode
speed at a known acceptance profile (e.g. MTP-3 at 3.18 tokens per round, DFlash2 block 8 at 5.4) are
measured by forcing it: a row keeps its first n drafts and the target's token after them (sampled
from its verify row n like a bonus token), n chosen per request so that the mean number of tokens
per round is the profile's (2.18 accepted drafts: 2, 2, 2, 2, 3, ...). The output is then NOT the
model's: the decoder flag is off by default, `ninfer serve` refuses it without
--allow-forced-acceptance, and /stats (spec.forced_acceptance) and the request log name it.
"""
from __future__ import annotations

import numpy as np

from ..sampling import RowState, Sampler
from .state import SpecState


class ForcedAcceptance:
    def __init__(self, tokens_per_round: float, draft_tokens: int):
        if not 1.0 <= tokens_per_round <= draft_tokens + 1:
            raise ValueError(f"forced acceptance {tokens_per_round} tokens per round needs 1..{draft_tokens + 1} "
                             f"(draft tokens + 1)")
        self.tokens_per_round = float(tokens_per_round)

    def count(self, st: SpecState, drafted: int) -> int:
        """Drafts this row keeps this round (a round short of drafts carries at most one token over)."""
        st.forced_carry += self.tokens_per_round - 1.0
        n = min(int(st.forced_carry + 1e-9), drafted)
        st.forced_carry = min(st.forced_carry - n, 1.0)
        return n

    @staticmethod
    def accept(row: RowState, logits: np.ndarray, drafts: list[int], n: int, sampler: Sampler) -> list[int]:
        """The first n drafts and the target's token after them (appended to the row's history)."""
        for d in drafts[:n]:
            row.append(d)
        return list(drafts[:n]) + [int(sampler.sample(logits[n: n + 1], [row])[0])]

    @staticmethod
    def accept_ids(row: RowState, target: np.ndarray, drafts: list[int], n: int) -> list[int]:
        """accept() for a plainly greedy row given the target's argmax ids of the verify rows (device path)."""
        out = list(drafts[:n]) + [int(target[n])]
        for t in out:
            row.append(t)
        return out
