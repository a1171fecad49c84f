"""Per-request speculative state and the record of one round (kept until the scheduler settles it)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np


@dataclass
class RoundRecord:
    """What one verification fed and produced for a row."""

    refed: list[int]  # committed tokens re-fed at the front (after an earlier rollback)
    pending: int  # the committed token the round started from
    drafts: list[int]
    out: list[int]  # accepted drafts + the correction / bonus token
    start: int  # position of `pending`
    hidden: Optional[np.ndarray] = None  # verify hidden rows of pending + drafts
    snap: Optional[tuple[int, int]] = None  # (snapshot slot, length before the verification)
    first_row: int = -1  # index of the row's first token among the verify's rows (-1: not verified yet)
    gdn_rows: Any = None  # the verify's kept GDN projections (runner.verify_gdn_rows): rollback without re-feed


@dataclass
class SpecState:
    """Speculative state of one request."""

    unfed: Optional[list] = None  # committed tokens the GDN state has not consumed (after a rollback)
    mtp_pos: int = 0  # position of the first pending MTP row
    mtp_hidden: Optional[np.ndarray] = None  # [m, D] main hidden rows not yet run through the MTP head
    draft_seq: Any = None  # draft-model path: the drafter's sequence (its own KV manager)
    draft_snap: Optional[tuple[int, int]] = None
    dflash: Any = None  # DFlash proposer: the request's drafter context (spec/dflash.py DFlashSeq)
    forced_carry: float = 0.0  # forced acceptance (benchmarks): accepted drafts owed to the profile
    qs: list = field(default_factory=list)  # draft distributions of the open round (rejection test)
    round: Optional[RoundRecord] = None
