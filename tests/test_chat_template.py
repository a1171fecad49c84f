"""Chat template rendering: HF apply_chat_template parity, loading, preserve_thinking, errors."""

import copy
import json
from datetime import datetime

import pytest

from ninfer_mlc.chat_template import ChatTemplate, ChatTemplateError, load_chat_template, strip_prior_reasoning
from ninfer_mlc.tool_calls import parse_tool_calls

# A Qwen3.5-style ChatML template: tools in a <tools> block with XML call instructions, tool
# responses folded into user turns, reasoning shown only after the last real user query (or for
# every turn with preserve_thinking), and the thinking switch in the generation prompt.
QWEN_TEMPLATE = r"""
{%- set enable_thinking = enable_thinking if enable_thinking is defined else true %}
{%- set keep_all_thinking = preserve_thinking is defined and preserve_thinking %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n' }}
    {{- '<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n' }}
    {{- '<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n' }}
    {{- '</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format\n' }}
    {{- '- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n</IMPORTANT><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == 'user' and message.content is string and not (message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if '</think>' in content %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content.strip('\n') %}
        {%- if (keep_all_thinking or loop.index0 > ns.last_query_index) and reasoning_content %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if loop.first and content.strip() %}
                    {{- '\n\n' }}
                {%- elif not loop.first %}
                    {{- '\n' }}
                {%- endif %}
                {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- if tool_call.arguments is mapping %}
                    {%- for args_name, args_value in tool_call.arguments | items %}
                        {{- '<parameter=' + args_name + '>\n' }}
                        {%- set args_value = args_value if args_value is string else args_value | tojson %}
                        {{- args_value + '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- elif message.role != 'system' %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking %}
        {{- '<think>\n' }}
    {%- else %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city — returns °C",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "description": "Write <file> contents",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "content": {"type": "string"}, "opts": {"type": "object"}},
            },
        },
    },
]

WEATHER_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}},
}
WRITE_CALL = {
    "id": "call_2",
    "type": "function",
    "function": {"name": "write_file", "arguments": {"path": "a.txt", "content": "x\ny", "opts": {"mode": "w", "n": [1]}}},
}

CONVERSATIONS = {
    "single_user": ([{"role": "user", "content": "Hi"}], None),
    "system_user": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], None),
    "tools_system": ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"}], TOOLS),
    "tool_roundtrip": (
        [
            {"role": "user", "content": "Weather in Paris and write it down"},
            {
                "role": "assistant",
                "content": "Checking.",
                "reasoning_content": "Need the weather tool.",
                "tool_calls": [WEATHER_CALL, WRITE_CALL],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18°C"},
            {"role": "tool", "tool_call_id": "call_2", "content": "ok"},
        ],
        TOOLS,
    ),
    "multi_turn_reasoning": (
        [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
            {"role": "user", "content": "And weather?"},
            {"role": "assistant", "content": "", "reasoning_content": "Use tool.", "tool_calls": [WEATHER_CALL]},
            {"role": "tool", "content": "sunny"},
            {"role": "assistant", "content": "<think>\nIt said sunny.\n</think>\n\nSunny.", "tool_calls": None},
        ],
        TOOLS,
    ),
    "reasoning_alias_field": (
        [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": "a", "reasoning": "thought via alias"},
            {"role": "user", "content": "q2"},
            {"role": "assistant", "content": "a2", "reasoning": "latest thought"},
        ],
        None,
    ),
}


def hf_tokenizer(template):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "a": 3, "b": 4, "ab": 5}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    hf.chat_template = template
    return hf


@pytest.fixture(scope="module")
def hf():
    return hf_tokenizer(QWEN_TEMPLATE)


OURS = ChatTemplate(QWEN_TEMPLATE, {"eos_token": "<|im_end|>", "pad_token": {"content": "<|endoftext|>"}})


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
@pytest.mark.parametrize("enable_thinking", [True, False, None])
def test_parity_with_transformers(hf, name, enable_thinking):
    messages, tools = CONVERSATIONS[name]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    want = hf.apply_chat_template(
        copy.deepcopy(messages), tools=tools, tokenize=False, add_generation_prompt=True, **kwargs
    )
    got = OURS.render(copy.deepcopy(messages), tools, add_generation_prompt=True, **kwargs)
    assert got == want
    assert got.endswith("<|im_start|>assistant\n<think>\n" if enable_thinking is not False else "<think>\n\n</think>\n\n")


def test_parity_without_generation_prompt(hf):
    messages, tools = CONVERSATIONS["tool_roundtrip"]
    want = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=False)
    assert OURS.render(messages, tools, add_generation_prompt=False) == want


def test_string_arguments_are_normalised_to_dicts():
    messages, tools = CONVERSATIONS["tool_roundtrip"]
    as_strings = copy.deepcopy(messages)
    for tc in as_strings[1]["tool_calls"]:
        tc["function"]["arguments"] = json.dumps(tc["function"]["arguments"])
    assert OURS.render(as_strings, tools) == OURS.render(messages, tools)
    assert isinstance(as_strings[1]["tool_calls"][0]["function"]["arguments"], str)  # caller's data untouched


def test_rendered_tool_call_round_trips_through_parser():
    messages, tools = CONVERSATIONS["tool_roundtrip"]
    text = OURS.render(messages, tools, add_generation_prompt=False)
    turn = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    r = parse_tool_calls(turn.split("</think>\n\n")[1], tools)
    assert r.fallback_reason is None
    assert [(c.name, c.arguments) for c in r.calls] == [
        ("get_weather", {"city": "Paris", "days": 2}),
        ("write_file", {"path": "a.txt", "content": "x\ny", "opts": {"mode": "w", "n": [1]}}),
    ]


def test_exact_render_of_tool_roundtrip():
    messages, tools = CONVERSATIONS["tool_roundtrip"]
    text = OURS.render(messages, tools)
    assert '\n{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city — returns °C"' in text
    assert text.endswith(
        "<|im_start|>user\nWeather in Paris and write it down<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nNeed the weather tool.\n</think>\n\nChecking.\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=write_file>\n<parameter=path>\na.txt\n</parameter>\n"
        "<parameter=content>\nx\ny\n</parameter>\n"
        '<parameter=opts>\n{"mode": "w", "n": [1]}\n</parameter>\n</function>\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18°C\n</tool_response>\n<tool_response>\nok\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )


PRIOR = [
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "a1", "reasoning_content": "r1"},
    {"role": "user", "content": "q2"},
    {"role": "assistant", "content": "<think>\nr2\n</think>\n\na2"},
    {"role": "user", "content": "q3"},
    {"role": "assistant", "content": "a3", "reasoning_content": "r3"},
]


def test_preserve_thinking_false_strips_prior_turns():
    # With preserve_thinking=True the template keeps every turn's reasoning.
    kept = OURS.render(PRIOR, preserve_thinking=True)
    assert "<think>\nr1\n</think>\n\na1" in kept and "<think>\nr2\n</think>\n\na2" in kept
    stripped = OURS.render(PRIOR, preserve_thinking=False)
    assert "r1" not in stripped and "r2" not in stripped
    assert "<|im_start|>assistant\na1<|im_end|>\n" in stripped
    assert "<|im_start|>assistant\na2<|im_end|>\n" in stripped
    assert "<think>\nr3\n</think>\n\na3" in stripped  # after the last user message: kept


def test_preserve_thinking_false_with_template_that_always_shows_reasoning():
    raw = ChatTemplate(
        "{% for m in messages %}[{{ m.role }}|{{ m.reasoning_content | default('-') }}|{{ m.content }}]{% endfor %}"
    )
    assert raw.render(PRIOR, add_generation_prompt=False) == (
        "[user|-|q1][assistant|r1|a1][user|-|q2][assistant|-|<think>\nr2\n</think>\n\na2][user|-|q3][assistant|r3|a3]"
    )
    assert raw.render(PRIOR, preserve_thinking=False) == (
        "[user|-|q1][assistant|-|a1][user|-|q2][assistant|-|a2][user|-|q3][assistant|r3|a3]"
    )
    assert PRIOR[1]["reasoning_content"] == "r1"  # input not mutated


def test_strip_prior_reasoning_closer_only_and_parts():
    msgs = [
        {"role": "assistant", "content": "r0\n</think>\n\nc0"},
        {"role": "assistant", "content": [{"type": "text", "text": "<think>x</think>\n\nc1"}], "thinking": "t"},
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "<think>keep</think>c2"},
    ]
    out = strip_prior_reasoning(msgs)
    assert out[0] == {"role": "assistant", "content": "c0"}
    assert out[1] == {"role": "assistant", "content": [{"type": "text", "text": "c1"}]}
    assert out[3] == msgs[3]


def test_tojson_matches_hf_options():
    t = ChatTemplate(
        "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(separators=(',', ':')) }}|{{ x | tojson(ensure_ascii=True) }}"
    )
    x = {"z": "<é>", "a": [1, 2]}
    assert t.render([], add_generation_prompt=False, x=x) == "|".join(
        [
            '{"z": "<é>", "a": [1, 2]}',
            json.dumps(x, ensure_ascii=False, indent=2),
            '{"z":"<é>","a":[1,2]}',
            '{"z": "<\\u00e9>", "a": [1, 2]}',
        ]
    )


def test_globals_and_extensions():
    t = ChatTemplate(
        "{{ strftime_now('%Y') }}|{% for i in [1, 2, 3, 4] %}{% if i == 3 %}{% break %}{% endif %}"
        "{% if i == 1 %}{% continue %}{% endif %}{{ i }}{% endfor %}|{{ bos_token }}{{ eos_token }}"
        "|{% generation %}gen{% endgeneration %}|{{ add_generation_prompt }}|{{ custom }}"
    )
    t.special_tokens = {"bos_token": "<s>", "eos_token": "</s>"}
    assert t.render([], custom="kw") == f"{datetime.now().year}|2|<s></s>|gen|True|kw"


def test_trim_and_lstrip_blocks():
    t = ChatTemplate("{% for m in messages %}\n    {% if m.role %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}")
    assert t.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == "a\nb\n"


def test_none_keys_dropped_like_hf(hf):
    msgs = [{"role": "user", "content": "hi", "name": None}]
    t = "{% for m in messages %}{{ m.name is defined }}{% endfor %}"
    assert ChatTemplate(t).render(msgs) == "False" == hf_tokenizer(t).apply_chat_template(msgs, tokenize=False)


def test_raise_exception_becomes_chat_template_error():
    with pytest.raises(ChatTemplateError, match="Unexpected message role: robot"):
        OURS.render([{"role": "robot", "content": "beep"}])
    with pytest.raises(ChatTemplateError, match="syntax error"):
        ChatTemplate("{% for x in %}").render([])
    with pytest.raises(ChatTemplateError, match="failed|error"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])


def test_sandbox_blocks_mutation_and_dunder_access():
    with pytest.raises(ChatTemplateError):
        ChatTemplate("{{ messages.append(1) }}").render([])
    with pytest.raises(ChatTemplateError, match="unsafe"):
        ChatTemplate("{{ ''.__class__.__mro__ }}").render([])


def test_load_from_model_dir_variants(tmp_path):
    d = tmp_path / "m1"
    d.mkdir()
    (d / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": "cfg {{ bos_token }}", "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"})
    )
    ct = ChatTemplate.from_model_dir(str(d))
    assert ct.render([]) == "cfg <s>"
    assert ct.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}

    (d / "chat_template.jinja").write_text("jinja {{ eos_token }}")
    assert ChatTemplate.from_model_dir(str(d)).render([]) == "jinja </s>"

    override = tmp_path / "override.jinja"
    override.write_text("override")
    assert ChatTemplate.from_model_dir(str(d), override=str(override)).render([]) == "override"

    d2 = tmp_path / "m2"
    d2.mkdir()
    (d2 / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]})
    )
    ct = ChatTemplate.from_model_dir(str(d2))
    assert ct.render([]) == "plain"
    assert ct.render([], tools=[]) == "tools"
    assert ct.render([], template_name="tool_use") == "tools"
    with pytest.raises(ChatTemplateError):
        ct.render([], template_name="nope")

    d3 = tmp_path / "m3"
    d3.mkdir()
    with pytest.raises(ChatTemplateError, match="no chat template"):
        load_chat_template(str(d3))
    with pytest.raises(ChatTemplateError):
        load_chat_template(str(d3), override=str(tmp_path / "missing.jinja"))
