"""API-neutral generation: prompt rendering, sampling resolution, running a request, and
turning engine deltas into reasoning / content / tool-call events.

The OpenAI and Anthropic modules parse their wire formats into ``ChatInputs``, call
``prepare_chat`` and ``submit``, then feed ``engine_events`` (a stream of ``Out`` and one final
``Done``) into their own response builders. ``ChatStream`` is pure (no I/O), so response
builders can be tested with scripted ``Delta`` / ``Finished`` sequences.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional


from ..chat_template import ChatTemplateError
from ..reasoning import ReasoningStreamSplitter
from ..runtime.engine import Delta, Finished, GenRequest, RequestHandle
from ..runtime.errors import EngineError
from ..runtime.grammar import ConstraintError, GrammarUnavailable
from ..runtime.sampling import SamplingError, SamplingParams, resolve_sampling_params
from ..tool_calls import ToolCall, ToolCallStreamDecoder
from .errors import APIError, ContextLengthExceeded, bad_request, from_engine, from_sampling
from .sse import until_disconnect
from .system_fold import fold_system_messages

# names render() or the template call itself binds: never taken from chat_template_kwargs
_RESERVED_TEMPLATE_VARS = {"self", "messages", "tools", "add_generation_prompt", "documents", "template_name",
                           "preserve_thinking", "enable_thinking"}


# ---- inputs -----------------------------------------------------------------------------
@dataclass
class ChatInputs:
    """A chat request after wire-format parsing (OpenAI-style messages and function tools)."""

    messages: list[dict]
    tools: Optional[list[dict]] = None  # rendered into the prompt
    parse_tools: bool = True  # False for tool_choice "none"
    enable_thinking: Optional[bool] = None  # None -> server default (--no-thinking)
    preserve_thinking: Optional[bool] = None  # None -> server default (--preserve-thinking)
    template_kwargs: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)  # SamplingParams field -> request value
    param_names: dict = field(default_factory=dict)  # SamplingParams field -> request spelling
    session_key: Optional[str] = None
    thinking_budget: Optional[int] = None  # Anthropic thinking.budget_tokens (None -> server default)
    # constrained-decoding spec ({"type": "json_schema", "schema", "strict"} | {"type": "json_object"} |
    # {"type": "tool_call", "mode": "required" | "named", "name", "tools"}); runtime/structural_tags.py
    constraint: Optional[dict] = None
    constraint_param: str = ""  # the request field the constraint came from (named by a 400)
    images: list = field(default_factory=list)  # ImageRef per image part, in prompt order (server/image_parts.py)


@dataclass
class Prepared:
    prompt_text: str
    prompt_ids: list[int]
    params: SamplingParams
    thinking: bool
    started_in_think: bool
    tools: Optional[list[dict]]  # for the tool-call parser; None = no parsing
    session_key: Optional[str] = None
    thinking_budget: Optional[int] = None  # enforced by the engine while the reply is reasoning
    constraint: Optional[dict] = None  # compiled (and cached) by prepare_chat
    media: Any = None  # runtime/media.py MediaInput when the prompt has images

    def request_fields(self) -> dict:
        """Engine-side extras: KV identity of the template mode, the reasoning budget, the constraint, the
        images."""
        return {"cache_mode": "think" if self.thinking else "nothink", "thinking_budget": self.thinking_budget,
                "started_in_think": self.started_in_think, "constraint": self.constraint, "media": self.media}


def render_prompt(state, inp: ChatInputs) -> tuple[str, bool]:
    """Chat template -> (prompt text, thinking enabled)."""
    cfg = state.config
    thinking = cfg.enable_thinking if inp.enable_thinking is None else bool(inp.enable_thinking)
    preserve = cfg.preserve_thinking if inp.preserve_thinking is None else bool(inp.preserve_thinking)
    kwargs = {k: v for k, v in inp.template_kwargs.items()
              if isinstance(k, str) and k.isidentifier() and k not in _RESERVED_TEMPLATE_VARS}
    kwargs["enable_thinking"] = thinking
    try:
        text = state.template.render(fold_system_messages(inp.messages), tools=inp.tools or None,
                                     add_generation_prompt=True, preserve_thinking=preserve, **kwargs)
    except ChatTemplateError as e:
        raise bad_request(str(e), param="messages") from None
    return text, thinking


def prompt_opens_think(prompt_text: str) -> bool:
    """True when the generation prompt leaves the model inside ``<think>``."""
    return prompt_text.rstrip().endswith("<think>")


def encode(state, text: str) -> list[int]:
    return state.tok.encode(text, add_special_tokens=False).ids


def resolve_params(state, layer: dict, names: dict, thinking: bool) -> SamplingParams:
    """request > process flags > model preset (thinking / non-thinking) > defaults."""
    cfg = state.config
    try:
        return resolve_sampling_params(layer, cfg.sampling_overrides, cfg.family, thinking,
                                       vocab_size=state.vocab_size, model_defaults=cfg.model_sampling_defaults)
    except SamplingError as e:
        raise from_sampling(e, names) from None
    except (TypeError, ValueError) as e:  # shapes SamplingParams cannot even hold
        raise bad_request(f"invalid sampling parameters: {e}") from None


def compile_constraint(state, inp: ChatInputs, reasoning: bool) -> None:
    """Compile the request's constraint now, off the event loop (the engine then finds it cached);
    a schema xgrammar cannot honour is a 400 naming the request field (or the tool) it came from."""
    try:
        state.engine.constraints.compile(inp.constraint, reasoning=reasoning)
    except ConstraintError as e:
        names = [((t.get("function") or t).get("name")) for t in inp.tools or []]
        param = f"tools[{names.index(e.tool)}]" if e.tool in names else inp.constraint_param
        raise bad_request(f"{param}: {e}", param=param) from None
    except GrammarUnavailable as e:
        raise bad_request(f"{inp.constraint_param}: {e}", param=inp.constraint_param) from None


def check_fits(state, text: str, param: str = "messages") -> None:
    """Refuse a prompt that cannot fit the context before tokenizing it: every token stands for at most
    max_token_bytes bytes, so the token count is at least bytes / that."""
    limit = state.config.max_context - 1
    floor = len(text.encode("utf-8", "surrogatepass")) // state.max_token_bytes
    if floor > limit:
        raise ContextLengthExceeded(floor, limit, param)


def _prepare_chat_sync(state, inp: ChatInputs) -> Prepared:
    text, thinking = render_prompt(state, inp)
    check_fits(state, text)
    params = resolve_params(state, inp.sampling, inp.param_names, thinking)
    ids = encode(state, text)
    tools = inp.tools if (inp.tools and inp.parse_tools) else None
    budget = inp.thinking_budget if inp.thinking_budget is not None else state.config.default_thinking_budget
    opens_think = prompt_opens_think(text)
    if inp.constraint is not None:
        compile_constraint(state, inp, opens_think)
    return Prepared(text, ids, params, thinking, opens_think, tools, inp.session_key,
                    budget if thinking else None, inp.constraint)


async def prepare_chat(state, inp: ChatInputs) -> Prepared:
    """Render + tokenize off the event loop (long prompts take a while); images -> the media payload."""
    prep = await state.prep.run(_prepare_chat_sync, state, inp)
    if inp.images:
        prep.prompt_ids, prep.media = await _vision(state).media_for(prep.prompt_ids, inp.images)
    elif getattr(state, "vision", None) is not None and state.vision.pad_id in prep.prompt_ids:
        raise bad_request("the prompt has an image placeholder but no image (image placeholder text in a message?)",
                          param="messages")
    return prep


def _vision(state):
    vision = getattr(state, "vision", None)
    if vision is None:
        raise bad_request("this model does not take images (no vision tower, or the server runs with --no-vision)",
                          param="messages")
    return vision


async def count_prompt_tokens(state, inp: ChatInputs) -> int:
    def work():
        text, _ = render_prompt(state, inp)
        return encode(state, text)

    ids = await state.prep.run(work)
    if inp.images:
        ids, _ = await _vision(state).media_for(ids, inp.images, encode=False)
    return len(ids)


# ---- events -----------------------------------------------------------------------------
@dataclass
class Out:
    kind: str  # reasoning | content | tool_call
    text: str = ""
    call: Optional[ToolCall] = None
    logprobs: Optional[list] = None  # OpenAI-style per-token entries produced with this piece


@dataclass
class Done:
    finish_reason: str  # stop | length | tool_calls | cancelled | error
    usage: dict
    timings: dict
    stop_matched: Optional[str] = None
    error: Optional[str] = None
    logprobs: Optional[list] = None  # entries not yet attached to an Out
    tool_parse: Optional[dict] = None  # for the request log


def logprob_entries(delta: Delta, token_text: Callable[[int], str],
                    token_bytes: Optional[Callable[[int], bytes]] = None) -> list[dict]:
    """OpenAI chat ``logprobs.content`` entries for the tokens of one delta. ``bytes`` are the token's own
    bytes (a token holding part of a UTF-8 character has no text of its own: its bytes say what it is)."""
    raw = token_bytes or (lambda t: token_text(t).encode("utf-8"))
    out = []
    for lp in delta.logprobs or []:
        if lp is None:
            continue
        tid = int(lp.token_id)
        top = [{"token": token_text(int(i)), "logprob": float(v), "bytes": list(raw(int(i)))}
               for i, v in zip(lp.top_ids, lp.top_logprobs)]
        out.append({"token": token_text(tid), "logprob": float(lp.logprob), "bytes": list(raw(tid)),
                    "top_logprobs": top})
    return out


class ChatStream:
    """Engine deltas -> ``Out`` events (reasoning, content, tool calls) and a final ``Done``.

    Text goes through the ``<think>`` splitter; the answer part then goes through the
    tool-call decoder when tools are active. Leading whitespace of the answer is held until
    real text arrives, so an answer that is only a tool call has no blank content.
    """

    def __init__(self, started_in_think: bool = False, tools: Optional[list[dict]] = None, tolerant: bool = False,
                 token_text: Optional[Callable[[int], str]] = None, split_reasoning: bool = True,
                 token_bytes: Optional[Callable[[int], bytes]] = None):
        self.splitter = ReasoningStreamSplitter(started_in_think) if split_reasoning else None
        self.decoder = ToolCallStreamDecoder(tools, tolerant=tolerant) if tools else None
        self.token_text = token_text or (lambda t: str(t))
        self.token_bytes = token_bytes
        self.calls: list[ToolCall] = []
        self._lead_ws = ""
        self._content_started = False
        self._pending_lp: list[dict] = []
        self.done: Optional[Done] = None

    # -- feeding ------------------------------------------------------------------------
    def feed(self, delta: Delta) -> list[Out]:
        if delta.logprobs:
            self._pending_lp.extend(logprob_entries(delta, self.token_text, self.token_bytes))
        out: list[Out] = []
        if delta.text:
            if self.splitter is None:
                self._answer(delta.text, out)
            else:
                self._route(self.splitter.feed(delta.text), out)
        return self._attach(out)

    def finish(self, fin: Finished) -> list:
        out: list = []
        if self.splitter is not None:
            self._route(self.splitter.finish(), out)
        tool_parse = None
        if self.decoder is not None:
            for kind, x in self.decoder.finish(truncated=fin.reason == "length"):
                self._answer_event(kind, x, out)
            r = self.decoder.result
            assert r is not None  # finish() just set it
            tool_parse = {"marker_seen": r.marker_seen, "structured_call_count": len(r.calls),
                          "fallback_reason": r.fallback_reason, "recoveries": list(r.recoveries)}
        if self._lead_ws and not self.calls:
            self._content_started = True
            out.append(Out("content", self._lead_ws))
        self._lead_ws = ""
        out = self._attach(out)
        reason = fin.reason
        if self.calls and reason == "stop":
            reason = "tool_calls"
        usage = dict(fin.usage or {})  # the engine counts reasoning_tokens as it commits them
        usage.setdefault("reasoning_tokens", 0)
        self.done = Done(reason, usage, dict(fin.timings or {}), fin.stop_matched, fin.error,
                         self._pending_lp or None, tool_parse)
        self._pending_lp = []
        out.append(self.done)
        return out

    # -- routing ------------------------------------------------------------------------
    def _attach(self, out: list) -> list:
        if self._pending_lp and out and isinstance(out[0], Out):
            out[0].logprobs = self._pending_lp
            self._pending_lp = []
        return out

    def _route(self, parts, out: list) -> None:
        for kind, text in parts:
            if kind == "reasoning":
                out.append(Out("reasoning", text))
            else:
                self._answer(text, out)

    def _answer(self, text: str, out: list) -> None:
        if self.decoder is None:
            self._content(text, out)
            return
        for kind, x in self.decoder.feed(text):
            self._answer_event(kind, x, out)

    def _answer_event(self, kind: str, x: Any, out: list) -> None:
        if kind == "tool_call":
            self.calls.append(x)
            out.append(Out("tool_call", call=x))
        else:
            self._content(x, out)

    def _content(self, text: str, out: list) -> None:
        if not text:
            return
        if not self._content_started:
            text = self._lead_ws + text
            if not text.strip():
                self._lead_ws = text
                return
            self._lead_ws = ""
            self._content_started = True
        out.append(Out("content", text))


@dataclass
class Collected:
    reasoning: str
    content: str
    calls: list[ToolCall]
    logprobs: list
    done: Done


async def collect(events: AsyncIterator) -> Collected:
    reasoning, content, calls, lps = [], [], [], []
    done = None
    async for ev in events:
        if isinstance(ev, Done):
            done = ev
            lps.extend(ev.logprobs or [])
            continue
        lps.extend(ev.logprobs or [])
        if ev.kind == "reasoning":
            reasoning.append(ev.text)
        elif ev.kind == "content":
            content.append(ev.text)
        else:
            calls.append(ev.call)
    if done is None:  # pragma: no cover - engine_events always ends with Done
        raise APIError(500, "generation ended without a result")
    return Collected("".join(reasoning), "".join(content), calls, lps, done)


# ---- running ----------------------------------------------------------------------------
async def submit(state, receive, prompt_ids: list[int], params: SamplingParams, request_id: str,
                 session_key: Optional[str] = None, prompt_param: str = "messages",
                 extra: Optional[dict] = None) -> Optional[RequestHandle]:
    """Queue a request and wait for admission (errors become APIError with the engine's
    status); ``None`` when the client disconnected while waiting."""
    loop = asyncio.get_running_loop()
    try:
        handle = state.engine.submit(GenRequest(prompt_ids, params, request_id, session_key, **(extra or {})),
                                     loop=loop)
    except EngineError as e:
        raise from_engine(e, prompt_param) from None
    try:
        ok, _ = await until_disconnect(receive, handle.wait_admitted())
    except EngineError as e:
        raise from_engine(e, prompt_param) from None
    except BaseException:
        handle.cancel()
        raise
    if not ok:
        handle.cancel()
        return None
    return handle


async def engine_events(handle: RequestHandle, conv, on_done: Optional[Callable[[Optional[Done]], None]] = None):
    """Engine events -> converter output; cancels the engine request if the consumer stops early."""
    done: Optional[Done] = None
    try:
        async for ev in handle.events():
            if isinstance(ev, Finished):
                outs = conv.finish(ev)
                done = outs[-1]
                for o in outs:
                    yield o
                return
            for o in conv.feed(ev):
                yield o
    finally:
        if done is None:
            handle.cancel()
        if on_done is not None:
            try:
                on_done(done)
            except Exception:  # logging must never break a response
                pass


async def run_collect(receive, handle: RequestHandle, events) -> tuple[bool, Optional[Collected]]:
    """Non-streaming: collect every event unless the client disconnects (then cancel)."""
    try:
        return await until_disconnect(receive, collect(events))
    finally:
        release(handle)


def release(handle: RequestHandle) -> None:
    """Cancel the engine request unless it already finished (idempotent)."""
    if handle.finished is None:
        handle.cancel()


def log_record(state, api: str, request_id: str, prompt_tokens: int, done: Optional[Done], t0: float,
               stream: bool) -> None:
    state.record(api, request_id, prompt_tokens, done, (time.monotonic() - t0) * 1000, stream)
