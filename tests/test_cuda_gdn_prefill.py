"""Tensor-core chunked GDN prefill (compile/kernels/cuda/gdn.py chunked_delta_rule, mma path).

No GPU needed: the generated CUDA is compiled with nvcc (registers, spills, shared memory) and run on
the CPU fiber emulator (ninfer_mlc.compile.kernels.cuda.emulate; warp-collective mma.sync m16n8k8 tf32)."""
from __future__ import annotations

import shutil

import pytest


def test_mma_path_selection():
    """27B geometry takes the tensor-core path by default; geometries it cannot tile keep SIMT."""
    from ninfer_mlc.compile.gpu_pipeline import is_thread_bound
    from ninfer_mlc.compile.kernels.cuda import gdn

    assert gdn.mma_applies(128, 128)
    assert gdn._mma_layout(128, 128, 32, gdn.MMA_TILE) == (32, 32)
    assert not gdn.mma_applies(16, 8)  # tiny test geometry: SIMT launches
    assert not gdn.mma_applies(128, 128, chunk=16)
    with pytest.raises(ValueError):
        gdn.chunked_delta_rule(2, 6, 16, 8, 1, mma=True)
    for kw in ({}, dict(mma=False), dict(tf32x3=False), dict(mma_tile=16)):
        assert is_thread_bound(gdn.chunked_delta_rule(16, 48, 128, 128, 2, **kw))


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_mma_dk128_on_cpu_emulator():
    """dk = dv = 128 (the 27B head) with 6 value heads, default tile 32: ragged rows (empty, length 1,
    partial chunks, several chunks), carried-in state; fp32-level agreement with the llvm kernel."""
    from ninfer_mlc.compile.kernels.cuda.emulate.gdn import run_emulation

    (row,) = run_emulation([dict(geo=(2, 6, 128, 128), lens=[70, 0, 33, 1, 64], decay="mixed", kw={})],
                           log=lambda *_: None)
    assert row["layout"]["mma"] and row["ok"], row


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_short_rows_kernel_on_cpu_emulator():
    """The row-by-row kernel verify / gdn_replay take on CUDA (short_delta_rule): ragged short sequences (empty, one
    row, eight), the tiny and the 27B head geometry, against the llvm chunked kernel at fp32 level; other slots
    untouched."""
    from ninfer_mlc.compile.kernels.cuda.emulate.gdn import run_short_emulation

    rows = run_short_emulation(log=lambda *_: None)
    assert len(rows) == 2 and all(r["ok"] for r in rows), rows
