"""<think> splitting: one-shot table, streaming hold-back, streaming == one-shot for any chunking."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ninfer_mlc.reasoning import ReasoningStreamSplitter, split_reasoning

# (id, text, started_in_think, reasoning, content, closed)
CASES = [
    ("prompt_opened", "Let me think.\n</think>\n\nThe answer is 4.", True, "Let me think.", "The answer is 4.", True),
    ("model_opened", "<think>\nhmm\n</think>\n\nHi", False, "hmm", "Hi", True),
    ("model_opened_leading_ws", "\n <think>x</think>y", False, "x", "y", True),
    ("no_think", "Hello\nworld\n", False, "", "Hello\nworld\n", True),
    ("think_not_at_start_is_content", "A <think>b</think> c", False, "", "A <think>b</think> c", True),
    ("empty_think_block", "<think>\n\n</think>\n\nAnswer", False, "", "Answer", True),
    ("prompt_opened_unclosed", "still thinking\nabout it\n", True, "still thinking\nabout it", "", False),
    ("model_opened_unclosed", "<think>\npartial", False, "partial", "", False),
    ("all_newlines_stripped", "\n\nr1\n\nr2\n\n\n</think>\n\n\nc1\n\nc2\n", True, "r1\n\nr2", "c1\n\nc2\n", True),
    ("second_close_is_content", "a</think>b</think>c", True, "a", "b</think>c", True),
    ("no_newlines", "a</think>b", True, "a", "b", True),
    ("content_keeps_inner_think", "r</think>\n\n<think>x</think>", True, "r", "<think>x</think>", True),
    ("prompt_opened_tool_call", "r\n</think>\n\n<tool_call>\n", True, "r", "<tool_call>\n", True),
    ("partial_open_is_content", "<thin", False, "", "<thin", True),
    ("empty", "", False, "", "", True),
    ("empty_in_think", "", True, "", "", False),
]


@pytest.mark.parametrize("cid,text,started,reasoning,content,closed", CASES, ids=[c[0] for c in CASES])
def test_split_reasoning(cid, text, started, reasoning, content, closed):
    r = split_reasoning(text, started)
    assert (r.reasoning, r.content, r.closed) == (reasoning, content, closed)


def stream(chunks, started):
    sp = ReasoningStreamSplitter(started)
    events = []
    for c in chunks:
        events += sp.feed(c)
    events += sp.finish()
    assert all(t for _, t in events), "no empty events"
    return sp, events


def joined(events, kind):
    return "".join(t for k, t in events if k == kind)


@pytest.mark.parametrize("cid,text,started,reasoning,content,closed", CASES, ids=[c[0] for c in CASES])
def test_stream_char_by_char(cid, text, started, reasoning, content, closed):
    sp, ev = stream(list(text), started)
    assert (joined(ev, "reasoning"), joined(ev, "content")) == (reasoning, content)
    assert sp.reasoning_closed == closed


def test_stream_holds_back_only_marker_prefixes():
    sp = ReasoningStreamSplitter(started_in_think=True)
    assert sp.feed("\nStep 1") == [("reasoning", "Step 1")]
    assert sp.feed("\n\n</thi") == []
    assert sp.held_back == "\n\n</thi" and sp.in_reasoning
    assert sp.feed("s is not") == [("reasoning", "\n\n</this is not")]
    assert sp.feed(" it\n</think>") == [("reasoning", " it")]
    assert sp.reasoning_closed and not sp.in_reasoning
    assert sp.feed("\n\n") == []
    assert sp.feed("Answer <") == [("content", "Answer <")]  # content is never held
    assert sp.finish() == []


def test_stream_waits_for_possible_open_marker():
    sp = ReasoningStreamSplitter()
    assert sp.feed(" <th") == []
    assert sp.held_back == " <th"
    assert sp.feed("ink>\nx") == [("reasoning", "x")]
    sp = ReasoningStreamSplitter()
    assert sp.feed("<th") == []
    assert sp.feed("e") == [("content", "<the")]


def test_feed_after_finish_raises():
    sp = ReasoningStreamSplitter()
    sp.finish()
    with pytest.raises(RuntimeError):
        sp.feed("x")


FRAGMENTS = ["<think>", "</think>", "\n", "\n\n", "a", " b", "<", "</", "think", ">", "<thi", "nk>", "</th", " "]


def split_at(text, cuts):
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0] + cuts + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=400, deadline=None)
@given(
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=30),
    cuts=st.lists(st.integers(min_value=0, max_value=1000), max_size=15),
    started=st.booleans(),
)
def test_stream_equals_oneshot(parts, cuts, started):
    text = "".join(parts)
    _, ev = stream(split_at(text, cuts), started)
    r = split_reasoning(text, started)
    assert joined(ev, "reasoning") == r.reasoning
    assert joined(ev, "content") == r.content
