"""What the HTTP layer holds: the engine, tokenizer, chat template and the serving settings."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

from ..chat_template import ChatTemplate


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
    keepalive_s: float = 5.0
    request_log_path: Optional[str] = None
    created: int = field(default_factory=lambda: int(time.time()))


class RequestLog:
    """Append-only JSONL request log (one line per finished request); thread-safe."""

    def __init__(self, path: Optional[str]):
        self.path = path
        self._lock = threading.Lock()

    def write(self, record: dict) -> None:
        if not self.path:
            return
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._lock:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)


def _http_counters():
    try:  # the /stats + /metrics module, when present
        from .stats import HttpCounters
    except ImportError:
        return None
    return HttpCounters()


def _request_logger(path: Optional[str]):
    try:
        from .request_log import RequestLogger
    except ImportError:
        return RequestLog(path)
    return RequestLogger(path)


class ServerState:
    """Shared by every route. ``engine`` is a started ``runtime.engine.Engine``."""

    def __init__(self, engine: Any, template: ChatTemplate, config: ServerConfig, tokenizer: Any = None):
        self.engine = engine
        self.tok = tokenizer if tokenizer is not None else engine.tok
        self.template = template
        self.config = config
        self.log = _request_logger(config.request_log_path)
        self.http = _http_counters()  # in-flight / recent requests for /stats
        self.vocab_size: Optional[int] = None
        runner = getattr(engine, "runner", None)
        if runner is not None:
            self.vocab_size = getattr(runner, "vocab_size", None)
        self.in_flight = 0
        self.max_in_flight = 0
        self._tok_text: dict[int, str] = {}

    def token_text(self, tid: int) -> str:
        s = self._tok_text.get(tid)
        if s is None:
            s = self.tok.decode([int(tid)], skip_special_tokens=False)
            if len(self._tok_text) < 200_000:
                self._tok_text[tid] = s
        return s

    def enter(self) -> None:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        if self.http is not None:
            self.http.enter()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.http is not None:
            self.http.leave()

    def record(self, api: str, request_id: str, prompt_tokens: int, done: Any, wall_ms: float, stream: bool) -> None:
        """A finished (or abandoned: ``done`` None) generation request: request log + /stats."""
        if self.http is not None and done is not None:
            self.http.record_request(request_id, done.timings, finish_reason=done.finish_reason, api=api,
                                     usage=done.usage)
        if not getattr(self.log, "path", None):
            return
        if hasattr(self.log, "log"):
            self.log.log(request_id=request_id, model=self.config.model_id, api=api, stream=stream,
                         finish_reason=None if done is None else done.finish_reason,
                         usage=None if done is None else done.usage, timings=None if done is None else done.timings,
                         prompt_tokens=prompt_tokens, wall_ms=wall_ms,
                         stop_matched=None if done is None else done.stop_matched,
                         error=None if done is None else done.error,
                         tool_call_parse=None if done is None else done.tool_parse)
            return
        rec = {"ts": round(time.time(), 3), "request_id": request_id, "api": api, "stream": stream,
               "model": self.config.model_id, "prompt_tokens": prompt_tokens, "wall_ms": round(wall_ms, 3)}
        if done is None:
            rec["finish_reason"] = "disconnected"
        else:
            rec.update(finish_reason=done.finish_reason, usage=done.usage, timings=done.timings,
                       stop_matched=done.stop_matched, error=done.error, tool_call_parse=done.tool_parse)
        self.log.write(rec)

    def stats(self) -> dict:
        snap = self.engine.snapshot()
        return {
            "timestamp_unix_ms": int(time.time() * 1000),
            "http": {"in_flight": self.in_flight, "max_in_flight": self.max_in_flight},
            "scheduler": {k: snap.get(k, 0) for k in ("running", "prefilling", "decode_ready", "waiting")},
            "counters": {k: v for k, v in snap.items() if k not in ("running", "prefilling", "decode_ready", "waiting")},
            "load": {"model_id": self.config.model_id, "max_context": self.config.max_context},
        }
