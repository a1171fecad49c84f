"""The GDN decode launch with the causal conv folded in (compile/kernels/cuda/gdn_decode.py gdn_decode_conv) on the
CPU emulator (ninfer_mlc.compile.kernels.cuda.emulate), against the sequence it replaces: the split of the
projection into qkv | z, the causal conv (gdn.py causal_conv, two launches) and gdn_decode. Several decode steps in
a row carry the conv tails and the recurrent state; outputs and both pools must be bit-equal after every step (the
two paths round the conv output to the activation dtype alike and share the step's code). A numpy reference of the
step checks that both are the GDN decode step at all."""
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

K, LAYERS, LAYER, SLOTS, EPS = 4, 3, 1, 10, 1e-6
needs_gpp = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def _np_dt(dtype):
    return ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32


def _rounded(x, dtype):
    return np.asarray(x, np.float32).astype(_np_dt(dtype)).astype(np.float32)


def _silu(x):
    return x / (1 + np.exp(-x))


def _reference_step(geo, dtype, qkvz, ba, pool, cw, a_log, dt_bias, nw, slot, ssm):
    """(out, new pool, new ssm) of one decode step in numpy (fp32 / fp64 sums)."""
    hk, hv, dk, dv = geo
    r, key_dim = hv // hk, hk * dk
    conv_dim = 2 * key_dim + hv * dv
    b = qkvz.shape[0]
    x = np.asarray(qkvz, np.float32)
    pool, ssm = pool.copy(), ssm.copy()
    out = np.zeros((b, hv * dv), np.float32)
    for i in range(b):
        seq = np.concatenate([np.asarray(pool[slot[i], LAYER], np.float32), x[i, :conv_dim, None]], axis=1)
        u = _rounded(_silu((seq * np.asarray(cw, np.float32)).sum(1)), dtype)
        pool[slot[i], LAYER] = seq[:, 1:].astype(pool.dtype)
        bf = np.asarray(ba[i], np.float32)
        for h in range(hv):
            q = u[(h // r) * dk:(h // r + 1) * dk]
            k = u[key_dim + (h // r) * dk:key_dim + (h // r + 1) * dk]
            v = u[2 * key_dim + h * dv:2 * key_dim + (h + 1) * dv]
            q = q / np.sqrt((q * q).sum() + 1e-6) * dk ** -0.5
            k = k / np.sqrt((k * k).sum() + 1e-6)
            beta = 1 / (1 + np.exp(-bf[h]))
            xa = bf[hv + h] + dt_bias[h]
            g = -np.exp(a_log[h]) * (xa if xa > 20 else np.log1p(np.exp(xa)))
            s = ssm[slot[i], LAYER, h].astype(np.float64) * np.exp(g)
            s += np.outer(k, beta * (v - k @ s))
            ssm[slot[i], LAYER, h] = s
            o = q @ s
            on = _rounded(o / np.sqrt((o * o).mean() + EPS) * nw, dtype)
            out[i, h * dv:(h + 1) * dv] = _rounded(on * _silu(x[i, conv_dim + h * dv:conv_dim + (h + 1) * dv]), dtype)
    return out, pool, ssm


def _weights(geo, dtype, rng):
    hk, hv, dk, dv = geo
    conv_dim = 2 * hk * dk + hv * dv
    dt = _np_dt(dtype)
    return dict(cw=(rng.standard_normal((conv_dim, K)) * 0.5).astype(dt),
                a_log=np.log(rng.uniform(1, 16, hv)).astype(np.float32),
                dt_bias=rng.standard_normal(hv).astype(np.float32),
                w=(1 + 0.1 * rng.standard_normal(dv)).astype(np.float32))


def _run_steps(geo, dtype, batches, steps, tmp_path, reference: bool):
    from ninfer_mlc.compile.kernels.cuda import gdn, gdn_decode
    from ninfer_mlc.compile.kernels.cuda.emulate import EmuLib

    hk, hv, dk, dv = geo
    conv_dim = 2 * hk * dk + hv * dv
    dt = _np_dt(dtype)
    funcs = {
        "conv": gdn.causal_conv(conv_dim, K, LAYERS, dtype).with_attr("global_symbol", "conv"),
        "dec": gdn_decode.fused_gdn_decode(hk, hv, dk, dv, LAYERS, dtype, EPS).with_attr("global_symbol", "dec"),
        "fused": gdn_decode.fused_gdn_decode_conv(hk, hv, dk, dv, K, LAYERS, dtype, EPS).with_attr(
            "global_symbol", "fused"),
    }
    lib = EmuLib(funcs, workdir=tmp_path)
    assert lib.kernel_names("fused") == ["fused_kernel", "fused_kernel_1"]  # outputs + step, then the tails
    rng = np.random.default_rng(hv * 1000 + dk)
    wts = _weights(geo, dtype, rng)
    for b in batches:
        slot = rng.permutation(SLOTS)[:b].astype(np.int32)
        cu = np.arange(b + 1, dtype=np.int32)
        pool = rng.standard_normal((SLOTS, LAYERS, conv_dim, K - 1)).astype(dt)
        ssm = (rng.standard_normal((SLOTS, LAYERS, hv, dk, dv)) * 0.3).astype(np.float32)
        old = dict(pool=pool.copy(), ssm=ssm.copy())
        new = dict(pool=pool.copy(), ssm=ssm.copy())
        for step in range(steps):
            qkvz = rng.standard_normal((b, conv_dim + hv * dv)).astype(dt)
            ba = rng.standard_normal((b, 2 * hv)).astype(dt)
            if reference and step == 0:
                ref = _reference_step(geo, dtype, qkvz, ba, new["pool"], wts["cw"], wts["a_log"], wts["dt_bias"],
                                      wts["w"], slot, new["ssm"])
            # old path: split copies, conv (outputs, tails), gdn_decode
            u = np.full((b, conv_dim), np.nan, np.float32).astype(dt)
            lib("conv", dict(x=np.ascontiguousarray(qkvz[:, :conv_dim]), cu=cu, slot=slot, pool=old["pool"],
                             w=wts["cw"], out=u), dict(layer=LAYER))
            out_old = np.full((b, hv * dv), np.nan, np.float32).astype(dt)
            lib("dec", dict(u=u, ba=ba, z=np.ascontiguousarray(qkvz[:, conv_dim:]).reshape(b, hv, dv),
                            a_log=wts["a_log"], dt_bias=wts["dt_bias"], w=wts["w"], slot=slot, ssm=old["ssm"],
                            out=out_old), dict(layer=LAYER))
            # new path: the projection in place
            out_new = np.full((b, hv * dv), np.nan, np.float32).astype(dt)
            lib("fused", dict(x=qkvz, cu=cu, ba=ba, pool=new["pool"], cw=wts["cw"], a_log=wts["a_log"],
                              dt_bias=wts["dt_bias"], w=wts["w"], slot=slot, ssm=new["ssm"], out=out_new),
                dict(layer=LAYER))
            assert np.isfinite(out_new.astype(np.float32)).all(), (b, step)
            assert np.array_equal(out_new.view(np.uint8), out_old.view(np.uint8)), (b, step, "out")
            assert np.array_equal(new["pool"].view(np.uint8), old["pool"].view(np.uint8)), (b, step, "conv pool")
            assert np.array_equal(new["ssm"].view(np.uint8), old["ssm"].view(np.uint8)), (b, step, "ssm pool")
            # the new tail ends with this step's input; other slots and layers keep theirs
            assert np.array_equal(new["pool"][slot, LAYER, :, -1].view(np.uint8),
                                  np.ascontiguousarray(qkvz[:, :conv_dim]).view(np.uint8))
            others = np.setdiff1d(np.arange(SLOTS), slot)
            assert np.array_equal(new["ssm"][others], ssm[others]) and np.array_equal(new["ssm"][:, 0], ssm[:, 0])
            if reference and step == 0:
                out_ref, pool_ref, ssm_ref = ref
                got = out_new.astype(np.float32)
                # bf16: a rounding step of the conv output or of the output may flip
                assert np.abs(got - out_ref).max() / np.abs(out_ref).max() < (1e-5 if dtype == "float32" else 2e-2)
                assert np.array_equal(new["pool"].view(np.uint8), pool_ref.view(np.uint8))
                assert np.abs(new["ssm"] - ssm_ref).max() / np.abs(ssm_ref).max() < (
                    1e-5 if dtype == "float32" else 2e-2)


@needs_gpp
@pytest.mark.parametrize("geo", [(2, 6, 32, 32), (2, 4, 32, 32)], ids=["r3", "r2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_conv_small_heads_on_cpu_emulator(geo, dtype, tmp_path):
    """Small heads (r = Hv/Hk 3 and 2), b 1 / 3 / 8, four steps, and the numpy step reference."""
    _run_steps(geo, dtype, [1, 3, 8], 4, tmp_path, reference=True)


@needs_gpp
@pytest.mark.parametrize("geo", [(16, 48, 128, 128), (16, 32, 128, 128)], ids=["27b", "35b"])
def test_decode_conv_model_heads_on_cpu_emulator(geo, tmp_path):
    """The 27B (Hk 16, Hv 48) and 35B-A3B (Hk 16, Hv 32) head geometries, dk = dv = 128, bf16, three steps."""
    _run_steps(geo, "bfloat16", [1, 3, 8], 3, tmp_path, reference=False)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_decode_conv_compiles_without_spills(tmp_path):
    """The 27B geometry's launches compile for sm_90 without spilling."""
    from ninfer_mlc.compile.kernels.cuda import gdn_decode
    from ninfer_mlc.compile.kernels.cuda.emulate import cuda_source

    f = gdn_decode.fused_gdn_decode_conv(16, 48, 128, 128, K, 48, "bfloat16", EPS).with_attr("global_symbol", "dc")
    src, _host = cuda_source({"dc": f})
    for kernel in ("dc_kernel", "dc_kernel_1"):
        spills, report = spill_stores(src, tmp_path, kernel)
        assert spills == 0, report


def test_decode_conv_is_thread_bound():
    """The GPU pipeline leaves the launch as written (no DLight schedule)."""
    from ninfer_mlc.compile.gpu_pipeline import is_thread_bound
    from ninfer_mlc.compile.kernels.registry import kernel_set

    assert is_thread_bound(kernel_set("cuda").gdn_decode_conv(2, 6, 32, 32, K, 1, "bfloat16", EPS))
    assert kernel_set("llvm").gdn_decode_conv is None


def _export(kind: str, monkeypatch, conv_in_step: bool = True):
    """The tiny default model's relax module (mtp head included); conv_in_step=False: a CUDA kernel set without
    gdn_decode_conv (the split + conv + gdn_decode path)."""
    from ninfer_mlc.compile import model as model_mod
    from ninfer_mlc.compile import tiny_default
    from ninfer_mlc.compile.config import parse_config
    from ninfer_mlc.compile.kernels.registry import kernel_set

    def without_conv_step(*a, **kw):
        ks = kernel_set(*a, **kw)
        ks.gdn_decode_conv = None
        return ks

    with monkeypatch.context() as mp:
        if not conv_in_step:
            mp.setattr(model_mod, "kernel_set", without_conv_step)
        m = model_mod.Qwen3xForCausalLM(parse_config(tiny_default.CONFIG), "bfloat16", kind, None, mtp=True,
                                        multimodal=True)
        return m.export_tvm(spec=m.export_spec())[0]


def _calls(mod, func: str) -> list[str]:
    """The kinds of prim_func `func` calls, in order, one entry per call: gdn_decode_conv, gdn_decode, gdn_conv or
    the callee's name."""
    kinds = (("gdn_decode_conv", r"gdn_decode_conv\w*"), ("gdn_decode", r"gdn_decode_\d\w*"),
             ("gdn_conv", r"(?:gdn_)?conv\d*"))
    return [next((k for k, pat in kinds if re.fullmatch(pat, c)), c)
            for c in re.findall(r"call_tir(?:_inplace)?\((?:cls\.)?(\w+)", mod[func].script())]


def test_cuda_decode_calls_the_conv_launch(monkeypatch):
    """CUDA decode / decode_mrope call gdn_decode_conv once per GDN layer, no gdn_conv / gdn_decode and no split of
    the projection (one R.split per GDN layer fewer than the path without it); every other function is unchanged;
    llvm keeps the relax path."""
    import tvm

    from ninfer_mlc.compile import tiny_default
    from ninfer_mlc.compile.config import parse_config

    n_gdn = parse_config(tiny_default.CONFIG).layer_types.count("linear_attention")
    new, old = _export("cuda", monkeypatch), _export("cuda", monkeypatch, conv_in_step=False)
    decode_rows = ("decode", "decode_mrope")
    for gv, f in new.functions_items():
        if not isinstance(f, tvm.relax.Function):
            continue
        name = gv.name_hint
        if name in decode_rows:
            calls, before = _calls(new, name), _calls(old, name)
            assert calls.count("gdn_decode_conv") == n_gdn, name
            assert "gdn_conv" not in calls and "gdn_decode" not in calls, name
            assert before.count("gdn_conv") == before.count("gdn_decode") == n_gdn, name
            assert f.script().count("R.split(") == old[name].script().count("R.split(") - n_gdn, name
        else:
            assert "gdn_decode_conv" not in _calls(new, name), name
            tvm.ir.assert_structural_equal(f, old[name], map_free_vars=True)
    assert {"decode", "decode_mrope", "prefill", "verify", "gdn_replay"} <= {gv.name_hint for gv in new.functions}
    llvm = _export("llvm", monkeypatch)
    assert "gdn_decode_conv" not in _calls(llvm, "decode") and "gdn_conv" in _calls(llvm, "decode")
