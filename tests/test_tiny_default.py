"""Tests for the deterministic tiny default model generator (compile/tiny_default.py)."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import subprocess
import sys
import time
import unicodedata
from pathlib import Path

import numpy as np
import pytest

from ninfer_mlc.compile import tiny_default as td

FILES = [
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "model.safetensors",
]


def _hashes(d: Path) -> dict[str, str]:
    return {f: hashlib.sha256((d / f).read_bytes()).hexdigest() for f in FILES}


@pytest.fixture(scope="module")
def gen(tmp_path_factory):
    t0 = time.perf_counter()
    d = td.generate(tmp_path_factory.mktemp("tiny_a"))
    return d, time.perf_counter() - t0


@pytest.fixture(scope="module")
def model_dir(gen) -> Path:
    return gen[0]


@pytest.fixture(scope="module")
def tok(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_tok(model_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model, info = transformers.Qwen3_5ForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module")
def config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


# ---------------------------------------------------------------------------------- files


def test_all_files_written_fast(gen):
    d, seconds = gen
    for f in FILES:
        assert (d / f).is_file(), f
    assert seconds < 20.0


def test_deterministic_in_process(model_dir, tmp_path_factory):
    other = td.generate(tmp_path_factory.mktemp("tiny_b"))
    assert _hashes(model_dir) == _hashes(other)


def test_deterministic_cli_other_process(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny_cli") / "m"
    env = dict(os.environ, PYTHONHASHSEED="12345", RAYON_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    res = subprocess.run(
        [sys.executable, "-m", "ninfer_mlc.compile.tiny_default", str(out)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert _hashes(model_dir) == _hashes(out)
    # Regenerating into an existing directory overwrites identically.
    td.generate(out)
    assert _hashes(model_dir) == _hashes(out)


def test_corpus_is_fixed():
    a, b = td.corpus_documents(), td.corpus_documents()
    assert a == b
    assert 300_000 < sum(len(x) for x in a) < 500_000


# --------------------------------------------------------------------------------- config


def test_config_values(config):
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["model_type"] == "qwen3_5_text"
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    expect = dict(
        num_hidden_layers=4, full_attention_interval=4, hidden_size=128, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=8192,
        tie_word_embeddings=False, mtp_num_hidden_layers=1,
    )
    for k, v in expect.items():
        assert config[k] == v, k
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}


def test_vocab_size_covers_tokenizer(config, tok):
    n = tok.get_vocab_size(with_added_tokens=True)
    assert 1900 <= n <= 2100
    assert config["vocab_size"] % 64 == 0
    assert n <= config["vocab_size"] < n + 64
    assert max(tok.get_vocab().values()) < config["vocab_size"]


def test_special_token_ids(config, model_dir, tok):
    ids = {t: tok.token_to_id(t) for t, _ in td.ADDED_TOKENS}
    assert ids["<|endoftext|>"] == td.BPE_VOCAB_SIZE
    assert ids["<|im_start|>"] == ids["<|endoftext|>"] + 1
    assert ids["<|im_end|>"] == ids["<|endoftext|>"] + 2
    assert config["eos_token_id"] == ids["<|im_end|>"]
    assert config["bos_token_id"] == config["pad_token_id"] == ids["<|endoftext|>"]
    gc = json.loads((model_dir / "generation_config.json").read_text())
    assert gc["eos_token_id"] == [ids["<|im_end|>"], ids["<|endoftext|>"]]
    assert (gc["temperature"], gc["top_p"], gc["top_k"]) == (0.7, 0.8, 20)
    tj = json.loads((model_dir / "tokenizer.json").read_text())
    special = {t["content"]: t["special"] for t in tj["added_tokens"]}
    assert special == dict(td.ADDED_TOKENS)
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tc["eos_token"] == "<|im_end|>" and tc["pad_token"] == "<|endoftext|>"
    assert tc["model_max_length"] == 8192
    assert tc["chat_template"] == (model_dir / "chat_template.jinja").read_text()


# ------------------------------------------------------------------------------ tokenizer

ROUND_TRIP = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return {'a': [1, 2.5, None]}  # comment\n\t\ttabs\r\nCRLF",
    "Grüße aus Köln — café, naïve, Ærøskøbing; ¿Qué tal? Привет мир. Γειά σου.",
    "你好，世界！今日は良い天気です。안녕하세요 🤖👋🏽🇫🇷 ∑ x² ≤ ∞ ",
    "<|im_start|>user\nhi<|im_end|>\n<think>\nhmm\n</think>\n\n<tool_call>\n<function=f>\n</function>\n</tool_call><|endoftext|>",
    "  leading and trailing spaces   \n\n\n",
    "\x00\x01\x7f control \ufeff bom \U0010ffff",
]


@pytest.mark.parametrize("text", ROUND_TRIP)
def test_tokenizer_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == unicodedata.normalize("NFC", text)


def test_tokenizer_round_trip_arbitrary_unicode(tok):
    # Every code point (minus surrogates) in a pseudo-random order; normalisation is NFC.
    rng = np.random.default_rng(0)
    cps = [c for c in rng.integers(1, 0x110000, 4000).tolist() if not 0xD800 <= c < 0xE000]
    text = "".join(map(chr, cps))
    ids = tok.encode(text).ids
    assert tok.decode(ids, skip_special_tokens=False) == tok.normalizer.normalize_str(text)


def test_special_tokens_atomic(tok):
    text = "<|im_start|>system\nx<|im_end|><think></think><tool_call></tool_call><tool_response></tool_response><|endoftext|>"
    toks = tok.encode(text).tokens
    for t, _ in td.ADDED_TOKENS:
        assert t in toks
    ids = tok.encode(text).ids
    # Only the ChatML/eot tokens are special: skip_special_tokens keeps <think> & co.
    assert tok.decode(ids, skip_special_tokens=True) == (
        "system\nx<think></think><tool_call></tool_call><tool_response></tool_response>"
    )


def test_bpe_learned_merges(tok):
    # The BPE is real: common words are single tokens and text compresses well.
    for word in [" the", " function", " return", "def", " data"]:
        assert len(tok.encode(word).ids) == 1, word
    text = " ".join(td.corpus_documents()[:20])
    assert len(tok.encode(text).ids) < len(text.encode()) / 2.5


def test_hf_tokenizer_matches(hf_tok, tok):
    assert len(hf_tok) == tok.get_vocab_size(with_added_tokens=True)
    assert hf_tok.eos_token == "<|im_end|>" and hf_tok.pad_token == "<|endoftext|>"
    # Combining marks without precomposed forms exercise the \\p{M} of Qwen3.5's regex.
    for text in ROUND_TRIP + ["x\u0308y q\u0323\u0307 1\u0301a \u0915\u093f\u0928\u093e"]:
        assert hf_tok(text)["input_ids"] == tok.encode(text).ids
    pre = json.loads(hf_tok.backend_tokenizer.to_str())["pre_tokenizer"]
    assert pre["pretokenizers"][0]["pattern"]["Regex"] == td.PRETOKENIZE_REGEX


# ----------------------------------------------------------------------------- template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def _conversation():
    return [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Old question"},
        {"role": "assistant", "content": "Old answer", "reasoning_content": "OLD-REASONING"},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "\nNeed the tool.\n",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3, "opts": {"unit": "C"}}}},
                {"type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}},
            ],
        },
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": "12:00"},
        {"role": "assistant", "content": "It is 21C.", "reasoning_content": "Got both."},
    ]


def test_template_tools_and_reasoning(hf_tok):
    s = hf_tok.apply_chat_template(_conversation(), tools=TOOLS, tokenize=False)
    assert s.startswith("<|im_start|>system\nYou are terse.\n\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n")
    assert '{"type": "function", "function": {"name": "get_weather", "description": "Get the weather"' in s
    assert "\n</tools>\n\nIf you choose to call a function ONLY reply in the following format" in s
    assert "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>" in s
    # Reasoning before the last user query is dropped, after it is kept.
    assert "OLD-REASONING" not in s
    assert "<|im_start|>user\nOld question<|im_end|>\n<|im_start|>assistant\nOld answer<|im_end|>\n" in s
    assert (
        "<|im_start|>assistant\n<think>\nNeed the tool.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=opts>\n{\"unit\": \"C\"}\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n<parameter=tz>\nCET\n</parameter>\n"
        "</function>\n</tool_call><|im_end|>\n"
    ) in s
    # Consecutive tool results share one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n"
        "<tool_response>\n12:00\n</tool_response><|im_end|>\n"
    ) in s
    assert s.endswith("<|im_start|>assistant\n<think>\nGot both.\n</think>\n\nIt is 21C.<|im_end|>\n")


def test_template_generation_prompt(hf_tok):
    msgs = [{"role": "user", "content": "hi"}]
    on = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert on == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    on2 = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert on2 == on
    off = hf_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    sys_only = hf_tok.apply_chat_template(
        [{"role": "system", "content": "S"}] + msgs, tokenize=False, add_generation_prompt=False
    )
    assert sys_only == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"


def test_template_content_parts_and_inline_think(hf_tok):
    msgs = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "<think>\nplan\n</think>\n\nanswer"},
    ]
    s = hf_tok.apply_chat_template(msgs, tokenize=False)
    assert s == "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\n<think>\nplan\n</think>\n\nanswer<|im_end|>\n"


def test_template_tokenizes_with_special_ids(hf_tok, tok):
    ids = hf_tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.token_to_id("<|im_end|>") in ids
    assert ids[-2:] == [tok.token_to_id("<think>"), tok.encode("\n").ids[0]]


# -------------------------------------------------------------------------------- weights


def test_safetensors_names_and_shapes(model_dir):
    from safetensors.numpy import load_file

    w = load_file(str(model_dir / "model.safetensors"))
    assert all(a.dtype == np.float32 for a in w.values())
    assert all(np.isfinite(a).all() for a in w.values())
    D = 128
    assert w["model.embed_tokens.weight"].shape == (2048, D)
    assert w["lm_head.weight"].shape == (2048, D)
    assert w["model.layers.0.linear_attn.in_proj_qkv.weight"].shape == (2 * 64 + 128, D)
    assert w["model.layers.0.linear_attn.conv1d.weight"].shape == (256, 1, 4)
    assert w["model.layers.2.linear_attn.A_log"].shape == (4,)
    assert w["model.layers.3.self_attn.q_proj.weight"].shape == (4 * 64 * 2, D)
    assert w["model.layers.3.self_attn.o_proj.weight"].shape == (D, 256)
    assert w["mtp.fc.weight"].shape == (D, 2 * D)
    for n in ["mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
              "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight"]:
        assert w[n].shape == (D,), n
    for n in ["q_proj", "k_proj", "v_proj", "o_proj"]:
        assert w[f"mtp.layers.0.self_attn.{n}.weight"].shape == w[f"model.layers.3.self_attn.{n}.weight"].shape
    for n in ["gate_proj", "up_proj", "down_proj"]:
        assert f"mtp.layers.0.mlp.{n}.weight" in w
    assert "mtp.layers.0.self_attn.q_norm.weight" in w and "mtp.layers.0.self_attn.k_norm.weight" in w
    assert not any(k.startswith("model.layers.3.linear_attn") for k in w)
    assert not any(k.startswith(("model.layers.0.self_attn", "model.layers.1.self_attn", "model.layers.2.self_attn")) for k in w)
    # GDN parameters in the intended ranges.
    for i in range(3):
        a = np.exp(w[f"model.layers.{i}.linear_attn.A_log"])
        assert ((a >= 1.0 - 1e-5) & (a <= 8.0 + 1e-5)).all()
        assert abs(w[f"model.layers.{i}.linear_attn.norm.weight"].mean() - 1.0) < 0.1


def test_hf_loads_all_weights(hf_model, model_dir):
    from safetensors.numpy import load_file

    model, info = hf_model
    assert not info["missing_keys"]
    assert not info["mismatched_keys"]
    assert set(info["unexpected_keys"]) <= {k for k in load_file(str(model_dir / "model.safetensors")) if k.startswith("mtp.")}
    sd = model.state_dict()
    w = load_file(str(model_dir / "model.safetensors"))
    for name, t in sd.items():
        assert np.array_equal(t.numpy(), w[name]), name


def test_hf_forward_and_cached_decode(hf_model, tok):
    import torch

    model, _ = hf_model
    text = " ".join(td.corpus_documents()[:3])
    ids = torch.tensor([tok.encode(text).ids[:75]])
    assert ids.shape[1] == 75
    with torch.no_grad():
        full = model(ids).logits
        assert torch.isfinite(full).all()
        assert full.shape == (1, 75, 2048)
        std = full[0].std(-1)
        assert (std > 0.3).all() and (std < 20).all()  # neither flat nor saturated
        out = model(ids[:, :70], use_cache=True)  # crosses the 64-token GDN chunk boundary
        cache, steps = out.past_key_values, []
        kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        for t in range(70, 75):
            out = model(ids[:, t : t + 1], use_cache=True, **{kw: cache})
            cache = out.past_key_values
            steps.append(out.logits[:, -1])
    assert (torch.stack(steps, 1) - full[:, 70:]).abs().max() < 1e-3


def test_greedy_generation_does_not_collapse(hf_model, hf_tok):
    import torch

    model, _ = hf_model
    prompt = hf_tok.apply_chat_template([{"role": "user", "content": "Tell me a story."}], add_generation_prompt=True, tokenize=False)
    ids = torch.tensor([hf_tok(prompt)["input_ids"]])
    with torch.no_grad():
        g = model.generate(ids, max_new_tokens=32, do_sample=False, eos_token_id=None, pad_token_id=None)
    new = g[0, ids.shape[1]:].tolist()
    assert len(new) == 32
    assert len(set(new)) >= 8
    assert max(new) < len(hf_tok)  # padded vocabulary rows are never picked
