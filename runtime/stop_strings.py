"""Incremental stop-string matching over streamed text (OpenAI semantics).

The matcher holds back only the longest suffix of the text seen so far that could still be
the start of a stop string, so everything else streams out immediately.  When a stop string
completes, the output is truncated right before it (the stop string is not emitted) and the
matcher reports ``stopped``.

Which match wins is defined so that the result does not depend on how the text is split
into deltas: the match that *completes first* (smallest end offset) wins; among matches
ending at the same offset, the longest (earliest start) wins.
"""

from __future__ import annotations

from typing import Iterable, Optional

__all__ = ["StopStringMatcher"]


class StopStringMatcher:
    """``feed(delta) -> (emit_text, stopped, matched)``; ``flush() -> held text`` at end."""

    def __init__(self, stop: Optional[Iterable[str]] = None):
        stops = [s for s in (stop or [])]
        for s in stops:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        # dedupe, keep order
        seen: set[str] = set()
        self.stop: list[str] = [s for s in stops if not (s in seen or seen.add(s))]
        self._max_len = max((len(s) for s in self.stop), default=0)
        # every proper prefix of every stop string, for the hold-back test
        self._prefixes: set[str] = {s[:i] for s in self.stop for i in range(1, len(s))}
        self._held = ""
        self.stopped = False
        self.matched: Optional[str] = None

    @property
    def held(self) -> str:
        """Text currently held back (a possible start of a stop string)."""
        return self._held

    def _find(self, buf: str) -> tuple[int, Optional[str]]:
        best_end = -1
        best_start = -1
        best: Optional[str] = None
        for s in self.stop:
            i = buf.find(s)
            if i < 0:
                continue
            end = i + len(s)
            if best is None or end < best_end or (end == best_end and i < best_start):
                best_end, best_start, best = end, i, s
        return best_start, best

    def _holdback_len(self, buf: str) -> int:
        for k in range(min(len(buf), self._max_len - 1), 0, -1):
            if buf[-k:] in self._prefixes:
                return k
        return 0

    def feed(self, delta: str) -> tuple[str, bool, Optional[str]]:
        """Add streamed text; returns (text safe to emit now, stopped, matched stop string)."""
        if self.stopped:
            return "", True, self.matched
        if not self.stop:
            return delta, False, None
        buf = self._held + delta
        start, s = self._find(buf)
        if s is not None:
            self.stopped = True
            self.matched = s
            self._held = ""
            return buf[:start], True, s
        k = self._holdback_len(buf)
        if k:
            self._held = buf[-k:]
            return buf[:-k], False, None
        self._held = ""
        return buf, False, None

    def flush(self) -> str:
        """End of stream without a stop: release the held-back text."""
        if self.stopped:
            return ""
        out, self._held = self._held, ""
        return out

    def reset(self) -> None:
        self._held = ""
        self.stopped = False
        self.matched = None
