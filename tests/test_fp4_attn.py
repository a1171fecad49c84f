"""The sm_120 NVFP4-KV attention with Q K^T on the block-scaled FP4 tensor cores (compile/kernels/cuda/attention.py
fp4_qk), checked without a GPU:

* selection: the sm_120 kernel set's nvfp4 attention has it where fp4_qk_applies (27B geometry), other arches'
  kernels are the unchanged ones (same CUDA source as without the option), other geometries fall back;
* fragment mapping: a numpy emulation of what a warp does per batch of 16 positions (Q quantized per row as the
  kernel does, the per-lane A / B registers and scale words built with the kernel's own index helpers from the page
  bytes, the block-scaled m16n8k64 of tests/test_fp4_mma.py placed by the CUTLASS layouts, 1/enc) against float64
  scores of the dequantized Q and K, then whole attention against the float64 reference with Q quantized;
* the emulator's FP4 mma (prelude.py) against the numpy one of tests/test_fp4_mma.py on random registers;
* the generated CUDA on the CPU emulator (the FP4 mma emulated like mma.sync m16n8k16) against the float64
  reference with Q quantized (bf16 output: < 1e-2; measured ~1e-3), and the Q-quantization error against exact Q;
* build: the kernel compiles for sm_120a without spills and its SASS holds OMMA.SF.16864.F32.E2M1.E2M1.UE4M3
  in the split attend kernel (needs nvcc; the SASS check needs cuobjdump on PATH or NINFER_CUOBJDUMP).

Measured Q-quantization error of the attention output (bench/fp4_attn_accuracy.py): see that script.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_fp4_mma import mma_m16n8k64  # noqa: E402  (the CUTLASS-layout block-scaled m16n8k64)

from ninfer_mlc.compile import nvfp4 as F  # noqa: E402
from ninfer_mlc.compile.kernels.cuda import attention as A  # noqa: E402
from ninfer_mlc.compile.kernels.cuda import fp4_mma as K4  # noqa: E402
from ninfer_mlc.compile.kernels.cuda.emulate import attention as C  # noqa: E402

GEO27 = (24, 4, 256)


def _attn(arch: str, geo=GEO27, kv="nvfp4", **kw):
    from ninfer_mlc.compile.kernels.cuda.registry import kernel_set

    hq, hkv, d = geo
    return kernel_set(kv, arch=arch).paged_attention(hq, hkv, d, 64, 2, "bfloat16", d ** -0.5, **kw)


def test_fp4_qk_selection():
    assert A.fp4_qk_applies(24, 4, 256, "bfloat16", "nvfp4") and A.fp4_qk_applies(24, 4, 256, "float16", "nvfp4")
    assert not A.fp4_qk_applies(4, 2, 32, "bfloat16", "nvfp4")  # the tiny geometry: the SIMT nvfp4 path
    assert not A.fp4_qk_applies(24, 4, 256, "bfloat16", "fp8") and not A.fp4_qk_applies(24, 4, 256, "float32", "nvfp4")
    assert A.MMA_NVF4_FN in _attn("sm_120").script()
    assert A.MMA_NVF4_FN not in _attn("sm_120", (4, 2, 32)).script()
    # the kernel set asks for it on sm_120 with nvfp4 pages only (sm_90's kernel: test_other_kernels_unchanged)
    from ninfer_mlc.compile.kernels.cuda.registry import kernel_set

    assert kernel_set("nvfp4", arch="sm_120").paged_attention.keywords["fp4_qk"] is True
    for kv, arch in (("nvfp4", "sm_90"), ("fp8", "sm_120"), (None, "sm_120")):
        assert "fp4_qk" not in kernel_set(kv, arch=arch).paged_attention.keywords


def test_fp4_qk_flag():
    """`ninfer compile --fp4-qk off` keeps the dequantized-K path on sm_120; `on` is refused where it cannot run."""
    from ninfer_mlc.compile.build import compile_model
    from ninfer_mlc.compile.config import ConfigError
    from ninfer_mlc.compile.kernels.cuda.registry import fp4_qk_scope, kernel_set
    from ninfer_mlc.paths import default_model_dir

    with fp4_qk_scope(False):
        assert "fp4_qk" not in kernel_set("nvfp4", arch="sm_120").paged_attention.keywords
    assert kernel_set("nvfp4", arch="sm_120").paged_attention.keywords["fp4_qk"] is True
    for target, kv in (("cuda:sm_90", "nvfp4"), ("cuda:sm_120", "fp8"), ("llvm", "nvfp4")):
        with pytest.raises(ConfigError, match="--fp4-qk on needs"):
            compile_model(default_model_dir(), target=target, kv_dtype=kv, fp4_qk="on")
    with pytest.raises(ConfigError, match="--fp4-qk 'maybe'"):
        compile_model(default_model_dir(), target="cuda:sm_120", kv_dtype="nvfp4", fp4_qk="maybe")


def test_other_kernels_unchanged():
    """fp4_qk changes nothing where it is not asked for: the sm_90 set's nvfp4 kernel is today's."""
    from ninfer_mlc.compile.kernels.cuda.emulate import cuda_source

    def src(f):
        return cuda_source({"attn": f.with_attr("global_symbol", "attn")})[0]

    assert src(_attn("sm_90")) == src(A.paged_attention(24, 4, 256, 64, 2, "bfloat16", 1 / 16, kv_dtype="nvfp4"))
    assert A.MMA_NVF4_FN not in src(_attn("sm_90"))


# ----------------------------------------------------------------------------- numpy emulation of a warp

def quantize_q_rows(q):
    """The attend block's Q staging: [G, D] -> code words uint32 [G, D/8], scale words uint32 [G, D/64], 1/enc [G]."""
    x = np.asarray(q, np.float32)
    amax = np.abs(x).max(-1)
    enc = np.array([K4.E4M3_MAX * K4.E2M1_MAX / np.float32(a) if a > 0 else 1.0 for a in amax], np.float32)
    codes, scales = F.quantize_nvfp4(x, global_scale=enc[:, None])
    return codes.view("<u4"), np.ascontiguousarray(scales).view("<u4"), np.float32(1.0) / enc


def emulate_scores(qw, qs, qd, krows, G: int, D: int) -> np.ndarray:
    """Scores [G, 16] of one batch of 16 page rows (krows uint8 [16, D/2 + D/16]) as the warp forms them: per
    8-position tile and 64-column chunk one m16n8k64 from the lanes' registers (attention._a_word / _b_word,
    fp4_mma.sfa_row / sfb_col / c_frag), fp32 accumulation, then x 1/enc of the row's head."""
    kw = np.ascontiguousarray(krows[:, :D // 2]).view("<u4")
    ks = np.ascontiguousarray(krows[:, D // 2:]).view("<u4")
    S = np.full((16, 16), np.nan)
    for tile in range(2):
        acc = np.zeros((32, 4), np.float32)
        for kc in range(D // 64):
            a = np.zeros((32, 4), np.uint32)
            b = np.zeros((32, 2), np.uint32)
            sfa = np.zeros(32, np.uint32)
            sfb = np.zeros(32, np.uint32)
            for lane in range(32):
                gid = lane // 4
                for u in range(2):
                    a[lane, 2 * u] = qw[gid, 8 * kc + A._a_word(lane, u)] if gid < G else 0
                    b[lane, u] = kw[tile * 8 + gid, 8 * kc + A._b_word(lane, u)]
                r = K4.sfa_row(lane)
                sfa[lane] = qs[r, kc] if r < G else 0
                sfb[lane] = ks[tile * 8 + K4.sfb_col(lane), kc]
            acc = (acc + mma_m16n8k64(a, b, sfa, sfb)).astype(np.float32)
        for lane in range(32):
            for e in range(4):
                row, col = K4.c_frag(lane, e)
                S[row, tile * 8 + col] = acc[lane, e] * (qd[row] if row < G else 0.0)
    return S[:G]


@pytest.mark.parametrize("seed", [0, 1])
def test_fragment_mapping_matches_fp64(seed):
    G, D, L = 6, 256, 40  # one KV head of the 27B geometry, 40 positions (3 batches, the last one partly masked)
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((G, D)) * rng.uniform(0.1, 10, (G, 1))).astype(np.float32)
    q[2, :16] *= 40  # an outlier block
    x = rng.standard_normal((2, L, D)).astype(np.float32) * np.exp(rng.uniform(-3, 3, (2, L, 1))).astype(np.float32)
    rows = F.pack_kv_nvfp4(x)  # [2 (K, V), L, D/2 + D/16]
    kd, vd = (F.unpack_kv_nvfp4(rows[c], D).astype(np.float64) for c in range(2))
    qw, qs, qd = quantize_q_rows(q)
    qdeq = C.quantize_q_nvfp4(q).astype(np.float64)
    # the staged words are the numpy quantizer's (the kernel's convention) and dequantize to quantize_q_nvfp4's Q
    np.testing.assert_allclose(
        F.dequantize_nvfp4(qw.view(np.uint8), qs.view(np.uint8), D) * qd[:, None], qdeq, rtol=1e-6, atol=0)
    pad = np.concatenate([rows[0], np.repeat(rows[0][-1:], 48 - L, 0)])  # rows past L: the last row (masked)
    S = np.concatenate([emulate_scores(qw, qs, qd, pad[16 * b:16 * b + 16], G, D) for b in range(3)], 1)[:, :L]
    S_ref = qdeq @ kd.T
    np.testing.assert_allclose(S, S_ref, rtol=0, atol=2e-6 * np.abs(S_ref).max())
    # attention from the emulated scores (softmax, P V in float64) = the float64 reference with Q quantized
    sm = D ** -0.5
    p = np.exp((S - S.max(-1, keepdims=True)) * sm)
    o = (p @ vd) / p.sum(-1, keepdims=True)
    pr = np.exp((S_ref - S_ref.max(-1, keepdims=True)) * sm)
    o_ref = (pr @ vd) / pr.sum(-1, keepdims=True)
    assert np.abs(o - o_ref).max() <= 1e-5 * np.abs(o_ref).max()
    # Q's quantization is what separates it from exact attention (its size: bench/fp4_attn_accuracy.py)
    pe = np.exp((q @ kd.T - (q @ kd.T).max(-1, keepdims=True)) * sm)
    o_exact = (pe @ vd) / pe.sum(-1, keepdims=True)
    assert np.abs(o - o_exact).max() > 1e-3 * np.abs(o_exact).max()


def test_q_quantizer_numpy_matches_ml_dtypes():
    """quantize_q_nvfp4 (the reference's Q) is the row-scaled NVFP4 of fp4_mma's activations, decoded by ml_dtypes."""
    import ml_dtypes

    rng = np.random.default_rng(3)
    q = (rng.standard_normal((5, 64)) * rng.uniform(0.01, 30, (5, 1))).astype(np.float32)
    q[1] = 0
    qw, qs, qd = quantize_q_rows(q)
    codes = (qw.view(np.uint8)[..., None] >> np.array([0, 4], np.uint8)) & 0xF
    vals = codes.reshape(5, 64).astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    sc = qs.view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    deq = vals * np.repeat(sc, 16, 1) * qd[:, None]
    np.testing.assert_allclose(C.quantize_q_nvfp4(q), deq, rtol=1e-6, atol=0)
    assert not C.quantize_q_nvfp4(q)[1].any() and (sc.max(1)[[0, 2, 3, 4]] == 448).all()


# ----------------------------------------------------------------------------- generated CUDA on the emulator

_MMA_HARNESS = r"""
extern "C" void emu_nvf4_warp(const unsigned* regs, float* out) {  // regs [32][8]: a0..a3, b0, b1, sfa, sfb
  emu_launch(1, 1, 1, 32, [=] {
    const unsigned* r = regs + 8 * threadIdx.x;
    float c[4] = {1.f, -2.f, 0.5f, 0.f};
    ninfer_attn_mma_nvf4(c, r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7]);
    for (int o = 0; o < 4; ++o) out[4 * threadIdx.x + o] = c[o];
  });
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_emulator_fp4_mma_matches_cutlass_layouts():
    """The CPU emulator's block-scaled m16n8k64 (prelude.py) = test_fp4_mma's numpy one (CUTLASS TV layouts), with
    garbage in the scale registers of the lanes the instruction does not read."""
    import ctypes

    from ninfer_mlc.compile.kernels.cuda.emulate import prelude
    from ninfer_mlc.compile.kernels.cuda.emulate.lib import compile_shared

    lib = compile_shared(prelude.source() + _MMA_HARNESS, name="nvf4_warp")
    rng = np.random.default_rng(11)
    regs = rng.integers(0, 2 ** 32, (32, 8), dtype=np.uint64).astype(np.uint32)
    regs[:, 6:] = rng.integers(0x08, 0x70, (32, 2, 4), dtype=np.uint8).view("<u4")[..., 0]  # E4M3 scales, no NaN
    out = np.zeros((32, 4), np.float32)
    lib.emu_nvf4_warp(regs.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p))
    want = mma_m16n8k64(regs[:, :4], regs[:, 4:6], regs[:, 6], regs[:, 7]) + np.array([1, -2, 0.5, 0])
    np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6 * np.abs(want).max())

@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_fp4_qk_cuda_source_on_cpu_emulator():
    from ninfer_mlc.compile.kernels.cuda.emulate import EmuLib

    cases = {m["name"]: m for m in C.all_cases()}
    lib = EmuLib(C.fp4_kernel_funcs(tags={"nvfp4"}))
    for name in ("emu_nvfp4_dec",):  # decode rows of two sequences (200 and 31 positions), split over KV
        r = C.emulate_case(cases[name], lib, func="f4_nvfp4", q_nvfp4=True)
        assert r["ok"] and r["nsplit"] > 1, (name, r)
        assert r["rel_err"] < 5e-3, (name, r)  # against the reference with Q quantized
        assert 0.01 < r["rel_err_q_exact"] < 0.3, (name, r)  # Q's NVFP4 error against exact Q


# ----------------------------------------------------------------------------- build for sm_120a

def _cuobjdump() -> str | None:
    return os.environ.get("NINFER_CUOBJDUMP") or shutil.which("cuobjdump")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_fp4_qk_kernel_builds_for_sm120a(tmp_path):
    from ninfer_mlc.compile.kernels.cuda.emulate import cuda_source

    src, _ = cuda_source({"attn": _attn("sm_120").with_attr("global_symbol", "attn")}, arch="sm_120")
    assert "kind::mxf4nvf4.block_scale.scale_vec::4X.m16n8k64" in src
    (tmp_path / "attn.cu").write_text(src)
    cubin = tmp_path / "attn.cubin"
    r = subprocess.run(["nvcc", "-cubin", "-arch=sm_120a", "-O3", "--use_fast_math", "--ptxas-options=-v",
                        str(tmp_path / "attn.cu"), "-o", str(cubin)], capture_output=True, text=True, check=True)
    for m in re.finditer(r"Function properties for (attn_kernel\w*)\n\s*(\d+) bytes stack frame, (\d+) bytes spill",
                         r.stderr):
        assert m.group(3) == "0", (m.group(1), r.stderr)
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (set NINFER_CUOBJDUMP): the SASS was not checked")
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    per_kernel: dict[str, int] = {}
    fn = ""
    for line in sass.splitlines():
        m = re.search(r"Function : (\w+)", line)
        if m:
            fn = m.group(1)
        if re.search(r"OMMA\.SF\.16864\.F32\.E2M1\.E2M1\.UE4M3", line):
            per_kernel[fn] = per_kernel.get(fn, 0) + 1
    # the split attend launch: one per 64-column chunk and 8-position tile of a batch (4 x 2, unrolled)
    assert per_kernel == {"attn_kernel_2": 8}, per_kernel
