"""Quantized KV pages (fp8, nvfp4) in the CUDA paged attention vs the llvm kernel, on the GPU.

  prep  OUT  (here: compiler, no GPU)
      OUT/kernels.so    CUDA attention prim_funcs (nvfp4, fp8) x (special rows f32 D=256 / Gaussian
                        bf16 D=256 GQA 6), built for sm_90
      OUT/kernels.npz   their inputs, and the llvm kernel's pool bytes and outputs after a ragged
                        prefill call and a decode call (the pool starts as random bytes)
      OUT/cuda-<kv>/    the tiny model (compile/tiny_default) for cuda:sm_90, --quant bf16, --kv-dtype kv
      OUT/model_ref.npz llvm (bf16) artifacts' logits (prefill all rows + decode) and page bytes
  check PREP OUT.json (GPU, runtime-only TVM): the kernel pool bytes must be identical to the llvm
      kernel's and the outputs close; the tiny models' logits are compared with the llvm ones.

Kernel level is the bit-exactness check: both kernels quantize the same K/V. At model level the K/V
that reach the pages come from bf16 projections computed on different devices, so page bytes can
differ where a bf16 K/V value differs; there the fraction of identical bytes is reported.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

KVS = ("nvfp4", "fp8")
PS = 64
N_LAYERS = 2
LAYER = 1
NPAGES = 8
SEQ_LENS = (100, 70)
PAGES = ((3, 5), (1, 6))
# (name, activation dtype, hq, hkv, D, data)
CASES = (("special", "float32", 4, 2, 256, "special"), ("gauss", "bfloat16", 24, 4, 256, "gauss"))
PROMPT, DECODE = 120, 16
OUT_TOL = 1e-4       # kernel outputs: max|d| / max|ref| (same dequantized values, f32 sums)
LOGIT_TOL = {"nvfp4": 0.1, "fp8": 0.05, "bfloat16": 0.05}  # model logits: max|d| / max|ref|


def _np_dt(dt):
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16) if dt == "bfloat16" else np.dtype(dt)


def _special_rows(rng, n: int, d: int) -> np.ndarray:
    """Rows whose 16-blocks cover codec corner cases (as tests/test_kv_quant.py) + log-uniform blocks."""
    from ninfer_mlc.compile import nvfp4 as F

    blocks = []
    mids = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    tie = np.concatenate([[6.0], mids, -mids, [0.0]]).astype(np.float32)
    for s in rng.choice(F.E4M3_VALUES[8:0x7F], 24):
        blocks.append(tie * np.float32(s))
    for k in range(1, 8):
        b = np.zeros(16, np.float32)
        b[0], b[1] = 6 * k * 2.0 ** -9, -2 * k * 2.0 ** -9
        blocks.append(b)
    t = np.zeros((4, 16), np.float32)
    t[0, 0] = 6 * 2.0 ** -10
    t[1, 0] = np.nextafter(np.float32(6 * 2.0 ** -10), np.float32(1))
    t[2] = np.float32(1e-3) * np.arange(16)
    t[3, 0], t[3, 1] = 3e-39, -1e-40                       # fp32 subnormals (flush-to-zero trap)
    blocks += list(t)
    sat = np.zeros((3, 16), np.float32)
    sat[0, :3] = [6 * 448 * 10, -6 * 448 * 3, 1000.0]
    sat[1, 0] = 6 * 460
    sat[2] = 2688.0
    blocks += list(sat)
    z = np.zeros((3, 16), np.float32)
    z[1] = -0.0
    z[2, :] = 1.0
    z[2, 3], z[2, 4] = -0.0, -1e-6
    blocks += list(z)
    odd = np.linspace(-2, 3, 32, dtype=np.float32).reshape(2, 16)
    odd[0, 5], odd[1, 7] = np.nan, np.inf
    blocks += list(odd)
    special = np.stack(blocks)
    total = n * d // 16
    rnd = rng.standard_normal((total, 16)).astype(np.float32) * \
        np.exp(rng.uniform(-14, 14, (total, 1))).astype(np.float32)
    pick = rng.permutation(total)[: len(special)]
    rnd[pick] = special
    rows = rnd.reshape(n, d)
    # whole rows for the fp8 per-row scale: zero, subnormal-only, one with NaN + Inf, a saturating one
    for r, val in zip(rng.permutation(n)[:4], (0.0, 1e-39, None, 1e30)):
        rows[r] = val if val is not None else rows[r]
        if val is None:
            rows[r, 0], rows[r, 1] = np.nan, -np.inf
    return rows


def _calls(kv, dt, hq, hkv, d, data, rng):
    """Two calls (ragged prefill of both sequences, then one decode token each): list of arg dicts."""
    from ninfer_mlc.contract.pool_layout import kv_row

    _, row = kv_row(kv, d)
    npd = _np_dt(dt)
    pt = np.asarray(PAGES, np.int32)
    calls = []
    for step in range(2):
        if step == 0:
            pos = np.concatenate([np.arange(L) for L in SEQ_LENS]).astype(np.int32)
            tseq = np.concatenate([np.full(L, s) for s, L in enumerate(SEQ_LENS)]).astype(np.int32)
        else:
            pos, tseq = np.asarray(SEQ_LENS, np.int32), np.arange(2, dtype=np.int32)
        n = len(pos)
        if data == "special":
            k = _special_rows(rng, n * hkv, d).reshape(n, hkv, d)
            v = _special_rows(rng, n * hkv, d).reshape(n, hkv, d)
            q = rng.standard_normal((n, hq, d)).astype(np.float32) * 1e-3
        else:
            k, v, q = (rng.standard_normal((n, h, d)).astype(np.float32) for h in (hkv, hkv, hq))
        calls.append(dict(q=q.astype(npd), k=k.astype(npd), v=v.astype(npd), pos=pos, tseq=tseq, pt=pt))
    pool0 = rng.integers(0, 256, (NPAGES, N_LAYERS, 2, hkv, PS, row), dtype=np.uint8)
    return calls, pool0


def _run(f, tvm, dev, call, pool, hq, d, dt):
    t = lambda a: tvm.runtime.tensor(np.ascontiguousarray(a), dev)  # noqa: E731
    n = call["q"].shape[0]
    out = t(np.full((n, hq, d), np.nan, np.float32).astype(_np_dt(dt)))
    f(t(call["q"]), t(call["k"]), t(call["v"]), t(call["pos"]), t(call["tseq"]), t(call["pt"]), pool, LAYER, out)
    return out.numpy().astype(np.float32)


def _model_run(runner, toks):
    """Prefill PROMPT tokens (all logits), then DECODE teacher-forced steps; logits [P+D, V] and pages."""
    s = runner.new_seq()
    (pre,) = runner.prefill([(s, toks[:PROMPT])], all_logits=True)
    pages_after_prefill = runner.read_pages(s.pages)
    dec = [runner.decode([s], [toks[t]])[0] for t in range(PROMPT, PROMPT + DECODE)]
    pages = runner.read_pages(s.pages)
    runner.free_seq(s)
    return np.concatenate([pre, np.stack(dec)]).astype(np.float32), pages_after_prefill, pages


def cmd_prep(out: Path):
    import tvm

    from ninfer_mlc.compile.build import compile_model
    from ninfer_mlc.compile.kernels.registry import kernel_set
    from ninfer_mlc.compile.targets import cuda_build_env, parse_target
    from ninfer_mlc.runtime.harness import Harness

    os.environ.pop("NINFER_LIB_CACHE", None)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    rng = np.random.default_rng(7)
    cf, lf, data, meta = {}, {}, {}, {}
    for kv in KVS:
        for name, dt, hq, hkv, d, kind in CASES:
            key = f"{kv}_{name}"
            args = (hq, hkv, d, PS, N_LAYERS, dt, d ** -0.5)
            cf[key] = kernel_set("cuda", kv).paged_attention(*args).with_attr("global_symbol", key)
            lf[key] = kernel_set("llvm", kv).paged_attention(*args).with_attr("global_symbol", key)
            calls, pool0 = _calls(kv, dt, hq, hkv, d, kind, rng)
            meta[key] = dict(kv=kv, dtype=dt, hq=hq, hkv=hkv, d=d, ncalls=len(calls))
            data[f"{key}/pool0"] = pool0
            for c, call in enumerate(calls):
                for a, x in call.items():
                    data[f"{key}/{c}/{a}"] = x.view(np.uint16) if x.dtype == _np_dt("bfloat16") else x
    tgt = parse_target("cuda:sm_90").tvm_target()
    with cuda_build_env(tgt):
        tvm.compile(tvm.IRModule(cf), target=tgt).export_library(str(out / "kernels.so"))
    lmod = tvm.compile(tvm.IRModule(lf), target=tvm.target.Target({"kind": "llvm"}))
    cpu = tvm.cpu()
    for key, m in meta.items():
        pool = tvm.runtime.tensor(data[f"{key}/pool0"], cpu)
        for c in range(m["ncalls"]):
            call = {a: _load(data, f"{key}/{c}/{a}", m["dtype"]) for a in ("q", "k", "v", "pos", "tseq", "pt")}
            data[f"{key}/{c}/ref_out"] = _run(lmod[key], tvm, cpu, call, pool, m["hq"], m["d"], m["dtype"])
            changed = np.nonzero(pool.numpy().reshape(-1) != data[f"{key}/pool0"].reshape(-1))[0]
            data[f"{key}/{c}/ref_idx"] = changed.astype(np.int32)  # ref pool = pool0 with these bytes set
            data[f"{key}/{c}/ref_val"] = pool.numpy().reshape(-1)[changed]
    np.savez_compressed(out / "kernels.npz", **data)
    (out / "kernels.json").write_text(json.dumps(meta))
    print(f"kernels: {len(meta)} cases, {time.time() - t0:.1f}s", flush=True)

    scratch = Path(os.environ.get("KVQ_SCRATCH", "/tmp/kvq_prep"))
    hf = scratch / "hf"
    if not (hf / "model.safetensors").is_file():
        import subprocess

        subprocess.run([sys.executable, "-m", "ninfer_mlc.compile.tiny_default", str(hf)], check=True)
    toks = np.random.default_rng(3).integers(0, 2048, PROMPT + DECODE).tolist()
    ref = {"tokens": np.asarray(toks, np.int32)}
    for kv in KVS + ("bf16",):
        for tgt_name in ("cuda:sm_90", "llvm"):
            tag = ("cuda" if tgt_name != "llvm" else "_llvm") + f"-{kv}"
            art = out / tag if tgt_name != "llvm" else scratch / tag
            compile_model(hf, target=tgt_name, quant="bf16", kv_dtype=kv, max_context=1024, out_dir=art,
                          name=tag.strip("_"), log=lambda *_: None)
            if tgt_name == "llvm":
                r = Harness(art, kv_capacity_tokens=512, num_slots=2)
                ref[f"{kv}/logits"], ref[f"{kv}/pages_prefill"], ref[f"{kv}/pages"] = _model_run(r, toks)
    np.savez_compressed(out / "model_ref.npz", **ref)
    print(f"prep done in {time.time() - t0:.1f}s", flush=True)


def _load(data, key, dt):
    x = data[key]
    return x.view(_np_dt("bfloat16")) if dt == "bfloat16" and x.dtype == np.uint16 else x


def _rel(a, b) -> float:
    """max|a - b| / max|b| over entries finite in b; inf if a and b disagree on which are finite
    (an fp8 row that held +-inf decodes back to inf, so both kernels give non-finite outputs there)."""
    fin = np.isfinite(b)
    if not np.array_equal(fin, np.isfinite(a)):
        return float("inf")
    if not fin.any():
        return 0.0
    return float(np.abs(a[fin] - b[fin]).max() / max(np.abs(b[fin]).max(), 1e-30))


def _same_written(got, ref, length) -> float:
    """Fraction of identical bytes over the page slots holding positions < length."""
    pos = np.arange(got.shape[0])[:, None] * got.shape[-2] + np.arange(got.shape[-2])[None, :]
    g = np.moveaxis(got, -2, 1)[pos < length]  # [written slots, layers, 2, H, R]
    r = np.moveaxis(ref, -2, 1)[pos < length]
    if g.dtype != np.uint8:
        g, r = g.view(np.uint8), r.view(np.uint8)
    return float((g == r).mean())


def cmd_check(prep: Path, out_json: Path) -> int:
    from ninfer_mlc.runtime.tvm_loader import import_tvm

    tvm = import_tvm("cuda")  # runtime-only TVM needs the CUDA loader registered by hand

    from ninfer_mlc.runtime.harness import Harness

    res = {"kernels": {}, "model": {}}
    ok = True
    dev = tvm.cuda(0)
    lib = tvm.runtime.load_module(str(prep / "kernels.so"))
    data = dict(np.load(prep / "kernels.npz"))
    meta = json.loads((prep / "kernels.json").read_text())
    for key, m in meta.items():
        pool = tvm.runtime.tensor(data[f"{key}/pool0"], dev)
        rows = []
        for c in range(m["ncalls"]):
            call = {a: _load(data, f"{key}/{c}/{a}", m["dtype"]) for a in ("q", "k", "v", "pos", "tseq", "pt")}
            got = _run(lib[key], tvm, dev, call, pool, m["hq"], m["d"], m["dtype"])
            dev.sync()
            gp, rp = pool.numpy(), data[f"{key}/pool0"].copy()
            rp.reshape(-1)[data[f"{key}/{c}/ref_idx"]] = data[f"{key}/{c}/ref_val"]
            ro = data[f"{key}/{c}/ref_out"]
            diff = int((gp != rp).sum())
            rel = _rel(got, ro)
            finite = bool(np.isfinite(got).sum() == np.isfinite(ro).sum())
            row = dict(call=["prefill", "decode"][c], n=int(call["q"].shape[0]), pool_bytes=int(gp.size),
                       pool_bytes_differing=diff, out_rel_maxdiff=rel, out_nonfinite=int((~np.isfinite(ro)).sum()),
                       out_same_finite=finite)
            rows.append(row)
            ok &= diff == 0 and finite and rel <= OUT_TOL
        res["kernels"][key] = rows
        print(key, rows, flush=True)
    ref = dict(np.load(prep / "model_ref.npz"))
    toks = ref["tokens"].tolist()
    for kv in KVS + ("bf16",):
        art = prep / f"cuda-{kv}"
        if not art.is_dir():
            continue
        r = Harness(art, kv_capacity_tokens=512, num_slots=2)
        lg, pp, pages = _model_run(r, toks)
        rl = ref[f"{kv}/logits"]
        rel = _rel(lg, rl)
        agree = float((lg.argmax(-1) == rl.argmax(-1)).mean())
        same_pre = _same_written(pp, ref[f"{kv}/pages_prefill"], PROMPT)
        same = _same_written(pages, ref[f"{kv}/pages"], PROMPT + DECODE)
        tol = LOGIT_TOL["bfloat16" if kv == "bf16" else kv]
        row = dict(logits_rel_maxdiff=rel, bound=tol, argmax_agree=agree,
                   page_bytes_identical_frac_prefill=same_pre, page_bytes_identical_frac_final=same,
                   finite=bool(np.isfinite(lg).all()))
        res["model"][kv] = row
        print(kv, row, flush=True)
        ok &= rel <= tol and row["finite"]
    res["ok"] = bool(ok)
    out_json.write_text(json.dumps(res, indent=1))
    print("OK" if ok else "MISMATCH", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    cmd, a, *rest = sys.argv[1:]
    if cmd == "prep":
        cmd_prep(Path(a))
    elif cmd == "check":
        sys.exit(cmd_check(Path(a), Path(rest[0])))
    else:
        raise SystemExit(__doc__)
