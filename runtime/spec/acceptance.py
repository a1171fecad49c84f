"""Choosing drafts and accepting them against the target, lossless for greedy and for sampling.

greedy     accept while d_i == argmax(target row i-1); the first mismatch is replaced by that argmax;
           all accepted -> bonus argmax of row k. Token-for-token what plain decoding produces.
sampling   standard speculative rejection sampling: accept d_i with probability min(1, p(d_i)/q(d_i)),
           on reject draw from norm(max(0, p - q)); all accepted -> bonus draw from p(row k). p and q are
           both `probs_after_processing` (temperature, top-k/p, min-p, bias, penalties over the history
           including the drafts accepted so far), so the output distribution is the target's.
Both append what they keep to the row's sampling history. `accept_argmax` is the greedy rule over the target's
argmax ids computed on the device (spec/device_round.py) for plainly greedy rows.
"""
from __future__ import annotations

from typing import Optional

import numpy as np

from ..sampling import RowState, Sampler, argmax, needs_logit_edit, probs_after_processing, sample_from_probs


def choose_draft(row: RowState, logits_row: np.ndarray) -> tuple[int, Optional[np.ndarray]]:
    """A draft token from the proposer's logits, processed like the target's, and the draft
    distribution q (None for greedy) the rejection test needs."""
    params = row.params
    if params.temperature == 0:
        t = argmax(logits_row) if not needs_logit_edit(params, row) else \
            int(np.argmax(probs_after_processing(logits_row, params, row)))
        return int(t), None
    q = probs_after_processing(logits_row, params, row)
    return int(sample_from_probs(q, row.rng)), q


def accept(row: RowState, logits: np.ndarray, drafts: list[int], qs: list, sampler: Sampler) -> tuple[list[int], int]:
    """Tokens to emit (accepted drafts + one correction or bonus token) and the number accepted.
    logits: target rows [len(drafts) + 1, V] (row i scores the token after draft i)."""
    params = row.params
    out: list[int] = []
    plain = params.temperature == 0 and not needs_logit_edit(params, row)
    for i, d in enumerate(drafts):
        if plain:
            t = argmax(logits[i])
            ok = t == d
        elif params.temperature == 0:
            t = int(np.argmax(probs_after_processing(logits[i], params, row)))
            ok = t == d
        else:
            p, q = probs_after_processing(logits[i], params, row), qs[i]
            ok = bool(q[d] > 0 and row.rng.random() * q[d] < p[d])  # accept with probability min(1, p/q)
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
    bonus = sampler.sample(logits[len(drafts): len(drafts) + 1], [row])  # appends to the history
    out.append(int(bonus[0]))
    return out, len(drafts)


def accept_argmax(row: RowState, target: np.ndarray, drafts: list[int]) -> tuple[list[int], int]:
    """accept() for a plainly greedy row given the target's argmax of each verify row (target [len(drafts) + 1]
    ids): the same tokens, with no logits on the host."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        t = int(target[i])
        out.append(t)
        row.append(t)
        if t != d:
            return out, i
    t = int(target[len(drafts)])
    out.append(t)
    row.append(t)
    return out, len(drafts)
