"""A DFlash / DFlash2 drafter's geometry: what `ninfer compile` writes into a drafter artifact's
manifest (compile/dflash/config.py parses it from the HF config) and the runtime reads back.

Paged layers keep the whole context on the target's page ids; windowed layers (sliding, with a
window) keep a ring of window + block positions per sequence."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class DrafterConfig:
    kind: str  # dflash | dflash2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    layer_types: list[str]
    causal: list[bool]  # per layer
    sliding_window: int | None  # the window of sliding layers (None: they keep everything)
    target_layer_ids: list[int]
    num_target_layers: int
    block_size: int
    mask_token_id: int
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    max_position_embeddings: int = 32768
    rope: dict = field(default_factory=dict)  # the raw rope keys (compile/rope_scaling.RopeSpec reads them)
    # DFlash2 only
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    # ---- derived -------------------------------------------------------------------------
    def windowed(self, i: int) -> bool:
        """Layer i keeps only a window of context (a ring); else all of it (pages)."""
        return self.layer_types[i] == "sliding_attention" and self.sliding_window is not None

    @property
    def ring_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.windowed(i)]

    @property
    def paged_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.windowed(i)]

    @property
    def ring_size(self) -> int:
        """Ring positions per sequence: the window plus the block, so writing a block never
        overwrites context a query of that block still sees."""
        if not self.ring_layers:
            return 0
        assert self.sliding_window is not None  # a layer rings only when the window is set (windowed())
        return int(self.sliding_window) + self.block_size

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Paged drafter KV per context token (the ring layers cost a fixed ring per sequence)."""
        return len(self.paged_layers) * 2 * self.num_key_value_heads * self.head_dim * itemsize

    def ring_bytes_per_sequence(self, itemsize: int) -> int:
        return len(self.ring_layers) * 2 * self.num_key_value_heads * self.ring_size * self.head_dim * itemsize

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        return cls(**d)
