"""MoE hybrids on the GPU: kernel checks, tiny-model checks and the Qwen3.5/3.6-35B-A3B benchmark (JSON out).

Three steps, as bench/gpu_bench.py: `prep` where the compiler is (no GPU), `check` and `bench` on the GPU machine
with only the TVM runtime (TVM_USE_RUNTIME_LIB=1), numpy, ml_dtypes and torch.

  prep OUT [--arch sm_90] [--skip-35b] [--only-35b]
      OUT/kernels.so, kernels.json, kernels_ref.npz
          the CUDA MoE kernels (compile/kernels/cuda/moe.py) at the check geometry: 32 experts + the folded shared
          one, top-8, hidden 2048, experts 512 (the 35B-A3B tiles and K loops), bf16 (the grouped wgmma launch from
          8 pairs per expert on sm_90, and the mma.sync passes alone) and NVFP4 (likewise), plus the llvm kernels' outputs
          (compile/kernels/moe.py) on inputs that `check` regenerates from the same seeds with numpy
      OUT/tiny/   a tiny Qwen3.5-MoE (fused-expert VLM-style checkpoint) built for cuda:ARCH in f32 and bf16 with
                  HF / llvm references: gpu_bench.py check's layout and criteria (CUDA graphs bit-equal to eager)
      OUT/variants.so|json   the 35B-A3B grouped expert GEMMs per VARIANTS entry (`kernels`)
      OUT/q35b.so|json, OUT/q35b_nvfp4.so|json   the 35B-A3B text decoder (bf16; NVFP4 experts and projections)
  check OUT RESULT.json
      kernels: CUDA route (top-k + grouping: one launch up to 64 tokens, else two) vs llvm's top-k (ids, weights),
      then gate_up + down + combine vs the llvm experts kernel on the rows routed alike, every token count (1, 4, 8:
      decode; 40, 100: groups past 8 pairs, the wgmma launch, the two-launch route), and the down GEMM with the fused
      combine (moe_down_combine, the route launch zeroing its tickets) bit-equal to it; the tiny model through
      gpu_bench.cmd_check (its result under "tiny")
  kernels OUT RESULT.json
      the grouped expert GEMMs alone at the 35B-A3B shapes (256 experts + shared, top-8) for the launch-parameter
      variants of VARIANTS (schedules/cuda_<arch>.json "kernels.moe"), bf16 and NVFP4: gate_up + down time per call
      on random routings (a new one each call, so experts come from HBM), GB/s of the distinct experts' weights for
      decode-size calls and TFLOP/s for prefill-size ones (the wgmma launch past its threshold on sm_90)
  bench OUT RESULT.json [--weights bf16,nvfp4] [--ctx 8192] [--long-ctx 131072] [--batches 1,4,8] [--prefill 8192]
      per weight format: random weights made on the GPU, decode through CUDA graphs at every batch and both contexts,
      prefill of one --prefill-token prompt. Floors: decode bytes = weights read per step (everything but the
      embedding and the expert arrays, plus per MoE layer the experts the batch selects: the expected union of b
      tokens' top-k under uniform routing, E(1 - (1 - k/E)^b), plus the shared expert) + KV read + GDN state read and
      written, over the measured copy bandwidth; prefill FLOPs = 2 x tokens x (dense matmul parameters + (k + 1)
      experts) + causal attention + one lm_head row, over the measured bf16 matmul rate.

GPU driver: bash bench/gpu_driver.sh moe (steps moe_check / moe_kernels / moe_bench on MOE_DIR, default .gpu/moe;
MOE_BENCH_ARGS adds bench options; MOE_BEFORE=dir also runs the bench on an earlier prep's libraries, before / after
in one call, with --profile per kernel).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import numpy as np

import gpu_bench
import gpu_common as gc

ROOT = Path(__file__).resolve().parent.parent
PAGE = 64
# Qwen3.5 / 3.6-35B-A3B text decoder (transformers' Qwen3_5MoeTextConfig defaults; rope as the 3.x releases)
Q35B = {
    "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text", "vocab_size": 248320,
    "hidden_size": 2048, "num_hidden_layers": 40, "full_attention_interval": 4, "num_attention_heads": 16,
    "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
}
# kernel check geometry: experts, top-k, hidden, expert size (the 35B-A3B tiles with fewer experts)
CE, CK, CD, CI = 32, 8, 2048, 512
CHECK_TOKENS = (1, 4, 8, 40, 100)
CHECK_WGMMA = (256, 4, 8)  # (bn, stages, pairs per expert slot): the wgmma launch from n*P >= 264 pairs
FORMATS = {"bf16": None, "nvfp4": "nvfp4"}
# launch-parameter variants of the grouped expert GEMMs timed by `kernels` (over the registry's defaults)
VARIANTS = {"default": {}, "w2": {"warps": 2}, "u8": {"unroll": 8}, "u2": {"unroll": 2},
            "bt1": {"big_tiles": 1}}
# (bt1: no separate decode kernel, so no decode launch bounds: the passes as before moe.decode_launch, for comparison)
VARIANT_TOKENS = (1, 4, 8, 48, 512, 8192)


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


# ----------------------------------------------------------------------------------------------
# kernel check inputs (regenerated from seeds on both machines)
def check_weights(fmt: str) -> list[np.ndarray]:
    """gate_up then down buffers of the CE + 1 expert slots."""
    rng = np.random.default_rng(17 if fmt == "bf16" else 19)
    ex = CE + 1
    out = []
    for o, i in ((2 * CI, CD), (CD, CI)):
        if fmt == "bf16":
            out.append((rng.standard_normal((ex, o, i), np.float32) * i ** -0.5).astype(_bf16()))
        else:  # random codes, E4M3 block scales in [0.5, 1), unit-variance rows
            out += [rng.integers(0, 256, (ex, o, i // 2), dtype=np.uint8),
                    rng.integers(0x30, 0x38, (ex, o, i // 16), dtype=np.uint8),
                    np.full((ex, o), 1.0 / (2.2 * i ** 0.5), np.float32)]
    return out


def check_inputs(n: int) -> dict:
    rng = np.random.default_rng(1000 + n)
    return {"logits": rng.standard_normal((n, CE + 1), np.float32) * 2,
            "x": rng.standard_normal((n, CD), np.float32).astype(_bf16())}


def check_funcs(arch: str) -> dict:
    from ninfer_mlc.compile.kernels.cuda import moe as M
    from ninfer_mlc.compile.kernels.cuda import registry

    p = registry.kernel_params(arch)["moe"]
    ex, pairs = CE + 1, CK + 1
    funcs = {"route": M.moe_route(CE, CK, True, ex, pairs),
             "route_c": M.moe_route(CE, CK, True, ex, pairs, M.down_combine_counters(CD)),
             "combine": M.moe_combine(CD, CK, pairs, "bfloat16", False, False)}
    variants = {"bf16_mma": (None, None), "nvfp4": ("nvfp4", None)}
    if arch == "sm_90":
        variants["bf16_wgmma"] = (None, CHECK_WGMMA)
        variants["nvfp4_wgmma"] = ("nvfp4", CHECK_WGMMA)
    for tag, (fmt, wg) in variants.items():
        funcs[f"gu_{tag}"] = M.expert_gemm("gate_up", CD, 2 * CI, ex, pairs, "bfloat16", fmt, **p, wgmma=wg)
        funcs[f"dn_{tag}"] = M.expert_gemm("down", CI, CD, ex, pairs, "bfloat16", fmt, **p, wgmma=wg)
        funcs[f"dc_{tag}"] = M.moe_down_combine(CI, CD, ex, pairs, CK, "bfloat16", fmt, False, False, **p, wgmma=wg)
    return {k: f.with_attr("global_symbol", k) for k, f in funcs.items()}


def _build_cuda(funcs: dict, arch: str, path: Path) -> None:
    import tvm

    from ninfer_mlc.compile.targets import cuda_build_env, parse_target

    tgt = parse_target("cuda:" + arch).tvm_target()
    with cuda_build_env(tgt):
        tvm.compile(tvm.IRModule(funcs), target=tgt).export_library(str(path))


def prep_kernels(out: Path, arch: str) -> None:
    import tvm

    from ninfer_mlc.compile.kernels import moe as L

    t0 = time.time()
    funcs = check_funcs(arch)
    _build_cuda(funcs, arch, out / "kernels.so")
    ex, pairs = CE + 1, CK + 1
    lmod = tvm.compile(tvm.IRModule({
        "topk": L.moe_topk(CE, CK, True).with_attr("global_symbol", "topk"),
        **{f"experts_{f}": L.moe_experts(CD, CI, ex, CK, pairs, "bfloat16", fmt).with_attr("global_symbol",
                                                                                        f"experts_{f}")
           for f, fmt in FORMATS.items()}}), target="llvm")
    cpu = tvm.cpu()
    T = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a), cpu)  # noqa: E731
    refs = {}
    weights = {f: [T(w) for w in check_weights(f)] for f in FORMATS}
    for n in CHECK_TOKENS:
        inp = check_inputs(n)
        ids, w = T(np.zeros((n, CK + 1), np.int32)), T(np.zeros((n, CK + 1), np.float32))
        lmod["topk"](T(inp["logits"]), ids, w)
        refs[f"{n}/ids"], refs[f"{n}/w"] = ids.numpy(), w.numpy()
        for f in FORMATS:
            o = T(np.zeros((n, CD), _bf16()))
            lmod[f"experts_{f}"](T(inp["x"]), ids, w, *weights[f], o)
            refs[f"{n}/{f}"] = o.numpy().astype(np.float32)
    np.savez_compressed(out / "kernels_ref.npz", **refs)
    from ninfer_mlc.compile.kernels.cuda import moe as M

    (out / "kernels.json").write_text(json.dumps({"arch": arch, "funcs": sorted(funcs), "tokens": CHECK_TOKENS,
                                                  "route_c_len": M.route_len(ex, M.down_combine_counters(CD))}))
    print(f"kernels: {len(funcs)} functions, llvm references for {CHECK_TOKENS} tokens, {time.time() - t0:.0f}s",
          flush=True)


def variant_funcs(arch: str) -> dict:
    from ninfer_mlc.compile.kernels.cuda import moe as M
    from ninfer_mlc.compile.kernels.cuda import registry

    kp = registry.kernel_params(arch)
    mw = kp["moe_wgmma"]
    wg = (mw["bn"], mw["stages"], mw["rows_per_expert"]) if arch in registry.ARCH_ONLY["moe_wgmma"] else None
    e, k, d, i = Q35B["num_experts"], Q35B["num_experts_per_tok"], Q35B["hidden_size"], Q35B["moe_intermediate_size"]
    funcs = {"route": M.moe_route(e, k, True, e + 1, k + 1),
             "route_c": M.moe_route(e, k, True, e + 1, k + 1, M.down_combine_counters(d)),
             "combine": M.moe_combine(d, k, k + 1, "bfloat16", True, False)}
    for f, fmt in FORMATS.items():  # the model's composition: down + combine (+ residual) in one prim_func
        funcs[f"dc_{f}"] = M.moe_down_combine(i, d, e + 1, k + 1, k, "bfloat16", fmt, True, False, **kp["moe"],
                                              wgmma=wg)
    for v, over in VARIANTS.items():
        p = {**kp["moe"], **over}
        for f, fmt in FORMATS.items():
            funcs[f"gu_{f}_{v}"] = M.expert_gemm("gate_up", d, 2 * i, e + 1, k + 1, "bfloat16", fmt, **p, wgmma=wg)
            funcs[f"dn_{f}_{v}"] = M.expert_gemm("down", i, d, e + 1, k + 1, "bfloat16", fmt, **p, wgmma=wg)
    return {name: f.with_attr("global_symbol", name) for name, f in funcs.items()}


def prep_variants(out: Path, arch: str) -> None:
    t0 = time.time()
    funcs = variant_funcs(arch)
    _build_cuda(funcs, arch, out / "variants.so")
    from ninfer_mlc.compile.kernels.cuda import moe as M

    route_c_len = M.route_len(Q35B["num_experts"] + 1, M.down_combine_counters(Q35B["hidden_size"]))
    (out / "variants.json").write_text(json.dumps({"arch": arch, "variants": VARIANTS, "tokens": VARIANT_TOKENS,
                                                   "route_c_len": route_c_len}))
    print(f"variants: {len(funcs)} functions, {time.time() - t0:.0f}s", flush=True)


def prep_35b(out: Path, arch: str) -> None:
    from ninfer_mlc.compile import gpu_pipeline
    from ninfer_mlc.compile.build import build_library
    from ninfer_mlc.compile.config import parse_config
    from ninfer_mlc.compile.targets import parse_target

    cfg = parse_config(Q35B)
    for tag, wq in FORMATS.items():
        t1 = time.time()
        name = "q35b" if tag == "bf16" else f"q35b_{tag}"
        specs = build_library(cfg, "bfloat16", parse_target("cuda:" + arch), out / f"{name}.so", weight_quant=wq,
                              max_rows=gpu_bench.PREFILL_ROWS)
        (out / f"{name}.json").write_text(json.dumps({
            "config": cfg.to_dict(), "params": specs, "arch": arch, "dtype": "bfloat16", "weights": tag,
            "build_seconds": time.time() - t1, "schedule_report": gpu_pipeline.last_report()}, indent=1))
        print(f"{name}: built in {time.time() - t1:.0f}s, {(out / f'{name}.so').stat().st_size} bytes", flush=True)


def cmd_prep(a) -> int:
    os.environ.pop("NINFER_LIB_CACHE", None)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if not a.only_35b:
        prep_kernels(out, a.arch)
        prep_variants(out, a.arch)
        (out / "tiny").mkdir(exist_ok=True)
        t0 = time.time()
        gpu_bench.prep_tiny(out / "tiny", a.arch, "qwen3_5_moe", 31, save="save_fused_vlm")
        print(f"tiny: {time.time() - t0:.0f}s", flush=True)
    if not a.skip_35b:
        prep_35b(out, a.arch)
    return 0


# ----------------------------------------------------------------------------------------------
def cmd_check(a) -> int:
    tvm, dev = gpu_bench._gpu_tvm()
    out = Path(a.out)
    meta = json.loads((out / "kernels.json").read_text())
    refs = dict(np.load(out / "kernels_ref.npz"))
    lib = tvm.runtime.load_module(str(out / "kernels.so"))
    T = lambda x: tvm.runtime.tensor(np.ascontiguousarray(x), dev)  # noqa: E731
    res = {"device": str(dev), "compute_version": dev.compute_version, "kernels": [], "pass": True}
    weights = {f: [T(w) for w in check_weights(f)] for f in FORMATS}
    ex, pairs = CE + 1, CK + 1
    for n in meta["tokens"]:
        inp = check_inputs(n)
        ids, w = T(np.full((n, CK + 1), -1, np.int32)), T(np.full((n, CK + 1), np.nan, np.float32))
        order, route = T(np.zeros(n * pairs, np.int32)), T(np.zeros(3 * ex + 3, np.int32))
        lib["route"](T(inp["logits"]), ids, w, order, route)
        got_ids, got_w = ids.numpy(), w.numpy()
        same = (got_ids == refs[f"{n}/ids"]).all(1)  # rows routed as llvm routes them (near ties may flip)
        row = {"tokens": n, "topk_rows_differing": int((~same).sum()),
               "topk_weight_err": float(np.abs(got_w[same] - refs[f"{n}/w"][same]).max()) if same.any() else None}
        ok = row["topk_rows_differing"] <= n // 50 and (row["topk_weight_err"] or 0) < 1e-5
        x = T(inp["x"])
        for tag in [t for t in ("bf16_wgmma", "bf16_mma", "nvfp4", "nvfp4_wgmma") if f"gu_{t}" in meta["funcs"]]:
            fmt = "nvfp4" if tag.startswith("nvfp4") else "bf16"
            ws = weights[fmt]
            half = len(ws) // 2
            h = T(np.zeros((n * pairs, CI), _bf16()))
            y = T(np.zeros((n * pairs, CD), _bf16()))
            o = T(np.zeros((n, CD), _bf16()))
            try:
                lib[f"gu_{tag}"](x, order, route, *ws[:half], h)
                lib[f"dn_{tag}"](h, order, route, *ws[half:], y)
                lib["combine"](y, w, o)
                dev.sync()
                ref = refs[f"{n}/{fmt}"]
                err = gc.rel_err(o.numpy().astype(np.float32)[same], ref[same])
                # the down GEMM with the fused combine (route_c: the grouping + zeroed tickets): the same bits
                rc = T(np.full(meta["route_c_len"], -1, np.int32))
                lib["route_c"](T(inp["logits"]), ids, w, order, rc)
                o2, y2 = T(np.zeros((n, CD), _bf16())), T(np.zeros((n * pairs, CD), _bf16()))
                lib[f"gu_{tag}"](x, order, rc, *ws[:half], h)
                lib[f"dc_{tag}"](h, order, rc, *ws[half:], w, x, x, y2, o2)
                dev.sync()
                row[f"{tag}_fused_combine_equal"] = bool(np.array_equal(o2.numpy().view(np.uint16),
                                                                          o.numpy().view(np.uint16)))
                ok &= row[f"{tag}_fused_combine_equal"]
            except Exception as e:  # noqa: BLE001
                err = repr(e)[:300]
            row[tag] = err
            ok &= isinstance(err, float) and err < 2e-2
        row["pass"] = bool(ok)
        res["pass"] &= row["pass"]
        res["kernels"].append(row)
        print(json.dumps(row), flush=True)
    gc.write_result(a.result, res)
    tiny_result = Path(str(a.result).replace(".json", "_tiny.json"))
    rc = gpu_bench.cmd_check(Namespace(out=str(out / "tiny"), result=str(tiny_result), moe=True))
    res["tiny"] = json.loads(tiny_result.read_text())
    res["pass"] &= rc == 0
    gc.write_result(a.result, res)
    print(f"check: {'PASS' if res['pass'] else 'FAIL'}", flush=True)
    return 0 if res["pass"] else 1


def cmd_kernels(a) -> int:
    """Time the grouped expert GEMMs (gate_up + down of one MoE layer) per variant, format and token count."""
    import torch

    tvm, dev = gpu_bench._gpu_tvm()
    out = Path(a.out)
    meta = json.loads((out / "variants.json").read_text())
    lib = tvm.runtime.load_module(str(out / "variants.so"))
    e, k, d, i = Q35B["num_experts"], Q35B["num_experts_per_tok"], Q35B["hidden_size"], Q35B["moe_intermediate_size"]
    ex, pairs = e + 1, k + 1
    res = {"device": torch.cuda.get_device_name(0), "arch": meta["arch"], "rows": []}
    bw, rate = gc.measure_floors(torch)
    res["copy_bandwidth_Bps"], res["bf16_matmul_flops"] = bw, rate
    g = torch.Generator(device="cuda").manual_seed(3)
    D = lambda t: tvm.runtime.from_dlpack(t.contiguous())  # noqa: E731
    weights = {"bf16": [torch.randn((ex, o, kk), device="cuda", generator=g).to(torch.bfloat16) * kk ** -0.5
                        for o, kk in ((2 * i, d), (d, i))]}
    weights["nvfp4"] = []
    for o, kk in ((2 * i, d), (d, i)):
        weights["nvfp4"] += [torch.randint(0, 256, (ex, o, kk // 2), device="cuda", generator=g, dtype=torch.int32)
                             .to(torch.uint8),
                             torch.randint(0x30, 0x38, (ex, o, kk // 16), device="cuda", generator=g, dtype=torch.int32)
                             .to(torch.uint8),
                             torch.full((ex, o), 1.0 / (2.2 * kk ** 0.5), device="cuda")]
    tw = {f: [D(t) for t in ws] for f, ws in weights.items()}
    slot_bytes = {f: sum(t.numel() * t.element_size() for t in ws) / ex for f, ws in weights.items()}
    s_ev, e_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for n in meta["tokens"]:
        routes = []  # a few random routings (a different set of experts per call)
        for r in range(4 if n < 512 else 1):
            logits = torch.randn((n, e + 1), device="cuda", generator=g)
            bufs = [D(logits), D(torch.zeros((n, k + 1), device="cuda", dtype=torch.int32)),
                    D(torch.zeros((n, k + 1), device="cuda")), D(torch.zeros(n * pairs, device="cuda", dtype=torch.int32)),
                    D(torch.zeros(3 * ex + 3, device="cuda", dtype=torch.int32))]
            lib["route"](*bufs)
            routes.append(bufs)
        union = float(np.mean([len(set(torch.from_dlpack(r[1]).cpu().numpy()[:, :k].reshape(-1).tolist())) + 1
                               for r in routes]))
        x = D(torch.randn((n, d), device="cuda", generator=g).to(torch.bfloat16))
        h = D(torch.empty((n * pairs, i), device="cuda", dtype=torch.bfloat16))
        y = D(torch.empty((n * pairs, d), device="cuda", dtype=torch.bfloat16))
        for v in meta["variants"]:
            for f in FORMATS:
                half = len(tw[f]) // 2
                gu, dn = lib[f"gu_{f}_{v}"], lib[f"dn_{f}_{v}"]

                def call(j):
                    r = routes[j % len(routes)]
                    gu(x, r[3], r[4], *tw[f][:half], h)
                    dn(h, r[3], r[4], *tw[f][half:], y)

                dt = _seconds_per_call(call, 20 if n < 512 else 3, torch, s_ev, e_ev)
                row = {"tokens": n, "weights": f, "variant": v, "us": dt * 1e6, "experts_read": union,
                       "GBps": union * slot_bytes[f] / dt / 1e9, "fraction_of_copy_bw": union * slot_bytes[f] / dt / bw,
                       "TFLOPs": 2 * n * pairs * 3 * d * i / dt / 1e12}
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
        if "route_c_len" in meta:
            _time_combine(lib, meta, res, n, routes, x, h, y, tw, D, torch, s_ev, e_ev)
        gc.write_result(a.result, res)
    return 0


def _seconds_per_call(call, reps: int, torch, s_ev, e_ev) -> float:
    """Mean seconds of call(j) over `reps` calls after two warm-up calls (CUDA events)."""
    for j in range(2):
        call(j)
    torch.cuda.synchronize()
    s_ev.record()
    for j in range(reps):
        call(j)
    e_ev.record()
    e_ev.synchronize()
    return s_ev.elapsed_time(e_ev) / 1e3 / reps


def _time_combine(lib, meta, res, n, routes, x, h, y, tw, D, torch, s_ev, e_ev) -> None:
    """One MoE layer's launches after the router GEMV, default parameters: route + gate_up + down + combine (+
    residual) against route (with tickets) + gate_up + the down GEMM with the fused combine."""
    d = Q35B["hidden_size"]
    out = D(torch.empty((n, d), device="cuda", dtype=torch.bfloat16))
    rcs = [D(torch.zeros(meta["route_c_len"], device="cuda", dtype=torch.int32)) for _ in routes]
    for f in FORMATS:
        half = len(tw[f]) // 2
        gu, dn, dc = lib[f"gu_{f}_default"], lib[f"dn_{f}_default"], lib[f"dc_{f}"]

        def unfused(j):
            r = routes[j % len(routes)]
            lib["route"](*r)
            gu(x, r[3], r[4], *tw[f][:half], h)
            dn(h, r[3], r[4], *tw[f][half:], y)
            lib["combine"](y, r[2], x, out)

        def fused(j):
            r, rc = routes[j % len(routes)], rcs[j % len(routes)]
            lib["route_c"](r[0], r[1], r[2], r[3], rc)
            gu(x, r[3], rc, *tw[f][:half], h)
            dc(h, r[3], rc, *tw[f][half:], r[2], x, x, y, out)

        for tag, call in (("route+gu+down+combine", unfused), ("route_c+gu+down_combine", fused)):
            row = {"tokens": n, "weights": f, "layer": tag,
                   "us": _seconds_per_call(call, 20 if n < 512 else 3, torch, s_ev, e_ev) * 1e6}
            res.setdefault("layer_rows", []).append(row)
            print(json.dumps(row), flush=True)


# ----------------------------------------------------------------------------------------------
def _byte_budget(cfg: dict, nbytes: dict) -> dict:
    """Weights read per decode step outside the experts, per-slot expert bytes, MoE layers, matmul params."""
    e = cfg["num_experts"]
    slots = e + (1 if cfg["shared_expert_intermediate_size"] == cfg["moe_intermediate_size"] else 0)
    expert = sum(v for k, v in nbytes.items() if ".mlp.experts." in k)
    moe_layers = len({k.split(".mlp.experts.")[0] for k in nbytes if ".mlp.experts." in k})
    dense = sum(v for k, v in nbytes.items() if ".mlp.experts." not in k and "embed_tokens" not in k)
    return {"dense_bytes": dense, "expert_slot_bytes": expert / max(1, moe_layers * slots), "moe_layers": moe_layers,
            "expert_slots": slots}


def _matmul_params(specs, cfg: dict) -> tuple[float, float]:
    """(dense matmul parameters per token outside embedding / lm_head / experts, parameters of one expert of one
    layer)."""
    d, i = cfg["hidden_size"], cfg["moe_intermediate_size"]
    dense = 0
    for name, shape, dtype in specs:
        if len(shape) != 2 or "embed_tokens" in name or name.startswith("lm_head") or ".mlp.experts." in name:
            continue
        if name.endswith(".weight_scale") or "conv1d" in name:
            continue
        dense += shape[0] * shape[1] * (2 if dtype == "uint8" else 1)
    return float(dense), float(3 * d * i)


def bench_weights(a, tag: str, torch, tvm, dev, floors) -> dict:
    from tvm.runtime.vm import VirtualMachine

    from ninfer_mlc.runtime.executor.cuda_graph import GraphedFunction, page_width_bucket
    from ninfer_mlc.runtime.executor.inputs import StepInputs

    out = Path(a.out)
    name = "q35b" if tag == "bf16" else f"q35b_{tag}"
    meta = json.loads((out / f"{name}.json").read_text())
    cfg, specs = meta["config"], meta["params"]
    bw, rate = floors
    res = {"weights": tag, "library_bytes": (out / f"{name}.so").stat().st_size, "decode": []}
    t0 = time.time()
    lib = tvm.runtime.load_module(str(out / f"{name}.so"))
    vm = VirtualMachine(lib, dev)
    tparams, keep, nbytes = gpu_bench._gen_params(torch, specs, cfg)
    params = [tvm.runtime.from_dlpack(t) for t in tparams]
    torch.cuda.synchronize()
    res["load_and_param_gen_seconds"] = time.time() - t0
    res["weights_bytes"] = sum(nbytes.values())
    budget = _byte_budget(cfg, nbytes)
    res.update(budget)

    lt = cfg["layer_types"]
    n_attn, n_gdn = lt.count("full_attention"), lt.count("linear_attention")
    hkv, dh = cfg["num_key_value_heads"], cfg["head_dim"]
    hv, dk, dv = cfg["linear_num_value_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    conv_dim = 2 * cfg["linear_num_key_heads"] * dk + hv * dv
    batches = [int(x) for x in a.batches.split(",")]
    ctxs = [c for c in (a.ctx, a.long_ctx) if c]
    page_bytes = n_attn * 2 * hkv * PAGE * dh * 2
    want = max(b * -(-c // PAGE) for b in batches for c in ctxs) + 1
    fit = int((torch.cuda.mem_get_info()[0] - a.reserve_gib * 2 ** 30) // page_bytes)
    num_pages = max(min(want, fit), max(batches) * -(-a.ctx // PAGE) + 1)
    slots = max(batches) + 1
    kv = torch.empty((num_pages, n_attn, 2, hkv, PAGE, dh), device="cuda", dtype=torch.bfloat16).normal_()
    conv = torch.randn((slots, n_gdn, conv_dim, 3), device="cuda", dtype=torch.bfloat16) * 0.1
    ssm = torch.randn((slots, n_gdn, hv, dk, dv), device="cuda", dtype=torch.float32) * 0.01
    pools = [tvm.runtime.from_dlpack(t) for t in (kv, conv, ssm)]
    res["kv_pool_pages"] = num_pages
    kv_per_tok = n_attn * 2 * hkv * dh * 2
    state_rw = n_gdn * (hv * dk * dv * 4 + conv_dim * 3 * 2) * 2
    e, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    graphs = GraphedFunction(tvm, dev, vm["decode"])
    persistent = pools + [params]
    inputs = StepInputs(tvm, dev, max(batches), page_width_bucket(-(-max(ctxs) // PAGE)))

    def T(x):
        return tvm.runtime.tensor(np.ascontiguousarray(x, np.int32), dev)

    for c in ctxs:
        for b in batches:
            npg = -(-c // PAGE)
            if b * npg + 1 > num_pages:
                res["decode"].append({"batch": b, "ctx": c, "skipped": "KV pool"})
                continue
            seqs = [SimpleNamespace(uid=100_000 * b + c + i, slot=i, pages=list(range(i * npg, (i + 1) * npg)),
                                    length=c - 1) for i in range(b)]
            toks = np.random.default_rng(b).integers(0, cfg["vocab_size"], b).astype(np.int32).tolist()
            args = list(inputs.decode(seqs, toks, page_width_bucket)) + persistent
            for _ in range(2):
                vm["decode"](*args)
            dev.sync()
            ts = time.perf_counter()
            for _ in range(a.steps):
                vm["decode"](*args)
            dev.sync()
            eager = (time.perf_counter() - ts) / a.steps
            for _ in range(3):  # eager, capture + launch, replay (inputs staged in persistent buffers)
                o = graphs(inputs.decode(seqs, toks, page_width_bucket), persistent)
            dev.sync()
            ts = time.perf_counter()
            for _ in range(a.steps):
                o = graphs(inputs.decode(seqs, toks, page_width_bucket), persistent)
            dev.sync()
            dt = (time.perf_counter() - ts) / a.steps
            union = e * (1 - (1 - k / e) ** b)
            byts = budget["dense_bytes"] + budget["moe_layers"] * (union + budget["expert_slots"] - e) * \
                budget["expert_slot_bytes"] + b * c * kv_per_tok + b * state_rw
            floor = byts / bw
            row = {"batch": b, "ctx": c, "step_ms": dt * 1e3, "tok_s": b / dt, "step_ms_eager": eager * 1e3,
                   "expected_expert_union": union, "bytes_per_step": byts, "floor_ms": floor * 1e3,
                   "fraction_of_floor": floor / dt, "logits_finite": bool(np.isfinite(o[0].numpy()).all())}
            res["decode"].append(row)
            print(f"[{tag}] decode b={b} ctx={c}: {dt * 1e3:.2f} ms/step, {b / dt:.0f} tok/s, floor {floor * 1e3:.2f} ms "
                  f"({100 * floor / dt:.0f}%; eager {eager * 1e3:.2f} ms)", flush=True)
    res["cuda_graph_stats"] = dict(graphs.stats, last_error=graphs.last_error)
    if a.profile:
        b = max(batches)
        npg = -(-a.ctx // PAGE)
        dargs = (T(np.arange(b) + 11), T(np.full(b, a.ctx - 1)), T(np.arange(b * npg).reshape(b, -1)), T(np.arange(b)),
                 *pools, params)
        res["profile_decode"] = gpu_bench._profile(torch, lambda: vm["decode"](*dargs), f"[{tag}] decode b={b}")

    n = a.prefill
    if n and -(-n // PAGE) <= num_pages:
        dense_p, slot_p = _matmul_params(specs, cfg)
        active = dense_p + budget["moe_layers"] * (budget["expert_slots"] - e + k) * slot_p  # + the shared expert
        flops = 2 * n * active + n_attn * 4 * cfg["num_attention_heads"] * dh * n * (n + 1) / 2 \
            + 2 * cfg["vocab_size"] * cfg["hidden_size"]
        pt = np.arange(-(-n // PAGE), dtype=np.int32).reshape(1, -1)
        toks = np.random.default_rng(7).integers(0, cfg["vocab_size"], n)
        pargs = (T(toks), T(np.arange(n)), T(np.zeros(n)), T([0, n]), T(pt), T([0]), T([n - 1]), *pools, params)
        times = []
        for _ in range(2):  # the first call also sizes the allocator pools
            ssm.zero_()
            conv.zero_()
            torch.cuda.synchronize()
            ts = time.perf_counter()
            o = vm["prefill"](*pargs)
            dev.sync()
            times.append(time.perf_counter() - ts)
        s = min(times)
        res["prefill"] = {"tokens": n, "seconds": s, "all_seconds": times, "tok_s": n / s, "flops": flops,
                          "active_matmul_params": active,
                          "floor_seconds": flops / rate, "fraction_of_floor": flops / rate / s,
                          "logits_finite": bool(np.isfinite(o[0].numpy()).all())}
        print(f"[{tag}] prefill {n}: {s:.3f}s = {n / s:.0f} tok/s (floor {flops / rate:.3f}s, "
              f"{100 * flops / rate / s:.1f}%)", flush=True)
        if a.profile:
            res["profile_prefill"] = gpu_bench._profile(torch, lambda: vm["prefill"](*pargs), f"[{tag}] prefill {n}")
    del graphs, vm, lib, params, tparams, keep, pools, kv, conv, ssm
    torch.cuda.empty_cache()
    return res


def cmd_bench(a) -> int:
    import torch

    tvm, dev = gpu_bench._gpu_tvm()
    res = {"device": torch.cuda.get_device_name(0), "geometry": Q35B, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "runs": []}
    floors = gc.measure_floors(torch)
    res["copy_bandwidth_Bps"], res["bf16_matmul_flops"] = floors
    print(f"floors: copy {floors[0] / 1e12:.2f} TB/s, bf16 matmul {floors[1] / 1e12:.0f} TFLOP/s", flush=True)
    for tag in a.weights.split(","):
        try:
            res["runs"].append(bench_weights(a, tag, torch, tvm, dev, floors))
        except Exception as e:  # noqa: BLE001 - the other format still runs
            res["runs"].append({"weights": tag, "error": repr(e)[:600]})
            print(f"[{tag}] ERROR {e!r}"[:800], flush=True)
        gc.write_result(a.result, res)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prep")
    p.add_argument("out")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--skip-35b", action="store_true")
    p.add_argument("--only-35b", action="store_true")
    c = sub.add_parser("check")
    c.add_argument("out")
    c.add_argument("result")
    kv = sub.add_parser("kernels")
    kv.add_argument("out")
    kv.add_argument("result")
    b = sub.add_parser("bench")
    b.add_argument("out")
    b.add_argument("result")
    b.add_argument("--weights", default="bf16,nvfp4")
    b.add_argument("--ctx", type=int, default=8192)
    b.add_argument("--long-ctx", type=int, default=131072)
    b.add_argument("--batches", default="1,4,8")
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--prefill", type=int, default=8192)
    b.add_argument("--reserve-gib", type=float, default=10.0, help="device memory left beside the KV pool")
    b.add_argument("--profile", action="store_true", help="CUPTI kernel breakdown of a decode step and the prefill")
    a = ap.parse_args(argv)
    return {"prep": cmd_prep, "check": cmd_check, "kernels": cmd_kernels, "bench": cmd_bench}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
