"""Forward passes of sequences that carry images (SeqKV.media): the runner's prefill / decode hooks.

prefill: a ragged chunk where some rows are image embeddings and RoPE follows the M-RoPE positions
(library function prefill_mm); sequences without media in the same batch get their plain positions
on all three components, which rotates them exactly as `prefill` does. decode: text tokens whose
rope position is the cache position plus the sequence's rope delta (decode_mrope); a batch where
every delta is zero keeps the plain `decode` (and its CUDA graphs).
"""
from __future__ import annotations

import numpy as np


def has_media(batch) -> bool:
    return any(getattr(s, "media", None) is not None for s, _ in batch)


def prefill_media(runner, batch, all_logits: bool) -> list[np.ndarray]:
    """runner.prefill for a batch with at least one media sequence."""
    if not runner.vm.module.implements_function("prefill_mm"):
        raise RuntimeError(f"{runner.art_dir.name} has no image prefill (compile a checkpoint with a vision tower)")
    args, cu = runner._ragged(batch)  # reserves pages; lengths still the pre-chunk ones
    n = int(cu[-1])
    rope, row_src, embeds = [], np.arange(n, dtype=np.int32), []
    m = 0
    for (s, t), start in zip(batch, cu[:-1]):
        media = getattr(s, "media", None)
        if media is None:
            rope.append(np.repeat(np.arange(s.length, s.length + len(t), dtype=np.int32)[:, None], 3, axis=1))
            continue
        rope.append(media.positions(s.length, len(t)))
        rows = media.rows(s.length, len(t))
        img = np.flatnonzero(rows >= 0)
        if img.size:
            if runner.vision is None:
                raise RuntimeError("a request with images reached a runner without a vision encoder")
            table = media.ensure_embeddings(runner.vision)
            embeds.append(table[rows[img]])
            row_src[start + img] = n + m + np.arange(img.size, dtype=np.int32)
            m += img.size
    d = int(runner.cfg["hidden_size"])
    # no image row in this chunk: one unreferenced zero row (a zero-row tensor would mean zero-size kernel
    # launches on CUDA)
    image_embeds = np.concatenate(embeds) if embeds else np.zeros((1, d), np.float32)
    logit_rows = np.arange(n, dtype=np.int32) if all_logits else (cu[1:] - 1).astype(np.int32)
    tokens, positions, token_seq, cu_t, page_table, slots = args
    out = runner.vm["prefill_mm"](
        tokens, positions, runner._tensor(np.concatenate(rope)), token_seq, cu_t, page_table, slots,
        runner._tensor(logit_rows), runner.tvm.runtime.tensor(np.ascontiguousarray(image_embeds, np.float32), runner.dev),
        runner._tensor(row_src), runner.kv_pool, runner.conv_pool, runner.ssm_pool, runner.params)
    return runner._prefilled(batch, out[0].numpy(), cu, all_logits)


def decode_rope_positions(seqs) -> np.ndarray | None:
    """Rope positions of one decode token per sequence, or None when they equal the cache positions."""
    deltas = [getattr(getattr(s, "media", None), "delta", 0) for s in seqs]
    if not any(deltas):
        return None
    return np.array([s.length + d for s, d in zip(seqs, deltas)], np.int32)
