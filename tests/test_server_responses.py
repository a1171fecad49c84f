"""The real server (tiny model) through the official `openai` SDK's Responses API and the
openai-agents SDK (Responses API with strict tools, and chat mode), plus the agent-client fields
of /v1/messages and the context-overflow wording of each API."""
import asyncio
import json

import anthropic
import openai
import pytest

NO_THINK = {"effort": "none"}
TOOL = {"type": "function", "name": "get_weather", "description": "Weather for a city", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                       "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def model(server):
    return server.state.config.model_id


def test_create_get_input_items_delete(client, model):
    r = client.responses.create(model=model, input="Say hi.", max_output_tokens=6, reasoning=NO_THINK,
                                temperature=0, metadata={"k": "v"})
    assert r.id.startswith("resp_") and r.status in ("completed", "incomplete") and r.model == model
    assert r.output and r.output[0].type == "message" and r.output_text == r.output[0].content[0].text
    assert 0 < r.usage.output_tokens <= 6 and r.usage.input_tokens > 5 and r.metadata == {"k": "v"}
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    items = client.responses.input_items.list(r.id)
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Say hi."
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_stream_events_match_the_final_response(client, model):
    kw = dict(model=model, input=[{"role": "developer", "content": "Be terse."},
                                  {"role": "user", "content": [{"type": "input_text", "text": "Say hi."}]}],
              max_output_tokens=12, temperature=0, reasoning={"effort": "high", "summary": "auto"},
              include=["reasoning.encrypted_content"], store=False, prompt_cache_key="sess-1",
              extra_body={"client_metadata": {"x": "y"}})
    events = list(client.responses.create(stream=True, **kw))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    # the server default thinks: the reasoning arrives as a summary with our encrypted content
    rs = final.output[0]
    assert rs.type == "reasoning" and rs.encrypted_content
    summary = "".join(e.delta for e in events if e.type == "response.reasoning_summary_text.delta")
    assert summary == rs.summary[0].text
    added = [e.output_index for e in events if e.type == "response.output_item.added"]
    done = [e.output_index for e in events if e.type == "response.output_item.done"]
    assert added == done == list(range(len(final.output)))
    with pytest.raises(openai.NotFoundError):  # store: false
        client.responses.retrieve(final.id)
    # a reply that ends by itself (greedy "Say hi." stops after ~40 tokens): the SDK's accumulator
    # assembles the same response as the non-streamed one
    kw = dict(model=model, input="Say hi.", max_output_tokens=64, temperature=0, reasoning=NO_THINK)
    with client.responses.stream(**kw) as s:
        acc = s.get_final_response()
    full = client.responses.create(**kw)
    assert acc.status == full.status == "completed" and acc.output_text == full.output_text
    assert acc.usage.output_tokens == full.usage.output_tokens


def think_block(server) -> int:
    """Tokens of the assistant opener + the empty think block that end a no-thinking prompt: later
    turns render the reply without the think block, and the engine checkpoints the first prompt
    right before its opener, so the cache reuses the first prompt up to there."""
    return len(server.state.tok.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n",
                                       add_special_tokens=False).ids)


def test_previous_response_id_and_reasoning_round_trip_reuse_the_prefix(client, model, server):
    first = client.responses.create(model=model, input="Tell me a story.", max_output_tokens=8, temperature=0,
                                    reasoning=NO_THINK, prompt_cache_key="chain")
    follow = {"role": "user", "content": "And then?"}
    chained = client.responses.create(model=model, input=[follow], previous_response_id=first.id,
                                      max_output_tokens=4, reasoning=NO_THINK, prompt_cache_key="chain")
    # the same conversation sent in full (as a stateless client does) renders the same prompt
    replay = [{"role": "user", "content": "Tell me a story."}] + [o.model_dump(exclude_none=True) for o in
                                                                 first.output] + [follow]
    stateless = client.responses.create(model=model, input=replay, max_output_tokens=4, reasoning=NO_THINK,
                                        store=False, prompt_cache_key="chain")
    assert chained.usage.input_tokens == stateless.usage.input_tokens > first.usage.input_tokens
    reused = first.usage.input_tokens - think_block(server)
    assert chained.usage.input_tokens_details.cached_tokens >= reused
    assert stateless.usage.input_tokens_details.cached_tokens >= reused
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model=model, input="x", previous_response_id="resp_nope")
    assert ei.value.body["param"] == "previous_response_id"


def test_tools_namespaces_and_hosted_tools_are_accepted(client, model):
    tools = [TOOL, {"type": "namespace", "name": "agents", "description": "sub-agents", "tools": [
        {"type": "function", "name": "spawn", "parameters": {"type": "object", "properties": {}}}]},
        {"type": "web_search"}]
    history = [{"role": "user", "content": "weather?"},
               {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
               {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    r = client.responses.create(model=model, input=history, tools=tools, max_output_tokens=6, reasoning=NO_THINK,
                                parallel_tool_calls=True, tool_choice="auto")
    assert r.status in ("completed", "incomplete")
    n_tools = client.responses.input_tokens.count(model=model, input=history, tools=tools).input_tokens
    n_plain = client.responses.input_tokens.count(model=model, input=history).input_tokens
    assert n_tools > n_plain + 50


def test_context_overflow_wording_per_api(server, client, model):
    long = "word " * 1500
    with pytest.raises(openai.BadRequestError) as ei:
        client.responses.create(model=model, input=long)
    assert ei.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": long}])
    assert ei.value.code == "context_length_exceeded"
    assert ei.value.body["message"].startswith("This model's maximum context length is 1024 tokens. However, "
                                               "your messages resulted in ")
    a = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as ei:
        a.messages.create(model="m", max_tokens=4, messages=[{"role": "user", "content": long}])
    err = ei.value.body["error"]
    assert err["type"] == "invalid_request_error"
    n = int(err["message"].split(": ")[1].split(" ")[0])
    assert err["message"] == f"prompt is too long: {n} tokens > 1023 maximum" and n > 1023


def test_messages_agent_fields(server):
    """What Claude Code sends: a system message inside `messages`, adaptive thinking with
    display "updates", context_management, output_config.effort, deferred and strict tools."""
    a = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tools = [{"name": "Read", "description": "read", "input_schema": {"type": "object"}, "strict": True},
             {"name": "Later", "description": "x", "input_schema": {"type": "object"}, "defer_loading": True}]
    msgs = [{"role": "user", "content": "hi"}, {"role": "system", "content": [{"type": "text", "text": "# Env"}]}]
    kw = dict(model="claude-x", max_tokens=4, messages=msgs, tools=tools,
              extra_body={"context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                          "output_config": {"effort": "medium"}})
    m = a.messages.create(thinking={"type": "adaptive", "display": "updates"}, **kw)
    assert m.type == "message" and m.content[0].type == "thinking"
    plain = a.messages.create(**kw)  # no `thinking`: no thinking, as the real API
    assert all(b.type != "thinking" for b in plain.content)
    n = a.messages.count_tokens(model="m", messages=msgs, tools=tools).input_tokens
    assert n == plain.usage.input_tokens + (plain.usage.cache_read_input_tokens or 0)


# ---- openai-agents ------------------------------------------------------------------------------
agents = pytest.importorskip("agents")


def _run_agent(server, chat_mode: bool):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, \
        function_tool, set_tracing_disabled
    from openai.types.shared import Reasoning

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        return f"sunny in {city}"

    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    cls = OpenAIChatCompletionsModel if chat_mode else OpenAIResponsesModel
    agent = Agent(name="a", instructions="Answer briefly.", tools=[get_weather],
                  model=cls(model=server.state.config.model_id, openai_client=aclient),
                  # room for the tiny model to stop by itself: the SDK (like the real API) fails an
                  # incomplete response
                  model_settings=ModelSettings(max_tokens=300, temperature=0, reasoning=Reasoning(effort="none")))
    return asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))


@pytest.mark.parametrize("chat_mode", [False, True], ids=["responses", "chat"])
def test_openai_agents_defaults(server, chat_mode):
    """The SDK's defaults: strict function tools (and, on the Responses model, the Responses API)."""
    res = _run_agent(server, chat_mode)
    assert isinstance(res.final_output, str)
    assert res.raw_responses and all(r.usage.input_tokens > 0 for r in res.raw_responses)


def test_full_tool_loop_through_both_sdks(client, model, server):
    """tool call -> tool result -> answer, with the call taken from a recorded assistant turn
    (forcing a call is the constrained decoder's job), through both official SDKs."""
    first = client.responses.create(model=model, input="weather in Paris?", tools=[TOOL], max_output_tokens=4,
                                    reasoning=NO_THINK)
    call = {"type": "function_call", "call_id": "call_7", "name": "get_weather",
            "arguments": json.dumps({"city": "Paris"})}
    answer = client.responses.create(model=model, previous_response_id=first.id, tools=[TOOL], max_output_tokens=6,
                                     reasoning=NO_THINK,
                                     input=[call, {"type": "function_call_output", "call_id": "call_7",
                                                   "output": "sunny"}])
    assert answer.status in ("completed", "incomplete")
    assert answer.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - think_block(server)
    a = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    tools = [{"name": "get_weather", "input_schema": TOOL["parameters"], "strict": True}]
    msgs = [{"role": "user", "content": "weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_7", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_7", "content": "sunny"}]}]
    m = a.messages.create(model="m", max_tokens=6, messages=msgs, tools=tools)
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")
