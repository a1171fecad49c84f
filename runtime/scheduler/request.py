"""One request: what the server submits (GenRequest), what the engine streams back (Delta,
Finished), and the engine-side state of a request while it lives (Request)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from ..detokenizer import IncrementalDetokenizer
from ..kv.manager import SeqKV
from ..kv.prefix_cache import identity_seed
from ..sampling import RowState, SamplingParams
from ..stop_strings import StopStringMatcher


@dataclass
class GenRequest:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    session_key: Optional[str] = None
    skip_special_tokens: bool = True
    thinking_budget: Optional[int] = None  # reasoning tokens before the engine closes </think> itself
    started_in_think: bool = False  # the prompt's generation prompt opened <think>
    cache_mode: str = ""  # template mode (e.g. thinking on/off) + media: part of the KV identity
    constraint: Optional[dict] = None  # constrained decoding spec (runtime/structural_tags.py)
    media: Any = None  # runtime/vision/media.py MediaInput: images, M-RoPE positions, cache key ids


# ---- events ----------------------------------------------------------------------------------
@dataclass
class Delta:
    text: str
    token_ids: list[int]  # every token committed since the previous delta
    logprobs: list = field(default_factory=list)


@dataclass
class Finished:
    reason: str  # stop | length | cancelled | error
    usage: dict
    timings: dict
    stop_matched: Optional[str] = None
    error: Optional[str] = None


class Sink(Protocol):
    """Where a request's events go (runtime.engine.RequestHandle)."""

    cached_tokens: int  # prompt tokens the prefix cache served (set at first admission)

    def push(self, ev: Any) -> None: ...

    def admit(self, err: Optional[Exception] = None) -> None: ...


# ---- engine-side state -------------------------------------------------------------------------
class Request:
    """A request between admission and its end. Owned by the scheduler (engine thread only)."""

    def __init__(self, rid: int, req: GenRequest, sink: Sink, max_tokens: int, stop_ids: set, tokenizer):
        self.rid, self.req, self.sink = rid, req, sink
        self.max_tokens = max_tokens
        self.stop_ids = stop_ids
        self.row = RowState(req.params, prompt_token_ids=req.prompt_ids)
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_ids[-8:], skip_special_tokens=req.skip_special_tokens)
        self.stops = StopStringMatcher(req.params.stop)
        self.identity = identity_seed(req.cache_mode)
        self.seq: Optional[SeqKV] = None
        self.feed: list[int] = list(req.prompt_ids)  # tokens still to prefill
        self.generated: list[int] = []
        self.pending_token: Optional[int] = None  # committed, not yet fed to the model
        self.unsent_ids: list[int] = []  # committed tokens not yet carried by a Delta
        # timings
        self.t_submit = time.monotonic()
        self.t_admit = 0.0
        self.admit_ms = 0.0  # first admission's KV work: prefix lookup, restore, room made for it
        self.t_first = 0.0
        self.t_prefill_done = 0.0
        self.prompt_computed = 0
        self.cached_tokens = 0
        self.preemptions = 0
        # reasoning
        self.in_think = req.started_in_think
        self.think_tokens = 0
        self.reasoning_tokens = 0
        self.forced: list[int] = []
        # prompt positions where prefill stops to checkpoint (set on first admission)
        self.checkpoints: list[int] = []
        self.grammar: Any = None  # runtime.grammar.GrammarMatcher of a constrained request
        # speculative decoding
        self.draft_n = 0
        self.draft_accepted = 0

    def fed_tokens(self) -> list[int]:
        """Prompt + generated tokens whose KV/state the sequence holds (or must hold)."""
        unfed = 1 if self.pending_token is not None else 0
        return list(self.req.prompt_ids) + self.generated[: len(self.generated) - unfed]

    def all_tokens(self) -> list[int]:
        return list(self.req.prompt_ids) + self.generated

    def tokens_between(self, start: int, stop: int) -> list[int]:
        """all_tokens()[start:stop] (0 <= start <= stop) without building the whole history."""
        prompt = self.req.prompt_ids
        n = len(prompt)
        head = [int(t) for t in prompt[start:stop]] if start < n else []
        return head + self.generated[max(start - n, 0): max(stop - n, 0)]

    def cache_keys(self, tokens: list[int]) -> list[int]:
        """The prefix-cache identity of tokens (a prefix of prompt + generated): image placeholders become
        ids derived from their image's digest (runtime/vision/mrope.py cache_key_ids), so a different image
        of the same size never matches."""
        media = self.req.media
        if media is None:
            return tokens
        n = len(self.req.prompt_ids)
        return list(media.key_ids[: min(len(tokens), n)]) + list(tokens[n:])

    @property
    def live_seq(self) -> SeqKV:
        """seq of an admitted request: the scheduler's running requests, and so every row of a step
        plan, hold one."""
        assert self.seq is not None, f"request {self.rid} holds no sequence"
        return self.seq

    @property
    def decoding(self) -> bool:
        return not self.feed and self.pending_token is not None

    @property
    def params(self) -> SamplingParams:
        return self.req.params
