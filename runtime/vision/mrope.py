"""Token layout of images in a prompt: placeholder expansion, M-RoPE positions, prefix-cache keys.

The chat template renders one <|image_pad|> per image; the prompt needs one per merged patch
(expand_image_pads). Positions follow transformers' Qwen3_5Model.get_rope_index: text tokens carry
(p, p, p) and advance p by one; an image starting at p gets (p + t, p + h, p + w) over its merged
grid and advances p by max(h, w); rope delta = max position + 1 - length is what later (decode)
tokens add to their cache position. For the prefix cache every placeholder is replaced by an id
derived from its image's digest (negative, so it never equals a real token): the same image in a
later turn matches, a different image with as many tokens does not.
"""
from __future__ import annotations

import numpy as np


class MediaLayoutError(ValueError):
    """Placeholders and images do not line up; the message says how."""


def expand_image_pads(ids: list[int], pad_id: int, counts: list[int]) -> list[int]:
    """Replace the k-th single placeholder by counts[k] placeholders."""
    where = [i for i, t in enumerate(ids) if t == pad_id]
    if len(where) != len(counts):
        raise MediaLayoutError(f"the prompt has {len(where)} image placeholders for {len(counts)} images "
                               "(image placeholder text in a message?)")
    out: list[int] = []
    prev = 0
    for i, n in zip(where, counts):
        out.extend(ids[prev:i])
        out.extend([pad_id] * n)
        prev = i + 1
    out.extend(ids[prev:])
    return out


def image_runs(ids: np.ndarray, pad_id: int) -> list[tuple[int, int]]:
    """[start, end) of every run of consecutive placeholders."""
    is_pad = np.concatenate([[False], np.asarray(ids) == pad_id, [False]])
    edges = np.flatnonzero(is_pad[1:] != is_pad[:-1])
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def rope_positions(ids, pad_id: int, grids: list[tuple[int, int, int]], merge: int) -> tuple[np.ndarray, int]:
    """([n, 3] int32 (T, H, W) positions, rope delta) as get_rope_index computes them."""
    ids = np.asarray(ids)
    runs = image_runs(ids, pad_id)
    if len(runs) != len(grids):
        raise MediaLayoutError(f"{len(runs)} image placeholder runs for {len(grids)} images")
    pos = np.zeros((ids.shape[0], 3), np.int64)
    p, prev = 0, 0
    for (start, end), (t, gh, gw) in zip(runs, grids):
        lh, lw = gh // merge, gw // merge
        if end - start != t * lh * lw:
            raise MediaLayoutError(f"an image of {t * lh * lw} tokens has {end - start} placeholders")
        pos[prev:start] = (p + np.arange(start - prev))[:, None]
        p += start - prev
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
        pos[start:end] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()], -1) + p
        p += max(gh, gw) // merge
        prev = end
    pos[prev:] = (p + np.arange(ids.shape[0] - prev))[:, None]
    delta = int(pos.max()) + 1 - ids.shape[0] if ids.shape[0] else 0
    return pos.astype(np.int32), delta


def _mix(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finalizer over uint64 (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def cache_key_ids(ids, pad_id: int, digests: list[str]) -> list[int]:
    """ids with the k-th image's placeholders replaced by negative ids derived from digests[k]."""
    out = np.asarray(ids, np.int64).copy()
    for (start, end), digest in zip(image_runs(out, pad_id), digests):
        seed = np.uint64(int(digest[:16], 16))
        with np.errstate(over="ignore"):
            h = _mix(seed + np.arange(end - start, dtype=np.uint64))
        out[start:end] = -1 - (h & np.uint64(0x7FFFFFFE)).astype(np.int64)
    return out.tolist()
