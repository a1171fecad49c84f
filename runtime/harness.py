"""Run sequences straight through the executor, without the scheduler or the prefix cache: the
parity checks against transformers and the kernel benchmarks use this. It owns a KV manager for its
own sequences and advances them after each forward, as the scheduler does for the engine."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np

from .executor.model_runner import ModelRunner
from .kv.manager import KVManager, SeqKV


class OutOfPages(RuntimeError):
    pass


class Harness:
    def __init__(self, art_dir: str | Path, device: str = "auto", kv_capacity_tokens: Optional[int] = None,
                 num_slots: int = 8, max_batch: int = 8, cuda_graphs: Optional[bool] = None, verify: str = "size",
                 programmatic_launch: bool = False):
        self.runner = ModelRunner(art_dir, device=device, verify=verify)
        r = self.runner
        cap = kv_capacity_tokens or max(r.manifest.max_context, r.page_size)
        num_pages = -(-cap // r.page_size)
        r.allocate(num_pages, num_slots, max_batch, cuda_graphs, programmatic_launch)
        r.zero_kv()  # timed decode over reserved, never-written context must read finite values
        self.kv = KVManager(r, num_pages, num_slots)

    def attach(self, cache=None, host=None) -> KVManager:
        """Give the harness's KV manager a prefix cache and a host tier (tests of the tiered KV)."""
        self.kv.cache, self.kv.host = cache, host
        return self.kv

    def __getattr__(self, name: str):  # the runner's attributes and views (manifest, cfg, page_view ...)
        return getattr(self.runner, name)

    # ---- sequences -----------------------------------------------------------------------
    def new_seq(self) -> SeqKV:
        seq = self.kv.new_seq()
        if seq is None:
            raise OutOfPages("no free state slot")
        return seq

    def free_seq(self, seq: SeqKV) -> None:
        self.kv.release(seq, [], 0, None, keep=False)

    def reserve(self, seq: SeqKV, n: int) -> None:
        if not self.kv.ensure(seq, n):
            raise OutOfPages(f"no pages for {n} more tokens")

    def _run(self, batch, fn):
        for s, t in batch:
            self.reserve(s, len(t))
        out = fn([(s, t) for s, t in batch])
        for s, t in batch:
            self.kv.advance(s, len(t))
        return out

    # ---- forward (reserve, execute, advance) ------------------------------------------------
    def prefill(self, batch, all_logits: bool = False) -> list[np.ndarray]:
        return self._run(batch, lambda b: self.runner.prefill(b, all_logits=all_logits))

    def prefill_h(self, batch, taps: bool = False):
        return self._run(batch, lambda b: self.runner.prefill_h(b, taps=taps))

    def verify(self, batch, taps: bool = False):
        return self._run(batch, lambda b: self.runner.verify(b, taps=taps))

    def decode(self, seqs: list[SeqKV], tokens: list[int], on_device: bool = False):
        """Logits [B, V] on the host (on_device: the library's device tensor, nothing copied)."""
        return self._run([(s, [t]) for s, t in zip(seqs, tokens)],
                         lambda b: self.runner.decode([s for s, _ in b], [t[0] for _, t in b], on_device=on_device))
