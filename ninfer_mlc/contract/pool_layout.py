"""Shapes and byte sizes of the runtime-owned pools a compiled library takes.

The compiler declares its function signatures from these shapes and the runtime allocates
buffers with them, so there is one definition of a KV page row, a state slot and a page:
  KV pool    [num_pages, n_attn_layers, 2 (K, V), kv_heads, PAGE_SIZE, row]
  conv pool  [num_slots, n_gdn_layers, conv_dim, conv_kernel - 1]        (model dtype)
  SSM pool   [num_slots, n_gdn_layers, value_heads, key_head_dim, value_head_dim]  (fp32)
  MTP KV     [num_pages, 1, 2, kv_heads, PAGE_SIZE, row]   (the MTP head's own layer, same page ids)
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

PAGE_SIZE = 64  # tokens per KV page
NVFP4_BLOCK = 16  # elements per E4M3 scale in an NVFP4 row
FP8_ROW_PAD = 4  # an fp8 row: head_dim E4M3 codes + one E8M0 scale byte + 3 zero bytes
QUANT_KV_DTYPES = ("fp8", "nvfp4")
_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "uint8": 1}


def kv_row(kv_dtype: str, head_dim: int) -> tuple[str, int]:
    """(storage dtype, last pool extent) of one KV row: plain dtypes keep head_dim elements; nvfp4
    rows are head_dim/2 code bytes + head_dim/16 scales (144 B at 256), fp8 rows head_dim + 4 bytes."""
    if kv_dtype == "nvfp4":
        if head_dim % NVFP4_BLOCK:
            raise ValueError(f"nvfp4 KV needs head_dim % {NVFP4_BLOCK} == 0, got {head_dim}")
        return "uint8", head_dim // 2 + head_dim // NVFP4_BLOCK
    if kv_dtype == "fp8":
        return "uint8", head_dim + FP8_ROW_PAD
    return kv_dtype, head_dim


def itemsize(dtype: str) -> int:
    return _ITEMSIZE[dtype]


@dataclass(frozen=True)
class PoolLayout:
    """Per-page and per-slot shapes of one artifact's pools (leading pool dimension left out)."""

    kv_dtype: str  # storage dtype of the KV pool (uint8 for quantized pages)
    state_dtype: str  # conv tails: the model dtype
    kv_page: tuple  # [n_attn, 2, kv_heads, PAGE_SIZE, row]
    mtp_page: tuple  # [1, 2, kv_heads, PAGE_SIZE, row]
    conv_slot: tuple  # [n_gdn, conv_dim, K - 1]
    ssm_slot: tuple  # [n_gdn, Hv, dk, dv]

    @classmethod
    def of(cls, config: dict, dtype: str, kv_dtype: str, page_size: int = PAGE_SIZE) -> "PoolLayout":
        """config: the manifest's model config (layer_types and the GDN / attention geometry)."""
        c = config
        kv_dt, row = kv_row(kv_dtype, c["head_dim"])
        n_attn = c["layer_types"].count("full_attention")
        n_gdn = c["layer_types"].count("linear_attention")
        conv_dim = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + \
            c["linear_num_value_heads"] * c["linear_value_head_dim"]
        head = (2, c["num_key_value_heads"], page_size, row)
        return cls(kv_dt, dtype, (n_attn,) + head, (1,) + head,
                   (n_gdn, conv_dim, c["linear_conv_kernel_dim"] - 1),
                   (n_gdn, c["linear_num_value_heads"], c["linear_key_head_dim"], c["linear_value_head_dim"]))

    @property
    def page_bytes(self) -> int:
        return prod(self.kv_page) * itemsize(self.kv_dtype)

    @property
    def mtp_page_bytes(self) -> int:
        return prod(self.mtp_page) * itemsize(self.kv_dtype)

    @property
    def conv_slot_bytes(self) -> int:
        return prod(self.conv_slot) * itemsize(self.state_dtype)

    @property
    def ssm_slot_bytes(self) -> int:
        return prod(self.ssm_slot) * 4

    @property
    def state_slot_bytes(self) -> int:
        return self.conv_slot_bytes + self.ssm_slot_bytes

    def kv_bytes_per_token(self) -> float:
        return self.page_bytes / self.kv_page[3]
