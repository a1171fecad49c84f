"""CUDA builds on a machine without a GPU (CPU-only checks).

* the CUDA kernel set has exactly the llvm set's prim_func signatures and buffer contracts;
* the hand-written kernels are thread-bound (the pipeline leaves them to themselves);
* the tiny model builds for cuda:sm_90 and the library holds a fatbin, not CUDA source
  (skipped without nvcc). Libraries are cached in NINFER_LIB_CACHE (tests/conftest.py).
"""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ninfer_mlc.compile.kernels.registry import kernel_set  # noqa: E402

FATBIN_MAGIC = b"\x50\xed\x55\xba"  # 0xBA55ED50, little endian

GEOMETRIES = [
    # paged_attention(hq, hkv, d, page, layers, dtype, scale), conv(dim, K, layers, dtype),
    # gdn(hk, hv, dk, dv, layers)
    dict(attn=(4, 2, 32), conv=96, gdn=(2, 6, 16, 8), dtype="float32"),
    dict(attn=(24, 4, 256), conv=10240, gdn=(16, 48, 128, 128), dtype="bfloat16"),
]


def _contract(func) -> list[str]:
    """Parameter names and every match_buffer (shape, dtype) of a prim_func, as printed."""
    text = func.script()
    head = re.search(r"def \w+\((.*?)\):", text, re.S).group(1)
    params = [p.split(":")[0].strip() for p in head.split(",") if p.strip()]
    bufs = re.findall(r"= T\.match_buffer\((.*?)\)\n", text)
    return params + sorted(bufs)


@pytest.mark.parametrize("geo", GEOMETRIES, ids=["tiny", "27b"])
def test_cuda_kernels_match_llvm_contract(geo):
    cuda, llvm = kernel_set("cuda"), kernel_set("llvm")
    hq, hkv, d = geo["attn"]
    dt = geo["dtype"]
    pairs = [
        (cuda.paged_attention(hq, hkv, d, 64, 3, dt, d ** -0.5), llvm.paged_attention(hq, hkv, d, 64, 3, dt, d ** -0.5)),
        (cuda.causal_conv(geo["conv"], 4, 5, dt), llvm.causal_conv(geo["conv"], 4, 5, dt)),
        (cuda.chunked_delta_rule(*geo["gdn"], 5), llvm.chunked_delta_rule(*geo["gdn"], 5)),
        (cuda.recurrent_delta_rule(*geo["gdn"], 5), llvm.recurrent_delta_rule(*geo["gdn"], 5)),
    ]
    for c, ref in pairs:
        assert _contract(c) == _contract(ref)


def test_cuda_kernels_are_thread_bound():
    from ninfer_mlc.compile.gpu_pipeline import is_thread_bound

    cuda, llvm = kernel_set("cuda"), kernel_set("llvm")
    assert is_thread_bound(cuda.paged_attention(4, 2, 32, 64, 1, "float32", 0.1))
    assert is_thread_bound(cuda.causal_conv(96, 4, 1, "float32"))
    assert is_thread_bound(cuda.chunked_delta_rule(2, 6, 16, 8, 1))
    assert is_thread_bound(cuda.recurrent_delta_rule(2, 6, 16, 8, 1))
    assert not is_thread_bound(llvm.recurrent_delta_rule(2, 6, 16, 8, 1))


def test_schedule_files_are_read():
    from tvm.target import Target

    from ninfer_mlc.compile.gpu_pipeline import schedule_for
    from ninfer_mlc.compile.kernels.cuda.registry import kernel_params

    for arch in ("sm_90", "sm_120"):
        s = schedule_for(Target({"kind": "cuda", "arch": arch}))
        assert s["_file"] and s["_file"].endswith(f"cuda_{arch}.json")
        assert "Matmul" in s["dlight"]["rules"] and s["dlight"]["rules"][-1] == "Fallback"
        assert kernel_params(arch)["paged_attention"]["threads"] % 32 == 0


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("gcc") is None, reason="needs nvcc and gcc")
def test_tiny_model_builds_for_sm90_as_fatbin(tmp_path):
    from hf_tiny import GEOMETRY

    from ninfer_mlc.compile.build import build_library
    from ninfer_mlc.compile.config import parse_config
    from ninfer_mlc.compile.targets import parse_target

    raw = dict(GEOMETRY, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text",
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    cfg = parse_config(raw)
    lib = tmp_path / "tiny_sm90.so"
    specs = build_library(cfg, "bfloat16", parse_target("cuda:sm_90"), lib)
    assert specs and lib.stat().st_size > 0
    data = lib.read_bytes()
    assert FATBIN_MAGIC in data, "no fatbin in the library: CUDA code was not compiled"
    for marker in (b"__global__", b'extern "C" __global__', b"#include <cuda"):
        assert marker not in data, f"raw CUDA source left in the library ({marker!r})"


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("gcc") is None, reason="needs nvcc and gcc")
@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8"])
def test_tiny_model_builds_for_sm90_with_quantized_kv(tmp_path, kv_dtype):
    """`ninfer compile --target cuda:sm_90 --quant bf16 --kv-dtype fp8|nvfp4` builds (fatbin, uint8 pool
    rows of the llvm layout); the CUDA quantized attention keeps the llvm kernel's contract."""
    import json

    from hf_tiny import GEOMETRY

    from ninfer_mlc.compile.build import compile_model
    from ninfer_mlc.compile.kernels.attention_quant import kv_pool_layout

    cuda, llvm = kernel_set("cuda", kv_dtype), kernel_set("llvm", kv_dtype)
    for args in ((4, 2, 32, 64, 3, "float32", 0.1), (24, 4, 256, 64, 3, "bfloat16", 1 / 16)):
        assert _contract(cuda.paged_attention(*args)) == _contract(llvm.paged_attention(*args))
    from ninfer_mlc.compile.gpu_pipeline import is_thread_bound

    assert is_thread_bound(cuda.paged_attention(4, 2, 32, 64, 1, "bfloat16", 0.1))

    torch = pytest.importorskip("torch")  # noqa: F841
    from hf_tiny import make_hf_model, save_hf

    hf_dir = save_hf(make_hf_model("qwen3_5", seed=3), tmp_path / "hf")
    art = compile_model(hf_dir, target="cuda:sm_90", quant="bf16", kv_dtype=kv_dtype, out_dir=tmp_path / "art",
                        name=f"tiny-{kv_dtype}", log=lambda *_: None)
    m = json.loads((art / "manifest.json").read_text())
    assert m["kv_dtype"] == kv_dtype and m["target"] == "cuda-sm_90"
    assert kv_pool_layout(kv_dtype, GEOMETRY["head_dim"])[0] == "uint8"
    data = (art / m["library"]).read_bytes()
    assert FATBIN_MAGIC in data, "no fatbin in the library: CUDA code was not compiled"
    assert b"__global__" not in data
