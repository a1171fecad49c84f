"""Request bodies and error answers of the OpenAPI document (``/openapi.json``).

The routes read their JSON bodies by hand (server/fields.py), so that every bad field is a 400 worded
as the imitated API words it; FastAPI therefore cannot derive their request schemas. The JSON Schemas
here describe the bodies each route takes, as the real OpenAI and Anthropic APIs document them, for
clients and code generators reading /openapi.json and for the schema-driven fuzz test
(tests/test_server_fuzz.py), which generates requests from them. They describe shapes; the values a
route refuses (a context overflow, a schema xgrammar cannot compile, n > 1 ...) are its 400 answers.
"""
from __future__ import annotations

from typing import Any

# ---- building blocks ----------------------------------------------------------------------
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}
_INT = {"type": "integer"}
_POS_INT = {"type": "integer", "minimum": 1}
_NULLABLE_POS_INT = {"type": ["integer", "null"], "minimum": 1}
_OBJ = {"type": "object"}


def _obj(props: dict, required: tuple = ()) -> dict:
    out: dict = {"type": "object", "properties": props}
    if required:
        out["required"] = list(required)
    return out


def _num(lo: float, hi: float) -> dict:
    return {"type": ["number", "null"], "minimum": lo, "maximum": hi}


# a tool's parameters: any JSON Schema; described by the keys the APIs read from one
TOOL_PARAMETERS = _obj({
    "type": {"const": "object"},
    "properties": {"type": "object", "additionalProperties": _obj({
        "type": {"enum": ["string", "integer", "number", "boolean", "array", "object", "null"]},
        "description": _STR, "enum": {"type": "array"}})},
    "required": {"type": "array", "items": _STR},
    "additionalProperties": _BOOL,
})
_STOP = {"oneOf": [_STR, {"type": "array", "items": _STR, "maxItems": 4}, {"type": "null"}]}

# ---- OpenAI chat completions ----------------------------------------------------------------
_TEXT_PART = _obj({"type": {"const": "text"}, "text": _STR}, ("type", "text"))
_IMAGE_PART = _obj({"type": {"const": "image_url"},
                    "image_url": _obj({"url": _STR, "detail": {"enum": ["auto", "low", "high"]}}, ("url",))},
                   ("type", "image_url"))
_CHAT_CONTENT = {"oneOf": [_STR, {"type": "array", "items": {"oneOf": [_TEXT_PART, _IMAGE_PART]}}]}
_CHAT_TOOL_CALL = _obj({"id": _STR, "type": {"const": "function"},
                        "function": _obj({"name": _STR, "arguments": _STR}, ("name", "arguments"))},
                       ("id", "type", "function"))
_CHAT_MESSAGE = {"oneOf": [
    _obj({"role": {"enum": ["system", "developer", "user"]}, "content": _CHAT_CONTENT, "name": _STR},
         ("role", "content")),
    _obj({"role": {"const": "assistant"}, "content": {"oneOf": [_CHAT_CONTENT, {"type": "null"}]},
          "reasoning_content": _STR, "tool_calls": {"type": "array", "items": _CHAT_TOOL_CALL}}, ("role",)),
    _obj({"role": {"const": "tool"}, "content": _CHAT_CONTENT, "tool_call_id": _STR},
         ("role", "content", "tool_call_id")),
]}
_CHAT_TOOL = _obj({"type": {"const": "function"},
                   "function": _obj({"name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                                     "description": _STR, "parameters": TOOL_PARAMETERS, "strict": _BOOL},
                                    ("name",))},
                  ("type", "function"))
_CHAT_TOOL_CHOICE = {"oneOf": [
    {"enum": ["none", "auto", "required"]},
    _obj({"type": {"const": "function"}, "function": _obj({"name": _STR}, ("name",))}, ("type", "function")),
]}
_RESPONSE_FORMAT = {"oneOf": [
    _obj({"type": {"enum": ["text", "json_object"]}}, ("type",)),
    _obj({"type": {"const": "json_schema"},
          "json_schema": _obj({"name": _STR, "schema": TOOL_PARAMETERS, "strict": _BOOL}, ("name",))},
         ("type", "json_schema")),
]}
_SAMPLING = {
    "temperature": _num(0, 2), "top_p": _num(0, 1), "top_k": {"type": ["integer", "null"], "minimum": -1},
    "min_p": _num(0, 1), "presence_penalty": _num(-2, 2), "frequency_penalty": _num(-2, 2),
    "repetition_penalty": {"type": ["number", "null"], "exclusiveMinimum": 0}, "seed": {"type": ["integer", "null"]},
    "stop": _STOP, "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 128},
    "logit_bias": {"type": ["object", "null"], "propertyNames": {"pattern": "^[0-9]+$"},
                   "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}},
    "ignore_eos": _BOOL, "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "user": _STR, "stream": {"type": ["boolean", "null"]},
    "stream_options": {"oneOf": [_obj({"include_usage": _BOOL}), {"type": "null"}]},
    "max_tokens": _NULLABLE_POS_INT,
}
CHAT_REQUEST = _obj({
    "model": _STR, "messages": {"type": "array", "items": _CHAT_MESSAGE, "minItems": 1},
    **_SAMPLING, "max_completion_tokens": _NULLABLE_POS_INT,
    "logprobs": {"type": ["boolean", "null"]}, "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
    "tools": {"type": "array", "items": _CHAT_TOOL}, "tool_choice": _CHAT_TOOL_CHOICE,
    "parallel_tool_calls": _BOOL, "response_format": _RESPONSE_FORMAT,
    "chat_template_kwargs": _obj({"enable_thinking": _BOOL, "preserve_thinking": _BOOL}),
    "reasoning_effort": {"enum": ["none", "minimal", "low", "medium", "high", "xhigh"]},
    "prompt_cache_key": _STR,
}, ("messages",))

# ---- OpenAI legacy completions -------------------------------------------------------------
COMPLETION_REQUEST = _obj({
    "model": _STR,
    "prompt": {"oneOf": [_STR, {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
                         {"type": "array", "items": _STR, "minItems": 1, "maxItems": 1}]},
    **_SAMPLING, "echo": _BOOL, "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
    "best_of": {"type": ["integer", "null"], "minimum": 1}, "suffix": {"type": ["string", "null"]},
}, ("prompt",))

# ---- Anthropic messages --------------------------------------------------------------------
_CACHE_CONTROL = _obj({"type": {"const": "ephemeral"}, "ttl": {"enum": ["5m", "1h"]}}, ("type",))
_A_TEXT = _obj({"type": {"const": "text"}, "text": _STR, "cache_control": _CACHE_CONTROL}, ("type", "text"))
_A_IMAGE = _obj({"type": {"const": "image"}, "source": {"oneOf": [
    _obj({"type": {"const": "base64"}, "media_type": {"enum": ["image/png", "image/jpeg", "image/gif", "image/webp"]},
          "data": _STR}, ("type", "media_type", "data")),
    _obj({"type": {"const": "url"}, "url": _STR}, ("type", "url"))]}}, ("type", "source"))
_A_TOOL_USE = _obj({"type": {"const": "tool_use"}, "id": _STR, "name": _STR, "input": _OBJ},
                   ("type", "id", "name", "input"))
_A_TOOL_RESULT = _obj({"type": {"const": "tool_result"}, "tool_use_id": _STR, "is_error": _BOOL,
                       "content": {"oneOf": [_STR, {"type": "array", "items": _A_TEXT}]}}, ("type", "tool_use_id"))
_A_THINKING = _obj({"type": {"const": "thinking"}, "thinking": _STR, "signature": _STR},
                   ("type", "thinking", "signature"))
_A_MESSAGE = _obj({"role": {"enum": ["user", "assistant"]}, "content": {"oneOf": [
    _STR, {"type": "array", "items": {"oneOf": [_A_TEXT, _A_IMAGE, _A_TOOL_USE, _A_TOOL_RESULT, _A_THINKING]}}]}},
    ("role", "content"))
_A_TOOL = _obj({"name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}, "description": _STR,
                "input_schema": TOOL_PARAMETERS, "strict": _BOOL, "cache_control": _CACHE_CONTROL},
               ("name", "input_schema"))
_A_TOOL_CHOICE = {"oneOf": [
    _obj({"type": {"enum": ["auto", "any", "none"]}, "disable_parallel_tool_use": _BOOL}, ("type",)),
    _obj({"type": {"const": "tool"}, "name": _STR, "disable_parallel_tool_use": _BOOL}, ("type", "name")),
]}
_A_THINKING_CFG = {"oneOf": [
    _obj({"type": {"const": "enabled"}, "budget_tokens": {"type": "integer", "minimum": 1024}},
         ("type", "budget_tokens")),
    _obj({"type": {"enum": ["disabled", "adaptive"]}}, ("type",)),
]}
_A_COMMON = {
    "model": _STR, "messages": {"type": "array", "items": _A_MESSAGE, "minItems": 1},
    "system": {"oneOf": [_STR, {"type": "array", "items": _A_TEXT}]},
    "tools": {"type": "array", "items": _A_TOOL}, "tool_choice": _A_TOOL_CHOICE, "thinking": _A_THINKING_CFG,
    "output_config": _obj({"effort": {"enum": ["low", "medium", "high", "max"]},
                           "format": _obj({"type": {"const": "json_schema"}, "schema": TOOL_PARAMETERS},
                                          ("type", "schema"))}),
}
MESSAGES_REQUEST = _obj({
    **_A_COMMON, "max_tokens": _POS_INT, "stop_sequences": {"type": "array", "items": _STR},
    "stream": _BOOL, "temperature": {"type": "number", "minimum": 0, "maximum": 1},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1}, "top_k": _POS_INT,
    "metadata": _obj({"user_id": {"type": ["string", "null"]}}),
}, ("model", "max_tokens", "messages"))
COUNT_TOKENS_REQUEST = _obj(_A_COMMON, ("model", "messages"))

# ---- OpenAI Responses ------------------------------------------------------------------------
_R_PART = {"oneOf": [_obj({"type": {"enum": ["input_text", "output_text"]}, "text": _STR}, ("type", "text")),
                     _obj({"type": {"const": "input_image"}, "image_url": _STR}, ("type",))]}
_R_ITEM = {"oneOf": [
    _obj({"type": {"const": "message"}, "role": {"enum": ["user", "assistant", "system", "developer"]},
          "content": {"oneOf": [_STR, {"type": "array", "items": _R_PART}]}}, ("role", "content")),
    _obj({"type": {"const": "function_call"}, "call_id": _STR, "name": _STR, "arguments": _STR},
         ("type", "call_id", "name", "arguments")),
    _obj({"type": {"const": "function_call_output"}, "call_id": _STR, "output": _STR},
         ("type", "call_id", "output")),
    _obj({"type": {"const": "reasoning"}, "summary": {"type": "array", "items": _obj(
        {"type": {"const": "summary_text"}, "text": _STR}, ("type", "text"))}, "encrypted_content": _STR},
        ("type", "summary")),
]}
_R_TOOL = {"oneOf": [
    _obj({"type": {"const": "function"}, "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
          "description": _STR, "parameters": TOOL_PARAMETERS, "strict": _BOOL}, ("type", "name")),
    _obj({"type": {"const": "custom"}, "name": _STR, "description": _STR}, ("type", "name")),
    _obj({"type": {"const": "web_search"}}, ("type",)),
]}
_R_TOOL_CHOICE = {"oneOf": [
    {"enum": ["none", "auto", "required"]},
    _obj({"type": {"const": "function"}, "name": _STR}, ("type", "name")),
]}
_R_FORMAT = {"oneOf": [
    _obj({"type": {"enum": ["text", "json_object"]}}, ("type",)),
    _obj({"type": {"const": "json_schema"}, "name": _STR, "schema": TOOL_PARAMETERS, "strict": _BOOL},
         ("type", "name", "schema")),
]}
RESPONSES_REQUEST = _obj({
    "model": _STR, "input": {"oneOf": [_STR, {"type": "array", "items": _R_ITEM}]}, "instructions": _STR,
    "max_output_tokens": _NULLABLE_POS_INT, "temperature": _num(0, 2), "top_p": _num(0, 1),
    "top_logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20},
    "stream": _BOOL, "store": _BOOL, "previous_response_id": {"type": ["string", "null"]},
    "tools": {"type": "array", "items": _R_TOOL}, "tool_choice": _R_TOOL_CHOICE, "parallel_tool_calls": _BOOL,
    "text": _obj({"format": _R_FORMAT}),
    "reasoning": _obj({"effort": {"enum": ["none", "minimal", "low", "medium", "high", "xhigh"]},
                       "summary": {"enum": ["auto", "concise", "detailed"]}}),
    "include": {"type": "array", "items": {"enum": ["reasoning.encrypted_content"]}},
    "metadata": {"type": "object", "additionalProperties": _STR}, "prompt_cache_key": _STR, "user": _STR,
    "truncation": {"enum": ["auto", "disabled"]},
}, ("model", "input"))

# ---- error answers -----------------------------------------------------------------------------
OPENAI_ERROR = _obj({"error": _obj({"message": _STR, "type": _STR, "param": {"type": ["string", "null"]},
                                    "code": {"type": ["string", "null"]}}, ("message", "type", "param", "code"))},
                    ("error",))
ANTHROPIC_ERROR = _obj({"type": {"const": "error"}, "error": _obj({"type": _STR, "message": _STR},
                                                                  ("type", "message"))}, ("type", "error"))
_ERROR_STATUSES = {400: "bad request: malformed JSON, a bad field (named in param / the message), a prompt over "
                        "the context", 401: "missing or wrong API key (--api-key)", 404: "unknown model or object",
                   413: "body over --max-request-mib", 429: "queue full; retry after Retry-After",
                   503: "queue deadline passed or engine stopped"}


# GET /v1/responses/{id}/input_items reads these from the query string
INPUT_ITEMS_QUERY = {"parameters": [
    {"name": "order", "in": "query", "required": False, "schema": {"enum": ["asc", "desc"]}},
    {"name": "limit", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
    {"name": "after", "in": "query", "required": False, "schema": _STR},
]}


def request_body(schema: dict) -> dict:
    """``openapi_extra`` of a route that reads ``schema`` as its JSON body."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def error_responses(anthropic: bool = False, statuses: Any = None) -> dict:
    """``responses`` of a route: its error answers in the route's error shape."""
    schema = ANTHROPIC_ERROR if anthropic else OPENAI_ERROR
    return {s: {"description": _ERROR_STATUSES[s], "content": {"application/json": {"schema": schema}}}
            for s in (statuses or _ERROR_STATUSES)}
