"""Partial NeoX RoPE with runtime frequency table.

inv_freq and the attention factor are model parameters (computed at conversion time by
compile/rope_scaling.py), so default, linear and YaRN scaling share one kernel. As in
transformers, the factor multiplies cos and sin, i.e. it reaches only the rotary dims.
"""
from __future__ import annotations

from tvm import te, tirx
from tvm.relax.frontend import nn


def apply_rope(x: nn.Tensor, positions: nn.Tensor, inv_freq: nn.Tensor, attn_factor: nn.Tensor,
               rotary_dim: int, name: str) -> nn.Tensor:
    head_dim = int(x.shape[-1])
    half = rotary_dim // 2
    dtype = x.dtype

    def compute(xt: te.Tensor, pos: te.Tensor, inv: te.Tensor, fac: te.Tensor):
        def elem(i, h, d):
            in_rot = d < rotary_dim
            fi = tirx.if_then_else(in_rot, tirx.floormod(d, half), 0)
            ang = pos[i].astype("float32") * inv[fi]
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
