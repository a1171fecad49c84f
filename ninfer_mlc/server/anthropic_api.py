"""Anthropic-compatible routes: POST /v1/messages and /v1/messages/count_tokens.

Any ``model`` name is accepted (clients such as Claude Code send their own model names); the
response echoes it. Claude Code's per-request ``x-anthropic-billing-header`` system block is
dropped so it does not change the prompt on every call.

Every field value the real API documents is accepted; what has no meaning for a local model
(``cache_control``, ``context_management``, tool ``strict`` / ``input_examples``, server tools)
is ignored, never answered with a 400. Thinking: ``enabled`` thinks, ``disabled`` does not,
``adaptive`` (the model decides; Claude Code's default) follows the server's template default
(``--no-thinking``); a request without ``thinking`` does not think, as with the real API, unless
the server runs with ``--messages-thinking-default on`` (then the server default decides too).
``role: "system"`` messages inside ``messages``
are folded into the adjacent user turn (server/system_fold.py).
"""
from __future__ import annotations

import hashlib
import logging
import time
from typing import Any, Optional

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from ..tool_calls import anthropic_tool_id
from . import generation as gen
from .constraints import anthropic_constraint, anthropic_output_format
from .errors import APIError, bad_request
from .fields import (
    get_bool,
    get_dict,
    get_int,
    get_list,
    get_str,
    new_id,
    object_items,
    read_json,
    type_name,
)
from .generation import ChatInputs, ChatStream, Done, Out
from .image_parts import VISION_MARKER, anthropic_image_block
from .openapi_doc import COUNT_TOKENS_REQUEST, MESSAGES_REQUEST, error_responses, request_body
from .schema_check import check_schema
from .sse import SSEResponse, sse_event

router = APIRouter()
log = logging.getLogger("ninfer.server")

_BILLING_PREFIX = "x-anthropic-billing-header"
_MIN_THINKING_BUDGET = 1024


def _state(request: Request):
    return request.app.state.ninfer


def _default_thinking(state) -> Optional[bool]:
    """enable_thinking for a request without ``thinking``: off (the real API), or the server's
    template default with --messages-thinking-default on."""
    return None if getattr(state.config, "messages_thinking_default", False) else False


# ---- request parsing ----------------------------------------------------------------------
def _blocks(content: Any, p: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{p} must be a string or an array of content blocks, got {type_name(content)}", param=p)
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise bad_request(f"{p}[{j}] must be a content block object with a type", param=f"{p}[{j}]")
    return content


def _block_text(b: dict, p: str) -> str:
    t = b.get("text")
    if not isinstance(t, str):
        raise bad_request(f"{p}.text must be a string", param=f"{p}.text")
    return t


def _tool_result_text(content: Any, p: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for j, b in enumerate(_blocks(content, p)):
        if b["type"] == "text":
            parts.append(_block_text(b, f"{p}[{j}]"))
        elif b["type"] in ("image", "document"):
            # tool output the client cannot shape (screenshots...): say so instead of failing the turn
            parts.append(f"[{b['type']} omitted: this model reads text only]")
        elif b["type"] == "tool_reference":  # tool search result: the named deferred tool is now loaded
            parts.append(f"Tool loaded: {b.get('tool_name')}")
        else:
            raise bad_request(f"{p}[{j}]: tool_result content type {b['type']!r} is not supported",
                              param=f"{p}[{j}].type")
    return "\n".join(parts)


def parse_system(raw: Any) -> Optional[str]:
    if raw is None:
        return None
    if isinstance(raw, str):
        return raw
    return _system_text(_blocks(raw, "system"), "system")


def _system_text(blocks: list[dict], p: str) -> str:
    parts = []
    for j, b in enumerate(blocks):
        if b["type"] != "text":
            raise bad_request(f"{p}[{j}].type must be 'text'", param=f"{p}[{j}].type")
        text = _block_text(b, f"{p}[{j}]")
        if text.startswith(_BILLING_PREFIX):
            continue  # Claude Code attribution header: differs per request, would defeat prefix reuse
        parts.append(text)
    return "\n".join(parts)


def parse_messages(raw: Any, system: Optional[str], images: Optional[list] = None) -> list[dict]:
    """images: collects the ImageRef of every user image block, in prompt order (None: images refused)."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty array", param="messages")
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": system})
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{p} must be an object", param=p)
        role = m.get("role")
        if role not in ("user", "assistant", "system"):
            raise bad_request(f"{p}.role must be 'user', 'assistant' or 'system', got {role!r}", param=f"{p}.role")
        blocks = _blocks(m.get("content"), f"{p}.content")
        if role == "system":  # folded into the adjacent user turn when the prompt is rendered
            out.append({"role": "system", "content": _system_text(blocks, f"{p}.content")})
        elif role == "user":
            out.extend(_user_messages(blocks, f"{p}.content", images))
        else:
            out.append(_assistant_message(blocks, f"{p}.content"))
    return out


def _user_messages(blocks: list[dict], p: str, images: Optional[list] = None) -> list[dict]:
    out: list[dict] = []
    text: list[str] = []

    def flush():
        if text:
            out.append({"role": "user", "content": "".join(text)})
            text.clear()

    for j, b in enumerate(blocks):
        t = b["type"]
        if t == "text":
            text.append(_block_text(b, f"{p}[{j}]"))
        elif t == "tool_result":
            flush()
            body = _tool_result_text(b.get("content"), f"{p}[{j}].content")
            msg = {"role": "tool", "content": body}
            if isinstance(b.get("tool_use_id"), str):
                msg["tool_call_id"] = b["tool_use_id"]
            out.append(msg)
        elif t == "image" and images is not None:
            images.append(anthropic_image_block(b, f"{p}[{j}]"))
            text.append(VISION_MARKER)
        elif t in ("image", "document", "audio", "video"):
            raise bad_request(f"{p}[{j}]: content type {t!r} is not supported (text-only model)",
                              param=f"{p}[{j}].type")
        else:
            raise bad_request(f"{p}[{j}]: content type {t!r} is not supported in user messages",
                              param=f"{p}[{j}].type")
    flush()
    if not out:  # an empty content array still is a user turn
        out.append({"role": "user", "content": ""})
    return out


def _assistant_message(blocks: list[dict], p: str) -> dict:
    text, thinking, calls = [], [], []
    for j, b in enumerate(blocks):
        t = b["type"]
        if t == "text":
            text.append(_block_text(b, f"{p}[{j}]"))
        elif t == "thinking":
            th = b.get("thinking")
            if not isinstance(th, str):
                raise bad_request(f"{p}[{j}].thinking must be a string", param=f"{p}[{j}].thinking")
            thinking.append(th)
        elif t == "redacted_thinking":
            continue
        elif t == "tool_use":
            name, args = b.get("name"), b.get("input", {})
            if not isinstance(name, str):
                raise bad_request(f"{p}[{j}].name must be a string", param=f"{p}[{j}].name")
            if not isinstance(args, dict):
                raise bad_request(f"{p}[{j}].input must be an object", param=f"{p}[{j}].input")
            calls.append({"id": b.get("id"), "type": "function", "function": {"name": name, "arguments": args}})
        else:
            raise bad_request(f"{p}[{j}]: content type {t!r} is not supported in assistant messages",
                              param=f"{p}[{j}].type")
    msg: dict = {"role": "assistant", "content": "".join(text)}
    if thinking:
        msg["reasoning_content"] = "\n".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def referenced_tools(raw_messages: Any) -> set[str]:
    """Names in ``tool_reference`` blocks of tool results (tool search loading deferred tools)."""
    names: set[str] = set()
    for m in raw_messages if isinstance(raw_messages, list) else ():
        content = m.get("content") if isinstance(m, dict) else None
        for b in content if isinstance(content, list) else ():
            inner = b.get("content") if isinstance(b, dict) and b.get("type") == "tool_result" else None
            for r in inner if isinstance(inner, list) else ():
                if isinstance(r, dict) and r.get("type") == "tool_reference" and isinstance(r.get("tool_name"), str):
                    names.add(r["tool_name"])
    return names


def parse_tools(raw: Any, loaded: frozenset = frozenset()) -> Optional[list[dict]]:
    """Anthropic tools -> OpenAI function tools (the form chat templates expect).

    Server tools (web search, code execution, ...) cannot run here: they are left out with a
    warning, as the real API leaves out a tool it cannot offer. ``defer_loading`` tools stay out
    of the prompt until a tool search result references them (``loaded``), as with the real API."""
    if raw is None:
        return None
    out = []
    for p, t in object_items(raw, "tools"):
        if t.get("type") not in (None, "custom"):
            log.warning("%s: server tool %r (type %r) is not available on this server; left out",
                        p, t.get("name"), t.get("type"))
            continue
        if t.get("defer_loading") is True and t.get("name") not in loaded:
            continue
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"{p}.name must be a non-empty string", param=f"{p}.name")
        schema = t.get("input_schema")
        if schema is None:
            raise bad_request(f"{p}.input_schema: Field required", param=f"{p}.input_schema")
        check_schema(schema, f"{p}.input_schema")
        fn: dict = {"name": name}
        if isinstance(t.get("description"), str):
            fn["description"] = t["description"]
        fn["parameters"] = schema
        if t.get("strict") is True:
            fn["strict"] = True  # constrained arguments (server/constraints.py)
        out.append({"type": "function", "function": fn})
    return out or None


def parse_tool_choice(raw: Any) -> bool:
    if raw is None:
        return True
    if not isinstance(raw, dict):
        raise bad_request("tool_choice must be an object", param="tool_choice")
    t = raw.get("type")
    if t == "auto":
        return True
    if t == "none":
        return False
    if t in ("any", "tool"):
        return True  # forced: server/constraints.py builds the constraint
    raise bad_request(f"unknown tool_choice type {t!r}", param="tool_choice.type")


def parse_thinking(raw: Any, default: Optional[bool] = False) -> tuple[Optional[bool], bool, Optional[int]]:
    """-> (enable_thinking or None for the server default, omit the thinking text, budget_tokens).

    ``default`` applies to a request without ``thinking`` (the real API: no thinking)."""
    if raw is None:
        return default, False, None
    if not isinstance(raw, dict):
        raise bad_request("thinking must be an object", param="thinking")
    t = raw.get("type")
    display = raw.get("display")
    if display is not None and not isinstance(display, str):  # summarized | omitted | later values
        raise bad_request(f"thinking.display must be a string, got {type_name(display)}", param="thinking.display")
    omit = display == "omitted"
    if t == "disabled":
        return False, False, None
    if t == "adaptive":  # the model decides: here the server's template default (--no-thinking) does
        return None, omit, None
    if t == "between_tools":
        return True, omit, None
    if t == "enabled":
        budget = get_int(raw, "budget_tokens", param="thinking.budget_tokens")
        if budget is None:
            raise bad_request("thinking.budget_tokens is required when thinking is enabled",
                              param="thinking.budget_tokens")
        if budget < _MIN_THINKING_BUDGET:
            raise bad_request(f"thinking.budget_tokens must be >= {_MIN_THINKING_BUDGET}, got {budget}",
                              param="thinking.budget_tokens")
        return True, omit, budget
    raise bad_request(f"thinking.type must be 'enabled', 'disabled', 'adaptive' or 'between_tools', got {t!r}",
                      param="thinking.type")


def parse_output_config(raw: Any) -> Optional[str]:
    """-> the effort level, passed to the template as ``reasoning_effort`` (``format`` is validated here and
    constrained through server/constraints.py anthropic_constraint)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise bad_request("output_config must be an object", param="output_config")
    anthropic_output_format(raw.get("format"))  # validated here, constrained by anthropic_constraint
    effort = raw.get("effort")
    if effort is not None and effort not in ("low", "medium", "high", "xhigh", "max"):
        raise bad_request(f"output_config.effort must be low, medium, high, xhigh or max, got {effort!r}",
                          param="output_config.effort")
    return effort


def parse_request(body: dict, for_count: bool = False, default_thinking: Optional[bool] = False
                  ) -> tuple[ChatInputs, str, bool, bool]:
    """-> (inputs, model, stream, omit the thinking text). ``default_thinking``: enable_thinking of a
    request without ``thinking`` (None: the server's template default).

    ``temperature`` / ``top_p`` / ``top_k`` are still read (older clients send them)."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("model must be a string", param="model")
    system = parse_system(body.get("system"))
    images: list = []
    messages = parse_messages(body.get("messages"), system, images)
    tools = parse_tools(body.get("tools"), frozenset(referenced_tools(body.get("messages"))))
    allow_calls = parse_tool_choice(body.get("tool_choice"))
    constraint, constraint_param = anthropic_constraint(body, tools, allow_calls)
    thinking, omit_thinking, thinking_budget = parse_thinking(body.get("thinking"), default_thinking)
    effort = parse_output_config(body.get("output_config"))
    layer: dict = {}
    names = {"stop": "stop_sequences"}
    if not for_count:
        mt = body.get("max_tokens")
        if mt is None:
            raise bad_request("max_tokens is required", param="max_tokens")
        layer["max_tokens"] = mt
        if thinking_budget is not None and isinstance(mt, int) and thinking_budget >= mt:
            raise bad_request(f"`max_tokens` must be greater than `thinking.budget_tokens` ({mt} <= "
                              f"{thinking_budget})", param="thinking.budget_tokens")
        for k in ("temperature", "top_p", "top_k"):
            if body.get(k) is not None:
                layer[k] = body[k]
        ss = get_list(body, "stop_sequences")
        if ss is not None:
            layer["stop"] = ss
    meta = get_dict(body, "metadata") or {}
    session = get_str(meta, "user_id", param="metadata.user_id")
    stream = bool(get_bool(body, "stream", False))
    inp = ChatInputs(messages=messages, tools=tools if allow_calls else None,
                     parse_tools=allow_calls and tools is not None, enable_thinking=thinking,
                     sampling=layer, param_names=names, session_key=session, thinking_budget=thinking_budget,
                     template_kwargs={"reasoning_effort": effort} if effort else {},
                     constraint=None if for_count else constraint, constraint_param=constraint_param, images=images)
    return inp, model or "", stream, omit_thinking


# ---- response building --------------------------------------------------------------------
def stop_reason(done: Done) -> tuple[str, Optional[str]]:
    if done.finish_reason == "tool_calls":
        return "tool_use", None
    if done.finish_reason == "length":
        return "max_tokens", None
    if done.stop_matched is not None:
        return "stop_sequence", done.stop_matched
    return "end_turn", None


def usage_body(done: Done) -> dict:
    u = done.usage
    cached = u.get("cached_tokens", 0)
    return {"input_tokens": u.get("prompt_tokens", 0) - cached, "output_tokens": u.get("completion_tokens", 0),
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def signature(thinking: str) -> str:
    """Opaque signature for a thinking block (clients must round-trip it; we never check it)."""
    return "ninfer-" + hashlib.sha256(thinking.encode("utf-8")).hexdigest()[:48]


def message_body(mid: str, model: str, col: gen.Collected, omit_thinking: bool = False) -> dict:
    content: list[dict] = []
    if col.reasoning:
        content.append({"type": "thinking", "thinking": "" if omit_thinking else col.reasoning,
                        "signature": signature(col.reasoning)})
    if col.content:
        content.append({"type": "text", "text": col.content})
    for c in col.calls:
        content.append({"type": "tool_use", "id": anthropic_tool_id(c.id), "name": c.name, "input": c.arguments})
    reason, seq = stop_reason(col.done)
    return {"id": mid, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": seq, "usage": usage_body(col.done)}


class MessageStreamer:
    """``Out``/``Done`` events -> Anthropic SSE events (bytes), full content-block lifecycle."""

    def __init__(self, mid: str, model: str, input_tokens: int, omit_thinking: bool = False, cached_tokens: int = 0):
        """input_tokens: the whole prompt; cached_tokens: the part the prefix cache served (known at
        admission, so message_start and message_delta report the same split)."""
        self.mid, self.model, self.input_tokens, self.cached = mid, model, input_tokens, cached_tokens
        self.omit_thinking = omit_thinking  # thinking.display "omitted": signature only
        self.index = -1
        self.open: Optional[str] = None  # type of the open block
        self._thinking: list[str] = []

    def start(self) -> list[bytes]:
        msg: dict[str, Any] = {"id": self.mid, "type": "message", "role": "assistant", "model": self.model, "content": [],
               "stop_reason": None, "stop_sequence": None,
               "usage": {"input_tokens": self.input_tokens - self.cached, "output_tokens": 0,
                         "cache_creation_input_tokens": 0, "cache_read_input_tokens": self.cached}}
        return [sse_event("message_start", {"type": "message_start", "message": msg}),
                sse_event("ping", {"type": "ping"})]

    def _open(self, kind: str, block: dict) -> list[bytes]:
        out = self._close()
        self.index += 1
        self.open = kind
        out.append(sse_event("content_block_start",
                             {"type": "content_block_start", "index": self.index, "content_block": block}))
        return out

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        out = []
        if self.open == "thinking":
            out.append(self._delta({"type": "signature_delta", "signature": signature("".join(self._thinking))}))
            self._thinking = []
        out.append(sse_event("content_block_stop", {"type": "content_block_stop", "index": self.index}))
        self.open = None
        return out

    def _delta(self, delta: dict) -> bytes:
        return sse_event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})

    def event(self, o: Out) -> list[bytes]:
        out: list[bytes] = []
        if o.kind == "reasoning":
            if self.open != "thinking":
                out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            self._thinking.append(o.text)
            if not self.omit_thinking:
                out.append(self._delta({"type": "thinking_delta", "thinking": o.text}))
        elif o.kind == "content":
            if self.open != "text":
                out += self._open("text", {"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": o.text}))
        else:
            c = o.call
            assert c is not None  # kind "tool_call"
            out += self._open("tool_use", {"type": "tool_use", "id": anthropic_tool_id(c.id), "name": c.name,
                                           "input": {}})
            out.append(self._delta({"type": "input_json_delta", "partial_json": c.arguments_json}))
            out += self._close()
        return out

    def done(self, d: Done) -> list[bytes]:
        out = self._close()
        reason, seq = stop_reason(d)
        out.append(sse_event("message_delta", {"type": "message_delta",
                                               "delta": {"stop_reason": reason, "stop_sequence": seq},
                                               "usage": usage_body(d)}))
        out.append(sse_event("message_stop", {"type": "message_stop"}))
        return out

    @staticmethod
    def error(message: str, etype: str = "api_error") -> bytes:
        return sse_event("error", {"type": "error", "error": {"type": etype, "message": message}})


# ---- routes -------------------------------------------------------------------------------
@router.get("/api/hello", operation_id="hello_get")
@router.head("/api/hello", operation_id="hello_head")
async def hello():
    """Claude Code's connectivity probe (``HEAD {ANTHROPIC_BASE_URL}/api/hello``)."""
    return JSONResponse({"status": "ok"})


@router.post("/v1/messages", openapi_extra=request_body(MESSAGES_REQUEST), responses=error_responses(True))
async def messages(request: Request):
    state = _state(request)
    rid = new_id("req_")
    t0 = time.monotonic()
    body = await read_json(request, state.config.max_request_bytes)
    inp, model, stream, omit_thinking = parse_request(body, default_thinking=_default_thinking(state))
    model = model or state.config.model_id
    prep = await gen.prepare_chat(state, inp)
    handle = await gen.submit(state, request.receive, prep.prompt_ids, prep.params, rid, prep.session_key,
                              extra=prep.request_fields())
    headers = {"request-id": rid}
    if handle is None:
        return Response(status_code=499, headers=headers)
    conv = ChatStream(prep.started_in_think, prep.tools, state.config.tolerant_tool_calls, state.token_text,
                      token_bytes=state.token_bytes)
    on_done = lambda d: gen.log_record(state, "anthropic.messages", rid, len(prep.prompt_ids), d, t0, stream)  # noqa: E731
    events = gen.engine_events(handle, conv, on_done)
    mid = new_id("msg_")
    if stream:
        streamer = MessageStreamer(mid, model, len(prep.prompt_ids), omit_thinking, cached_tokens=handle.cached_tokens)
        return SSEResponse(_messages_sse(handle, streamer, events), headers=headers,
                           keepalive_s=state.config.keepalive_s, keepalive=sse_event("ping", {"type": "ping"}))
    ok, col = await gen.run_collect(request.receive, handle, events)
    if not ok:
        return Response(status_code=499, headers=headers)
    assert col is not None  # ok: collect() ran to the end
    if col.done.finish_reason == "error":
        raise APIError(500, f"generation failed: {col.done.error}")
    return JSONResponse(message_body(mid, model, col, omit_thinking), headers=headers)


async def _messages_sse(handle, streamer: MessageStreamer, events):
    try:
        for b in streamer.start():
            yield b
        async for ev in events:
            if isinstance(ev, Done):
                if ev.finish_reason == "error":
                    yield streamer.error(f"generation failed: {ev.error}")
                else:
                    for b in streamer.done(ev):
                        yield b
                break
            for b in streamer.event(ev):
                yield b
    finally:
        await events.aclose()
        gen.release(handle)


@router.post("/v1/messages/count_tokens", openapi_extra=request_body(COUNT_TOKENS_REQUEST),
             responses=error_responses(True, (400, 401, 413, 429)))
async def count_tokens(request: Request):
    state = _state(request)
    body = await read_json(request, state.config.max_request_bytes)
    inp = parse_request(body, for_count=True, default_thinking=_default_thinking(state))[0]
    n = await gen.count_prompt_tokens(state, inp)
    return JSONResponse({"input_tokens": n}, headers={"request-id": new_id("req_")})
