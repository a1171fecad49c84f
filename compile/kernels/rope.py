"""Partial NeoX RoPE with runtime frequency table, 1-D or multimodal (M-RoPE) positions.

inv_freq and the attention factor are model parameters (computed at conversion time by
compile/rope_scaling.py), so default, linear and YaRN scaling share one kernel. As in
transformers, the factor multiplies cos and sin, i.e. it reaches only the rotary dims.

M-RoPE (Qwen3.5 with images): positions are [n, 3] (T, H, W) and frequency j takes its angle from
one component, interleaved as transformers' Qwen3_5TextRotaryEmbedding.recomposition_frequencies
does with mrope_section (s_t, s_h, s_w): H where j % 3 == 1 and j < 3 s_h, W where j % 3 == 2 and
j < 3 s_w, T otherwise. A text token carries three equal components, so its angles are the 1-D
ones bit for bit.
"""
from __future__ import annotations

from tvm import te, tirx
from tvm.relax.frontend import nn


def mrope_component(j, section):
    """Index (0 = T, 1 = H, 2 = W) of the position component that frequency j rotates with."""
    return tirx.if_then_else(
        tirx.all(tirx.floormod(j, 3) == 1, j < 3 * int(section[1])), 1,
        tirx.if_then_else(tirx.all(tirx.floormod(j, 3) == 2, j < 3 * int(section[2])), 2, 0))


def apply_rope(x: nn.Tensor, positions: nn.Tensor, inv_freq: nn.Tensor, attn_factor: nn.Tensor,
               rotary_dim: int, name: str, mrope_section=None) -> nn.Tensor:
    """positions: [n] (1-D rope) or [n, 3] with mrope_section (M-RoPE)."""
    head_dim = int(x.shape[-1])
    half = rotary_dim // 2
    dtype = x.dtype
    multimodal = len(positions.shape) == 2
    if multimodal and mrope_section is None:
        raise ValueError("[n, 3] rope positions need an mrope_section")

    def compute(xt: te.Tensor, pos: te.Tensor, inv: te.Tensor, fac: te.Tensor):
        def elem(i, h, d):
            in_rot = d < rotary_dim
            fi = tirx.if_then_else(in_rot, tirx.floormod(d, half), 0)
            p = pos[i, mrope_component(fi, mrope_section)] if multimodal else pos[i]
            ang = p.astype("float32") * inv[fi]
            cos = tirx.cos(ang) * fac[0]
            sin = tirx.sin(ang) * fac[0]
            lo = d < half
            partner = tirx.if_then_else(
                lo,
                -xt[i, h, tirx.min(d + half, head_dim - 1)].astype("float32"),
                xt[i, h, tirx.max(d - half, 0)].astype("float32"),
            )
            rot = xt[i, h, d].astype("float32") * cos + partner * sin
            return tirx.if_then_else(in_rot, rot.astype(dtype), xt[i, h, d])

        return te.compute(xt.shape, elem, name=name)

    return nn.tensor_expr_op(compute, name, [x, positions, inv_freq, attn_factor])
