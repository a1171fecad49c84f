"""The proposer interface every speculative method implements (MTP head, draft model, ...).

A proposer sees the request's committed tokens and its own per-request state; it never touches
the scheduler, the engine or the target's pages and slots beyond the sequence it is handed."""
from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from ..scheduler.request import Request
from .state import SpecState

# choose(request, logits_row, j) -> draft token j of that request
Choose = Callable[[Request, np.ndarray, int], int]


class Proposer(Protocol):
    name: str
    wants_prefill_hidden: bool  # the target's prefill must return hidden states (MTP)
    # optional `target_hidden`: "final" (default: the final post-norm hidden, host arrays) or "taps" (the
    # tap layers' outputs as device rows: DFlash drafters); the decoder asks prefill / verify for it.
    # optional `before_round()`: called at the start of every round, before propose and the verify, whose
    # output buffers a CUDA-graph replay overwrites: a proposer holding device rows of the previous verify
    # consumes them there
    # optional `stage_device(items)` / `launch_device(staged, argmax)`: greedy drafts chosen on the device (MTP:
    # spec/mtp.py); stage does every host->device copy (or returns None: propose() then), launch returns the
    # [k, rows] device drafts without reading them; the decoder stages the verify in between

    def after_prefill(self, items: list[tuple[Request, SpecState, int, np.ndarray]]) -> None:
        """items: (request, state, first position, hidden rows [n, D]) of a target prefill."""

    def can_draft(self, req: Request, st: SpecState) -> bool: ...

    def propose(self, items: list[tuple[Request, SpecState, int]], choose: Choose) -> list[list[int]]:
        """items: (request, state, k >= 1); the drafts of each (at most k)."""

    def after_verify(self, req: Request, st: SpecState, hidden: np.ndarray, kept: int, k: int, start: int) -> None:
        """hidden: verify rows of the pending token and the kept drafts (positions start..)."""

    def release(self, st: SpecState) -> None: ...
