"""Incremental stop-string matching over streamed text (OpenAI semantics), in linear time.

The matcher holds back only the longest suffix of the text seen so far that could still be the start
of a stop string, so everything else streams out immediately. When a stop string completes, the output
is truncated right before it (the stop string is not emitted) and the matcher reports ``stopped``.

Which match wins does not depend on how the text is split into deltas: the match that *completes
first* (smallest end offset) wins; among matches ending at the same offset, the longest wins.

An Aho-Corasick automaton over the stop strings does both jobs in one pass: after each character its
state is the longest suffix of the text that is a prefix of some stop string (that suffix is what must
be held back), and a state that ends a stop string reports the longest one ending there. Each character
costs amortised O(1), so neither long stop strings nor long deltas can stall the engine.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Optional

__all__ = ["StopStringMatcher"]


class _Automaton:
    """Trie of the stop strings with failure links; `match[s]`: length of the longest stop string that is
    a suffix of state s's string (0 = none)."""

    def __init__(self, patterns: list[str]):
        self.goto: list[dict[str, int]] = [{}]
        self.depth = [0]
        self.match = [0]
        for p in patterns:
            s = 0
            for c in p:
                nxt = self.goto[s].get(c)
                if nxt is None:
                    nxt = len(self.goto)
                    self.goto[s][c] = nxt
                    self.goto.append({})
                    self.depth.append(self.depth[s] + 1)
                    self.match.append(0)
                s = nxt
            self.match[s] = len(p)
        self.fail = [0] * len(self.goto)
        queue = deque(self.goto[0].values())
        while queue:
            s = queue.popleft()
            if not self.match[s]:
                self.match[s] = self.match[self.fail[s]]
            for c, t in self.goto[s].items():
                f = self.fail[s]
                while f and c not in self.goto[f]:
                    f = self.fail[f]
                self.fail[t] = self.goto[f].get(c, 0)
                queue.append(t)

    def step(self, s: int, c: str) -> int:
        while s and c not in self.goto[s]:
            s = self.fail[s]
        return self.goto[s].get(c, 0)


class StopStringMatcher:
    """``feed(delta) -> (emit_text, stopped, matched)``; ``flush() -> held text`` at end."""

    def __init__(self, stop: Optional[Iterable[str]] = None):
        stops = list(stop or [])
        for s in stops:
            if not isinstance(s, str) or s == "":
                raise ValueError(f"stop strings must be non-empty strings, got {s!r}")
        self.stop: list[str] = list(dict.fromkeys(stops))  # dedupe, keep order
        self._ac = _Automaton(self.stop) if self.stop else None
        self._state = 0
        self._held = ""
        self.stopped = False
        self.matched: Optional[str] = None

    @property
    def held(self) -> str:
        """Text currently held back (a possible start of a stop string)."""
        return self._held

    def feed(self, delta: str) -> tuple[str, bool, Optional[str]]:
        """Add streamed text; returns (text safe to emit now, stopped, matched stop string)."""
        if self.stopped:
            return "", True, self.matched
        if self._ac is None:
            return delta, False, None
        ac, s = self._ac, self._state
        buf = self._held + delta
        base = len(self._held)
        for i, c in enumerate(delta):
            s = ac.step(s, c)
            n = ac.match[s]
            if n:
                end = base + i + 1
                self.stopped, self.matched, self._held = True, buf[end - n:end], ""
                return buf[: end - n], True, self.matched
        self._state = s
        keep = ac.depth[s]
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False, None

    def flush(self) -> str:
        """End of stream without a stop: release the held-back text."""
        if self.stopped:
            return ""
        out, self._held, self._state = self._held, "", 0
        return out

    def reset(self) -> None:
        self._held = ""
        self._state = 0
        self.stopped = False
        self.matched = None
