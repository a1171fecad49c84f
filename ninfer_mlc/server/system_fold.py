"""System messages after the first turn, reshaped for templates that take one leading system message.

Agent clients put system text in the middle of a conversation: Claude Code sends its environment
block as a ``role: "system"`` message after the first user turn, Codex sends several developer
messages. Qwen chat templates accept only one system message, at the start. So leading system
messages are merged into one, and every later one is folded into the adjacent user turn as a
``<system-reminder>`` block (the form Claude Code itself uses for such text):

- appended to the user message right before it (where Claude Code puts it: the fold then stays
  in the same place on every later turn, so the prompt prefix and its cache survive), else
- prepended to the user message right after it, else
- a user message of its own.
"""
from __future__ import annotations

from typing import Optional


def reminder(text: str) -> str:
    return f"<system-reminder>\n{text}\n</system-reminder>"


def _join(a: str, b: str) -> str:
    return f"{a}\n\n{b}" if a else b


def fold_system_messages(messages: list[dict]) -> list[dict]:
    """OpenAI-style messages (string contents) -> the same with at most one, leading, system message."""
    out: list[dict] = []
    i = 0
    lead: list[str] = []
    while i < len(messages) and messages[i].get("role") == "system":
        lead.append(messages[i].get("content") or "")
        i += 1
    if lead:
        out.append({**messages[0], "content": "\n\n".join(t for t in lead if t)})
    pending: Optional[str] = None  # reminder text waiting for the next user message
    for m in messages[i:]:
        role = m.get("role")
        if role == "system":
            text = reminder(m.get("content") or "")
            if pending is None and out and out[-1].get("role") == "user":
                out[-1] = {**out[-1], "content": _join(out[-1].get("content") or "", text)}
            else:
                pending = text if pending is None else _join(pending, text)
            continue
        if pending is not None:
            if role == "user":
                m = {**m, "content": _join(pending, m.get("content") or "")}
            else:
                out.append({"role": "user", "content": pending})
            pending = None
        out.append(m)
    if pending is not None:
        out.append({"role": "user", "content": pending})
    return out
