"""CUDA builds on a machine without a GPU (CPU-only checks).

* the CUDA kernel set has exactly the llvm set's prim_func signatures and buffer contracts;
* the hand-written kernels are thread-bound (the pipeline leaves them to themselves);
* the tiny model builds for cuda:sm_90 and the library holds a fatbin, not CUDA source
  (skipped without nvcc). Libraries are cached in NINFER_LIB_CACHE (tests/conftest.py).
"""
from __future__ import annotations

import contextlib
import json
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


def test_fused_launches_can_be_turned_off_by_the_schedule(tmp_path, monkeypatch):
    """schedule "kernels.fused": false builds the unfused sequences (before/after measurements, an off switch)."""
    from ninfer_mlc.compile.kernels.cuda.registry import kernel_set

    on = kernel_set(None, "sm_90")
    assert on.gdn_decode_conv is not None and on.verify_attention(24, 4, 256, 64, 16, "bfloat16", 0.0625) is not None
    (tmp_path / "cuda_sm_90.json").write_text(json.dumps(
        {"kernels": {"fused": {"verify_attention": False, "gdn_decode_conv": False, "qk_norm_rope": False,
                               "norm_gemv": False}}}))
    monkeypatch.setenv("NINFER_SCHEDULE_DIR", str(tmp_path))
    off = kernel_set(None, "sm_90")
    assert off.gdn_decode_conv is None and off.verify_attention(24, 4, 256, 64, 16, "bfloat16", 0.0625) is None
    assert off.qk_norm_rope is None and on.qk_norm_rope is not None
    assert off.gemv_norm is None and on.gemv_norm is None  # norm_gemv: off unless a schedule turns it on
    (tmp_path / "cuda_sm_90.json").write_text(json.dumps({"kernels": {"fused": {"norm_gemv": True}}}))
    folded = kernel_set(None, "sm_90").gemv_norm
    assert folded(5120, 34816, "bfloat16", "bfloat16", "silu_mul", norm_eps=1e-6)
    assert folded(2048, 12288, "bfloat16", "bfloat16", "none", norm_eps=1e-6) is None  # below norm_gemv.min_k
    (tmp_path / "cuda_sm_90.json").write_text(json.dumps({"kernels": {"fused": {"norm_gemv": True},
                                                                      "norm_gemv": {"min_k": 0}}}))
    assert kernel_set(None, "sm_90").gemv_norm(2048, 12288, "bfloat16", "bfloat16", "none", norm_eps=1e-6)
    assert off.gdn_decode is not None  # the unfused decode step stays


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
    for kernel in (b"sampler_process_kernel", b"sampler_select_kernel", b"sampler_logprobs_kernel"):
        assert kernel in data, f"the device sampler is missing from the library ({kernel!r})"


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("gcc") is None, reason="needs nvcc and gcc")
@pytest.mark.parametrize("quant,kv_dtype", [("bf16", "fp8"), ("nvfp4", "nvfp4")], ids=["bf16-fp8kv", "nvfp4-nvfp4kv"])
def test_tiny_model_builds_for_sm90_with_quantized_kv(tmp_path, quant, kv_dtype):
    """`ninfer compile --target cuda:sm_90 --quant bf16|nvfp4 --kv-dtype fp8|nvfp4` builds (fatbin, uint8 pool
    rows of the llvm layout); the CUDA quantized attention keeps the llvm kernel's contract. With NVFP4
    weights (one build for both NVFP4 formats) the decode GEMVs over the NVFP4 buffers and the prefill
    projections' dequant are thread-bound kernels of the library."""
    import json

    from hf_tiny import GEOMETRY

    from ninfer_mlc.compile.build import compile_model
    from ninfer_mlc.compile.gpu_pipeline import is_thread_bound, last_report
    from ninfer_mlc.contract.pool_layout import kv_row

    cuda, llvm = kernel_set("cuda", kv_dtype), kernel_set("llvm", kv_dtype)
    for args in ((4, 2, 32, 64, 3, "float32", 0.1), (24, 4, 256, 64, 3, "bfloat16", 1 / 16)):
        assert _contract(cuda.paged_attention(*args)) == _contract(llvm.paged_attention(*args))
    assert is_thread_bound(cuda.paged_attention(4, 2, 32, 64, 1, "bfloat16", 0.1))

    torch = pytest.importorskip("torch")  # noqa: F841
    from hf_tiny import make_hf_model, save_hf

    hf_dir = save_hf(make_hf_model("qwen3_5", seed=3), tmp_path / "hf")
    art = compile_model(hf_dir, target="cuda:sm_90", quant=quant, kv_dtype=kv_dtype, out_dir=tmp_path / "art",
                        name=f"tiny-{quant}-{kv_dtype}", log=lambda *_: None)
    m = json.loads((art / "manifest.json").read_text())
    assert m["kv_dtype"] == kv_dtype and m["target"] == "cuda-sm_90"
    assert m["extras"]["grid_dependency_wait"] is True  # every kernel waits for its predecessor: PDL edges allowed
    assert kv_row(kv_dtype, GEOMETRY["head_dim"])[0] == "uint8"
    data = (art / m["library"]).read_bytes()
    assert FATBIN_MAGIC in data, "no fatbin in the library: CUDA code was not compiled"
    assert b"__global__" not in data
    if quant == "nvfp4":
        assert m["extras"]["fp4_mma"] is False and m["extras"]["weight_quant"] == "nvfp4"
        report = last_report()
        if report:  # empty when the library came from the test cache
            nv = {k: v for k, v in report.items() if k.startswith("gemv_nvfp4")}
            assert nv and set(nv.values()) == {"thread-bound"}, report
            # prefill projections: the copy-rate dequant kernel, no tensor-expression dequant left to DLight
            dq = {k: v for k, v in report.items() if k.startswith("dequant_nvfp4")}
            assert dq and all(re.fullmatch(r"dequant_nvfp4_\d+x\d+_bf16", k) for k in dq), report
            assert set(dq.values()) == {"thread-bound"}, report


# ---- decode GEMV (compile/kernels/cuda/gemv.py) ---------------------------------------------------
def test_gemv_kernel_set_and_contract():
    """CUDA set: gemv factory (thread-bound, x/w[/res]/out contract, None where it does not apply);
    llvm set: gemv=None, so llvm builds keep their relax matmuls."""
    from ninfer_mlc.compile.gpu_pipeline import is_thread_bound

    assert kernel_set("llvm").gemv is None
    g = kernel_set("cuda").gemv
    f = g(5120, 34816, "bfloat16", "bfloat16", "silu_mul")
    assert is_thread_bound(f)

    def bufs(func):
        return [(str(list(p.shape)), str(p.dtype)) for p in func.params]

    assert bufs(f) == [("[n, 5120]", "bfloat16"), ("[34816, 5120]", "bfloat16"), ("[n, 17408]", "bfloat16")]
    r = g(100, 50, "bfloat16", "bfloat16", "residual")  # K % 8 != 0: FMA path
    assert is_thread_bound(r) and len(bufs(r)) == 4 and bufs(r)[2] == ("[n, 50]", "bfloat16")
    assert bufs(g(5120, 248320, "bfloat16", "float32"))[-1] == ("[n, 248320]", "float32")
    assert is_thread_bound(g(64, 96, "float32", "float32", "none"))
    assert g(64, 95, "bfloat16", "bfloat16", "silu_mul") is None
    assert g(64, 96, "bfloat16", "float32", "residual") is None


def test_gemv_only_in_decode_functions():
    """decode / mtp_step / verify (few rows) route projections through gemv on CUDA, prefill / prefill_h /
    mtp_prefill through the sm_90 prefill GEMM (same epilogues); every other function, every llvm function
    and the sm_120 prefill functions are unchanged."""
    import tvm
    from tvm.target import Target

    from ninfer_mlc.compile import tiny_default
    from ninfer_mlc.compile.config import parse_config
    from ninfer_mlc.compile.model import Qwen3xForCausalLM

    cfg = parse_config(tiny_default.CONFIG)

    def export(kind, gemv=True, arch="sm_90"):
        with Target({"kind": "cuda", "arch": arch}) if kind == "cuda" else contextlib.nullcontext():
            m = Qwen3xForCausalLM(cfg, "bfloat16", kind, None, mtp=True)
        if not gemv:
            m._gemv_factory = m._gemm_factory = None
        return m.export_tvm(spec=m.export_spec())[0]

    with_gemv, without = export("cuda"), export("cuda", gemv=False)
    for gv, f in with_gemv.functions_items():
        if not isinstance(f, tvm.relax.Function):
            continue
        calls = set(re.findall(r"call_tir\((?:cls\.)?(gemv\w*)", f.script()))
        gemm = set(re.findall(r"call_tir\((?:cls\.)?(gemm\w*)", f.script()))
        if gv.name_hint in ("decode", "mtp_step", "verify", "mtp_step_hd"):
            assert any("silu_mul" in c for c in calls) and any("residual" in c for c in calls), gv.name_hint
            assert any(c.endswith(("_f32", "_f32_rms")) for c in calls), "lm_head with fp32 logits"
            # kernels.fused.norm_gemv is off by default: the norms stay their own launches everywhere
            norms = re.findall(r"call_tir\((?:cls\.)?(rms_norm_\w*)", f.script())
            assert norms and not {c for c in calls if c.endswith("_rms")}, gv.name_hint
            assert not gemm, gv.name_hint
            assert any(c.startswith("gemv_rows") for c in calls) == (gv.name_hint == "mtp_step_hd"), gv.name_hint
        elif gv.name_hint == "mtp_prefill_hd":  # prefill GEMMs, the shortlisted head through gemv_rows
            assert calls and all(c.startswith("gemv_rows") for c in calls), calls
            assert any("silu_mul" in c for c in gemm) and any("residual" in c for c in gemm), gemm
        elif gv.name_hint in ("prefill", "prefill_h", "mtp_prefill"):
            assert not calls, gv.name_hint
            assert any("silu_mul" in c for c in gemm) and any("residual" in c for c in gemm), gv.name_hint
            assert any(c.endswith("_f32") for c in gemm), "lm_head with fp32 logits"
        else:
            assert not calls and not gemm, gv.name_hint
            tvm.ir.assert_structural_equal(f, without[gv.name_hint], map_free_vars=True)
    sm120 = export("cuda", arch="sm_120")
    for gv, f in sm120.functions_items():
        if isinstance(f, tvm.relax.Function):
            assert "call_tir(cls.gemm" not in f.script() and "gemm_" not in f.script(), gv.name_hint
    llvm = export("llvm")
    assert not [gv for gv, _ in llvm.functions_items() if "gemv" in gv.name_hint]


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_gemv_cuda_source_on_cpu_emulator():
    """The generated CUDA of the gemv kernels, run on the CPU emulator (a fiber per CUDA thread, mma.sync /
    shuffles emulated from the PTX fragment layouts), n on both sides of the host's n <= 8 launch branch."""
    from ninfer_mlc.compile.kernels.cuda.emulate.gemv import run_emulation

    rows = run_emulation(quick=True, log=lambda *_: None)
    bad = [r for r in rows if not r["ok"]]
    assert rows and not bad, bad


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_gemv_norm_cuda_source_on_cpu_emulator():
    """gemv(..., norm_eps): the RMSNorm folded into the GEMV, on the CPU emulator: rows of sizes 1e-2..1e2 (the norm
    is per batch row), every epilogue and fp32 out, one warp / several warps splitting K, n on both sides of the
    n <= 8 launch branch; equal to the fused roundings (bf16(x * g), sums / rms) within the output rounding, and to
    rms_norm + gemv within twice that."""
    from ninfer_mlc.compile.kernels.cuda.emulate.gemv import EMU_NORM_CASES, EMU_NORM_NS, run_norm_emulation

    rows = run_norm_emulation(log=lambda *_: None)
    bad = [r for r in rows if not r["ok"]]
    assert len(rows) == len(EMU_NORM_CASES) * len(EMU_NORM_NS) and not bad, bad


def test_gemv_norm_contract():
    """gemv_norm applies to bf16 dense weights on the tensor-core path only (x, g, w, [res], out); None elsewhere
    (the model then keeps the norm launch); the llvm set has none."""
    from ninfer_mlc.compile.kernels.cuda.emulate.gemv import default_params
    from ninfer_mlc.compile.kernels.cuda import gemv as G
    from ninfer_mlc.compile.kernels.registry import kernel_set

    f = G.gemv(5120, 248320, "bfloat16", "float32", "none", **default_params(), norm_eps=1e-6)
    assert [str(p.name) for p in f.params] == ["x", "g", "w", "out"]
    assert 'g: T.Buffer((5120,), "float32")' in f.script() and str(f.attrs["global_symbol"]).endswith("_f32_rms")
    r = G.gemv(768, 32, "bfloat16", "bfloat16", "residual", **default_params(), norm_eps=1e-6)
    assert len(r.params) == 5
    assert G.gemv(256, 48, "float16", "float16", "none", norm_eps=1e-6) is None
    assert G.gemv(256, 48, "float32", "float32", "none", norm_eps=1e-6) is None
    assert G.gemv(100, 48, "bfloat16", "bfloat16", "none", norm_eps=1e-6) is None  # K % 8: FMA path
    assert G.gemv(256, 48, "bfloat16", "bfloat16", "none", weight_format="nvfp4", norm_eps=1e-6) is None
    assert G.gemv(2048, 48, "bfloat16", "bfloat16", "none", norm_eps=1e-6, norm_min_k=4096) is None
    assert kernel_set("llvm").gemv_norm is None  # outside llvm_norm_gemv_scope (tests/test_norm_gemv_llvm.py)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_gemv_rows_cuda_source_on_cpu_emulator():
    """gemv_rows (weight rows known at run time: the shortlisted MTP head) on the CPU emulator: m not a multiple
    of the 16-row tile, fewer rows than a tile, n on both sides of the n <= 8 launch branch, K split over warps."""
    from ninfer_mlc.compile.kernels.cuda.emulate.gemv import run_rows_emulation

    rows = run_rows_emulation(log=lambda *_: None)
    bad = [r for r in rows if not r["ok"]]
    assert len(rows) == 12 and not bad, bad


def test_gemv_rows_contract():
    """gemv_rows: x[n, K], w[m, K], out[n, m] with m symbolic, thread-bound; None where the tensor-core path does
    not apply (fp32, K % 8), so the model keeps its matmul; the llvm set has none."""
    from ninfer_mlc.compile.gpu_pipeline import is_thread_bound

    assert kernel_set("llvm").gemv_rows is None
    g = kernel_set("cuda").gemv_rows
    f = g(5120, "bfloat16", "float32")
    assert is_thread_bound(f)
    assert [(str(list(p.shape)), str(p.dtype)) for p in f.params] == \
        [("[n, 5120]", "bfloat16"), ("[m, 5120]", "bfloat16"), ("[n, m]", "float32")]
    assert g(5120, "float32", "float32") is None and g(100, "bfloat16", "float32") is None


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_dequant_nvfp4_cuda_source_on_cpu_emulator():
    """The sm_90 prefill dequant (compile/kernels/cuda/dequant_nvfp4.py) on the CPU emulator gives dequant.py's
    weights bit for bit (every code, E4M3 subnormal / large / zero scales, -0 included): the last block partly
    empty, K % 32 != 0, f16 activations. f32 models keep the tensor expression (None)."""
    import numpy as np

    from ninfer_mlc.compile.kernels.cuda.dequant_nvfp4 import dequant_nvfp4
    from ninfer_mlc.compile.kernels.cuda.emulate import EmuLib
    from ninfer_mlc.compile.kernels.cuda.emulate.gemv import np_dtype, nvfp4_dequant, nvfp4_weights

    cases = [(256, 48, "bfloat16"), (48, 40, "float16"), (2048, 73, "bfloat16")]  # 18 full blocks + a part
    funcs = {dequant_nvfp4(k, o, dt).attrs["global_symbol"]: dequant_nvfp4(k, o, dt) for k, o, dt in cases}
    lib = EmuLib(funcs)
    for (k, o, dt), name in zip(cases, funcs, strict=True):
        codes, scales, g = nvfp4_weights(np.random.default_rng(k), o, k)
        out = np.full((o, k), np.nan, np.float32).astype(np_dtype(dt))
        lib(name, {"w": codes, "ws": scales, "ws2": g, "out": out})
        ref = nvfp4_dequant(codes, scales, g).astype(np_dtype(dt))
        assert np.signbit(ref).any() and (ref == 0).any()
        np.testing.assert_array_equal(out.view(np.uint16), ref.view(np.uint16), err_msg=name)
    assert dequant_nvfp4(256, 48, "float32") is None and dequant_nvfp4(40, 48, "bfloat16") is None


# ---- chunked GDN prefill (compile/kernels/cuda/gdn.py chunked_delta_rule) -------------------------
def test_gdn_chunk_layout():
    """27B geometry: chunk 32, 8 lanes x 16 state rows per value column, 16 columns per block of the
    sequential pass, 256 threads in the parallel pass; chunk 64 does not fit 48 KiB and falls back."""
    from ninfer_mlc.compile.gpu_pipeline import is_thread_bound
    from ninfer_mlc.compile.kernels.cuda import gdn

    assert gdn._chunk_layout(128, 128, 32, 16, 16) == (32, 16, 8, 16, 256)
    assert gdn._chunk_layout(128, 128, 64, 16, 16)[0] == 32
    assert gdn._chunk_layout(16, 8, 32, 16, 16) == (32, 16, 1, 8, 32)
    # the registry's knobs (chunk, dv_tile) are still accepted
    assert is_thread_bound(gdn.chunked_delta_rule(16, 48, 128, 128, 2, 32, dv_tile=64))


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("gcc") is None, reason="needs nvcc and gcc")
@pytest.mark.parametrize("arch,kw", [("sm_90", {}), ("sm_90", dict(mma_tile=16, tf32x3=False)), ("sm_120", {})],
                         ids=["sm_90", "sm_90-tile16-tf32", "sm_120"])
def test_gdn_chunk_27b_compiles(tmp_path, arch, kw):
    """Both launches of the 27B gdn_chunk (tensor-core path: mma.sync tf32) compile to a fatbin; on sm_90
    ptxas reports no spills and static shared memory within 48 KiB, also for the other value tile and
    the single-tf32 products."""
    import subprocess

    import tvm

    from ninfer_mlc.compile.kernels.cuda import gdn
    from ninfer_mlc.compile.targets import cuda_build_env, parse_target

    f = (gdn.chunked_delta_rule(16, 48, 128, 128, 48, **kw) if kw else
         kernel_set("cuda").chunked_delta_rule(16, 48, 128, 128, 48)).with_attr("global_symbol", "gdn_chunk")
    tgt = parse_target("cuda:" + arch).tvm_target()
    with cuda_build_env(tgt):
        ex = tvm.compile(tvm.IRModule({"gdn_chunk": f}), target=tgt)
    ex.export_library(str(tmp_path / "gdn.so"))
    assert FATBIN_MAGIC in (tmp_path / "gdn.so").read_bytes()
    src = ex.mod.imports[0].inspect_source("cuda")
    assert re.findall(r'__global__ void __launch_bounds__\((\d+)\) gdn_chunk_kernel\w*\(', src)[:2] == ["256", "128"]
    assert "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32" in src
    if arch == "sm_90":
        (tmp_path / "gdn.cu").write_text(src)
        r = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "--use_fast_math", "-Xptxas", "-v",
                            str(tmp_path / "gdn.cu"), "-o", str(tmp_path / "gdn.cubin")],
                           capture_output=True, text=True, check=True)
        assert re.findall(r"(\d+) bytes spill stores", r.stderr) == ["0", "0"], r.stderr
        assert all(int(x) <= 48 * 1024 for x in re.findall(r"(\d+) bytes smem", r.stderr)), r.stderr


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_gdn_chunk_cuda_source_on_cpu_emulator():
    """The generated CUDA of gdn_chunk run on the CPU emulator (a fiber per CUDA thread, barriers,
    xor-shuffles and mma.sync tf32 emulated) matches the llvm kernel on ragged rows (empty, length 1,
    partial chunks) with 1, 4 and 8 lanes per state column and the tensor-core launches."""
    from ninfer_mlc.compile.kernels.cuda.emulate.gdn import run_emulation

    rows = run_emulation(quick=True, log=lambda *_: None)
    bad = [r for r in rows if not r["ok"]]
    assert rows and not bad, bad


def test_attention_reference_matches_llvm_kernel():
    """The attention checks' float64 reference and page-byte expectations (what the emulator and the GPU
    run of bench/attn_gpu_check.py check the CUDA attention against) agree with the llvm kernel: plain,
    fp8 and nvfp4 pages."""
    from ninfer_mlc.compile.kernels.cuda.emulate import attention as C

    cases = {m["name"]: m for m in C.all_cases()}
    for name in ("f32tiny_mixed", "emu_bf16_prefill", "emu_fp8_dec", "emu_nvfp4tiny"):
        r = C.llvm_case(cases[name])
        assert r["ok"], (name, r)


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_attention_cuda_source_on_cpu_emulator():
    """The generated CUDA of the paged attention (tensor-core split path for bf16, fp8 and nvfp4 pages,
    SIMT path for f32 and small quantized geometries; the prefill launch over fp8 / nvfp4 pages) run on the
    CPU emulator (fibers per thread; shuffles, barriers and mma.m16n8k16 emulated) matches the float64
    reference; appended page bytes are exact."""
    from ninfer_mlc.compile.kernels.cuda.emulate import EmuLib
    from ninfer_mlc.compile.kernels.cuda.emulate import attention as C

    cases = {m["name"]: m for m in C.all_cases()}
    names = ("emu_bf16_dec", "emu_bf16_prefill", "f32tiny_mixed", "emu_fp8_dec", "emu_nvfp4_dec", "emu_fp8_pf",
             "emu_nvfp4_pf", "emu_fp8tiny", "emu_nvfp4tiny")  # the last two: quantized pages on the SIMT path
    lib = EmuLib(C.kernel_funcs(tags={cases[n]["tag"] for n in names}))
    for name in names:
        r = C.emulate_case(cases[name], lib)
        assert r["ok"], (name, r)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_attention_kernels_compile_without_spills(tmp_path):
    """27B geometry: the bf16 attend kernel takes the tensor-core path with __launch_bounds__(128, 2);
    bf16 / fp8 / nvfp4 kernels (each with its prefill attend launch: 4 kernels) compile for sm_90 without
    register spills; the fp8 / nvfp4 split attends run f16 mma on converted / dequantized fragments. One
    nvcc per page format, run concurrently (nvcc uses one core; the fp8 and nvfp4 kernels take ~30 s each)."""
    import subprocess

    from ninfer_mlc.compile.kernels.cuda.emulate import cuda_source

    srcs = {}
    for kv in (None, "fp8", "nvfp4"):
        name = f"attn_{kv or 'bf16'}"
        f = kernel_set("cuda", kv).paged_attention(24, 4, 256, 64, 16, "bfloat16", 1 / 16)
        srcs[name] = cuda_source({name: f.with_attr("global_symbol", name)})[0]
    assert "__launch_bounds__(128, 2) attn_bf16_kernel_1(" in srcs["attn_bf16"]
    assert "mma.sync.aligned.m16n8k16" in srcs["attn_bf16"]
    assert "ninfer_attn_nvfp4_f16x8(" in srcs["attn_nvfp4"].split("attn_nvfp4_kernel_2(")[-1]
    assert "ninfer_attn_e4m3x2_f16x2(" in srcs["attn_fp8"].split("attn_fp8_kernel_2(")[-1].split("attn_fp8_kernel_3(")[0]
    procs = []
    for name, src in srcs.items():
        (tmp_path / f"{name}.cu").write_text(src)
        procs.append(subprocess.Popen(["nvcc", "-cubin", "-arch=sm_90", "-O3", "--use_fast_math",  # TVM's nvcc flags
                                       "--ptxas-options=-v,--register-usage-level=10", str(tmp_path / f"{name}.cu"),
                                       "-o", str(tmp_path / f"{name}.cubin")], stderr=subprocess.PIPE, text=True))
    report = ""
    for p in procs:
        err = p.communicate()[1]
        assert p.returncode == 0, err
        report += err
    spills = re.findall(r"(\d+) bytes spill stores", report)
    assert len(spills) == 12 and set(spills) == {"0"}, report


# ---- NVFP4 decode GEMV (compile/kernels/cuda/gemv.py gemv_nvfp4) ----------------------------------
def test_gemv_nvfp4_kernel_set_and_contract():
    """gemv(..., weight_format="nvfp4"): thread-bound, NVFP4Linear's buffers (x, codes, block scales,
    row scales[, res], out), tensor-core path for bf16 with K % 32 == 0, FMA path otherwise, None where it
    does not apply; the bf16 kernels keep their names."""
    from ninfer_mlc.compile.gpu_pipeline import is_thread_bound
    from ninfer_mlc.compile.kernels.cuda import gemv as G

    g = kernel_set("cuda").gemv

    def bufs(func):
        return [(str(list(p.ty.shape)), str(p.dtype)) for p in func.params]

    f = g(5120, 34816, "bfloat16", "bfloat16", "silu_mul", weight_format="nvfp4")
    assert is_thread_bound(f) and f.attrs["global_symbol"] == "gemv_nvfp4_silu_mul_5120x34816_bf16"
    assert bufs(f) == [("[n, 5120]", "bfloat16"), ("[34816, 2560]", "uint8"), ("[34816, 320]", "uint8"),
                       ("[34816]", "float32"), ("[n, 17408]", "bfloat16")]
    assert G.NVFP4_DQ_FUNC in f.script() and "ninfer_gemv_mma_bf16" in f.script()
    r = g(17408, 5120, "bfloat16", "bfloat16", "residual", weight_format="nvfp4")
    assert bufs(r)[4] == ("[n, 5120]", "bfloat16") and len(bufs(r)) == 6
    fma = g(48, 40, "bfloat16", "bfloat16", "residual", weight_format="nvfp4")  # K % 32 != 0
    assert is_thread_bound(fma) and G.NVFP4_DQ_FUNC not in fma.script()
    assert is_thread_bound(g(64, 96, "float32", "float32", "silu_mul", weight_format="nvfp4"))
    assert g(40, 96, "bfloat16", "bfloat16", weight_format="nvfp4") is None  # K % 16 != 0
    assert g(64, 95, "bfloat16", "bfloat16", "silu_mul", weight_format="nvfp4") is None
    assert g(64, 96, "bfloat16", "bfloat16", weight_format="int4") is None
    assert g(5120, 14336, "bfloat16").attrs["global_symbol"] == "gemv_5120x14336_bf16"


def _dequant_names(f, one):
    """f with its calls of the tensor-expression dequants (dequant_nvfp4, dequant_nvfp41, ...) all to GlobalVar
    `one`: the numbering depends on which functions of the module used them first."""
    from tvm import relax

    @relax.expr_functor.mutator
    class Rename(relax.PyExprMutator):
        def visit_global_var_(self, op):
            return one if re.fullmatch(r"dequant_nvfp4\d*", op.name_hint) else op

    return Rename().visit_expr(f)


def test_nvfp4_decode_functions_use_gemv():
    """--quant nvfp4 on CUDA: decode / mtp_step run every NVFP4 projection through gemv_nvfp4 (plain,
    residual and silu_mul fused) and dequantize nothing; prefill / prefill_h / mtp_prefill dequantize each
    NVFP4 weight once into the sm_90 prefill GEMM (fused epilogues); every other function is unchanged."""
    import tvm

    from ninfer_mlc.compile import tiny_default
    from ninfer_mlc.compile.config import parse_config
    from ninfer_mlc.compile.model import Qwen3xForCausalLM

    cfg = parse_config(tiny_default.CONFIG)

    def export(kind, gemv=True):
        m = Qwen3xForCausalLM(cfg, "bfloat16", kind, None, mtp=True, weight_quant="nvfp4")
        if not gemv:
            m._gemv_factory = m._gemm_factory = None
        return m.export_tvm(spec=m.export_spec())[0]

    with_gemv, without = export("cuda"), export("cuda", gemv=False)
    for gv, f in with_gemv.functions_items():
        if not isinstance(f, tvm.relax.Function):
            continue
        calls = set(re.findall(r"call_tir\((?:cls\.)?(\w+)", f.script()))
        if gv.name_hint in ("decode", "mtp_step", "verify", "mtp_step_hd"):
            assert not [c for c in calls if "dequant" in c], gv.name_hint
            nv = [c for c in calls if c.startswith("gemv_nvfp4")]
            assert any("silu_mul" in c for c in nv) and any("residual" in c for c in nv), (gv.name_hint, nv)
            assert any("silu_mul" not in c and "residual" not in c for c in nv), (gv.name_hint, nv)
        elif gv.name_hint in ("prefill", "prefill_h", "mtp_prefill", "mtp_prefill_hd"):
            gm = [c for c in calls if c.startswith("gemm_")]
            dq = [c for c in calls if c.startswith("dequant_nvfp4")]  # the hand-written kernel, no tensor expression
            assert dq and all(re.fullmatch(r"dequant_nvfp4_\d+x\d+_bf16", c) for c in dq), (gv.name_hint, dq)
            # the shortlisted head (bf16 rows of the unquantized lm_head) through gemv_rows
            assert [c for c in calls if c.startswith("gemv")] == (["gemv_rows_128_bf16_f32"]
                                                                   if gv.name_hint == "mtp_prefill_hd" else [])
            assert any("silu_mul" in c for c in gm) and any("residual" in c for c in gm), (gv.name_hint, gm)
        elif gv.name_hint in ("gdn_replay", "mtp_head_build"):  # no weight matmul (a recurrence, a row gather)
            assert not [c for c in calls if "dequant" in c or c.startswith(("gemv", "gemm"))], (gv.name_hint, calls)
        else:
            assert any(re.fullmatch(r"dequant_nvfp4\d*", c) for c in calls), gv.name_hint
            # the same function; only the numbering of the tensor-expression dequants differs (prefill no
            # longer holds the first ones)
            one = without.get_global_var("dequant_nvfp4")
            tvm.ir.assert_structural_equal(_dequant_names(f, one), _dequant_names(without[gv.name_hint], one),
                                           map_free_vars=True)
    llvm = export("llvm")
    assert not [gv for gv, _ in llvm.functions_items() if "gemv" in gv.name_hint]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_gemv_nvfp4_27b_compiles(tmp_path, arch):
    """The 27B NVFP4 decode shapes (both launches each) compile to a fatbin; on sm_90 without spills."""
    import subprocess

    import tvm

    from ninfer_mlc.compile.kernels.cuda import gemv as G
    from ninfer_mlc.compile.targets import cuda_build_env, parse_target

    g = kernel_set("cuda").gemv
    shapes = [(5120, 14336, "none"), (5120, 34816, "silu_mul"), (17408, 5120, "residual"), (6144, 5120, "residual")]
    funcs = {}
    for k, o, ep in shapes:
        f = g(k, o, "bfloat16", "bfloat16", ep, weight_format="nvfp4")
        funcs[f.attrs["global_symbol"]] = f
    tgt = parse_target("cuda:" + arch).tvm_target()
    with cuda_build_env(tgt):
        ex = tvm.compile(tvm.IRModule(funcs), target=tgt)
    ex.export_library(str(tmp_path / "g.so"))
    assert FATBIN_MAGIC in (tmp_path / "g.so").read_bytes()
    src = ex.mod.imports[0].inspect_source("cuda")
    assert src.count(f"void {G.NVFP4_DQ_FUNC}(") == 1 and "mma.sync.aligned.m16n8k16.row.col.f32.bf16" in src
    if arch == "sm_90":
        (tmp_path / "g.cu").write_text(src)
        r = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "--use_fast_math", "-Xptxas", "-v",
                            str(tmp_path / "g.cu"), "-o", str(tmp_path / "g.cubin")],
                           capture_output=True, text=True, check=True)
        spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
        assert len(spills) == 2 * len(shapes) and set(spills) == {"0"}, r.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_gemv_rows_27b_compiles_without_spills(tmp_path):
    """The shortlisted MTP head's GEMV at 27B (K = 5120, bf16 -> fp32 logits, both launches) compiles for sm_90
    without spills."""
    import subprocess

    import tvm

    from ninfer_mlc.compile.targets import cuda_build_env, parse_target

    f = kernel_set("cuda").gemv_rows(5120, "bfloat16", "float32")
    tgt = parse_target("cuda:sm_90").tvm_target()
    with cuda_build_env(tgt):
        ex = tvm.compile(tvm.IRModule({f.attrs["global_symbol"]: f}), target=tgt)
    src = ex.mod.imports[0].inspect_source("cuda")
    (tmp_path / "g.cu").write_text(src)
    r = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "--use_fast_math", "-Xptxas", "-v",
                        str(tmp_path / "g.cu"), "-o", str(tmp_path / "g.cubin")], capture_output=True, text=True, check=True)
    spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
    assert len(spills) == 2 and set(spills) == {"0"}, r.stderr


# ---- prefill GEMM (compile/kernels/cuda/gemm_sm90.py: cp.async + wgmma, sm_90a) -------------------------
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_gemm_sm90_27b_compiles_without_spills(tmp_path):
    """The 27B prefill projections (each epilogue, fp32 logits, an odd shape) compile for sm_90a: the wgmma
    launch keeps its 128 accumulators in registers (no stack, no spills, and ptxas does not serialize the
    wgmma pipeline), the few-row launch is the decode GEMV's."""
    import subprocess

    import tvm

    from ninfer_mlc.compile.kernels.cuda import gemm_sm90
    from ninfer_mlc.compile.targets import cuda_build_env, parse_target

    with parse_target("cuda:sm_90").tvm_target():
        g = kernel_set("cuda").gemm
    assert g is not None
    shapes = [(5120, 14336, "none", None), (5120, 34816, "silu_mul", None), (17408, 5120, "residual", None),
              (5120, 248320, "none", "float32"), (72, 520, "residual", None)]
    funcs = {}
    for k, o, ep, odt in shapes:
        f = g(k, o, "bfloat16", odt, ep)
        funcs[f.attrs["global_symbol"]] = f
    tgt = parse_target("cuda:sm_90").tvm_target()
    with cuda_build_env(tgt):
        ex = tvm.compile(tvm.IRModule(funcs), target=tgt)
    src = ex.mod.imports[0].inspect_source("cuda")
    assert src.count("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16") == len(shapes)
    # the host launches the wgmma kernels with their whole ring as dynamic shared memory (TVM sizes it from
    # the accessed region; a bare address_of(smem[0]) launched with 1 byte: illegal address on the GPU)
    launch_args = re.findall(r"store i64 (\d+), ptr", ex.mod.inspect_source("ll"))
    assert launch_args.count(str(gemm_sm90.smem_bytes(256, 4))) == len(shapes), launch_args
    (tmp_path / "g.cu").write_text(src)
    r = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-O3", "--use_fast_math", "-Xptxas", "-v",
                        str(tmp_path / "g.cu"), "-o", str(tmp_path / "g.cubin")],
                       capture_output=True, text=True, check=True)
    assert "C7514" not in r.stderr and "C7510" not in r.stderr, r.stderr  # wgmma serialization warnings
    frames = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores", r.stderr)
    assert frames and all(s == "0" for _, s in frames), r.stderr
    wg = re.findall(r"Function properties for (\w*gemm\w*_kernel_2)\n\s+(\d+) bytes stack frame", r.stderr)
    assert len(wg) == len(shapes) and all(fr == "0" for _, fr in wg), r.stderr
    with parse_target("cuda:sm_120").tvm_target():
        assert kernel_set("cuda").gemm is None  # wgmma is sm_90a only
