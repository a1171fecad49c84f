"""Run a compiled DFlash / DFlash2 drafter (compile/dflash) beside its target.

The drafter library has its own weights only; `draft` gets the target's embedding table and lm_head
(the target runner's device tensors: nothing is duplicated). Its KV:
  paged layers   one pool on the TARGET's page ids (target.attach_page_pool, before the host tier is
                 made: page copies and the host tier move it with the target's pages);
  ring layers    a ring of window + block positions per lane (one lane per drafting request).
The runner allocates no pages: the caller hands it target sequences whose pages cover every position
it writes (the block: start .. start + B - 1).

On CUDA, when the target replays graphs, `draft` and the round-sized `ctx` calls (<= GRAPH_CTX_ROWS rows) replay
CUDA graphs too (executor/cuda_graph.py; key: input shapes, page tables in width buckets), so a round's drafter
forwards cost the host one launch each instead of a VM call per kernel (drafts identical to eager calls,
bench/dflash_gpu_check.py; the 27B DFlash2 round measured no shorter for it, BENCHMARKS.md run 8). The graphs'
inputs are fixed-address views: the ragged StepInputs, int buffers sized once, and a fixed stage the ctx call's tap
rows are copied into (a verify's output rows live in that verify graph's buffer, which differs between shapes).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from ...contract.drafter import DrafterConfig
from ...contract.manifest import Manifest, read_manifest
from ..executor.cuda_graph import GraphedFunction, page_width_bucket
from ..executor.device_rows import DeviceRows, RowStage
from ..executor.inputs import StepInputs, _Buffer
from ..executor.upload_batch import UploadBatch
from ..executor.view_cache import ViewCache
from ..executor.weights import load_params, np_dtype
from ..tvm_loader import load_vm

PAGED_POOL = "dflash"  # the target runner's page_pools key
GRAPH_CTX_ROWS = 128  # ctx calls up to this many rows (a round's verify rows) replay graphs; prefill-sized ones run eagerly


def read_drafter_manifest(draft_dir: str | Path) -> Manifest:
    m = read_manifest(draft_dir)
    if "dflash" not in m.extras:
        raise ValueError(f"{draft_dir}: not a DFlash drafter artifact (compile the drafter's HF directory with "
                         "`ninfer compile`)")
    return m


def attach_paged_pool(target, draft_dir: str | Path):
    """Allocate the drafter's paged-layer KV on the target's page ids (None when it has no paged layer)."""
    m = read_drafter_manifest(draft_dir)
    shape = m.extras["dflash"]["pools"].get("paged_pool")
    return target.attach_page_pool(PAGED_POOL, tuple(shape), m.dtype) if shape else None


def paged_bytes_per_page(draft_dir: str | Path) -> int:
    m = read_drafter_manifest(draft_dir)
    shape = m.extras["dflash"]["pools"].get("paged_pool")
    return int(np.prod(shape)) * np_dtype(m.dtype).itemsize if shape else 0


class DrafterRunner:
    def __init__(self, draft_dir: str | Path, target, lanes: int, max_batch: int):
        self.art_dir = Path(draft_dir)
        self.manifest = m = read_drafter_manifest(draft_dir)
        self.cfg = cfg = DrafterConfig.from_dict(m.config)
        self.target = target
        self._check_target(target)
        self.tvm, self.dev = target.tvm, target.dev
        self.vm = load_vm(self.tvm, self.art_dir / m.library, self.dev)
        self.params, self.weights_bytes, self.random_weights = load_params(m, self.art_dir, self.dev, self.tvm)
        self.embed = target.param("model.embed_tokens.weight")
        self.lm_head = self.embed if target.cfg.get("tie_word_embeddings") else target.param("lm_head.weight")
        self.block = cfg.block_size
        pools = m.extras["dflash"]["pools"]
        self.pools = []
        self.paged_pool = self.ring_pool = None
        if "paged_pool" in pools:
            self.paged_pool = attach_paged_pool(target, self.art_dir)
            self.pools.append(self.paged_pool)
        if "ring_pool" in pools:
            # zeroed: slots no position has been written to yet enter the dense attention with weight 0,
            # and 0 x NaN would poison it
            shape = (lanes,) + tuple(pools["ring_pool"])
            self.ring_pool = self.tvm.runtime.tensor(np.zeros(shape, np_dtype(m.dtype)), self.dev)
            self.pools.append(self.ring_pool)
        self.lanes = lanes
        # ctx and draft each have their own input buffers: a device round stages both (and the target's verify)
        # before launching any of them, so no staged value may overwrite another's destination
        self.inputs = StepInputs(self.tvm, self.dev, max_batch, target.inputs.max_pages)
        self.ctx_inputs = StepInputs(self.tvm, self.dev, max_batch, target.inputs.max_pages)
        self.stage = RowStage(self.tvm, self.dev)
        # int inputs: sized once for the largest draft call (max_batch blocks), so graphs over them stay valid
        self._int_rows = max(64, max_batch * self.block)
        self._bufs: dict[str, _Buffer] = {}
        graphs = getattr(target, "decode_graphs", None) is not None  # (CUDA, graphs on)
        # one stream: a device round launches draft right after ctx, which must finish first
        self.ctx_graphs = GraphedFunction(self.tvm, self.dev, self.vm["ctx"]) if graphs else None
        self.draft_graphs = GraphedFunction(self.tvm, self.dev, self.vm["draft"], stream=self.ctx_graphs.stream) \
            if self.ctx_graphs is not None else None
        self._ctx_stage = None  # [GRAPH_CTX_ROWS, taps x hidden] fixed rows for graphed ctx calls
        self._drafts: Any = None  # device drafts of the last device round (hold_drafts)
        self._draft_views = ViewCache()
        self._generations = (self.inputs.generation, self.ctx_inputs.generation)
        # DFlash2's greedy walk on the device (compile/dflash/selector_walk.py; older drafters lack it)
        self.has_walk = cfg.kind == "dflash2" and bool(self.vm.module.implements_function("select_walk"))

    def _check_target(self, t) -> None:
        m, cfg = self.manifest, self.cfg
        name = self.art_dir.name
        if m.target != t.manifest.target:
            raise ValueError(f"drafter {name} is built for {m.target}, the target for {t.manifest.target}")
        if m.dtype != t.manifest.dtype:
            raise ValueError(f"drafter {name} computes in {m.dtype}, the target in {t.manifest.dtype}: compile the "
                             f"drafter with the target's activation dtype")
        if cfg.hidden_size != int(t.cfg["hidden_size"]) or cfg.vocab_size != int(t.cfg["vocab_size"]):
            raise ValueError(f"drafter {name} (hidden {cfg.hidden_size}, vocab {cfg.vocab_size}) does not fit the "
                             f"target (hidden {t.cfg['hidden_size']}, vocab {t.cfg['vocab_size']})")
        if not t.has_taps or list(t.tap_layers) != list(cfg.target_layer_ids):
            raise ValueError(f"the target {t.art_dir.name} exposes tap layers {t.tap_layers or 'none'} but drafter "
                             f"{name} reads {cfg.target_layer_ids}: recompile the target with "
                             f"`ninfer compile --tap-layers {self.art_dir}`")

    # ---- inputs ---------------------------------------------------------------------------
    def _ints(self, name: str, values, uploads) -> object:
        """A device view of int32 values (a buffer per name), joining `uploads` (sent before the call)."""
        a = np.asarray(values, np.int32).reshape(-1)
        buf = self._bufs.get(name)
        if buf is None or buf.capacity < a.size:
            buf = self._bufs[name] = _Buffer(self.tvm, self.dev, max(a.size, 2 * (buf.capacity if buf else 0),
                                                                     self._int_rows))
            self._reset_graphs()  # (a buffer that moved: graphs recorded over the old one are stale)
        buf.host[: a.size] = a
        return buf.upload((a.size,), uploads)

    def codebooks(self) -> tuple[np.ndarray, np.ndarray]:
        """DFlash2: the selector's (predecessor, successor) codebooks on the host, [V, rank]."""
        names = [n for n, _, _ in self.manifest.params]
        return tuple(self.params[names.index(f"candidate_selector.{k}_codebook.weight")].numpy()
                     for k in ("predecessor", "successor"))

    # ---- graphs ----------------------------------------------------------------------------
    def _reset_graphs(self) -> None:
        for g in (self.ctx_graphs, self.draft_graphs):
            if g is not None:
                g.reset()

    def _fresh_graphs(self) -> None:
        """Graphs over the ragged buffers are stale once those buffers moved (they grew)."""
        now = (self.inputs.generation, self.ctx_inputs.generation)
        if now != self._generations:
            self._reset_graphs()
            self._generations = now

    def _staged_taps(self, parts) -> Any:
        """The tap rows copied into the fixed ctx stage (graphed ctx calls read them there)."""
        parts = [p for p in parts if len(p)]
        n, w, dt = sum(len(p) for p in parts), parts[0].width, parts[0].dtype
        st = self._ctx_stage
        if st is None or int(st.shape[1]) != w or str(st.dtype) != dt:
            st = self._ctx_stage = self.tvm.runtime.empty((GRAPH_CTX_ROWS, w), dt, self.dev)
            self._reset_graphs()
        off = 0
        for p in parts:
            p.view().copyto(DeviceRows(st, off, len(p)).view())
            off += len(p)
        return DeviceRows(st, 0, n).view()

    # ---- forward ---------------------------------------------------------------------------
    # Each call is staged (its inputs join an UploadBatch; default: its own, sent at once) and then launched, so a
    # device round stages ctx, draft, walk and the target's verify, sends them in ONE host->device copy (each copy
    # waits for the device) and launches them back to back (spec/dflash.py stage_device / launch_device).
    def ctx(self, items: Sequence[tuple]) -> None:
        """Write context K/V: items (target seq, lane, first position, [DeviceRows of tap rows, ...]); each
        item's rows cover consecutive positions from its first one."""
        staged = self.stage_ctx(items)
        if staged is not None:
            self.run_ctx(staged)

    def stage_ctx(self, items: Sequence[tuple], uploads: Optional[UploadBatch] = None) -> Optional[tuple]:
        """ctx's inputs (None: no rows to write); the tap rows are copied into the graphs' fixed stage now (device
        copies, ordered before anything launched later)."""
        seqs, lanes, starts, counts, parts = [], [], [], [], []
        for seq, lane, start, rows in items:
            n = sum(len(r) for r in rows)
            if n == 0:
                continue
            if start + n > len(seq.pages) * self.target.page_size:
                raise ValueError(f"drafter context up to {start + n} lies beyond the sequence's pages")
            seqs.append(seq)
            lanes.append(lane)
            starts.append(start)
            counts.append(n)
            parts.extend(rows)
        if not seqs:
            return None
        bound = self.manifest.extras.get("max_prefill_chunk")  # ctx's planned storage (compile/memory_bounds.py)
        if bound and sum(counts) > int(bound):
            raise ValueError(f"drafter context of {sum(counts)} rows exceeds the drafter's max_prefill_chunk {bound}")
        graphed = self.ctx_graphs is not None and sum(counts) <= GRAPH_CTX_ROWS
        taps = self._staged_taps(parts) if graphed else self.stage.gather(parts)
        batch = self.ctx_inputs.uploads if uploads is None else uploads
        args, _, _ = self.ctx_inputs.ragged(seqs, [np.zeros(n, np.int32) for n in counts], starts=starts,
                                            uploads=batch, width_of=page_width_bucket if graphed else None)
        keep = [s + n - self.cfg.ring_size for s, n in zip(starts, counts)]
        lanes_v, keep_v = self._ints("ctx_lanes", lanes, batch), self._ints("ctx_keep", keep, batch)
        if uploads is None:
            batch.send()
        return graphed, [taps, args[1], args[2], args[4], lanes_v, keep_v]

    def run_ctx(self, staged: tuple) -> None:
        graphed, inputs = staged
        if graphed:
            assert self.ctx_graphs is not None
            self._fresh_graphs()
            self.ctx_graphs(inputs, [*self.pools, self.params], wait=False)
        else:
            self.vm["ctx"](*inputs, *self.pools, self.params)

    def draft(self, items: Sequence[tuple], on_device: bool = False) -> tuple[Any, Optional[np.ndarray]]:
        """One block per item (target seq, lane, start, anchor token, ring_lo, k): [anchor, MASK x (B-1)] at
        positions start..start+B-1. Returns logits of the first k mask rows of each block, in order
        ([sum k, V] fp32; on_device: the library's device tensor, not copied) and, for DFlash2, the selector's
        projected hidden of those rows."""
        out = self.run_draft(self.stage_draft(items))
        sel = self.target.read_host(out[1]) if self.cfg.kind == "dflash2" else None
        return (out[0] if on_device else out[0].numpy()), sel

    def stage_draft(self, items: Sequence[tuple], uploads: Optional[UploadBatch] = None) -> list:
        """draft's inputs (run_draft launches it)."""
        B, mask = self.block, self.cfg.mask_token_id
        seqs, starts, tokens, attn_pos, kv_rows = [], [], [], [], []
        rows: list[int] = []
        for i, (seq, _lane, start, anchor, _ring_lo, k) in enumerate(items):
            if start + B > len(seq.pages) * self.target.page_size:
                raise ValueError(f"drafter block at {start} lies beyond the sequence's pages")
            if not 1 <= k < B:
                raise ValueError(f"a block of {B} drafts 1..{B - 1} tokens, asked for {k}")
            seqs.append(seq)
            starts.append(start)
            tokens.append([int(anchor)] + [mask] * (B - 1))
            rows.extend(i * B + 1 + j for j in range(k))
            attn_pos.extend([start + B - 1] * B)
            kv_rows.extend([i * B + B - 1] * B)
        batch = self.inputs.uploads if uploads is None else uploads
        args, _, rows_view = self.inputs.ragged(seqs, tokens, np.asarray(rows, np.int32), starts=starts,
                                                uploads=batch, width_of=page_width_bucket if self.draft_graphs is not None else None)
        ints = [self._ints("attn_pos", attn_pos, batch), self._ints("kv_rows", kv_rows, batch),
                self._ints("lanes", [it[1] for it in items], batch), self._ints("ring_lo", [it[4] for it in items], batch)]
        if uploads is None:
            batch.send()
        return [args[0], args[1], ints[0], ints[1], args[2], args[4], ints[2], ints[3], rows_view]

    def run_draft(self, inputs: list) -> Any:
        """Launch a staged draft: the library's outputs (logits, [selector hidden], pools...) as device tensors (a
        graph's: valid until its next replay of this shape)."""
        persistent = [self.embed, self.lm_head, *self.pools, self.params]
        if self.draft_graphs is not None:
            self._fresh_graphs()
            return self.draft_graphs(inputs, persistent, wait=False)
        return self.vm["draft"](*inputs, *persistent)

    def stage_walk(self, anchors: Sequence[int], uploads: UploadBatch) -> Any:
        """The walk's anchors (each block's last committed token), joining `uploads`."""
        return self._ints("walk_anchors", anchors, uploads)

    def run_walk(self, top_ids, top_vals, sel, anchors) -> Any:
        """DFlash2's greedy walk on the device (has_walk): [k, b] int32 drafts, step-major, from the device
        sampler's top logprobs of draft's rows (top_ids, top_vals) and its selector rows (sel)."""
        out = self.vm["select_walk"](top_ids, top_vals, sel, anchors, self.params)
        return self.hold_drafts(out, int(anchors.shape[0]))

    def hold_drafts(self, drafts, b: int) -> Any:
        """Device drafts [k * b] (a VM call's output) copied into a buffer of the runner's, as a [k, b] view. A VM
        output's memory comes from the pool that graph replays also write their recorded scratch into (executor/
        cuda_graph.py): the verify's replay may overwrite it before the round reads the drafts (seen on the H200)."""
        n = int(drafts.shape[0])
        if self._drafts is None or int(self._drafts.shape[0]) < n:
            self._drafts = self.tvm.runtime.empty((max(n, self._int_rows),), "int32", self.dev)
        drafts.copyto(self._draft_views(self._drafts, (n,), "int32"))
        return self._draft_views(self._drafts, (n // b, b), "int32")
