"""The per-request image payload the prefill consumes (GenRequest.media -> SeqKV.media).

Built once per request from the prompt (one placeholder per image, as the chat template renders
it) and the prepared images: the expanded prompt, M-RoPE positions for every prompt token, the rope
delta that every later token adds to its cache position, the prefix-cache key ids, and which
embedding row feeds each placeholder. Embeddings are computed once (ensure_embeddings; any thread,
idempotent) and sliced per prefill chunk, so a chunk boundary or a cached prefix may fall inside
an image.
"""
from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .image_processing import PreparedImage
from .mrope import cache_key_ids, expand_image_pads, image_runs, rope_positions


@dataclass(eq=False)
class MediaInput:
    images: list[PreparedImage]
    prompt_len: int
    rope_pos: np.ndarray  # [prompt_len, 3] int32
    delta: int  # rope position - cache position of every token after the prompt's last image
    embed_row: np.ndarray  # [prompt_len] int32: row of the concatenated image embeddings, -1 for text
    key_ids: list[int]  # prompt ids with placeholders replaced by image-digest ids (prefix-cache identity)
    embeds: Optional[np.ndarray] = None  # [image tokens, D] fp32 once encoded
    encode_ms: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def num_image_tokens(self) -> int:
        return int((self.embed_row >= 0).sum())

    @property
    def digest(self) -> str:
        """One digest over every image of the request (in order)."""
        return hashlib.sha256("".join(img.digest for img in self.images).encode()).hexdigest()

    def positions(self, start: int, count: int) -> np.ndarray:
        """[count, 3] rope positions of tokens start .. start + count (past the prompt: cache position + delta)."""
        idx = np.arange(start, start + count)
        out = np.repeat((idx + self.delta)[:, None], 3, axis=1).astype(np.int32)
        inside = idx < self.prompt_len
        out[inside] = self.rope_pos[idx[inside]]
        return out

    def rows(self, start: int, count: int) -> np.ndarray:
        """Embedding row feeding each token start .. start + count (-1: the token's own embedding)."""
        out = np.full(count, -1, np.int32)
        end = min(start + count, self.prompt_len)
        if end > start:
            out[: end - start] = self.embed_row[start:end]
        return out

    def ensure_embeddings(self, encoder) -> np.ndarray:
        """Run the vision tower once (later calls return the cached rows)."""
        with self._lock:
            if self.embeds is None:
                import time

                t0 = time.perf_counter()
                parts = encoder.encode(self.images)
                self.encode_ms = (time.perf_counter() - t0) * 1000
                self.embeds = np.ascontiguousarray(np.concatenate(parts), np.float32) if parts else \
                    np.zeros((0, encoder.out_dim), np.float32)
            return self.embeds


def build_media(prompt_ids: list[int], images: list[PreparedImage], pad_id: int, merge: int
                ) -> tuple[list[int], MediaInput]:
    """(expanded prompt ids, MediaInput) for a prompt with one placeholder per image."""
    ids = expand_image_pads(prompt_ids, pad_id, [img.num_tokens(merge) for img in images])
    pos, delta = rope_positions(ids, pad_id, [img.grid for img in images], merge)
    row = np.full(len(ids), -1, np.int32)
    k = 0
    for start, end in image_runs(np.asarray(ids), pad_id):
        row[start:end] = np.arange(k, k + end - start)
        k += end - start
    keys = cache_key_ids(ids, pad_id, [img.digest for img in images])
    return ids, MediaInput(images, len(ids), pos, delta, row, keys)
