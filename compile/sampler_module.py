"""The device sampler's relax functions, added to every model library (ninfer_mlc/contract/sampler_abi.py is the contract).

`sample` runs the kernel set's sampler kernels on the logits tensor a decode / prefill / verify call returned:
process (bias, penalties, mask -> keys) -> select (the token) -> logprobs (rows that ask) -> append (the
token to the lane's counts, in place). `sampler_counts_add` edits the counts outside a step (rollback of
rejected draft tokens, tokens accepted elsewhere).
"""
from __future__ import annotations

from tvm import IRModule
from tvm.relax.frontend import nn
from tvm.relax.frontend.nn import op

from ..contract.sampler_abi import (ABI_VERSION, COUNTS_ADD_FUNCTION, NUM_PARAMS, SAMPLE_FUNCTION, mask_words,
                                   top_logprob_slots)
from .kernels.registry import kernel_set

__all__ = ["ABI_VERSION", "SamplerFunctions", "add_device_sampler"]


class SamplerFunctions(nn.Module):
    def __init__(self, vocab_size: int, target_kind: str = "llvm"):
        self.vocab = int(vocab_size)
        self.kernels = kernel_set(target_kind).sampler(self.vocab)

    def sample(self, logits, params, mask, counts, prompt, bias):
        k, V = self.kernels, self.vocab
        n = logits.shape[0]
        K = top_logprob_slots(V)
        keys = op.tensor_ir_op(k.process, "sampler_process", [logits, params, mask, counts, prompt, bias],
                               nn.Tensor.placeholder((n, V), "uint32"))
        tokens = op.tensor_ir_op(k.select, "sampler_select", [keys, params], nn.Tensor.placeholder((n,), "int32"))
        token_lp, rank, top_ids, top_lp = op.tensor_ir_op(
            k.logprobs, "sampler_logprobs", [logits, keys, params, tokens],
            [nn.Tensor.placeholder((n,), "float32"), nn.Tensor.placeholder((n,), "int32"),
             nn.Tensor.placeholder((n, K), "int32"), nn.Tensor.placeholder((n, K), "float32")])
        counts = op.tensor_ir_inplace_op(k.append, "sampler_append", [tokens, params, counts], 2, counts)
        return tokens, token_lp, rank, top_ids, top_lp, counts

    def sampler_counts_add(self, lanes, tokens, delta, counts):
        return op.tensor_ir_inplace_op(self.kernels.counts_add, "sampler_counts_add_kernel",
                                       [lanes, tokens, delta, counts], 3, counts)

    def export_spec(self) -> dict:
        V, W = self.vocab, mask_words(self.vocab)
        mode = {"param_mode": "none", "effect_mode": "none"}
        counts = nn.spec.Tensor(["lanes", V], "int32")
        return {
            SAMPLE_FUNCTION: {
                "logits": nn.spec.Tensor(["n", V], "float32"),
                "params": nn.spec.Tensor(["n", NUM_PARAMS], "float64"),
                "mask": nn.spec.Tensor(["n", W], "int32"),
                "counts": counts,
                "prompt": nn.spec.Tensor(["lanes", W], "int32"),
                "bias": nn.spec.Tensor(["lanes", V], "float32"),
                "$": mode,
            },
            COUNTS_ADD_FUNCTION: {
                "lanes": nn.spec.Tensor(["m"], "int32"),
                "tokens": nn.spec.Tensor(["m"], "int32"),
                "delta": nn.spec.Tensor(["m"], "int32"),
                "counts": counts,
                "$": mode,
            },
        }


def sampler_module(vocab_size: int, target_kind: str = "llvm") -> IRModule:
    """The sampler functions alone (tests and benchmarks build just these)."""
    m = SamplerFunctions(vocab_size, target_kind)
    mod, _ = m.export_tvm(spec=m.export_spec())
    return mod


def add_device_sampler(mod: IRModule, vocab_size: int, target_kind: str = "llvm") -> IRModule:
    """Add the sampler functions to `mod` (the exported model, updated in place and returned); the builder
    records ABI_VERSION in the manifest extras."""
    extra = sampler_module(vocab_size, target_kind)
    clash = {gv.name_hint for gv, _ in extra.functions_items()} & {gv.name_hint for gv, _ in mod.functions_items()}
    if clash:
        raise ValueError(f"the model module already defines {sorted(clash)}")
    mod.update(extra)
    return mod
