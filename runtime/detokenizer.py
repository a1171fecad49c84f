"""Incremental detokenization on top of a ``tokenizers.Tokenizer``.

Byte-level BPE tokens can split one UTF-8 character (CJK, emoji) over several tokens; a
plain per-token decode would emit U+FFFD halves.  ``IncrementalDetokenizer`` decodes a small
window of recent tokens (``prefix_offset:``) and only emits the text past what the window
already produced (``prefix_offset:read_offset``), and only once the window does not end in
U+FFFD (an incomplete sequence).  Window boundaries always fall right after a complete
character, so concatenating every ``add`` delta plus ``flush()`` equals
``tokenizer.decode(all_ids, skip_special_tokens=...)``.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["IncrementalDetokenizer"]

_REPLACEMENT = "\ufffd"
# How many prompt tokens (at most) to keep as decoding context for the first outputs.
_PROMPT_CONTEXT = 6


class IncrementalDetokenizer:
    """Streams text for generated token ids.

    ``prompt_token_ids_tail``: the last prompt tokens, used only as decoding context (so the
    first generated tokens decode as they would in the middle of the text, e.g. for
    SentencePiece-style leading-space handling); they are never emitted.
    """

    def __init__(self, tokenizer, prompt_token_ids_tail: Optional[Sequence[int]] = None,
                 skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        tail = list(prompt_token_ids_tail or [])[-_PROMPT_CONTEXT:]
        # Drop context tokens that end in an incomplete character: the window must start
        # and its emitted prefix must end at complete characters.
        while tail and self._decode(tail).endswith(_REPLACEMENT):
            tail.pop()
        while tail and self._decode(tail).startswith(_REPLACEMENT):
            tail.pop(0)
        self._ids: list[int] = tail
        self._n_context = len(tail)
        self._prefix_offset = 0
        self._read_offset = len(tail)
        self._text_parts: list[str] = []

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=self.skip_special_tokens)

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._n_context:]

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._text_parts)

    @property
    def pending_token_count(self) -> int:
        """Tokens added whose text is not emitted yet (incomplete character)."""
        return len(self._ids) - self._read_offset

    def add(self, token_id: int) -> str:
        """Append one generated token id; return the newly completed text (maybe "")."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            if delta:
                self._text_parts.append(delta)
            return delta
        return ""

    def add_many(self, token_ids: Sequence[int]) -> str:
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """End of generation: emit whatever is pending (with U+FFFD for invalid bytes)."""
        if self._read_offset >= len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        if delta:
            self._text_parts.append(delta)
        return delta
