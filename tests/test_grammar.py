"""Constrained decoding (runtime/grammar.py + structural_tags.py) on the tiny model's real tokenizer.

No model: a seeded random walk picks any token the mask allows, so every path the grammar permits is
fair game; whenever the grammar completes, the text must parse (JSON / Qwen XML calls through the
server's own parser) and validate against the schema.
"""
import json
import subprocess
import sys

import jsonschema
import numpy as np
import pytest

from ninfer_mlc.paths import default_model_dir
from ninfer_mlc.runtime.grammar import (ConstraintCompiler, ConstraintError, allocate_bitmask, apply_bitmask,
                                        bitmask_words, encoded_vocab, fill_bitmasks, mask_logits)
from ninfer_mlc.runtime.structural_tags import structural_tag
from ninfer_mlc.runtime.tokenizer import load_tokenizer
from ninfer_mlc.tool_calls import parse_tool_calls

V = 2048  # the tiny model's logits width (its tokenizer has 2000 tokens)
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"},
    "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 2}},
    "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "ping", "parameters": {
             "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}}}]
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer",
                                                                                           "minimum": 0, "maximum": 9}},
          "required": ["answer", "score"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(default_model_dir())


@pytest.fixture(scope="module")
def compiler(tok):
    return ConstraintCompiler(tok, V, [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")])


def walk(compiler, tok, spec, seed, reasoning=False, steps=400, prefix=""):
    """Random allowed tokens until the grammar terminates: (text, terminated). ``prefix`` is fed first."""
    m = compiler.matcher(spec, reasoning)
    for t in tok.encode(prefix, add_special_tokens=False).ids:
        assert m.accept(t)
    rng = np.random.default_rng(seed)
    out, mask = [], allocate_bitmask(V)
    for _ in range(steps):
        logits = rng.standard_normal((1, V)).astype(np.float32)
        m.fill_bitmask(mask)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), count=V, bitorder="little"))
        assert len(allowed) and allowed.max() < 2000  # padding ids are never allowed
        masked = mask_logits([m], logits)[0]
        assert np.isneginf(np.delete(masked, allowed)).all() and np.isfinite(masked[allowed]).all()
        # favour ending (a stop token, else the lowest id: quotes, brackets, digits) half of the time so
        # walks end within the step budget
        ok = set(allowed.tolist())
        closers = [c for c in compiler.stop_token_ids + [tok.token_to_id(x) for x in '"}]'] if c in ok]
        t = int(allowed[np.argmax(masked[allowed])]) if rng.random() < 0.5 else (closers + [int(allowed[0])])[0]
        assert m.accept(t)
        out.append(t)
        if m.is_terminated():
            assert t in compiler.stop_token_ids
            return tok.decode(out[:-1], skip_special_tokens=False), True
    return tok.decode(out, skip_special_tokens=False), False


def test_apply_bitmask_matches_reference():
    rng = np.random.default_rng(0)
    for v in (1, 31, 32, 33, 2048, 2051):
        mask = rng.integers(-2**31, 2**31, size=bitmask_words(v), dtype=np.int64).astype(np.int32)
        row = rng.standard_normal(v).astype(np.float32)
        want = row.copy()
        for t in range(v):
            if not (int(mask[t // 32]) >> (t % 32)) & 1:
                want[t] = -np.inf
        apply_bitmask(row, mask)
        np.testing.assert_array_equal(row, want)
    with pytest.raises(ValueError):
        apply_bitmask(np.zeros(64, np.float32), np.zeros(3, np.int32))
    logits = np.zeros((2, 64), np.float32)
    assert mask_logits([None, None], logits) is logits  # unconstrained batches are not copied


@pytest.mark.parametrize("seed", range(6))
def test_json_schema_walks_validate(compiler, tok, seed):
    text, done = walk(compiler, tok, {"type": "json_schema", "schema": ANSWER}, seed)
    assert done, text
    jsonschema.validate(json.loads(text), ANSWER)


@pytest.mark.parametrize("seed", range(4))
def test_json_object_walks_parse(compiler, tok, seed):
    text, done = walk(compiler, tok, {"type": "json_object"}, seed, steps=300)
    assert done, text
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("mode,seed", [(m, s) for m in ("required", "named") for s in range(4)])
def test_forced_tool_calls_parse_with_schema_valid_arguments(compiler, tok, mode, seed):
    spec = {"type": "tool_call", "mode": mode, "tools": TOOLS, "parallel": seed % 2 == 0}
    if mode == "named":
        spec["name"] = "get_weather"
    text, done = walk(compiler, tok, spec, seed)
    assert done, text
    assert text.startswith("<tool_call>\n<function=")  # nothing but calls
    res = parse_tool_calls(text, TOOLS)
    assert res.fallback_reason is None and res.calls and res.content == "", (text, res)
    if mode == "named" or not spec["parallel"]:
        assert len(res.calls) == 1
    if mode == "named":
        assert res.calls[0].name == "get_weather"
    for c in res.calls:
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == c.name)
        jsonschema.validate(c.arguments, schema)


def test_auto_mode_constrains_only_strict_tools(compiler, tok):
    tools = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}},
             {"type": "function", "function": {"name": "free", "parameters": {"type": "object"}}}]
    spec = {"type": "tool_call", "mode": "auto", "tools": tools, "parallel": False}
    tag = structural_tag(spec)["format"]
    assert tag["type"] == "triggered_tags" and tag["tags"][1]["content"]["json_schema"] is True
    text, done = walk(compiler, tok, spec, 0, prefix="Let me check.\n<tool_call>\n<function=get_weather>\n")
    assert done, text
    res = parse_tool_calls("<tool_call>\n<function=get_weather>\n" + text, tools)
    assert res.calls and res.calls[0].name == "get_weather"
    jsonschema.validate(res.calls[0].arguments, WEATHER)
    m = compiler.matcher(spec)  # an undeclared name cannot follow the trigger
    for t in tok.encode("<tool_call>\n<function=", add_special_tokens=False).ids:
        assert m.accept(t)
    assert not m.accept(tok.encode("zzz", add_special_tokens=False).ids[0])


def test_json_or_tool_calls(compiler, tok):
    spec = {"type": "json_schema", "schema": ANSWER, "tools": TOOLS[:1], "parallel": False}
    for seed in range(4):
        text, done = walk(compiler, tok, spec, seed)
        assert done
        if text.startswith("<tool_call>"):
            assert parse_tool_calls(text, TOOLS).calls
        else:
            jsonschema.validate(json.loads(text), ANSWER)


def test_reasoning_stays_free_until_think_closes(compiler, tok):
    spec = {"type": "json_schema", "schema": ANSWER}
    m = compiler.matcher(spec, reasoning=True)
    for t in tok.encode("anything <goes> here, even {{ unbalanced", add_special_tokens=False).ids:
        assert m.accept(t)
    text, done = walk(compiler, tok, spec, 3, reasoning=True, prefix="thinking...</think>\n\n")
    assert done
    jsonschema.validate(json.loads(text), ANSWER)
    # no second <think> opener inside the reasoning, and the answer cannot start before </think>
    m = compiler.matcher(spec, reasoning=True)
    assert not m.accept(tok.token_to_id("<think>"))


def test_special_tokens_never_allowed_and_stop_only_at_the_end(compiler, tok):
    m = compiler.matcher({"type": "json_schema", "schema": ANSWER})
    mask = allocate_bitmask(V)
    m.fill_bitmask(mask)
    bits = np.unpackbits(mask.view(np.uint8), count=V, bitorder="little")
    assert bits[tok.token_to_id("<|im_start|>")] == 0 and bits[tok.token_to_id("<|im_end|>")] == 0
    assert not m.accept(tok.token_to_id("<|im_end|>"))
    for t in tok.encode('{"answer": "no", "score": 3}', add_special_tokens=False).ids:
        assert m.accept(t)
    m.fill_bitmask(mask)
    bits = np.unpackbits(mask.view(np.uint8), count=V, bitorder="little")
    assert set(np.flatnonzero(bits)) <= set(compiler.stop_token_ids)
    assert m.accept(tok.token_to_id("<|im_end|>")) and m.is_terminated()
    m.rollback(1)
    assert not m.is_terminated()


def test_batch_bitmask_for_a_device_sampler(compiler, tok):
    m = compiler.matcher({"type": "json_object"})
    out = np.zeros((2, bitmask_words(V)), np.int32)
    need = fill_bitmasks([None, m], out)
    assert need.tolist() == [False, True] and (out[0] == -1).all()
    one = allocate_bitmask(V)
    m.fill_bitmask(one)
    np.testing.assert_array_equal(out[1], one)
    logits = np.random.default_rng(0).standard_normal((2, V)).astype(np.float32)
    masked = mask_logits([None, m], logits)
    np.testing.assert_array_equal(masked[0], logits[0])
    apply_bitmask(logits[1], out[1])
    np.testing.assert_array_equal(masked[1], logits[1])


def test_grammar_markers_stay_text_when_a_tokenizer_flags_them_special():
    from tokenizers import Tokenizer

    spec = json.loads((default_model_dir() / "tokenizer.json").read_text())
    for a in spec["added_tokens"]:
        a["special"] = a["special"] or a["content"] in ("</think>", "<tool_call>")
    t2 = Tokenizer.from_str(json.dumps(spec))
    vocab = encoded_vocab(t2, V)
    assert vocab[t2.token_to_id("</think>")] == "</think>" and vocab[t2.token_to_id("<tool_call>")] == "<tool_call>"
    assert vocab[t2.token_to_id("<|im_start|>")] == "" and vocab[2047] == ""  # special / padding: never allowed


def test_rollback_restores_the_mask(compiler, tok):
    m = compiler.matcher({"type": "tool_call", "mode": "named", "name": "ping", "tools": TOOLS})
    before, after = allocate_bitmask(V), allocate_bitmask(V)
    m.fill_bitmask(before)
    ids = tok.encode("<tool_call>\n<function=ping>\n<parameter=ok>", add_special_tokens=False).ids
    for t in ids:
        assert m.accept(t)
    m.rollback(len(ids))
    m.fill_bitmask(after)
    np.testing.assert_array_equal(before, after)


def test_warm_up_in_background(tok):
    c = ConstraintCompiler(tok, V, [1993])
    c.warm_in_background().join(timeout=120)
    c.compile({"type": "json_object"})
    assert c.stats == {"compiled": 1, "cache_hits": 0}


def test_compiled_grammars_are_cached_by_spec(tok):
    c = ConstraintCompiler(tok, V, [1993], cache_size=2)
    a = {"type": "json_schema", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}
    reordered = {"schema": {"properties": {"a": {"type": "integer"}}, "type": "object"}, "type": "json_schema"}
    assert c.compile(a) is c.compile(reordered)
    assert c.stats == {"compiled": 1, "cache_hits": 1}
    c.compile(a, reasoning=True)  # another grammar: reasoning prefix
    c.compile({"type": "json_object"})
    assert c.stats["compiled"] == 3
    c.compile(a)  # evicted (LRU of 2)
    assert c.stats["compiled"] == 4


@pytest.mark.parametrize("spec,match,tool", [
    ({"type": "json_schema", "schema": {"type": "strng"}}, "Unsupported type", None),
    ({"type": "json_schema", "schema": {"type": "string", "pattern": "(("}}, "invalid schema", None),
    ({"type": "json_schema", "schema": "nope"}, "JSON schema object", None),
    ({"type": "yaml"}, "constraint type", None),
    ({"type": "tool_call", "mode": "named", "name": "nope", "tools": TOOLS}, "not among", None),
    ({"type": "tool_call", "mode": "required", "tools": []}, "non-empty list", None),
    ({"type": "tool_call", "mode": "sometimes", "tools": TOOLS}, "mode", None),
    ({"type": "tool_call", "mode": "required", "tools": TOOLS + TOOLS[:1]}, "declared twice", "get_weather"),
    ({"type": "tool_call", "mode": "required", "tools": TOOLS + [{"type": "function", "function": {
        "name": "bad", "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}]},
     "tool 'bad'", "bad"),
])
def test_bad_specs_raise_constraint_errors(compiler, spec, match, tool):
    with pytest.raises(ConstraintError, match=match) as ei:
        compiler.compile(spec)
    assert ei.value.tool == tool


def test_xgrammar_loads_without_torch_or_transformers():
    """Serving installs xgrammar without its declared requirements: only its native core is imported then."""
    code = """
import sys
for name in ("torch", "transformers", "triton", "pydantic"):  # xgrammar's declared requirements
    sys.modules[name] = None
from ninfer_mlc.paths import default_model_dir
from ninfer_mlc.runtime.grammar import ConstraintCompiler
from ninfer_mlc.runtime.tokenizer import load_tokenizer
tok = load_tokenizer(default_model_dir())
m = ConstraintCompiler(tok, 2048, [1993]).matcher({"type": "json_object"})
for t in tok.encode('{"a": 1}', add_special_tokens=False).ids:
    assert m.accept(t)
assert m.accept(1993) and m.is_terminated()
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def _schemas():
    from hypothesis import strategies as st

    leaf = st.fixed_dictionaries({}, optional={
        "type": st.sampled_from(["string", "integer", "number", "boolean", "null", "object", "array", "strng", 3]),
        "enum": st.lists(st.one_of(st.text(max_size=4), st.integers(), st.none()), max_size=3),
        "minimum": st.integers(-5, 5), "maximum": st.integers(-5, 5), "maxLength": st.integers(-1, 4),
        "pattern": st.sampled_from(["^a+$", "((", "[0-9]{2}"]), "format": st.sampled_from(["date", "email", "x"]),
        "required": st.one_of(st.lists(st.text(max_size=3), max_size=2), st.text(max_size=2))})
    return st.recursive(leaf, lambda kids: st.one_of(
        st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(
            st.text(min_size=1, max_size=3), kids, max_size=3)}),
        st.fixed_dictionaries({"type": st.just("array"), "items": kids}),
        st.fixed_dictionaries({"anyOf": st.lists(kids, max_size=3)})), max_leaves=6)


def test_arbitrary_schemas_compile_or_raise_constraint_errors(compiler):
    """Whatever a client sends as a schema, compiling it either works or is a ConstraintError (a 400)."""
    from hypothesis import HealthCheck, given, settings

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
    @given(_schemas())
    def check(schema):
        for spec in ({"type": "json_schema", "schema": schema},
                     {"type": "tool_call", "mode": "required", "tools": [{"type": "function", "function": {
                         "name": "f", "parameters": schema}}]}):
            try:
                compiler.matcher(spec)
            except ConstraintError:
                pass

    check()
