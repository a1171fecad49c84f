"""bench/spec_forced.py's steady decode window (batch > 1 rows would otherwise mix other requests' prefill chunks
into a request's decode rate)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from spec_forced import steady_decode_rate  # noqa: E402


def test_window_is_from_the_last_first_token_to_the_first_last_token():
    # request 0 decodes from t=0 (1 token per 0.1 s) to t=1.0; request 1 starts at t=0.5 (after its prefill), ends 1.5
    a = [[(0.1 * i, 1) for i in range(11)], [(0.5 + 0.1 * i, 1) for i in range(11)]]
    # window (0.5, 1.0]: request 0 has 5 tokens there (0.6 .. 1.0), request 1 has 5 (0.6 .. 1.0): 10 tokens in 0.5 s
    assert steady_decode_rate(a) == 10.0
    # the per-request rates from each one's own first token are 10 tok/s too, but the window excludes request 1's
    # prefill time entirely: a request that decoded alone for longer would not raise it
    a[0] = [(0.02 * i, 1) for i in range(51)]  # request 0 fast (50 tok/s) while alone, to t=1.0
    assert steady_decode_rate(a) == round((25 + 5) / 0.5 / 2, 2)


def test_no_window_when_one_request_ends_before_another_starts_decoding():
    assert steady_decode_rate([[(0.0, 1), (1.0, 1)], [(2.0, 1), (3.0, 1)]]) is None
    assert steady_decode_rate([[(0.0, 1)], [(0.0, 1), (1.0, 1)]]) is None
    assert steady_decode_rate([]) is None
