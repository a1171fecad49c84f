"""CompileOptions: every choice `ninfer compile` makes, its default and help text, in one typed place.

The CLI generates `ninfer compile`'s flags from these fields (ninfer_mlc/config.py: field `kv_dtype` is
flag `--kv-dtype`); `ninfer serve/generate/bench MODEL` reuse a subset (target, quant, kv_dtype) with
`auto` defaults when MODEL is a Hub repo id or an uncompiled Hugging Face directory. `resolved()` turns
`auto` into the concrete target and quantization for this machine.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Optional

from .targets import TargetError

QUANTS = ("auto", "f32", "bf16", "nvfp4")
KV_DTYPE_CHOICES = ("f32", "bf16", "fp8", "nvfp4")
# compute capability major -> the target compiled for it (targets.py lists what exists)
_TARGET_BY_CC_MAJOR = {9: "cuda:sm_90", 12: "cuda:sm_120"}
# the flags `ninfer serve/generate/bench` take to compile a repo id or HF directory, defaulting to auto
ARTIFACT_FIELDS = ("target", "quant", "kv_dtype")
AUTO_DEFAULTS = {"target": "auto", "quant": "auto"}


def _f(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class CompileOptions:
    target: str = _f("llvm", "llvm (CPU), cuda:sm_90 (H100/H200), cuda:sm_120 (RTX 5090), or auto (this machine's "
                             "GPU, llvm when it has none)", metavar="TARGET")
    quant: str = _f("f32", "f32 | bf16 | nvfp4 (NVFP4 decoder weights with fused dequant; bf16 activations on CUDA, "
                           "f32 on CPU) | auto (nvfp4 on CUDA, f32 on CPU)", choices=QUANTS)
    kv_dtype: Optional[str] = _f(None, "KV cache page format: fp8 is E4M3 with a per-(token, head) power-of-two scale; "
                                       "nvfp4 is E2M1 with an E4M3 scale per 16 dims (144 B per token per KV head at "
                                       "head_dim 256, 3.6x smaller than bf16)", choices=KV_DTYPE_CHOICES,
                                 default_text="the activation dtype")
    max_context: Optional[int] = _f(None, "per-sequence token limit baked into the manifest", metavar="TOKENS",
                                    default_text="the model's, capped by the rope setup")
    kv_hadamard: bool = _f(False, "rotate Q and K by a normalised Walsh-Hadamard over head_dim after RoPE (V unrotated). "
                                  "Off by default: measured on synthetic NVFP4 attention it does not help (output error "
                                  "without/with: 0.136/0.134 on Gaussian K, 0.255/0.317 on K with 4 outlier channels "
                                  "x20; 16-element blocks already isolate outliers)")
    fp4_mma: Optional[str] = _f(None, "NVFP4 projections: prefill rows on the sm_120a block-scaled FP4 tensor cores "
                                      "(activations quantized to NVFP4 on the fly, per-token scale), decode rows keep "
                                      "the dequant GEMV", choices=("on", "off"),
                                default_text="on for --target cuda:sm_120 --quant nvfp4, else off (needs both)")
    fp4_qk: Optional[str] = _f(None, "NVFP4 KV pages: decode attention computes Q K^T on the sm_120a block-scaled FP4 "
                                     "tensor cores straight from the page bytes (Q quantized to NVFP4 per 16 values on "
                                     "the fly: attention outputs differ from the dequantized-K path's by ~9 %% relative "
                                     "L2 on random data, bench/fp4_attn_accuracy.py)", choices=("on", "off"),
                               default_text="on for --target cuda:sm_120 --kv-dtype nvfp4, else off (needs both)")
    rope_scaling_type: Optional[str] = _f(None, "context extension exactly as transformers' rope type of that name",
                                          choices=("linear", "yarn"), default_text="config.json's")
    rope_scaling_factor: Optional[float] = _f(None, "rope scaling factor (--max-context may go up to original x factor)",
                                              metavar="F", default_text="config.json's")
    rope_scaling_original_context: Optional[int] = _f(None, "the context the model was trained for", metavar="TOKENS",
                                                      default_text="config.json's")
    max_prefill_chunk: Optional[int] = _f(None, "the most tokens one prefill call takes: the prefill functions' memory is "
                                                "planned once for it (a fixed footprint instead of a pool that grows "
                                                "with every distinct chunk length); `ninfer serve --prefill-chunk` "
                                                "may not exceed it", metavar="TOKENS", default_text="2048")
    tap_layers: Optional[str] = _f(None, "for --spec dflash|dflash2: also compile prefill_t / verify_t, which return the "
                                         "outputs of these decoder layers (comma-separated ids, or a DFlash drafter "
                                         "directory: its target_layer_ids). A DFlash drafter directory given as MODEL "
                                         "compiles the drafter itself (--quant f32 or bf16: the target's activation "
                                         "dtype)", metavar="IDS|DRAFTER_DIR", default_text="none")

    def resolved(self) -> "CompileOptions":
        """`auto` target and quant made concrete for this machine (TargetError when its GPU has no target)."""
        target = local_target() if self.target == "auto" else self.target
        quant = self.quant
        if quant == "auto":
            quant = "nvfp4" if target.startswith("cuda") else "f32"
        return replace(self, target=target, quant=quant)

    def compile_kwargs(self) -> dict:
        """Keyword arguments of compile.build.compile_model (after `resolved()`)."""
        return {"target": self.target, "quant": self.quant, "kv_dtype": self.kv_dtype, "max_context": self.max_context,
                "kv_hadamard": self.kv_hadamard, "fp4_mma": self.fp4_mma, "fp4_qk": self.fp4_qk, "tap_layers": self.tap_layers,
                "max_prefill_chunk": self.max_prefill_chunk,
                "rope_overrides": {"scaling_type": self.rope_scaling_type, "factor": self.rope_scaling_factor,
                                   "original_context": self.rope_scaling_original_context}}


def local_target() -> str:
    """The --target for this machine: its first CUDA GPU's architecture, or llvm without a GPU."""
    import tvm

    try:
        dev = tvm.runtime.device("cuda", 0)
        present = bool(dev.exist)
    except Exception:  # noqa: BLE001 - a TVM without its CUDA runtime: no GPU for us
        present = False
    if not present:
        return "llvm"
    cc = str(dev.compute_version)
    target = _TARGET_BY_CC_MAJOR.get(int(cc.split(".")[0]))
    if target is None:
        known = ", ".join(f"{t} (compute capability {m}.x)" for m, t in _TARGET_BY_CC_MAJOR.items())
        raise TargetError(f"--target auto: this machine's GPU has compute capability {cc}, which no target supports "
                          f"(there are {known}); pass --target llvm to run on the CPU")
    return target
