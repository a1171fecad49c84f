"""Prefill memory does not grow with the number of distinct chunk lengths (compile/memory_bounds.py).

Before the row bound, every prefill of a new length left its intermediates in the VM's pooled
allocator (about 3 MiB per length of ~400 tokens on the tiny model); a server fed prompts of
varying lengths grew without limit. Now the chunk functions allocate one storage of their
compiled maximum, reused for every length.
"""
from __future__ import annotations

import gc
import json
import os
import shutil

import numpy as np
import pytest

from ninfer_mlc.paths import default_model_dir
from ninfer_mlc.runtime.assemble import prefill_chunk_for
from ninfer_mlc.runtime.config import EngineConfig
from ninfer_mlc.runtime.errors import ConfigError
from ninfer_mlc.runtime.harness import Harness


def _rss_mib() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.fixture(scope="module")
def harness():
    return Harness(default_model_dir(), device="cpu", kv_capacity_tokens=1024, num_slots=2, max_batch=2)


def _prefill(h: Harness, n: int, rng) -> None:
    seq = h.new_seq()
    try:
        h.prefill([(seq, rng.integers(0, h.vocab_size, n).tolist())])
    finally:
        h.free_seq(seq)


def test_distinct_prefill_lengths_do_not_grow_memory(harness):
    rng = np.random.default_rng(0)
    _prefill(harness, 512, rng)  # the functions' storages exist after one call (any length)
    gc.collect()
    before = _rss_mib()
    for n in range(500, 260, -20):  # 12 lengths never seen before
        _prefill(harness, n, rng)
    gc.collect()
    grown = _rss_mib() - before
    assert grown < 12, f"RSS grew {grown:.1f} MiB over 12 distinct prefill lengths"


def test_row_bound_is_enforced(harness, tmp_path):
    bound = harness.max_prefill_chunk
    assert bound == 2048  # the default model carries the compiled bound
    seq = harness.new_seq()
    try:
        with pytest.raises(ValueError, match="max_prefill_chunk"):
            harness.runner.prefill([(seq, [1] * (bound + 1))])
    finally:
        harness.free_seq(seq)
    assert prefill_chunk_for(EngineConfig(), harness.runner) == 512  # the CPU default, under the bound
    assert prefill_chunk_for(EngineConfig(prefill_chunk=bound), harness.runner) == bound
    with pytest.raises(ConfigError, match="prefill_chunk"):
        prefill_chunk_for(EngineConfig(prefill_chunk=bound + 1), harness.runner)
    # a draft model compiled for smaller chunks caps the engine's chunk too
    draft = shutil.copytree(default_model_dir(), tmp_path / "draft")
    m = json.loads((draft / "manifest.json").read_text())
    m["extras"]["max_prefill_chunk"] = 256
    (draft / "manifest.json").write_text(json.dumps(m))
    assert prefill_chunk_for(EngineConfig(draft_model=str(draft)), harness.runner) == 256
    with pytest.raises(ConfigError, match="prefill_chunk"):
        prefill_chunk_for(EngineConfig(prefill_chunk=300, draft_model=str(draft)), harness.runner)
