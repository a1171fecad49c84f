"""OpenAI Responses API: POST /v1/responses (+ /input_tokens), GET / DELETE /v1/responses/{id},
GET /v1/responses/{id}/input_items. What Codex CLI (wire_api "responses") and openai-agents speak.

Requests are parsed into ``ChatInputs`` (server/responses_items.py) and run through the same
``prepare_chat`` / ``ChatStream`` machinery as chat completions; ``ResponseBuilder`` turns the
``Out`` / ``Done`` events into output items and the documented SSE event sequence:
response.created, response.in_progress, then per item output_item.added, (content_part.added,
output_text.delta..., output_text.done, content_part.done | reasoning deltas |
function_call_arguments.delta / .done), output_item.done, and finally response.completed
(response.incomplete at max_output_tokens, response.failed on an engine error), each with a
``sequence_number``.

Thinking: a request thinks as the server default says (``--no-thinking``), except that
``reasoning.effort`` "none" or "minimal" turns it off. Reasoning is streamed as summary text when
``reasoning.summary`` is set, else as reasoning text; ``include: ["reasoning.encrypted_content"]``
adds our own encrypted_content so a stateless client (``store: false``) can send it back.
``prompt_cache_key`` (else ``user`` / ``safety_identifier``) is the session key of the prefix cache.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from . import generation as gen
from .errors import APIError, bad_request
from .fields import get_bool, get_dict, get_int, get_list, get_str, new_id, one_of, read_json, request_id
from .generation import ChatInputs, ChatStream, Done, Out
from .openai_api import check_model
from .openapi_doc import INPUT_ITEMS_QUERY, RESPONSES_REQUEST, error_responses, request_body
from .response_store import ResponseStore
from .responses_items import (ToolTable, constraint_spec, encrypt_reasoning, items_to_messages, new_item_id,
                              normalize_input, parse_tools)
from .sse import SSEResponse, sse_event, until_disconnect

router = APIRouter()

_NO_THINKING_EFFORTS = {"none", "minimal"}
_EFFORTS = {"none", "minimal", "low", "medium", "high", "xhigh"}
_SUMMARY = {"auto", "concise", "detailed"}
_UNSUPPORTED = {"background": "background mode", "conversation": "conversations", "prompt": "prompt templates"}


def _state(request: Request):
    return request.app.state.ninfer


def response_store(state) -> ResponseStore:
    """The server's store, created on first use (ServerState knows nothing of this API)."""
    store = getattr(state, "response_store", None)
    if store is None:
        store = state.response_store = ResponseStore()
    return store


# ---- request ------------------------------------------------------------------------------
@dataclass
class ResponsesRequest:
    inputs: ChatInputs
    model: str
    stream: bool
    store: bool
    input_items: list[dict]  # this request's items (with ids)
    history: list[dict]  # items of the previous responses + input_items
    tools: ToolTable
    summary: bool  # reasoning as summary parts (reasoning.summary set)
    encrypted: bool  # include reasoning.encrypted_content
    echo: dict = field(default_factory=dict)  # request fields the response object repeats


def parse_reasoning(raw: Any) -> tuple[Optional[bool], bool, dict]:
    """-> (enable_thinking or None for the server default, summaries wanted, echo)."""
    if raw is None:
        return None, False, {"effort": None, "summary": None}
    if not isinstance(raw, dict):
        raise bad_request("reasoning must be an object", param="reasoning")
    effort = raw.get("effort")
    if effort is not None and not one_of(effort, _EFFORTS):
        raise bad_request(f"reasoning.effort must be one of {sorted(_EFFORTS)}, got {effort!r}",
                          param="reasoning.effort")
    summary = raw.get("summary", raw.get("generate_summary"))
    if summary is not None and not one_of(summary, _SUMMARY):
        raise bad_request(f"reasoning.summary must be one of {sorted(_SUMMARY)}, got {summary!r}",
                          param="reasoning.summary")
    thinking = False if effort in _NO_THINKING_EFFORTS else None
    return thinking, summary is not None, {"effort": effort, "summary": summary}


def parse_request(state, body: dict, store: ResponseStore) -> ResponsesRequest:
    for key, what in _UNSUPPORTED.items():
        if body.get(key) not in (None, False):
            raise bad_request(f"{key}: {what} are not supported by this server", param=key)
    model = check_model(state, body)
    if "input" not in body:
        raise bad_request("input is required", param="input")
    items = normalize_input(body["input"])
    history: list[dict] = []
    prev_id = get_str(body, "previous_response_id")
    if prev_id is not None:
        prev = store.get(prev_id)
        if prev is None:
            raise APIError(400, f"Previous response with id '{prev_id}' not found.", param="previous_response_id",
                           code="previous_response_not_found")
        history = list(prev.history)
    history += items
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", param="instructions")
    messages = items_to_messages(history, instructions)
    tools = parse_tools(body.get("tools"))
    allow_calls, constraint = constraint_spec(body.get("tool_choice"), body.get("text"), tools)
    thinking, summary, reasoning_echo = parse_reasoning(body.get("reasoning"))
    include = get_list(body, "include") or []
    layer: dict = {}
    names = {"max_tokens": "max_output_tokens"}
    if body.get("max_output_tokens") is not None:
        layer["max_tokens"] = body["max_output_tokens"]
    for k in ("temperature", "top_p"):
        if body.get(k) is not None:
            layer[k] = body[k]
    top_lp = get_int(body, "top_logprobs", minimum=0)
    if top_lp:
        layer["logprobs"], layer["top_logprobs"] = True, top_lp
    get_dict(body, "metadata")
    get_dict(body, "client_metadata")  # Codex: accepted, not used
    session = get_str(body, "prompt_cache_key") or get_str(body, "user") or get_str(body, "safety_identifier")
    inp = ChatInputs(messages=messages, tools=tools.tools if (allow_calls and tools.tools) else None,
                     parse_tools=allow_calls and bool(tools.tools), enable_thinking=thinking, sampling=layer,
                     param_names=names, session_key=session, constraint=constraint)
    echo = {"instructions": instructions, "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": prev_id, "reasoning": reasoning_echo,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"),
            "text": body.get("text") or {"format": {"type": "text"}}, "tool_choice": body.get("tool_choice", "auto"),
            "tools": body.get("tools") or [], "truncation": body.get("truncation") or "disabled",
            "prompt_cache_key": body.get("prompt_cache_key"), "user": body.get("user")}
    do_store = bool(get_bool(body, "store", True))
    return ResponsesRequest(inp, model, bool(get_bool(body, "stream", False)), do_store, items, history, tools,
                            summary, "reasoning.encrypted_content" in include, echo)


# ---- response building --------------------------------------------------------------------
def usage_body(done: Done) -> dict:
    u = done.usage
    return {"input_tokens": u.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)},
            "output_tokens": u.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": u.get("reasoning_tokens", 0)},
            "total_tokens": u.get("total_tokens", 0)}


class ResponseBuilder:
    """``Out`` / ``Done`` events -> output items and (for streams) the SSE events, in order.

    The same object serves both modes: ``event`` returns the SSE bytes of one ``Out`` and grows
    ``output``; non-streaming callers ignore the bytes."""

    def __init__(self, rid: str, req: ResponsesRequest, created: int):
        self.rid, self.req, self.created = rid, req, created
        self.output: list[dict] = []
        self.seq = 0
        self.open: Optional[dict] = None  # the item receiving deltas
        self._text: list[str] = []
        self.status = "in_progress"
        self.usage: Optional[dict] = None
        self.error: Optional[dict] = None
        self.incomplete: Optional[dict] = None

    # -- objects --------------------------------------------------------------------------
    def response(self) -> dict:
        r = {"id": self.rid, "object": "response", "created_at": self.created, "status": self.status,
             "background": False, "error": self.error, "incomplete_details": self.incomplete,
             "model": self.req.model, "output": [dict(i) for i in self.output], "usage": self.usage,
             "store": self.req.store, **self.req.echo}
        if self.status == "completed":
            r["completed_at"] = int(time.time())
        return r

    def _ev(self, kind: str, **payload) -> bytes:
        b = sse_event(kind, {"type": kind, "sequence_number": self.seq, **payload})
        self.seq += 1
        return b

    # -- stream ---------------------------------------------------------------------------
    def start(self) -> list[bytes]:
        snap = self.response()
        return [self._ev("response.created", response=snap), self._ev("response.in_progress", response=snap)]

    def _add(self, item: dict) -> bytes:
        self.output.append(item)
        return self._ev("response.output_item.added", output_index=len(self.output) - 1, item=dict(item))

    def _where(self) -> dict:
        assert self.open is not None  # called right after an item was opened
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}

    def _open_reasoning(self) -> list[bytes]:
        out = self._close()
        self.open = {"id": new_item_id("reasoning"), "type": "reasoning", "summary": [], "status": "in_progress"}
        if not self.req.summary:
            self.open["content"] = []
        out.append(self._add(self.open))
        if self.req.summary:
            out.append(self._ev("response.reasoning_summary_part.added", **self._where(), summary_index=0,
                                part={"type": "summary_text", "text": ""}))
        else:
            out.append(self._ev("response.content_part.added", **self._where(), content_index=0,
                                part={"type": "reasoning_text", "text": ""}))
        return out

    def _open_message(self) -> list[bytes]:
        out = self._close()
        self.open = {"id": new_item_id("message"), "type": "message", "role": "assistant", "status": "in_progress",
                     "content": []}
        out.append(self._add(self.open))
        out.append(self._ev("response.content_part.added", **self._where(), content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))
        return out

    def _close(self) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        text = "".join(self._text)
        self._text = []
        w = {"item_id": item["id"], "output_index": len(self.output) - 1}
        out = []
        if item["type"] == "reasoning":
            part: dict[str, Any] = {"type": "summary_text" if self.req.summary else "reasoning_text", "text": text}
            if self.req.summary:
                out.append(self._ev("response.reasoning_summary_text.done", **w, summary_index=0, text=text))
                out.append(self._ev("response.reasoning_summary_part.done", **w, summary_index=0, part=part))
                item["summary"] = [part]
            else:
                out.append(self._ev("response.reasoning_text.done", **w, content_index=0, text=text))
                out.append(self._ev("response.content_part.done", **w, content_index=0, part=part))
                item["content"] = [part]
            if self.req.encrypted:
                item["encrypted_content"] = encrypt_reasoning(text)
        else:
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            out.append(self._ev("response.output_text.done", **w, content_index=0, text=text, logprobs=[]))
            out.append(self._ev("response.content_part.done", **w, content_index=0, part=part))
            item["content"] = [part]
        item["status"] = "completed"
        out.append(self._ev("response.output_item.done", output_index=w["output_index"], item=dict(item)))
        return out

    def event(self, o: Out) -> list[bytes]:
        out: list[bytes] = []
        if o.kind == "reasoning":
            if self.open is None or self.open["type"] != "reasoning":
                out += self._open_reasoning()
            self._text.append(o.text)
            if self.req.summary:
                out.append(self._ev("response.reasoning_summary_text.delta", **self._where(), summary_index=0,
                                    delta=o.text))
            else:
                out.append(self._ev("response.reasoning_text.delta", **self._where(), content_index=0,
                                    delta=o.text))
        elif o.kind == "content":
            if self.open is None or self.open["type"] != "message":
                out += self._open_message()
            self._text.append(o.text)
            out.append(self._ev("response.output_text.delta", **self._where(), content_index=0, delta=o.text,
                                logprobs=[]))
        else:
            out += self._close()
            out += self._call(o.call)
        return out

    def _call(self, call) -> list[bytes]:
        ns, name = self.req.tools.output_name(call.name)
        custom = call.name in self.req.tools.custom
        kind = "custom_tool_call" if custom else "function_call"
        item = {"id": new_item_id(kind), "type": kind, "status": "in_progress", "call_id": call.id, "name": name}
        if ns is not None:
            item["namespace"] = ns
        out = []
        if custom:
            text = call.arguments.get("input") if isinstance(call.arguments.get("input"), str) else call.arguments_json
            item["input"] = ""
            out.append(self._add(item))
            w = {"item_id": item["id"], "output_index": len(self.output) - 1}
            out.append(self._ev("response.custom_tool_call_input.delta", **w, delta=text))
            out.append(self._ev("response.custom_tool_call_input.done", **w, input=text))
            item["input"] = text
        else:
            item["arguments"] = ""
            out.append(self._add(item))
            w = {"item_id": item["id"], "output_index": len(self.output) - 1}
            out.append(self._ev("response.function_call_arguments.delta", **w, delta=call.arguments_json))
            out.append(self._ev("response.function_call_arguments.done", **w, name=name,
                                arguments=call.arguments_json))
            item["arguments"] = call.arguments_json
        item["status"] = "completed"
        out.append(self._ev("response.output_item.done", output_index=w["output_index"], item=dict(item)))
        return out

    def done(self, d: Done) -> list[bytes]:
        out = self._close()
        self.usage = usage_body(d)
        if d.finish_reason == "error":
            self.status = "failed"
            self.error = {"code": "server_error", "message": f"generation failed: {d.error}"}
            out.append(self._ev("response.failed", response=self.response()))
        elif d.finish_reason == "length":
            self.status = "incomplete"
            self.incomplete = {"reason": "max_output_tokens"}
            out.append(self._ev("response.incomplete", response=self.response()))
        else:
            self.status = "completed"
            out.append(self._ev("response.completed", response=self.response()))
        return out


def _stored(store: ResponseStore, req: ResponsesRequest, b: ResponseBuilder) -> None:
    if req.store and b.status in ("completed", "incomplete"):
        store.put(b.response(), req.input_items, req.history + [dict(i) for i in b.output])


# ---- routes -------------------------------------------------------------------------------
@router.post("/v1/responses", openapi_extra=request_body(RESPONSES_REQUEST), responses=error_responses())
async def create_response(request: Request):
    state = _state(request)
    rid = request_id(request)
    t0 = time.monotonic()
    body = await read_json(request, state.config.max_request_bytes)
    store = response_store(state)
    req = parse_request(state, body, store)
    prep = await gen.prepare_chat(state, req.inputs)
    handle = await gen.submit(state, request.receive, prep.prompt_ids, prep.params, rid, prep.session_key,
                              prompt_param="input", extra=prep.request_fields())
    headers = {"x-request-id": rid}
    if handle is None:
        return Response(status_code=499, headers=headers)
    conv = ChatStream(prep.started_in_think, prep.tools, state.config.tolerant_tool_calls, state.token_text,
                      token_bytes=state.token_bytes)
    def on_done(d):
        gen.log_record(state, "openai.responses", rid, len(prep.prompt_ids), d, t0, req.stream)

    events = gen.engine_events(handle, conv, on_done)
    builder = ResponseBuilder(new_id("resp_"), req, int(time.time()))
    if req.stream:
        return SSEResponse(_response_sse(handle, builder, events, store), headers=headers,
                           keepalive_s=state.config.keepalive_s)
    try:
        ok, done = await until_disconnect(request.receive, _drain(builder, events))
    finally:
        gen.release(handle)
    if not ok:
        return Response(status_code=499, headers=headers)
    if done.finish_reason == "error":
        raise APIError(500, f"generation failed: {done.error}", code="server_error")
    _stored(store, req, builder)
    return JSONResponse(builder.response(), headers=headers)


async def _drain(builder: ResponseBuilder, events) -> Done:
    async for ev in events:
        if isinstance(ev, Done):
            builder.done(ev)
            return ev
        builder.event(ev)
    raise APIError(500, "generation ended without a result")  # pragma: no cover


async def _response_sse(handle, builder: ResponseBuilder, events, store: ResponseStore):
    try:
        for b in builder.start():
            yield b
        async for ev in events:
            if isinstance(ev, Done):
                for b in builder.done(ev):
                    yield b
                _stored(store, builder.req, builder)
                break
            for b in builder.event(ev):
                yield b
    finally:
        await events.aclose()
        gen.release(handle)


@router.post("/v1/responses/input_tokens", openapi_extra=request_body(RESPONSES_REQUEST),
             responses=error_responses(statuses=(400, 401, 404, 413, 429)))
async def input_tokens(request: Request):
    state = _state(request)
    body = await read_json(request, state.config.max_request_bytes)
    req = parse_request(state, body, response_store(state))
    n = await gen.count_prompt_tokens(state, req.inputs)
    return JSONResponse({"object": "response.input_tokens", "input_tokens": n})


def _not_found(rid: str) -> APIError:
    return APIError(404, f"No response found with id '{rid}'.", param="response_id", code="not_found")


@router.get("/v1/responses/{rid}", responses=error_responses(statuses=(401, 404)))
async def get_response(rid: str, request: Request):
    entry = response_store(_state(request)).get(rid)
    if entry is None:
        raise _not_found(rid)
    return JSONResponse(entry.response)


@router.delete("/v1/responses/{rid}", responses=error_responses(statuses=(401, 404)))
async def delete_response(rid: str, request: Request):
    if not response_store(_state(request)).delete(rid):
        raise _not_found(rid)
    return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})


@router.get("/v1/responses/{rid}/input_items", openapi_extra=INPUT_ITEMS_QUERY,
            responses=error_responses(statuses=(400, 401, 404)))
async def list_input_items(rid: str, request: Request):
    entry = response_store(_state(request)).get(rid)
    if entry is None:
        raise _not_found(rid)
    q = request.query_params
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request("order must be 'asc' or 'desc'", param="order")
    try:
        limit = int(q.get("limit", "20"))
    except ValueError:
        raise bad_request("limit must be an integer", param="limit") from None
    if not 1 <= limit <= 100:
        raise bad_request("limit must be in 1..100", param="limit")
    items = list(entry.input_items) if order == "asc" else list(reversed(entry.input_items))
    after = q.get("after")
    if after is not None:
        ids = [i["id"] for i in items]
        if after not in ids:
            raise bad_request(f"after: no item {after!r} in this response's input", param="after")
        items = items[ids.index(after) + 1:]
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                         "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
