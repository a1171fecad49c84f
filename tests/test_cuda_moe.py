"""The CUDA MoE kernels (compile/kernels/cuda/moe.py) as generated CUDA on the CPU emulator
(compile/kernels/cuda/emulate), against the llvm kernels (compile/kernels/moe.py) on the same inputs: router top-k and
the expert grouping (one launch, or two past ROUTE_FUSED_MAX tokens), the grouped gate_up / down GEMMs (tensor-core,
NVFP4 in-register dequantization and FMA
paths, passes of 8 and of 8 * big_tiles pairs, K / row remainders), the combine and the down GEMM with the combine
fused into its last block per row tile; the sm_90 wgmma tile's NVFP4 dequantization; plus the wiring of the MoE
block on CUDA and compile checks of the 35B-A3B shapes for sm_90 / sm_120."""
from __future__ import annotations

import re
import shutil

import ml_dtypes
import numpy as np
import pytest

emu = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


def _np_dt(dtype):
    return {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}.get(dtype, np.float32)


def _llvm(funcs: dict):
    import tvm

    return tvm.compile(tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in funcs.items()}), target="llvm")


def _run_llvm(lib, name, *arrays):
    import tvm

    dev = tvm.cpu()
    ts = [tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in arrays]
    lib[name](*ts)
    return [t.numpy() for t in ts]


def _quantized_experts(rng, ex, out_f, in_f):
    """NVFP4 buffers of `ex` random experts (each matrix quantized on its own, rows scales per row)."""
    from ninfer_mlc.compile.weight_quant import quantize_weight

    qs = [quantize_weight((rng.standard_normal((out_f, in_f)) * 0.3).astype(np.float32)) for _ in range(ex)]
    codes = np.stack([q["weight"] for q in qs])
    scales = np.stack([q["weight_scale"] for q in qs])
    scales[0, 0, 0] = 0  # a zero block scale and an E4M3 subnormal one
    scales[-1, 1, 0] = 3
    gs = np.stack([np.full(out_f, q["weight_scale_2"][0], np.float32) for q in qs])
    return [codes, scales, gs]


# (name, E, K, D, I, shared I (None: folded), dtype, weight format, n tokens)
CASES = [
    ("bf16_decode", 8, 2, 64, 32, None, "bfloat16", None, 5),
    ("bf16_prefill_big_passes", 8, 2, 64, 32, None, "bfloat16", None, 70),  # > ROUTE_FUSED_MAX: 2 route launches
    ("bf16_k_row_remainders", 6, 3, 72, 20, 48, "bfloat16", None, 9),  # K % 128, rows % 16 / % 8, down K % 8 -> fma
    ("bf16_down_rows", 8, 2, 72, 24, None, "bfloat16", None, 12),  # down rows % 16, K % 128 on the mma path
    ("f16_mma", 8, 4, 64, 24, None, "float16", None, 7),
    ("f32_fma", 8, 2, 40, 24, 16, "float32", None, 11),
    ("nvfp4_decode", 8, 2, 64, 32, None, "bfloat16", "nvfp4", 4),
    ("nvfp4_prefill", 8, 2, 64, 32, None, "bfloat16", "nvfp4", 50),
    ("nvfp4_fma_down", 8, 2, 64, 48, 16, "bfloat16", "nvfp4", 6),  # down K = 48 % 32 != 0
]


def _case_funcs(case) -> dict:
    """The CUDA prim_funcs of a case, named <case>__<role>."""
    from ninfer_mlc.compile.kernels.cuda import moe as M

    name, E, K, D, I, shared, dtype, fmt, _ = case
    fold = shared is None
    Ex, P = E + fold, K + fold
    gemm = dict(warps=2, unroll=2, big_tiles=2) if name == "bf16_prefill_big_passes" else {}
    funcs = {"route": M.moe_route(E, K, E != 6, Ex, P),
             "gu": M.expert_gemm("gate_up", D, 2 * I, Ex, P, dtype, fmt, **gemm),
             "dn": M.expert_gemm("down", I, D, Ex, P, dtype, fmt, **gemm),
             "comb": M.moe_combine(D, K, P, dtype, True, not fold), "bare": M.moe_combine(D, K, P, dtype, False, False),
             "routec": M.moe_route(E, K, E != 6, Ex, P, M.down_combine_counters(D)),
             "dc": M.moe_down_combine(I, D, Ex, P, K, dtype, fmt, True, not fold, **gemm)}
    return {f"{name}__{k}": f.with_attr("global_symbol", f"{name}__{k}") for k, f in funcs.items()}


@pytest.fixture(scope="module")
def emu_lib(tmp_path_factory):
    """Every case's kernels in one emulator build (one g++ run)."""
    from ninfer_mlc.compile.kernels.cuda.emulate import EmuLib

    funcs = {}
    for case in CASES:
        funcs.update(_case_funcs(case))
    return EmuLib(funcs, workdir=tmp_path_factory.mktemp("moe_emu"))


@emu
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_moe_kernels_on_cpu_emulator_match_llvm(case, emu_lib):
    from ninfer_mlc.compile.kernels import moe as L
    from ninfer_mlc.compile.kernels.cuda import moe as M

    _, E, K, D, I, shared, dtype, fmt, n = case
    fold = shared is None
    Ex, P = E + fold, K + fold
    dt = _np_dt(dtype)
    rng = np.random.default_rng(len(case[0]))
    logits = rng.standard_normal((n, E + 1)).astype(np.float32)
    logits[:3, :E] = rng.integers(0, 2, (3, E))  # exact ties
    x = rng.standard_normal((n, D)).astype(dt)
    res = rng.standard_normal((n, D)).astype(dt)
    if fmt == "nvfp4":
        gu, dn = _quantized_experts(rng, Ex, 2 * I, D), _quantized_experts(rng, Ex, D, I)
    else:
        gu, dn = [(rng.standard_normal((Ex, 2 * I, D)) * 0.3).astype(dt)], [(rng.standard_normal((Ex, D, I)) * 0.3)
                                                                           .astype(dt)]
    norm = E != 6
    lib = _llvm({"topk": L.moe_topk(E, K, norm), "experts": L.moe_experts(D, I, Ex, K, P, dtype, fmt)})
    _, ids_ref, w_ref = _run_llvm(lib, "topk", logits, np.zeros((n, K + 1), np.int32), np.zeros((n, K + 1), np.float32))
    want = _run_llvm(lib, "experts", x, ids_ref, w_ref, *gu, *dn, np.zeros((n, D), dt))[-1].astype(np.float32)

    name = case[0]

    def lib(role, arrays, scalars):
        return emu_lib(f"{name}__{role}", arrays, scalars)

    ids, w = np.full((n, K + 1), -1, np.int32), np.full((n, K + 1), np.nan, np.float32)
    order, route = np.full(n * P, -1, np.int32), np.full(M.route_len(Ex), -1, np.int32)
    lib("route", dict(logits=logits, ids=ids, w=w, order=order, route=route), dict(n=n))
    assert len(emu_lib.kernel_names(f"{name}__route")) == 3  # one block up to ROUTE_FUSED_MAX tokens, else top-k then align
    np.testing.assert_array_equal(ids, ids_ref)
    np.testing.assert_allclose(w, w_ref, rtol=1e-6, atol=1e-7)

    flat = ids[:, :P].reshape(-1)
    assert sorted(order.tolist()) == list(range(n * P))
    counts = np.bincount(flat, minlength=Ex)
    np.testing.assert_array_equal(route[:Ex + 1], np.concatenate([[0], np.cumsum(counts)]))
    used = np.flatnonzero(counts)
    assert route[Ex + 1] == len(used) and route[Ex + 2:Ex + 2 + len(used)].tolist() == used.tolist()
    for e in used:  # every pair sits in its expert's range
        assert set(flat[order[route[e]:route[e + 1]]].tolist()) == {e}
    tiles = -(-counts[used] // M.TILE_ROWS)  # row tiles of the wgmma launch before each used expert, then the total
    assert route[2 * Ex + 2:2 * Ex + 3 + len(used)].tolist() == [0] + np.cumsum(tiles).tolist()

    h = np.full((n * P, I), np.nan, np.float32).astype(dt)
    y = np.full((n * P, D), np.nan, np.float32).astype(dt)
    gw = dict(zip(("wq", "wsc", "wg") if fmt else ("w",), gu))
    dw = dict(zip(("wq", "wsc", "wg") if fmt else ("w",), dn))
    lib("gu", dict(x=x, order=order, route=route, out=h, **gw), dict(npairs=n * P, xr=n))
    lib("dn", dict(x=h, order=order, route=route, out=y, **dw), dict(npairs=n * P, xr=n * P))
    assert np.isfinite(y.astype(np.float32)).all()
    if "prefill" in case[0]:  # another order inside the groups (atomics): the same bits for every pair
        order2 = order.copy()
        for e in used:
            order2[route[e]:route[e + 1]] = np.random.default_rng(e).permutation(order[route[e]:route[e + 1]])
        h2, y2 = np.zeros_like(h), np.zeros_like(y)
        lib("gu", dict(x=x, order=order2, route=route, out=h2, **gw), dict(npairs=n * P, xr=n))
        lib("dn", dict(x=h2, order=order2, route=route, out=y2, **dw), dict(npairs=n * P, xr=n * P))
        assert np.array_equal(y2.view(np.uint16), y.view(np.uint16))
    bare = np.zeros((n, D), dt)
    lib("bare", dict(y=y, w=w, out=bare), dict(n=n))
    tol = 1e-5 if dtype == "float32" else 2e-2  # bf16 / f16: a rounding step of h or y may flip
    scale = np.abs(want).max()
    assert np.abs(bare.astype(np.float32) - want).max() / scale < tol

    # the combine: residual (+ the unfolded shared expert's output, weighted by its gate)
    sh = rng.standard_normal((n, D)).astype(dt) if not fold else None
    out = np.zeros((n, D), dt)
    lib("comb", dict(y=y, w=w, res=res, out=out, **({"sh": sh} if sh is not None else {})), dict(n=n))
    v = bare.astype(np.float32)
    if sh is not None:
        v = (v + (w[:, K:] * sh.astype(np.float32)).astype(dt).astype(np.float32)).astype(dt).astype(np.float32)
    np.testing.assert_array_equal(out.astype(np.float32), (res.astype(np.float32) + v).astype(dt).astype(np.float32))

    # the down GEMM with the combine in its last block per row tile (FMA: a combine launch after it): the route
    # launch zeroes the tickets after the grouping; the same bits as moe_down then moe_combine, and again on the
    # next call (the route launch zeroes the tickets the first call left)
    rc = np.full(M.route_len(Ex, M.down_combine_counters(D)), 7, np.int32)
    rc[:M.route_len(Ex)] = -1  # as `route` was (entries past the used experts stay as they were)
    for _ in range(2):
        lib("routec", dict(logits=logits, ids=ids, w=w, order=order, route=rc), dict(n=n))
        np.testing.assert_array_equal(rc[:M.route_len(Ex)], route)
        assert not rc[M.route_len(Ex):].any()
        y2, out2 = np.zeros_like(y), np.zeros_like(out)
        lib("dc", dict(x=h, order=order, route=rc, cw=w, res=res, sh=sh if sh is not None else res, y=y2, out=out2, **dw),
            dict(npairs=n * P, n=n))
        assert np.array_equal(y2.view(np.uint8), y.view(np.uint8))
        np.testing.assert_array_equal(out2.astype(np.float32), out.astype(np.float32))
    # FMA: the passes then a combine launch; else the fused kernel, and its decode variant (<= DECODE_TOKENS tokens)
    fused = emu_lib.kernel_names(f"{name}__dc")
    assert len(fused) == 2, fused
    if M.gemm_path(I, dtype, fmt == "nvfp4") != "fma":
        assert len(emu_lib.kernel_names(f"{name}__dn")) == 2  # the passes, and their decode variant (the cases
        # run both: 4 / 5 / 7 tokens and 9 / 12 / 50 / 70)


def test_moe_block_uses_the_cuda_kernels():
    """On CUDA the MoE block runs top-k, align, the grouped GEMMs and the combine (the residual fused where the
    model fuses it, the router through the decode GEMV or the sm_90 prefill GEMM with fp32 logits), never the
    llvm set's per-token kernel."""
    from ninfer_mlc.compile.config import parse_config
    from ninfer_mlc.compile.model import Qwen3xForCausalLM
    from ninfer_mlc.compile.targets import parse_target

    raw = {"architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "vocab_size": 320,
           "hidden_size": 64, "num_hidden_layers": 2, "full_attention_interval": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2,
           "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
           "linear_value_head_dim": 8, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
           "shared_expert_intermediate_size": 32, "mtp_num_hidden_layers": 1}
    cfg = parse_config(raw)
    with parse_target("cuda:sm_90").tvm_target():
        m = Qwen3xForCausalLM(cfg, "bfloat16", "cuda", None, mtp=True)
    mod = m.export_tvm(spec=m.export_spec())[0]
    for fn in ("decode", "prefill", "verify", "mtp_step", "mtp_step_sl"):
        calls = re.findall(r"call_tir\((?:cls\.)?(\w+)", mod[fn].script())
        for k in ("moe_route", "moe_gate_up", "moe_down_combine"):
            assert sum(c.startswith(k) for c in calls) == (1 if fn.startswith("mtp") else 2), (fn, k)
        assert not any(c.startswith("moe_combine") or c.startswith("moe_down_") and "combine" not in c
                       for c in calls), (fn, calls)
        combine = [c for c in calls if c.startswith("moe_down_combine")]
        assert all(c.endswith("_res") for c in combine) == (fn != "mtp_step_sl"), (fn, combine)
        if fn in ("decode", "verify", "mtp_step"):
            assert any(c.startswith("gemv_") and c.endswith("x9_bf16_f32") for c in calls), (fn, calls)  # router
        if fn == "prefill":
            assert any(c.startswith("gemm_") and c.endswith("x9_bf16_f32") for c in calls), (fn, calls)
    assert "moe_experts" not in mod.script()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("arch", ["sm_90", "sm_120"])
def test_moe_35b_kernels_compile(tmp_path, arch):
    """The Qwen3.5-35B-A3B MoE shapes (256 experts + the shared one, top-8, hidden 2048, experts 512), bf16 and
    NVFP4, the down GEMM alone and with the fused combine, compile to a fatbin; on sm_90 without register spills."""
    import subprocess

    import tvm

    from ninfer_mlc.compile.kernels.cuda import moe as M
    from ninfer_mlc.compile.targets import cuda_build_env, parse_target

    E, K, D, I = 256, 8, 2048, 512
    funcs = {"route": M.moe_route(E, K, True, E + 1, K + 1), "comb": M.moe_combine(D, K, K + 1, "bfloat16", True, False)}
    for fmt in (None, "nvfp4"):
        funcs[f"gu_{fmt}"] = M.expert_gemm("gate_up", D, 2 * I, E + 1, K + 1, "bfloat16", fmt)
        funcs[f"dn_{fmt}"] = M.expert_gemm("down", I, D, E + 1, K + 1, "bfloat16", fmt)
        funcs[f"dc_{fmt}"] = M.moe_down_combine(I, D, E + 1, K + 1, K, "bfloat16", fmt, True, False)
    funcs = {k: f.with_attr("global_symbol", k) for k, f in funcs.items()}
    tgt = parse_target("cuda:" + arch).tvm_target()
    with cuda_build_env(tgt):
        ex = tvm.compile(tvm.IRModule(funcs), target=tgt)
    ex.export_library(str(tmp_path / "m.so"))
    assert b"\x50\xed\x55\xba" in (tmp_path / "m.so").read_bytes()
    src = ex.mod.imports[0].inspect_source("cuda")
    assert "mma.sync.aligned.m16n8k16.row.col.f32.bf16" in src and "ninfer_moe_nvfp4_dq32" in src
    if arch == "sm_90":
        (tmp_path / "m.cu").write_text(src)
        r = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-O3", "--use_fast_math", "-Xptxas", "-v",
                            str(tmp_path / "m.cu"), "-o", str(tmp_path / "m.cubin")],
                           capture_output=True, text=True, check=True)
        spills = re.findall(r"Function properties for (\w+)\n\s+\d+ bytes stack frame, (\d+) bytes spill stores",
                            r.stderr)
        # the bf16 down decode kernels (alone and with the fused combine) hold 56 registers for 9 resident blocks per
        # SM (moe.decode_launch) with a spill of <= 8 bytes (in a memory-bound kernel); everything else: none
        assert len(spills) >= 10 and all(s == "0" or fn.startswith(("dc_", "dn_")) and int(s) <= 8
                                         for fn, s in spills), r.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_moe_wgmma_prefill_compiles_without_spills(tmp_path):
    """sm_90: the 35B-A3B gate_up / down with large groups launch the grouped wgmma kernel (gemm_sm90's tile:
    128 accumulators in registers, no stack, no spills, no wgmma serialization) next to the mma.sync passes, bf16
    and NVFP4 (B dequantized into the shared ring, moe_sm90.py)."""
    import subprocess

    import tvm

    from ninfer_mlc.compile.kernels.cuda import registry
    from ninfer_mlc.compile.targets import cuda_build_env, parse_target

    tgt = parse_target("cuda:sm_90").tvm_target()
    with tgt:
        ks = registry.kernel_set()
    funcs = {f"{k}_{fmt}": kern(2048, 512, 257, 9, "bfloat16", fmt)
             for k, kern in (("gu", ks.moe_gate_up), ("dn", ks.moe_down)) for fmt in (None, "nvfp4")}
    for f in funcs.values():
        assert "if npairs >= T.int64(12336)" in f.script()  # 48 pairs per expert slot on average
    with parse_target("cuda:sm_120").tvm_target():
        assert "wgmma" not in registry.kernel_set().moe_gate_up(2048, 512, 257, 9, "bfloat16").script()
    with cuda_build_env(tgt):
        ex = tvm.compile(tvm.IRModule({k: f.with_attr("global_symbol", k) for k, f in funcs.items()}), target=tgt)
    src = ex.mod.imports[0].inspect_source("cuda")
    assert src.count("wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16") == 4
    assert src.count("ninfer_moe_nvfp4_dq8(d, bq[j], bs[j])") == 2  # NVFP4 B dequantized into the shared ring
    (tmp_path / "m.cu").write_text(src)
    r = subprocess.run(["nvcc", "-cubin", "-arch=sm_90a", "-O3", "--use_fast_math", "-Xptxas", "-v",
                        str(tmp_path / "m.cu"), "-o", str(tmp_path / "m.cubin")], capture_output=True, text=True,
                       check=True)
    assert "C7514" not in r.stderr and "C7510" not in r.stderr, r.stderr
    # wgmma, passes, decode passes: no stack, no spills, but for the bf16 down decode passes' <= 8 bytes (56
    # registers for 9 resident blocks per SM: moe.decode_launch)
    wg = re.findall(r"Function properties for (\w+_kernel(?:_\d)?)\n\s+(\d+) bytes stack frame, (\d+) bytes spill",
                    r.stderr)
    assert len(wg) == 12 and all(fr == sp == "0" or fn.startswith("dn_None") and int(sp) <= 8
                                 for fn, fr, sp in wg), r.stderr
    assert sum(fr != "0" for _, fr, _ in wg) <= 1, r.stderr


@emu
def test_nvfp4_dq8_on_cpu_emulator_is_exact(tmp_path):
    """The sm_90 wgmma tile's NVFP4 B chunk (moe.py _DQ8): 8 codes of one word and their E4M3 block scale -> bf16
    e2m1 * e4m3 * 2^-7 in natural K order, exact, for every code and every scale byte (subnormal ones too)."""
    from tvm.script import tirx as T

    from ninfer_mlc.compile.kernels.cuda import moe as M
    from ninfer_mlc.compile.kernels.cuda.emulate import EmuLib

    src = M._BF16X2 + M._DQ8 + M._src("ninfer_test_dq8", """
__device__ __forceinline__ void ninfer_test_dq8(const unsigned* codes, const unsigned char* sc, unsigned* out) {
  if (threadIdx.x == 0) ninfer_moe_nvfp4_dq8(out + 4 * blockIdx.x, codes[blockIdx.x], sc[blockIdx.x]);
}""")

    @T.prim_func
    def dq8(var_c: T.handle, var_s: T.handle, var_o: T.handle):
        n = T.int64()
        c = T.match_buffer(var_c, (n,), "uint32")
        s = T.match_buffer(var_s, (n,), "uint8")
        o = T.match_buffer(var_o, (n, 4), "uint32")
        for b in T.thread_binding(n, thread="blockIdx.x"):
            for tx in T.thread_binding(32, thread="threadIdx.x"):
                T.evaluate(T.cuda.func_call("ninfer_test_dq8", T.address_of(c[0]), T.address_of(s[0]),
                                            T.address_of(o[0, 0]), source_code=src))

    lib = EmuLib({"dq8": dq8.with_attr("global_symbol", "dq8")}, workdir=tmp_path)
    rng = np.random.default_rng(3)
    scales = np.arange(0x7F, dtype=np.uint8)  # every E4M3 byte but NaN (block scales are positive)
    nib = np.stack([rng.permutation(16)[:8] for _ in scales]).astype(np.uint32)  # 8 distinct codes per word
    codes = (nib << (4 * np.arange(8, dtype=np.uint32))).sum(1).astype(np.uint32)
    out = np.zeros((len(scales), 4), np.uint32)
    lib("dq8", dict(c=codes, s=scales, o=out), dict(n=len(scales)))
    got = out.view(ml_dtypes.bfloat16).astype(np.float64).reshape(len(scales), 8)
    mag = np.array([0, .5, 1, 1.5, 2, 3, 4, 6])[nib & 7] * np.where(nib & 8, -1, 1)
    e, m = (scales >> 3) & 15, (scales & 7).astype(np.float64)
    s = np.where(e == 0, m * 2.0 ** -9, 2.0 ** (e.astype(np.float64) - 7) * (1 + m / 8))
    np.testing.assert_array_equal(got, mag * s[:, None] * 2.0 ** -7)
