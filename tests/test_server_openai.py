"""The real server (tiny model) through the official `openai` SDK."""
import json

import openai
import pytest

from ninfer_mlc.chat_template import ChatTemplate
from ninfer_mlc.paths import default_model_dir

HI = [{"role": "user", "content": "Say hi."}]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(server):
    return server.state.config.model_id


def expected_prompt_tokens(server, messages, tools=None, **kw):
    text = ChatTemplate.from_model_dir(str(default_model_dir())).render(messages, tools, **kw)
    return len(server.state.tok.encode(text, add_special_tokens=False).ids)


def test_models(client, model, server):
    models = client.models.list()
    assert [m.id for m in models.data] == [model]
    m = client.models.retrieve(model)
    assert m.owned_by == "ninfer-mlc" and m.model_extra["max_model_len"] == 1024
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_chat_nonstream(client, model, server):
    r = client.chat.completions.with_raw_response.create(model=model, messages=HI, max_tokens=8, temperature=0)
    assert r.headers["x-request-id"]
    c = r.parse()
    ch = c.choices[0]
    assert ch.finish_reason in ("stop", "length") and ch.message.role == "assistant"
    extra = ch.message.model_extra
    assert isinstance(extra.get("reasoning_content", ""), str)
    assert c.usage.completion_tokens <= 8
    assert c.usage.prompt_tokens == expected_prompt_tokens(server, HI, enable_thinking=True, preserve_thinking=False)
    assert c.usage.prompt_tokens_details.cached_tokens >= 0
    t = c.model_extra["timings"]
    assert t["predicted_n"] == c.usage.completion_tokens and t["prompt_n"] + t["cache_n"] == c.usage.prompt_tokens


def _stream_text(stream):
    reasoning, content, finish, chunks = [], [], None, []
    for ch in stream:
        chunks.append(ch)
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        reasoning.append((d.model_extra or {}).get("reasoning_content") or "")
        content.append(d.content or "")
        finish = ch.choices[0].finish_reason or finish
    return "".join(reasoning), "".join(content), finish, chunks


@pytest.mark.parametrize("thinking", [True, False])
def test_stream_equals_nonstream_at_temperature_0(client, model, thinking):
    kw = dict(model=model, messages=HI, max_tokens=12, temperature=0,
              extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    full = client.chat.completions.create(**kw)
    reasoning, content, finish, chunks = _stream_text(client.chat.completions.create(stream=True, **kw))
    msg = full.choices[0].message
    assert reasoning == ((msg.model_extra or {}).get("reasoning_content") or "")
    assert content == (msg.content or "")
    assert finish == full.choices[0].finish_reason
    assert chunks[0].choices[0].delta.role == "assistant"
    if not thinking:
        assert reasoning == ""  # the template closed the think block in the prompt
    else:
        assert reasoning  # the prompt opened <think>: the random model writes reasoning


def test_stream_include_usage(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=HI, max_tokens=6, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens <= 6 and last.usage.total_tokens > 0
    assert "timings" in last.model_extra
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")


def test_seed_reproducible(client, model):
    kw = dict(model=model, messages=HI, max_tokens=10, temperature=1.0,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    a = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    b = client.chat.completions.create(seed=1234, **kw).choices[0].message.content
    c = [client.chat.completions.create(seed=s, **kw).choices[0].message.content for s in (1, 2, 3)]
    assert a == b
    assert any(x != a for x in c)


def test_tools_accepted_and_rendered(client, model, server):
    kw = dict(model=model, max_tokens=4, temperature=0)
    plain = client.chat.completions.create(messages=HI, **kw)
    with_tools = client.chat.completions.create(messages=HI, tools=TOOLS, tool_choice="auto", **kw)
    want = expected_prompt_tokens(server, HI, TOOLS, enable_thinking=True, preserve_thinking=False)
    assert with_tools.usage.prompt_tokens == want > plain.usage.prompt_tokens + 50
    # a tool round trip in the history renders too
    history = HI + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.chat.completions.create(messages=history, tools=TOOLS, **kw)
    assert r.usage.prompt_tokens == expected_prompt_tokens(server, history, TOOLS, enable_thinking=True,
                                                           preserve_thinking=False)
    with pytest.raises(openai.BadRequestError) as ei:  # forcing a tool the request does not offer
        client.chat.completions.create(messages=HI, tools=TOOLS, tool_choice={"type": "function", "function": {
            "name": "get_time"}}, **kw)
    assert ei.value.param == "tool_choice"


def test_stop_logprobs_and_logit_bias(client, model, server):
    kw = dict(model=model, messages=HI, max_tokens=12, temperature=0,
              extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    base = client.chat.completions.create(**kw).choices[0].message.content
    assert len(base) > 4
    stop = base[2:5]
    cut = client.chat.completions.create(stop=[stop], **kw).choices[0]
    assert cut.message.content == base[:base.index(stop)] and cut.finish_reason == "stop"
    lp = client.chat.completions.create(logprobs=True, top_logprobs=2, **kw).choices[0]
    assert len(lp.logprobs.content) >= 1 and all(len(e.top_logprobs) == 2 for e in lp.logprobs.content)
    assert all(e.logprob <= 0 for e in lp.logprobs.content)
    # a +100 bias on one token makes greedy decoding pick it every step
    tid = server.state.tok.encode(" hello", add_special_tokens=False).ids[0]
    forced = client.chat.completions.create(logit_bias={str(tid): 100}, **{**kw, "max_tokens": 3})
    assert forced.choices[0].message.content == server.state.tok.decode([tid]) * 3


def test_completions(client, model):
    r = client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("stop", "length")
    text = r.choices[0].text
    s = "".join(c.choices[0].text for c in client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=6, temperature=0, stream=True) if c.choices)
    assert s == text
    ids = r.usage.prompt_tokens
    r2 = client.completions.create(model=model, prompt=[[1, 2, 3, 4]], max_tokens=3, temperature=0, logprobs=1)
    assert r2.usage.prompt_tokens == 4 and len(r2.choices[0].logprobs.tokens) >= 1
    assert ids > 0


def test_errors_and_server_keeps_serving(client, model, server):
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=model, messages=HI, temperature=5)
    assert ei.value.param == "temperature" and "temperature" in ei.value.message
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=model, messages=HI, max_completion_tokens=0)
    assert ei.value.param == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=model, messages=HI, n=2)
    assert ei.value.param == "n"
    with pytest.raises(openai.NotFoundError) as ei:
        client.chat.completions.create(model="gpt-nonexistent", messages=HI)
    assert ei.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as ei:  # > --max-context 1024 tokens, < 1 MiB
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hello " * 1500}])
    assert ei.value.code == "context_length_exceeded"
    with pytest.raises(openai.APIStatusError) as ei:  # > --max-request-mib 1
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x" * (1 << 21)}])
    assert ei.value.status_code == 413
    r = client.chat.completions.create(model=model, messages=HI, max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert server.state.engine.stats().scheduler.running == 0


def test_api_key(secured_server):
    bad = openai.OpenAI(base_url=secured_server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    with pytest.raises(openai.AuthenticationError):
        bad.chat.completions.create(model="tiny", messages=HI, max_tokens=2)
    good = openai.OpenAI(base_url=secured_server.url + "/v1", api_key="sekret", max_retries=0)
    assert [m.id for m in good.models.list().data] == ["tiny"]
    r = good.chat.completions.create(model="tiny", messages=HI, max_tokens=2)
    assert r.model == "tiny"
