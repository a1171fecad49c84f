"""Run a compiled model: weights on the device, runtime-owned KV pages and state slots.

The runner turns lists of sequences into the ragged arrays the library takes and hands back
fp32 logits. It knows nothing about requests, sampling or scheduling.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import safetensors_io
from .artifact import Manifest, read_manifest
from .cuda_graph import GraphedFunction, page_width_bucket
from .kv_pages import OutOfPages, PageAllocator, SlotAllocator
from .media_forward import decode_rope_positions, has_media, prefill_media
from .tvm_loader import device_for, import_tvm, load_vm


@dataclass
class SeqKV:
    """Device residency of one sequence: its state slot, its KV pages and how many tokens they hold."""

    slot: int
    pages: list[int] = field(default_factory=list)
    length: int = 0
    media: object = None  # [vision hook] the request's runtime/media.py MediaInput (images, M-RoPE positions)


class TokenError(ValueError):
    pass


class ContextLimitError(ValueError):
    """A sequence would grow past the max_context the artifact was compiled for."""


# Quantized KV pages are uint8 rows (compile/kernels/attention_quant.py): nvfp4 = D/2 E2M1 code bytes +
# D/16 E4M3 scales; fp8 = D E4M3 codes + an E8M0 scale byte + 3 pad bytes. Plain dtypes keep D elements.
_KV_ROW = {"nvfp4": lambda d: d // 2 + d // 16, "fp8": lambda d: d + 4}


class ModelRunner:
    def __init__(self, art_dir: str | Path, device: str = "auto", device_index: int = 0,
                 kv_capacity_tokens: int | None = None, num_slots: int = 8, verify: str = "size",
                 cuda_graphs: bool | None = None):
        """cuda_graphs: replay decode steps as CUDA graphs (None = on for CUDA libraries)."""
        self.art_dir = Path(art_dir)
        self.manifest: Manifest = read_manifest(self.art_dir, verify=verify)
        m = self.manifest
        self.cfg = m.config
        kind = "cpu" if m.target == "llvm" else "cuda"
        if device not in ("auto", kind):
            raise ValueError(f"library {m.library} is built for {m.target}; it cannot run on device {device!r}")
        self.device_kind = kind
        self.tvm = import_tvm(kind)
        self.dev = device_for(self.tvm, kind, device_index)
        t0 = time.time()
        self.vm = load_vm(self.tvm, self.art_dir / m.library, self.dev)
        self.params = self._load_params()
        self.load_seconds = time.time() - t0
        self.page_size = m.page_size
        self.vocab_size = int(self.cfg["vocab_size"])
        if kv_capacity_tokens == "auto":
            kv_capacity_tokens = self._auto_capacity(num_slots)
        cap = kv_capacity_tokens or max(m.max_context, self.page_size)
        num_pages = -(-cap // self.page_size)
        self.pages = PageAllocator(num_pages, self.page_size)
        self.slots = SlotAllocator(num_slots)
        self._alloc_pools(num_pages, num_slots)
        self._init_spec(num_pages)
        self.vision = None  # [vision hook] runtime/vision_encoder.py VisionEncoder for image prefills
        self.decode_graphs = None
        if kind == "cuda" and (cuda_graphs is None or cuda_graphs):
            self.decode_graphs = GraphedFunction(self.tvm, self.dev, self.vm["decode"])

    # ---- setup ---------------------------------------------------------------------------
    AUTO_HEADROOM = 1 << 30

    def _auto_capacity(self, num_slots: int) -> int:
        """Tokens of KV that fit in the device memory left after weights, state slots and 1 GiB."""
        m, c = self.manifest, self.cfg
        free = int(getattr(self.dev, "available_global_memory", 0) or 0) if self.device_kind == "cuda" else 0
        if free <= 0:
            return m.max_context
        kvd = m.kv_dtype
        kv_dt, row = ("uint8", _KV_ROW[kvd](c["head_dim"])) if kvd in _KV_ROW else (kvd, c["head_dim"])
        per_token = c["layer_types"].count("full_attention") * 2 * c["num_key_value_heads"] * row * \
            self._np_dtype(kv_dt).itemsize
        state = 160 * 2**20  # generous per-slot bound for the 27B geometry (~147 MiB)
        left = free - self.AUTO_HEADROOM - num_slots * state
        return max(m.max_context, left // per_token)
    def _load_params(self):
        m = self.manifest
        arrays: dict[str, np.ndarray] = {}
        for rel in m.weight_shards:
            arrays.update(safetensors_io.load(self.art_dir / rel))
        out = []
        self.weights_bytes = 0
        for name, shape, dtype in m.params:
            a = arrays.get(name)
            if a is None:
                raise RuntimeError(f"{self.art_dir}: weight {name} missing from the shards")
            if list(a.shape) != list(shape):
                raise RuntimeError(f"{self.art_dir}: weight {name} has shape {a.shape}, library expects {shape}")
            self.weights_bytes += a.nbytes
            out.append(self.tvm.runtime.tensor(np.ascontiguousarray(a), self.dev))
        return out

    def _alloc_pools(self, num_pages: int, num_slots: int):
        c = self.cfg
        n_attn = c["layer_types"].count("full_attention")
        n_gdn = c["layer_types"].count("linear_attention")
        dt = self.manifest.dtype
        kvd = self.manifest.kv_dtype
        kv_dt, row = ("uint8", _KV_ROW[kvd](c["head_dim"])) if kvd in _KV_ROW else (kvd, c["head_dim"])
        self.kv_shape = (num_pages, n_attn, 2, c["num_key_value_heads"], self.page_size, row)
        conv_dim = 2 * c["linear_num_key_heads"] * c["linear_key_head_dim"] + \
            c["linear_num_value_heads"] * c["linear_value_head_dim"]
        self.conv_shape = (num_slots, n_gdn, conv_dim, c["linear_conv_kernel_dim"] - 1)
        self.ssm_shape = (num_slots, n_gdn, c["linear_num_value_heads"], c["linear_key_head_dim"],
                          c["linear_value_head_dim"])
        empty = self.tvm.runtime.empty
        self.kv_pool = empty(self.kv_shape, kv_dt, self.dev)
        self.conv_pool = empty(self.conv_shape, dt, self.dev)
        self.ssm_pool = empty(self.ssm_shape, "float32", self.dev)
        self._np_kv = self._np_dtype(kv_dt)
        self._np_conv = self._np_dtype(dt)
        self.page_bytes = int(np.prod(self.kv_shape[1:])) * self._np_kv.itemsize
        self.conv_slot_bytes = int(np.prod(self.conv_shape[1:])) * self._np_conv.itemsize
        self.ssm_slot_bytes = int(np.prod(self.ssm_shape[1:])) * 4

    @staticmethod
    def _np_dtype(dt: str):
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(dt)

    # ---- raw views for state movement (host tier, checkpoints) -------------------------------
    def _view(self, pool, shape_tail, index: int, itemsize: int):
        nbytes = int(np.prod(shape_tail)) * itemsize
        return pool._create_view(tuple(shape_tail), pool.dtype, index * nbytes)

    def page_view(self, page: int):
        return self._view(self.kv_pool, self.kv_shape[1:], page, self._np_kv.itemsize)

    def sync(self) -> None:
        """Wait for queued device copies (host tier transfers are timed and must be complete)."""
        if self.device_kind == "cuda":
            self.dev.sync()

    def state_views(self, slot: int):
        return (self._view(self.conv_pool, self.conv_shape[1:], slot, self._np_conv.itemsize),
                self._view(self.ssm_pool, self.ssm_shape[1:], slot, 4))

    def read_state(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        conv, ssm = self.state_views(slot)
        return conv.numpy(), ssm.numpy()

    def write_state(self, slot: int, conv: np.ndarray, ssm: np.ndarray) -> None:
        cv, sv = self.state_views(slot)
        cv.copyfrom(np.ascontiguousarray(conv, dtype=self._np_conv))
        sv.copyfrom(np.ascontiguousarray(ssm, dtype=np.float32))

    def copy_state(self, src: int, dst: int) -> None:
        s_conv, s_ssm = self.state_views(src)
        d_conv, d_ssm = self.state_views(dst)
        s_conv.copyto(d_conv)
        s_ssm.copyto(d_ssm)

    def zero_state(self, slot: int) -> None:
        self.write_state(slot, np.zeros(self.conv_shape[1:], self._np_conv), np.zeros(self.ssm_shape[1:], np.float32))

    def read_pages(self, pages: list[int]) -> np.ndarray:
        return np.stack([self.page_view(p).numpy() for p in pages]) if pages else \
            np.zeros((0,) + self.kv_shape[1:], self._np_kv)

    def write_pages(self, pages: list[int], data: np.ndarray) -> None:
        for p, block in zip(pages, data):
            self.page_view(p).copyfrom(np.ascontiguousarray(block, dtype=self._np_kv))

    def copy_page(self, src: int, dst: int) -> None:
        self.page_view(src).copyto(self.page_view(dst))
        if self.mtp_kv_pool is not None:  # the MTP head's KV lives on the same page ids
            self.mtp_page_view(src).copyto(self.mtp_page_view(dst))

    # ---- sequences -----------------------------------------------------------------------
    def new_seq(self) -> SeqKV:
        slot = self.slots.alloc()
        if slot is None:
            raise OutOfPages("no free state slot")
        self.zero_state(slot)
        return SeqKV(slot=slot)

    def free_seq(self, seq: SeqKV) -> None:
        self.pages.release(seq.pages)
        seq.pages = []
        self.slots.release(seq.slot)

    def reserve(self, seq: SeqKV, new_tokens: int) -> None:
        """Make sure seq has pages for length + new_tokens; raises OutOfPages without side effects."""
        if seq.length + new_tokens > self.manifest.max_context:
            raise ContextLimitError(
                f"sequence would reach {seq.length + new_tokens} tokens; {self.art_dir.name} was compiled for "
                f"max_context {self.manifest.max_context} (ninfer compile --max-context / --rope-scaling-factor)")
        need = self.pages.pages_for(seq.length + new_tokens) - len(seq.pages)
        if need > 0:
            seq.pages.extend(self.pages.alloc(need))

    # ---- forward -------------------------------------------------------------------------
    def _check_tokens(self, toks: np.ndarray) -> None:
        if toks.size and (toks.min() < 0 or toks.max() >= self.vocab_size):
            raise TokenError(f"token id out of range [0, {self.vocab_size})")

    def _tensor(self, a, dtype="int32"):
        return self.tvm.runtime.tensor(np.ascontiguousarray(a, dtype=dtype), self.dev)

    def _page_table(self, seqs: list[SeqKV], width: int | None = None) -> np.ndarray:
        width = width or max(1, max(len(s.pages) for s in seqs))
        pt = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            pt[i, : len(s.pages)] = s.pages
        return pt

    def prefill(self, batch: list[tuple[SeqKV, list[int]]], all_logits: bool = False) -> list[np.ndarray]:
        """Run a chunk of tokens for each (seq, tokens); returns per-sequence logits
        ([V] for the last token, or [len, V] with all_logits)."""
        if has_media(batch):  # [vision hook] image rows and M-RoPE positions (runtime/media_forward.py)
            return prefill_media(self, batch, all_logits)
        args, cu = self._ragged(batch)
        rows = np.arange(cu[-1], dtype=np.int32) if all_logits else (cu[1:] - 1).astype(np.int32)
        out = self.vm["prefill"](*args, self._tensor(rows), self.kv_pool, self.conv_pool, self.ssm_pool, self.params)
        return self._prefilled(batch, out[0].numpy(), cu, all_logits)

    @staticmethod
    def _prefilled(batch, logits: np.ndarray, cu: np.ndarray, all_logits: bool) -> list[np.ndarray]:
        """Grow the sequences by their chunk; per-sequence logits ([V], or [len, V] with all_logits)."""
        for s, t in batch:
            s.length += len(t)
        if all_logits:
            return [logits[cu[i]:cu[i + 1]] for i in range(len(batch))]
        return list(logits)

    def decode(self, seqs: list[SeqKV], tokens: list[int]) -> np.ndarray:
        """One token per sequence; returns logits [B, V]."""
        for s in seqs:
            self.reserve(s, 1)
        toks = np.asarray(tokens, np.int32)
        self._check_tokens(toks)
        positions = np.array([s.length for s in seqs], np.int32)
        slots = np.array([s.slot for s in seqs], np.int32)
        # CUDA: page-table width rounded up to a power of two, graphs or not (few graph keys, and the
        # attention split count, which follows the width, is the same in both modes)
        width = page_width_bucket(max(len(s.pages) for s in seqs)) if self.device_kind == "cuda" else None
        pt = self._page_table(seqs, width)
        rope = decode_rope_positions(seqs)  # [vision hook] cache position + rope delta after images
        if rope is not None:
            out = self.vm["decode_mrope"](self._tensor(toks), self._tensor(positions), self._tensor(rope),
                                          self._tensor(pt), self._tensor(slots), self.kv_pool, self.conv_pool,
                                          self.ssm_pool, self.params)
        elif self.decode_graphs is not None:
            out = self.decode_graphs([toks, positions, pt, slots],
                                     [self.kv_pool, self.conv_pool, self.ssm_pool, self.params])
        else:
            out = self.vm["decode"](self._tensor(toks), self._tensor(positions), self._tensor(pt),
                                    self._tensor(slots), self.kv_pool, self.conv_pool, self.ssm_pool, self.params)
        for s in seqs:
            s.length += 1
        return out[0].numpy()

    # ---- speculative decoding: prefill_h / verify / the MTP head ---------------------------
    # Hidden states are the final post-norm ones, fp32 on the host. The MTP head keeps its own
    # one-layer KV pool on the main model's page ids (same page tables, same allocator).
    def _init_spec(self, num_pages: int) -> None:
        has = self.vm.module.implements_function
        self.has_verify = bool(has("verify") and has("prefill_h"))
        self.has_mtp = bool(self.manifest.extras.get("mtp")) and bool(has("mtp_step") and has("mtp_prefill"))
        self.mtp_kv_pool = None
        if not self.has_mtp:
            return
        self.mtp_kv_shape = (num_pages, 1) + tuple(self.kv_shape[2:])
        self.mtp_kv_pool = self.tvm.runtime.empty(self.mtp_kv_shape, str(self.kv_pool.dtype), self.dev)
        # zeroed once: a position the head never wrote (a restored prefix) must read finite values
        page = np.zeros(self.mtp_kv_shape[1:], self._np_kv)
        for p in range(num_pages):
            self.mtp_page_view(p).copyfrom(page)

    def mtp_page_view(self, page: int):
        return self._view(self.mtp_kv_pool, self.mtp_kv_shape[1:], page, self._np_kv.itemsize)

    def _ragged(self, batch):
        """Reserve pages and build the ragged arrays for [(seq, tokens)] (tokens appended at seq.length)."""
        if not batch or any(len(t) == 0 for _, t in batch):
            raise ValueError("a ragged forward needs at least one token per sequence")
        for s, t in batch:
            self.reserve(s, len(t))
        toks = np.concatenate([np.asarray(t, np.int32) for _, t in batch])
        self._check_tokens(toks)
        lens = [len(t) for _, t in batch]
        cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        pos = np.concatenate([np.arange(s.length, s.length + len(t)) for s, t in batch]).astype(np.int32)
        tseq = np.repeat(np.arange(len(batch)), lens).astype(np.int32)
        seqs = [s for s, _ in batch]
        args = [self._tensor(toks), self._tensor(pos), self._tensor(tseq), self._tensor(cu),
                self._tensor(self._page_table(seqs)), self._tensor([s.slot for s in seqs])]
        return args, cu

    def prefill_h(self, batch: list[tuple[SeqKV, list[int]]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """prefill that also returns every row's final hidden state: ([V] last-token logits, [len, D] hidden)
        per sequence."""
        args, cu = self._ragged(batch)
        out = self.vm["prefill_h"](*args, self._tensor(cu[1:] - 1), self.kv_pool, self.conv_pool, self.ssm_pool,
                                   self.params)
        logits, hidden = out[0].numpy(), out[1].numpy()
        for s, t in batch:
            s.length += len(t)
        return list(logits), [hidden[cu[i]:cu[i + 1]] for i in range(len(batch))]

    def verify(self, batch: list[tuple[SeqKV, list[int]]]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """One batched multi-token target forward: ([len, V] logits, [len, D] hidden) per sequence.
        The tokens are appended like a prefill (KV written, GDN state advanced, length grown); the
        caller rolls the state back when drafts are rejected."""
        args, cu = self._ragged(batch)
        out = self.vm["verify"](*args, self.kv_pool, self.conv_pool, self.ssm_pool, self.params)
        logits, hidden = out[0].numpy(), out[1].numpy()
        for s, t in batch:
            s.length += len(t)
        return ([logits[cu[i]:cu[i + 1]] for i in range(len(batch))],
                [hidden[cu[i]:cu[i + 1]] for i in range(len(batch))])

    def _check_mtp_positions(self, seqs, pos_per_seq) -> None:
        if not self.has_mtp:
            raise RuntimeError(f"{self.art_dir.name} has no MTP head (recompile from a checkpoint with mtp.* weights)")
        for s, top in zip(seqs, pos_per_seq):
            if top >= len(s.pages) * self.page_size:
                raise ValueError(f"MTP position {top} lies beyond the sequence's reserved pages")

    def mtp_prefill(self, items: list[tuple[SeqKV, np.ndarray, list[int], int]],
                    shortlist: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """MTP rows for [(seq, hidden [m, D], next_tokens [m], first position)]: row j pairs the main hidden
        at position p + j with the token at p + j + 1 and writes the head's KV at p + j. Returns the logits
        ([b, V], or [b, len(shortlist)]) and output hidden [b, D] of each item's last row."""
        seqs = [s for s, _, _, _ in items]
        lens = [len(h) for _, h, _, _ in items]
        if any(n == 0 or len(t) != n for n, (_, _, t, _) in zip(lens, items)):
            raise ValueError("mtp_prefill needs matching, non-empty hidden rows and next tokens")
        self._check_mtp_positions(seqs, [p + n - 1 for n, (_, _, _, p) in zip(lens, items)])
        hidden = np.ascontiguousarray(np.concatenate([h for _, h, _, _ in items]), np.float32)
        toks = np.concatenate([np.asarray(t, np.int32) for _, _, t, _ in items])
        self._check_tokens(toks)
        pos = np.concatenate([np.arange(p, p + n) for n, (_, _, _, p) in zip(lens, items)]).astype(np.int32)
        tseq = np.repeat(np.arange(len(items)), lens).astype(np.int32)
        last = (np.cumsum(lens) - 1).astype(np.int32)
        args = [self.tvm.runtime.tensor(hidden, self.dev), self._tensor(toks), self._tensor(pos), self._tensor(tseq),
                self._tensor(self._page_table(seqs))]
        if shortlist is not None:
            out = self.vm["mtp_step_sl"](*args, self._tensor(shortlist), self.mtp_kv_pool, self.params)
            return out[0].numpy()[last], out[1].numpy()[last]
        out = self.vm["mtp_prefill"](*args, self._tensor(last), self.mtp_kv_pool, self.params)
        return out[0].numpy(), out[1].numpy()

    def mtp_step(self, seqs: list[SeqKV], hidden: np.ndarray, tokens, positions,
                 shortlist: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """One MTP row per sequence (a chained draft step): (logits [b, V or len(shortlist)], hidden [b, D])."""
        self._check_mtp_positions(seqs, list(positions))
        toks = np.asarray(tokens, np.int32)
        self._check_tokens(toks)
        args = [self.tvm.runtime.tensor(np.ascontiguousarray(hidden, np.float32), self.dev), self._tensor(toks),
                self._tensor(positions), self._tensor(np.arange(len(seqs))), self._tensor(self._page_table(seqs))]
        if shortlist is not None:
            out = self.vm["mtp_step_sl"](*args, self._tensor(shortlist), self.mtp_kv_pool, self.params)
        else:
            out = self.vm["mtp_step"](*args, self.mtp_kv_pool, self.params)
        return out[0].numpy(), out[1].numpy()
