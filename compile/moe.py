"""The sparse mixture-of-experts block of Qwen3.5-MoE / Qwen3-Next (transformers' *SparseMoeBlock).

  out = sum_j p_j * expert_{e_j}(x) + sigmoid(x . w_sg) * shared_expert(x)

Parameters (compile/convert_moe.py builds them from either checkpoint layout):
  mlp.router.weight                 [E + 1, D]  the router (`mlp.gate`) rows, then `mlp.shared_expert_gate`:
                                                one projection gives the expert logits and the shared gate
  mlp.experts.gate_up_proj.weight   [Ex, 2I, D] per expert: gate rows, then up rows
  mlp.experts.down_proj.weight      [Ex, D, I]
  (NVFP4: each array as NVFP4Linear's codes / weight_scale / weight_scale_2 with a leading expert axis)
  mlp.shared_expert.{gate_up,down}_proj  only when the shared expert's size differs from the routed ones'.
When they are equal (every released Qwen MoE checkpoint) the shared expert is stored as expert Ex - 1 = E
of the same arrays and routed to every token with weight sigmoid(gate): one expert kernel serves both.

The kernel set decides how the experts run (compile/kernels/moe.py for the contract):
  llvm: moe_topk, then moe_experts (each token reads its selected experts directly).
  CUDA: moe_route (top-k, pairs sorted by expert), moe_gate_up over the experts the batch selected, then
        moe_down_combine: the down GEMM with the weighted sum + residual in its last block per row tile
        (compile/kernels/cuda/moe.py).
"""
from __future__ import annotations

from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from .config import ModelConfig
from .model import _WEIGHT_QUANT, MLP, Linear, _gemv


class ExpertWeight(nn.Module):
    """One weight array of all experts: [n, out, in] in dtype, or NVFP4 codes / block scales / row scales."""

    def __init__(self, n: int, out_f: int, in_f: int, dtype: str, nvfp4: bool):
        self.nvfp4 = nvfp4
        if nvfp4:
            self.weight = nn.Parameter((n, out_f, in_f // 2), "uint8")
            self.weight_scale = nn.Parameter((n, out_f, in_f // 16), "uint8")
            self.weight_scale_2 = nn.Parameter((n, out_f), "float32")
        else:
            self.weight = nn.Parameter((n, out_f, in_f), dtype)

    def buffers(self) -> list:
        return [self.weight, self.weight_scale, self.weight_scale_2] if self.nvfp4 else [self.weight]


class Experts(nn.Module):
    def __init__(self, n: int, hidden: int, inter: int, dtype: str, nvfp4: bool):
        self.gate_up_proj = ExpertWeight(n, 2 * inter, hidden, dtype, nvfp4)
        self.down_proj = ExpertWeight(n, hidden, inter, dtype, nvfp4)


def shared_folded(cfg: ModelConfig) -> bool:
    """The shared expert is stored as the last expert of the routed arrays (equal intermediate sizes)."""
    return cfg.shared_expert_intermediate_size == cfg.moe_intermediate_size


def expert_slots(cfg: ModelConfig) -> int:
    return cfg.num_experts + (1 if shared_folded(cfg) else 0)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: str, kernels):
        d, e, k = cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok
        inter = cfg.moe_intermediate_size
        self.cfg, self.dtype = cfg, dtype
        self.fold = shared_folded(cfg)
        self.slots = expert_slots(cfg)
        self.pairs = k + (1 if self.fold else 0)
        nvfp4 = _WEIGHT_QUANT.get() == "nvfp4" and d % 16 == 0 and inter % 16 == 0
        self.weight_format = "nvfp4" if nvfp4 else None
        self.router = Linear(d, e + 1, dtype)
        self.experts = Experts(self.slots, d, inter, dtype, nvfp4)
        if not self.fold:
            self.shared_expert = MLP(cfg, dtype, intermediate=cfg.shared_expert_intermediate_size)
        self.grouped = getattr(kernels, "moe_route", None) is not None  # CUDA: pairs grouped by expert
        if self.grouped:
            counters = kernels.moe_down_combine_counters(d)  # the fused down + combine's tickets in route
            self.route_len = kernels.moe_route_len(self.slots, counters)
            self.route_kernel = kernels.moe_route(e, k, cfg.norm_topk_prob, self.slots, self.pairs, counters)
            self.gate_up_kernel = kernels.moe_gate_up(d, inter, self.slots, self.pairs, dtype, self.weight_format)
            self.down_combine = {(res, sh): kernels.moe_down_combine(d, inter, self.slots, self.pairs, k, dtype,
                                                                     self.weight_format, res, sh)
                                 for res in (False, True) for sh in (False, not self.fold)}
            if None in (self.route_kernel, self.gate_up_kernel, *self.down_combine.values()):
                raise ValueError(f"no CUDA MoE kernels for {self.slots} expert slots, hidden {d}, experts {inter}, "
                                 f"{dtype} {self.weight_format or ''}")
        else:
            self.topk_kernel = kernels.moe_topk(e, k, cfg.norm_topk_prob)
            self.experts_kernel = kernels.moe_experts(d, inter, self.slots, k, self.pairs, dtype, self.weight_format)

    def _router_logits(self, x: nn.Tensor) -> nn.Tensor:
        """[n, E + 1] fp32: expert logits and the shared expert's gate logit."""
        y = _gemv(x, self.router.weight, out_dtype="float32", name="gemv_router")
        if y is not None:
            return y
        return op.matmul(x, op.permute_dims(self.router.weight), out_dtype="float32")

    def forward(self, x: nn.Tensor, residual: nn.Tensor | None = None) -> nn.Tensor:
        """x [n, D] (post-attention norm); residual: return residual + moe(x)."""
        n, k = x.shape[0], self.cfg.num_experts_per_tok
        logits = self._router_logits(x)
        if self.grouped:
            return self._grouped(x, logits, residual)
        ids, w = op.tensor_ir_op(self.topk_kernel, "moe_topk", [logits],
                                 [nn.Tensor.placeholder((n, k + 1), "int32"),
                                  nn.Tensor.placeholder((n, k + 1), "float32")])
        weights = self.experts.gate_up_proj.buffers() + self.experts.down_proj.buffers()
        y = op.tensor_ir_op(self.experts_kernel, "moe_experts", [x, ids, w] + weights,
                            nn.Tensor.placeholder((n, self.cfg.hidden_size), self.dtype))
        if not self.fold:  # shared expert as a dense MLP, scaled by its gate
            sg = op.split(w, [k], axis=1)[1]
            y = y + (self.shared_expert(x).astype("float32") * sg).astype(self.dtype)
        return y if residual is None else residual + y

    def _grouped(self, x, logits, residual):
        """CUDA: top-k and pairs grouped by expert, the grouped GEMMs over the selected experts, the combine fused
        into the down GEMM (decode-size calls: one launch; y is its scratch)."""
        cfg = self.cfg
        n, k, npairs = x.shape[0], cfg.num_experts_per_tok, x.shape[0] * self.pairs
        _, w, order, route = op.tensor_ir_op(
            self.route_kernel, "moe_route", [logits],
            [nn.Tensor.placeholder((n, k + 1), "int32"), nn.Tensor.placeholder((n, k + 1), "float32"),
             nn.Tensor.placeholder((npairs,), "int32"), nn.Tensor.placeholder((self.route_len,), "int32")])
        h = op.tensor_ir_op(self.gate_up_kernel, "moe_gate_up", [x, order, route] + self.experts.gate_up_proj.buffers(),
                            nn.Tensor.placeholder((npairs, cfg.moe_intermediate_size), self.dtype))
        sh = x if self.fold else self.shared_expert(x)  # x: a stand-in the kernel does not read
        _, out = op.tensor_ir_op(
            self.down_combine[(residual is not None, not self.fold)], "moe_down_combine",
            [h, order, route] + self.experts.down_proj.buffers() + [w, x if residual is None else residual, sh],
            [nn.Tensor.placeholder((npairs, cfg.hidden_size), self.dtype),
             nn.Tensor.placeholder((n, cfg.hidden_size), self.dtype)])
        return out
