"""Execute a compiled model: weights on the device, the pools the runtime owns, persistent inputs.

The runner runs the library's functions over sequences it is handed (state slot, page ids, length)
and returns fp32 logits (and hidden states for speculative decoding). It allocates no pages or slots
and advances no lengths: the KV manager owns those, the scheduler decides what runs. It only checks
that what it is asked to run fits what was reserved.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np

from ...contract.manifest import Manifest, read_manifest
from ...contract.pool_layout import PoolLayout
from ..tvm_loader import device_for, import_tvm, load_vm
from .cuda_graph import GraphedFunction, page_width_bucket
from .device_rows import DeviceRows
from .draft_head import DraftHead, draft_head_bytes
from .host_copy import HostRead
from .inputs import ChainInputs, SeqLike, StepInputs
from .replay_inputs import ReplayInputs
from .upload_batch import UploadBatch
from .view_cache import ViewCache
from .media_forward import decode_rope_positions, has_media, prefill_media
from .weights import load_params, np_dtype

if TYPE_CHECKING:  # the vision stack loads only for image-capable models (assemble.py)
    from ..vision.encoder import VisionEncoder


class ModelRunner:
    AUTO_HEADROOM = 1 << 30

    def __init__(self, art_dir: str | Path, device: str = "auto", device_index: int = 0, verify: str = "size"):
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
        self.layout: PoolLayout = m.layout()
        self.page_size = m.page_size
        self.vocab_size = int(self.cfg["vocab_size"])
        # ids the tokenizer can produce: logits are cut to these (a padded or larger lm_head never samples
        # an id that has no text); the engine sets it, the harness keeps the full width
        self.sample_vocab = self.vocab_size
        has = self.vm.module.implements_function
        self.has_verify = bool(has("verify") and has("prefill_h"))
        # verify / verify_t also return every GDN layer's projections of every row, and gdn_replay advances a
        # state slot over chosen rows of them: a partly accepted round keeps its prefix without a re-feed.
        # Older libraries lack it (their rollback re-feeds the kept tokens: spec/decoder.py)
        self.has_gdn_replay = bool(self.has_verify and has("gdn_replay"))
        self.verify_gdn_rows: Any = None  # (qkvz_rows, ba_rows) of the last verify call (has_gdn_replay)
        self.has_mtp = bool(m.extras.get("mtp")) and bool(has("mtp_step") and has("mtp_prefill"))
        # the shortlisted MTP head on the device (executor/draft_head.py): device draft chains over a shortlist.
        # Older libraries draft with a shortlist in host rounds only (mtp_step_sl)
        self.has_head_draft = self.has_mtp and bool(m.extras.get("mtp_head_draft")) and all(
            has(f) for f in ("mtp_head_build", "mtp_step_hd", "mtp_prefill_hd"))
        self.draft_head: Optional[DraftHead] = None  # set_draft_head
        # DFlash drafters: the tap layers prefill_t / verify_t return (compile --tap-layers)
        self.tap_layers = [int(i) for i in m.extras.get("tap_layers") or []]
        self.has_taps = bool(self.tap_layers) and bool(has("prefill_t") and has("verify_t"))
        # rows per prefill-style call the library's memory plan is sized for (compile/memory_bounds.py);
        # None: an older library whose chunk functions allocate per row count
        bound = m.extras.get("max_prefill_chunk")
        self.max_prefill_chunk = int(bound) if bound else None
        # [dflash hook] pools of other per-token KV on the main page ids (a DFlash drafter's paged layers):
        # name -> (tensor [num_pages, *page_shape], page_shape, dtype); copied and moved with the main pages
        self.page_pools: dict = {}
        self.page_bytes = self.layout.page_bytes
        self.conv_slot_bytes = self.layout.conv_slot_bytes
        self.ssm_slot_bytes = self.layout.ssm_slot_bytes
        # device pools (tvm.runtime.Tensor, which carries no type information), made by allocate()
        self.kv_pool: Any = None
        self.conv_pool: Any = None
        self.ssm_pool: Any = None
        self.mtp_kv_pool: Any = None
        self.inputs: Optional[StepInputs] = None
        self.last_inputs_s = 0.0  # staging + upload seconds of the last decode call (engine step timing)
        self.decode_graphs: Optional[GraphedFunction] = None
        self.verify_graphs: Optional[GraphedFunction] = None  # speculative rounds: verify and MTP draft steps
        self.verify_t_graphs: Optional[GraphedFunction] = None  # verify with the tap layers (DFlash rounds)
        self.mtp_graphs: Optional[GraphedFunction] = None
        self.mtp_hd_graphs: Optional[GraphedFunction] = None  # mtp_step_hd: draft chains with the shortlisted head
        self.replay_graphs: Optional[GraphedFunction] = None  # gdn_replay (rollback without a re-feed)
        self.replay_inputs: Optional[ReplayInputs] = None
        self._replay_generation = 0
        self.chain: Optional[ChainInputs] = None  # the device MTP draft chain's inputs (stage_draft_chain)
        self.round_uploads: Optional[UploadBatch] = None  # inputs of several staged calls, one copy (upload_batch)
        self._chain_generation = 0
        self._graph_generation = 0
        self.num_pages = self.num_slots = 0
        self._views = ViewCache()  # state-slot views and the draft copies' views (a round reuses the same ones)
        self.read_host = HostRead(self.tvm)  # a round's reads of ids and hidden rows (no Tensor.numpy() overhead)
        self.vision: Optional[VisionEncoder] = None  # runtime/vision/encoder.py VisionEncoder of an image-capable model (assemble.py)

    # ---- setup ---------------------------------------------------------------------------
    def _load_params(self) -> list:
        """Weights from the shards; a random-weights benchmark artifact has only its exact tables there
        and the rest is drawn on the device (executor/random_weights.py)."""
        out, self.weights_bytes, self.random_weights = load_params(self.manifest, self.art_dir, self.dev, self.tvm)
        return out

    def param(self, name: str):
        """The device tensor of one parameter (a DFlash drafter borrows the embedding and lm_head)."""
        for (n, _, _), t in zip(self.manifest.params, self.params):
            if n == name:
                return t
        raise KeyError(f"{self.art_dir.name} has no parameter {name}")

    def attach_page_pool(self, name: str, page_shape: tuple, dtype: str):
        """[dflash hook] A pool of per-token KV on the main page ids ([num_pages, *page_shape]): page
        copies (copy-on-write, checkpoints) and the host tier move it with the main page. Attach before
        the host tier is made; returns the tensor."""
        if name not in self.page_pools:
            pool = self.tvm.runtime.empty((self.num_pages,) + tuple(page_shape), dtype, self.dev)
            self.page_pools[name] = (pool, tuple(page_shape), dtype)
            self._zero_pool(pool, tuple(page_shape), np_dtype(dtype))  # a position never written reads finite values
        return self.page_pools[name][0]

    def pool_page_view(self, name: str, page: int):
        pool, shape, dtype = self.page_pools[name]
        return self._view(pool, shape, page, np_dtype(dtype).itemsize)

    def step_workspace_bytes(self, rows: int) -> int:
        """An upper estimate of what one forward pass of `rows` tokens allocates beside the pools: activations
        (32 bytes per token for each element of the widest row: the fused gate_up / expert projections), and,
        where NVFP4 weights are dequantized per call (no FP4 tensor cores), bf16 copies of the two largest."""
        c = self.cfg
        width = max(int(c.get("hidden_size") or 0), 2 * int(c.get("intermediate_size") or 0),
                    2 * int(c.get("moe_intermediate_size") or 0) * int(c.get("num_experts_per_tok") or 1))
        total = rows * 32 * width
        extras = self.manifest.extras
        if extras.get("weight_quant") == "nvfp4" and not extras.get("fp4_mma"):
            packed = sorted((int(np.prod(shape)) for _, shape, dtype in self.manifest.params  # expert stacks (3-D)
                             if str(dtype) == "uint8" and len(shape) == 2), reverse=True)[:2]  # dequantize in registers
            total += sum(4 * n for n in packed)  # two fp4 codes per byte -> 2 bf16 bytes each
        return total

    def auto_kv_tokens(self, num_slots: int, extra_page_bytes: int = 0, step_rows: int = 2048,
                       extra_bytes: int = 0) -> int:
        """Tokens of KV that fit in the device memory left after weights, state slots, 1 GiB and the workspace of
        a step of step_rows tokens (the artifact's max_context on the CPU, where memory is not the pool's limit).
        extra_page_bytes: pools that will be attached on the same page ids (a DFlash drafter's paged layers);
        extra_bytes: other device memory made after the pools (the shortlisted MTP head: draft_head_bytes)."""
        free = int(getattr(self.dev, "available_global_memory", 0) or 0) if self.device_kind == "cuda" else 0
        if free <= 0:
            return self.manifest.max_context
        per_token = (self.layout.page_bytes + extra_page_bytes) / self.page_size
        left = free - self.AUTO_HEADROOM - self.step_workspace_bytes(step_rows) - \
            num_slots * self.layout.state_slot_bytes - extra_bytes
        return max(self.manifest.max_context, int(left // per_token))

    def allocate(self, num_pages: int, num_slots: int, max_batch: int, cuda_graphs: Optional[bool] = None,
                 programmatic_launch: bool = False) -> None:
        """Pools for num_pages KV pages and num_slots state slots, input buffers for max_batch rows.
        programmatic_launch: graphs get programmatic kernel edges where the library's kernels wait for their
        predecessor (manifest extras.grid_dependency_wait)."""
        lay, empty = self.layout, self.tvm.runtime.empty
        self.num_pages, self.num_slots = num_pages, num_slots
        self.kv_pool = empty((num_pages,) + lay.kv_page, lay.kv_dtype, self.dev)
        self.conv_pool = empty((num_slots,) + lay.conv_slot, lay.state_dtype, self.dev)
        self.ssm_pool = empty((num_slots,) + lay.ssm_slot, "float32", self.dev)
        self._np_kv, self._np_conv = np_dtype(lay.kv_dtype), np_dtype(lay.state_dtype)
        if self.has_mtp:
            self.mtp_kv_pool = empty((num_pages,) + lay.mtp_page, lay.kv_dtype, self.dev)
            self._zero_pool(self.mtp_kv_pool, lay.mtp_page, self._np_kv)  # a position the head never wrote reads finite values
        max_pages = -(-(self.manifest.max_context + 64) // self.page_size)
        self.inputs = StepInputs(self.tvm, self.dev, max_batch, max_pages)
        self.chain = ChainInputs(self.tvm, self.dev, max_batch, max_pages) if self.has_mtp else None
        self.replay_inputs = ReplayInputs(self.tvm, self.dev) if self.has_gdn_replay else None
        self.round_uploads = UploadBatch(self.tvm, self.dev)
        if self.device_kind == "cuda" and (cuda_graphs is None or cuda_graphs):
            pdl = bool(programmatic_launch and self.manifest.extras.get("grid_dependency_wait"))

            def graphed(name: str) -> GraphedFunction:
                return GraphedFunction(self.tvm, self.dev, self.vm[name], programmatic=pdl)

            self.decode_graphs = graphed("decode")
            if self.has_verify:
                self.verify_graphs = graphed("verify")
            if self.has_taps:
                self.verify_t_graphs = graphed("verify_t")
            if self.has_mtp:
                self.mtp_graphs = graphed("mtp_step")
            if self.has_head_draft:
                self.mtp_hd_graphs = graphed("mtp_step_hd")
            if self.has_gdn_replay:
                self.replay_graphs = graphed("gdn_replay")
        self._graph_generation = self.inputs.generation

    def zero_kv(self) -> None:
        """Zero the whole KV pool once. The engine never reads a position it did not write; a harness that
        times decode over reserved-but-unwritten context does, and fresh memory may hold NaN patterns."""
        self._zero_pool(self.kv_pool, self.layout.kv_page, self._np_kv)

    def _zero_pool(self, pool, page_shape: tuple, np_dt) -> None:
        """Zero a [num_pages, *page_shape] pool: one device fill on CUDA (torch over DLPack), one copy on the
        CPU; page by page only where torch cannot view it."""
        if self.device_kind != "cuda":
            pool.copyfrom(np.zeros((self.num_pages,) + tuple(page_shape), np_dt))
            return
        try:
            import torch
            torch.from_dlpack(pool).zero_()
            return
        except Exception:  # noqa: BLE001  (no torch, or a dtype it cannot view): page by page
            pass
        zero = np.zeros(page_shape, np_dt)
        for p in range(self.num_pages):
            self._view(pool, page_shape, p, np_dt.itemsize).copyfrom(zero)

    @property
    def kv_shape(self) -> tuple:
        return (self.num_pages,) + self.layout.kv_page

    @property
    def mtp_kv_shape(self) -> tuple:
        return (self.num_pages,) + self.layout.mtp_page

    # ---- raw views for state movement (host tier, checkpoints) -------------------------------
    @staticmethod
    def _view(pool, shape_tail, index: int, itemsize: int):
        nbytes = int(np.prod(shape_tail)) * itemsize
        return pool._create_view(tuple(shape_tail), pool.dtype, index * nbytes)

    def page_view(self, page: int):
        return self._view(self.kv_pool, self.layout.kv_page, page, self._np_kv.itemsize)

    def mtp_page_view(self, page: int):
        return self._view(self.mtp_kv_pool, self.layout.mtp_page, page, self._np_kv.itemsize)

    def state_views(self, slot: int):
        conv, ssm = self.layout.conv_slot, self.layout.ssm_slot
        return (self._views(self.conv_pool, tuple(conv), self.layout.state_dtype,
                            slot * math.prod(conv) * self._np_conv.itemsize),
                self._views(self.ssm_pool, tuple(ssm), "float32", slot * math.prod(ssm) * 4))

    def sync(self) -> None:
        """Wait for queued device copies (host tier transfers are timed and must be complete)."""
        if self.device_kind == "cuda":
            self.dev.sync()

    def read_state(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        conv, ssm = self.state_views(slot)
        return conv.numpy(), ssm.numpy()

    def write_state(self, slot: int, conv: np.ndarray, ssm: np.ndarray) -> None:
        cv, sv = self.state_views(slot)
        cv.copyfrom(np.ascontiguousarray(conv, dtype=self._np_conv))
        sv.copyfrom(np.ascontiguousarray(ssm, dtype=np.float32))

    def copy_state(self, src: int, dst: int) -> None:
        for s, d in zip(self.state_views(src), self.state_views(dst)):
            s.copyto(d)

    def zero_state(self, slot: int) -> None:
        self.write_state(slot, np.zeros(self.layout.conv_slot, self._np_conv),
                         np.zeros(self.layout.ssm_slot, np.float32))

    def read_pages(self, pages: list[int]) -> np.ndarray:
        return np.stack([self.page_view(p).numpy() for p in pages]) if pages else \
            np.zeros((0,) + self.layout.kv_page, self._np_kv)

    def write_pages(self, pages: list[int], data: np.ndarray) -> None:
        for p, block in zip(pages, data):
            self.page_view(p).copyfrom(np.ascontiguousarray(block, dtype=self._np_kv))

    def copy_page(self, src: int, dst: int) -> None:
        self.page_view(src).copyto(self.page_view(dst))
        if self.mtp_kv_pool is not None:  # the MTP head's KV lives on the same page ids
            self.mtp_page_view(src).copyto(self.mtp_page_view(dst))
        for name in self.page_pools:  # [dflash hook]
            self.pool_page_view(name, src).copyto(self.pool_page_view(name, dst))

    # ---- forward -------------------------------------------------------------------------
    def _pools(self) -> list:
        return [self.kv_pool, self.conv_pool, self.ssm_pool, self.params]

    def host_logits(self, logits) -> np.ndarray:
        """A decode call's device logits (on_device=True) on the host, cut to the sampled vocabulary."""
        return self._cut(logits.numpy())

    def _cut(self, logits: np.ndarray) -> np.ndarray:
        return logits if self.sample_vocab >= logits.shape[-1] else logits[..., : self.sample_vocab]

    def _check_tokens(self, chunks) -> None:
        """A token id outside the vocabulary would index past the embedding table on the device."""
        for t in chunks:
            if len(t) == 0:
                continue
            # a round's chunks are a few ids (Python's min/max beat numpy's there); prompts are long arrays
            lo, hi = (min(t), max(t)) if len(t) <= 64 and isinstance(t, list) else (np.min(t), np.max(t))
            if lo < 0 or hi >= self.vocab_size:
                raise ValueError(f"token id out of range [0, {self.vocab_size})")

    def _check_room(self, seqs: Sequence[SeqLike], counts: Sequence[int]) -> None:
        for s, n in zip(seqs, counts):
            if n <= 0:
                raise ValueError("a forward needs at least one token per sequence")
            if s.length + n > len(s.pages) * self.page_size:
                raise ValueError(f"sequence {s.uid}: {n} tokens at {s.length} exceed its {len(s.pages)} reserved pages")
            if s.length + n > self.manifest.max_context:
                raise ValueError(f"sequence {s.uid} would pass the compiled max_context {self.manifest.max_context}")

    def _check_chunk(self, n: int) -> None:
        """A prefill call over the compiled row bound would overrun its planned storage."""
        if self.max_prefill_chunk is not None and n > self.max_prefill_chunk:
            raise ValueError(f"a prefill call of {n} tokens exceeds the library's max_prefill_chunk "
                             f"{self.max_prefill_chunk} (split it, or recompile with a larger --max-prefill-chunk)")

    def _ragged(self, batch, out_rows=None):
        seqs = [s for s, _ in batch]
        chunks = [t for _, t in batch]
        self._check_chunk(sum(len(t) for t in chunks))
        self._check_room(seqs, [len(t) for t in chunks])
        self._check_tokens(chunks)
        assert self.inputs is not None  # allocate() made the input buffers
        return self.inputs.ragged(seqs, chunks, out_rows)

    def prefill(self, batch: list[tuple[SeqLike, Sequence[int]]], all_logits: bool = False) -> list[np.ndarray]:
        """Run a chunk of tokens for each (seq, tokens) at the sequence's length; returns per-sequence
        logits ([V] for the last token, or [len, V] with all_logits)."""
        lens = np.array([len(t) for _, t in batch], np.int64)
        cu = np.concatenate([[0], np.cumsum(lens)])
        rows = np.arange(cu[-1], dtype=np.int32) if all_logits else (cu[1:] - 1).astype(np.int32)
        if has_media(batch):  # image rows and M-RoPE positions (executor/media_forward.py)
            logits = self._cut(prefill_media(self, batch, rows))
        else:
            args, cu, rows_view = self._ragged(batch, rows)
            logits = self._cut(self.vm["prefill"](*args, rows_view, *self._pools())[0].numpy())
        if all_logits:
            return [logits[cu[i]:cu[i + 1]] for i in range(len(batch))]
        return list(logits)

    def decode(self, seqs: Sequence[SeqLike], tokens: Sequence[int], on_device: bool = False, wait: bool = True):
        """One token per sequence at its length; returns logits [B, V] (on_device: the library's output
        tensor, uncut, for the device sampler; valid until the next decode call). wait=False (with on_device):
        return once the step is queued on the device (a CUDA graph replay does not wait for the stream).
        `last_inputs_s` keeps the seconds spent staging and uploading the inputs."""
        t0 = time.perf_counter()
        self._check_room(seqs, [1] * len(seqs))
        self._check_tokens([tokens])
        # CUDA: page-table width rounded up to a power of two, graphs or not (few graph keys, and the
        # attention split count, which follows the width, is the same in both modes)
        bucket = page_width_bucket if self.device_kind == "cuda" else None
        assert self.inputs is not None  # allocate() made the input buffers
        args = self.inputs.decode(seqs, tokens, bucket)
        rope = decode_rope_positions(seqs)  # cache position + rope delta after images
        self.last_inputs_s = time.perf_counter() - t0
        if rope is not None:
            tokens_v, positions_v, pt_v, slots_v = args
            out = self.vm["decode_mrope"](tokens_v, positions_v, self.inputs.tensor(rope), pt_v, slots_v,
                                          *self._pools())
        elif self.decode_graphs is not None:
            out = self.decode_graphs(args, self._pools(), wait=wait or not on_device)
        else:
            out = self.vm["decode"](*args, *self._pools())
        return out[0] if on_device else self._cut(out[0].numpy())

    # ---- speculative decoding: prefill_h / verify / the MTP head ---------------------------
    # Hidden states are the final post-norm ones, fp32 on the host. The MTP head keeps its own
    # one-layer KV pool on the main model's page ids (same page tables, same allocator).
    def prefill_h(self, batch, taps: bool = False) -> tuple[list[np.ndarray], list]:
        """prefill that also returns every row's final hidden state: ([V] last-token logits, [len, D]
        hidden) per sequence. taps: the tap layers' outputs instead ([len, T*D] DeviceRows that stay on
        the device: prefill_t)."""
        lens = np.array([len(t) for _, t in batch], np.int64)
        rows = (np.cumsum(lens) - 1).astype(np.int32)
        args, cu, rows_view = self._ragged(batch, rows)
        out = self.vm[self._hidden_fn("prefill_h", taps)](*args, rows_view, *self._pools())
        return list(self._cut(out[0].numpy())), self.split_rows(out[1], cu, taps)

    def _ragged_graphs(self) -> None:
        """Graphs over the ragged buffers are stale once those buffers moved (they grew)."""
        assert self.inputs is not None  # allocate() made the input buffers
        if self.inputs.generation != self._graph_generation:
            for g in (self.verify_graphs, self.verify_t_graphs, self.mtp_graphs):
                if g is not None:
                    g.reset()
            self._graph_generation = self.inputs.generation

    def verify(self, batch, taps: bool = False) -> tuple[list[np.ndarray], list]:
        """One batched multi-token target forward: ([len, V] logits, [len, D] hidden) per sequence.
        KV is written and the GDN state advanced like a prefill; the caller rolls back rejections.
        On CUDA it replays a graph per (rows, batch, page-width bucket): a round's shape repeats.
        taps: the tap layers' outputs instead of the final hidden (DeviceRows: verify_t). Replayed, they
        are the graph's output buffer, which the next replay of that shape overwrites: consume them first."""
        out, cu = self._verify_call(batch, taps)
        logits = self._cut(out[0].numpy())
        return [logits[cu[i]:cu[i + 1]] for i in range(len(batch))], self.split_rows(out[1], cu, taps)

    def verify_device(self, staged: tuple, drafts=None) -> tuple[Any, np.ndarray, Any]:
        """A staged verify (stage_verify) whose logits stay on the device: (the library's [rows, vocab_size]
        logits tensor, uncut, for the device sampler, valid until the next verify of that shape; cu_seqlens; the
        hidden / taps output tensor, which split_rows cuts per sequence as verify does: read it after queueing
        what consumes the logits). drafts: (rows [k, b] device int32, [(chain row, index of its first draft
        among the call's tokens)]): tokens the device chose (run_draft_chain), copied on the device over the
        placeholders the staged batch holds there. The graph replay is not waited for: reading an output is."""
        out, cu = self.run_verify(staged, drafts, wait=False)
        return out[0], cu, out[1]

    def _verify_call(self, batch, taps: bool, drafts=None, wait: bool = True):
        return self.run_verify(self.stage_verify(batch, taps), drafts, wait)

    def upload_batch(self) -> UploadBatch:
        """The runner's batch (emptied) for the inputs of several staged calls, sent in ONE host->device copy: a
        device round stages its draft chain and its verify into it (stage_draft_chain, stage_verify), sends it,
        then launches both. run_verify and run_draft_chain refuse to launch while it holds unsent inputs."""
        assert self.round_uploads is not None  # allocate() made it
        self.round_uploads.discard()
        return self.round_uploads

    def _check_sent(self) -> None:
        if self.round_uploads is not None and self.round_uploads.pending:
            raise RuntimeError("launch with staged inputs not sent (UploadBatch.send first)")

    def stage_verify(self, batch, taps: bool = False, uploads: Optional[UploadBatch] = None) -> tuple:
        """A verify's inputs, staged now and launched by run_verify: a round stages its verify before launching
        the draft chain, so nothing waits for the device between the two. uploads: a batch the values join (the
        caller sends it before the launch); default: sent now, in one copy."""
        seqs = [s for s, _ in batch]
        chunks = [t for _, t in batch]
        self._check_room(seqs, [len(t) for t in chunks])
        self._check_tokens(chunks)
        name = self._hidden_fn("verify", taps)
        graphs = self.verify_t_graphs if taps else self.verify_graphs
        assert self.inputs is not None  # allocate() made the input buffers
        args, cu, _ = self.inputs.ragged(seqs, chunks, width_of=page_width_bucket if graphs is not None else None,
                                         uploads=uploads)
        if graphs is not None:
            self._ragged_graphs()
        return name, graphs, args, cu

    def run_verify(self, staged: tuple, drafts=None, wait: bool = True):
        """Launch a staged verify: (the library's outputs, cu_seqlens); drafts as verify_device's."""
        name, graphs, args, cu = staged
        self._check_sent()
        if drafts is not None:
            assert self.inputs is not None
            rows, where = drafts
            k, b = (int(x) for x in rows.shape)
            if b == 1:  # one sequence: its drafts are contiguous, one copy
                self._views(rows, (k,), "int32").copyto(self.inputs.r_tokens.view((k,), where[0][1]))
            else:  # [k, b] step-major -> each row's k tokens: a device copy per draft (views made once)
                for j in range(k):
                    for r, at in where:
                        src = self._views(rows, (1,), "int32", 4 * (j * b + r))
                        src.copyto(self.inputs.r_tokens.view((1,), at + j))
        if graphs is not None:
            out = graphs(args, self._pools(), wait=wait)
        else:
            out = self.vm[name](*args, *self._pools())
        self.verify_gdn_rows = (out[2], out[3]) if self.has_gdn_replay else None
        return out, cu

    def replay_gdn(self, gdn_rows: tuple, items: Sequence[tuple[SeqLike, int, int]]) -> None:
        """Advance state slots over verify rows (gdn_replay): gdn_rows, a verify's verify_gdn_rows (valid until the
        next verify of that shape); items (sequence, index of its first row among that verify's rows, row count),
        each sequence's slot holding the state before those rows. Queued on the device, not waited for."""
        if not self.has_gdn_replay:
            raise RuntimeError(f"{self.art_dir.name} lacks gdn_replay; recompile it with this version of `ninfer compile`")
        total = int(gdn_rows[0].shape[1])
        staged = []
        for s, first, n in items:
            first, n = int(first), int(n)
            if n <= 0:
                continue
            if s.slot is None or first < 0 or first + n > total:
                raise ValueError(f"replay rows {first}..{first + n} outside the verify's {total} rows (or no slot)")
            staged.append((int(s.slot), first, n))
        if not staged:
            return
        assert self.replay_inputs is not None  # allocate() made the input buffers
        args = self.replay_inputs.stage(gdn_rows, staged)
        pools = [self.conv_pool, self.ssm_pool, self.params]
        if self.replay_graphs is None:
            self.vm["gdn_replay"](*args, *pools)
            return
        if self.replay_inputs.generation != self._replay_generation:  # its buffers moved (grew)
            self.replay_graphs.reset()
            self._replay_generation = self.replay_inputs.generation
        self.replay_graphs(args, pools, wait=False)

    def _hidden_fn(self, name: str, taps: bool) -> str:
        if not taps:
            return name
        if not self.has_taps:
            raise RuntimeError(f"{self.art_dir.name} has no tap-layer functions (recompile it with "
                               "`ninfer compile --tap-layers DRAFTER_DIR`)")
        return {"prefill_h": "prefill_t", "verify": "verify_t"}[name]

    def split_rows(self, hidden, cu, taps: bool) -> list:
        """Per-sequence rows of a [n, W] output: host arrays, or device row views for taps."""
        rows = DeviceRows(hidden) if taps else self.read_host(hidden)
        return [rows[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]

    def _check_mtp(self, seqs, tops) -> None:
        if not self.has_mtp:
            raise RuntimeError(f"{self.art_dir.name} has no MTP head (recompile from a checkpoint with mtp.* weights)")
        for s, top in zip(seqs, tops):
            if top >= len(s.pages) * self.page_size:
                raise ValueError(f"MTP position {top} lies beyond the sequence's reserved pages")

    def _check_mtp_items(self, items, bounded: bool) -> list[int]:
        """mtp_prefill's items checked (matching rows and tokens, positions, ids, the row bound); their row counts."""
        lens = [len(h) for _, h, _, _ in items]
        if any(n == 0 or len(t) != n for n, (_, _, t, _) in zip(lens, items)):
            raise ValueError("mtp_prefill needs matching, non-empty hidden rows and next tokens")
        if bounded:
            self._check_chunk(sum(lens))
        self._check_mtp([s for s, _, _, _ in items], [p + n - 1 for n, (_, _, _, p) in zip(lens, items)])
        self._check_tokens([t for _, _, t, _ in items])
        return lens

    def mtp_prefill(self, items: list[tuple[SeqLike, np.ndarray, Sequence[int], int]],
                    shortlist: Optional[np.ndarray] = None, on_device: bool = False) -> tuple[Any, Any]:
        """MTP rows for [(seq, hidden [m, D], next_tokens [m], first position)]: row j pairs the main hidden
        at position p + j with the token at p + j + 1 and writes the head's KV at p + j. Returns the logits
        ([b, V], or [b, len(shortlist)]) and output hidden [b, D] of each item's last row (on_device: the
        library's output tensors, logits uncut, for a draft chain that stays on the device; no shortlist)."""
        if on_device and shortlist is not None:
            raise ValueError("a shortlisted MTP head returns shortlist columns; the device chain needs the full vocabulary")
        seqs = [s for s, _, _, _ in items]
        lens = self._check_mtp_items(items, bounded=shortlist is None)  # mtp_step_sl (draft rounds): no row bound
        hidden = np.ascontiguousarray(np.concatenate([h for _, h, _, _ in items]), np.float32)
        last = (np.cumsum(lens) - 1).astype(np.int32)
        assert self.inputs is not None  # allocate() made the input buffers
        args, _, rows_view = self.inputs.ragged(seqs, [t for _, _, t, _ in items], last,
                                                starts=[p for _, _, _, p in items])
        ragged = [self.inputs.hidden(hidden)] + args[:3] + [args[4]]  # no cu_seqlens / slots
        if shortlist is not None:
            out = self.vm["mtp_step_sl"](*ragged, self.inputs.tensor(shortlist), self.mtp_kv_pool, self.params)
            return out[0].numpy()[last], out[1].numpy()[last]
        out = self.vm["mtp_prefill"](*ragged, rows_view, self.mtp_kv_pool, self.params)
        if on_device:
            return out[0], out[1]
        return self._cut(out[0].numpy()), out[1].numpy()

    def mtp_step(self, seqs: Sequence[SeqLike], hidden: np.ndarray, tokens, positions,
                 shortlist: Optional[np.ndarray] = None) -> tuple[np.ndarray, np.ndarray]:
        """One MTP row per sequence (a chained draft step): (logits [b, V or len(shortlist)], hidden [b, D])."""
        self._check_mtp(seqs, list(positions))
        self._check_tokens([tokens])
        graphs = self.mtp_graphs if shortlist is None else None
        assert self.inputs is not None  # allocate() made the input buffers
        args, _, _ = self.inputs.ragged(seqs, [[int(t)] for t in tokens], starts=list(positions),
                                        width_of=page_width_bucket if graphs is not None else None)
        ragged = [self.inputs.hidden(hidden)] + args[:3] + [args[4]]
        if shortlist is not None:
            out = self.vm["mtp_step_sl"](*ragged, self.inputs.tensor(shortlist), self.mtp_kv_pool, self.params)
        else:
            if graphs is not None:
                self._ragged_graphs()
                out = graphs(ragged, [self.mtp_kv_pool, self.params])
            else:
                out = self.vm["mtp_step"](*ragged, self.mtp_kv_pool, self.params)
            return self._cut(out[0].numpy()), out[1].numpy()
        return out[0].numpy(), out[1].numpy()

    # ---- the shortlisted proposal head on the device (executor/draft_head.py) -------------------
    def draft_head_bytes(self, rows: int) -> int:
        """Device bytes set_draft_head takes for a shortlist of `rows` ids (0 where the library has no such head)."""
        if not self.has_head_draft:
            return 0
        return draft_head_bytes(rows, int(self.cfg["hidden_size"]), self.vocab_size, self.manifest.dtype)

    def set_draft_head(self, ids: np.ndarray) -> bool:
        """Build the shortlisted head (token ids `ids`) on the device for draft chains with head=True; False (and
        nothing built) where the library lacks the head-draft functions: a shortlist then drafts in host rounds."""
        if not self.has_head_draft:
            return False
        self.draft_head = DraftHead(self, ids)
        if self.mtp_hd_graphs is not None:  # graphs bake in the head tensors' addresses
            self.mtp_hd_graphs.reset()
        return True

    def stage_draft_chain(self, items: list[tuple[SeqLike, np.ndarray, Sequence[int], int]], steps: int,
                          uploads: Optional[UploadBatch] = None, head: bool = False) -> tuple:
        """Stage a round's MTP draft chain (run_draft_chain launches it): mtp_prefill over items (as
        mtp_prefill's: the pending hidden rows and their next tokens), then steps - 1 chained mtp_steps, step s
        putting each row at the position after the previous one. Every host->device copy of the chain happens
        here (TVM's waits for the device): its values join `uploads` (the round's verify joins them too; the
        caller sends the batch before launching anything); default: sent now, in one copy.
        head: draft with the shortlisted head (set_draft_head): mtp_prefill_hd / mtp_step_hd."""
        if not self.has_mtp or self.chain is None:
            raise RuntimeError(f"{self.art_dir.name} has no MTP head (recompile from a checkpoint with mtp.* weights)")
        if head and self.draft_head is None:
            raise RuntimeError("a draft chain with the shortlisted head needs set_draft_head first")
        lens = self._check_mtp_items(items, bounded=True)
        seqs = [s for s, _, _, _ in items]
        first = [p + n for n, (_, _, _, p) in zip(lens, items)]  # the first chained step's positions
        if steps > 1:
            self._check_mtp(seqs, [f + steps - 2 for f in first])
        chain = self.chain  # its graphs under the tag "chain" (other input buffers)
        graphs = self.mtp_hd_graphs if head else self.mtp_graphs
        batch = self.upload_batch() if uploads is None else uploads
        args = chain.stage(seqs, first, steps - 1, batch, width_of=page_width_bucket if graphs is not None else None)
        hidden = np.concatenate([h for _, h, _, _ in items])
        pre = chain.stage_prefill(hidden, [t for _, _, t, _ in items], [p for _, _, _, p in items], args[4], batch)
        if uploads is None:
            batch.send()
        args[0] = chain.hidden_view(len(seqs), int(hidden.shape[1]))
        if chain.generation != self._chain_generation:
            for g in (self.mtp_graphs, self.mtp_hd_graphs):
                if g is not None:
                    g.reset()  # the chain's buffers moved (rare: a longer chain, or the first)
            self._chain_generation = chain.generation
        return steps, args, pre, head

    def run_draft_chain(self, staged: tuple, choose):
        """Launch a staged chain; choose(logits) -> [b] int32 device tensor picks a step's drafts (spec/
        device_round.py DeviceArgmax); they and the step's output hidden feed the next step by device copies,
        nothing is read back, and replays are not waited for, so the steps run back to back. Returns the
        [steps, b] drafts view (valid until the next chain)."""
        self._check_sent()  # before anything: a staged chain whose upload was not sent must not launch
        steps, args, pre, head = staged
        chain = self.chain
        assert chain is not None  # stage_draft_chain checked it
        if head:  # the shortlisted head's weight and id -> row map, before the pool (compile/model.py mtp_step_hd)
            assert self.draft_head is not None  # stage_draft_chain checked it
            graphs, step_fn = self.mtp_hd_graphs, "mtp_step_hd"
            persistent = [self.draft_head.weight, self.draft_head.pos, self.mtp_kv_pool, self.params]
        else:
            graphs, step_fn = self.mtp_graphs, "mtp_step"
            persistent = [self.mtp_kv_pool, self.params]
        out = self.vm["mtp_prefill_hd" if head else "mtp_prefill"](*pre, *persistent)
        # a sampler output is VM pool memory a graph replay may reuse as scratch: copy it out before any replay
        choose(out[0]).copyto(chain.drafts_row(0))
        hid = out[1]
        for s in range(steps - 1):
            chain.drafts_row(s).copyto(args[1])
            chain.positions_row(s).copyto(args[2])
            hid.copyto(args[0])
            if graphs is not None:
                out = graphs(args, persistent, wait=False, tag="chain")
            else:
                out = self.vm[step_fn](*args, *persistent)
            hid = out[1]
            choose(out[0]).copyto(chain.drafts_row(s + 1))
        return chain.drafts_rows(steps)
