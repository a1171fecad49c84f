"""Split ``<think>...</think>`` reasoning from the answer text.

Qwen3.5+ templates open ``<think>\\n`` inside the prompt when thinking is on, so
the generated text usually starts *inside* the reasoning and only contains
``</think>``; older Qwen3 checkpoints emit ``<think>`` themselves.  Newlines
next to the markers are layout, not payload: templates render history as
``<think>\\n{reasoning}\\n</think>\\n\\n{content}`` and strip them when reading it
back, so we strip them too (all newlines touching a marker, like the templates).
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ReasoningSplit", "split_reasoning", "ReasoningStreamSplitter", "THINK_OPEN", "THINK_CLOSE"]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_LEAD_WS = " \t\r\n"


class ReasoningSplit(NamedTuple):
    reasoning: str
    content: str
    closed: bool  # True once ``</think>`` was seen, or when there was no reasoning at all


def split_reasoning(text: str, started_in_think: bool = False) -> ReasoningSplit:
    """One-shot split.  ``started_in_think``: the prompt already ended with ``<think>``."""
    if started_in_think:
        body = text
    else:
        stripped = text.lstrip(_LEAD_WS)
        if not stripped.startswith(THINK_OPEN):
            return ReasoningSplit("", text, True)
        body = stripped[len(THINK_OPEN):]
    i = body.find(THINK_CLOSE)
    if i < 0:
        return ReasoningSplit(body.strip("\n"), "", False)
    return ReasoningSplit(body[:i].strip("\n"), body[i + len(THINK_CLOSE):].lstrip("\n"), True)


def _partial_suffix_len(s: str, marker: str) -> int:
    for k in range(min(len(s), len(marker) - 1), 0, -1):
        if s.endswith(marker[:k]):
            return k
    return 0


class ReasoningStreamSplitter:
    """Streaming counterpart of :func:`split_reasoning`.

    ``feed(delta)`` / ``finish()`` return ``[("reasoning"|"content", text), ...]``.
    Only text that may still turn into a marker (a partial marker, the newlines
    before it, or leading whitespace before a possible ``<think>``) is held back.
    """

    def __init__(self, started_in_think: bool = False):
        self._state = "lead_reasoning" if started_in_think else "start"
        self._buf = ""
        self._done = False

    @property
    def in_reasoning(self) -> bool:
        return self._state in ("lead_reasoning", "reasoning")

    @property
    def reasoning_closed(self) -> bool:
        """True once text is known to be content (after ``</think>``, or no reasoning at all)."""
        return self._state in ("lead_content", "content")

    @property
    def held_back(self) -> str:
        return self._buf

    def feed(self, delta: str) -> list[tuple[str, str]]:
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._buf += delta
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, str]]:
        if self._done:
            raise RuntimeError("finish() called twice")
        self._done = True
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []

        def emit(kind: str, text: str) -> None:
            if text:
                out.append((kind, text))

        while True:
            buf = self._buf
            st = self._state
            if st == "start":
                s = buf.lstrip(_LEAD_WS)
                if s.startswith(THINK_OPEN):
                    self._buf = s[len(THINK_OPEN):]
                    self._state = "lead_reasoning"
                    continue
                if not final and THINK_OPEN.startswith(s):
                    return out  # only whitespace and/or a partial "<think>" so far
                self._state = "content"
                continue
            if st in ("lead_reasoning", "lead_content"):
                s = buf.lstrip("\n")
                self._buf = s
                if not s:
                    return out
                self._state = "reasoning" if st == "lead_reasoning" else "content"
                continue
            if st == "reasoning":
                i = buf.find(THINK_CLOSE)
                if i >= 0:
                    emit("reasoning", buf[:i].rstrip("\n"))
                    self._buf = buf[i + len(THINK_CLOSE):]
                    self._state = "lead_content"
                    continue
                if final:
                    emit("reasoning", buf.rstrip("\n"))
                    self._buf = ""
                    return out
                # Hold back a partial "</think>" and the newlines right before it.
                keep = len(buf) - _partial_suffix_len(buf, THINK_CLOSE)
                keep = len(buf[:keep].rstrip("\n"))
                emit("reasoning", buf[:keep])
                self._buf = buf[keep:]
                return out
            # content: nothing left to interpret
            emit("content", buf)
            self._buf = ""
            return out
