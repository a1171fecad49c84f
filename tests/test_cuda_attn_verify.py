"""The verify attend of the CUDA paged attention (compile/kernels/cuda/attention_verify.py: a block per sequence,
KV head and split takes all the sequence's rows, so its K/V are read once), checked on a machine without a GPU:

* the kernel set has it for bf16 / f16 pages (paged_attention's contract) and None for other page formats;
* verify / verify_t (traced under short_rows_scope) call it on CUDA, no other function does, the llvm build not at all;
* its generated CUDA on the CPU emulator matches the float64 reference: 1, 3, 4, 8 and 16 rows per sequence,
  one and three sequences of different row counts and lengths (not page multiples, shorter than a split, 5
  positions), 16 rows of G = 6 (two row tiles), the 27B geometry (G = 6, D = 256), G = 4 / D = 64 and f16; with
  splits (empty trailing splits included: the workspace is 0xff-filled, a partial no split wrote reads as NaN)
  and with one split (out written directly);
* it compiles for sm_90 without register spills (needs nvcc).
"""
from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

from ninfer_mlc.compile.kernels.cuda.emulate import EmuLib, cuda_source
from ninfer_mlc.compile.kernels.cuda.emulate import attention as C

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvcc_spills import spill_stores  # noqa: E402

EMU_CASES = ("emu_vf_bf16_r1", "emu_vf_bf16_r3", "emu_vf_bf16_r4", "emu_vf_bf16_r8", "emu_vf_bf16_r16",
             "emu_vf_bf16_b3", "emu_vf_bf16_b3_r16", "emu_vf_f16_b2", "emu_vf_bf16small_b3")


def _contract(func) -> list[str]:
    text = func.script()
    head = re.search(r"def \w+\((.*?)\):", text, re.S).group(1)
    return [p.split(":")[0].strip() for p in head.split(",") if p.strip()] + sorted(
        re.findall(r"= T\.match_buffer\((.*?)\)\n", text))


def test_verify_attention_in_the_kernel_set():
    from ninfer_mlc.compile.kernels.cuda import attention_verify as V
    from ninfer_mlc.compile.kernels.registry import kernel_set

    assert V.verify_applies(24, 4, 256, "bfloat16", None) and V.verify_applies(8, 2, 64, "float16", "float16")
    assert not V.verify_applies(24, 4, 256, "bfloat16", "fp8") and not V.verify_applies(24, 4, 256, "bfloat16", "nvfp4")
    assert not V.verify_applies(24, 4, 256, "float32", None) and not V.verify_applies(4, 2, 32, "bfloat16", None)
    cuda = kernel_set("cuda")
    f = cuda.verify_attention(24, 4, 256, 64, 3, "bfloat16", 1 / 16)
    assert _contract(f) == _contract(cuda.paged_attention(24, 4, 256, 64, 3, "bfloat16", 1 / 16))
    src = f.script()
    assert "ninfer_attn_verify_" in src and "ninfer_attn_prefill_" not in src
    assert "ninfer_attn_verify_" not in cuda.paged_attention(24, 4, 256, 64, 3, "bfloat16", 1 / 16).script()
    assert kernel_set("cuda", "fp8").verify_attention(24, 4, 256, 64, 3, "bfloat16", 1 / 16) is None
    assert kernel_set("cuda", "nvfp4").verify_attention(24, 4, 256, 64, 3, "bfloat16", 1 / 16) is None
    assert getattr(kernel_set("llvm"), "verify_attention", None) is None
    # splits: ~target_blocks blocks over b sequences x Hkv, at least VF_MIN_TILES K/V tiles each at full width
    assert V.verify_splits(1, 128, 4, 64) == 66 and V.verify_splits(4, 128, 4, 64) == 17
    assert V.verify_splits(1, 4, 4, 64) == 4 and V.verify_splits(70, 128, 4, 64) == 1


def test_verify_functions_take_verify_attention():
    from tvm import relax
    from tvm.target import Target

    from ninfer_mlc.compile import tiny_default
    from ninfer_mlc.compile.config import parse_config
    from ninfer_mlc.compile.model import Qwen3xForCausalLM

    cfg = parse_config(tiny_default.CONFIG)

    def export(kind):
        with Target({"kind": "cuda", "arch": "sm_90"}) if kind == "cuda" else _null():
            m = Qwen3xForCausalLM(cfg, "bfloat16", kind, None, mtp=True, tap_layers=(1,))
        return m.export_tvm(spec=m.export_spec())[0]

    seen = set()
    for gv, f in export("cuda").functions_items():
        if not isinstance(f, relax.Function):
            continue
        calls = set(re.findall(r"call_tir_inplace\((?:cls\.)?(attn\w*)", f.script()))  # by global symbol
        if gv.name_hint in ("verify", "verify_t"):
            assert calls == {"attn_verify"}, (gv.name_hint, calls)
            seen.add(gv.name_hint)
        else:
            assert "attn_verify" not in calls and "attn_mtp_verify" not in calls, (gv.name_hint, calls)
            if gv.name_hint in ("decode", "prefill"):
                assert calls == {"attn"}, (gv.name_hint, calls)
    assert seen == {"verify", "verify_t"}
    assert not [gv for gv, _ in export("llvm").functions_items() if "verify" in gv.name_hint and "attn" in gv.name_hint]


def _null():
    import contextlib

    return contextlib.nullcontext()


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_verify_cuda_source_on_cpu_emulator():
    from ninfer_mlc.compile.kernels.cuda import attention as A

    cases = {m["name"]: m for m in C.all_cases()}
    funcs = C.kernel_funcs(tags={cases[n]["tag"] for n in EMU_CASES}, verify=True)
    geo = C.FUNCS["bf16"][0]
    # target_blocks 4: one split at b >= 1 (Hkv = 4): the verify attend writes out itself
    funcs["vf1_bf16"] = A.paged_attention(*geo, C.PAGE, C.LAYERS, "bfloat16", geo[2] ** -0.5, target_blocks=4,
                                          short_rows=True).with_attr("global_symbol", "vf1_bf16")
    lib = EmuLib(funcs)
    assert len(lib.kernel_names("vf_bf16")) == 3  # append, verify attend, combine
    for name in EMU_CASES:
        m = cases[name]
        r = C.emulate_case(m, lib)
        assert m["func"].startswith("vf_") and r["nsplit"] > 1, (name, r)
        assert r["ok"] and r["rel_err"] < 5e-3, (name, r)
    for name in ("emu_vf_bf16_r8", "emu_vf_bf16_b3_r16"):
        r = C.emulate_case(cases[name], lib, func="vf1_bf16")
        assert r["ok"] and r["rel_err"] < 5e-3, (name, r)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_verify_kernel_compiles_without_spills(tmp_path):
    from ninfer_mlc.compile.kernels.registry import kernel_set

    f = kernel_set("cuda").verify_attention(24, 4, 256, 64, 16, "bfloat16", 1 / 16).with_attr("global_symbol", "attn")
    src, _host = cuda_source({"attn": f})
    assert "__launch_bounds__(128, 2) attn_kernel_1(" in src and "ninfer_attn_verify_" in src
    spills, report = spill_stores(src, tmp_path, "attn_kernel_1")
    assert spills == 0, report
