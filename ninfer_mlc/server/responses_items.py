"""Responses API request pieces -> the API-neutral chat form: input items -> messages, tools ->
function tools, ``tool_choice`` / ``text.format`` -> the constraint spec.

Items of one assistant turn (reasoning, an assistant message, function calls) become one assistant
message, so the chat template renders them exactly as the model produced them and the prefix
cache keeps matching across turns. Reasoning comes back either as text (summary / content) or as
our own ``encrypted_content`` (``include: ["reasoning.encrypted_content"]`` with ``store: false``,
as Codex runs): base64 of the text behind a prefix, opaque to clients, readable by this server.
"""
from __future__ import annotations

import base64
import json
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, Optional

from .errors import bad_request
from .fields import object_items, one_of, type_name

log = logging.getLogger("ninfer.server")

_ENC_PREFIX = "ninfer-r1:"
_TEXT_PARTS = {"input_text", "output_text", "text", "summary_text", "reasoning_text", "refusal"}
_MEDIA_PARTS = {"input_image", "input_file", "input_audio", "image_url"}
_CUSTOM_PARAMS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
_ITEM_PREFIX = {"message": "msg_", "function_call": "fc_", "custom_tool_call": "ctc_", "reasoning": "rs_",
                "function_call_output": "fco_", "custom_tool_call_output": "ctco_"}


def new_item_id(kind: str) -> str:
    return _ITEM_PREFIX.get(kind, "item_") + secrets.token_hex(12)


def encrypt_reasoning(text: str) -> str:
    """Reasoning in a form the client returns untouched and this server reads back."""
    return _ENC_PREFIX + base64.urlsafe_b64encode(text.encode("utf-8")).decode("ascii")


def decrypt_reasoning(blob: Any) -> Optional[str]:
    """Our own ``encrypted_content`` -> the reasoning text; None for anything else (another server's)."""
    if not isinstance(blob, str) or not blob.startswith(_ENC_PREFIX):
        return None
    try:
        return base64.urlsafe_b64decode(blob[len(_ENC_PREFIX):].encode("ascii")).decode("utf-8")
    except (ValueError, UnicodeDecodeError):
        return None


# ---- tools --------------------------------------------------------------------------------
@dataclass
class ToolTable:
    """Rendered function tools plus how a called name maps back to an output item."""

    tools: list[dict] = field(default_factory=list)  # OpenAI chat function tools, for the template
    namespace: dict = field(default_factory=dict)  # rendered name -> (namespace, name)
    custom: set = field(default_factory=set)  # rendered names of freeform (custom) tools
    ignored: list[str] = field(default_factory=list)  # hosted tools left out

    def output_name(self, rendered: str) -> tuple[Optional[str], str]:
        """-> (namespace or None, name as the client declared it)."""
        return self.namespace.get(rendered, (None, rendered))


def _function(t: dict, p: str, qualified: Optional[str] = None) -> dict:
    name = t.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request(f"{p}.name must be a non-empty string", param=f"{p}.name")
    params = t.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise bad_request(f"{p}.parameters must be a JSON schema object", param=f"{p}.parameters")
    strict = t.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{p}.strict must be a boolean", param=f"{p}.strict")
    fn: dict = {"name": qualified or name}
    if isinstance(t.get("description"), str):
        fn["description"] = t["description"]
    fn["parameters"] = params if params is not None else {"type": "object", "properties": {}}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


def parse_tools(raw: Any) -> ToolTable:
    """function (incl. ``strict``), ``namespace`` (nested functions, rendered as ``ns.name``) and
    ``custom`` (freeform text input, rendered as a function of one string ``input``) tools.
    Hosted tools (web_search, file_search, ...) do not exist here: left out with a warning, so a
    client that always sends them (Codex sends web_search) still works."""
    table = ToolTable()
    if raw is None:
        return table
    for p, t in object_items(raw, "tools"):
        kind = t.get("type")
        if kind == "function":
            table.tools.append(_function(t, p))
        elif kind == "namespace":
            ns = t.get("name")
            inner = t.get("tools")
            if not isinstance(ns, str) or not ns or not isinstance(inner, list):
                raise bad_request(f"{p}: a namespace tool needs a name and a tools array", param=p)
            for k, sub in enumerate(inner):
                q = f"{p}.tools[{k}]"
                if not isinstance(sub, dict) or sub.get("type", "function") != "function":
                    raise bad_request(f"{q}: namespace tools must be function tools", param=q)
                fn = _function(sub, q, f"{ns}.{sub.get('name')}")
                table.tools.append(fn)
                table.namespace[fn["function"]["name"]] = (ns, sub["name"])
        elif kind == "custom":
            fn = _function({"name": t.get("name"), "description": t.get("description"),
                            "parameters": _CUSTOM_PARAMS}, p)
            table.tools.append(fn)
            table.custom.add(fn["function"]["name"])
        else:
            table.ignored.append(str(kind))
            log.warning("%s: hosted tool type %r is not available on this server; left out", p, kind)
    return table


# ---- tool_choice + text.format -> constraint ------------------------------------------------
def constraint_spec(tool_choice: Any, text: Any, tools: ToolTable) -> tuple[bool, Optional[dict]]:
    """-> (tool calls allowed, the constraint spec of ChatInputs.constraint or None).

    tool_choice: "auto" | "none" | "required" | {"type": "function" | "custom", "name"} |
    {"type": "allowed_tools", "mode": "auto" | "required", ...} | a hosted tool type (auto here).
    text.format: {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", "schema", "strict"}."""
    allow, spec = True, None
    if tool_choice is None or tool_choice == "auto":
        pass
    elif tool_choice == "none":
        allow = False
    elif tool_choice == "required":
        spec = {"type": "tool_call", "mode": "required"}
    elif isinstance(tool_choice, dict):
        kind = tool_choice.get("type")
        if kind in ("function", "custom"):
            name = tool_choice.get("name")
            if not isinstance(name, str) or not any(t["function"]["name"] == name for t in tools.tools):
                raise bad_request(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice.name")
            spec = {"type": "tool_call", "mode": "named", "name": name}
        elif kind == "allowed_tools":
            mode = tool_choice.get("mode", "auto")
            if mode not in ("auto", "required"):
                raise bad_request(f"tool_choice.mode must be 'auto' or 'required', got {mode!r}",
                                  param="tool_choice.mode")
            if mode == "required":
                spec = {"type": "tool_call", "mode": "required"}
        elif not isinstance(kind, str):
            raise bad_request("tool_choice.type must be a string", param="tool_choice.type")
        # a hosted tool's type: that tool is not here; the model answers on its own
    else:
        raise bad_request(f"tool_choice must be 'auto', 'none', 'required' or an object, got {tool_choice!r}",
                          param="tool_choice")
    if isinstance(text, dict) and text.get("format") is not None and spec is None:
        spec = _text_format(text["format"])
    elif text is not None and not isinstance(text, dict):
        raise bad_request(f"text must be an object, got {type_name(text)}", param="text")
    return allow, spec


def _text_format(fmt: Any) -> Optional[dict]:
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object", param="text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema object", param="text.format.schema")
        return {"type": "json_schema", "schema": fmt["schema"], "strict": bool(fmt.get("strict", False)),
                "name": fmt.get("name")}
    raise bad_request(f"text.format.type must be text, json_object or json_schema, got {kind!r}",
                      param="text.format.type")


# ---- input items -> messages ----------------------------------------------------------------
def normalize_input(raw: Any) -> list[dict]:
    """``input`` (a string or an item array) -> items, each with a ``type`` and an ``id``."""
    if isinstance(raw, str):
        raw = [{"type": "message", "role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise bad_request(f"input must be a string or an array of items, got {type_name(raw)}", param="input")
    out = []
    for i, it in enumerate(raw):
        if not isinstance(it, dict):
            raise bad_request(f"input[{i}] must be an object", param=f"input[{i}]")
        kind = it.get("type") or ("message" if "role" in it else None)
        if not isinstance(kind, str):
            raise bad_request(f"input[{i}] needs a type", param=f"input[{i}].type")
        item = {**it, "type": kind}
        if kind == "message" and isinstance(item.get("content"), str):  # the stored form is parts
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": part, "text": item["content"]}]
        if not isinstance(item.get("id"), str):
            item["id"] = new_item_id(kind)
        out.append(item)
    return out


def _text(content: Any, p: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{p} must be a string or an array of content parts", param=p)
    parts = []
    for j, c in enumerate(content):
        if isinstance(c, str):
            parts.append(c)
            continue
        kind = c.get("type") if isinstance(c, dict) else None
        if one_of(kind, _TEXT_PARTS):
            t = c.get("text", c.get("refusal"))
            if not isinstance(t, str):
                raise bad_request(f"{p}[{j}].text must be a string", param=f"{p}[{j}].text")
            parts.append(t)
        elif one_of(kind, _MEDIA_PARTS):
            raise bad_request(f"{p}[{j}]: content type {kind!r} is not supported (text-only model)",
                              param=f"{p}[{j}].type")
        else:
            raise bad_request(f"{p}[{j}]: unknown content part type {kind!r}", param=f"{p}[{j}].type")
    return "".join(parts)


def _reasoning_text(it: dict) -> str:
    own = decrypt_reasoning(it.get("encrypted_content"))
    if own is not None:
        return own
    for key in ("content", "summary"):
        parts = it.get(key)
        if isinstance(parts, list) and parts:
            return "\n".join(p.get("text", "") for p in parts if isinstance(p, dict) and isinstance(p.get("text"), str))
    return ""


def _arguments(raw: Any, p: str) -> Any:
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise bad_request(f"{p} must be a JSON string", param=p)
    try:
        val = json.loads(raw) if raw.strip() else {}
    except ValueError:
        return raw  # rendered as given
    return val if isinstance(val, dict) else raw


def items_to_messages(items: list[dict], instructions: Optional[str] = None) -> list[dict]:
    """Items -> OpenAI-style chat messages (system / user / assistant with reasoning_content and
    tool_calls / tool). Developer messages are system messages (folded later when not leading)."""
    out: list[dict] = []
    turn: Optional[dict] = None  # the assistant message being assembled

    def assistant() -> dict:
        nonlocal turn
        if turn is None:
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
        return turn

    if instructions:
        out.append({"role": "system", "content": instructions})
    for i, it in enumerate(items):
        p = f"input[{i}]"
        kind = it["type"]
        if kind == "message":
            role = it.get("role")
            text = _text(it.get("content"), f"{p}.content")
            if role == "assistant":
                a = assistant()
                a["content"] = a["content"] + text
                continue
            if role not in ("user", "system", "developer"):
                raise bad_request(f"{p}.role must be user, assistant, system or developer, got {role!r}",
                                  param=f"{p}.role")
            turn = None
            out.append({"role": "system" if role == "developer" else role, "content": text})
        elif kind == "reasoning":
            text = _reasoning_text(it)
            a = assistant()
            if a["content"] or a.get("tool_calls"):  # reasoning after text: a new assistant turn
                turn = None
                a = assistant()
            a["reasoning_content"] = (a.get("reasoning_content", "") + "\n" + text).strip("\n") \
                if a.get("reasoning_content") else text
        elif kind in ("function_call", "custom_tool_call"):
            name = it.get("name")
            if not isinstance(name, str) or not name:
                raise bad_request(f"{p}.name must be a non-empty string", param=f"{p}.name")
            if isinstance(it.get("namespace"), str) and it["namespace"]:
                name = f"{it['namespace']}.{name}"
            if kind == "function_call":
                args = _arguments(it.get("arguments", ""), f"{p}.arguments")
            else:
                args = {"input": it.get("input") if isinstance(it.get("input"), str) else ""}
            call_id = it.get("call_id") if isinstance(it.get("call_id"), str) else it["id"]
            assistant().setdefault("tool_calls", []).append(
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
        elif kind in ("function_call_output", "custom_tool_call_output"):
            turn = None
            msg = {"role": "tool", "content": _text(it.get("output"), f"{p}.output")}
            if isinstance(it.get("call_id"), str):
                msg["tool_call_id"] = it["call_id"]
            out.append(msg)
        elif kind == "item_reference":
            raise bad_request(f"{p}: item_reference is not supported; send the items themselves",
                              param=f"{p}.type")
        else:
            raise bad_request(f"{p}: input item type {kind!r} is not supported", param=f"{p}.type")
    if not any(m["role"] != "system" for m in out):
        raise bad_request("input must hold at least one message", param="input")
    return out
