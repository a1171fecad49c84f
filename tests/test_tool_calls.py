"""Qwen XML tool-call parser: strict/tolerant tables, schema typing, streaming == one-shot."""

import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ninfer_mlc.tool_calls import (
    ToolCall,
    ToolCallStreamDecoder,
    anthropic_tool_id,
    convert_value,
    new_call_id,
    parse_tool_calls,
    tool_schemas,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
            },
        },
    },
    {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "mcp.fs-read_v2", "parameters": {"type": "object"}}},
]


def call(name, *params, close=True):
    s = f"<tool_call>\n<function={name}>\n"
    for p, v in params:
        s += f"<parameter={p}>\n{v}\n</parameter>\n"
    if close:
        s += "</function>\n</tool_call>"
    return s


W1 = call("get_weather", ("city", "Paris"), ("days", "3"))
W1_ARGS = {"city": "Paris", "days": 3}
XML_PAYLOAD = "<root>\n<parameter=a>\nnested\n</parameter>\n</root>"
MARKERS_PAYLOAD = "text with <tool_call> and </function> and </tool_call> literals"

# (id, text, expected_content, expected [(name, args)], expected_reason)
STRICT_CASES = [
    ("plain", "just text", "just text", [], None),
    ("single", W1, "", [("get_weather", W1_ARGS)], None),
    ("content_before", "Let me check.\n\n" + W1, "Let me check.\n\n", [("get_weather", W1_ARGS)], None),
    (
        "two_calls",
        W1 + "\n" + call("now"),
        "",
        [("get_weather", W1_ARGS), ("now", {})],
        None,
    ),
    ("zero_params", "<tool_call>\n<function=now>\n</function>\n</tool_call>", "", [("now", {})], None),
    (
        "whitespace_between_tags",
        "<tool_call> \t\r\n<function=get_weather>\r\n  <parameter=city>Oslo</parameter>\t\n</function>  \n</tool_call>\n\n",
        "",
        [("get_weather", {"city": "Oslo"})],
        None,
    ),
    (
        "one_newline_each_side_only",
        call("write_file", ("path", "a"), ("content", "\nbody\n")),
        "",
        [("write_file", {"path": "a", "content": "\nbody\n"})],
        None,
    ),
    (
        "nested_balanced_parameter_in_value",
        call("write_file", ("path", "x.xml"), ("content", XML_PAYLOAD)),
        "",
        [("write_file", {"path": "x.xml", "content": XML_PAYLOAD})],
        None,
    ),
    (
        "literal_markers_in_value",
        call("write_file", ("path", "notes.md"), ("content", MARKERS_PAYLOAD)),
        "",
        [("write_file", {"path": "notes.md", "content": MARKERS_PAYLOAD})],
        None,
    ),
    (
        "dotted_dashed_name",
        call("mcp.fs-read_v2", ("p", '{"a": [1, 2]}')),
        "",
        [("mcp.fs-read_v2", {"p": {"a": [1, 2]}})],
        None,
    ),
    (
        "unmatched_nested_opener",
        call("write_file", ("path", "a"), ("content", "<parameter=x>\nno close")),
        None,
        [],
        "malformed_structure",
    ),
    (
        "lone_closer_in_value",
        call("write_file", ("path", "a"), ("content", "a</parameter>b")),
        None,
        [],
        "malformed_structure",
    ),
    (
        "duplicate_parameter",
        call("get_weather", ("city", "A"), ("city", "B")),
        None,
        [],
        "duplicate_parameter",
    ),
    ("invalid_name_space", call("get weather", ("city", "A")), None, [], "invalid_tool_name"),
    ("invalid_name_empty", call("", ("city", "A")), None, [], "invalid_tool_name"),
    ("invalid_name_symbol", call("rm$rf", ("city", "A")), None, [], "invalid_tool_name"),
    ("invalid_name_too_long", call("x" * 129, ("city", "A")), None, [], "invalid_tool_name"),
    ("undeclared_tool", call("launch_missiles", ("target", "moon")), None, [], "undeclared_tool"),
    ("trailing_content", W1 + "\nDone!", None, [], "trailing_content"),
    ("trailing_partial_marker", W1 + "\n<tool_ca", None, [], "trailing_content"),
    ("text_between_calls", W1 + "\nand\n" + call("now"), None, [], "trailing_content"),
    ("missing_tool_call_close", W1[: -len("</tool_call>")], None, [], "malformed_structure"),
    (
        "missing_function_close",
        W1.replace("</function>\n", ""),
        None,
        [],
        "malformed_structure",
    ),
    ("garbage_after_open", "<tool_call>\nhello\n</tool_call>", None, [], "malformed_structure"),
    ("corrupted_opener_strict", W1.replace("<function=", "function="), None, [], "malformed_structure"),
    ("second_call_bad", W1 + "\n" + call("get_weather", ("city", "A"), ("city", "B")), None, [], "duplicate_parameter"),
]


@pytest.mark.parametrize("cid,text,content,calls,reason", STRICT_CASES, ids=[c[0] for c in STRICT_CASES])
def test_strict(cid, text, content, calls, reason):
    r = parse_tool_calls(text, TOOLS)
    assert r.fallback_reason == reason
    assert r.content == (text if content is None else content)
    assert [(c.name, c.arguments) for c in r.calls] == calls
    assert r.marker_seen == ("<tool_call>" in text)
    for c in r.calls:
        assert json.loads(c.arguments_json) == c.arguments


CUT_WRITE = (
    "<tool_call>\n<function=write_file>\n<parameter=path>\nout.txt\n</parameter>\n"
    "<parameter=content>\nline one\nline tw"
)

# (id, text, truncated, expected_content, expected calls, expected_reason, recovery_expected)
TOLERANT_CASES = [
    ("trailing_text", W1 + "\nHope that helps!", False, "", [("get_weather", W1_ARGS)], "truncated_tail", None),
    (
        "malformed_second_call",
        W1 + "\n<tool_call>\n<function=get_weather>\n<parameter=city>\nx</parameter>junk",
        False,
        "",
        [("get_weather", W1_ARGS)],
        "truncated_tail",
        None,
    ),
    (
        "second_call_cut_before_params",
        W1 + "\n<tool_call>\n<function=now",
        False,
        "",
        [("get_weather", W1_ARGS)],
        "truncated_tail",
        None,
    ),
    ("missing_tool_call_close", W1[: -len("</tool_call>")], False, "", [("get_weather", W1_ARGS)], None,
     "missing_tool_call_close"),
    ("partial_tool_call_close", W1[: -len("l>")], False, "", [("get_weather", W1_ARGS)], None,
     "missing_tool_call_close"),
    (
        "missing_both_closers",
        W1[: -len("</function>\n</tool_call>")],
        False,
        "",
        [("get_weather", W1_ARGS)],
        None,
        "missing_function_close",
    ),
    (
        "partial_function_close",
        W1[: -len("tion>\n</tool_call>")],
        False,
        "",
        [("get_weather", W1_ARGS)],
        None,
        "missing_function_close",
    ),
    (
        "tool_call_close_without_function_close",
        W1.replace("</function>\n", "") + "\n" + call("now"),
        False,
        "",
        [("get_weather", W1_ARGS), ("now", {})],
        None,
        "missing_function_close",
    ),
    (
        "missing_tool_call_close_between_calls",
        W1[: -len("</tool_call>")] + call("now"),
        False,
        "",
        [("get_weather", W1_ARGS), ("now", {})],
        None,
        "missing_tool_call_close",
    ),
    (
        "cut_value_truncated",
        "Writing.\n" + CUT_WRITE,
        True,
        "Writing.\n",
        [("write_file", {"path": "out.txt", "content": "line one\nline tw"})],
        None,
        "cut_parameter_value",
    ),
    (
        "cut_value_partial_closer",
        CUT_WRITE + "o\n</param",
        True,
        "",
        [("write_file", {"path": "out.txt", "content": "line one\nline two"})],
        None,
        "cut_parameter_value",
    ),
    ("cut_value_not_truncated", CUT_WRITE, False, None, [], "malformed_structure", None),
    (
        "cut_first_parameter_stays_text",
        "<tool_call>\n<function=write_file>\n<parameter=path>\nout.t",
        True,
        None,
        [],
        "malformed_structure",
        None,
    ),
    (
        "cut_parameter_opener",
        "<tool_call>\n<function=write_file>\n<parameter=path>\nout.txt\n</parameter>\n<parameter=cont",
        True,
        "",
        [("write_file", {"path": "out.txt"})],
        None,
        "cut_parameter_opener",
    ),
    ("cut_before_any_parameter", "<tool_call>\n<function=get_weather>\n", True, None, [], "malformed_structure", None),
    ("cut_first_parameter_opener", "<tool_call>\n<function=now>\n<parameter=ci", True, None, [], "malformed_structure",
     None),
    (
        "dropped_lt",
        W1.replace("<function=", "function="),
        False,
        "",
        [("get_weather", W1_ARGS)],
        None,
        "corrupted_function_opener",
    ),
    (
        "leaked_im_start",
        W1.replace("<function=", "<|im_start|>function="),
        False,
        "",
        [("get_weather", W1_ARGS)],
        None,
        "corrupted_function_opener",
    ),
    (
        "dropped_function_keyword",
        W1.replace("<function=", "<="),
        False,
        "",
        [("get_weather", W1_ARGS)],
        None,
        "corrupted_function_opener",
    ),
    (
        "im_start_dropped_keyword",
        W1.replace("<function=", "<|im_start|>="),
        False,
        "",
        [("get_weather", W1_ARGS)],
        None,
        "corrupted_function_opener",
    ),
    (
        "doubled_lt",
        W1.replace("<function=", "<<function="),
        False,
        "",
        [("get_weather", W1_ARGS)],
        None,
        "corrupted_function_opener",
    ),
    (
        "missing_gt_newline",
        W1.replace("<function=get_weather>", "<function=get_weather"),
        False,
        "",
        [("get_weather", W1_ARGS)],
        None,
        "missing_function_gt",
    ),
    (
        "missing_gt_space",
        W1.replace("<function=get_weather>\n", "<function=get_weather  "),
        False,
        "",
        [("get_weather", W1_ARGS)],
        None,
        "missing_function_gt",
    ),
    ("missing_gt_then_text", W1.replace("<function=get_weather>\n", "<function=get_weather x>\n"), False, None, [],
     "invalid_tool_name", None),
    (
        "undeclared_kept",
        call("launch", ("target", "moon"), ("n", "3")),
        False,
        "",
        [("launch", {"target": "moon", "n": 3})],
        None,
        "undeclared_tool",
    ),
    ("duplicate_first_call_still_fails", call("get_weather", ("city", "A"), ("city", "B")), False, None, [],
     "duplicate_parameter", None),
    ("invalid_name_still_fails", call("a b", ("x", "1")), False, None, [], "invalid_tool_name", None),
]


@pytest.mark.parametrize(
    "cid,text,truncated,content,calls,reason,recovery", TOLERANT_CASES, ids=[c[0] for c in TOLERANT_CASES]
)
def test_tolerant(cid, text, truncated, content, calls, reason, recovery):
    r = parse_tool_calls(text, TOOLS, tolerant=True, truncated=truncated)
    assert r.fallback_reason == reason
    assert r.content == (text if content is None else content)
    assert [(c.name, c.arguments) for c in r.calls] == calls
    if recovery:
        assert recovery in r.recoveries


def test_strict_rejects_every_tolerant_recovery():
    for cid, text, truncated, *_ in TOLERANT_CASES:
        r = parse_tool_calls(text, TOOLS, truncated=truncated)
        assert r.calls == [] and r.content == text and r.fallback_reason is not None, cid


def test_no_tools_declared_accepts_any_name_untyped():
    r = parse_tool_calls(call("anything", ("a", "1"), ("b", "hi"), ("c", "true")))
    assert [(c.name, c.arguments) for c in r.calls] == [("anything", {"a": 1, "b": "hi", "c": True})]


def test_argument_order_preserved_in_json():
    r = parse_tool_calls(call("get_weather", ("metric", "false"), ("city", "Rome"), ("days", "2")), TOOLS)
    assert r.calls[0].arguments_json == '{"metric": false, "city": "Rome", "days": 2}'
    assert list(r.calls[0].arguments) == ["metric", "city", "days"]


def test_arguments_json_keeps_unicode():
    r = parse_tool_calls(call("get_weather", ("city", "Zürich 東京")), TOOLS)
    assert r.calls[0].arguments_json == '{"city": "Zürich 東京"}'


def test_empty_non_string_value_omitted_string_kept():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n</parameter>\n<parameter=days>\n\n</parameter>\n"
            "</function>\n</tool_call>")
    r = parse_tool_calls(text, TOOLS)
    assert r.calls[0].arguments == {"city": ""}


def test_anthropic_and_flat_tool_styles():
    anth = [{"name": "calc", "input_schema": {"type": "object", "properties": {"x": {"type": "number"}, "s": {"type": "string"}}}}]
    flat = [{"type": "function", "name": "calc", "parameters": anth[0]["input_schema"]}]
    for tools in (anth, flat):
        assert set(tool_schemas(tools)) == {"calc"}
        r = parse_tool_calls(call("calc", ("x", "2.5"), ("s", "2.5")), tools)
        assert r.calls[0].arguments == {"x": 2.5, "s": "2.5"}
    assert parse_tool_calls(call("other"), anth).fallback_reason == "undeclared_tool"


INT = {"type": "integer"}
_OMIT = object()
CONVERT_CASES = [
    ({"type": "string"}, "  5 ", "  5 "),
    ({"type": "string"}, "true", "true"),
    (INT, "5", 5),
    (INT, " 42 ", 42),
    (INT, "abc", "abc"),  # mismatch, not JSON -> string
    (INT, "[1]", [1]),  # mismatch, valid JSON -> kept
    (INT, "2.5", 2.5),
    (INT, "", _OMIT),
    ({"type": "number"}, "1e3", 1000.0),
    ({"type": "number"}, "NaN", "NaN"),
    ({"type": "boolean"}, "True", True),
    ({"type": "boolean"}, "FALSE", False),
    ({"type": "boolean"}, "yes", "yes"),
    ({"type": "object"}, '{"b": 1, "a": [true, null]}', {"b": 1, "a": [True, None]}),
    ({"type": "array"}, "[1, \"x\"]", [1, "x"]),
    ({"type": "array"}, "[1, 2", "[1, 2"),
    ({"type": "null"}, "None", None),
    ({"type": ["integer", "null"]}, "null", None),
    ({"type": ["integer", "null"]}, "7", 7),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "5", 5),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "five", "five"),
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "[5]", "[5]"),  # array not declared -> raw string
    ({"anyOf": [{"type": "string"}, {"type": "integer"}]}, "", ""),
    ({"oneOf": [{"type": "boolean"}, {"type": "object"}]}, "tRuE", True),
    ({"oneOf": [{"type": "boolean"}, {"type": "object"}]}, '{"k": "v"}', {"k": "v"}),
    ({"enum": ["a", "b"]}, "5", "5"),  # enum of strings -> string type
    ({"type": "string", "enum": ["Paris", "Rome"]}, "  Rome\n\t", "Rome"),  # whitespace around tokens is layout
    ({"type": "string", "pattern": "^[a-z]+$"}, "\n abc \n", "abc"),
    ({"type": "string"}, " keep  ", " keep  "),  # free text keeps its spaces
    ({"enum": [1, 2]}, "2", 2),
    ({"description": "untyped"}, '{"a": 1}', {"a": 1}),
    ({"description": "untyped"}, "hello world", "hello world"),
    ({"description": "untyped"}, "True", "True"),
    (None, "3", 3),
    (None, "", ""),
]


@pytest.mark.parametrize("schema,raw,expected", CONVERT_CASES)
def test_convert_value(schema, raw, expected):
    got = convert_value(raw, schema)
    if expected is _OMIT:
        assert got is not None and not isinstance(got, (str, int, float, list, dict))
    else:
        assert got == expected and type(got) is type(expected)


def test_ids():
    cid = new_call_id()
    assert re.fullmatch(r"call_[0-9a-f]{24}", cid)
    assert anthropic_tool_id(cid) == "toolu_" + cid[5:]
    assert re.fullmatch(r"toolu_[0-9a-f]{24}", anthropic_tool_id())
    assert ToolCall("f", {}).id != ToolCall("f", {}).id
    assert ToolCall("f", {"a": 1}).arguments_json == '{"a": 1}'


# ----------------------------------------------------------------------------- streaming


def run_stream(chunks, tolerant=False, truncated=False, tools=TOOLS):
    dec = ToolCallStreamDecoder(tools, tolerant=tolerant)
    events = []
    for ch in chunks:
        events += dec.feed(ch)
    events += dec.finish(truncated)
    content = "".join(e[1] for e in events if e[0] == "content")
    calls = [(e[1].name, e[1].arguments_json) for e in events if e[0] == "tool_call"]
    return dec, events, content, calls


def test_stream_holds_only_marker_prefix():
    dec = ToolCallStreamDecoder(TOOLS)
    assert dec.feed("Hello <to") == [("content", "Hello ")]
    assert dec.held_back == "<to" and dec.holding
    assert dec.feed("ols are") == [("content", "<tools are")]
    assert not dec.holding
    assert dec.feed(" here <") == [("content", " here ")]
    assert dec.feed("tool_call>\n<function=now>") == []
    assert dec.marker_seen and dec.held_back == "<tool_call>\n<function=now>"
    assert dec.feed("\n</function>\n</tool_call>") == []  # strict: decided at finish
    ev = dec.finish()
    assert [(k, v.name) for k, v in ev] == [("tool_call", "now")]
    assert dec.result.content == "Hello <tools are here " and dec.result.fallback_reason is None


def test_stream_strict_fallback_emits_region_as_content():
    text = "A " + W1 + " trailing"
    dec, events, content, calls = run_stream([text[:5], text[5:]])
    assert calls == [] and content == text
    assert events[-1] == ("content", text[2:])
    assert dec.result.fallback_reason == "trailing_content"


def test_stream_tolerant_emits_call_before_finish():
    dec = ToolCallStreamDecoder(TOOLS, tolerant=True)
    ev = dec.feed(W1[:-3])
    assert ev == []
    ev = dec.feed(W1[-3:] + "\n<tool_call>\n<function=no")
    assert [(k, v.name, v.arguments) for k, v in ev] == [("tool_call", "get_weather", W1_ARGS)]
    first_id = ev[0][1].id
    ev = dec.feed("w>\n</function>\n</tool_call>")
    assert [v.name for _, v in ev] == ["now"]
    assert dec.finish() == []
    assert [c.name for c in dec.result.calls] == ["get_weather", "now"]
    assert dec.result.calls[0].id == first_id


def test_stream_finish_without_marker():
    dec = ToolCallStreamDecoder()
    assert dec.feed("x <tool_c") == [("content", "x ")]
    assert dec.finish() == [("content", "<tool_c")]
    assert dec.result.content == "x <tool_c" and not dec.result.marker_seen


def oneshot(text, tolerant, truncated):
    r = parse_tool_calls(text, TOOLS, tolerant=tolerant, truncated=truncated)
    return r.content, [(c.name, c.arguments_json) for c in r.calls], r.fallback_reason


def split_at(text, cuts):
    cuts = sorted({c % (len(text) + 1) for c in cuts})
    bounds = [0] + cuts + [len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


ALL_TEXTS = [c[1] for c in STRICT_CASES] + [c[1] for c in TOLERANT_CASES]

FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<function=get_weather>", "<function=now>", "<function=write_file>",
    "function=now>", "<|im_start|>", "<=now>", "<", ">", "</function>", "<parameter=city>",
    "<parameter=content>", "<parameter=days>", "</parameter>", "\n", " ", "3", "Paris", "True", "x",
    "</think>", "<tool_c", "</param", "</func",
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.sampled_from(ALL_TEXTS),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
    tolerant=st.booleans(),
    truncated=st.booleans(),
)
def test_stream_equals_oneshot_table_texts(text, cuts, tolerant, truncated):
    dec, _, content, calls = run_stream(split_at(text, cuts), tolerant, truncated)
    want = oneshot(text, tolerant, truncated)
    assert (content, calls) == want[:2]
    assert (dec.result.content, dec.result.fallback_reason) == (want[0], want[2])
    assert [(c.name, c.arguments_json) for c in dec.result.calls] == want[1]


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12),
    tolerant=st.booleans(),
    truncated=st.booleans(),
)
def test_stream_equals_oneshot_fuzz(parts, cuts, tolerant, truncated):
    text = "".join(parts)
    dec, _, content, calls = run_stream(split_at(text, cuts), tolerant, truncated)
    want = oneshot(text, tolerant, truncated)
    assert (content, calls, dec.result.fallback_reason) == want


@settings(max_examples=40, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_stream_equals_oneshot_structured_calls(cuts):
    text = "Plan:\n" + call("write_file", ("path", "a"), ("content", XML_PAYLOAD + MARKERS_PAYLOAD)) + "\n" + W1
    dec, _, content, calls = run_stream(split_at(text, cuts), tolerant=True)
    assert content == "Plan:\n"
    assert [n for n, _ in calls] == ["write_file", "get_weather"]
    assert json.loads(calls[0][1])["content"] == XML_PAYLOAD + MARKERS_PAYLOAD


VALUE_BITS = ["text", "\n", " ", "</tool_call>", "</function>", "<tool_call>", "<parameter=k>", "</parameter>", "True", "7", "<"]


@st.composite
def call_regions(draw):
    """Mostly well-formed call regions with hostile values, optionally corrupted and cut."""
    text = draw(st.sampled_from(["", "Sure.\n\n", "a <tool "]))
    for n in range(draw(st.integers(min_value=1, max_value=3))):
        name = draw(st.sampled_from(["get_weather", "write_file", "now", "undeclared"]))
        opener = draw(st.sampled_from(["<function=", "<function=", "function=", "<<function=", "<|im_start|>="]))
        text += ("\n" if n else "") + "<tool_call>\n" + opener + name + draw(st.sampled_from([">\n", ">", "\n"]))
        for pname in draw(st.lists(st.sampled_from(["city", "days", "content", "metric"]), max_size=3)):
            value = "".join(draw(st.lists(st.sampled_from(VALUE_BITS), max_size=6)))
            text += f"<parameter={pname}>\n{value}\n</parameter>\n"
        text += draw(st.sampled_from(["</function>\n</tool_call>", "</function>\n</tool_call>", "</tool_call>", "</function>", ""]))
    text += draw(st.sampled_from(["", "", "\n", "\nbye"]))
    if draw(st.booleans()):
        text = text[: draw(st.integers(min_value=0, max_value=len(text)))]
    return text


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=call_regions(),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=15),
    tolerant=st.booleans(),
    truncated=st.booleans(),
)
def test_stream_equals_oneshot_generated_regions(text, cuts, tolerant, truncated):
    dec, _, content, calls = run_stream(split_at(text, cuts), tolerant, truncated)
    want = oneshot(text, tolerant, truncated)
    assert (content, calls, dec.result.fallback_reason) == want


def test_stream_does_not_emit_call_closed_only_inside_a_value():
    # "</tool_call>" arrives inside a value; the call is still open and must not be emitted yet.
    dec = ToolCallStreamDecoder(TOOLS, tolerant=True)
    head = "<tool_call>\n<function=write_file>\n<parameter=content>\nx </tool_call> y\n</parameter>\n"
    assert dec.feed(head) == []
    assert dec.feed("<parameter=path>\np\n</parameter>\n</function>\n</tool_call>")[0][1].arguments == {
        "content": "x </tool_call> y",
        "path": "p",
    }
