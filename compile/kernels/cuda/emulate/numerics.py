"""Error measure and input helpers shared by the kernel checks (numpy; l2norm also takes torch tensors)."""
from __future__ import annotations

import numpy as np


def rel_err(got, ref) -> float:
    """max|got - ref| / max|ref| in float64; inf where got has a non-finite value."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    if not np.isfinite(got).all():
        return float("inf")
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def l2norm(a, eps: float = 1e-6):
    """a / |a| over the last axis (numpy arrays or torch tensors)."""
    if isinstance(a, np.ndarray):
        return a / np.sqrt((a * a).sum(-1, keepdims=True) + eps)
    return a / ((a * a).sum(-1, keepdim=True) + eps).sqrt()


def l2_qk(rng, n: int, hk: int, dk: int):
    """Gated-delta-rule q (l2-normalised, times dk^-0.5) and k (l2-normalised), float32, shape (n, hk, dk)."""
    q = (l2norm(rng.standard_normal((n, hk, dk))) * dk ** -0.5).astype(np.float32)
    k = l2norm(rng.standard_normal((n, hk, dk))).astype(np.float32)
    return q, k


def cu_seqlens(lens) -> np.ndarray:
    """[0, cumsum(lens)...] as int32."""
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
