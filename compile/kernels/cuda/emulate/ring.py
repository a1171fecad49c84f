"""Cases and references of the drafter's ring-attention check (compile/dflash/ring_attention.py): the dense relax
path it replaces as a module of its own, inputs whose contexts wrap the ring, and a float64 reference of the mask
semantics. tests/test_ring_attention.py (emulated CUDA vs the llvm dense path) and bench/ring_attn_gpu_check.py
(GPU: kernel vs the CUDA dense path and the reference) use them. Numpy only at module level."""
from __future__ import annotations

import numpy as np


def ring_module(cfg, slot: int, fused: bool, dtype: str, kinds=(True, False)):
    """IRModule with, per causality in kinds (name: causal | full), `dense_<name>` (DFlashDrafter._ring_mask +
    _ring_attention, as the llvm drafter runs them) and, with fused, `fused_<name>` (the kernel the CUDA drafter
    calls), all (q[n,Hq,D], ring, pos[n], lanes[b], lo[b]) -> out[n,Hq,D] for ring layer `slot`. Export `fused`
    for CUDA only (its prim_func is thread-bound)."""
    from tvm.relax.frontend import nn
    from tvm.relax.frontend.nn import op

    from ....dflash.model import DFlashDrafter
    from ....dflash.ring_attention import kernel_name, ring_attention
    from ....model import _i32

    me = DFlashDrafter(cfg, dtype)  # the llvm drafter: its dense ring path (only its methods are used here)
    hq, hkv, dh, R, L = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.ring_size, len(cfg.ring_layers)
    ring = nn.Module()
    args = {"q": nn.spec.Tensor(["n", hq, dh], dtype), "pool": nn.spec.Tensor(["l", L, 2, hkv, R, dh], dtype),
            "pos": nn.spec.Tensor(["n"], "int32"), "lanes": nn.spec.Tensor(["b"], "int32"),
            "lo": nn.spec.Tensor(["b"], "int32"), "$": {"param_mode": "none", "effect_mode": "none"}}
    spec = {}
    for causal in kinds:
        name = "causal" if causal else "full"

        def dense(q, pool, pos, lanes, lo, causal=causal):
            return DFlashDrafter._ring_attention(me, q, pool, slot, lanes, DFlashDrafter._ring_mask(me, pos, lo, causal))

        setattr(ring, f"dense_{name}", dense)
        spec[f"dense_{name}"] = args
        if fused:
            kernel = ring_attention(cfg.block_size, hq, hkv, dh, R, int(cfg.sliding_window), L, causal, dtype)

            def fused_fn(q, pool, pos, lanes, lo, causal=causal, kernel=kernel):
                return op.tensor_ir_op(kernel, kernel_name(causal), [q, pool, pos, lanes, lo, _i32(slot)],
                                       nn.Tensor.placeholder(q.shape, dtype))

            setattr(ring, f"fused_{name}", fused_fn)
            spec[f"fused_{name}"] = args
    return ring.export_tvm(spec=spec)[0]


def ring_case(rng, cfg, starts: list[int], lo_offsets: list[int], n_lanes: int) -> dict:
    """Blocks at `starts` (one per sequence, lanes n_lanes-1, n_lanes-2, ...), ring_lo = max(0, start - window +
    offset) (offset > 0: the ring holds less than the window), a random ring (slots past a young sequence's
    context hold stale values the mask must hide), Gaussian q. float32 arrays."""
    B, R, W, L = cfg.block_size, cfg.ring_size, int(cfg.sliding_window), len(cfg.ring_layers)
    hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    pos = np.concatenate([np.arange(s, s + B) for s in starts]).astype(np.int32)
    return dict(q=rng.standard_normal((len(starts) * B, hq, dh)).astype(np.float32),
                pool=rng.standard_normal((n_lanes, L, 2, hkv, R, dh)).astype(np.float32), pos=pos,
                lanes=np.array([n_lanes - 1 - i for i in range(len(starts))], np.int32),
                lo=np.array([max(0, s - W + o) for s, o in zip(starts, lo_offsets, strict=True)], np.int32))


def ring_reference(case: dict, cfg, slot: int, causal: bool) -> np.ndarray:
    """float64 attention of every block row over its ring with the dense path's mask (model.py's docstring)."""
    B, R, W = cfg.block_size, cfg.ring_size, int(cfg.sliding_window)
    hq, hkv, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q, pool, pos = case["q"].astype(np.float64), case["pool"], case["pos"].astype(np.int64)
    out = np.zeros(q.shape, np.float64)
    s = np.arange(R)
    for bi, (lane, lo) in enumerate(zip(case["lanes"], case["lo"], strict=True)):
        hi = pos[bi * B + B - 1]
        p = hi - (hi - s) % R
        k = pool[lane, slot, 0].astype(np.float64)  # [hkv, R, dh]
        v = pool[lane, slot, 1].astype(np.float64)
        for i in range(B):
            qp = pos[bi * B + i]
            ok = (p >= lo) & (p >= 0) & (qp - p < W) & ((p <= qp) if causal else (p - qp < W))
            for h in range(hq):
                sc = k[h // (hq // hkv)] @ q[bi * B + i, h] * dh ** -0.5
                sc = np.where(ok, sc, -np.inf)
                w = np.exp(sc - sc.max())
                out[bi * B + i, h] = (w / w.sum()) @ v[h // (hq // hkv)]
    return out
