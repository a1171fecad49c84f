"""Server-sent events and client-disconnect handling.

``SSEResponse`` streams an async iterator of already-framed events, sends a keep-alive after
``keepalive_s`` of silence, and watches the ASGI ``receive`` channel for ``http.disconnect``:
when the client goes away the producer is cancelled and closed, so its ``finally`` blocks run
at once (that is where the engine request is cancelled). ``until_disconnect`` does the same
for a plain awaitable (non-streaming requests, waiting for admission).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, AsyncGenerator, Awaitable, Optional

from starlette.responses import Response
from starlette.types import Receive

log = logging.getLogger("ninfer.server")

DONE = b"data: [DONE]\n\n"
KEEPALIVE_COMMENT = b": keep-alive\n\n"


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse_data(obj: Any) -> bytes:
    """One unnamed event (OpenAI style)."""
    return f"data: {dumps(obj)}\n\n".encode()


def sse_event(name: str, obj: Any) -> bytes:
    """One named event (Anthropic style)."""
    return f"event: {name}\ndata: {dumps(obj)}\n\n".encode()


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        msg = await receive()
        if msg.get("type") == "http.disconnect":
            return


async def _cancel_and_wait(task: "asyncio.Future") -> None:
    if not task.done():
        task.cancel()
    with contextlib.suppress(BaseException):
        await task


async def until_disconnect(receive: Receive, aw: Awaitable) -> tuple[bool, Any]:
    """Run ``aw`` unless the client disconnects first.

    Returns ``(True, result)``, or ``(False, None)`` after cancelling ``aw`` because the client
    left. Exceptions of ``aw`` propagate.
    """
    task = asyncio.ensure_future(aw)
    watcher = asyncio.ensure_future(_wait_disconnect(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return True, task.result()
        await _cancel_and_wait(task)
        return False, None
    finally:
        if not task.done():  # we were cancelled ourselves
            await _cancel_and_wait(task)
        await _cancel_and_wait(watcher)


class SSEResponse(Response):
    """ASGI response streaming ``events`` (bytes) as ``text/event-stream``.

    A ``Response`` subclass only so frameworks pass it through untouched; it never has a body
    of its own (and so no Content-Length).
    """

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: Optional[dict] = None, keepalive_s: float = 5.0,
                 keepalive: bytes = KEEPALIVE_COMMENT, status_code: int = 200):
        self.events = events
        self.sse_headers = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache",
                            "x-accel-buffering": "no", **(headers or {})}
        self.keepalive_s = keepalive_s
        self.keepalive = keepalive
        self.status_code = status_code
        self.background = None
        self.body = b""
        self.raw_headers = [(k.lower().encode("latin-1"), str(v).encode("latin-1"))
                            for k, v in self.sse_headers.items()]

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        agen = self.events
        watcher = asyncio.ensure_future(_wait_disconnect(receive))
        nxt: Optional[asyncio.Future] = None
        try:
            while True:
                nxt = asyncio.ensure_future(agen.__anext__())
                while True:
                    done, _ = await asyncio.wait({nxt, watcher}, timeout=self.keepalive_s,
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if nxt in done or watcher in done:
                        break
                    await send({"type": "http.response.body", "body": self.keepalive, "more_body": True})
                if not nxt.done():  # client gone while waiting for the next event
                    return
                try:
                    chunk = nxt.result()
                except StopAsyncIteration:
                    break
                except Exception:  # producers turn their errors into events; this is a backstop
                    log.exception("SSE producer failed")
                    return
                nxt = None
                if watcher.done():
                    return
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the transport broke under us: same as a disconnect
            return
        finally:
            if nxt is not None and not nxt.done():
                await _cancel_and_wait(nxt)
            with contextlib.suppress(BaseException):
                await agen.aclose()
            await _cancel_and_wait(watcher)
