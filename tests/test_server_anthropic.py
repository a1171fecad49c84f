"""The real server (tiny model) through the official `anthropic` SDK."""
import anthropic
import pytest

MSGS = [{"role": "user", "content": "Say hi."}]
TOOLS = [{"name": "get_weather", "description": "Current weather",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
NO_THINK = {"type": "disabled"}
T0 = {"temperature": 0}  # the current SDK no longer has sampling kwargs; the API still takes them
THINK = {"type": "adaptive"}  # the server default (thinking on); a budget needs max_tokens > 1024


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)


def test_message_nonstream(client):
    r = client.messages.with_raw_response.create(model="claude-any", max_tokens=8, messages=MSGS, extra_body=T0,
                                                 thinking=NO_THINK)
    assert r.headers["request-id"]
    m = r.parse()
    assert m.model == "claude-any" and m.role == "assistant" and m.type == "message"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in m.content] in (["text"], [])
    assert 0 < m.usage.output_tokens <= 8
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 5


def test_thinking_enabled_and_disabled(client):
    on = client.messages.create(model="m", max_tokens=10, messages=MSGS, extra_body=T0, thinking=THINK)
    assert on.content[0].type == "thinking" and on.content[0].thinking and on.content[0].signature
    off = client.messages.create(model="m", max_tokens=10, messages=MSGS, extra_body=T0, thinking=NO_THINK)
    assert all(b.type != "thinking" for b in off.content)


def test_stream_lifecycle_matches_nonstream(client):
    kw = dict(model="m", max_tokens=10, messages=MSGS, extra_body=T0, thinking=THINK)
    full = client.messages.create(**kw)
    events = list(client.messages.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    # blocks open and close in order, deltas only inside an open block
    open_idx = None
    for e in events:
        if e.type == "content_block_start":
            assert open_idx is None
            open_idx = e.index
        elif e.type == "content_block_delta":
            assert e.index == open_idx
        elif e.type == "content_block_stop":
            assert e.index == open_idx
            open_idx = None
    assert open_idx is None
    thinking = "".join(e.delta.thinking for e in events if e.type == "content_block_delta"
                       and e.delta.type == "thinking_delta")
    assert any(e.type == "content_block_delta" and e.delta.type == "signature_delta" for e in events)
    assert thinking == full.content[0].thinking
    assert events[-2].delta.stop_reason == full.stop_reason
    # the SDK's own accumulator gives the same message
    with client.messages.stream(**kw) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == [b.type for b in full.content]
    assert final.content[0].thinking == full.content[0].thinking
    assert final.usage.output_tokens == full.usage.output_tokens


def test_count_tokens(client, server):
    n = client.messages.count_tokens(model="m", messages=MSGS).input_tokens
    m = client.messages.create(model="m", max_tokens=2, messages=MSGS)
    assert n == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    n_tools = client.messages.count_tokens(model="m", messages=MSGS, tools=TOOLS, system="Be brief.").input_tokens
    assert n_tools > n + 50


def test_stop_sequences(client):
    kw = dict(model="m", max_tokens=12, messages=MSGS, extra_body=T0, thinking=NO_THINK)
    text = client.messages.create(**kw).content[0].text
    assert len(text) > 5
    stop = text[2:5]
    m = client.messages.create(stop_sequences=[stop], **kw)
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    got = m.content[0].text if m.content else ""
    assert got == text[:text.index(stop)]


def test_tools_history_and_metadata(client):
    msgs = MSGS + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "use the tool", "signature": "abc"},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    m = client.messages.create(model="m", max_tokens=4, messages=msgs, tools=TOOLS, tool_choice={"type": "auto"},
                               system=[{"type": "text", "text": "You are terse."}], metadata={"user_id": "u-1"})
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_errors_and_server_keeps_serving(client):
    with pytest.raises(anthropic.BadRequestError) as ei:
        client.messages.create(model="m", max_tokens=4, messages=MSGS, extra_body={"temperature": 5})
    assert ei.value.body["type"] == "error" and ei.value.body["error"]["type"] == "invalid_request_error"
    assert "temperature" in ei.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": "hi " * 1500}])
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", max_tokens=4, messages=MSGS, thinking={"type": "enabled",
                                                                                 "budget_tokens": 5})
    with pytest.raises(anthropic.BadRequestError):  # forcing a tool the request does not offer
        client.messages.create(model="m", max_tokens=4, messages=MSGS, tools=TOOLS,
                               tool_choice={"type": "tool", "name": "get_time"})
    assert client.messages.create(model="m", max_tokens=2, messages=MSGS).type == "message"


def test_auth(secured_server):
    bad = anthropic.Anthropic(base_url=secured_server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as ei:
        bad.messages.create(model="m", max_tokens=2, messages=MSGS)
    assert ei.value.body["error"]["type"] == "authentication_error"
    good = anthropic.Anthropic(base_url=secured_server.url, api_key="sekret", max_retries=0)
    assert good.messages.create(model="m", max_tokens=2, messages=MSGS).type == "message"


def test_thinking_display_omitted_and_effort(client):
    m = client.messages.create(model="m", max_tokens=6, messages=MSGS, extra_body=T0,
                               thinking={"type": "adaptive", "display": "omitted"}, output_config={"effort": "low"})
    assert m.content[0].type == "thinking" and m.content[0].thinking == "" and m.content[0].signature
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model="m", max_tokens=6, messages=MSGS, output_config={"effort": "insane"})
