"""The gated attention's one-launch q/k preparation (compile/kernels/cuda/qk_norm_rope.py) on the CPU emulator
(ninfer_mlc.compile.kernels.cuda.emulate), against the launches it replaces, each run as a build runs it: the split
of the projection (exact copies: numpy slices), norm.py's rms_norm on q and k, and apply_rope's tensor expression
(kernels/rope.py) as the GPU pipeline schedules it (DLight, compile/gpu_pipeline.py). q, gate, k and v must be
bit-equal; a float64 numpy RMSNorm + RoPE checks that both are that at all. Then which launches the model's CUDA
functions call, and an nvcc compile without spills."""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from nvcc_spills import spill_stores  # noqa: E402

EPS = 1e-6
SECTION = (11, 11, 10)
needs_gpp = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
# (hq, hkv, dh, rotary_dim): the 27B and 35B-A3B attention, a head wider than rms_norm's 256 threads
GEOMETRIES = {"27b": (24, 4, 256, 64), "35b": (16, 2, 256, 64), "wide": (2, 1, 512, 128)}


def _np_dt(dtype):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32


def _yarn_tables(rotary_dim: int):
    """A YaRN frequency table and attention factor (!= 1) of the size of a 4x-extended 262k context."""
    from ninfer_mlc.compile.rope_scaling import RopeSpec, inv_freq_and_attention_factor

    inv, fac = inv_freq_and_attention_factor(RopeSpec(rope_type="yarn", theta=1e7, rotary_dim=rotary_dim, factor=4.0,
                                                      original_max_position_embeddings=262144))
    assert fac != 1.0
    return np.asarray(inv, np.float32), np.array([fac], np.float32)


def _rope_func(heads: int, dh: int, rotary_dim: int, dtype: str, mrope: bool, name: str):
    """apply_rope's prim_func (the model's tensor expression) scheduled as the CUDA build schedules it."""
    import tvm
    from tvm.relax.frontend import nn

    from ninfer_mlc.compile.gpu_pipeline import NinferDLight, schedule_for
    from ninfer_mlc.compile.kernels.rope import apply_rope
    from ninfer_mlc.compile.targets import parse_target

    class Rope(nn.Module):
        def forward(self, x, pos, inv, fac):
            return apply_rope(x, pos, inv, fac, rotary_dim, "rope", list(SECTION))

    spec = {"forward": {"x": nn.spec.Tensor(["n", heads, dh], dtype),
                        "pos": nn.spec.Tensor(["n", 3] if mrope else ["n"], "int32"),
                        "inv": nn.spec.Tensor([rotary_dim // 2], "float32"), "fac": nn.spec.Tensor([1], "float32")}}
    mod, _ = Rope().export_tvm(spec=spec)
    tgt = parse_target("cuda:sm_90").tvm_target()
    report: dict = {}
    with tgt:
        sched = NinferDLight(schedule_for(tgt), report)(tvm.IRModule({"rope": mod["rope"]}))
    assert report == {"rope": "Fallback"}
    return sched["rope"].with_attr("global_symbol", name)


def _lib(geo, dtype, tmp_path):
    from ninfer_mlc.compile.kernels.cuda import norm
    from ninfer_mlc.compile.kernels.cuda.emulate import EmuLib
    from ninfer_mlc.compile.kernels.registry import kernel_set

    hq, hkv, dh, rot = geo
    prep = kernel_set("cuda").qk_norm_rope
    funcs = {"fused": prep(hq, hkv, dh, rot, dtype, EPS), "fused_mm": prep(hq, hkv, dh, rot, dtype, EPS, SECTION),
             "norm": norm.rms_norm(dh, dtype, EPS, threads=256)}
    for mm in (False, True):
        for heads, which in ((hq, "q"), (hkv, "k")):
            name = f"rope_{which}{'_mm' if mm else ''}"
            funcs[name] = _rope_func(heads, dh, rot, dtype, mm, name)
    funcs = {k: f.with_attr("global_symbol", k) for k, f in funcs.items()}
    return EmuLib(funcs, workdir=tmp_path)


def _positions(rng, n: int, mrope: bool):
    """Positions up to 600k (0 and 500000 among them); M-RoPE: three different components per row."""
    p = rng.integers(0, 600_000, size=(n, 3) if mrope else n).astype(np.int32)
    p.reshape(n, -1)[0, 0] = 500_000
    p.reshape(n, -1)[-1, -1] = 0
    return p


def _old_path(lib, geo, dtype, qkv, pos, inv, fac, qw, kw, mrope):
    """q, gate, k, v through the unfused launches."""
    hq, hkv, dh, _ = geo
    n = qkv.shape[0]
    qg = qkv[:, :2 * hq * dh].reshape(n, hq, 2 * dh)
    outs = {"gate": np.ascontiguousarray(qg[:, :, dh:]),
            "v": np.ascontiguousarray(qkv[:, 2 * hq * dh + hkv * dh:]).reshape(n, hkv, dh)}
    for which, heads, x, w in (("q", hq, qg[:, :, :dh], qw), ("k", hkv, qkv[:, 2 * hq * dh:2 * hq * dh + hkv * dh], kw)):
        normed = np.full((n * heads, dh), np.nan, np.float32).astype(qkv.dtype)
        lib("norm", dict(x=np.ascontiguousarray(x).reshape(n * heads, dh), w=w, out=normed))
        roped = np.full((n, heads, dh), np.nan, np.float32).astype(qkv.dtype)
        name = f"rope_{which}{'_mm' if mrope else ''}"
        lib(name, dict(x=normed.reshape(n, heads, dh), pos=pos, inv=inv, fac=fac, rope=roped))
        outs[which] = roped
    return outs


def _new_path(lib, geo, qkv, pos, inv, fac, qw, kw, mrope):
    hq, hkv, dh, _ = geo
    n = qkv.shape[0]
    outs = {k: np.full((n, h, dh), np.nan, np.float32).astype(qkv.dtype)
            for k, h in (("q", hq), ("gate", hq), ("k", hkv), ("v", hkv))}
    lib("fused_mm" if mrope else "fused", dict(qkv=qkv, pos=pos, inv=inv, factor=fac, qw=qw, kw=kw, **outs))
    return outs


def _numpy_reference(x, pos, inv, fac, w, rotary_dim, mrope):
    """RMSNorm + partial NeoX RoPE in float64 but for the fp32 angle ([n, heads, dh] x); M-RoPE picks
    rope.mrope_component's part."""
    x = np.asarray(x, np.float64)
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w
    half = rotary_dim // 2
    j = np.arange(half)
    comp = np.where((j % 3 == 1) & (j < 3 * SECTION[1]), 1, np.where((j % 3 == 2) & (j < 3 * SECTION[2]), 2, 0))
    p = pos[:, comp] if mrope else pos[:, None]  # [n, half]
    ang = (p.astype(np.float32) * inv[None]).astype(np.float64)  # the fp32 angle (at 500k its ulp is 0.03 rad)
    cos, sin = (np.concatenate([f(ang)] * 2, -1)[:, None] * float(fac[0]) for f in (np.cos, np.sin))
    r = y[..., :rotary_dim]
    rot = np.concatenate([-r[..., half:], r[..., :half]], -1)
    return np.concatenate([r * cos + rot * sin, y[..., rotary_dim:]], -1)


@needs_gpp
@pytest.mark.parametrize("geo,dtype", [("27b", "bfloat16"), ("35b", "bfloat16"), ("wide", "bfloat16"),
                                       ("wide", "float32")])
def test_qk_norm_rope_matches_unfused_launches(geo, dtype, tmp_path):
    """n 1 / 3 / 8 / 70, 1-D and M-RoPE positions up to 600k, YaRN table with attention factor != 1: q, gate, k,
    v bit-equal to the split + rms_norm + apply_rope launches."""
    g = GEOMETRIES[geo]
    hq, hkv, dh, rot = g
    lib = _lib(g, dtype, tmp_path)
    rng = np.random.default_rng(dh + hq)
    inv, fac = _yarn_tables(rot)
    qw, kw = ((1 + 0.2 * rng.standard_normal(dh)).astype(np.float32) for _ in range(2))
    for n in (1, 3, 8, 70):
        qkv = (rng.standard_normal((n, (2 * hq + 2 * hkv) * dh)) * rng.uniform(0.1, 4)).astype(_np_dt(dtype))
        for mrope in (False, True):
            pos = _positions(rng, n, mrope)
            old = _old_path(lib, g, dtype, qkv, pos, inv, fac, qw, kw, mrope)
            new = _new_path(lib, g, qkv, pos, inv, fac, qw, kw, mrope)
            for key in ("q", "gate", "k", "v"):
                assert np.isfinite(new[key].astype(np.float32)).all(), (n, mrope, key)
                assert np.array_equal(new[key].view(np.uint8), old[key].view(np.uint8)), (n, mrope, key)
            ref = _numpy_reference(qkv[:, :2 * hq * dh].reshape(n, hq, 2 * dh)[:, :, :dh], pos, inv, fac, qw, rot,
                                   mrope)
            err = np.abs(new["q"].astype(np.float64) - ref).max() / np.abs(ref).max()
            assert err < (1e-2 if dtype == "bfloat16" else 1e-4), (n, mrope, err)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_qk_norm_rope_compiles_without_spills(tmp_path):
    """The 27B geometry (1-D and M-RoPE positions) compiles for sm_90 without spilling."""
    from ninfer_mlc.compile.kernels.cuda.emulate import cuda_source
    from ninfer_mlc.compile.kernels.registry import kernel_set

    prep = kernel_set("cuda").qk_norm_rope
    funcs = {"qk": prep(24, 4, 256, 64, "bfloat16", EPS), "qk_mm": prep(24, 4, 256, 64, "bfloat16", EPS, SECTION)}
    src, _host = cuda_source({k: f.with_attr("global_symbol", k) for k, f in funcs.items()})
    for name in funcs:
        spills, report = spill_stores(src, tmp_path, f"{name}_kernel")
        assert spills == 0, report


def test_qk_norm_rope_is_thread_bound():
    """The GPU pipeline leaves the launch as written; the llvm set has none."""
    from ninfer_mlc.compile.gpu_pipeline import is_thread_bound
    from ninfer_mlc.compile.kernels.registry import kernel_set

    assert is_thread_bound(kernel_set("cuda").qk_norm_rope(4, 2, 64, 16, "bfloat16", EPS))
    assert kernel_set("llvm").qk_norm_rope is None


def _export(kind: str, kv_hadamard: bool = False):
    """The tiny default model's relax module (mtp head and multimodal functions included)."""
    import contextlib

    from tvm.target import Target

    from ninfer_mlc.compile import tiny_default
    from ninfer_mlc.compile.config import parse_config
    from ninfer_mlc.compile.model import Qwen3xForCausalLM

    cfg = parse_config(tiny_default.CONFIG)
    with Target({"kind": "cuda", "arch": "sm_90"}) if kind == "cuda" else contextlib.nullcontext():
        m = Qwen3xForCausalLM(cfg, "bfloat16", kind, None, kv_hadamard=kv_hadamard, mtp=True, multimodal=True)
    return cfg, m.export_tvm(spec=m.export_spec())[0]


def test_model_functions_call_the_fused_launch():
    """CUDA: every function with attention layers (decode, verify, prefill, the MTP head's, the multimodal ones)
    calls qk_norm_rope once per attention layer (the M-RoPE variant where positions are [n, 3]) and no rope_q /
    rope_k / head-dim rms_norm; llvm and kv_hadamard keep the unfused path."""
    import tvm

    cfg, mod = _export("cuda")
    dh = cfg.head_dim
    n_attn = cfg.layer_types.count("full_attention")
    per_func = {"mtp_step": 1, "mtp_step_sl": 1, "mtp_step_hd": 1, "mtp_prefill": 1, "mtp_prefill_hd": 1}
    seen = set()
    for gv, f in mod.functions_items():
        if not isinstance(f, tvm.relax.Function):
            continue
        calls = re.findall(r"call_tir(?:_inplace)?\((?:cls\.)?(\w+)", f.script())
        if not any(c.startswith(("attn", "paged_attention")) for c in calls):
            continue
        seen.add(gv.name_hint)
        fused = [c for c in calls if c.startswith("qk_norm_rope")]
        assert len(fused) == per_func.get(gv.name_hint, n_attn), (gv.name_hint, calls)
        assert all(c.endswith("_mrope11x11x10") == (gv.name_hint == "prefill_mm") for c in fused), fused
        assert not [c for c in calls if c.startswith("rope") or c.startswith(f"rms_norm_{dh}_")], (gv.name_hint, calls)
    assert {"decode", "decode_mrope", "prefill", "prefill_h", "prefill_mm", "verify", "mtp_step", "mtp_prefill"} <= seen
    for kind, hadamard in (("llvm", False), ("cuda", True)):
        _, old = _export(kind, kv_hadamard=hadamard)
        calls = re.findall(r"call_tir(?:_inplace)?\((?:cls\.)?(\w+)", old["decode"].script())
        assert not [c for c in calls if c.startswith("qk_norm_rope")], kind
        assert calls.count("rope_q") == calls.count("rope_k") == n_attn, (kind, calls)
