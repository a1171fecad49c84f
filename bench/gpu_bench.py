"""GPU checks and benchmarks for the CUDA builds (see bench/README.md).

Three steps; `prep` runs where the compiler is (no GPU needed), the others on the GPU machine with
only the TVM *runtime* (TVM_USE_RUNTIME_LIB=1) plus numpy, ml_dtypes and torch:

  prep  OUT  [--arch sm_90] [--skip-27b]
        OUT/kernels.so + kernels.npz   hand-written CUDA kernels, and their inputs and the outputs
                                       of the llvm kernels (same contract) on those inputs
        OUT/tiny-{f32,bf16}/            tiny Qwen3.5 artifacts built for cuda:ARCH
        OUT/tiny_ref.npz               HF (f32) and our llvm (f32, bf16) logits for fixed scenarios
        OUT/q27b.so + q27b.json         the full Qwen3.x-27B geometry (bf16) and its parameter list
  check OUT RESULT.json                 kernels vs llvm reference, tiny model vs HF / llvm
  bench OUT RESULT.json [--ctx 8192] [--long-ctx 131072] [--batches 1,2,4,8]
        27B geometry with random weights generated on the GPU (torch), decode tok/s, prefill
        tok/s, memory, measured copy bandwidth and bf16 matmul rate, roofline ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

import gpu_common as gc

ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------------------------
# Full-size geometry (Qwen3.x-27B text decoder)
Q27B = {
    "architectures": ["Qwen3_5ForCausalLM"], "model_type": "qwen3_5_text", "vocab_size": 248320,
    "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 64, "full_attention_interval": 4,
    "num_attention_heads": 24, "num_key_value_heads": 4, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 48, "linear_key_head_dim": 128,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "tie_word_embeddings": False,
}
PAGE = 64


# rows one prefill call of the bench libraries takes (their memory is planned for it: compile/memory_bounds.py);
# the bench prefills 8k prompts in one call and longer ones in chunks of this size
PREFILL_ROWS = 8192

def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def _np_dt(dt: str):
    return _bf16() if dt == "bfloat16" else np.dtype(dt)


def _pack(arrs: dict) -> dict:
    """npz cannot hold bfloat16: store it as uint16 with a marker key."""
    out = {}
    for k, a in arrs.items():
        if a.dtype == _bf16():
            out[k + "@bf16"] = a.view(np.uint16)
        else:
            out[k] = a
    return out


def _unpack(z) -> dict:
    out = {}
    for k in z.files:
        if k.endswith("@bf16"):
            out[k[:-5]] = z[k].view(_bf16())
        else:
            out[k] = z[k]
    return out


rel_err = gc.rel_err


# ----------------------------------------------------------------------------------------------
# Kernel cases: (name, factory kind, factory args, input builder)
def _kernel_cases():
    """Small shapes that still cross every boundary: pages, KV splits (one and several pages per
    split, a partial last split), GQA groups of 6, GDN chunks (32) and ragged rows."""
    cases = []
    for dt in ("float32", "bfloat16"):
        cases.append(dict(name=f"attn27_prefill_{dt}", kind="paged_attention", geo=(24, 4, 256), dtype=dt,
                          rows=[(100, 37), (0, 20)], layers=1))
        cases.append(dict(name=f"attn27_decode_{dt}", kind="paged_attention", geo=(24, 4, 256), dtype=dt,
                          rows=[(300, 1), (63, 1), (0, 1)], layers=1))
        cases.append(dict(name=f"conv_{dt}", kind="causal_conv", conv_dim=640, dtype=dt, lens=[5, 1, 70]))
        cases.append(dict(name=f"conv_decode_{dt}", kind="causal_conv", conv_dim=640, dtype=dt, lens=[1, 1]))
    cases.append(dict(name="attn27_split_bfloat16", kind="paged_attention", geo=(24, 4, 256), dtype="bfloat16",
                      rows=[(700, 1)], layers=1, target_blocks=16))
    cases.append(dict(name="attn_tiny_float32", kind="paged_attention", geo=(4, 2, 32), dtype="float32",
                      rows=[(40, 30), (150, 1)], layers=2))
    cases.append(dict(name="chunk27", kind="chunked_delta_rule", geo=(2, 6, 128, 128), lens=[70, 33, 5]))
    cases.append(dict(name="chunk_tiny", kind="chunked_delta_rule", geo=(2, 6, 16, 8), lens=[150, 64]))
    cases.append(dict(name="step27", kind="recurrent_delta_rule", geo=(2, 6, 128, 128), b=3))
    cases.append(dict(name="step_tiny", kind="recurrent_delta_rule", geo=(2, 6, 16, 8), b=2))
    return cases


def _case_func(case, ks, cuda=False):
    k = case["kind"]
    if k == "paged_attention":
        hq, hkv, d = case["geo"]
        extra = {"target_blocks": case["target_blocks"]} if cuda and "target_blocks" in case else {}
        return ks.paged_attention(hq, hkv, d, PAGE, case["layers"], case["dtype"], d ** -0.5, **extra)
    if k == "causal_conv":
        return ks.causal_conv(case["conv_dim"], 4, 2, case["dtype"])
    if k == "chunked_delta_rule":
        return ks.chunked_delta_rule(*case["geo"], 2)
    return ks.recurrent_delta_rule(*case["geo"], 2)


def _case_inputs(case, rng):
    """(args list of numpy arrays with the layer int in place, indices of in-place/outputs)."""
    k = case["kind"]
    layer = 1
    if k == "paged_attention":
        hq, hkv, d = case["geo"]
        dt = _np_dt(case["dtype"])
        rows = case["rows"]
        layer = case["layers"] - 1
        n = sum(c for _, c in rows)
        need = [-(-(o + c) // PAGE) for o, c in rows]
        p = max(need)
        npages = sum(need) + 1
        perm = rng.permutation(npages)
        pt = np.zeros((len(rows), p), np.int32)
        pos, tseq, used = [], [], 0
        for r, (old, cnt) in enumerate(rows):
            pt[r, :need[r]] = perm[used:used + need[r]]
            used += need[r]
            pos += list(range(old, old + cnt))
            tseq += [r] * cnt
        q = (rng.standard_normal((n, hq, d)) * 1.5).astype(dt)
        kk = rng.standard_normal((n, hkv, d)).astype(dt)
        v = rng.standard_normal((n, hkv, d)).astype(dt)
        pool = rng.standard_normal((npages, case["layers"], 2, hkv, PAGE, d)).astype(dt)
        out = np.full((n, hq, d), np.nan, dt)
        return [q, kk, v, np.array(pos, np.int32), np.array(tseq, np.int32), pt, pool, layer, out], [6, 8]
    if k == "causal_conv":
        c = case["conv_dim"]
        dt = _np_dt(case["dtype"])
        lens = case["lens"]
        n = sum(lens)
        cu = gc.cu_seqlens(lens)
        slots = rng.permutation(len(lens) + 2)[:len(lens)].astype(np.int32)
        x = rng.standard_normal((n, c)).astype(dt)
        pool = rng.standard_normal((len(lens) + 2, 2, c, 3)).astype(dt)
        w = (rng.standard_normal((c, 4)) * 0.5).astype(dt)
        out = np.full((n, c), np.nan, dt)
        return [x, cu, slots, pool, w, layer, out], [3, 6]
    if k == "chunked_delta_rule":
        hk, hv, dk, dv = case["geo"]
        lens = case["lens"]
        n = sum(lens)
        cu = gc.cu_seqlens(lens)
        slots = rng.permutation(len(lens) + 1)[:len(lens)].astype(np.int32)
        q, kk = gc.l2_qk(rng, n, hk, dk)
        v = rng.standard_normal((n, hv, dv)).astype(np.float32)
        g = -rng.uniform(0.01, 0.5, (n, hv)).astype(np.float32)
        beta = rng.uniform(0.1, 0.9, (n, hv)).astype(np.float32)
        ssm = (rng.standard_normal((len(lens) + 1, 2, hv, dk, dv)) * 0.3).astype(np.float32)
        o = np.full((n, hv, dv), np.nan, np.float32)
        return [q, kk, v, g, beta, cu, slots, ssm, layer, o], [7, 9]
    hk, hv, dk, dv = case["geo"]
    b = case["b"]
    slots = rng.permutation(b + 1)[:b].astype(np.int32)
    q, kk = gc.l2_qk(rng, b, hk, dk)
    v = rng.standard_normal((b, hv, dv)).astype(np.float32)
    g = -rng.uniform(0.01, 0.5, (b, hv)).astype(np.float32)
    beta = rng.uniform(0.1, 0.9, (b, hv)).astype(np.float32)
    ssm = (rng.standard_normal((b + 1, 2, hv, dk, dv)) * 0.3).astype(np.float32)
    o = np.full((b, hv, dv), np.nan, np.float32)
    return [q, kk, v, g, beta, slots, ssm, layer, o], [6, 8]


def _run_case(mod_func, args, tvm, dev, check_idx):
    targs = [a if isinstance(a, int) else tvm.runtime.tensor(np.ascontiguousarray(a), dev) for a in args]
    mod_func(*targs)
    return {i: targs[i].numpy() for i in check_idx}


# ----------------------------------------------------------------------------------------------
# Tiny-model scenarios (the same calls as tests/test_parity_hf.py)
PROMPT, STEPS = 150, 18


def tiny_ids(vocab: int) -> list[int]:
    rng = np.random.default_rng(5)
    return rng.integers(0, vocab, PROMPT + STEPS).tolist()


def run_scenarios(runner, ids) -> dict:
    out = {}
    seq = runner.new_seq()
    (out["prefill_all"],) = runner.prefill([(seq, ids[:PROMPT])], all_logits=True)
    runner.free_seq(seq)
    seq = runner.new_seq()
    dec = [runner.prefill([(seq, ids[:PROMPT])])[0]]
    for t in range(PROMPT, PROMPT + STEPS):
        dec.append(runner.decode([seq], [ids[t]])[0])
    runner.free_seq(seq)
    out["decode"] = np.stack(dec)  # rows: logits at positions PROMPT-1 .. PROMPT+STEPS-1
    seq = runner.new_seq()
    runner.prefill([(seq, ids[:37])])
    runner.prefill([(seq, ids[37:101])])
    (out["chunked_tail"],) = runner.prefill([(seq, ids[101:PROMPT])], all_logits=True)
    runner.free_seq(seq)
    lens, starts = [150, 70, 9], [0, 3, 40]
    feeds = np.random.default_rng(3).integers(0, runner.vocab_size, size=(3, 16)).tolist()
    seqs = [runner.new_seq() for _ in lens]
    first = runner.prefill([(s, ids[a:a + n]) for s, a, n in zip(seqs, starts, lens)])
    tog = [[lg] for lg in first]
    for k in range(16):
        lg = runner.decode(seqs, [f[k] for f in feeds])
        for i in range(3):
            tog[i].append(lg[i])
    for s in seqs:
        runner.free_seq(s)
    for i in range(3):
        out[f"batched_{i}"] = np.stack(tog[i])
    if runner.has_verify:  # speculative rounds: 3 verifies (and MTP steps) of one shape: eager, capture, replay
        seq = runner.new_seq()
        _, (h,) = runner.prefill_h([(seq, ids[:PROMPT])])
        rows, hid = [], []
        for j in range(3):
            (lg,), (hv,) = runner.verify([(seq, ids[PROMPT + 4 * j: PROMPT + 4 * j + 4])])
            rows.append(lg)
            hid.append(hv)
        out["verify"] = np.concatenate(rows)
        if runner.has_mtp:
            mtp, hm = [], hid[-1][-1:]
            for j in range(3):
                lg, hm = runner.mtp_step([seq], hm, [ids[j]], [seq.length - 1])
                mtp.append(lg[0])
            out["mtp_step"] = np.stack(mtp)
        runner.free_seq(seq)
    return out


# ----------------------------------------------------------------------------------------------
def cmd_prep(a):
    os.environ.pop("NINFER_LIB_CACHE", None)
    import tvm

    from ninfer_mlc.compile.kernels.registry import kernel_set
    from ninfer_mlc.compile.targets import cuda_build_env, parse_target

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    arch = a.arch
    t0 = time.time()
    if getattr(a, "only_27b", False):
        return _prep_27b(a, out, arch)
    # 1. kernels: CUDA module + llvm reference outputs
    cks = kernel_set("cuda")
    lks = kernel_set("llvm")
    rng = np.random.default_rng(1234)
    cfuncs, lfuncs, data = {}, {}, {}
    cases = _kernel_cases()
    for c in cases:
        cfuncs[c["name"]] = _case_func(c, cks, cuda=True).with_attr("global_symbol", c["name"])
        lfuncs[c["name"]] = _case_func(c, lks).with_attr("global_symbol", c["name"])
    tgt = parse_target("cuda:" + arch).tvm_target()
    with cuda_build_env(tgt):
        kex = tvm.compile(tvm.IRModule(cfuncs), target=tgt)
    kex.export_library(str(out / "kernels.so"))
    lmod = tvm.compile(tvm.IRModule(lfuncs), target=tvm.target.Target({"kind": "llvm"}))
    cpu = tvm.cpu()
    meta = {}
    for c in cases:
        args, idx = _case_inputs(c, rng)
        for i, x in enumerate(args):
            if isinstance(x, int):
                continue
            if i == idx[-1]:  # the output buffer (NaN-poisoned): rebuilt from shape and dtype
                meta_out = {"shape": list(x.shape), "dtype": str(x.dtype)}
            else:
                data[f"{c['name']}/in{i}"] = x
        res = _run_case(lmod[c["name"]], args, tvm, cpu, idx)
        for i, r in res.items():
            if i == idx[0]:  # in-place buffer: keep only what the kernel changed
                flat_in, flat_r = args[i].reshape(-1), r.reshape(-1)
                changed = np.nonzero(flat_in != flat_r)[0]
                data[f"{c['name']}/diffidx{i}"] = changed.astype(np.int32)
                data[f"{c['name']}/diffval{i}"] = flat_r[changed]
            else:
                data[f"{c['name']}/ref{i}"] = r
        li = next(i for i, x in enumerate(args) if isinstance(x, int))
        meta[c["name"]] = {"nargs": len(args), "layer_index": li, "layer": args[li], "check": idx, "out": meta_out}
    np.savez_compressed(out / "kernels.npz", **_pack(data))
    (out / "kernels.json").write_text(json.dumps(meta))
    print(f"kernels: {len(cases)} cases, {time.time() - t0:.1f}s", flush=True)

    # 2. tiny model artifacts + references
    prep_tiny(out, arch, "qwen3_5", 11)
    print(f"tiny: {time.time() - t0:.1f}s", flush=True)

    # 3. full-size library
    if not a.skip_27b:
        _prep_27b(a, out, arch)


def prep_tiny(out: Path, arch: str, family: str, seed: int, save: str = "save_hf") -> None:
    """tests/hf_tiny.py's `family` model: OUT/tiny-{f32,bf16} built for cuda:ARCH and OUT/tiny_ref.npz (HF logits
    and the llvm builds' run_scenarios outputs), what cmd_check compares. save: the hf_tiny checkpoint writer."""
    import torch

    sys.path.insert(0, str(ROOT / "tests"))
    import hf_tiny

    from ninfer_mlc.compile.build import compile_model
    from ninfer_mlc.compile.kernels.cuda.registry import kernel_params
    from ninfer_mlc.compile.kernels.registry import llvm_norm_gemv_scope
    from ninfer_mlc.runtime.harness import Harness

    # the llvm references fold decode's norms where the CUDA build does (kernels.fused.norm_gemv), with its
    # roundings (compile/kernels/norm_gemv.py): the check then compares like with like at its tight bound
    kp = kernel_params(arch)
    fold_min_k = kp["norm_gemv"]["min_k"] if kp["fused"]["norm_gemv"] else None
    model = hf_tiny.make_hf_model(family, seed=seed)
    hf_dir = getattr(hf_tiny, save)(model, out / "_hf_tiny")
    ids = tiny_ids(model.config.vocab_size)
    refs = {}
    with torch.no_grad():
        refs["hf"] = model(torch.tensor([ids])).logits[0].numpy()
    for quant in ("f32", "bf16"):
        compile_model(hf_dir, target="cuda:" + arch, quant=quant, out_dir=out / f"tiny-{quant}",
                      name=f"tiny-{quant}", log=lambda *_: None)
        with llvm_norm_gemv_scope(fold_min_k):
            lart = compile_model(hf_dir, target="llvm", quant=quant, out_dir=out / f"_llvm-{quant}",
                                 name=f"llvm-{quant}", log=lambda *_: None)
        r = Harness(lart, kv_capacity_tokens=2048, num_slots=6)
        for k, v in run_scenarios(r, ids).items():
            refs[f"llvm_{quant}/{k}"] = v
    refs["ids"] = np.array(ids, np.int32)
    refs["llvm_norm_gemv_min_k"] = np.array(-1 if fold_min_k is None else fold_min_k, np.int64)
    np.savez(out / "tiny_ref.npz", **refs)


def _prep_27b(a, out: Path, arch: str):
    from ninfer_mlc.compile import gpu_pipeline
    from ninfer_mlc.compile.build import build_library
    from ninfer_mlc.compile.config import parse_config
    from ninfer_mlc.compile.targets import parse_target

    cfg = parse_config(Q27B)
    t1 = time.time()
    specs = build_library(cfg, a.dtype, parse_target("cuda:" + arch), out / "q27b.so", max_rows=PREFILL_ROWS)
    (out / "q27b.json").write_text(json.dumps({
        "config": cfg.to_dict(), "params": specs, "arch": arch, "dtype": a.dtype, "build_seconds": time.time() - t1,
        "schedule": gpu_pipeline.schedule_for(parse_target("cuda:" + arch).tvm_target()),
        "schedule_report": gpu_pipeline.last_report()}, indent=1))
    print(f"27b ({a.dtype}): built in {time.time() - t1:.1f}s, {(out / 'q27b.so').stat().st_size} bytes", flush=True)


# ----------------------------------------------------------------------------------------------
def _gpu_tvm():
    from ninfer_mlc.runtime.tvm_loader import import_tvm

    tvm = import_tvm("cuda")
    return tvm, tvm.cuda(0)


def cmd_check(a):
    tvm, dev = _gpu_tvm()
    out = Path(a.out)
    res = {"device": str(dev), "compute_version": dev.compute_version, "kernels": {}, "tiny": {}}
    ok = True
    # kernels (optional: a prep folder without kernels.so checks only the tiny model)
    have_kernels = (out / "kernels.so").is_file()
    lib = tvm.runtime.load_module(str(out / "kernels.so")) if have_kernels else None
    data = _unpack(np.load(out / "kernels.npz")) if have_kernels else {}
    meta = json.loads((out / "kernels.json").read_text()) if have_kernels else {}
    for name, m in meta.items():
        args = []
        for i in range(m["nargs"]):
            if i == m["layer_index"]:
                args.append(m["layer"])
            elif i == m["check"][-1]:
                args.append(np.full(m["out"]["shape"], np.nan, _np_dt(m["out"]["dtype"])))
            else:
                args.append(data[f"{name}/in{i}"])
        try:
            got = _run_case(lib[name], args, tvm, dev, m["check"])
            dev.sync()
            ip = m["check"][0]
            ref_ip = np.array(args[ip]).reshape(-1).copy()
            ref_ip[data[f"{name}/diffidx{ip}"]] = data[f"{name}/diffval{ip}"]
            refs = {ip: ref_ip.reshape(args[ip].shape)}
            refs.update({i: data[f"{name}/ref{i}"] for i in m["check"][1:]})
            errs = {str(i): rel_err(got[i], refs[i]) for i in m["check"]}
        except Exception as e:  # noqa: BLE001
            errs = {"error": repr(e)[:400]}
        tol = 2e-2 if "bfloat16" in name else 1e-4
        passed = "error" not in errs and all(v < tol for v in errs.values())
        ok &= passed
        res["kernels"][name] = {"rel_err": errs, "tol": tol, "pass": passed}
        print(f"kernel {name:28s} {'PASS' if passed else 'FAIL'} {errs}", flush=True)
    # tiny model
    from ninfer_mlc.runtime.harness import Harness

    ref = dict(np.load(out / "tiny_ref.npz"))
    ids = ref["ids"].tolist()
    hf = ref["hf"]
    fold = int(ref.get("llvm_norm_gemv_min_k", -1))  # prep's llvm references folded the norms like the CUDA build
    res["llvm_norm_gemv_min_k"] = None if fold < 0 else fold
    print(f"tiny references: llvm norms {'folded (min_k %d)' % fold if fold >= 0 else 'separate'}", flush=True)
    for quant in ("f32", "bf16"):
        art = out / f"tiny-{quant}"
        try:
            r = Harness(art, kv_capacity_tokens=2048, num_slots=6)  # decode through CUDA graphs
            got = run_scenarios(r, ids)
            graph_stats = dict(r.decode_graphs.stats) if r.decode_graphs else None
            r_eager = Harness(art, kv_capacity_tokens=2048, num_slots=6, cuda_graphs=False)
            eager = run_scenarios(r_eager, ids)
            del r_eager
        except Exception as e:  # noqa: BLE001
            res["tiny"][quant] = {"error": repr(e)[:600]}
            ok = False
            print(f"tiny {quant}: ERROR {e!r}"[:800], flush=True)
            continue
        e = {
            "prefill_vs_hf": rel_err(got["prefill_all"], hf[:PROMPT]),
            "decode_vs_hf": rel_err(got["decode"], hf[PROMPT - 1:PROMPT + STEPS]),
            "chunked_vs_hf": rel_err(got["chunked_tail"], hf[101:PROMPT]),
        }
        for k in got:
            e[f"{k}_vs_llvm_{quant}"] = rel_err(got[k], ref[f"llvm_{quant}/{k}"])
        # graph replays run the very same kernels: decode logits must match the eager VM bit for bit
        e["graphs_vs_eager_maxabs"] = max(float(np.abs(got[k] - eager[k]).max()) for k in got)
        e["llvm_prefill_vs_hf"] = rel_err(ref[f"llvm_{quant}/prefill_all"], hf[:PROMPT])
        # bf16: the tiny random model amplifies rounding (our llvm bf16 build is itself ~0.3 off HF),
        # so bf16 is judged against the llvm bf16 build and against llvm's own distance to HF
        for k in ("prefill_all", "decode"):
            e[f"{k}_top1_agree_llvm"] = float(np.mean(got[k].argmax(-1) == ref[f"llvm_{quant}/{k}"].argmax(-1)))
        # MoE libraries group (token, expert) pairs with atomics: pair order, hence summation order, varies from
        # call to call, so MoE logits may differ in the last bits between any two runs (graphs or not)
        moe = bool(getattr(a, "moe", False))
        graphs_ok = e["graphs_vs_eager_maxabs"] <= (1e-5 if moe else 0.0) and bool(graph_stats and graph_stats["replays"] > 0)
        for name, g in (("verify", r.verify_graphs), ("mtp_step", r.mtp_graphs)):
            if g is not None:  # the speculative functions replayed too
                graph_stats[f"{name}_replays"] = g.stats["replays"]
                graphs_ok &= g.stats["replays"] > 0
        if quant == "f32":
            passed = graphs_ok and all(v < 1e-3 for k, v in e.items() if "top1" not in k)
        else:
            base = e["llvm_prefill_vs_hf"]
            near_llvm = all(v < 0.1 for k, v in e.items() if "vs_llvm" in k)
            if moe:  # bf16 rounding flips near-tied routing choices of the tiny random router: judge agreement
                near_llvm = all(v >= 0.8 for k, v in e.items() if "top1_agree" in k)
            passed = graphs_ok and near_llvm and \
                all(v < 1.5 * base + 0.02 for k, v in e.items() if k.endswith("vs_hf") and not k.startswith("llvm"))
        tol_hf = tol_llvm = None
        ok &= passed
        res["tiny"][quant] = {"rel_err": e, "pass": passed, "tol_hf": tol_hf, "tol_llvm": tol_llvm,
                              "cuda_graphs": graph_stats}
        print(f"tiny {quant}: {'PASS' if passed else 'FAIL'} " + ", ".join(f"{k}={v:.2e}" for k, v in e.items()),
              flush=True)
    res["pass"] = ok
    gc.write_result(a.result, res)
    return 0 if ok else 1


# ----------------------------------------------------------------------------------------------
def _measure_floors(torch):
    """Device-to-device copy bandwidth (bytes read + written) and bf16 matmul rate, random data."""
    return gc.measure_floors(torch)


def _gen_params(torch, specs, cfg):
    """Random weights made on the GPU (nothing large travels). Scales keep activations finite. Matrices of any
    rank (MoE expert arrays [experts, out, in]) scale by their last axis; NVFP4 parameters (uint8 codes, E4M3
    block scales, fp32 row scales) get random codes, scales in [0.5, 1) and row scales giving unit-variance rows."""
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    out, keep, nbytes = [], [], {}
    rot = int(cfg["head_dim"] * float(cfg["rope"].get("partial_rotary_factor", 1.0)))
    theta = float(cfg["rope"].get("rope_theta", 1e4))
    tmap = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "uint8": torch.uint8}
    shapes = {name: shape for name, shape, _ in specs}
    for name, shape, dtype in specs:
        tdt = tmap[dtype]
        if dtype == "uint8":  # NVFP4 codes (two E2M1 per byte) or E4M3 block scales 0x30..0x37 (0.5 .. 0.94)
            lo, hi = (0x30, 0x38) if name.endswith(".weight_scale") else (0, 256)
            t = torch.randint(lo, hi, shape, device="cuda", dtype=torch.int32, generator=g).to(torch.uint8)
        elif name.endswith(".weight_scale_2"):  # E2M1 x E4M3 of random codes / scales has rms ~2.2
            fan_in = 2 * shapes[name[: -len("_scale_2")]][-1]
            t = torch.full(shape, 1.0 / (2.2 * fan_in ** 0.5), device="cuda", dtype=tdt)
        elif name.endswith("rope_inv_freq"):
            t = (1.0 / theta ** (torch.arange(0, rot, 2, device="cuda", dtype=torch.float32) / rot)).contiguous()
        elif name.endswith("rope_attn_factor"):
            t = torch.ones(shape, device="cuda", dtype=torch.float32)
        elif name.endswith("A_log"):
            t = torch.empty(shape, device="cuda", dtype=tdt).uniform_(1.0, 16.0, generator=g).log_()
        elif name.endswith("dt_bias"):
            t = torch.randn(shape, device="cuda", dtype=tdt, generator=g) * 0.5
        elif "norm" in name:
            t = 1.0 + 0.05 * torch.randn(shape, device="cuda", dtype=tdt, generator=g)
        elif "conv1d" in name:
            t = torch.randn(shape, device="cuda", dtype=tdt, generator=g) * 0.3
        else:
            fan_in = shape[-1] if len(shape) >= 2 and "embed" not in name else 1
            t = torch.randn(shape, device="cuda", dtype=tdt, generator=g) * (fan_in ** -0.5)
        t = t.to(tdt).contiguous()
        keep.append(t)
        out.append(t)
        nbytes[name] = t.numel() * t.element_size()
    return out, keep, nbytes


def _kernel_category(name: str) -> str:
    if name.startswith("attn_kernel"):
        return "attention"
    if name.startswith("gdn_chunk"):
        return "gdn_chunk"
    if name.startswith("gdn_step"):
        return "gdn_step"
    if name.startswith("gdn_decode"):
        return "gdn_decode"
    if name.startswith(("conv_kernel", "gdn_prep")):
        return "conv (prefill: + q/k/v split, L2 norms)"
    if name.startswith(("gemm_", "gemv_")):
        return "gemm (wgmma prefill)" if name.startswith("gemm_") else "gemv (decode)"
    if "matmul" in name:
        m = re.search(r"_kernel(_\d+)?$", name)
        return "matmul" + ((m.group(1) or "_0") if m else "")
    if "memcpy" in name.lower() or "memset" in name.lower():
        return "memcpy"
    return "other (norms, rope, elementwise, take)"


def _profile(torch, fn, label: str, top: int = 25) -> dict:
    try:
        return _profile_inner(torch, fn, label, top)
    except Exception as e:  # noqa: BLE001 - profiling is optional
        print(f"profile {label}: failed: {e!r}"[:300], flush=True)
        return {"label": label, "error": repr(e)[:300]}


def _profile_inner(torch, fn, label: str, top: int) -> dict:
    """Kernel times of one call through CUPTI (torch.profiler sees TVM's kernels too)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0) or 0
        if t:
            rows.append((e.key, float(t), int(e.count)))
    rows.sort(key=lambda r: -r[1])
    cats: dict = {}
    for k, t, c in rows:
        cat = _kernel_category(k)
        cats[cat] = cats.get(cat, 0.0) + t
    total = sum(r[1] for r in rows)
    print(f"profile {label}: kernels {total / 1e3:.2f} ms; " + ", ".join(
        f"{k} {v / 1e3:.2f}" for k, v in sorted(cats.items(), key=lambda kv: -kv[1])), flush=True)
    return {"label": label, "kernel_total_us": total, "by_category_us": cats,
            "top": [{"kernel": k, "us": t, "count": c} for k, t, c in rows[:top]]}


def cmd_bench(a):
    import torch

    tvm, dev = _gpu_tvm()
    from tvm.runtime.vm import VirtualMachine

    out = Path(a.out)
    meta = json.loads((out / "q27b.json").read_text())
    cfg, specs = meta["config"], meta["params"]
    res = {"device": torch.cuda.get_device_name(0), "compute_version": dev.compute_version, "geometry": Q27B,
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "library_bytes": (out / "q27b.so").stat().st_size}
    t0 = time.time()
    bw, rate = _measure_floors(torch)
    res["copy_bandwidth_Bps"] = bw
    res["bf16_matmul_flops"] = rate
    print(f"floors: copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)

    t1 = time.time()
    lib = tvm.runtime.load_module(str(out / "q27b.so"))
    vm = VirtualMachine(lib, dev)
    res["load_seconds"] = time.time() - t1
    t1 = time.time()
    tparams, keep, nbytes = _gen_params(torch, specs, cfg)
    params = [tvm.runtime.from_dlpack(t) for t in tparams]
    torch.cuda.synchronize()
    res["param_gen_seconds"] = time.time() - t1
    w_all = sum(nbytes.values())
    w_embed = sum(v for k, v in nbytes.items() if "embed_tokens" in k)
    res["weights_bytes"] = w_all
    res["weights_bytes_read_per_step"] = w_all - w_embed

    n_attn = cfg["layer_types"].count("full_attention")
    n_gdn = cfg["layer_types"].count("linear_attention")
    hkv, dh = cfg["num_key_value_heads"], cfg["head_dim"]
    hv, dk, dv = cfg["linear_num_value_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    conv_dim = 2 * cfg["linear_num_key_heads"] * dk + hv * dv
    batches = [int(x) for x in a.batches.split(",")]
    max_b = max(batches)
    ctx = a.ctx
    pages_per_seq = -(-ctx // PAGE)
    long_b = [int(x) for x in a.long_batches.split(",")] if a.long_ctx else []
    longest_b = [int(x) for x in a.longest_batches.split(",")] if a.longest_ctx else []
    want = max([max_b * pages_per_seq] + [b * -(-a.long_ctx // PAGE) for b in long_b]
               + [b * -(-a.longest_ctx // PAGE) for b in longest_b]) + 1
    # the largest pool that fits next to the weights with a reserve for activations / workspace; rows that
    # need more pages than it holds are skipped (reported), never an out-of-memory failure
    page_bytes = cfg["layer_types"].count("full_attention") * 2 * cfg["num_key_value_heads"] * PAGE * \
        cfg["head_dim"] * {"float32": 4}.get(meta.get("dtype", "bfloat16"), 2)
    fit = int((torch.cuda.mem_get_info()[0] - a.reserve_gib * 2 ** 30) // page_bytes)
    num_pages = max(min(want, fit), max_b * pages_per_seq + 1)
    res["kv_pool_pages"], res["kv_pool_pages_wanted"] = num_pages, want
    slots = max_b + 1
    mdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[meta.get("dtype", "bfloat16")]
    res["dtype"] = meta.get("dtype", "bfloat16")
    res["schedule"] = {k: v for k, v in meta.get("schedule", {}).items() if k in ("dlight", "kernels", "cuda_graph")}
    kv = torch.randn((num_pages, n_attn, 2, hkv, PAGE, dh), device="cuda", dtype=mdt)
    conv = torch.randn((slots, n_gdn, conv_dim, 3), device="cuda", dtype=mdt) * 0.1
    ssm = torch.randn((slots, n_gdn, hv, dk, dv), device="cuda", dtype=torch.float32) * 0.01
    kv_t, conv_t, ssm_t = (tvm.runtime.from_dlpack(x) for x in (kv, conv, ssm))
    res["kv_pool_bytes"] = kv.numel() * kv.element_size()
    res["state_pool_bytes"] = conv.numel() * conv.element_size() + ssm.numel() * 4
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    res["mem_after_alloc_bytes"] = total - free

    def T(x):
        return tvm.runtime.tensor(np.ascontiguousarray(x, np.int32), dev)

    kv_per_tok = n_attn * 2 * hkv * dh * kv.element_size()
    state_rw = n_gdn * (hv * dk * dv * 4 + conv_dim * 3 * conv.element_size()) * 2

    from types import SimpleNamespace

    from ninfer_mlc.runtime.executor.cuda_graph import GraphedFunction, page_width_bucket
    from ninfer_mlc.runtime.executor.inputs import StepInputs

    graphs = GraphedFunction(tvm, dev, vm["decode"]) if a.graphs else None
    max_rows = max(batches + long_b + longest_b)
    longest = max(a.long_ctx or 0, a.longest_ctx or 0, ctx)
    inputs = StepInputs(tvm, dev, max_rows, page_width_bucket(-(-longest // PAGE)))

    def decode_run(b, c, steps, warm=3):
        """Eager VM calls, then (with --graphs) the runner's path: the step's inputs staged in the
        runner's persistent buffers (executor/inputs.py) and one graph launch per step (staging included
        in the time)."""
        npg = -(-c // PAGE)
        seqs = [SimpleNamespace(uid=100_000 * b + c + i, slot=i, pages=list(range(i * npg, (i + 1) * npg)),
                                length=c - 1) for i in range(b)]
        toks = np.random.default_rng(b).integers(0, cfg["vocab_size"], b).astype(np.int32).tolist()
        persistent = [kv_t, conv_t, ssm_t, params]
        args = tuple(inputs.decode(seqs, toks, page_width_bucket)) + tuple(persistent)
        for _ in range(warm):
            vm["decode"](*args)
        dev.sync()
        ts = time.perf_counter()
        for _ in range(steps):
            o = vm["decode"](*args)
        dev.sync()
        dt_eager = (time.perf_counter() - ts) / steps
        dt = dt_eager
        if graphs is not None:
            for _ in range(3):  # eager, capture + launch, replay
                graphs(inputs.decode(seqs, toks, page_width_bucket), persistent)
            ts = time.perf_counter()
            for _ in range(steps):
                o = graphs(inputs.decode(seqs, toks, page_width_bucket), persistent)
            dev.sync()
            dt = (time.perf_counter() - ts) / steps
        logits = o[0].numpy() if isinstance(o, (list, tuple)) or hasattr(o, "__getitem__") else None
        finite = bool(np.all(np.isfinite(logits))) if logits is not None else None
        byts = res["weights_bytes_read_per_step"] + b * c * kv_per_tok + b * state_rw
        floor = byts / bw
        row = {"batch": b, "ctx": c, "step_ms": dt * 1e3, "tok_s": b / dt, "bytes_per_step": byts,
               "floor_ms": floor * 1e3, "floor_tok_s": b / floor, "fraction_of_floor": floor / dt,
               "step_ms_eager": dt_eager * 1e3, "fraction_of_floor_eager": floor / dt_eager,
               "cuda_graph": graphs is not None, "logits_finite": finite}
        print(f"decode b={b} ctx={c}: {dt * 1e3:.2f} ms/step, {b / dt:.1f} tok/s (floor {floor * 1e3:.2f} ms, "
              f"{100 * floor / dt:.0f}% of roofline; eager VM {dt_eager * 1e3:.2f} ms = {100 * floor / dt_eager:.0f}%)",
              flush=True)
        return row

    def save():
        if graphs is not None:
            res["cuda_graph_stats"] = dict(graphs.stats, last_error=graphs.last_error,
                                           nodes={str(k): v for k, v in graphs.graph_nodes().items()})
        gc.write_result(a.result, res)

    res["decode"] = []
    for b in batches:
        res["decode"].append(decode_run(b, ctx, a.steps))
        save()
    if a.short_ctx:
        res["decode"].append(decode_run(1, a.short_ctx, a.steps))
    if a.profile:
        res["profile"] = []
        for b in sorted({1, max_b}):
            ptab = np.arange(b * pages_per_seq, dtype=np.int32).reshape(b, -1)
            dargs = (T(np.arange(b) + 11), T(np.full(b, ctx - 1)), T(ptab), T(np.arange(b)), kv_t, conv_t, ssm_t, params)
            res["profile"].append(_profile(torch, lambda: vm["decode"](*dargs), f"decode b={b} ctx={ctx}"))
        if a.profile_prefill:
            m = a.profile_prefill
            pargs0 = (T(np.arange(m) % 1000), T(np.arange(m)), T(np.zeros(m)), T([0, m]),
                      T(np.arange(-(-m // PAGE), dtype=np.int32).reshape(1, -1)), T([0]), T([m - 1]),
                      kv_t, conv_t, ssm_t, params)
            res["profile"].append(_profile(torch, lambda: vm["prefill"](*pargs0), f"prefill {m}"))
        save()
    res["decode_skipped"] = []
    for c, bs, frac in ((a.long_ctx, long_b, 0.5), (a.longest_ctx, longest_b, 0.6)):
        for b in bs:
            if b * -(-c // PAGE) + 1 > num_pages or time.time() - t0 > a.budget_s * frac:
                res["decode_skipped"].append({"batch": b, "ctx": c, "why": "pool" if b * -(-c // PAGE) + 1 > num_pages
                                              else "time budget"})
                print(f"decode b={b} ctx={c}: skipped ({res['decode_skipped'][-1]['why']})", flush=True)
                continue
            res["decode"].append(decode_run(b, c, 3 if c > a.long_ctx else max(3, a.steps // 2), warm=1))
            save()

    # prefill at ctx tokens (one sequence, fresh state)
    n = a.prefill
    if not n:
        res["wall_seconds"] = time.time() - t0
        save()
        return 0
    n_params_mm = (w_all - w_embed - nbytes.get("lm_head.weight", 0)) / 2  # bf16 matmul weights
    flops_mm = 2 * n_params_mm * n
    flops_attn = n_attn * 4 * cfg["num_attention_heads"] * dh * n * (n + 1) / 2
    flops_head = 2 * cfg["vocab_size"] * cfg["hidden_size"]
    flops = flops_mm + flops_attn + flops_head
    pt = np.arange(-(-n // PAGE), dtype=np.int32).reshape(1, -1)
    toks = np.random.default_rng(7).integers(0, cfg["vocab_size"], n)
    pargs = (T(toks), T(np.arange(n)), T(np.zeros(n)), T([0, n]), T(pt), T([0]), T([n - 1]),
             kv_t, conv_t, ssm_t, params)
    times = []
    for i in range(a.prefill_reps + 1):
        ssm.zero_()
        conv.zero_()
        torch.cuda.synchronize()
        ts = time.perf_counter()
        o = vm["prefill"](*pargs)
        dev.sync()
        times.append(time.perf_counter() - ts)
        print(f"prefill {n}: {times[-1]:.3f}s", flush=True)
        if time.time() - t0 > a.budget_s * 0.8:
            break
    pt_s = min(times[1:]) if len(times) > 1 else times[0]
    floor = flops / rate
    res["prefill"] = {"tokens": n, "seconds": pt_s, "all_seconds": times, "tok_s": n / pt_s, "flops": flops,
                      "flops_matmul": flops_mm, "flops_attention": flops_attn, "floor_seconds": floor,
                      "floor_tok_s": n / floor, "fraction_of_floor": floor / pt_s,
                      "logits_finite": bool(np.all(np.isfinite(o[0].numpy())))}
    print(f"prefill {n}: {pt_s:.3f}s = {n / pt_s:.0f} tok/s (floor {floor:.3f}s, {100 * floor / pt_s:.1f}% of roofline)",
          flush=True)
    save()

    # long prompt: one sequence prefilled in chunks the way the engine feeds it (state slot and pages carry
    # over between chunks); the floor counts every token's matmuls and the whole causal attention
    n = a.long_prefill
    if n and n // PAGE + 1 <= num_pages and time.time() - t0 < a.budget_s * 0.8:
        c = a.prefill_chunk
        ptl = np.arange(-(-n // PAGE), dtype=np.int32).reshape(1, -1)
        toks = np.random.default_rng(8).integers(0, cfg["vocab_size"], n)
        ssm.zero_()
        conv.zero_()
        torch.cuda.synchronize()
        ts = time.perf_counter()
        chunk_s = []
        for c0 in range(0, n, c):
            m = min(c, n - c0)
            t1 = time.perf_counter()
            o = vm["prefill"](T(toks[c0:c0 + m]), T(np.arange(c0, c0 + m)), T(np.zeros(m)), T([0, m]), T(ptl), T([0]),
                              T([m - 1]), kv_t, conv_t, ssm_t, params)
            dev.sync()
            chunk_s.append(time.perf_counter() - t1)
        lp_s = time.perf_counter() - ts
        fl = 2 * n_params_mm * n + n_attn * 4 * cfg["num_attention_heads"] * dh * n * (n + 1) / 2 + flops_head
        res["prefill_long"] = {"tokens": n, "chunk": c, "seconds": lp_s, "tok_s": n / lp_s, "flops": fl,
                               "floor_seconds": fl / rate, "fraction_of_floor": fl / rate / lp_s,
                               "first_chunk_seconds": chunk_s[0], "last_chunk_seconds": chunk_s[-1],
                               "logits_finite": bool(np.all(np.isfinite(o[0].numpy())))}
        print(f"prefill {n} in {c}-token chunks: {lp_s:.2f}s = {n / lp_s:.0f} tok/s (floor {fl / rate:.2f}s, "
              f"{100 * fl / rate / lp_s:.1f}% of roofline; chunk 1 {chunk_s[0]:.3f}s, last {chunk_s[-1]:.3f}s)", flush=True)
    elif n:
        print(f"prefill {n}: skipped (pool of {num_pages} pages or time budget)", flush=True)
    free, total = torch.cuda.mem_get_info()
    res["mem_peak_seen_bytes"] = total - free
    res["mem_total_bytes"] = total
    res["torch_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    res["wall_seconds"] = time.time() - t0
    save()
    print(json.dumps({k: v for k, v in res.items() if k not in ("geometry", "decode", "prefill")}, indent=0))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prep")
    p.add_argument("out")
    p.add_argument("--arch", default="sm_90")
    p.add_argument("--skip-27b", action="store_true")
    p.add_argument("--only-27b", action="store_true", help="just the full-size library (variants)")
    p.add_argument("--dtype", default="bfloat16", help="activation dtype of the full-size library")
    c = sub.add_parser("check")
    c.add_argument("out")
    c.add_argument("result")
    b = sub.add_parser("bench")
    b.add_argument("out")
    b.add_argument("result")
    b.add_argument("--ctx", type=int, default=8192)
    b.add_argument("--short-ctx", type=int, default=512)
    b.add_argument("--long-ctx", type=int, default=131072)
    b.add_argument("--longest-ctx", type=int, default=262144, help="one more decode row at batch 1 (0: skip)")
    b.add_argument("--long-batches", default="1,2,4,8", help="batches decoded at --long-ctx")
    b.add_argument("--longest-batches", default="1,2,4", help="batches decoded at --longest-ctx")
    b.add_argument("--reserve-gib", type=float, default=12.0,
                   help="device memory left free beside the KV pool (activations, workspace)")
    b.add_argument("--batches", default="1,2,4,8")
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--prefill", type=int, default=8192)
    b.add_argument("--prefill-reps", type=int, default=0)
    b.add_argument("--long-prefill", type=int, default=131072,
                   help="one prompt of this many tokens in --prefill-chunk chunks (needs the --long-ctx pool; 0: skip)")
    b.add_argument("--prefill-chunk", type=int, default=8192)
    b.add_argument("--budget-s", type=float, default=240)
    b.add_argument("--graphs", type=int, default=1, help="1: also time decode replayed as CUDA graphs")
    b.add_argument("--profile", action="store_true", help="CUPTI kernel breakdown of decode and a prefill")
    b.add_argument("--profile-prefill", type=int, default=2048)
    a = ap.parse_args(argv)
    return {"prep": cmd_prep, "check": cmd_check, "bench": cmd_bench}[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())
