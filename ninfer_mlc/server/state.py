"""What the HTTP layer holds: the engine, tokenizer, chat template and the serving settings."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from ..chat_template import ChatTemplate
from .prep_stage import PrepStage, max_token_bytes
from .request_log import RequestLogger
from .stats import HttpCounters

if TYPE_CHECKING:  # importing vision loads the image stack; the annotation alone needs no import
    from .vision import VisionService


@dataclass
class ServerConfig:
    model_id: str
    max_context: int
    api_key: Optional[str] = None
    cors: bool = False
    max_request_bytes: int = 64 << 20
    enable_thinking: bool = True  # default when a request does not say (--no-thinking flips it)
    # /v1/messages without `thinking`: False = no thinking (the real API); True = enable_thinking decides
    messages_thinking_default: bool = False  # --messages-thinking-default on|off (h/clients hook)
    preserve_thinking: bool = False  # keep reasoning of closed assistant turns (--preserve-thinking)
    tolerant_tool_calls: bool = False
    default_thinking_budget: Optional[int] = None  # --default-thinking-budget (reasoning tokens)
    sampling_overrides: dict = field(default_factory=dict)  # process-level flags (--temperature ...)
    family: Optional[str] = None  # model family for sampling presets
    model_sampling_defaults: dict = field(default_factory=dict)  # the model's generation_config.json
    keepalive_s: float = 5.0
    prep_workers: int = 2  # threads rendering and tokenizing prompts
    max_waiting_prep: int = 16  # requests waiting for one of them (beyond: 429)
    request_log_path: Optional[str] = None
    created: int = field(default_factory=lambda: int(time.time()))


def _byte_level_decoder() -> dict:
    """GPT-2's printable-character -> byte table (the inverse of bytes_to_unicode)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class ServerState:
    """Shared by every route. ``engine`` is a started ``runtime.engine.Engine``."""

    def __init__(self, engine: Any, template: ChatTemplate, config: ServerConfig, tokenizer: Any = None):
        self.engine = engine
        self.tok = tokenizer if tokenizer is not None else engine.tok
        self.template = template
        self.config = config
        self.log = RequestLogger(config.request_log_path)
        self.http = HttpCounters()  # in-flight / recent requests / answers by status for /stats
        self.vocab_size: Optional[int] = engine.runner.vocab_size if hasattr(engine, "runner") else None
        self.vision: Optional[VisionService] = None  # server/vision.py VisionService when the model takes images
        # render + tokenize off the event loop, bounded (server/prep_stage.py)
        self.prep = PrepStage(config.prep_workers, config.max_waiting_prep)
        self._max_token_bytes: Optional[int] = None
        self._byte_decoder: Optional[dict] = None
        self._tok_text: dict[int, str] = {}

    @property
    def max_token_bytes(self) -> int:
        if self._max_token_bytes is None:
            self._max_token_bytes = max_token_bytes(self.tok)
        return self._max_token_bytes

    def token_text(self, tid: int) -> str:
        s = self._tok_text.get(tid)
        if s is None:
            s = self.tok.decode([int(tid)], skip_special_tokens=False)
            if len(self._tok_text) < 200_000:
                self._tok_text[tid] = s
        return s

    def token_bytes(self, tid: int) -> bytes:
        """The raw bytes of one token. Byte-level BPE vocabularies spell each byte as one printable
        character (GPT-2's table), so a token that is half a UTF-8 character maps back to its real bytes;
        other tokenizers fall back to the UTF-8 of the token's text."""
        if self._byte_decoder is None:
            self._byte_decoder = _byte_level_decoder()
        piece = self.tok.id_to_token(int(tid))
        if piece is not None and all(c in self._byte_decoder for c in piece):
            return bytes(self._byte_decoder[c] for c in piece)
        return self.token_text(tid).encode("utf-8")

    def enter(self) -> None:
        self.http.enter()

    def leave(self) -> None:
        self.http.leave()

    def record(self, api: str, request_id: str, prompt_tokens: int, done: Any, wall_ms: float, stream: bool) -> None:
        """A finished (or abandoned: ``done`` None) generation request: request log + /stats."""
        if done is not None:
            self.http.record_request(request_id, done.timings, finish_reason=done.finish_reason, api=api,
                                     usage=done.usage)
        if not self.log.enabled:
            return
        self.log.log(request_id=request_id, model=self.config.model_id, api=api, stream=stream,
                     finish_reason=None if done is None else done.finish_reason,
                     usage=None if done is None else done.usage, timings=None if done is None else done.timings,
                     prompt_tokens=prompt_tokens, wall_ms=wall_ms,
                     stop_matched=None if done is None else done.stop_matched,
                     error=None if done is None else done.error,
                     tool_call_parse=None if done is None else done.tool_parse)
