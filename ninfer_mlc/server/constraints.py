"""Request fields -> constrained-decoding spec (runtime/structural_tags.py), one parser per API.

OpenAI chat: ``tool_choice`` "required" / a named function / ``allowed_tools`` (mode required),
``parallel_tool_calls``, ``response_format`` json_object / json_schema, ``strict`` function tools.
Anthropic: ``tool_choice`` any / tool (+ ``disable_parallel_tool_use``), ``output_config.format``
(json_schema), ``strict`` tools. A forced tool call wins over a response format, which wins over
strict tools; a response format with tools offered still lets the model call them.

Each parser returns ``(spec or None, the request field it came from)``; the field is what a 400
names when the spec cannot be compiled.
"""
from __future__ import annotations

from typing import Any, Optional

from .errors import bad_request
from .fields import type_name


Constraint = tuple[Optional[dict], str]
NO_CONSTRAINT: Constraint = (None, "")


def tool_name(tool: dict) -> Optional[str]:
    fn = tool["function"] if isinstance(tool.get("function"), dict) else tool
    return fn.get("name")


def _is_strict(tool: dict) -> bool:
    fn = tool["function"] if isinstance(tool.get("function"), dict) else tool
    return fn.get("strict") is True or tool.get("strict") is True


def _tool_spec(mode: str, tools: list[dict], parallel: bool, name: Optional[str] = None) -> dict:
    spec = {"type": "tool_call", "mode": mode, "tools": tools, "parallel": parallel}
    if name is not None:
        spec["name"] = name
    return spec


def _named(tools: Optional[list[dict]], name: Any, param: str) -> str:
    if not isinstance(name, str) or not name:
        raise bad_request(f"{param} must be a tool name", param=param)
    if not tools or name not in {tool_name(t) for t in tools}:
        raise bad_request(f"{param}: tool {name!r} is not in tools", param=param)
    return name


def _bool(body: dict, key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"{key} must be a boolean, got {type_name(v)}", param=key)
    return v


# ---- OpenAI -------------------------------------------------------------------------------------
def _openai_forced(raw: Any, tools: Optional[list[dict]], parallel: bool) -> Constraint:
    """The constraint a forcing tool_choice asks for (none for auto / none)."""
    if raw == "required":
        if not tools:
            raise bad_request("tool_choice 'required' needs tools", param="tool_choice")
        return (_tool_spec("required", tools, parallel), "tool_choice")
    if not isinstance(raw, dict):
        return NO_CONSTRAINT
    t = raw.get("type")
    if t == "function":
        fn = raw["function"] if isinstance(raw.get("function"), dict) else raw  # chat / Responses form
        name = _named(tools, fn.get("name"), "tool_choice")
        assert tools is not None  # _named accepts a name only from a non-empty tools list
        return (_tool_spec("named", tools, False, name), "tool_choice")
    if t == "allowed_tools":
        allowed = raw["allowed_tools"] if isinstance(raw.get("allowed_tools"), dict) else raw
        if allowed.get("mode", "auto") != "required":
            return NO_CONSTRAINT
        refs = allowed.get("tools")
        if not isinstance(refs, list) or not refs:
            raise bad_request("tool_choice.allowed_tools.tools must be a non-empty array",
                              param="tool_choice.allowed_tools.tools")
        names = {_named(tools, tool_name(r) if isinstance(r, dict) else None, "tool_choice.allowed_tools.tools")
                 for r in refs}
        assert tools is not None  # refs is non-empty, so _named checked at least one name against tools
        subset = [t for t in tools if tool_name(t) in names]
        return (_tool_spec("required", subset, parallel), "tool_choice")
    return NO_CONSTRAINT


def openai_response_format(raw: Any, param: str = "response_format") -> Optional[dict]:
    """Chat ``response_format`` (json_schema nested under ``json_schema``) or the Responses API's flat
    ``text.format`` (pass ``param="text.format"``) -> a json spec (None for text)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad_request(f"{param} must be an object, got {type_name(raw)}", param=param)
    t = raw.get("type")
    if t == "text":
        return None
    if t == "json_object":
        return {"type": "json_object"}
    if t == "json_schema":
        nested = "json_schema" in raw or "schema" not in raw
        js, p = (raw.get("json_schema"), f"{param}.json_schema") if nested else (raw, param)
        if not isinstance(js, dict):
            raise bad_request(f"{p} must be an object", param=p)
        schema = js.get("schema")
        if schema is None:
            return {"type": "json_object"}
        if not isinstance(schema, (dict, bool)):
            raise bad_request(f"{p}.schema must be a JSON schema object", param=f"{p}.schema")
        return {"type": "json_schema", "schema": schema, "strict": js.get("strict") is True}
    raise bad_request(f"{param}.type must be text, json_object or json_schema, got {t!r}", param=f"{param}.type")


def openai_constraint(body: dict, tools: Optional[list[dict]], allow_calls: bool,
                      fmt_param: str = "response_format") -> Constraint:
    """Chat completions: tool_choice, parallel_tool_calls, response_format, strict tools. The
    Responses API passes ``fmt_param="text.format"`` (read from ``body["text"]["format"]``)."""
    parallel = _bool(body, "parallel_tool_calls", True)
    offered = tools if allow_calls else None
    forced = _openai_forced(body.get("tool_choice"), offered, parallel)
    if forced[0] is not None:
        return forced
    raw = body.get("response_format")
    if fmt_param == "text.format":
        raw = body["text"].get("format") if isinstance(body.get("text"), dict) else None
    fmt = openai_response_format(raw, fmt_param)
    return _answer_constraint(fmt, fmt_param, offered, parallel)


def _answer_constraint(fmt: Optional[dict], fmt_param: str, offered: Optional[list[dict]],
                       parallel: bool) -> Constraint:
    if fmt is not None:
        if offered:
            fmt.update(tools=offered, parallel=parallel)
        return (fmt, fmt_param)
    if offered and any(_is_strict(t) for t in offered):
        return (_tool_spec("auto", offered, parallel), "tools")
    return NO_CONSTRAINT


# ---- Anthropic ----------------------------------------------------------------------------------
def anthropic_output_format(raw: Any) -> Optional[dict]:
    """``output_config.format`` -> a json spec."""
    if raw is None:
        return None
    p = "output_config.format"
    if not isinstance(raw, dict):
        raise bad_request(f"{p} must be an object, got {type_name(raw)}", param=p)
    if raw.get("type") != "json_schema":
        raise bad_request(f"{p}.type must be 'json_schema', got {raw.get('type')!r}", param=f"{p}.type")
    schema = raw.get("schema")
    if not isinstance(schema, dict):
        raise bad_request(f"{p}.schema must be a JSON schema object", param=f"{p}.schema")
    return {"type": "json_schema", "schema": schema, "strict": True}


def anthropic_constraint(body: dict, tools: Optional[list[dict]], allow_calls: bool) -> Constraint:
    """Messages: tool_choice any / tool, output_config.format, strict tools (``tools`` already in the
    OpenAI function form, ``strict`` kept)."""
    tc = body["tool_choice"] if isinstance(body.get("tool_choice"), dict) else {}
    parallel = not _bool(tc, "disable_parallel_tool_use", False)
    offered = tools if allow_calls else None
    t = tc.get("type")
    if t in ("any", "tool"):
        if not offered:
            raise bad_request(f"tool_choice type {t!r} needs tools", param="tool_choice.type")
        if t == "any":
            return (_tool_spec("required", offered, parallel), "tool_choice")
        name = _named(offered, tc.get("name"), "tool_choice.name")
        return (_tool_spec("named", offered, False, name), "tool_choice")
    oc = body["output_config"] if isinstance(body.get("output_config"), dict) else {}
    fmt = anthropic_output_format(oc.get("format"))
    return _answer_constraint(fmt, "output_config.format", offered, parallel)
