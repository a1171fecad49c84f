"""OpenAI-compatible routes: /v1/models, /v1/chat/completions, /v1/completions.

Parsing (wire format -> ``ChatInputs``) and response building (``Out``/``Done`` events ->
JSON / SSE chunks) are plain functions and classes so they can be tested without a server.
"""
from __future__ import annotations

import re
import time
from typing import Any, Optional

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from . import generation as gen
from .constraints import openai_constraint
from .errors import APIError, bad_request
from .fields import (
    get_bool,
    get_dict,
    get_int,
    get_str,
    new_id,
    object_items,
    one_of,
    read_json,
    request_id,
    type_name,
)
from .generation import ChatInputs, ChatStream, Done, Out
from .image_parts import VISION_MARKER, openai_image_part
from .openapi_doc import CHAT_REQUEST, COMPLETION_REQUEST, error_responses, request_body
from .schema_check import check_schema
from .sse import DONE, SSEResponse, sse_data

router = APIRouter()

_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}
_TEXT_PARTS = {"text", "input_text", "output_text"}
_TOOL_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,128}")
_REASONING_EFFORTS = {"none", "minimal", "low", "medium", "high", "xhigh", "max"}
# SamplingParams field -> request field, for the fields whose names coincide
_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                    "repetition_penalty", "seed", "stop", "logit_bias", "n", "ignore_eos", "stop_token_ids")


def _state(request: Request):
    return request.app.state.ninfer


# ---- models -------------------------------------------------------------------------------
def model_card(state) -> dict:
    cfg = state.config
    return {"id": cfg.model_id, "object": "model", "created": cfg.created, "owned_by": "ninfer-mlc",
            "max_model_len": cfg.max_context}


@router.get("/v1/models", responses=error_responses(statuses=(401,)))
async def list_models(request: Request):
    return {"object": "list", "data": [model_card(_state(request))]}


@router.get("/v1/models/{model_id:path}", responses=error_responses(statuses=(401, 404)))
async def get_model(model_id: str, request: Request):
    state = _state(request)
    if model_id != state.config.model_id:
        raise APIError(404, f"The model `{model_id}` does not exist", param="model", code="model_not_found")
    return model_card(state)


def check_model(state, body: dict) -> str:
    model = body.get("model")
    if model is None or model == "":
        return state.config.model_id
    if not isinstance(model, str):
        raise bad_request(f"model must be a string, got {type_name(model)}", param="model")
    if model != state.config.model_id:
        raise APIError(404, f"The model `{model}` does not exist; this server serves `{state.config.model_id}`",
                       param="model", code="model_not_found")
    return model


# ---- request parsing ----------------------------------------------------------------------
def _text_content(content: Any, param: str, allow_none: bool = True, images: Optional[list] = None) -> Optional[str]:
    """images: where a user message's image parts go (their place in the text gets the vision marker)."""
    if content is None:
        if allow_none:
            return None
        raise bad_request(f"{param} is required", param=param)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if isinstance(p, str):
                parts.append(p)
                continue
            if not isinstance(p, dict):
                raise bad_request(f"{param}[{j}] must be an object", param=f"{param}[{j}]")
            ptype = p.get("type", "text")
            if one_of(ptype, _TEXT_PARTS):
                if not isinstance(p.get("text"), str):
                    raise bad_request(f"{param}[{j}].text must be a string", param=f"{param}[{j}].text")
                parts.append(p["text"])
            elif ptype in ("image_url", "input_image") and images is not None:
                images.append(openai_image_part(p, f"{param}[{j}]"))
                parts.append(VISION_MARKER)
            elif ptype in ("image_url", "input_image", "input_audio", "file", "video_url"):
                raise bad_request(f"{param}[{j}]: content type {ptype!r} is not supported (text-only model)",
                                  param=f"{param}[{j}].type")
            else:
                raise bad_request(f"{param}[{j}]: unknown content part type {ptype!r}", param=f"{param}[{j}].type")
        return "".join(parts)
    raise bad_request(f"{param} must be a string or an array of content parts, got {type_name(content)}",
                      param=param)


def parse_messages(raw: Any, images: Optional[list] = None) -> list[dict]:
    """images: collects the ImageRef of every user image part, in prompt order (None: images refused)."""
    if not isinstance(raw, list) or not raw:
        raise bad_request("messages must be a non-empty array", param="messages")
    out = []
    for i, m in enumerate(raw):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{p} must be an object", param=p)
        role = m.get("role")
        if not one_of(role, _ROLES):
            raise bad_request(f"{p}.role must be one of {sorted(_ROLES)}, got {role!r}", param=f"{p}.role")
        if role == "developer":
            role = "system"
        elif role == "function":
            role = "tool"
        msg: dict = {"role": role}
        content = _text_content(m.get("content"), f"{p}.content", allow_none=role in ("assistant",),
                                images=images if role == "user" else None)
        msg["content"] = content if content is not None else ""
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if role == "assistant":
            for key in ("reasoning_content", "reasoning"):
                r = m.get(key)
                if isinstance(r, str):
                    msg["reasoning_content"] = r
                    break
            calls = m.get("tool_calls")
            if calls is not None:
                msg["tool_calls"] = _parse_history_calls(calls, f"{p}.tool_calls")
        if role == "tool" and isinstance(m.get("tool_call_id"), str):
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _parse_history_calls(calls: Any, p: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"{p} must be an array", param=p)
    out = []
    for k, tc in enumerate(calls):
        if not isinstance(tc, dict) or not isinstance(tc.get("function"), dict):
            raise bad_request(f"{p}[{k}] must be an object with a function", param=f"{p}[{k}]")
        fn = tc["function"]
        if not isinstance(fn.get("name"), str):
            raise bad_request(f"{p}[{k}].function.name must be a string", param=f"{p}[{k}].function.name")
        args = fn.get("arguments", "")
        if not isinstance(args, (str, dict)):
            raise bad_request(f"{p}[{k}].function.arguments must be a JSON string",
                              param=f"{p}[{k}].function.arguments")
        out.append({"id": tc.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out


def parse_tools(raw: Any) -> Optional[list[dict]]:
    if raw is None:
        return None
    for p, t in object_items(raw, "tools"):
        if t.get("type", "function") != "function":
            raise bad_request(f"{p}.type {t.get('type')!r} is not supported; only function tools are",
                              param=f"{p}.type")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{p}.function must be an object", param=f"{p}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not _TOOL_NAME_RE.fullmatch(name):
            raise bad_request(f"{p}.function.name must match [A-Za-z0-9_.-]{{1,128}}", param=f"{p}.function.name")
        params = fn.get("parameters")
        if params is not None:
            check_schema(params, f"{p}.function.parameters")
        strict = fn.get("strict", t.get("strict"))
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"{p}.function.strict must be a boolean", param=f"{p}.function.strict")
    return raw or None


def parse_tool_choice(raw: Any) -> bool:
    """-> whether tool calls are allowed (auto, required, a named function) or not (none); what a
    forcing choice constrains is read by server/constraints.py."""
    if raw is None or raw in ("auto", "required"):
        return True
    if raw == "none":
        return False
    if isinstance(raw, dict):
        t = raw.get("type")
        if t in ("auto", "function", "allowed_tools"):
            return True
        if t == "none":
            return False
        raise bad_request(f"unknown tool_choice type {t!r}", param="tool_choice")
    raise bad_request(f"tool_choice must be 'auto', 'none', 'required' or a function, got {raw!r}",
                      param="tool_choice")


def _sampling_layer(body: dict) -> tuple[dict, dict]:
    layer = {k: body.get(k) for k in _SAMPLING_FIELDS if body.get(k) is not None}
    names: dict = {}
    if body.get("max_completion_tokens") is not None:
        layer["max_tokens"] = body["max_completion_tokens"]
        names["max_tokens"] = "max_completion_tokens"
    elif body.get("max_tokens") is not None:
        layer["max_tokens"] = body["max_tokens"]
    return layer, names


def parse_chat(state, body: dict) -> tuple[ChatInputs, bool, bool]:
    """-> (inputs, stream, include_usage)."""
    images: list = []
    messages = parse_messages(body.get("messages"), images)
    tools = parse_tools(body.get("tools"))
    allow_calls = parse_tool_choice(body.get("tool_choice"))
    stream = bool(get_bool(body, "stream", False))
    so = get_dict(body, "stream_options") or {}
    include_usage = bool(get_bool(so, "include_usage", False, param="stream_options.include_usage"))
    constraint, constraint_param = openai_constraint(body, tools, allow_calls)
    kwargs = dict(get_dict(body, "chat_template_kwargs") or {})
    enable_thinking = kwargs.pop("enable_thinking", None)
    preserve_thinking = kwargs.pop("preserve_thinking", None)
    for name, v in (("enable_thinking", enable_thinking), ("preserve_thinking", preserve_thinking)):
        if v is not None and not isinstance(v, bool):
            raise bad_request(f"chat_template_kwargs.{name} must be a boolean", param=f"chat_template_kwargs.{name}")
    effort = get_str(body, "reasoning_effort")
    if effort is not None:
        if effort not in _REASONING_EFFORTS:
            raise bad_request(f"reasoning_effort must be one of {sorted(_REASONING_EFFORTS)}, got {effort!r}",
                              param="reasoning_effort")
        if enable_thinking is None:
            enable_thinking = effort != "none"
        kwargs.setdefault("reasoning_effort", effort)
    layer, names = _sampling_layer(body)
    lp = body.get("logprobs")
    if lp is not None:
        layer["logprobs"] = lp
    if body.get("top_logprobs") is not None:
        layer["top_logprobs"] = body["top_logprobs"]
    session = get_str(body, "user") or get_str(body, "prompt_cache_key")
    inp = ChatInputs(messages=messages, tools=tools, parse_tools=allow_calls and tools is not None,
                     enable_thinking=enable_thinking, preserve_thinking=preserve_thinking, template_kwargs=kwargs,
                     sampling=layer, param_names=names, session_key=session, constraint=constraint,
                     constraint_param=constraint_param, images=images)
    if not allow_calls:
        inp.tools = None  # tool_choice "none": do not offer the tools at all
    return inp, stream, include_usage


# ---- response building --------------------------------------------------------------------
def usage_body(done: Done) -> dict:
    u = done.usage
    return {"prompt_tokens": u.get("prompt_tokens", 0), "completion_tokens": u.get("completion_tokens", 0),
            "total_tokens": u.get("total_tokens", 0),
            "prompt_tokens_details": {"cached_tokens": u.get("cached_tokens", 0)},
            "completion_tokens_details": {"reasoning_tokens": u.get("reasoning_tokens", 0)}}


def tool_call_body(call, index: Optional[int] = None) -> dict:
    d = {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}
    if index is not None:
        d["index"] = index
    return d


def chat_completion_body(cid: str, model: str, created: int, col: gen.Collected, want_logprobs: bool) -> dict:
    msg: dict = {"role": "assistant", "content": col.content if (col.content or not col.calls) else None}
    if col.reasoning:
        msg["reasoning_content"] = col.reasoning
    if col.calls:
        msg["tool_calls"] = [tool_call_body(c) for c in col.calls]
    choice = {"index": 0, "message": msg, "logprobs": {"content": col.logprobs} if want_logprobs else None,
              "finish_reason": col.done.finish_reason}
    return {"id": cid, "object": "chat.completion", "created": created, "model": model, "choices": [choice],
            "usage": usage_body(col.done), "timings": col.done.timings}


class ChatChunker:
    """``Out``/``Done`` events -> ``chat.completion.chunk`` dicts."""

    def __init__(self, cid: str, model: str, created: int, include_usage: bool = False, want_logprobs: bool = False):
        self.cid, self.model, self.created = cid, model, created
        self.include_usage = include_usage
        self.want_logprobs = want_logprobs
        self.n_calls = 0

    def _chunk(self, delta: dict, finish_reason: Optional[str] = None, logprobs: Optional[list] = None) -> dict:
        c = {"id": self.cid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
             "choices": [{"index": 0, "delta": delta,
                          "logprobs": {"content": logprobs} if (self.want_logprobs and logprobs) else None,
                          "finish_reason": finish_reason}]}
        if self.include_usage:
            c["usage"] = None
        return c

    def start(self) -> dict:
        return self._chunk({"role": "assistant", "content": ""})

    def event(self, o: Out) -> list[dict]:
        if o.kind == "reasoning":
            return [self._chunk({"reasoning_content": o.text}, logprobs=o.logprobs)]
        if o.kind == "content":
            return [self._chunk({"content": o.text}, logprobs=o.logprobs)]
        i = self.n_calls
        self.n_calls += 1
        c = o.call
        assert c is not None  # kind "tool_call"
        return [self._chunk({"tool_calls": [{"index": i, "id": c.id, "type": "function",
                                             "function": {"name": c.name, "arguments": ""}}]}, logprobs=o.logprobs),
                self._chunk({"tool_calls": [{"index": i, "function": {"arguments": c.arguments_json}}]})]

    def done(self, d: Done) -> list[dict]:
        fin = self._chunk({}, finish_reason=d.finish_reason, logprobs=d.logprobs)
        if not self.include_usage:
            fin["timings"] = d.timings
            return [fin]
        last = {"id": self.cid, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [], "usage": usage_body(d), "timings": d.timings}
        return [fin, last]


def stream_error_chunk(message: str, code: str = "generation_error") -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": code}}


# ---- routes -------------------------------------------------------------------------------
@router.post("/v1/chat/completions", openapi_extra=request_body(CHAT_REQUEST), responses=error_responses())
async def chat_completions(request: Request):
    state = _state(request)
    rid = request_id(request)
    t0 = time.monotonic()
    body = await read_json(request, state.config.max_request_bytes)
    model = check_model(state, body)
    inp, stream, include_usage = parse_chat(state, body)
    prep = await gen.prepare_chat(state, inp)
    want_lp = bool(prep.params.logprobs or prep.params.top_logprobs)
    handle = await gen.submit(state, request.receive, prep.prompt_ids, prep.params, rid, prep.session_key,
                              extra=prep.request_fields())
    headers = {"x-request-id": rid}
    if handle is None:
        return Response(status_code=499, headers=headers)
    conv = ChatStream(prep.started_in_think, prep.tools, state.config.tolerant_tool_calls, state.token_text,
                      token_bytes=state.token_bytes)
    on_done = lambda d: gen.log_record(state, "openai.chat", rid, len(prep.prompt_ids), d, t0, stream)  # noqa: E731
    events = gen.engine_events(handle, conv, on_done)
    cid, created = new_id("chatcmpl-"), int(time.time())
    if stream:
        chunker = ChatChunker(cid, model, created, include_usage, want_lp)
        return SSEResponse(_chat_sse(handle, chunker, events), headers=headers, keepalive_s=state.config.keepalive_s)
    ok, col = await gen.run_collect(request.receive, handle, events)
    if not ok:
        return Response(status_code=499, headers=headers)
    assert col is not None  # ok: collect() ran to the end
    if col.done.finish_reason == "error":
        raise APIError(500, f"generation failed: {col.done.error}", code="generation_error")
    return JSONResponse(chat_completion_body(cid, model, created, col, want_lp), headers=headers)


async def _chat_sse(handle, chunker: ChatChunker, events):
    try:
        yield sse_data(chunker.start())
        async for ev in events:
            if isinstance(ev, Done):
                if ev.finish_reason == "error":
                    yield sse_data(stream_error_chunk(f"generation failed: {ev.error}"))
                else:
                    for c in chunker.done(ev):
                        yield sse_data(c)
                break
            for c in chunker.event(ev):
                yield sse_data(c)
        yield DONE
    finally:
        await events.aclose()
        gen.release(handle)


# ---- legacy completions -------------------------------------------------------------------
def parse_prompt(state, raw: Any) -> list[int]:
    if isinstance(raw, str):
        gen.check_fits(state, raw, param="prompt")
        return gen.encode(state, raw)
    if isinstance(raw, list) and raw:
        if all(isinstance(x, int) and not isinstance(x, bool) for x in raw):
            V = state.vocab_size
            for x in raw:
                if x < 0 or (V is not None and x >= V):
                    raise bad_request(f"prompt token id {x} is out of the vocabulary", param="prompt")
            return list(raw)
        if len(raw) == 1:
            return parse_prompt(state, raw[0])
        raise bad_request("only one prompt per request is supported", param="prompt")
    raise bad_request("prompt must be a string, an array of token ids, or a one-element array of those",
                      param="prompt")


def completion_logprobs(entries: list[dict], offset0: int) -> dict:
    tokens, lps, tops, offsets = [], [], [], []
    off = offset0
    for e in entries:
        tokens.append(e["token"])
        lps.append(e["logprob"])
        tops.append({t["token"]: t["logprob"] for t in e["top_logprobs"]} or None)
        offsets.append(off)
        off += len(e["token"])
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


@router.post("/v1/completions", openapi_extra=request_body(COMPLETION_REQUEST), responses=error_responses())
async def completions(request: Request):
    state = _state(request)
    rid = request_id(request)
    t0 = time.monotonic()
    body = await read_json(request, state.config.max_request_bytes)
    model = check_model(state, body)
    if "prompt" not in body:
        raise bad_request("prompt is required", param="prompt")
    for unsupported in ("suffix",):
        if body.get(unsupported) not in (None, ""):
            raise bad_request(f"{unsupported} is not supported", param=unsupported)
    best_of = get_int(body, "best_of")
    if best_of not in (None, 1):
        raise bad_request("only best_of=1 is supported", param="best_of")
    stream = bool(get_bool(body, "stream", False))
    include_usage = bool(get_bool(get_dict(body, "stream_options") or {}, "include_usage", False,
                                  param="stream_options.include_usage"))
    echo = bool(get_bool(body, "echo", False))
    n_lp = get_int(body, "logprobs", minimum=0)
    layer, names = _sampling_layer(body)
    if n_lp is not None:
        layer["logprobs"] = True
        layer["top_logprobs"] = n_lp
        names["top_logprobs"] = "logprobs"
    raw_prompt = body["prompt"]
    ids = await state.prep.run(parse_prompt, state, raw_prompt)
    params = gen.resolve_params(state, layer, names, thinking=False)
    handle = await gen.submit(state, request.receive, ids, params, rid, get_str(body, "user"), prompt_param="prompt")
    headers = {"x-request-id": rid}
    if handle is None:
        return Response(status_code=499, headers=headers)
    echo_text = ""
    if echo:
        echo_text = raw_prompt if isinstance(raw_prompt, str) else state.tok.decode(ids, skip_special_tokens=False)
    conv = ChatStream(token_text=state.token_text, split_reasoning=False, token_bytes=state.token_bytes)
    on_done = lambda d: gen.log_record(state, "openai.completions", rid, len(ids), d, t0, stream)  # noqa: E731
    events = gen.engine_events(handle, conv, on_done)
    cid, created = new_id("cmpl-"), int(time.time())
    want_lp = n_lp is not None
    if stream:
        return SSEResponse(_completion_sse(handle, cid, model, created, events, echo_text, include_usage, want_lp),
                           headers=headers, keepalive_s=state.config.keepalive_s)
    ok, col = await gen.run_collect(request.receive, handle, events)
    if not ok:
        return Response(status_code=499, headers=headers)
    assert col is not None  # ok: collect() ran to the end
    if col.done.finish_reason == "error":
        raise APIError(500, f"generation failed: {col.done.error}", code="generation_error")
    choice = {"index": 0, "text": echo_text + col.content,
              "logprobs": completion_logprobs(col.logprobs, len(echo_text)) if want_lp else None,
              "finish_reason": col.done.finish_reason}
    return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                         "choices": [choice], "usage": usage_body(col.done), "timings": col.done.timings},
                        headers=headers)


async def _completion_sse(handle, cid, model, created, events, echo_text, include_usage, want_lp):
    try:
        async for b in _completion_sse_body(cid, model, created, events, echo_text, include_usage, want_lp):
            yield b
    finally:
        await events.aclose()
        gen.release(handle)


async def _completion_sse_body(cid, model, created, events, echo_text, include_usage, want_lp):
    def chunk(text: str, finish_reason=None, lps=None, offset=0) -> dict:
        c = {"id": cid, "object": "text_completion", "created": created, "model": model,
             "choices": [{"index": 0, "text": text,
                          "logprobs": completion_logprobs(lps, offset) if (want_lp and lps) else None,
                          "finish_reason": finish_reason}]}
        if include_usage:
            c["usage"] = None
        return c

    offset = 0
    if echo_text:
        yield sse_data(chunk(echo_text))
        offset = len(echo_text)
    async for ev in events:
        if isinstance(ev, Done):
            if ev.finish_reason == "error":
                yield sse_data(stream_error_chunk(f"generation failed: {ev.error}"))
                break
            fin = chunk("", ev.finish_reason, ev.logprobs, offset)
            if include_usage:
                yield sse_data(fin)
                yield sse_data({"id": cid, "object": "text_completion", "created": created, "model": model,
                                "choices": [], "usage": usage_body(ev), "timings": ev.timings})
            else:
                fin["timings"] = ev.timings
                yield sse_data(fin)
            break
        yield sse_data(chunk(ev.text, lps=ev.logprobs, offset=offset))
        offset += len(ev.text)
    yield DONE
