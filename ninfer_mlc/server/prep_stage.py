"""The stage before the engine: prompt rendering and tokenization in a bounded worker pool.

Rendering a chat template and tokenizing a multi-megabyte prompt takes seconds; done on the event loop
it would freeze every other client (and /health). They run here instead, on a fixed number of threads,
with a bounded number of requests waiting for one: past that bound a request gets 429 at once, as a full
engine queue answers. A prompt whose text cannot fit the context whatever it tokenizes to (fewer tokens
than bytes / the longest token) is refused before the tokenizer sees it.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from .errors import APIError


class PrepStage:
    def __init__(self, workers: int, max_waiting: int):
        self.workers, self.max_waiting = max(1, workers), max(0, max_waiting)
        self._pool = ThreadPoolExecutor(self.workers, thread_name_prefix="ninfer-prep")
        self._lock = threading.Lock()
        self._inside = 0  # running + waiting

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        with self._lock:
            if self._inside >= self.workers + self.max_waiting:
                raise APIError(429, f"{self._inside} requests are being prepared or wait for it; retry shortly",
                               code="server_overloaded", headers={"Retry-After": "1"})
            self._inside += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, lambda: fn(*args))
        finally:
            with self._lock:
                self._inside -= 1

    @property
    def busy(self) -> int:
        return self._inside

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def max_token_bytes(tokenizer) -> int:
    """An upper bound on the UTF-8 bytes one token stands for (so tokens >= text bytes / this)."""
    return max((len(t.encode("utf-8")) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1) or 1
