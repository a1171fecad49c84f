"""The prefill (FlashAttention-2) attend path of the CUDA paged attention (compile/kernels/cuda/attention.py
prefill_source), checked on a machine without a GPU:

* calls with n >= prefill_min tokens launch it (host branch), fewer tokens keep the split attend launch;
* its generated CUDA run on the CPU emulator (ninfer_mlc.compile.kernels.cuda.emulate: fibers per thread;
  shuffles, barriers, ldmatrix, cp.async and mma.m16n8k16 emulated) matches the float64 reference: several
  sequences in one row tile, ragged lengths, chunks appended after existing context, the 27B
  geometry (G = 6, D = 256) and a small one (G = 4, D = 64);
* it compiles for sm_90 without register spills (needs nvcc).
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from ninfer_mlc.compile.kernels.cuda.emulate import EmuLib, cuda_source
from ninfer_mlc.compile.kernels.cuda.emulate import attention as C

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvcc_spills import spill_stores  # noqa: E402


def test_prefill_path_selection():
    from ninfer_mlc.compile.kernels.cuda import attention as A

    assert A.prefill_applies(24, 4, 256, "bfloat16", None)
    assert A.prefill_applies(8, 2, 64, "float16", "float16")
    assert A.prefill_applies(24, 4, 256, "bfloat16", "fp8") and A.prefill_applies(24, 4, 256, "bfloat16", "nvfp4")
    assert not A.prefill_applies(24, 4, 256, "float16", "nvfp4")  # dequantized values need bf16's range
    assert not A.prefill_applies(24, 4, 256, "float32", None)
    assert not A.prefill_applies(4, 2, 32, "bfloat16", None)
    src = A.paged_attention(24, 4, 256, 64, 2, "bfloat16", 1 / 16).script()
    assert "ninfer_attn_prefill_" in src and "shared.dyn" in src
    assert "ninfer_attn_prefill_" not in A.paged_attention(24, 4, 256, 64, 2, "bfloat16", 1 / 16, prefill=False).script()
    assert "ninfer_attn_prefill_" in A.paged_attention(24, 4, 256, 64, 2, "bfloat16", 1 / 16, kv_dtype="fp8").script()
    assert "ninfer_attn_prefill_" not in A.paged_attention(24, 4, 256, 64, 2, "float16", 1 / 16, kv_dtype="fp8").script()
    assert A.attend_splits(64, 8, 4, 64, prefill_min=64) == 1


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_prefill_cuda_source_on_cpu_emulator():
    cases = {m["name"]: m for m in C.all_cases()}
    names = ("emu_bf16_pf", "emu_bf16small_pf", "emu_bf16_prefill")  # the last: n < 64, split path
    lib = EmuLib(C.kernel_funcs(tags={cases[n]["tag"] for n in names}))
    ran = lib.kernel_names("new_bf16")
    assert len(ran) == 4  # append, prefill attend, split attend, combine
    for name in names:
        r = C.emulate_case(cases[name], lib)
        assert r["ok"], (name, r)
        assert r["rel_err"] < 5e-3, (name, r)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_prefill_kernel_compiles_without_spills(tmp_path):
    from ninfer_mlc.compile.kernels.registry import kernel_set

    f = kernel_set("cuda").paged_attention(24, 4, 256, 64, 16, "bfloat16", 1 / 16).with_attr("global_symbol", "attn")
    src, host = cuda_source({"attn": f})
    assert "__launch_bounds__(128, 2) attn_kernel_1(" in src and "ldmatrix.sync.aligned.m8n8.x4.trans" in src
    # the dynamic shared memory of the prefill launch is the whole Q + double-buffered K/V tile
    from ninfer_mlc.compile.kernels.cuda import attention as A

    assert f"T.int64({A.prefill_smem_bytes(256)})" in host
    spills, report = spill_stores(src, tmp_path, "attn_kernel_1")
    assert spills == 0, report
