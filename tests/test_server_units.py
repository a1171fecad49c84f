"""Server pieces without a server: scripted engine events through the streaming converter and
the OpenAI / Anthropic response builders (checked with the SDKs' own accumulators), request
parsing, flag errors, SSE response mechanics."""
import asyncio
import json

import numpy as np
import pytest

from ninfer_mlc.runtime.engine import Delta, Finished
from ninfer_mlc.runtime.errors import ContextTooLong, QueueFull, QueueTimeout
from ninfer_mlc.runtime.sampling import TokenLogprobs
from ninfer_mlc.server import anthropic_api, openai_api
from ninfer_mlc.server.errors import APIError, error_body, from_engine
from ninfer_mlc.server.generation import ChatStream, Collected, Done, Out
from ninfer_mlc.server.sse import SSEResponse

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
CALL_TEXT = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n" \
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"


def fin(reason="stop", n_out=10, stop_matched=None, error=None):
    return Finished(reason, {"prompt_tokens": 20, "completion_tokens": n_out, "total_tokens": 20 + n_out,
                             "cached_tokens": 4, "reasoning_tokens": 3},
                    {"cache_n": 4, "prompt_n": 16, "prompt_ms": 1.0, "predicted_n": n_out, "predicted_ms": 2.0},
                    stop_matched, error)


def chunks_of(text, sizes=(1, 3, 2, 5, 7)):
    out, i, k = [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        out.append(text[i:i + n])
        i, k = i + n, k + 1
    return out


def run_stream(text, *, started_in_think=True, tools=None, tolerant=False, finished=None, sizes=(1, 3, 2, 5, 7)):
    conv = ChatStream(started_in_think, tools, tolerant)
    events = []
    for piece in chunks_of(text, sizes):
        events += conv.feed(Delta(piece, [1]))
    events += conv.finish(finished or fin())
    return events


def collected(events):
    outs = [e for e in events if isinstance(e, Out)]
    done = events[-1]
    assert isinstance(done, Done) and all(not isinstance(e, Done) for e in events[:-1])
    return Collected("".join(o.text for o in outs if o.kind == "reasoning"),
                     "".join(o.text for o in outs if o.kind == "content"),
                     [o.call for o in outs if o.kind == "tool_call"], [], done)


# ---- ChatStream -------------------------------------------------------------------------
def test_reasoning_then_content():
    col = collected(run_stream("Let me think.\n</think>\n\nThe answer is 4."))
    assert (col.reasoning, col.content, col.calls) == ("Let me think.", "The answer is 4.", [])
    assert col.done.finish_reason == "stop" and col.done.usage["reasoning_tokens"] == 3  # the engine's count


@pytest.mark.parametrize("sizes", [(1,), (2, 9), (50,), (4, 1, 13)])
def test_tool_call_streamed_any_chunking(sizes):
    text = "I should check.\n</think>\n\n" + CALL_TEXT
    ev = run_stream(text, tools=TOOLS, sizes=sizes)
    col = collected(ev)
    assert col.reasoning == "I should check."
    assert col.content == ""  # whitespace before the call is not content
    assert [(c.name, c.arguments) for c in col.calls] == [("get_weather", {"city": "Paris", "days": 3})]
    assert col.done.finish_reason == "tool_calls"
    assert col.done.tool_parse["structured_call_count"] == 1


def test_content_before_tool_call_and_two_calls():
    text = "r</think>\n\nChecking both." + "\n\n" + CALL_TEXT + "\n" + CALL_TEXT.replace("Paris", "Rome")
    col = collected(run_stream(text, tools=TOOLS))
    assert col.content.startswith("Checking both.")
    assert [c.arguments["city"] for c in col.calls] == ["Paris", "Rome"]
    assert len({c.id for c in col.calls}) == 2


def test_strict_malformed_call_falls_back_to_content():
    bad = "r</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</function>\n</tool_call>"
    col = collected(run_stream(bad, tools=TOOLS))
    assert col.calls == [] and "<tool_call>" in col.content and col.done.finish_reason == "stop"
    assert col.done.tool_parse["fallback_reason"] == "malformed_structure"


def test_tolerant_recovers_truncated_call():
    cut = "r</think>\n\n" + CALL_TEXT[: CALL_TEXT.index("</parameter>\n<parameter=days>")] + "</parameter>\n"
    strict = collected(run_stream(cut, tools=TOOLS, finished=fin("length")))
    assert strict.calls == [] and strict.done.finish_reason == "length"
    tol = collected(run_stream(cut, tools=TOOLS, tolerant=True, finished=fin("length")))
    assert [c.arguments for c in tol.calls] == [{"city": "Paris"}]
    assert tol.done.finish_reason == "length"  # truncated: not a clean tool_calls stop


def test_no_tools_means_no_parsing():
    col = collected(run_stream("r</think>" + CALL_TEXT, tools=None))
    assert col.calls == [] and col.content == CALL_TEXT


def test_whitespace_only_answer_kept_without_calls():
    col = collected(run_stream("r</think>\n\n  ", sizes=(1,)))
    assert col.content == "  "


def test_logprobs_attach_to_emitted_pieces():
    conv = ChatStream(True, None, token_text=lambda t: f"<{t}>")
    lp = lambda t: TokenLogprobs(t, -0.5, 1, np.array([t, 9], np.int32), np.array([-0.5, -2.0], np.float32))  # noqa: E731
    ev = conv.feed(Delta("ab", [5], [lp(5)]))
    assert ev[0].logprobs[0]["token"] == "<5>" and ev[0].logprobs[0]["top_logprobs"][1]["token"] == "<9>"
    ev = conv.feed(Delta("</th", [6], [lp(6)]))  # held back (maybe a marker): logprobs wait
    assert ev == []
    ev = conv.feed(Delta("ink>x", [7], [lp(7)]))
    assert [o.kind for o in ev] == ["content"] and [e["token"] for e in ev[0].logprobs] == ["<6>", "<7>"]
    done = conv.finish(fin())[-1]
    assert done.logprobs is None


def test_error_and_stop_string_pass_through():
    d = collected(run_stream("x", finished=fin("error", error="boom"))).done
    assert d.finish_reason == "error" and d.error == "boom"
    d = collected(run_stream("r</think>ok", finished=fin("stop", stop_matched="END"))).done
    assert d.finish_reason == "stop" and d.stop_matched == "END"


# ---- OpenAI builders, validated by the openai SDK ------------------------------------------
def openai_chunks(events, include_usage=True):
    ch = openai_api.ChatChunker("chatcmpl-x", "m", 1, include_usage=include_usage)
    out = [ch.start()]
    for e in events:
        out += ch.done(e) if isinstance(e, Done) else ch.event(e)
    return out


def test_openai_stream_chunks_accumulate_to_tool_call():
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    events = run_stream("thinking\n</think>\n\nSure." + CALL_TEXT, tools=TOOLS)
    chunks = openai_chunks(events)
    # name chunk precedes the arguments chunk, both at index 0; the usage chunk has no choices
    tc = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if c["choices"] and
          "tool_calls" in c["choices"][0]["delta"]]
    assert tc[0]["function"] == {"name": "get_weather", "arguments": ""} and tc[0]["type"] == "function"
    assert "name" not in tc[1]["function"] and json.loads(tc[1]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
    assert chunks[-1]["timings"]["cache_n"] == 4
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"
    st = ChatCompletionStreamState()
    for c in chunks:
        st.handle_chunk(ChatCompletionChunk.model_validate(c))
    final = st.get_final_completion()
    msg = final.choices[0].message
    assert msg.content == "Sure." and final.choices[0].finish_reason == "tool_calls"
    assert msg.tool_calls[0].function.name == "get_weather"
    assert json.loads(msg.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
    assert (msg.model_extra or {}).get("reasoning_content") == "thinking"
    assert final.usage.completion_tokens_details.reasoning_tokens > 0


def test_openai_nonstream_body_validates():
    from openai.types.chat import ChatCompletion

    col = collected(run_stream("t</think>\n\n" + CALL_TEXT, tools=TOOLS))
    body = openai_api.chat_completion_body("chatcmpl-x", "m", 1, col, want_logprobs=False)
    cc = ChatCompletion.model_validate(body)
    assert cc.choices[0].message.content is None and cc.choices[0].finish_reason == "tool_calls"
    assert cc.choices[0].message.tool_calls[0].id.startswith("call_")
    assert body["choices"][0]["message"]["reasoning_content"] == "t"
    assert body["timings"]["prompt_n"] == 16 and cc.usage.prompt_tokens_details.cached_tokens == 4


def test_openai_chunks_without_usage_put_timings_on_finish():
    chunks = openai_chunks(run_stream("a</think>b"), include_usage=False)
    assert "usage" not in chunks[0] and chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert "timings" in chunks[-1]


# ---- Anthropic builders, validated by the anthropic SDK --------------------------------------
def sse_parse(blobs):
    out = []
    for b in blobs:
        text = b.decode()
        assert text.endswith("\n\n")
        lines = text.strip("\n").split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: ")
        name, data = lines[0][7:], json.loads(lines[1][6:])
        assert data["type"] == name
        out.append(data)
    return out


def anthropic_events(events):
    ms = anthropic_api.MessageStreamer("msg_x", "claude-x", 20)
    blobs = ms.start()
    for e in events:
        blobs += ms.done(e) if isinstance(e, Done) else ms.event(e)
    return sse_parse(blobs)


def test_anthropic_stream_lifecycle_and_accumulation():
    from anthropic.lib.streaming._messages import accumulate_event

    evs = anthropic_events(run_stream("plan\n</think>\n\nOn it." + CALL_TEXT, tools=TOOLS))
    types = [e["type"] for e in evs]
    assert types[:2] == ["message_start", "ping"] and types[-2:] == ["message_delta", "message_stop"]
    blocks = [(e["index"], e["content_block"]["type"]) for e in evs if e["type"] == "content_block_start"]
    assert blocks == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    # every block opens, gets deltas, closes, in order; a signature ends the thinking block
    for idx, kind in blocks:
        seq = [e for e in evs if e.get("index") == idx]
        assert seq[0]["type"] == "content_block_start" and seq[-1]["type"] == "content_block_stop"
        dtypes = {e["delta"]["type"] for e in seq[1:-1]}
        assert dtypes == {"thinking": {"thinking_delta", "signature_delta"}, "text": {"text_delta"},
                          "tool_use": {"input_json_delta"}}[kind]
        if kind == "thinking":
            assert seq[-2]["delta"]["type"] == "signature_delta"
    assert evs[-2]["delta"]["stop_reason"] == "tool_use"
    snap = None
    bufs: dict = {}
    for e in evs:
        if e["type"] != "ping":
            snap = accumulate_event(event=e, current_snapshot=snap, json_bufs=bufs)
    kinds = [b.type for b in snap.content]
    assert kinds == ["thinking", "text", "tool_use"]
    assert snap.content[0].thinking == "plan" and snap.content[0].signature
    assert snap.content[1].text == "On it."
    assert snap.content[2].name == "get_weather" and snap.content[2].input == {"city": "Paris", "days": 3}
    assert snap.content[2].id.startswith("toolu_")
    assert snap.stop_reason == "tool_use" and snap.usage.output_tokens == 10


def test_anthropic_stream_thinking_omitted():
    ms = anthropic_api.MessageStreamer("msg_x", "m", 5, omit_thinking=True)
    blobs = ms.start()
    for e in run_stream("secret plan\n</think>\n\nok"):
        blobs += ms.done(e) if isinstance(e, Done) else ms.event(e)
    evs = sse_parse(blobs)
    deltas = [e["delta"]["type"] for e in evs if e["type"] == "content_block_delta"]
    assert "thinking_delta" not in deltas and deltas[0] == "signature_delta" and "text_delta" in deltas
    assert b"secret" not in b"".join(blobs)


@pytest.mark.parametrize("finished,reason,seq", [(fin("stop"), "end_turn", None), (fin("length"), "max_tokens", None),
                                                  (fin("stop", stop_matched="##"), "stop_sequence", "##")])
def test_anthropic_stop_reasons(finished, reason, seq):
    from anthropic.types import Message

    col = collected(run_stream("r</think>\n\nhello", finished=finished))
    body = anthropic_api.message_body("msg_x", "m", col)
    m = Message.model_validate(body)
    assert (m.stop_reason, m.stop_sequence) == (reason, seq)
    assert [b.type for b in m.content] == ["thinking", "text"]
    assert m.usage.input_tokens == 16 and m.usage.cache_read_input_tokens == 4


def test_anthropic_request_conversion():
    body = {
        "model": "claude-sonnet", "max_tokens": 4096,
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
                   {"type": "text", "text": "You are helpful."}],
        "messages": [
            {"role": "user", "content": "weather?"},
            {"role": "assistant", "content": [{"type": "thinking", "thinking": "need tool", "signature": "s"},
                                              {"type": "text", "text": "Checking."},
                                              {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                          "content": [{"type": "text", "text": "sunny"},
                                                      {"type": "image", "source": {"type": "base64"}}]},
                                         {"type": "text", "text": "thanks"}]},
        ],
        "tools": [{"name": "get_weather", "description": "d", "input_schema": {"type": "object"}}],
        "thinking": {"type": "enabled", "budget_tokens": 2048}, "stop_sequences": ["END"],
        "metadata": {"user_id": "u1"},
    }
    inp, model, stream, omit = anthropic_api.parse_request(body)
    assert not omit
    assert model == "claude-sonnet" and not stream
    assert inp.messages[0] == {"role": "system", "content": "You are helpful."}
    a = inp.messages[2]
    assert a["reasoning_content"] == "need tool" and a["content"] == "Checking."
    assert a["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert inp.messages[3] == {"role": "tool", "content": "sunny\n[image omitted: this model reads text only]",
                               "tool_call_id": "toolu_1"}
    assert inp.messages[4] == {"role": "user", "content": "thanks"}
    assert inp.tools[0]["function"]["parameters"] == {"type": "object"} and inp.parse_tools
    assert inp.enable_thinking is True and inp.sampling["stop"] == ["END"] and inp.session_key == "u1"


@pytest.mark.parametrize("patch,param", [
    ({"max_tokens": None}, "max_tokens"),
    ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking.budget_tokens"),
    ({"tool_choice": {"type": "any"}}, "tool_choice.type"),  # forcing a tool needs tools
    ({"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool", "name": "g"}},
     "tool_choice.name"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].source.type"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "system", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"output_config": {"format": {"type": "json_object"}}}, "output_config.format.type"),
    ({"output_config": {"format": {"type": "json_schema", "schema": "x"}}}, "output_config.format.schema"),
    ({"output_config": {"effort": "extreme"}}, "output_config.effort"),
    ({"thinking": {"type": "enabled", "budget_tokens": 2000, "display": 3}}, "thinking.display"),
])
def test_anthropic_request_errors_name_the_field(patch, param):
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **patch}
    with pytest.raises(APIError) as ei:
        anthropic_api.parse_request(body)
    assert ei.value.status == 400 and ei.value.param == param


@pytest.mark.parametrize("patch,param", [
    ({"tool_choice": "required"}, "tool_choice"),  # no tools to force
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                   "function": {"name": "g"}}},
     "tool_choice"),
    ({"tool_choice": {"type": "mystery"}}, "tool_choice"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].image_url.url"),
    ({"messages": [{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
     "messages[0].content[0].type"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format.json_schema.schema"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"stream": "yes"}, "stream"),
])
def test_openai_request_errors_name_the_field(patch, param):
    body = {"messages": [{"role": "user", "content": "hi"}], **patch}
    with pytest.raises(APIError) as ei:
        openai_api.parse_chat(None, body)
    assert ei.value.status == 400 and ei.value.param == param


def test_openai_thinking_controls():
    base = {"messages": [{"role": "developer", "content": [{"type": "text", "text": "sys"}]},
                         {"role": "user", "content": "hi"}]}
    inp, _, _ = openai_api.parse_chat(None, {**base, "reasoning_effort": "none"})
    assert inp.enable_thinking is False and inp.messages[0] == {"role": "system", "content": "sys"}
    inp, _, _ = openai_api.parse_chat(None, {**base, "chat_template_kwargs": {"enable_thinking": True,
                                                                             "preserve_thinking": True, "x": 1}})
    assert inp.enable_thinking is True and inp.preserve_thinking is True and inp.template_kwargs == {"x": 1}
    inp, _, _ = openai_api.parse_chat(None, {**base, "max_completion_tokens": 7, "max_tokens": 9, "user": "s"})
    assert inp.sampling["max_tokens"] == 7 and inp.param_names["max_tokens"] == "max_completion_tokens"
    assert inp.session_key == "s"
    inp, _, _ = openai_api.parse_chat(None, {**base, "tools": TOOLS, "tool_choice": "none"})
    assert inp.tools is None and not inp.parse_tools


# ---- errors ---------------------------------------------------------------------------------
def test_error_shapes_by_route():
    e = APIError(400, "bad", param="temperature", code="invalid_value")
    assert error_body("/v1/chat/completions", e) == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "temperature", "code": "invalid_value"}}
    assert error_body("/v1/messages", e) == {"type": "error", "error": {"type": "invalid_request_error",
                                                                      "message": "bad"}}
    assert from_engine(QueueFull(3)).status == 429
    assert from_engine(QueueTimeout(31.0)).status == 503
    ctl = from_engine(ContextTooLong(9000, 8191))  # 8191 prompt tokens at most: an 8192-token context
    assert (ctl.status, ctl.code, ctl.param) == (400, "context_length_exceeded", "messages")
    assert "9000" in ctl.message and "8192" in ctl.message
    assert error_body("/v1/messages", from_engine(QueueTimeout(1.0)))["error"]["type"] == "overloaded_error"


# ---- flags ----------------------------------------------------------------------------------
@pytest.mark.parametrize("flags,needle", [
    (["--max-context", "99999999"], "--max-context"),
    (["--max-concurrency", "9"], "--max-concurrency"),
    (["--top-p", "1.5"], "--top-p"),
    (["--kv-capacity", "lots"], "--kv-capacity"),
    (["--max-request-mib", "0"], "--max-request-mib"),
    (["--chat-template", "/nonexistent/t.jinja"], "--chat-template"),
    (["--stats-port", "8080"], "--stats-port"),
    (["/nonexistent/model"], "model"),
])
def test_flag_errors_name_the_flag(flags, needle, capsys):
    import argparse

    from ninfer_mlc.server.app import load_state
    from ninfer_mlc.server.options import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    with pytest.raises(SystemExit) as ei:
        load_state(p.parse_args(flags), engine=object())
    assert ei.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("ninfer: error: ") and needle in err


def test_auth_header_forms():
    from starlette.datastructures import Headers

    from ninfer_mlc.server.app import authorized

    assert authorized(Headers({"authorization": "Bearer k1"}), "k1")
    assert authorized(Headers({"x-api-key": "k1"}), "k1")
    assert not authorized(Headers({"authorization": "Bearer k2"}), "k1")
    assert not authorized(Headers({"authorization": "Basic k1"}), "k1")
    assert not authorized(Headers({}), "k1")


# ---- SSE response mechanics ------------------------------------------------------------------
def _drive(resp, disconnect_after=None):
    sent, state = [], {"closed": False}

    async def main():
        async def receive():
            if disconnect_after is None:
                await asyncio.sleep(3600)
            await asyncio.sleep(disconnect_after)
            return {"type": "http.disconnect"}

        async def send(msg):
            sent.append(msg)

        await resp({"type": "http"}, receive, send)

    asyncio.run(main())
    return sent, state


def test_sse_keepalive_during_silence():
    async def gen():
        yield b"data: 1\n\n"
        await asyncio.sleep(0.35)
        yield b"data: 2\n\n"

    sent, _ = _drive(SSEResponse(gen(), keepalive_s=0.1))
    bodies = [m.get("body") for m in sent[1:]]
    assert bodies[0] == b"data: 1\n\n" and bodies[-2] == b"data: 2\n\n" and bodies[-1] == b""
    assert bodies.count(b": keep-alive\n\n") >= 2
    headers = dict(sent[0]["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream") and b"content-length" not in headers


def test_sse_disconnect_closes_producer():
    closed = []

    async def gen():
        try:
            for i in range(1000):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0.02)
        finally:
            closed.append(True)

    sent, _ = _drive(SSEResponse(gen(), keepalive_s=5), disconnect_after=0.15)
    assert closed == [True]
    assert 2 <= len(sent) < 100 and sent[-1].get("more_body", True)  # never completed normally
