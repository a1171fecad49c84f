"""Tests for runtime/stop_strings.py: results must not depend on how text is split."""

from __future__ import annotations

from typing import Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer_mlc.runtime.stop_strings import StopStringMatcher


def reference(text: str, stops: list[str]) -> tuple[str, Optional[str]]:
    """Independent definition: scan end offsets left to right; the first stop string that
    ends there (longest first on ties) wins; output is the text before it."""
    for end in range(1, len(text) + 1):
        for s in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(s):
                return text[:end - len(s)], s
    return text, None


def longest_holdback(text: str, stops: list[str]) -> int:
    best = 0
    for k in range(1, len(text) + 1):
        suf = text[-k:]
        if any(len(s) > k and s.startswith(suf) for s in stops):
            best = k
    return best


def run_split(text: str, stops: list[str], cuts: list[int]):
    m = StopStringMatcher(stops)
    out = []
    seen = ""
    pieces = []
    prev = 0
    for c in sorted(set(cuts)) + [len(text)]:
        pieces.append(text[prev:c])
        prev = c
    for piece in pieces:
        seen += piece
        emit, stopped, matched = m.feed(piece)
        out.append(emit)
        if stopped:
            return "".join(out), matched, True
        # invariant: everything but the minimal possible hold-back is out already
        assert "".join(out) + m.held == seen
        assert len(m.held) == longest_holdback(seen, stops)
    out.append(m.flush())
    return "".join(out), None, False


alphabet = st.sampled_from(list("ab\n<|>é😀"))
stop_st = st.lists(st.text(alphabet, min_size=1, max_size=4), min_size=0, max_size=4)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(alphabet, max_size=30), stops=stop_st, data=st.data())
def test_split_invariance(text, stops, data):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text) + 1))
    want_text, want_match = reference(text, stops)
    got_text, got_match, stopped = run_split(text, stops, cuts)
    assert got_text == want_text
    assert got_match == want_match
    assert stopped == (want_match is not None)


@settings(max_examples=60, deadline=None)
@given(text=st.text(alphabet, max_size=12), stops=stop_st)
def test_every_split_of_short_text(text, stops):
    # all 2^(n-1) ways to split (n <= 12) -- exhaustively
    want = reference(text, stops)
    n = len(text)
    for mask in range(1 << max(n - 1, 0)):
        cuts = [i + 1 for i in range(n - 1) if mask >> i & 1]
        got_text, got_match, _ = run_split(text, stops, cuts)
        assert (got_text, got_match) == want


def test_basic_examples():
    m = StopStringMatcher(["</answer>", "\n\nUser:"])
    assert m.feed("The answer is 4") == ("The answer is 4", False, None)
    assert m.feed(".</ans") == (".", False, None)
    assert m.held == "</ans"
    assert m.feed("wer> trailing") == ("", True, "</answer>")
    assert m.feed("more") == ("", True, "</answer>")
    assert m.flush() == ""


def test_false_start_is_released():
    m = StopStringMatcher(["STOP"])
    assert m.feed("ST") == ("", False, None)
    assert m.feed("OX") == ("STOX", False, None)
    assert m.feed("S") == ("", False, None)
    assert m.flush() == "S"


def test_overlapping_stops_first_to_complete_wins():
    # "b" completes before "xbc"
    assert run_split("xbc", ["xbc", "b"], [])[:2] == ("x", "b")
    assert run_split("xbc", ["xbc", "b"], [1, 2])[:2] == ("x", "b")
    # same end offset: the longer one (earlier start) wins
    assert run_split("aab", ["ab", "aab"], [])[:2] == ("", "aab")
    assert run_split("aab", ["ab", "aab"], [2])[:2] == ("", "aab")


def test_no_stops_passthrough_and_validation():
    m = StopStringMatcher([])
    assert m.feed("abc") == ("abc", False, None)
    assert m.flush() == ""
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def test_reset():
    m = StopStringMatcher(["z"])
    assert m.feed("az") == ("a", True, "z")
    m.reset()
    assert m.feed("b") == ("b", False, None)


def test_long_stop_strings_match_in_linear_time():
    """A 100k-character stop string builds and matches in one pass (the old matcher built every prefix:
    quadratic time and memory); the answer is the same as the reference."""
    stop = "ab" * 50_000
    m = StopStringMatcher([stop, "b" * 3])
    text = "a" * 1000 + "ab" * 49_999 + "a" + "bbb"
    out, stopped, matched = "", False, None
    for i in range(0, len(text), 997):
        emit, stopped, matched = m.feed(text[i:i + 997])
        out += emit
        if stopped:
            break
    assert (out, matched) == reference(text, [stop, "bbb"])


def test_sampling_params_bound_stop_length():
    from ninfer_mlc.runtime.sampling import MAX_STOP_STRING_CHARS, SamplingError, SamplingParams

    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS]).validate()
    with pytest.raises(SamplingError, match="at most"):
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)]).validate()
