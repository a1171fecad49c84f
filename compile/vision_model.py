"""The Qwen3.5 vision tower (transformers Qwen3_5VisionModel) in tvm.relax.frontend.nn.

Exported function (one call encodes one or more images; attention stays within each image):
  encode(patches[n, C*T*P*P] f32, interp_idx[n, 4] i32, interp_w[n, 4] f32, rope_cos[n, Dh] f32,
         rope_sin[n, Dh] f32, cu_seqlens[s+1] i32, seg[n] i32) -> embeds[n / merge^2, out_hidden] f32

The host (runtime/vision_inputs.py) lays the patches out in merge-block order as the HF processor
does and computes the per-patch tables: the 4 bilinear taps into the learned position table and
their weights, and the cos / sin of the 2D axial rope (h then w frequencies, repeated, over the
whole head dim). In the library: the Conv3d patch embedding as one matmul over the flattened patch
(kernel = stride), + interpolated position embedding, `depth` pre-LN blocks (LayerNorm with bias,
fused qkv with bias, rope, attention per image, proj; GELU-tanh MLP), then the merger: LayerNorm,
2x2 neighbours concatenated, Linear, exact GELU, Linear to the language model width.

Parameter names are the checkpoint's without the "model.visual." prefix; the patch embedding weight
is the Conv3d kernel flattened to [hidden, C*T*P*P] (compile/vision_build.py).
"""
from __future__ import annotations

import contextvars

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .kernels import cpu_linear
from .vision_config import VisionConfig

LN_EPS = 1e-6
# set while an llvm encoder is constructed: its fp32 projections run as kernels/cpu_linear.py
_CPU_LINEAR: contextvars.ContextVar = contextvars.ContextVar("ninfer_vision_cpu_linear", default=False)


class BiasLinear(nn.Module):
    """y = x W^T + b with fp32 accumulation, result in the activation dtype (llvm: one parallel vector kernel)."""

    def __init__(self, i: int, o: int, dtype: str):
        self.dtype, self.out_features = dtype, o
        self.weight = nn.Parameter((o, i), dtype)
        self.bias = nn.Parameter((o,), dtype)
        use_cpu = _CPU_LINEAR.get() and dtype == "float32" and cpu_linear.applies(i, o)
        self.cpu_kernel = cpu_linear.cpu_linear(i, o) if use_cpu else None

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        if self.cpu_kernel is not None:
            return op.tensor_ir_op(self.cpu_kernel, "cpu_linear", [x, self.weight, self.bias],
                                   nn.Tensor.placeholder((x.shape[0], self.out_features), "float32"))
        y = op.matmul(x, op.permute_dims(self.weight), out_dtype="float32") + self.bias.astype("float32")
        return y if self.dtype == "float32" else y.astype(self.dtype)


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias, computed in fp32."""

    def __init__(self, dim: int, dtype: str):
        self.dim, self.dtype = dim, dtype
        self.weight = nn.Parameter((dim,), dtype)
        self.bias = nn.Parameter((dim,), dtype)

    def forward(self, x: nn.Tensor) -> nn.Tensor:
        y = op.layer_norm(x.astype("float32"), self.dim, self.weight.astype("float32"),
                          self.bias.astype("float32"), eps=LN_EPS)
        return y if self.dtype == "float32" else y.astype(self.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: str):
        self.proj = BiasLinear(cfg.patch_dim, cfg.hidden_size, dtype)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: str, kernel):
        self.cfg, self.dtype, self.kernel = cfg, dtype, kernel
        self.qkv = BiasLinear(cfg.hidden_size, 3 * cfg.hidden_size, dtype)
        self.proj = BiasLinear(cfg.hidden_size, cfg.hidden_size, dtype)

    def _rope(self, x: nn.Tensor, cos: nn.Tensor, sin: nn.Tensor) -> nn.Tensor:
        """x * cos + rotate_half(x) * sin over the whole head dim, in fp32 (apply_rotary_pos_emb_vision)."""
        half = self.cfg.head_dim // 2
        xf = x.astype("float32")
        x1, x2 = op.split(xf, [half], axis=2)
        rot = op.concat([op.negative(x2), x1], dim=2)
        n = x.shape[0]
        c = op.reshape(cos, (n, 1, self.cfg.head_dim))
        s = op.reshape(sin, (n, 1, self.cfg.head_dim))
        y = xf * c + rot * s
        return y if self.dtype == "float32" else y.astype(self.dtype)

    def forward(self, x, cos, sin, cu_seqlens, seg):
        cfg = self.cfg
        n = x.shape[0]
        qkv = op.reshape(self.qkv(x), (n, 3, cfg.num_heads, cfg.head_dim))
        q, k, v = op.split(qkv, 3, axis=1)
        shape = (n, cfg.num_heads, cfg.head_dim)
        q = self._rope(op.reshape(q, shape), cos, sin)
        k = self._rope(op.reshape(k, shape), cos, sin)
        v = op.reshape(v, shape)
        o = op.tensor_ir_op(self.kernel, "vit_attention", [q, k, v, cu_seqlens, seg],
                            nn.Tensor.placeholder(shape, self.dtype))
        return self.proj(op.reshape(o, (n, cfg.hidden_size)))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: str):
        self.approximate = "tanh" if cfg.hidden_act == "gelu_pytorch_tanh" else None
        self.linear_fc1 = BiasLinear(cfg.hidden_size, cfg.intermediate_size, dtype)
        self.linear_fc2 = BiasLinear(cfg.intermediate_size, cfg.hidden_size, dtype)

    def forward(self, x):
        h = self.linear_fc1(x)
        return self.linear_fc2(op.gelu(h.astype("float32"), approximate=self.approximate).astype(h.dtype))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: str, kernel):
        self.norm1 = LayerNorm(cfg.hidden_size, dtype)
        self.norm2 = LayerNorm(cfg.hidden_size, dtype)
        self.attn = VisionAttention(cfg, dtype, kernel)
        self.mlp = VisionMLP(cfg, dtype)

    def forward(self, x, cos, sin, cu_seqlens, seg):
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens, seg)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: str):
        self.cfg = cfg
        wide = cfg.hidden_size * cfg.merge_unit
        self.norm = LayerNorm(cfg.hidden_size, dtype)
        self.linear_fc1 = BiasLinear(wide, wide, dtype)
        self.linear_fc2 = BiasLinear(wide, cfg.out_hidden_size, dtype)

    def forward(self, x):
        cfg = self.cfg
        n = x.shape[0]
        h = op.reshape(self.norm(x), (n // cfg.merge_unit, cfg.hidden_size * cfg.merge_unit))
        h = self.linear_fc1(h)
        h = op.gelu(h.astype("float32")).astype(h.dtype)  # nn.GELU(): the exact (erf) form
        return self.linear_fc2(h).astype("float32")


class Qwen35VisionEncoder(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: str, target_kind: str = "llvm"):
        self.cfg, self.dtype = cfg, dtype
        kernel = vision_attention_kernel(target_kind, cfg.num_heads, cfg.head_dim, dtype)
        token = _CPU_LINEAR.set(target_kind == "llvm")
        try:
            self.patch_embed = PatchEmbed(cfg, dtype)
            self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size, dtype)
            self.blocks = nn.ModuleList([VisionBlock(cfg, dtype, kernel) for _ in range(cfg.depth)])
            self.merger = PatchMerger(cfg, dtype)
        finally:
            _CPU_LINEAR.reset(token)

    def encode(self, patches, interp_idx, interp_w, rope_cos, rope_sin, cu_seqlens, seg):
        cfg = self.cfg
        n = patches.shape[0]
        x = self.patch_embed.proj(patches.astype(self.dtype))
        taps = op.take(self.pos_embed.weight, op.reshape(interp_idx, (n * 4,)), axis=0)
        taps = op.reshape(taps.astype("float32"), (n, 4, cfg.hidden_size))
        pos = op.sum(taps * op.reshape(interp_w, (n, 4, 1)), axis=1)
        x = (x.astype("float32") + pos).astype(self.dtype)
        for blk in self.blocks:
            x = blk(x, rope_cos, rope_sin, cu_seqlens, seg)
        return self.merger(x)

    def export_spec(self) -> dict:
        cfg = self.cfg
        return {"encode": {
            "patches": nn.spec.Tensor(["n", cfg.patch_dim], "float32"),
            "interp_idx": nn.spec.Tensor(["n", 4], "int32"),
            "interp_w": nn.spec.Tensor(["n", 4], "float32"),
            "rope_cos": nn.spec.Tensor(["n", cfg.head_dim], "float32"),
            "rope_sin": nn.spec.Tensor(["n", cfg.head_dim], "float32"),
            "cu_seqlens": nn.spec.Tensor(["sp1"], "int32"),
            "seg": nn.spec.Tensor(["n"], "int32"),
            "$": {"param_mode": "packed", "effect_mode": "none"},
        }}


def vision_attention_kernel(target_kind: str, n_heads: int, head_dim: int, dtype: str):
    if target_kind == "cuda":
        from .kernels.cuda.vision_attention import vit_attention as cuda_vit_attention

        return cuda_vit_attention(n_heads, head_dim, dtype)
    if target_kind != "llvm":
        raise ValueError(f"no vision kernels for target kind {target_kind!r}")
    from .kernels.vision_attention import vit_attention

    return vit_attention(n_heads, head_dim, dtype)
