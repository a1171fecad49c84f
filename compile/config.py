"""Model geometry read from a Hugging Face config.json.

One dataclass serves both checkpoint families (Qwen3.5/3.6 text, dense or MoE, and Qwen3-Next) because
after weight conversion they share one layout; `family` only steers the converter.

Mixture-of-experts layers (num_experts > 0): a softmax top-k router over `num_experts` routed SwiGLU
experts of `moe_intermediate_size`, renormalised when `norm_topk_prob` (Qwen3.5-MoE always), plus a
shared SwiGLU expert of `shared_expert_intermediate_size` scaled by sigmoid(shared_expert_gate(x)).
Qwen3.5-MoE puts one in every layer; Qwen3-Next in layer i when i is not in `mlp_only_layers` and
(i + 1) % decoder_sparse_step == 0 (the others keep a dense MLP of `intermediate_size`).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

# architectures / model_type keys we accept, mapped to the weight-layout family
_ARCH_FAMILY = {
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5",
    "Qwen3NextForCausalLM": "qwen3_next",
}
_MODEL_TYPE_FAMILY = {"qwen3_5_text": "qwen3_5", "qwen3_5": "qwen3_5", "qwen3_5_moe_text": "qwen3_5",
                      "qwen3_5_moe": "qwen3_5", "qwen3_next": "qwen3_next"}
# model types whose every layer is MoE and whose router always renormalises the top-k (no dense MLP)
_ALL_MOE_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")


class ConfigError(ValueError):
    """A model directory or config.json that we cannot compile; the message says why."""


@dataclass
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: list[str]
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768
    rope: dict = field(default_factory=dict)  # normalised rope_parameters (type, theta, partial factor, ...)
    mtp_num_hidden_layers: int = 0
    # mixture of experts (num_experts 0: every layer has the dense MLP)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    architecture: str = ""

    # ---- derived geometry -------------------------------------------------------------
    @property
    def attn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    def is_moe_layer(self, index: int) -> bool:
        """Layer `index` has the sparse MoE block (transformers' Qwen3NextDecoderLayer rule; the MTP
        layer uses index 0, as vLLM's predictor does)."""
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % max(1, self.decoder_sparse_step) == 0)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * float(self.rope.get("partial_rotary_factor", 1.0)))

    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def to_dict(self) -> dict:
        """All fields; the MoE ones only for MoE models (dense manifests and library keys stay as they were)."""
        d = asdict(self)
        if not self.num_experts:
            for f in _MOE_FIELDS:
                d.pop(f)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        return cls(**d)


_MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
               "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers")


def _moe_fields(text: dict, all_moe: bool) -> dict:
    """The MoE geometry of a config (empty for dense models), validated."""
    e = int(text.get("num_experts", 0) or 0)
    if e <= 0:
        if all_moe:
            raise ConfigError("a Qwen3.5-MoE config needs num_experts > 0")
        return {}
    try:
        k = int(text["num_experts_per_tok"])
        inter = int(text["moe_intermediate_size"])
        shared = int(text["shared_expert_intermediate_size"])
    except KeyError as err:
        raise ConfigError(f"MoE config.json lacks required field {err.args[0]!r}") from None
    if not 1 <= k <= e:
        raise ConfigError(f"num_experts_per_tok {k} must be in 1..num_experts ({e})")
    if inter < 1 or shared < 1:
        raise ConfigError("moe_intermediate_size and shared_expert_intermediate_size must be positive "
                          f"(got {inter}, {shared}); MoE layers without a shared expert are not supported")
    step = 1 if all_moe else int(text.get("decoder_sparse_step", 1) or 1)
    only = [] if all_moe else [int(i) for i in (text.get("mlp_only_layers") or [])]
    return dict(num_experts=e, num_experts_per_tok=k, moe_intermediate_size=inter,
                shared_expert_intermediate_size=shared,
                norm_topk_prob=True if all_moe else bool(text.get("norm_topk_prob", True)),
                decoder_sparse_step=step, mlp_only_layers=only)


def _rope_parameters(text: dict) -> dict:
    """Fold the legacy rope keys into one dict, as transformers' config classes do."""
    rp = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
    if "type" in rp and "rope_type" not in rp:
        rp["rope_type"] = rp.pop("type")
    rp.setdefault("rope_type", "default")
    if "rope_theta" not in rp:
        rp["rope_theta"] = float(text.get("rope_theta", 10000.0))
    if "partial_rotary_factor" not in rp:
        rp["partial_rotary_factor"] = float(text.get("partial_rotary_factor", 0.25))
    return rp


def _layer_types(text: dict, n: int) -> list[str]:
    lt = text.get("layer_types")
    if lt is None:
        interval = int(text.get("full_attention_interval", 4))
        lt = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    lt = list(lt)
    if len(lt) != n:
        raise ConfigError(f"layer_types has {len(lt)} entries but num_hidden_layers is {n}")
    bad = sorted(set(lt) - {"full_attention", "linear_attention"})
    if bad:
        raise ConfigError(f"unsupported layer types {bad}; expected full_attention / linear_attention")
    return lt


def parse_config(raw: dict) -> ModelConfig:
    """Validate an HF config dict and return the geometry the compiler needs."""
    archs = raw.get("architectures") or []
    family = next((_ARCH_FAMILY[a] for a in archs if a in _ARCH_FAMILY), None)
    model_type = raw.get("model_type", "")
    if family is None:
        family = _MODEL_TYPE_FAMILY.get(model_type)
    if family is None:
        raise ConfigError(
            f"unknown architecture {archs or model_type!r}: ninfer-mlc compiles "
            f"{sorted(_ARCH_FAMILY)} (model_type {sorted(_MODEL_TYPE_FAMILY)})"
        )
    text = raw.get("text_config") or raw  # VLM checkpoints nest the decoder config
    all_moe = (text.get("model_type") or model_type) in _ALL_MOE_TYPES or any("Moe" in a for a in archs)
    moe = _moe_fields(text, all_moe)
    if text.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"hidden_act {text.get('hidden_act')!r} is not supported (expected silu)")
    try:
        n = int(text["num_hidden_layers"])
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        cfg = ModelConfig(
            family=family,
            vocab_size=int(text["vocab_size"]),
            hidden_size=int(text["hidden_size"]),
            # MoE-only models (Qwen3.5-MoE) have no dense MLP
            intermediate_size=int(text.get("intermediate_size") or 0) if all_moe else int(text["intermediate_size"]),
            num_hidden_layers=n,
            num_attention_heads=int(text["num_attention_heads"]),
            num_key_value_heads=int(text["num_key_value_heads"]),
            head_dim=int(text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]),
            linear_num_key_heads=int(text["linear_num_key_heads"]),
            linear_num_value_heads=int(text["linear_num_value_heads"]),
            linear_key_head_dim=int(text["linear_key_head_dim"]),
            linear_value_head_dim=int(text["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            layer_types=_layer_types(text, n),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            rope=_rope_parameters(text),
            mtp_num_hidden_layers=int(text.get("mtp_num_hidden_layers", 0) or 0),
            bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
            eos_token_id=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            architecture=(archs[0] if archs else model_type),
            **moe,
        )
    except KeyError as e:
        raise ConfigError(f"config.json lacks required field {e.args[0]!r}") from None
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        raise ConfigError("num_attention_heads must be a multiple of num_key_value_heads")
    if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
        raise ConfigError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    if cfg.rotary_dim % 2 or cfg.rotary_dim > cfg.head_dim:
        raise ConfigError(f"rotary dim {cfg.rotary_dim} must be even and <= head_dim {cfg.head_dim}")
    if not cfg.attn_layers:
        raise ConfigError("model has no full-attention layer")
    if cfg.intermediate_size < 1 and len(cfg.moe_layers) < n:
        raise ConfigError("intermediate_size is needed for the dense MLP layers of this config")
    return cfg


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"model directory {model_dir} does not exist")
    if not path.is_file():
        raise ConfigError(f"{path} not found: a Hugging Face model directory needs config.json")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    return parse_config(raw)
