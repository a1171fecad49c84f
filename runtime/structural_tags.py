"""Constraint specs -> xgrammar structural tags (plain JSON, no xgrammar import).

A constraint spec is the plain dict the server parses out of a request (``GenRequest.constraint``):

- ``{"type": "json_object"}``: the answer is one JSON object.
- ``{"type": "json_schema", "schema": {...} | true, "strict": bool}``: the answer is JSON valid
  against the schema (``strict`` is accepted and always enforced).
- ``{"type": "tool_call", "mode": "required" | "named" | "auto", "tools": [...], "name": str,
  "parallel": bool}``: Qwen XML tool calls (``<tool_call>\\n<function=NAME>\\n<parameter=P>\\n
  value\\n</parameter>\\n</function>\\n</tool_call>``) whose parameters follow each tool's JSON
  schema, values written as Qwen writes them (strings as bare text, other types as JSON text).
  ``required``: the answer is one or more calls and nothing else; ``named``: exactly one call of
  ``name``; ``auto`` (strict tools): free text, and any call the model opens is completed with
  schema-valid arguments for tools marked ``strict`` (free-form arguments for the others).
  ``parallel`` false allows a single call.

A json spec may also carry ``tools`` (+ ``parallel``): the answer is then either the JSON document
or tool calls (a structured-output agent that still calls tools).

``tools`` are OpenAI function tools (``{"type": "function", "function": {name, parameters,
strict}}``) or the flat Responses form (``{"type": "function", "name", "parameters", "strict"}``).

The tool tags are the shape of xgrammar's built-in ``qwen_3_5`` structural tag (same begin/end
strings, ``qwen_xml`` argument style); ``required`` differs in allowing no free text around the
calls, so a forced call is what the client gets. When the prompt leaves the model inside
``<think>``, the tag starts with free reasoning up to ``</think>`` plus Qwen's blank line, so only
the answer is constrained.
"""
from __future__ import annotations

import json
from typing import Any, Optional

TOOL_CALL_TRIGGER = "<tool_call>\n<function="
TOOL_CALL_END = "\n</function>\n</tool_call>"
THINK_END = "</think>"
THINK_SUFFIX = "\n\n"
THINK_TAGS = ["<think>", "</think>"]
# Longest whitespace run inside constrained JSON answers (ample for pretty-printed output) and between
# XML arguments (Qwen writes one newline there; values that are JSON are compact): it keeps a
# degenerate model from padding forever. Free-text string arguments are not limited.
MAX_WHITESPACE = 16
MAX_XML_WHITESPACE = 4
SPEC_TYPES = ("json_object", "json_schema", "tool_call")
TOOL_MODES = ("required", "named", "auto")


class ConstraintError(ValueError):
    """A constraint spec that cannot be honoured. ``tool`` names the tool whose schema failed."""

    def __init__(self, message: str, tool: Optional[str] = None):
        super().__init__(message)
        self.tool = tool


def function_tools(tools: Any) -> list[tuple[str, Any, bool]]:
    """(name, parameters schema or True, strict) of each function tool, in order."""
    if not isinstance(tools, list) or not tools:
        raise ConstraintError("a tool constraint needs a non-empty list of function tools")
    out = []
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) and isinstance(t.get("function"), dict) else t
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ConstraintError(f"tool {j} has no name")
        params = fn.get("parameters")
        if params is None:
            params = True
        if not isinstance(params, (dict, bool)):
            raise ConstraintError(f"tool {fn['name']!r}: parameters must be a JSON schema object", tool=fn["name"])
        strict = fn.get("strict") is True or (isinstance(t, dict) and t.get("strict") is True)
        out.append((fn["name"], params, strict))
    names = [n for n, _, _ in out]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise ConstraintError(f"tool {dup!r} is declared twice", tool=dup)
    return out


def _reasoning_prefix() -> dict:
    return {"type": "sequence", "elements": [
        {"type": "tag", "begin": "", "content": {"type": "any_text", "excludes": THINK_TAGS}, "end": THINK_END},
        {"type": "const_string", "value": THINK_SUFFIX}]}


def tool_tag(name: str, schema: Any) -> dict:
    """One Qwen XML call of ``name`` with arguments following ``schema`` (True: any arguments)."""
    return {"type": "tag", "begin": f"{TOOL_CALL_TRIGGER}{name}>\n",
            "content": {"type": "json_schema", "json_schema": schema, "style": "qwen_xml",
                        "max_whitespace_cnt": MAX_XML_WHITESPACE},
            "end": TOOL_CALL_END}


def _json_format(schema: Any) -> dict:
    return {"type": "json_schema", "json_schema": schema, "style": "json", "max_whitespace_cnt": MAX_WHITESPACE}


def _calls_only(tags: list[dict], parallel: bool) -> dict:
    if len(tags) == 1 and not parallel:
        return tags[0]
    return {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
            "stop_after_first": not parallel}


def _tool_format(spec: dict) -> dict:
    mode = spec.get("mode")
    if mode not in TOOL_MODES:
        raise ConstraintError(f"tool_call mode must be one of {', '.join(TOOL_MODES)}, got {mode!r}")
    tools = function_tools(spec.get("tools"))
    parallel = spec.get("parallel", True) is not False
    if mode == "named":
        name = spec.get("name")
        match = [(n, s) for n, s, _ in tools if n == name]
        if not match:
            raise ConstraintError(f"the forced tool {name!r} is not among the request's tools")
        return tool_tag(*match[0])
    if mode == "required":
        return _calls_only([tool_tag(n, s) for n, s, _ in tools], parallel)
    return {"type": "triggered_tags", "triggers": [TOOL_CALL_TRIGGER],
            "tags": [tool_tag(n, s if strict else True) for n, s, strict in tools],
            "excludes": THINK_TAGS, "stop_after_first": not parallel}


def _answer_format(spec: dict) -> dict:
    if not isinstance(spec, dict):
        raise ConstraintError(f"a constraint must be an object, got {type(spec).__name__}")
    kind = spec.get("type")
    if kind == "tool_call":
        return _tool_format(spec)
    if kind == "json_object":
        fmt = _json_format({"type": "object"})
    elif kind == "json_schema":
        schema = spec.get("schema")
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError("json_schema needs a JSON schema object")
        fmt = _json_format(schema)
    else:
        raise ConstraintError(f"constraint type must be one of {', '.join(SPEC_TYPES)}, got {kind!r}")
    if spec.get("tools"):
        tags = [tool_tag(n, s) for n, s, _ in function_tools(spec["tools"])]
        fmt = {"type": "or", "elements": [fmt, _calls_only(tags, spec.get("parallel", True) is not False)]}
    return fmt


def structural_tag(spec: dict, reasoning: bool = False) -> dict:
    """The xgrammar structural tag for ``spec``; ``reasoning``: the prompt ends inside ``<think>``."""
    fmt = _answer_format(spec)
    if reasoning:
        fmt = {"type": "sequence", "elements": [_reasoning_prefix(), fmt]}
    return {"type": "structural_tag", "format": fmt}


def spec_key(spec: dict, reasoning: bool) -> str:
    """Canonical cache key of a spec (key order does not matter)."""
    try:
        return json.dumps([spec, bool(reasoning)], sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as e:
        raise ConstraintError(f"a constraint must be plain JSON: {e}") from None


def tool_schemas_for_errors(spec: dict) -> list[tuple[str, dict]]:
    """Single-tool structural tags of a spec, to find which tool's schema a failed compile came from."""
    tools = spec.get("tools")
    if not tools:
        return []
    try:
        return [(n, {"type": "structural_tag", "format": tool_tag(n, s)}) for n, s, _ in function_tools(tools)]
    except ConstraintError:
        return []
