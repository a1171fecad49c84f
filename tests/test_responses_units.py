"""Pieces of the agent-client work without a server: system-message folding, Responses API item
parsing, tools and the constraint spec, the SSE event builder, the response store, the context
overflow wording of each API."""
import json

import pytest

from ninfer_mlc.server import anthropic_api
from ninfer_mlc.server.errors import APIError, ContextLengthExceeded, error_body, from_engine
from ninfer_mlc.server.generation import Done, Out
from ninfer_mlc.server.response_store import ResponseStore
from ninfer_mlc.server.responses_api import ResponseBuilder, ResponsesRequest, parse_reasoning
from ninfer_mlc.server.responses_items import (constraint_spec, decrypt_reasoning, encrypt_reasoning,
                                               items_to_messages, normalize_input, parse_tools)
from ninfer_mlc.server.system_fold import fold_system_messages
from ninfer_mlc.runtime.errors import ContextTooLong, InvalidRequest
from ninfer_mlc.server.generation import ChatInputs
from ninfer_mlc.tool_calls import ToolCall


# ---- system folding -----------------------------------------------------------------------------
def test_fold_keeps_one_leading_system_and_appends_later_ones_to_the_user_turn_before():
    msgs = [{"role": "system", "content": "A"}, {"role": "system", "content": "B"},
            {"role": "user", "content": "q1"}, {"role": "system", "content": "env"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    assert fold_system_messages(msgs) == [
        {"role": "system", "content": "A\n\nB"},
        {"role": "user", "content": "q1\n\n<system-reminder>\nenv\n</system-reminder>"},
        {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]


def test_fold_prepends_to_the_next_user_turn_or_stands_alone():
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
            {"role": "system", "content": "s1"}, {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "b"}, {"role": "system", "content": "s2"}]
    out = fold_system_messages(msgs)
    assert out[2] == {"role": "user", "content": "<system-reminder>\ns1\n</system-reminder>\n\nq2"}
    assert out[-1] == {"role": "user", "content": "<system-reminder>\ns2\n</system-reminder>"}
    assert [m["role"] for m in out] == ["user", "assistant", "user", "assistant", "user"]
    tool_then_sys = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": []},
                     {"role": "tool", "content": "r"}, {"role": "system", "content": "s"}]
    assert fold_system_messages(tool_then_sys)[-1]["role"] == "user"


def test_claude_code_system_message_renders_inside_the_user_turn_with_a_stable_prefix(server):
    """Claude Code's environment block (a system message after the first user turn) renders as a
    reminder at the end of that user turn, on the first request and on the --continue one."""
    from ninfer_mlc.server.generation import render_prompt

    def req(messages):
        inp = anthropic_api.parse_request({"model": "m", "max_tokens": 4, "system": "SYS", "messages": messages})[0]
        text, _ = render_prompt(server.state, inp)
        return text, server.state.tok.encode(text, add_special_tokens=False).ids

    first = [{"role": "user", "content": [{"type": "text", "text": "say hi"}]},
             {"role": "system", "content": [{"type": "text", "text": "# Environment", "cache_control": {}}]}]
    t1, ids1 = req(first)
    assert t1.startswith("<|im_start|>system\nSYS<|im_end|>\n<|im_start|>user\nsay hi\n\n<system-reminder>\n"
                         "# Environment\n</system-reminder><|im_end|>\n<|im_start|>assistant\n")
    assert t1.count("<|im_start|>system") == 1
    t2, ids2 = req(first + [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}])
    opener = "<|im_start|>assistant\n"
    head = t1[:t1.rindex(opener) + len(opener)]
    assert t2.startswith(head)
    n = len(server.state.tok.encode(head, add_special_tokens=False).ids)
    assert ids2[:n] == ids1[:n] and n > 0.9 * len(ids1)


# ---- Anthropic fields ---------------------------------------------------------------------------
def test_anthropic_accepts_every_documented_value():
    tools = [{"name": "Read", "input_schema": {"type": "object"}, "strict": True,
              "cache_control": {"type": "ephemeral"}},
             {"name": "Later", "input_schema": {"type": "object"}, "defer_loading": True},
             {"type": "web_search_20250305", "name": "web_search"}]
    body = {"model": "m", "max_tokens": 4, "tools": tools, "messages": [{"role": "user", "content": "hi"}],
            "thinking": {"type": "adaptive", "display": "updates"}, "context_management": {"edits": []},
            "output_config": {"effort": "xhigh", "format": {"type": "json_schema", "schema": {"type": "object"}}}}
    inp, _, _, omit = anthropic_api.parse_request(body)
    assert [t["function"]["name"] for t in inp.tools] == ["Read"]  # deferred + server tools left out
    assert inp.enable_thinking is None and not omit  # adaptive: the server default decides
    c = inp.constraint  # the format, with the strict tools the grammar also covers
    assert (c["type"], c["schema"], c["strict"]) == ("json_schema", {"type": "object"}, True)
    assert [t["function"]["name"] for t in c["tools"]] == ["Read"]
    assert inp.template_kwargs == {"reasoning_effort": "xhigh"}
    # a tool search result loads the deferred tool
    body["messages"] = [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                                           "input": {}}]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                            {"type": "tool_reference", "tool_name": "Later"}]}]}]
    inp = anthropic_api.parse_request(body)[0]
    assert [t["function"]["name"] for t in inp.tools] == ["Read", "Later"]
    assert inp.messages[-1]["content"] == "Tool loaded: Later"


def test_anthropic_thinking_default_follows_the_real_api():
    body = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert anthropic_api.parse_request(body)[0].enable_thinking is False
    assert anthropic_api.parse_request(body, default_thinking=None)[0].enable_thinking is None


# ---- errors -------------------------------------------------------------------------------------
def test_context_overflow_is_worded_as_each_api_words_it():
    e = from_engine(ContextTooLong(9000, 8191))
    assert isinstance(e, ContextLengthExceeded) and e.status == 400 and e.code == "context_length_exceeded"
    a = error_body("/v1/messages", e)
    assert a == {"type": "error", "error": {"type": "invalid_request_error",
                                            "message": "prompt is too long: 9000 tokens > 8191 maximum"}}
    o = error_body("/v1/chat/completions", e)["error"]
    assert o["code"] == "context_length_exceeded" and o["type"] == "invalid_request_error"
    assert o["message"].startswith("This model's maximum context length is 8192 tokens. However, your messages "
                                   "resulted in 9000 tokens.")
    r = error_body("/v1/responses", e)["error"]
    assert r["code"] == "context_length_exceeded" and "exceeds the context window" in r["message"]
    assert from_engine(InvalidRequest("the prompt is empty")).message_for("/v1/messages") == "the prompt is empty"


# ---- Responses: items, tools, constraint --------------------------------------------------------
def test_items_become_one_assistant_turn_per_reply():
    items = normalize_input([
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "D"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "U"}]},
        {"type": "reasoning", "summary": [], "encrypted_content": encrypt_reasoning("think")},
        {"type": "function_call", "call_id": "c1", "name": "spawn", "namespace": "agents", "arguments": '{"n": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "done"}]},
        {"type": "message", "role": "user", "content": "next"},
    ])
    assert all(isinstance(i["id"], str) for i in items)
    assert items_to_messages(items, "INSTR") == [
        {"role": "system", "content": "INSTR"}, {"role": "system", "content": "D"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "", "reasoning_content": "think",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "agents.spawn", "arguments": {"n": 1}}}]},
        {"role": "tool", "content": "ok", "tool_call_id": "c1"},
        {"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]
    assert decrypt_reasoning(encrypt_reasoning("é")) == "é" and decrypt_reasoning("gAAAA-other") is None
    with pytest.raises(APIError) as ei:
        items_to_messages(normalize_input([{"type": "message", "role": "user",
                                            "content": [{"type": "input_image", "image_url": "x"}]}]))
    assert ei.value.param == "input[0].content[0].type"


def test_tools_namespaces_custom_and_hosted():
    t = parse_tools([
        {"type": "function", "name": "exec", "strict": True, "parameters": {"type": "object"}},
        {"type": "namespace", "name": "agents", "description": "sub-agents",
         "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object"}}]},
        {"type": "custom", "name": "apply_patch", "description": "patch", "format": {"type": "grammar"}},
        {"type": "web_search", "external_web_access": False}])
    assert [x["function"]["name"] for x in t.tools] == ["exec", "agents.spawn", "apply_patch"]
    assert t.tools[0]["function"]["strict"] is True
    assert t.output_name("agents.spawn") == ("agents", "spawn") and t.output_name("exec") == (None, "exec")
    assert t.custom == {"apply_patch"} and t.ignored == ["web_search"]


@pytest.mark.parametrize("choice,text,want", [
    (None, None, (True, None)),
    ("none", None, (False, None)),
    ("required", None, (True, {"type": "tool_call", "mode": "required"})),
    ({"type": "function", "name": "exec"}, None, (True, {"type": "tool_call", "mode": "named", "name": "exec"})),
    ({"type": "allowed_tools", "mode": "required", "tools": []}, None,
     (True, {"type": "tool_call", "mode": "required"})),
    ({"type": "web_search"}, None, (True, None)),
    ("auto", {"format": {"type": "json_object"}}, (True, {"type": "json_object"})),
    ("auto", {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "strict": True}},
     (True, {"type": "json_schema", "schema": {"type": "object"}, "strict": True, "name": "x"})),
    ("auto", {"format": {"type": "text"}, "verbosity": "low"}, (True, None)),
])
def test_constraint_spec(choice, text, want):
    tools = parse_tools([{"type": "function", "name": "exec"}])
    assert constraint_spec(choice, text, tools) == want


def test_constraint_spec_errors():
    tools = parse_tools([{"type": "function", "name": "exec"}])
    for choice, text, param in (({"type": "function", "name": "nope"}, None, "tool_choice.name"),
                                ("sometimes", None, "tool_choice"),
                                (None, {"format": {"type": "yaml"}}, "text.format.type")):
        with pytest.raises(APIError) as ei:
            constraint_spec(choice, text, tools)
        assert ei.value.param == param


def test_reasoning_effort_rule():
    assert parse_reasoning(None)[0] is None
    assert parse_reasoning({"effort": "none"})[0] is False and parse_reasoning({"effort": "minimal"})[0] is False
    assert parse_reasoning({"effort": "high", "summary": "auto"})[:2] == (None, True)


# ---- Responses: event builder -------------------------------------------------------------------
def _req(summary=False, encrypted=False, tools=None):
    table = parse_tools(tools)
    return ResponsesRequest(ChatInputs(messages=[]), "tiny", True, True, [], [], table, summary, encrypted, {})


def _events(raw: list[bytes]) -> list[dict]:
    out = []
    for b in raw:
        name, data = b.decode().strip().split("\n")
        assert name == "event: " + json.loads(data[len("data: "):])["type"]
        out.append(json.loads(data[len("data: "):]))
    return out


def test_builder_event_order_text_reasoning_and_calls():
    tools = [{"type": "namespace", "name": "agents", "tools": [{"type": "function", "name": "spawn"}]}]
    b = ResponseBuilder("resp_1", _req(encrypted=True, tools=tools), 1)
    raw = b.start()
    for o in (Out("reasoning", "hm"), Out("reasoning", "m"), Out("content", "Hi"), Out("content", "!"),
              Out("tool_call", call=ToolCall("agents.spawn", {"n": 2}, id="call_9"))):
        raw += b.event(o)
    raw += b.done(Done("tool_calls", {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15,
                                      "cached_tokens": 4, "reasoning_tokens": 2}, {}))
    ev = _events(raw)
    assert [e["sequence_number"] for e in ev] == list(range(len(ev)))
    assert [e["type"] for e in ev] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    final = ev[-1]["response"]
    assert final["status"] == "completed" and final["usage"]["input_tokens_details"]["cached_tokens"] == 4
    rs, msg, call = final["output"]
    assert decrypt_reasoning(rs["encrypted_content"]) == "hmm" and rs["content"][0]["text"] == "hmm"
    assert msg["content"][0]["text"] == "Hi!" and msg["status"] == "completed"
    assert (call["name"], call["namespace"], call["call_id"], json.loads(call["arguments"])) == \
        ("spawn", "agents", "call_9", {"n": 2})
    # the stored history replays as the same assistant turn
    replay = items_to_messages([{"type": "message", "role": "user", "content": "q", "id": "m"}] + final["output"])
    assert replay[1] == {"role": "assistant", "content": "Hi!", "reasoning_content": "hmm", "tool_calls": [
        {"id": "call_9", "type": "function", "function": {"name": "agents.spawn", "arguments": {"n": 2}}}]}


def test_builder_summary_mode_custom_tool_and_incomplete():
    b = ResponseBuilder("resp_2", _req(summary=True, tools=[{"type": "custom", "name": "apply_patch"}]), 1)
    raw = b.start() + b.event(Out("reasoning", "x"))
    raw += b.event(Out("tool_call", call=ToolCall("apply_patch", {"input": "*** Begin Patch"}, id="call_1")))
    raw += b.done(Done("length", {}, {}))
    ev = _events(raw)
    types = [e["type"] for e in ev]
    assert "response.reasoning_summary_part.added" in types and "response.reasoning_summary_text.delta" in types
    assert "response.custom_tool_call_input.done" in types and types[-1] == "response.incomplete"
    out = ev[-1]["response"]["output"]
    assert out[0]["summary"] == [{"type": "summary_text", "text": "x"}]
    assert out[1]["type"] == "custom_tool_call" and out[1]["input"] == "*** Begin Patch"
    assert ev[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_store_is_bounded():
    s = ResponseStore(max_entries=2, max_bytes=10_000)
    for i in range(3):
        s.put({"id": f"r{i}"}, [], [])
    assert len(s) == 2 and s.get("r0") is None and s.get("r2") is not None
    assert s.delete("r2") and not s.delete("r2") and s.get("r2") is None
    s.put({"id": "big", "x": "y" * 20_000}, [], [])  # alone over the byte bound: nothing is kept
    assert len(s) == 0 and s.bytes == 0
