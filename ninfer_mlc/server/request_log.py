"""`--request-log-jsonl PATH`: one JSON line per finished request, appended.

A line looks like (keys always present; unknown values are null/0):

  {"ts": 1733150000.123, "request_id": "chatcmpl-...", "model": "qwen3x-tiny", "api": "openai.chat",
   "stream": true, "finish_reason": "stop", "prompt_tokens": 195, "completion_tokens": 16,
   "cached_tokens": 128, "queue_ms": 1.03, "prompt_ms": 287.7, "predicted_ms": 83.4,
   "prompt_per_second": 677.7, "predicted_per_second": 179.7, "draft_n": 0, "draft_n_accepted": 0,
   "draft_forced_acceptance": 0.0,
   "wall_ms": 402.1, "stop_matched": null, "error": null, "tool_call_parse": {...} | null}

`RequestLogger.write(record)` appends an arbitrary dict (the same interface as the server's
`state.RequestLog`), `RequestLogger.log(...)` builds the standard record from the engine's
`Finished.usage` / `Finished.timings`. Writes are serialised by a lock and each line is written
with a single `write` call on a file opened in append mode, so lines from concurrent requests
(and from several processes sharing the file) never interleave. The file is opened per write,
which keeps log rotation (rename + new file) working without a signal.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Any, Optional


def _num(v: Any, default=0):
    if isinstance(v, bool) or v is None:
        return default if v is None else int(v)
    if isinstance(v, (int, float)):
        return v
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


class RequestLogger:
    def __init__(self, path: Optional[str]):
        self.path = os.fspath(path) if path else None
        self._lock = threading.Lock()
        self.lines_written = 0
        self.write_errors = 0

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def check_writable(self) -> None:
        """Raise OSError now (at startup) when the log cannot be appended to."""
        if self.path:
            with open(self.path, "a", encoding="utf-8"):
                pass

    def write(self, record: dict) -> None:
        """Append one record as a JSON line. Never raises: a full disk must not fail a request."""
        if not self.path:
            return
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":"), default=str) + "\n"
        data = line.encode("utf-8")
        with self._lock:
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                try:
                    os.write(fd, data)
                finally:
                    os.close(fd)
                self.lines_written += 1
            except OSError:
                self.write_errors += 1

    def log(self, *, request_id: str, model: str, api: str, finish_reason: Optional[str],
            usage: Optional[dict] = None, timings: Optional[dict] = None, stream: Optional[bool] = None,
            prompt_tokens: Optional[int] = None, completion_tokens: Optional[int] = None,
            cached_tokens: Optional[int] = None, wall_ms: Optional[float] = None,
            stop_matched: Optional[str] = None, error: Optional[str] = None,
            tool_call_parse: Optional[dict] = None, **extra: Any) -> dict:
        """Build the standard record for a finished request, write it, and return it.

        `usage`/`timings` are the engine's `Finished.usage` and `Finished.timings`; explicit
        token counts override them. `finish_reason` None means the client went away.
        """
        u, t = usage or {}, timings or {}
        rec = {
            "ts": round(time.time(), 3),
            "request_id": str(request_id),
            "model": model,
            "api": api,
            "stream": stream,
            "finish_reason": finish_reason if finish_reason is not None else "disconnected",
            "prompt_tokens": int(_num(prompt_tokens if prompt_tokens is not None else u.get("prompt_tokens"))),
            "completion_tokens": int(_num(completion_tokens if completion_tokens is not None
                                          else u.get("completion_tokens", t.get("predicted_n")))),
            "cached_tokens": int(_num(cached_tokens if cached_tokens is not None
                                      else u.get("cached_tokens", t.get("cache_n")))),
            "queue_ms": _num(t.get("queue_ms"), 0.0),
            "admit_ms": _num(t.get("admit_ms"), 0.0),
            "prompt_ms": _num(t.get("prompt_ms"), 0.0),
            "predicted_ms": _num(t.get("predicted_ms"), 0.0),
            "prompt_per_second": _num(t.get("prompt_per_second"), 0.0),
            "predicted_per_second": _num(t.get("predicted_per_second"), 0.0),
            "draft_n": int(_num(t.get("draft_n"))),
            "draft_n_accepted": int(_num(t.get("draft_n_accepted"))),
            "draft_forced_acceptance": _num(t.get("draft_forced_acceptance"), 0.0),  # BENCHMARK profile; 0 = lossless
            "wall_ms": round(float(wall_ms), 3) if wall_ms is not None else None,
            "stop_matched": stop_matched,
            "error": error,
            "tool_call_parse": tool_call_parse,
        }
        rec.update(extra)
        self.write(rec)
        return rec

    def log_rejected(self, *, request_id: str, model: str, method: str, path: str, status: int,
                     error_type: Optional[str], error: Optional[str], wall_ms: float) -> dict:
        """A request answered with an error before (or instead of) generating: 4xx / 5xx."""
        rec = {"ts": round(time.time(), 3), "request_id": str(request_id), "model": model, "method": method,
               "path": path, "status": int(status), "finish_reason": "rejected", "error_type": error_type,
               "error": error, "wall_ms": round(float(wall_ms), 3)}
        self.write(rec)
        return rec
