"""Constrained decoding through the real server (tiny random model) with the official SDKs.

The random model writes whatever the grammar lets through, so a forced tool call that parses with
schema-valid arguments shows the constraint at work. Schemas use enums, booleans and bounded
integers so generation ends (finish_reason stop) well inside max_tokens; validity is asserted
whenever it does.
"""
import json

import anthropic
import jsonschema
import openai
import pytest

from ninfer_mlc.server import anthropic_api, openai_api
from ninfer_mlc.server.constraints import openai_constraint, openai_response_format
from ninfer_mlc.server.errors import APIError

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "metric": {"type": "boolean"}}, "required": ["city", "days"]}
PING = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
OA_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
            {"type": "function", "function": {"name": "ping", "parameters": PING}}]
AN_TOOLS = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER},
            {"name": "ping", "input_schema": PING}]
ANSWER = {"type": "object", "properties": {"verdict": {"enum": ["sunny", "rainy"]}, "confidence": {
    "type": "integer", "minimum": 0, "maximum": 100}}, "required": ["verdict", "confidence"],
          "additionalProperties": False}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False}}
SCHEMAS = {"get_weather": WEATHER, "ping": PING}


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def an(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def oa_chat(oa, **kw):
    base = dict(model="", messages=ASK, max_tokens=160, temperature=0, extra_body=NO_THINK)
    return oa.chat.completions.create(**{**base, **kw})


def an_msg(an, **kw):
    base = dict(model="m", max_tokens=160, messages=ASK, thinking={"type": "disabled"},
                extra_body={"temperature": 0})
    return an.messages.create(**{**base, **kw})


def check_openai_calls(choice, names):
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and not (choice.message.content or "").strip()
    for c in calls:
        assert c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    return calls


def check_anthropic_calls(msg, names):
    assert msg.stop_reason == "tool_use", msg
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and all(b.type == "tool_use" for b in msg.content)
    for b in uses:
        assert b.name in names
        jsonschema.validate(b.input, SCHEMAS[b.name])
    return uses


# ---- OpenAI ---------------------------------------------------------------------------------------
def test_openai_tool_choice_required(oa):
    r = oa_chat(oa, tools=OA_TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(check_openai_calls(r.choices[0], {"get_weather", "ping"})) == 1


def test_openai_named_tool_choice_stream(oa):
    kw = dict(tools=OA_TOOLS, tool_choice={"type": "function", "function": {"name": "ping"}})
    full = oa_chat(oa, **kw)
    calls = check_openai_calls(full.choices[0], {"ping"})
    assert len(calls) == 1
    args, finish = "", None
    for ch in oa_chat(oa, stream=True, **kw):
        if ch.choices:
            for tc in ch.choices[0].delta.tool_calls or []:
                assert tc.function.name in (None, "ping")
                args += tc.function.arguments or ""
            finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and json.loads(args) == json.loads(calls[0].function.arguments)


def test_openai_strict_tools_stay_optional(oa):
    """tool_choice auto with a strict tool: text stays allowed, a call would follow the schema."""
    tools = [{"type": "function", "function": {**OA_TOOLS[0]["function"], "strict": True}}]
    r = oa_chat(oa, tools=tools, max_tokens=24)
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length", "tool_calls")
    for c in ch.message.tool_calls or []:
        jsonschema.validate(json.loads(c.function.arguments), WEATHER)


def test_openai_response_format_json_schema_and_object(oa):
    r = oa_chat(oa, response_format={"type": "json_schema", "json_schema": {
        "name": "verdict", "schema": ANSWER, "strict": True}})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)
    r = oa_chat(oa, response_format={"type": "json_object"}, max_tokens=200)
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # the random model may wander inside a free string: still a JSON prefix
        assert r.choices[0].message.content.lstrip().startswith("{")


def test_openai_invalid_schemas_are_400s_naming_the_field(oa):
    with pytest.raises(openai.BadRequestError) as ei:
        oa_chat(oa, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"a": {"type": "strng"}}}}})
    assert ei.value.param == "response_format" and "strng" in str(ei.value)
    bad = OA_TOOLS + [{"type": "function", "function": {"name": "bad", "parameters": {
        "type": "object", "properties": {"x": {"type": "string", "pattern": "(("}}}}}]
    with pytest.raises(openai.BadRequestError) as ei:
        oa_chat(oa, tools=bad, tool_choice="required")
    assert ei.value.param == "tools[2]"


def test_openai_tool_loop(oa):
    """Forced call -> tool result -> an answer in the response format."""
    first = oa_chat(oa, tools=OA_TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = check_openai_calls(first.choices[0], {"get_weather"})[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear", "temp_c": 21}'}]
    second = oa_chat(oa, messages=history, tools=OA_TOOLS, tool_choice="none", response_format={
        "type": "json_schema", "json_schema": {"name": "verdict", "schema": ANSWER}})
    assert second.choices[0].finish_reason == "stop" and not second.choices[0].message.tool_calls
    jsonschema.validate(json.loads(second.choices[0].message.content), ANSWER)


def test_openai_forced_call_after_reasoning(server_engine):
    """Thinking on: reasoning stays free; the call follows </think> (budget closes it quickly)."""
    from conftest import start_test_server

    srv, _ = start_test_server(server_engine, "--default-thinking-budget", "12")
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.chat.completions.create(model="", messages=ASK, max_tokens=200, temperature=0, tools=OA_TOOLS,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
        ch = r.choices[0]
        assert ch.message.model_extra.get("reasoning_content")
        check_openai_calls(ch, {"get_weather"})
    finally:
        srv.stop()


# ---- Anthropic ------------------------------------------------------------------------------------
def test_anthropic_tool_choice_any_and_tool(an):
    m = an_msg(an, tools=AN_TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert len(check_anthropic_calls(m, {"get_weather", "ping"})) == 1
    m = an_msg(an, tools=AN_TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    assert [b.name for b in check_anthropic_calls(m, {"get_weather"})] == ["get_weather"]


def test_anthropic_forced_tool_stream(an):
    kw = dict(tools=AN_TOOLS, tool_choice={"type": "tool", "name": "ping"})
    with an.messages.stream(**{**dict(model="m", max_tokens=160, messages=ASK, thinking={"type": "disabled"},
                                      extra_body={"temperature": 0}), **kw}) as s:
        final = s.get_final_message()
    uses = check_anthropic_calls(final, {"ping"})
    assert uses[0].input == an_msg(an, **kw).content[0].input


def test_anthropic_strict_tool_and_output_format(an):
    tools = [{**AN_TOOLS[0], "strict": True}]
    m = an_msg(an, tools=tools, max_tokens=24)
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    for b in m.content:
        if b.type == "tool_use":
            jsonschema.validate(b.input, WEATHER)
    m = an_msg(an, extra_body={"temperature": 0, "output_config": {"format": {"type": "json_schema",
                                                                              "schema": ANSWER}}})
    assert m.stop_reason == "end_turn"
    jsonschema.validate(json.loads(m.content[0].text), ANSWER)
    with pytest.raises(anthropic.BadRequestError) as ei:
        an_msg(an, extra_body={"output_config": {"format": {"type": "json_schema", "schema": {"type": "strng"}}}})
    assert "output_config.format" in str(ei.value)


def test_anthropic_tool_loop(an):
    first = an_msg(an, tools=AN_TOOLS, tool_choice={"type": "tool", "name": "get_weather"})
    use = check_anthropic_calls(first, {"get_weather"})[0]
    history = ASK + [{"role": "assistant", "content": [b.model_dump() for b in first.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": "clear sky, 21 C"}]}]
    second = an_msg(an, messages=history, tools=AN_TOOLS, tool_choice={"type": "none"},
                    extra_body={"temperature": 0, "output_config": {"format": {"type": "json_schema",
                                                                               "schema": ANSWER}}})
    assert second.stop_reason == "end_turn" and all(b.type == "text" for b in second.content)
    jsonschema.validate(json.loads(second.content[0].text), ANSWER)


# ---- request -> spec ------------------------------------------------------------------------------
def _oa_spec(**body):
    inp, _, _ = openai_api.parse_chat(None, {"messages": ASK, **body})
    return inp.constraint, inp.constraint_param


def _an_spec(**body):
    inp, _, _, _ = anthropic_api.parse_request({"max_tokens": 5, "messages": ASK, **body})
    return inp.constraint, inp.constraint_param


def test_openai_fields_to_specs():
    assert _oa_spec() == (None, "")
    assert _oa_spec(tools=OA_TOOLS) == (None, "")
    spec, param = _oa_spec(tools=OA_TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert param == "tool_choice" and spec == {"type": "tool_call", "mode": "required", "tools": OA_TOOLS,
                                               "parallel": False}
    spec, _ = _oa_spec(tools=OA_TOOLS, tool_choice={"type": "function", "name": "ping"})  # Responses form
    assert spec["mode"] == "named" and spec["name"] == "ping"
    spec, _ = _oa_spec(tools=OA_TOOLS, tool_choice={"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "ping"}}]}})
    assert spec["mode"] == "required" and [t["function"]["name"] for t in spec["tools"]] == ["ping"]
    spec, param = _oa_spec(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": ANSWER}})
    assert (spec, param) == ({"type": "json_schema", "schema": ANSWER, "strict": False}, "response_format")
    spec, _ = _oa_spec(response_format={"type": "json_object"}, tools=OA_TOOLS)  # answer or calls
    assert spec["type"] == "json_object" and spec["tools"] == OA_TOOLS
    assert _oa_spec(response_format={"type": "json_object"}, tools=OA_TOOLS, tool_choice="none")[0] == \
        {"type": "json_object"}
    strict = [{"type": "function", "function": {**OA_TOOLS[1]["function"], "strict": True}}]
    assert _oa_spec(tools=strict) == ({"type": "tool_call", "mode": "auto", "tools": strict, "parallel": True},
                                      "tools")
    assert _oa_spec(response_format={"type": "text"}) == (None, "")
    # the Responses API: flat function tools, flat named tool_choice, text.format
    flat = [{"type": "function", "name": "ping", "parameters": PING, "strict": True}]
    assert openai_constraint({"tool_choice": {"type": "function", "name": "ping"}}, flat, True,
                             "text.format")[0]["mode"] == "named"
    assert openai_constraint({"text": {"format": {"type": "json_schema", "name": "a", "schema": ANSWER}}}, flat, True,
                             "text.format") == ({"type": "json_schema", "schema": ANSWER, "strict": False,
                                                 "tools": flat, "parallel": True}, "text.format")
    assert openai_constraint({}, flat, True, "text.format") == (
        {"type": "tool_call", "mode": "auto", "tools": flat, "parallel": True}, "tools")
    assert openai_response_format({"type": "json_schema", "name": "a", "schema": ANSWER, "strict": True},
                                  "text.format") == {"type": "json_schema", "schema": ANSWER, "strict": True}
    with pytest.raises(APIError) as ei:
        openai_response_format({"type": "json_schema", "name": "a", "schema": 3}, "text.format")
    assert ei.value.param == "text.format.schema"


def test_anthropic_fields_to_specs():
    spec, param = _an_spec(tools=AN_TOOLS, tool_choice={"type": "any"})
    assert param == "tool_choice" and spec["mode"] == "required" and spec["parallel"] is True
    assert [t["function"]["name"] for t in spec["tools"]] == ["get_weather", "ping"]
    spec, _ = _an_spec(tools=AN_TOOLS, tool_choice={"type": "tool", "name": "ping"})
    assert spec["mode"] == "named" and spec["name"] == "ping"
    spec, param = _an_spec(output_config={"format": {"type": "json_schema", "schema": ANSWER}})
    assert (spec, param) == ({"type": "json_schema", "schema": ANSWER, "strict": True}, "output_config.format")
    spec, param = _an_spec(tools=[{**AN_TOOLS[1], "strict": True}])
    assert param == "tools" and spec["mode"] == "auto" and spec["tools"][0]["function"]["strict"] is True
    assert _an_spec(tools=AN_TOOLS) == (None, "")
    inp = anthropic_api.parse_request({"messages": ASK, "tools": AN_TOOLS, "tool_choice": {"type": "any"}},
                                      for_count=True)[0]
    assert inp.constraint is None  # count_tokens never compiles
    with pytest.raises(APIError):
        _an_spec(tool_choice={"type": "tool", "name": "ping"})


def test_compile_errors_become_400s_naming_the_field():
    from types import SimpleNamespace

    from ninfer_mlc.runtime.grammar import ConstraintError, GrammarUnavailable
    from ninfer_mlc.server.generation import compile_constraint

    def state_raising(err):
        def compile(spec, reasoning=False):
            raise err
        return SimpleNamespace(engine=SimpleNamespace(constraints=SimpleNamespace(compile=compile)))

    inp, _, _ = openai_api.parse_chat(None, {"messages": ASK, "tools": OA_TOOLS, "tool_choice": "required"})
    with pytest.raises(APIError) as ei:
        compile_constraint(state_raising(ConstraintError("bad", tool="ping")), inp, False)
    assert ei.value.status == 400 and ei.value.param == "tools[1]"
    with pytest.raises(APIError) as ei:
        compile_constraint(state_raising(ConstraintError("bad")), inp, False)
    assert ei.value.param == "tool_choice"
    with pytest.raises(APIError) as ei:  # serving without xgrammar: a clear 400, not a 500
        compile_constraint(state_raising(GrammarUnavailable("constrained decoding needs xgrammar")), inp, True)
    assert ei.value.status == 400 and ei.value.param == "tool_choice" and "xgrammar" in str(ei.value)
