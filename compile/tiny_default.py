"""Deterministic generator for the project's embedded default model ("tiny-default").

``generate(out_dir)`` writes a complete Hugging Face model directory for a tiny
``Qwen3_5ForCausalLM`` (model_type ``qwen3_5_text``): 3 Gated-DeltaNet layers + 1 gated
full-attention layer, an MTP head under vLLM's ``mtp.*`` names, a real byte-level BPE
tokenizer (~2000 tokens) with Qwen's special / added tokens, a Qwen3.5-style ChatML chat
template with XML tool calls and ``<think>`` reasoning, and a generation config.

Everything is bit-identical on every run and machine:

* the training corpus is assembled from fixed word lists with a pure-Python SplitMix64
  generator (no ``random``, no stdlib docstrings, nothing that varies with the Python version);
* the tokenizer is trained with ``tokenizers``' BPE trainer (whose merge order is a pure
  function of the pair counts, ties broken by pair ids) and ``tokenizer.json`` is then
  serialised by this module with a fixed layout, so it does not depend on how a given
  ``tokenizers`` version pretty-prints;
* weights come from ``numpy.random.Generator(PCG64)`` seeded per tensor from the tensor name,
  and are shaped only with element-wise IEEE operations (no BLAS, no float reductions), so the
  float32 bytes do not depend on the CPU's SIMD width;
* ``model.safetensors`` is written by hand (sorted names, fixed header), independent of the
  installed ``safetensors`` version.

Run ``python -m ninfer_mlc.compile.tiny_default OUT_DIR``.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import sys
import time
from pathlib import Path

import numpy as np

__all__ = ["generate", "CONFIG", "SPECIAL_TOKENS", "ADDED_TOKENS", "CHAT_TEMPLATE", "BPE_VOCAB_SIZE"]

# --------------------------------------------------------------------------------------------
# Model dimensions
# --------------------------------------------------------------------------------------------

HIDDEN = 128
INTERMEDIATE = 256
NUM_LAYERS = 4
FULL_ATTENTION_INTERVAL = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 64
LIN_K_HEADS = 2
LIN_V_HEADS = 4
LIN_K_DIM = 32
LIN_V_DIM = 32
CONV_KERNEL = 4
MAX_POS = 8192

# BPE part of the vocabulary (256 byte symbols + merges); the 9 added tokens follow it, as
# in Qwen's tokenizers (151643 BPE tokens, then <|endoftext|>, <|im_start|>, ...).
BPE_VOCAB_SIZE = 1991

# (content, special) in id order, right after the BPE vocabulary.
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED_TOKENS = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

SEED = 20250611
# Output-projection gain of the main layers, bigram logit boost and cross-talk cap (lm_head).
OUT_GAIN = 0.6
BIGRAM_BOOST = 10.0
BIGRAM_CAP = 3.0
HEAD_NOISE = 1.0
CORPUS_SEED = 0x5EED_7153_0DEF_A017

# Qwen3.5's pre-tokenisation regex (transformers' Qwen3_5Tokenizer.PRETOKENIZE_REGEX).
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _round_up(x: int, m: int) -> int:
    return (x + m - 1) // m * m


N_TOKENS = BPE_VOCAB_SIZE + len(ADDED_TOKENS)
VOCAB_SIZE = _round_up(N_TOKENS, 64)
TOKEN_ID = {tok: BPE_VOCAB_SIZE + i for i, (tok, _) in enumerate(ADDED_TOKENS)}
ENDOFTEXT_ID = TOKEN_ID["<|endoftext|>"]
IM_START_ID = TOKEN_ID["<|im_start|>"]
IM_END_ID = TOKEN_ID["<|im_end|>"]

LAYER_TYPES = [
    "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
    for i in range(NUM_LAYERS)
]

CONFIG = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": VOCAB_SIZE,
    "hidden_size": HIDDEN,
    "intermediate_size": INTERMEDIATE,
    "num_hidden_layers": NUM_LAYERS,
    "full_attention_interval": FULL_ATTENTION_INTERVAL,
    "layer_types": LAYER_TYPES,
    "num_attention_heads": NUM_HEADS,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_DIM,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "attn_output_gate": True,
    "linear_num_key_heads": LIN_K_HEADS,
    "linear_num_value_heads": LIN_V_HEADS,
    "linear_key_head_dim": LIN_K_DIM,
    "linear_value_head_dim": LIN_V_DIM,
    "linear_conv_kernel_dim": CONV_KERNEL,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": MAX_POS,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "use_cache": True,
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "mamba_ssm_dtype": "float32",
    "dtype": "float32",
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
    "pad_token_id": ENDOFTEXT_ID,
}

GENERATION_CONFIG = {
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": [IM_END_ID, ENDOFTEXT_ID],
    "pad_token_id": ENDOFTEXT_ID,
    "do_sample": True,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
}

# --------------------------------------------------------------------------------------------
# Chat template (Qwen3.5-style ChatML, XML tool calls, <think> reasoning)
# --------------------------------------------------------------------------------------------

CHAT_TEMPLATE = r"""{#- tiny-default chat template: Qwen3.5-style ChatML. -#}
{%- macro render_content(content) -%}
    {%- if content is none -%}
    {%- elif content is string -%}
        {{- content -}}
    {%- elif content is mapping -%}
        {{- content.text if content.text is defined and content.text is string else '' -}}
    {%- elif content is iterable -%}
        {%- for part in content -%}
            {%- if part is string -%}
                {{- part -}}
            {%- elif part is mapping and part.text is defined and part.text is string -%}
                {{- part.text -}}
            {%- endif -%}
        {%- endfor -%}
    {%- endif -%}
{%- endmacro -%}
{%- set has_system = messages|length > 0 and messages[0].role == 'system' -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if has_system -%}
        {%- set sys_text = render_content(messages[0].content)|trim -%}
        {%- if sys_text -%}
            {{- sys_text + '\n\n' -}}
        {%- endif -%}
    {%- endif -%}
    {{- '# Tools\n\nYou have access to the following functions:\n\n<tools>' -}}
    {%- for tool in tools -%}
        {{- '\n' -}}
        {{- tool | tojson -}}
    {%- endfor -%}
    {{- '\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT><|im_end|>\n' -}}
{%- elif has_system -%}
    {{- '<|im_start|>system\n' + render_content(messages[0].content) + '<|im_end|>\n' -}}
{%- endif -%}
{#- The last real user query: tool results wrapped in <tool_response> do not count. -#}
{%- set ns = namespace(last_query_index=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}
        {%- set text = render_content(message.content)|trim -%}
        {%- if not (text.startswith('<tool_response>') and text.endswith('</tool_response>')) -%}
            {%- set ns.last_query_index = loop.index0 -%}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- for message in messages -%}
    {%- set content = render_content(message.content) -%}
    {%- if message.role == 'system' -%}
        {%- if not loop.first -%}
            {{- '<|im_start|>system\n' + content + '<|im_end|>\n' -}}
        {%- endif -%}
    {%- elif message.role == 'user' -%}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' -}}
    {%- elif message.role == 'assistant' -%}
        {%- set reasoning = '' -%}
        {%- if message.reasoning_content is defined and message.reasoning_content is string -%}
            {%- set reasoning = message.reasoning_content -%}
        {%- elif '</think>' in content -%}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}
            {%- set content = content.split('</think>')[-1] -%}
        {%- endif -%}
        {%- set reasoning = reasoning.strip('\n') -%}
        {%- set content = content.lstrip('\n') -%}
        {{- '<|im_start|>assistant\n' -}}
        {%- if loop.index0 > ns.last_query_index -%}
            {{- '<think>\n' + reasoning + '\n</think>\n\n' -}}
        {%- endif -%}
        {{- content -}}
        {%- if message.tool_calls is defined and message.tool_calls -%}
            {%- for tc in message.tool_calls -%}
                {%- set call = tc.function if tc.function is defined else tc -%}
                {%- if not loop.first -%}
                    {{- '\n' -}}
                {%- elif content|trim -%}
                    {{- '\n\n' -}}
                {%- endif -%}
                {{- '<tool_call>\n<function=' + call.name + '>\n' -}}
                {%- if call.arguments is mapping -%}
                    {%- for arg_name, arg_value in call.arguments|items -%}
                        {{- '<parameter=' + arg_name + '>\n' -}}
                        {%- if arg_value is string -%}
                            {{- arg_value -}}
                        {%- else -%}
                            {{- arg_value | tojson -}}
                        {%- endif -%}
                        {{- '\n</parameter>\n' -}}
                    {%- endfor -%}
                {%- elif call.arguments is string and call.arguments -%}
                    {{- call.arguments + '\n' -}}
                {%- endif -%}
                {{- '</function>\n</tool_call>' -}}
            {%- endfor -%}
        {%- endif -%}
        {{- '<|im_end|>\n' -}}
    {%- elif message.role == 'tool' -%}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}
            {{- '<|im_start|>user' -}}
        {%- endif -%}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}
            {{- '<|im_end|>\n' -}}
        {%- endif -%}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- else -%}
        {{- '<think>\n' -}}
    {%- endif -%}
{%- endif -%}
"""

# --------------------------------------------------------------------------------------------
# Deterministic corpus
# --------------------------------------------------------------------------------------------

_M64 = (1 << 64) - 1


class _SplitMix64:
    """Tiny PRNG with a fixed, version-independent stream (SplitMix64)."""

    def __init__(self, seed: int):
        self.state = seed & _M64

    def u64(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & _M64
        z = self.state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.u64() % n

    def between(self, lo: int, hi: int) -> int:  # inclusive
        return lo + self.below(hi - lo + 1)

    def choice(self, seq):
        return seq[self.below(len(seq))]

    def chance(self, percent: int) -> bool:
        return self.below(100) < percent

    def sample(self, seq, k: int) -> list:
        pool = list(seq)
        out = []
        for _ in range(min(k, len(pool))):
            out.append(pool.pop(self.below(len(pool))))
        return out


def _w(s: str) -> list[str]:
    return s.split()


NOUNS = _w("""
time year day week month hour minute people way world life hand part child eye woman man place
work case point government company number group problem fact system program question house area
country money story friend book family city river mountain road garden window door table chair
computer server file function value model network process user data memory token layer language
engine kernel compiler parser request response message answer result error test string list map
key record field module package library project team report plan idea reason moment example
teacher student doctor market price cost power energy light water fire wind stone tree forest
animal bird horse dog cat fish ship train car street bridge station school office room kitchen
letter word sentence page line picture song music game rule law policy history science nature
thread queue stack buffer cache batch vector matrix tensor graph node edge path pattern signal
""")
ADJECTIVES = _w("""
good new first last long great little own other old right big high different small large next
early young important few public bad same able simple quick slow bright dark warm cold quiet loud
strong weak clean empty full heavy light happy sad careful clear complex correct fast final free
general hidden local main modern natural open private ready real recent safe short special stable
strange sudden tiny total true useful valid wide wrong blue green red yellow white black golden
silver ancient gentle patient curious brave calm eager fair fine honest kind proud rare rich wise
""")
VERBS = _w("""
make take see know find give tell work call try ask need feel leave keep begin help show hear play
run move live believe hold bring write provide stand lose pay meet include continue set learn change
lead understand watch follow stop create speak read allow add spend grow open walk win offer remember
consider appear buy wait serve send expect build stay fall cut reach kill remain suggest raise pass
sell require report decide pull return explain hope develop carry break receive agree support hit
produce eat cover catch draw choose compute parse compile load store fetch sort filter merge split
encode decode render update delete insert check verify measure train predict sample stream schedule
""")
ADVERBS = _w("""
quickly slowly carefully quietly really almost always never often sometimes usually already still
again together finally suddenly simply clearly easily nearly rarely gently exactly probably perhaps
""")
PREPOSITIONS = _w("in on at from with about into over under after before behind near across through")
DETERMINERS = _w("the the the a a this that every each some one another no my your our their his her its")
PLURAL_DETS = _w("the the some many few several these those all most our their")
PRONOUNS = ["he", "she", "it", "they", "we", "you", "I"]
NAMES = _w("""
Alice Bob Carol David Emma Frank Grace Henry Irene Jack Karen Leo Maria Nina Oscar Paul Quinn Rosa
Sam Tina Victor Wendy Xavier Yara Zoe Alan Ada Linus Guido Grace Ken Dennis Barbara Edsger Donald
""")
PLACES = _w("""
London Paris Berlin Tokyo Madrid Rome Vienna Prague Oslo Lisbon Dublin Cairo Lima Seoul Sydney Toronto
Boston Chicago Denver Austin Seattle Zurich Geneva Munich Milan Kyoto Osaka Beijing Shanghai Mumbai
""")
CONJUNCTIONS = _w("and but so because while although when if unless since")
TOPICS = _w("""
weather travel cooking music history science programming mathematics gardening astronomy economics
painting chess football medicine architecture poetry databases compilers networking security
""")

CODE_NAMES = _w("""
data items values result count index total buffer config options path name text lines tokens
node nodes edges graph cache state model layer weights inputs outputs batch size offset limit key
keys value queue stack user users request response payload headers status message error logger
""")
CODE_TYPES = _w("int str float bool bytes list dict tuple None")
MODULES = _w("os sys json math re time random pathlib itertools functools collections typing dataclasses")
ATTRS = _w("size name value count shape dtype length id kind score weight priority level")

JSON_KEYS = _w("""
id name title description type status created updated tags items count price currency email city
country score enabled version author url path size owner role permissions metadata labels location
""")

TOOL_NAMES = [
    "get_weather", "search_web", "read_file", "write_file", "run_command", "get_time",
    "send_email", "lookup_user", "list_files", "calculate", "translate_text", "create_event",
]
TOOL_PARAMS = _w("city query path content command timezone to subject body user_id directory expression text target_language date title unit limit")

FOREIGN = {
    "fr": _w("le la les un une et est dans pour avec sur pas très être avoir été où ça déjà après français "
             "élève été café château fenêtre hôpital garçon leçon noël forêt île"),
    "de": _w("der die das und ist nicht mit für auf ein eine über schön größer Straße Mädchen Übung "
             "Grüße fünf zwölf Tür Bär Öl außerdem natürlich"),
    "es": _w("el la los las un una y es en por con para muy está año niño mañana señor corazón canción "
             "también información pequeño español"),
    "pt": _w("o a os um uma e é em para com não são ação coração informação também você avó pão"),
    "ru": _w("и в не на я что он с как это по но они мы привет мир спасибо да нет хорошо сегодня "
             "город книга время человек"),
    "el": _w("και το η ο να είναι με για στο καλημέρα ευχαριστώ κόσμος"),
    "zh": _w("的 一 是 不 了 在 人 有 我 他 这 中 大 来 上 国 个 到 说 们 为 子 和 你 地 出 道 也 时 年 "
             "你好 世界 模型 语言 计算机 数据 时间 今天 天气 谢谢 学习 程序"),
    "ja": _w("の に は を た が で て と し れ さ ある いる する こんにちは ありがとう 日本 東京 言語 "
             "モデル データ コンピュータ 今日 天気"),
    "ko": _w("안녕하세요 감사합니다 한국어 모델 데이터 오늘 날씨 사람 시간 세계"),
}
EMOJI = ["😀", "🙂", "🎉", "🚀", "🔥", "👍", "✅", "❌", "⚠️", "💡", "📦", "🌍", "❤️", "✨", "🤖", "👋🏽"]
SYMBOLS = ["→", "←", "≤", "≥", "≠", "±", "×", "÷", "∞", "√", "π", "°", "€", "£", "¥", "©", "—", "–", "…", "•", "“", "”", "‘", "’"]


def _plural(noun: str) -> str:
    if noun in ("child",):
        return "children"
    if noun in ("man", "woman"):
        return noun[:-2] + "en"
    if noun in ("people", "data", "fish"):
        return noun
    if noun.endswith(("s", "x", "ch", "sh")):
        return noun + "es"
    if noun.endswith("y") and noun[-2] not in "aeiou":
        return noun[:-1] + "ies"
    return noun + "s"


def _third(verb: str) -> str:
    irregular = {"have": "has", "do": "does", "go": "goes"}
    if verb in irregular:
        return irregular[verb]
    if verb.endswith(("s", "x", "ch", "sh", "o")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def _past(verb: str) -> str:
    irregular = {
        "make": "made", "take": "took", "see": "saw", "know": "knew", "find": "found", "give": "gave",
        "tell": "told", "feel": "felt", "leave": "left", "keep": "kept", "begin": "began", "show": "showed",
        "hear": "heard", "run": "ran", "hold": "held", "bring": "brought", "write": "wrote", "stand": "stood",
        "lose": "lost", "pay": "paid", "meet": "met", "lead": "led", "understand": "understood",
        "speak": "spoke", "read": "read", "spend": "spent", "grow": "grew", "win": "won", "buy": "bought",
        "build": "built", "fall": "fell", "cut": "cut", "sell": "sold", "break": "broke", "hit": "hit",
        "eat": "ate", "catch": "caught", "draw": "drew", "choose": "chose", "send": "sent", "set": "set",
    }
    if verb in irregular:
        return irregular[verb]
    if verb.endswith("e"):
        return verb + "d"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ied"
    return verb + "ed"


def _np(r: _SplitMix64) -> tuple[str, bool]:
    """A noun phrase and whether it is plural."""
    k = r.below(10)
    if k < 5:
        adj = (r.choice(ADJECTIVES) + " ") if r.chance(45) else ""
        return f"{r.choice(DETERMINERS)} {adj}{r.choice(NOUNS)}", False
    if k < 7:
        adj = (r.choice(ADJECTIVES) + " ") if r.chance(45) else ""
        return f"{r.choice(PLURAL_DETS)} {adj}{_plural(r.choice(NOUNS))}", True
    if k < 9:
        return r.choice(NAMES), False
    return f"the {r.choice(NOUNS)} of {r.choice(NAMES)}", False


def _clause(r: _SplitMix64) -> str:
    subj, plural = _np(r)
    tense = r.below(3)
    verb = r.choice(VERBS)
    if tense == 0:
        v = _past(verb)
    elif tense == 1:
        v = verb if plural else _third(verb)
    else:
        v = "will " + verb
    obj, _ = _np(r)
    s = f"{subj} {v} {obj}"
    if r.chance(40):
        pobj, _ = _np(r)
        s += f" {r.choice(PREPOSITIONS)} {pobj}"
    if r.chance(20):
        s += " " + r.choice(ADVERBS)
    return s


def _sentence(r: _SplitMix64) -> str:
    k = r.below(12)
    if k < 6:
        s = _clause(r)
    elif k < 8:
        s = f"{_clause(r)} {r.choice(CONJUNCTIONS)} {_clause(r)}"
    elif k == 8:
        s = f"{r.choice(CONJUNCTIONS).capitalize()} {_clause(r)}, {_clause(r)}"
    elif k == 9:
        obj, _ = _np(r)
        q = f"{r.choice(['Why', 'How', 'When', 'Where'])} did {r.choice(NAMES)} {r.choice(VERBS)} {obj}?"
        return q
    elif k == 10:
        return f'"{_clause(r)[0].upper() + _clause(r)[1:]}," said {r.choice(NAMES)}.'
    else:
        n = r.between(2, 1999)
        s = f"in {r.between(1890, 2030)}, {n} {_plural(r.choice(NOUNS))} {r.choice(['were', 'are'])} {r.choice(ADJECTIVES)}"
    s = s[0].upper() + s[1:]
    return s + r.choice([".", ".", ".", ".", "!", ";", "."]).replace(";", ".")


def _prose_doc(r: _SplitMix64) -> str:
    title = f"{r.choice(ADJECTIVES).capitalize()} {_plural(r.choice(NOUNS))} in {r.choice(PLACES)}"
    paras = []
    for _ in range(r.between(2, 5)):
        paras.append(" ".join(_sentence(r) for _ in range(r.between(3, 7))))
    head = title if r.chance(50) else f"# {title}"
    return head + "\n\n" + "\n\n".join(paras) + "\n"


def _ident(r: _SplitMix64) -> str:
    return f"{r.choice(VERBS)}_{r.choice(CODE_NAMES)}"


def _py_doc(r: _SplitMix64) -> str:
    out = []
    for m in r.sample(MODULES, r.between(1, 3)):
        out.append(f"import {m}")
    if r.chance(50):
        out.append(f"from {r.choice(MODULES)} import {r.choice(CODE_NAMES)}")
    out.append("")
    for _ in range(r.between(1, 3)):
        name = _ident(r)
        args = r.sample(CODE_NAMES, r.between(1, 3))
        sig = ", ".join(f"{a}: {r.choice(CODE_TYPES)}" if r.chance(50) else a for a in args)
        ret = f" -> {r.choice(CODE_TYPES)}" if r.chance(50) else ""
        if r.chance(30):
            cls = "".join(p.capitalize() for p in _ident(r).split("_"))
            out.append(f"class {cls}:")
            out.append(f'    """{_sentence(r)}"""')
            out.append("")
            out.append(f"    def __init__(self, {sig}):")
            for a in args:
                out.append(f"        self.{a} = {a}")
            out.append("")
            out.append(f"    def {name}(self){ret}:")
            body_indent = "        "
            a0 = f"self.{args[0]}"
        else:
            out.append(f"def {name}({sig}){ret}:")
            body_indent = "    "
            a0 = args[0]
        out.append(f'{body_indent}"""{r.choice(VERBS).capitalize()} the {r.choice(NOUNS)} {r.choice(PREPOSITIONS)} the given {r.choice(CODE_NAMES)}."""')
        k = r.below(4)
        x = r.choice(["x", "item", "row", "tok", "elem", "entry"])
        if k == 0:
            out += [
                f"{body_indent}result = []",
                f"{body_indent}for {x} in {a0}:",
                f"{body_indent}    if {x}.{r.choice(ATTRS)} > {r.between(0, 100)}:",
                f"{body_indent}        result.append({x})",
                f"{body_indent}return result",
            ]
        elif k == 1:
            out += [
                f"{body_indent}total = 0",
                f"{body_indent}for i, {x} in enumerate({a0}):",
                f"{body_indent}    total += {x} * {r.between(2, 9)}",
                f"{body_indent}    if total >= {r.between(10, 5000)}:",
                f"{body_indent}        break",
                f"{body_indent}return total",
            ]
        elif k == 2:
            out += [
                f"{body_indent}try:",
                f"{body_indent}    with open({a0}, \"r\", encoding=\"utf-8\") as f:",
                f"{body_indent}        return json.load(f)",
                f"{body_indent}except (OSError, ValueError) as exc:",
                f"{body_indent}    raise RuntimeError(f\"cannot {r.choice(VERBS)} {{{a0}!r}}: {{exc}}\") from exc",
            ]
        else:
            out += [
                f"{body_indent}if not {a0}:",
                f"{body_indent}    return None",
                f"{body_indent}{r.choice(CODE_NAMES)} = {{k: v for k, v in {a0}.items() if v is not None}}",
                f"{body_indent}print(f\"{r.choice(VERBS)}: {{len({a0})}} {r.choice(CODE_NAMES)}\")",
                f"{body_indent}return {r.choice(['len', 'sorted', 'list', 'tuple'])}({a0})",
            ]
        out.append("")
    if r.chance(40):
        out += ['if __name__ == "__main__":', f"    {_ident(r)}(sys.argv[1:])", ""]
    return "\n".join(out)


def _other_code_doc(r: _SplitMix64) -> str:
    k = r.below(4)
    if k == 0:  # JavaScript
        name = "".join([r.choice(VERBS)] + [r.choice(CODE_NAMES).capitalize()])
        a, b = r.sample(CODE_NAMES, 2)
        return (
            f"export async function {name}({a}, {b} = {{}}) {{\n"
            f"  const res = await fetch(`/api/{r.choice(CODE_NAMES)}/${{{a}}}`, {{ method: \"{r.choice(['GET', 'POST', 'PUT'])}\" }});\n"
            f"  if (!res.ok) {{\n    throw new Error(`request failed: ${{res.status}}`);\n  }}\n"
            f"  const {r.choice(CODE_NAMES)} = await res.json();\n"
            f"  return {{ ...{b}, {a}, ok: true, count: {r.between(0, 99)} }};\n}}\n"
        )
    if k == 1:  # shell
        lines = ["#!/usr/bin/env bash", "set -euo pipefail"]
        for _ in range(r.between(2, 5)):
            lines.append(r.choice([
                f"mkdir -p build/{r.choice(CODE_NAMES)}",
                f"cp -r src/{r.choice(CODE_NAMES)} /tmp/{r.choice(CODE_NAMES)}",
                f"grep -rn \"{r.choice(VERBS)}\" . | head -n {r.between(5, 50)}",
                f"python -m pytest tests/test_{r.choice(CODE_NAMES)}.py -q",
                f"echo \"{_clause(r)}\" >> log.txt",
                "git log --oneline | wc -l",
                f"export {r.choice(CODE_NAMES).upper()}_DIR=\"$HOME/.cache/{r.choice(CODE_NAMES)}\"",
            ]))
        return "\n".join(lines) + "\n"
    if k == 2:  # SQL
        t = _plural(r.choice(NOUNS))
        c1, c2 = r.sample(JSON_KEYS, 2)
        return (
            f"SELECT {c1}, COUNT(*) AS n, AVG({c2}) AS avg_{c2}\nFROM {t}\n"
            f"WHERE {c1} IS NOT NULL AND {c2} > {r.between(1, 500)}\nGROUP BY {c1}\nORDER BY n DESC\nLIMIT {r.between(1, 100)};\n"
        )
    # C-like
    n = r.choice(CODE_NAMES)
    return (
        f"static int {r.choice(VERBS)}_{n}(const float *{n}, int len) {{\n"
        f"    int count = 0;\n    for (int i = 0; i < len; ++i) {{\n"
        f"        if ({n}[i] > {r.between(0, 9)}.{r.between(0, 9)}f) {{\n            count += {r.between(1, 4)};\n        }}\n    }}\n"
        f"    return count;\n}}\n"
    )


def _json_value(r: _SplitMix64, depth: int):
    k = r.below(8 if depth < 2 else 5)
    if k == 0:
        return r.between(-100, 100000)
    if k == 1:
        return r.between(0, 99999) / 100
    if k == 2:
        return r.choice([True, False, None])
    if k in (3, 4):
        return r.choice([r.choice(NOUNS), r.choice(NAMES), r.choice(PLACES), _clause(r), r.choice(TOPICS)])
    if k == 5:
        return [_json_value(r, depth + 1) for _ in range(r.between(0, 4))]
    return {key: _json_value(r, depth + 1) for key in r.sample(JSON_KEYS, r.between(1, 5))}


def _tool_schema(r: _SplitMix64) -> dict:
    params = r.sample(TOOL_PARAMS, r.between(1, 3))
    return {
        "type": "function",
        "function": {
            "name": r.choice(TOOL_NAMES),
            "description": _sentence(r),
            "parameters": {
                "type": "object",
                "properties": {
                    p: {"type": r.choice(["string", "string", "integer", "boolean"]), "description": f"The {p.replace('_', ' ')}"}
                    for p in params
                },
                "required": params[: r.between(1, len(params))],
            },
        },
    }


def _json_doc(r: _SplitMix64) -> str:
    if r.chance(30):
        obj = _tool_schema(r)
    else:
        obj = {key: _json_value(r, 0) for key in r.sample(JSON_KEYS, r.between(2, 7))}
    if r.chance(50):
        return json.dumps(obj, ensure_ascii=False, indent=2) + "\n"
    return json.dumps(obj, ensure_ascii=False) + "\n"


def _agent_doc(r: _SplitMix64) -> str:
    """Reasoning and XML tool-call snippets (no ChatML control tokens)."""
    tool = r.choice(TOOL_NAMES)
    params = r.sample(TOOL_PARAMS, r.between(1, 3))
    out = [
        "<think>",
        f"The user wants to {r.choice(VERBS)} {_np(r)[0]}. {_sentence(r)} I should call {tool}.",
        "</think>",
        "",
    ]
    if r.chance(50):
        out.append(f"Let me {r.choice(VERBS)} that for you.")
        out.append("")
    out += ["<tool_call>", f"<function={tool}>"]
    for p in params:
        val = r.choice([r.choice(PLACES), str(r.between(1, 500)), r.choice(NOUNS), f"/home/{r.choice(NAMES).lower()}/{r.choice(CODE_NAMES)}.txt"])
        out += [f"<parameter={p}>", val, "</parameter>"]
    out += ["</function>", "</tool_call>"]
    resp = {"result": _json_value(r, 1), "ok": r.choice([True, False])}
    out += ["<tool_response>", json.dumps(resp, ensure_ascii=False), "</tool_response>"]
    out.append(f"{_sentence(r)} {_sentence(r)}")
    return "\n".join(out) + "\n"


def _foreign_doc(r: _SplitMix64) -> str:
    lines = []
    for _ in range(r.between(2, 5)):
        lang = r.choice(sorted(FOREIGN))
        words = [r.choice(FOREIGN[lang]) for _ in range(r.between(4, 12))]
        sep = "" if lang in ("zh", "ja") else " "
        line = sep.join(words)
        end = {"zh": "。", "ja": "。"}.get(lang, ".")
        if r.chance(25):
            line += " " + r.choice(EMOJI)
        lines.append(line + end)
    return "\n".join(lines) + "\n"


def _markdown_doc(r: _SplitMix64) -> str:
    out = [f"## {r.choice(TOPICS).capitalize()}", ""]
    for i in range(r.between(2, 5)):
        bullet = f"{i + 1}." if r.chance(50) else r.choice(["-", "*"])
        out.append(f"{bullet} **{r.choice(ADJECTIVES)} {r.choice(NOUNS)}**: {_sentence(r)}")
    out.append("")
    a, b = r.between(1, 999), r.between(1, 999)
    out.append(f"We have {a} {r.choice(SYMBOLS)} {b} = {a * b}, and {a} + {b} = {a + b}; see `{_ident(r)}()` {r.choice(EMOJI)}.")
    out.append("")
    out.append("| name | value | unit |")
    out.append("|------|-------|------|")
    for _ in range(r.between(1, 4)):
        out.append(f"| {r.choice(CODE_NAMES)} | {r.between(0, 9999) / 10} | {r.choice(['ms', 'MB', 'GB', '%', 'tok/s', '°C'])} |")
    return "\n".join(out) + "\n"


def corpus_documents(target_chars: int = 360_000) -> list[str]:
    """The tokenizer training corpus: a fixed list of documents (same on every run/machine)."""
    r = _SplitMix64(CORPUS_SEED)
    makers = (
        [_prose_doc] * 9 + [_py_doc] * 4 + [_other_code_doc] * 2 + [_json_doc] * 3
        + [_agent_doc] * 2 + [_foreign_doc] * 2 + [_markdown_doc] * 2
    )
    docs: list[str] = []
    total = 0
    while total < target_chars:
        d = r.choice(makers)(r)
        docs.append(d)
        total += len(d)
    return docs


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def _pipeline_json() -> dict:
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": PRETOKENIZE_REGEX}, "behavior": "Isolated", "invert": False},
                dict(byte_level),
            ],
        },
        "post_processor": dict(byte_level),
        "decoder": dict(byte_level),
    }


def _train_bpe(docs: list[str]) -> tuple[dict[str, int], list[list[str]]]:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    pipe = _pipeline_json()
    tok = Tokenizer(models.BPE())
    # Build the normaliser / pre-tokeniser from the same JSON that ends up in tokenizer.json.
    skeleton = json.loads(tok.to_str())
    skeleton.update({k: pipe[k] for k in ("normalizer", "pre_tokenizer")})
    tok = Tokenizer.from_str(json.dumps(skeleton))
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    merges = [m.split(" ") if isinstance(m, str) else list(m) for m in model["merges"]]
    if len(vocab) != BPE_VOCAB_SIZE:
        raise RuntimeError(f"BPE training produced {len(vocab)} tokens, expected {BPE_VOCAB_SIZE}")
    if sorted(vocab.values()) != list(range(BPE_VOCAB_SIZE)):
        raise RuntimeError("BPE vocabulary ids are not contiguous")
    return vocab, merges


def _tokenizer_json(vocab: dict[str, int], merges: list[list[str]]) -> dict:
    pipe = _pipeline_json()
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": TOKEN_ID[content],
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": special,
            }
            for content, special in ADDED_TOKENS
        ],
        "normalizer": pipe["normalizer"],
        "pre_tokenizer": pipe["pre_tokenizer"],
        "post_processor": pipe["post_processor"],
        "decoder": pipe["decoder"],
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": dict(sorted(vocab.items(), key=lambda kv: kv[1])),
            "merges": merges,
        },
    }


def _tokenizer_config() -> dict:
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(TOKEN_ID[content]): {
                "content": content,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for content, special in ADDED_TOKENS
        },
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "extra_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "model_max_length": MAX_POS,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        # Not Qwen2Tokenizer: transformers 5 rebuilds that class's pipeline with the Qwen2 regex
        # (no \p{M}); Qwen3_5Tokenizer uses exactly the regex written in tokenizer.json.
        "tokenizer_class": "Qwen3_5Tokenizer",
        "unk_token": None,
    }


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def _rng(name: str) -> np.random.Generator:
    digest = hashlib.sha256(f"{SEED}:{name}".encode()).digest()
    return np.random.Generator(np.random.PCG64([SEED, int.from_bytes(digest[:8], "little")]))


def _normal(name: str, shape: tuple[int, ...], std: float, mean: float = 0.0) -> np.ndarray:
    # Element-wise float64 ops only (exactly rounded), then one rounding to float32.
    return (_rng(name).standard_normal(shape) * std + mean).astype(np.float32)


def _uniform(name: str, shape: tuple[int, ...], lo: float, hi: float) -> np.ndarray:
    return _rng(name).uniform(lo, hi, shape)  # float64


def _bigram_successors(tokenizer, docs: list[str], k: int = 4) -> list[tuple[int, int, int]]:
    """(prev, next, count) for the top-k successors of every token in the corpus."""
    enc = tokenizer.encode_batch(docs, add_special_tokens=False)
    seqs = [np.asarray(e.ids + [IM_END_ID], dtype=np.int64) for e in enc]
    prev = np.concatenate([s[:-1] for s in seqs])
    nxt = np.concatenate([s[1:] for s in seqs])
    pairs, counts = np.unique(prev * VOCAB_SIZE + nxt, return_counts=True)
    p, n = pairs // VOCAB_SIZE, pairs % VOCAB_SIZE
    # Per prev: by count descending, then next id ascending.
    order = np.lexsort((n, -counts, p))
    out, last, rank = [], -1, 0
    for i in order.tolist():
        pi = int(p[i])
        rank = rank + 1 if pi == last else 0
        last = pi
        if rank < k:
            out.append((pi, int(n[i]), int(counts[i])))
    return out


def _build_weights(tokenizer, docs: list[str]) -> dict[str, np.ndarray]:
    D, I, V = HIDDEN, INTERMEDIATE, VOCAB_SIZE
    w: dict[str, np.ndarray] = {}

    def lin(name: str, out_f: int, in_f: int, gain: float = 1.0) -> None:
        w[name] = _normal(name, (out_f, in_f), gain / math.sqrt(in_f))

    def znorm(name: str, n: int) -> None:  # zero-centred RMSNorm: y = x_hat * (1 + w)
        w[name] = _normal(name, (n,), 0.1)

    def attention(prefix: str, out_gain: float = 1.0) -> None:
        lin(prefix + "q_proj.weight", NUM_HEADS * HEAD_DIM * 2, D)
        lin(prefix + "k_proj.weight", NUM_KV_HEADS * HEAD_DIM, D)
        lin(prefix + "v_proj.weight", NUM_KV_HEADS * HEAD_DIM, D)
        lin(prefix + "o_proj.weight", D, NUM_HEADS * HEAD_DIM, out_gain * OUT_GAIN)
        znorm(prefix + "q_norm.weight", HEAD_DIM)
        znorm(prefix + "k_norm.weight", HEAD_DIM)

    def mlp(prefix: str, out_gain: float = 1.0) -> None:
        lin(prefix + "gate_proj.weight", I, D)
        lin(prefix + "up_proj.weight", I, D)
        lin(prefix + "down_proj.weight", D, I, out_gain * OUT_GAIN)

    # Token embedding: unit-variance random vectors (rows for the padded ids are tiny).
    emb = _normal("model.embed_tokens.weight", (V, D), 1.0)
    emb[N_TOKENS:] *= np.float32(0.01)
    w["model.embed_tokens.weight"] = emb

    key_dim, value_dim = LIN_K_HEADS * LIN_K_DIM, LIN_V_HEADS * LIN_V_DIM
    conv_dim = 2 * key_dim + value_dim
    for i, kind in enumerate(LAYER_TYPES):
        p = f"model.layers.{i}."
        if kind == "linear_attention":
            la = p + "linear_attn."
            lin(la + "in_proj_qkv.weight", conv_dim, D)
            lin(la + "in_proj_z.weight", value_dim, D)
            lin(la + "in_proj_b.weight", LIN_V_HEADS, D)
            lin(la + "in_proj_a.weight", LIN_V_HEADS, D)
            w[la + "conv1d.weight"] = _normal(la + "conv1d.weight", (conv_dim, 1, CONV_KERNEL), 1.0 / math.sqrt(CONV_KERNEL))
            # g = -exp(A_log) * softplus(a + dt_bias): A in [1, 8]; dt_bias spread so that some
            # heads forget within a few tokens and others keep state over hundreds (decay ~0.99),
            # which makes chunk-to-chunk state passing matter in parity tests.
            a = _uniform(la + "A_log", (LIN_V_HEADS,), 1.0, 8.0)
            w[la + "A_log"] = np.array([math.log(x) for x in a.tolist()], dtype=np.float32)
            shift = np.linspace(0.0, -6.0, LIN_V_HEADS)  # exact for 4 heads: 0, -2, -4, -6
            w[la + "dt_bias"] = (_rng(la + "dt_bias").standard_normal(LIN_V_HEADS) * 0.5 + shift).astype(np.float32)
            w[la + "norm.weight"] = _normal(la + "norm.weight", (LIN_V_DIM,), 0.1, 1.0)  # plain scale around 1
            lin(la + "out_proj.weight", D, value_dim, OUT_GAIN)
        else:
            attention(p + "self_attn.")
        mlp(p + "mlp.")
        znorm(p + "input_layernorm.weight", D)
        znorm(p + "post_attention_layernorm.weight", D)
    znorm("model.norm.weight", D)

    # lm_head = random part + a "bigram" part: if the final hidden state points along
    # embed[v], the corpus' frequent successors of v get a logit boost (a deterministic,
    # BLAS-free construction: element-wise products accumulated with np.add.at).
    head = _normal("lm_head.weight", (V, D), HEAD_NOISE / math.sqrt(D)).astype(np.float64)
    succ = _bigram_successors(tokenizer, docs)
    top: dict[int, int] = {}
    for pv, _, c in succ:
        top[pv] = max(top.get(pv, 0), c)
    boost, cap = BIGRAM_BOOST, BIGRAM_CAP
    coef = [(pv, nx, boost * c / top[pv]) for pv, nx, c in succ]
    energy: dict[int, list[float]] = {}
    for _, nx, s in coef:
        energy.setdefault(nx, []).append(s * s)
    # Keep the cross-talk of tokens with many predecessors bounded: std <= cap logits.
    scale = {nx: min(1.0, cap / math.sqrt(math.fsum(e) / D)) for nx, e in energy.items()}
    prev_ids = np.array([pv for pv, _, _ in coef], dtype=np.int64)
    next_ids = np.array([nx for _, nx, _ in coef], dtype=np.int64)
    weight = np.array([s * scale[nx] / D for _, nx, s in coef], dtype=np.float64)
    np.add.at(head, next_ids, weight[:, None] * emb[prev_ids].astype(np.float64))
    head[N_TOKENS:] *= 0.01
    w["lm_head.weight"] = head.astype(np.float32)

    # MTP head (vLLM names). fc's embedding half is close to the identity, so the draft for
    # token t+2 is roughly the bigram successor of token t+1: speculative decoding gets a
    # non-trivial but imperfect acceptance rate.
    fc = _normal("mtp.fc.weight", (D, 2 * D), 0.5 / math.sqrt(2 * D))
    fc[:, :D] += np.eye(D, dtype=np.float32)
    w["mtp.fc.weight"] = fc
    znorm("mtp.pre_fc_norm_embedding.weight", D)
    znorm("mtp.pre_fc_norm_hidden.weight", D)
    attention("mtp.layers.0.self_attn.", out_gain=0.5)
    mlp("mtp.layers.0.mlp.", out_gain=0.5)
    znorm("mtp.layers.0.input_layernorm.weight", D)
    znorm("mtp.layers.0.post_attention_layernorm.weight", D)
    znorm("mtp.norm.weight", D)
    return w


def _write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Minimal, version-independent safetensors writer (float32, names sorted)."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs, offset = [], 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name], dtype="<f4")
        data = arr.tobytes()
        header[name] = {"dtype": "F32", "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for b in blobs:
            f.write(b)


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def _dump_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=2) + "\n", encoding="utf-8", newline="\n")


def generate(out_dir: Path) -> Path:
    """Write the tiny default model into ``out_dir`` (created if needed) and return it."""
    from tokenizers import Tokenizer

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    docs = corpus_documents()
    vocab, merges = _train_bpe(docs)
    tok_json = _tokenizer_json(vocab, merges)
    tok_text = json.dumps(tok_json, ensure_ascii=False, indent=2) + "\n"
    tokenizer = Tokenizer.from_str(tok_text)
    if tokenizer.get_vocab_size(with_added_tokens=True) != N_TOKENS:
        raise RuntimeError("unexpected tokenizer size")

    (out_dir / "tokenizer.json").write_text(tok_text, encoding="utf-8", newline="\n")
    _dump_json(out_dir / "tokenizer_config.json", _tokenizer_config())
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE, encoding="utf-8", newline="\n")
    _dump_json(out_dir / "config.json", CONFIG)
    _dump_json(out_dir / "generation_config.json", GENERATION_CONFIG)
    _write_safetensors(out_dir / "model.safetensors", _build_weights(tokenizer, docs))
    return out_dir


def _main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0] in ("-h", "--help"):
        print("usage: python -m ninfer_mlc.compile.tiny_default OUT_DIR", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    out = generate(Path(argv[0]))
    dt = time.perf_counter() - t0
    for f in sorted(out.iterdir()):
        if f.is_file():
            digest = hashlib.sha256(f.read_bytes()).hexdigest()
            print(f"{digest}  {f.stat().st_size:>9}  {f.name}")
    print(f"wrote {out} in {dt:.2f}s")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
