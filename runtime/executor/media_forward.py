"""Forward passes of sequences that carry images (SeqKV.media): the executor's prefill / decode paths
for them.

prefill: a ragged chunk where some rows are image embeddings and RoPE follows the M-RoPE positions
(library function prefill_mm); sequences without media in the same batch get their plain positions on
all three components, which rotates them exactly as `prefill` does. decode: text tokens whose rope
position is the cache position plus the sequence's rope delta (decode_mrope); a batch where every delta
is zero keeps the plain `decode` (and its CUDA graphs).
"""
from __future__ import annotations

import numpy as np


def has_media(batch) -> bool:
    return any(getattr(s, "media", None) is not None for s, _ in batch)


def prefill_media(runner, batch, rows: np.ndarray) -> np.ndarray:
    """The logits rows `rows` of runner.prefill over a batch with at least one media sequence."""
    if not runner.vm.module.implements_function("prefill_mm"):
        raise RuntimeError(f"{runner.art_dir.name} has no image prefill (compile a checkpoint with a vision tower)")
    args, cu, rows_view = runner._ragged(batch, rows)
    n = int(cu[-1])
    rope, row_src, embeds = [], np.arange(n, dtype=np.int32), []
    m = 0
    for (s, t), start in zip(batch, cu[:-1]):
        media = getattr(s, "media", None)
        if media is None:
            rope.append(np.repeat(np.arange(s.length, s.length + len(t), dtype=np.int32)[:, None], 3, axis=1))
            continue
        rope.append(media.positions(s.length, len(t)))
        img_rows = media.rows(s.length, len(t))
        img = np.flatnonzero(img_rows >= 0)
        if img.size:
            if runner.vision is None:
                raise RuntimeError("a request with images reached a runner without a vision encoder")
            table = media.ensure_embeddings(runner.vision)
            embeds.append(table[img_rows[img]])
            row_src[start + img] = n + m + np.arange(img.size, dtype=np.int32)
            m += img.size
    d = int(runner.cfg["hidden_size"])
    # no image row in this chunk: one unreferenced zero row (a zero-row tensor would mean zero-size kernel
    # launches on CUDA)
    image_embeds = np.concatenate(embeds) if embeds else np.zeros((1, d), np.float32)
    tokens, positions, token_seq, cu_t, page_table, slots = args
    out = runner.vm["prefill_mm"](
        tokens, positions, runner.inputs.tensor(np.concatenate(rope)), token_seq, cu_t, page_table, slots,
        rows_view, runner.inputs.tensor(image_embeds, "float32"), runner.inputs.tensor(row_src),
        *runner._pools())
    return out[0].numpy()


def decode_rope_positions(seqs) -> np.ndarray | None:
    """Rope positions of one decode token per sequence, or None when they equal the cache positions."""
    deltas = [getattr(getattr(s, "media", None), "delta", 0) for s in seqs]
    if not any(deltas):
        return None
    return np.array([s.length + d for s, d in zip(seqs, deltas)], np.int32)
