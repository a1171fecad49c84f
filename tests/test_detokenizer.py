"""Tests for runtime/detokenizer.py against ``tokenizers.Tokenizer.decode``.

A tiny byte-level BPE is trained in-test (no downloads) on mixed ASCII / CJK / emoji text, so
multi-byte characters are split across tokens in many different ways.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from ninfer_mlc.runtime.detokenizer import IncrementalDetokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world, this is a tiny corpus for a byte-level BPE tokenizer.",
    "The quick brown fox jumps over the lazy dog. 0123456789",
    "你好世界，这是一个测试。中文文本用于训练。",
    "こんにちは世界、テストです。",
    "Emoji time 😀😃😄😁 🚀🔥 👍🏽 👨‍👩‍👧‍👦 🇫🇷",
    "Ünïcödé àccents: café, naïve, smörgåsbord, Ελληνικά, русский текст",
    "def f(x):\n    return x * 2  # code\n\n\tindent",
    "<think>reasoning here</think> final answer",
] * 20


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer(models.BPE())
    t.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    t.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t.train_from_iterator(CORPUS, trainer)
    t.add_tokens([AddedToken("<think>", special=False, normalized=False),
                  AddedToken("</think>", special=False, normalized=False)])
    return t


def stream(tok, ids, skip_special_tokens=True, tail=None):
    d = IncrementalDetokenizer(tok, prompt_token_ids_tail=tail, skip_special_tokens=skip_special_tokens)
    deltas = [d.add(i) for i in ids]
    final = d.flush()
    return deltas, final, d


text_alphabet = st.one_of(
    st.characters(codec="utf-8", exclude_categories=("Cs",)),
    st.sampled_from(list("你好世界こんにちは😀😃🚀🔥👍🏽👨‍👩‍👧‍👦éàüßΩж \n\t")),
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(text_alphabet, max_size=40))
def test_random_text_roundtrip(tok, text):
    ids = tok.encode(text).ids
    deltas, final, d = stream(tok, ids)
    assert "".join(deltas) + final == tok.decode(ids)
    specials = [t.content for t in tok.get_added_tokens_decoder().values() if t.special]
    if any(s in text for s in specials):
        return  # the literal text of a special token encodes to that token, which decoding skips
    assert tok.decode(ids) == text
    if not text.endswith("\ufffd"):
        # valid text: everything is out by the last token (a literal U+FFFD at the very end
        # is indistinguishable from an incomplete character and waits for flush)
        assert final == ""
    if "\ufffd" not in text:
        for x in deltas:
            assert "\ufffd" not in x  # never a half character
    assert d.text == text


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), skip=st.booleans())
def test_random_ids_match_decode(tok, data, skip):
    # arbitrary id sequences: invalid UTF-8, specials, added tokens in any order
    V = tok.get_vocab_size()
    ids = data.draw(st.lists(st.integers(0, V - 1), max_size=30))
    deltas, final, _ = stream(tok, ids, skip_special_tokens=skip)
    assert "".join(deltas) + final == tok.decode(ids, skip_special_tokens=skip)


def _byte_token_ids(tok, text):
    """Ids of the single-byte tokens for ``text`` (forces a split inside every character)."""
    enc = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False).pre_tokenize_str(text)
    chars = "".join(piece for piece, _ in enc)
    ids = [tok.token_to_id(c) for c in chars]
    assert None not in ids
    return ids


def test_emoji_split_over_byte_tokens(tok):
    ids = _byte_token_ids(tok, "a😀b")
    assert len(ids) == 6
    deltas, final, d = stream(tok, ids)
    assert deltas == ["a", "", "", "", "😀", "b"]
    assert final == ""
    assert d.pending_token_count == 0


def test_cjk_split_and_incomplete_tail_flushes(tok):
    ids = _byte_token_ids(tok, "你好")
    deltas, final, _ = stream(tok, ids[:-1])  # last character incomplete
    assert deltas == ["", "", "你", "", ""]
    assert final == tok.decode(ids[:-1]) [1:] and final.endswith("\ufffd")
    deltas, final, _ = stream(tok, ids)
    assert "".join(deltas) == "你好" and final == ""


def test_special_and_added_tokens(tok):
    think = tok.token_to_id("<think>")
    im_end = tok.token_to_id("<|im_end|>")
    body = tok.encode("hi 😀").ids
    ids = [think] + body + [tok.token_to_id("</think>")] + tok.encode("ok").ids + [im_end]
    deltas, final, _ = stream(tok, ids, skip_special_tokens=True)
    text = "".join(deltas) + final
    assert text == tok.decode(ids, skip_special_tokens=True) == "<think>hi 😀</think>ok"
    deltas, final, _ = stream(tok, ids, skip_special_tokens=False)
    text = "".join(deltas) + final
    assert text == tok.decode(ids, skip_special_tokens=False)
    assert text.endswith("<|im_end|>") and deltas[-1] == "<|im_end|>"


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(prompt=st.text(text_alphabet, max_size=20), out=st.text(text_alphabet, max_size=20))
def test_prompt_tail_context(tok, prompt, out):
    p_ids = tok.encode(prompt).ids
    o_ids = tok.encode(out).ids
    deltas, final, d = stream(tok, o_ids, tail=p_ids[-8:])
    assert "".join(deltas) + final == tok.decode(o_ids) == out
    assert d.output_token_ids == o_ids


def test_prompt_tail_ending_mid_character(tok):
    # prompt tail ends inside a character: the incomplete context is dropped, output intact
    p_ids = _byte_token_ids(tok, "x😀")[:-2]
    o_ids = tok.encode("yes 你").ids
    deltas, final, _ = stream(tok, o_ids, tail=p_ids)
    assert "".join(deltas) + final == "yes 你"
