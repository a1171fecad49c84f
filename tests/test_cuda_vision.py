"""The vision tower's CUDA attention (compile/kernels/cuda/vision_attention.py) without a GPU: its generated
CUDA run on the CPU emulator (compile/kernels/cuda/emulate) against a float64 per-image softmax attention
(three images whose patches straddle the 64-patch query tiles), and the 27B geometry (16 heads x 72)
compiled for sm_90 without register spills (needs nvcc)."""
from __future__ import annotations

import re
import shutil
import subprocess

import ml_dtypes
import numpy as np
import pytest

from ninfer_mlc.compile.kernels.cuda.emulate import EmuLib, cuda_source
from ninfer_mlc.compile.kernels.cuda.vision_attention import vit_attention


def _reference(q, k, v, cu):
    ref = np.zeros(q.shape)
    d = q.shape[-1]
    for a, b in zip(cu[:-1], cu[1:]):
        for h in range(q.shape[1]):
            s = q[a:b, h].astype(np.float64) @ k[a:b, h].astype(np.float64).T / np.sqrt(d)
            p = np.exp(s - s.max(1, keepdims=True))
            ref[a:b, h] = (p / p.sum(1, keepdims=True)) @ v[a:b, h].astype(np.float64)
    return ref


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 8e-3)])
def test_vit_attention_cuda_source_on_cpu_emulator(dtype, tol):
    heads, dim, lens = 2, 16, [40, 70, 30]
    lib = EmuLib({"vit": vit_attention(heads, dim, dtype).with_attr("global_symbol", "vit")})
    n = sum(lens)
    cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    seg = np.repeat(np.arange(len(lens)), lens).astype(np.int32)
    npdt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((n, heads, dim)).astype(npdt) for _ in range(3))
    out = np.full((n, heads, dim), np.nan, np.float32).astype(npdt)
    lib("vit", dict(q=q, k=k, v=v, cu=cu, seg=seg, out=out), dict(n=n, s1=len(cu)))
    ref = _reference(q, k, v, cu)
    assert np.abs(out.astype(np.float64) - ref).max() / np.abs(ref).max() < tol


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_vit_attention_27b_geometry_compiles_without_spills(tmp_path):
    src, _ = cuda_source({"vit": vit_attention(16, 72, "bfloat16").with_attr("global_symbol", "vit")})
    (tmp_path / "vit.cu").write_text(src)
    r = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "--use_fast_math", "--ptxas-options=-v",
                        str(tmp_path / "vit.cu"), "-o", str(tmp_path / "vit.cubin")], capture_output=True, text=True,
                       check=True)
    m = re.search(r"Function properties for vit_kernel\w*\n\s*(\d+) bytes stack frame, (\d+) bytes spill stores",
                  r.stderr)
    assert m and m.group(2) == "0", r.stderr
