"""Per-patch tables the vision library takes besides the pixels (transformers' vision_utils, in numpy).

For a batch of images with grids (t, gh, gw), patches in merge-block order:
  interp_idx / interp_w [n, 4]  bilinear taps (align_corners=True) into the learned side x side
                                position table and their weights (h taps x w taps)
  rope_cos / rope_sin [n, Dh]   2D axial rope: angles row * inv_freq then col * inv_freq
                                (Dh / 4 frequencies each), concatenated and repeated once
  cu_seqlens [images + 1], seg [n]  which image each patch belongs to (attention stays inside it)
Float32 op order follows transformers so the tables agree to the last bit or so.
"""
from __future__ import annotations

import numpy as np


def patch_rows_cols(gh: int, gw: int, merge: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of every patch of a frame, in merge-block order."""
    within = np.arange(gh * gw, dtype=np.int64)
    blocks_w = gw // merge
    in_col = within % merge
    in_row = (within // merge) % merge
    block_col = (within // (merge * merge)) % blocks_w
    block_row = within // (merge * merge * blocks_w)
    return block_row * merge + in_row, block_col * merge + in_col


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    offsets = np.arange(2, dtype=np.float32)
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets.astype(np.int64), 0, side - 1)
    distance = np.abs(src[:, None] - floor[:, None] - offsets)
    return taps, np.maximum(np.float32(1) - distance, np.float32(0)).astype(np.float32)


def axial_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    spatial = head_dim // 2
    return (1.0 / (np.float32(theta) ** (np.arange(0, spatial, 2, dtype=np.float32) / np.float32(spatial)))).astype(
        np.float32)


def vision_tables(grids: list[tuple[int, int, int]], merge: int, side: int, head_dim: int, theta: float) -> dict:
    """The non-pixel inputs of the vision library's `encode` for these images (in call order)."""
    idx, wts, rows, cols, seg, cu = [], [], [], [], [], [0]
    for k, (t, gh, gw) in enumerate(grids):
        r, c = patch_rows_cols(gh, gw, merge)
        h_taps, h_w = _axis_taps(r, gh, side)
        w_taps, w_w = _axis_taps(c, gw, side)
        idx.append(np.tile((h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4), (t, 1)))
        wts.append(np.tile((h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4), (t, 1)))
        rows.append(np.tile(r, t))
        cols.append(np.tile(c, t))
        n = t * gh * gw
        seg.append(np.full(n, k, np.int32))
        cu.append(cu[-1] + n)
    inv = axial_inv_freq(head_dim, theta)
    fh = np.concatenate(rows).astype(np.float32)[:, None] * inv
    fw = np.concatenate(cols).astype(np.float32)[:, None] * inv
    cos = np.concatenate([np.cos(fh), np.cos(fw)], -1)
    sin = np.concatenate([np.sin(fh), np.sin(fw)], -1)
    return {
        "interp_idx": np.concatenate(idx).astype(np.int32), "interp_w": np.concatenate(wts).astype(np.float32),
        "rope_cos": np.ascontiguousarray(np.concatenate([cos, cos], -1), np.float32),
        "rope_sin": np.ascontiguousarray(np.concatenate([sin, sin], -1), np.float32),
        "cu_seqlens": np.asarray(cu, np.int32), "seg": np.concatenate(seg),
    }
