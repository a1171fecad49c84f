"""Speculative decoding on the GPU (issue 7): tokens/round and speedup vs no speculation.

Two steps; `prep` runs where the compiler is (no GPU), `run` on the GPU machine with only the TVM runtime
(TVM_USE_RUNTIME_LIB=1), numpy, ml_dtypes and torch (the bench/README.md driver: /tmp/pkg/ninfer_mlc with
runtime/ and compile/ linked, PYTHONPATH=/tmp/pkg:/tmp/site, torch's libcudart on LD_LIBRARY_PATH).

  prep OUT [--arch sm_90]                                   (~4 min on 2 cores, OUT ~ 15 MB)
      OUT/tiny-cuda/          the embedded tiny model (dist/qwen3x-tiny: same weights, tokenizer, MTP head)
                              compiled for cuda:ARCH (f32) through the normal `ninfer compile` path
      OUT/tiny_prompts.json   bench/spec_bench.py PROMPTS as token ids (no tokenizer needed on the GPU box)
      OUT/q27b_mtp.so/.json   the Qwen3.x-27B geometry (bench/gpu_bench.py Q27B) WITH its MTP head
                              (mtp_num_hidden_layers=1), bf16, and its parameter list
  run OUT RESULT.json [--budget-s 210]                      (~1.5 min of GPU time after the machine start)
      (b) 27B geometry, random weights made on the GPU (gpu_bench._gen_params), every sequence at --ctx:
          decode (1 row per sequence), verify with m = 1..2k_max+2 rows per sequence, mtp_step (1 row),
          mtp_prefill (m rows), the GDN state snapshot a round takes; timed the way the runner calls them
          (inputs uploaded, outputs copied to the host), eager VM and -- when runtime/cuda_graph.py is
          there -- decode/verify replayed as CUDA graphs (decode is graphed in the runner; verify is not).
          Random weights give no meaningful acceptance: the 27B speedup is PROJECTED from the measured
          costs, at the acceptance measured in (a) and at a = 0.6 / 0.8.
      (a) the tiny model end to end through the real engine (bench/spec_bench.run: same prompts and
          protocol as the CPU benchmark): no speculation vs --spec mtp with k = 1, 2, 3 draft tokens,
          greedy; acceptance, tokens/round, tokens/s, speedup, outputs identical to no speculation.

  (c) FORCED acceptance profiles through the engine (bench/spec_forced.py): the 27B geometry with MTP head and
      tap layers, and a DFlash2 drafter of the Qwen3.8-27B-DFlash2 shape, both random weights drawn on the GPU;
      no speculation vs MTP-3 forced to 3.18 / 3.4 tokens per round vs DFlash2 block 8 forced to 5.4, batch 1
      and 4 at --forced-ctx: tokens/s, a round's cost in plain decode steps, speedup. Every row names the
      forced profile (the output is not the model's). prep builds OUT/q27b-taps and OUT/dflash2-27b (minutes).
      Only this part:  run OUT RESULT.json --skip-27b --skip-tiny --budget-s 540
      CPU dry run:     run OUT R.json --device cpu --skip-27b --skip-tiny --forced-target TAPS_ART
                       --forced-drafter DFLASH2_ART --forced-ctx 200 --forced-gen 12 --forced-batches 1,2
      --forced-lm-head-draft 32768: every MTP profile also with the shortlisted proposal head (rows "... head32768")

Projection, per batch b and k drafts (greedy, i.i.d. acceptance a):
  tokens/round  tau = (1 - a^(k+1)) / (1 - a)
  ideal round   T_verify(k+1 rows) + T_mtp_prefill(tau rows) + (k-1) T_mtp_step + T_snapshot
  engine round  the engine's rollback re-feed simulated (runtime/speculative.py: after a rejection the
                committed-but-rolled-back tokens go at the front of the next verify; more than k+1 of
                them are re-fed by a prefill, costed as a verify of that many rows)
  speedup       tau * T_decode / T_round
Host-side sampling/argmax and engine bookkeeping are not in the 27B round costs (part (a) has them).

CPU dry run of the code paths (the llvm tiny model stands in for the 27B library; real weights):
  .venv/bin/python bench/spec_gpu_bench.py run .gpu/spec /tmp/spec_cpu.json --device cpu \
      --tiny-dir dist/qwen3x-tiny --geo-dir dist/qwen3x-tiny --ctx 256 --batches 1,2 --max-tokens 16
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import gpu_bench  # noqa: E402
import gpu_common as gc  # noqa: E402
import spec_bench  # noqa: E402  (puts ROOT on sys.path)
import spec_forced  # noqa: E402

PAGE = gpu_bench.PAGE
TINY_NAME = "qwen3x-tiny-cuda"


def _ensure_pkg() -> None:
    """ninfer_mlc.{runtime,compile,generate} from this checkout whatever provides `ninfer_mlc`
    (editable install here; on the GPU box /tmp/pkg holds only runtime/ and compile/)."""
    import ninfer_mlc

    for p in (ROOT / "ninfer_mlc", ROOT):
        if str(p) not in list(ninfer_mlc.__path__):
            ninfer_mlc.__path__.append(str(p))


# ----------------------------------------------------------------------------------------------
# prep (compiler machine)
def cmd_prep(a) -> int:
    _ensure_pkg()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if not a.skip_tiny:
        _prep_tiny(a, out)
    if not a.skip_27b:
        _prep_27b_mtp(a, out)
    if not a.skip_forced:
        spec_forced.prep_forced(out, a.arch, a.forced_quant, a.forced_max_context,
                                log=lambda *m: print(*m, flush=True))
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {total / 2**20:.1f} MiB", flush=True)
    return 0


def _prep_tiny(a, out: Path) -> None:
    from ninfer_mlc.compile.build import compile_model
    from ninfer_mlc.compile.tiny_default import generate
    from ninfer_mlc.runtime.assemble import THINK_EARLY_CLOSE, TURN_START
    from ninfer_mlc.paths import default_model_dir
    from ninfer_mlc.contract import safetensors_io
    from ninfer_mlc.runtime.tokenizer import load_tokenizer

    t0 = time.time()
    dst = out / "tiny-cuda"
    with tempfile.TemporaryDirectory(prefix="ninfer_spec_tiny_") as tmp:
        hf = generate(Path(tmp) / "qwen3x-tiny")
        compile_model(hf, target="cuda:" + a.arch, quant=a.tiny_quant, out_dir=dst, name=TINY_NAME,
                      log=lambda *m: print("tiny:", *m, flush=True))
    man = json.loads((dst / "manifest.json").read_text())
    assert man["extras"]["mtp"], "the tiny model lost its MTP head"
    # same weights as the embedded llvm model (tiny_default.generate is deterministic)
    ref = default_model_dir()
    same = None
    if (ref / "manifest.json").is_file():
        rm = json.loads((ref / "manifest.json").read_text())
        mine, theirs = {}, {}
        for rel in man["weight_shards"]:
            mine.update(safetensors_io.load(dst / rel))
        for rel in rm["weight_shards"]:
            theirs.update(safetensors_io.load(ref / rel))
        same = mine.keys() == theirs.keys() and all(
            np.array_equal(np.asarray(mine[k], np.float32), np.asarray(theirs[k], np.float32)) for k in mine)
    tok = load_tokenizer(dst)
    texts = {t: tok.encode(t, add_special_tokens=False).ids for t in (TURN_START, THINK_EARLY_CLOSE)}
    (out / "tiny_prompts.json").write_text(json.dumps({
        "prompts": [tok.encode(p).ids for p in spec_bench.PROMPTS],
        "encodings": texts, "weights_identical_to_dist": same, "quant": a.tiny_quant}, indent=0))
    print(f"tiny: cuda:{a.arch} {a.tiny_quant} in {time.time() - t0:.1f}s, weights identical to {ref}: {same}",
          flush=True)


class _unique_mtp_attention:
    """Build-time patch of compile/model.py's kernel set: the paged-attention prim_func of a 1-layer KV
    pool (the MTP head's) gets its own global_symbol. Needed while both kernels are named "attn"
    (any model whose main stack has more than one full-attention layer)."""

    def __enter__(self):
        from types import SimpleNamespace

        from ninfer_mlc.compile import model as model_mod

        self.mod, self.orig = model_mod, model_mod.kernel_set
        orig = self.orig

        def kernel_set(*args, **kw):
            ks = orig(*args, **kw)
            pa = ks.paged_attention

            def paged_attention(hq, hkv, dh, page, n_layers, *rest, **kw2):
                f = pa(hq, hkv, dh, page, n_layers, *rest, **kw2)
                return f.with_attr("global_symbol", "attn_mtp") if n_layers == 1 else f

            return SimpleNamespace(**{**vars(ks), "paged_attention": paged_attention})

        model_mod.kernel_set = kernel_set
        return self

    def __exit__(self, *exc):
        self.mod.kernel_set = self.orig
        return False


def _prep_27b_mtp(a, out: Path) -> None:
    from ninfer_mlc.compile import gpu_pipeline
    from ninfer_mlc.compile.build import build_library
    from ninfer_mlc.compile.config import parse_config
    from ninfer_mlc.compile.targets import parse_target

    cfg = parse_config(dict(gpu_bench.Q27B, mtp_num_hidden_layers=1))
    tgt = parse_target("cuda:" + a.arch)
    t1 = time.time()
    workaround = None
    os.environ.pop("NINFER_LIB_CACHE", None)  # a cached library would hide whether the workaround was needed
    try:
        specs = build_library(cfg, "bfloat16", tgt, out / "q27b_mtp.so", mtp=True)
    except Exception as e:  # noqa: BLE001
        if "duplicate global symbol" not in str(e):
            raise
        # the MTP layer's attention kernel (a 1-layer KV pool) and the main one (16 layers) are two
        # prim_funcs with the same global_symbol "attn"; rename the head's (same kernel otherwise)
        msg = str(e)
        workaround = f"MTP attention prim_func renamed attn_mtp ({msg[msg.find('duplicate global symbol'):][:60]})"
        print("27b+mtp: " + workaround, flush=True)
        with _unique_mtp_attention():
            specs = build_library(cfg, "bfloat16", tgt, out / "q27b_mtp.so", mtp=True)
    (out / "q27b_mtp.json").write_text(json.dumps({
        "config": cfg.to_dict(), "params": specs, "arch": a.arch, "dtype": "bfloat16", "kv_dtype": "bfloat16",
        "mtp": True, "build_seconds": time.time() - t1, "build_workaround": workaround,
        "schedule": gpu_pipeline.schedule_for(tgt.tvm_target())}, indent=1))
    n_mtp = sum(int(np.prod(s)) for n, s, _ in specs if n.startswith("mtp."))
    print(f"27b+mtp: built in {time.time() - t1:.1f}s, {(out / 'q27b_mtp.so').stat().st_size} bytes, "
          f"{len(specs)} params ({n_mtp / 1e6:.0f} M in the MTP head)", flush=True)


# ----------------------------------------------------------------------------------------------
# run (GPU machine; --device cpu for a dry run)
def _ensure_tokenizers(encodings: dict) -> str:
    """The engine wants a tokenizer (detokenized text, EOS ids). Without the `tokenizers` package a
    stand-in maps ids to vocabulary strings; prompts are token ids already, and the two texts the
    engine encodes at start-up were encoded in prep."""
    try:
        import tokenizers  # noqa: F401

        return "tokenizers"
    except ImportError:
        pass
    import types

    class _Enc:
        def __init__(self, ids):
            self.ids = list(ids)

    class Tokenizer:
        def __init__(self, vocab: dict):
            self._vocab, self._inv = vocab, {i: t for t, i in vocab.items()}

        @classmethod
        def from_file(cls, path):
            d = json.loads(Path(path).read_text())
            vocab = dict(d["model"]["vocab"])
            vocab.update({t["content"]: t["id"] for t in d.get("added_tokens", [])})
            return cls(vocab)

        def token_to_id(self, t):
            return self._vocab.get(t)

        def get_vocab(self, with_added_tokens=True):
            return dict(self._vocab)

        def get_vocab_size(self, with_added_tokens=True):
            return len(self._vocab)

        def decode(self, ids, skip_special_tokens=True):
            return "".join(self._inv.get(int(i), "") for i in ids)

        def encode(self, text, add_special_tokens=True):
            if text not in encodings:
                raise RuntimeError("tokenizers is not installed; only prep-encoded texts are available")
            return _Enc(encodings[text])

    mod = types.ModuleType("tokenizers")
    mod.Tokenizer = Tokenizer
    sys.modules["tokenizers"] = mod
    return "stand-in (tokenizers not installed)"


def run_tiny(a, res: dict, deadline: float, save) -> None:
    """(a): the tiny model through the engine, bench/spec_bench.py protocol, no spec vs MTP k drafts."""
    model = Path(a.tiny_dir) if a.tiny_dir else Path(a.out) / "tiny-cuda"
    pf = Path(a.out) / "tiny_prompts.json"
    meta = json.loads(pf.read_text()) if pf.is_file() else None
    mode = _ensure_tokenizers(meta["encodings"] if meta else {})
    if meta:
        ids = meta["prompts"]
    else:
        from ninfer_mlc.runtime.tokenizer import load_tokenizer

        tok = load_tokenizer(model)
        ids = [tok.encode(p).ids for p in spec_bench.PROMPTS]
    prompts = [ids[i % len(ids)] for i in range(a.requests)]
    man = json.loads((model / "manifest.json").read_text())
    out = res["tiny"] = {"model": man["name"], "target": man["target"], "dtype": man["dtype"], "tokenizer": mode,
                         "max_tokens": a.max_tokens, "requests": a.requests, "results": [], "skipped": []}
    cost = 0.0
    for c in a.concurrency:
        base = None
        for k in [0] + list(a.k):
            if time.time() + cost > deadline or (k and base is None):
                out["skipped"].append({"concurrency": c, "k": k})
                print(f"tiny c={c} k={k}: skipped (budget)", flush=True)
                continue
            t1 = time.time()
            if k == 0:
                r, base_out = spec_bench.run(model, prompts, a.max_tokens, c)
                base = r
            else:
                r, outs = spec_bench.run(model, prompts, a.max_tokens, c, "mtp", k)
                r["identical_to_baseline"] = outs == base_out
                r["speedup"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
                r["forward_ratio"] = round(base["target_forwards"] / max(1, r["target_forwards"]), 3)
            cost = time.time() - t1
            r["config_seconds"] = round(cost, 2)
            out["results"].append(r)
            print(f"tiny c={c} k={k}: " + json.dumps({x: r[x] for x in r if x not in ("spec", "requests")}),
                  flush=True)
            save()


def _load_geometry(a) -> dict:
    if a.geo_dir:
        d = Path(a.geo_dir)
        m = json.loads((d / "manifest.json").read_text())
        return {"name": m["name"], "config": m["config"], "params": m["params"], "dtype": m["dtype"],
                "kv_dtype": m["kv_dtype"], "library": d / m["library"],
                "weights": [d / r for r in m["weight_shards"]]}
    out = Path(a.out)
    m = json.loads((out / "q27b_mtp.json").read_text())
    return dict(m, name="q27b_mtp", library=out / "q27b_mtp.so", weights=None)


def _timed(fn, sync, steps: int, warm: int) -> float:
    """ms per call: warm-up calls, then `steps` calls and one sync at the end."""
    for _ in range(warm):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    return (time.perf_counter() - t) / steps * 1e3


def run_geometry(a, res: dict, deadline: float, save) -> None:
    """(b): decode / verify / mtp_step / mtp_prefill / state snapshot of the (27B) geometry at --ctx."""
    import torch

    from ninfer_mlc.runtime.tvm_loader import import_tvm

    kind = a.device
    tvm = import_tvm(kind)
    from tvm.runtime.vm import VirtualMachine

    dev = tvm.cuda(0) if kind == "cuda" else tvm.cpu(0)
    tdev = "cuda" if kind == "cuda" else "cpu"
    try:
        from ninfer_mlc.runtime.executor.cuda_graph import GraphedFunction, page_width_bucket
    except ImportError:
        GraphedFunction, page_width_bucket = None, None
    geo = _load_geometry(a)
    cfg, specs = geo["config"], geo["params"]
    g = res["geometry"] = {"name": geo["name"], "ctx": a.ctx, "dtype": geo["dtype"],
                           "weights": "real (artifact)" if geo["weights"] else "random, generated on the GPU",
                           "library_bytes": Path(geo["library"]).stat().st_size,
                           "build_workaround": geo.get("build_workaround")}
    t1 = time.time()
    vm = VirtualMachine(tvm.runtime.load_module(str(geo["library"])), dev)
    for f in ("decode", "verify", "mtp_step", "mtp_prefill"):
        if not vm.module.implements_function(f):
            raise RuntimeError(f"{geo['library']} lacks {f} (build it with the MTP head)")
    g["load_seconds"] = round(time.time() - t1, 2)
    t1 = time.time()
    if geo["weights"]:
        from ninfer_mlc.contract import safetensors_io

        arrs = {}
        for f in geo["weights"]:
            arrs.update(safetensors_io.load(f))
        params = [tvm.runtime.tensor(np.ascontiguousarray(arrs[n]), dev) for n, _, _ in specs]
        keep = None
    else:
        if kind != "cuda":
            raise RuntimeError("random weights are made on the GPU; pass --geo-dir for a CPU dry run")
        keep, _, nbytes = gpu_bench._gen_params(torch, specs, cfg)
        params = [tvm.runtime.from_dlpack(t) for t in keep]
        torch.cuda.synchronize()
        g["weights_bytes"] = sum(nbytes.values())
        g["mtp_weights_bytes"] = sum(v for n, v in nbytes.items() if n.startswith("mtp."))
    g["param_seconds"] = round(time.time() - t1, 2)

    batches = [int(x) for x in a.batches.split(",")]
    kmax = max(a.k)
    mmax = 2 * kmax + 2  # verify rows per sequence: k + 1, plus rolled-back tokens re-run in front
    B = max(batches)
    pps = -(-(a.ctx + mmax + kmax) // PAGE)
    width = page_width_bucket(pps) if (kind == "cuda" and page_width_bucket) else pps
    num_pages = B * pps + 1
    n_attn = cfg["layer_types"].count("full_attention")
    n_gdn = cfg["layer_types"].count("linear_attention")
    hkv, dh = cfg["num_key_value_heads"], cfg["head_dim"]
    hv, dk, dv = cfg["linear_num_value_heads"], cfg["linear_key_head_dim"], cfg["linear_value_head_dim"]
    conv_dim = 2 * cfg["linear_num_key_heads"] * dk + hv * dv
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    mdt, kvdt = tdt[geo["dtype"]], tdt[geo.get("kv_dtype") or geo["dtype"]]
    gen = torch.Generator(device=tdev)
    gen.manual_seed(1)
    kv = torch.randn((num_pages, n_attn, 2, hkv, PAGE, dh), device=tdev, dtype=kvdt, generator=gen)
    mtp_kv = torch.randn((num_pages, 1, 2, hkv, PAGE, dh), device=tdev, dtype=kvdt, generator=gen)
    slots = 2 * B + 1  # sequences + their pre-verification snapshots
    conv = torch.randn((slots, n_gdn, conv_dim, cfg["linear_conv_kernel_dim"] - 1), device=tdev, dtype=mdt,
                       generator=gen) * 0.1
    ssm = torch.randn((slots, n_gdn, hv, dk, dv), device=tdev, dtype=torch.float32, generator=gen) * 0.01
    kv_t, mtp_kv_t, conv_t, ssm_t = (tvm.runtime.from_dlpack(x) for x in (kv, mtp_kv, conv, ssm))
    persistent = [kv_t, conv_t, ssm_t, params]
    if kind == "cuda":
        free, total = torch.cuda.mem_get_info()
        g["device_memory_in_use_bytes"] = total - free

    def sync():
        dev.sync()
        if kind == "cuda":
            torch.cuda.synchronize()

    def T(x, dt=np.int32):
        return tvm.runtime.tensor(np.ascontiguousarray(x, dt), dev)

    rng = np.random.default_rng(0)
    V, D = int(cfg["vocab_size"]), int(cfg["hidden_size"])

    def page_table(b):
        pt = np.zeros((b, width), np.int32)
        pt[:, :pps] = np.arange(b * pps, dtype=np.int32).reshape(b, pps)
        return pt

    def decode_in(b):
        return [rng.integers(0, V, b), np.full(b, a.ctx), page_table(b), np.arange(b)]

    def verify_in(b, m):
        return [rng.integers(0, V, b * m), np.tile(np.arange(a.ctx, a.ctx + m), b), np.repeat(np.arange(b), m),
                np.arange(0, b * m + 1, m), page_table(b), np.arange(b)]

    def mtp_in(b, m, j=0):
        """m rows per sequence at positions ctx + j ..; mtp_prefill adds the last row of each as logit row."""
        return [rng.standard_normal((b * m, D)).astype(np.float32), rng.integers(0, V, b * m),
                np.tile(np.arange(a.ctx + j, a.ctx + j + m), b), np.repeat(np.arange(b), m), page_table(b)]

    def fetch(o, n):
        return [o[i].numpy() for i in range(n)]

    def eager(fname, host, n_out):
        return fetch(vm[fname](*[T(x) for x in host], *persistent), n_out)

    def mtp(fname, host, extra=()):
        h = [T(host[0], np.float32)] + [T(x) for x in host[1:]] + [T(x) for x in extra]
        return fetch(vm[fname](*h, mtp_kv_t, params), 2)

    use_graphs = bool(a.graphs and kind == "cuda" and GraphedFunction is not None)
    g_dec = GraphedFunction(tvm, dev, vm["decode"]) if use_graphs else None
    g_ver = GraphedFunction(tvm, dev, vm["verify"]) if use_graphs else None
    g["cuda_graphs"] = use_graphs
    warm_g = max(a.warm, 3)  # eager, capture + launch, replay

    # ---- checks: the argument layouts agree between functions (same state, same positions)
    s_conv, s_ssm = conv[0].clone(), ssm[0].clone()

    def restore():
        conv[0].copy_(s_conv)
        ssm[0].copy_(s_ssm)
        sync()

    din = decode_in(1)
    ld = eager("decode", din, 1)[0]
    restore()
    vin = verify_in(1, 2)
    vin[0][0] = din[0][0]
    lv = eager("verify", vin, 2)[0]
    restore()
    h = rng.standard_normal((1, D)).astype(np.float32)
    tk = rng.integers(0, V, 1)
    pt1 = page_table(1)
    ls = mtp("mtp_step", [h, tk, [a.ctx], [0], pt1])
    lp = mtp("mtp_prefill", [h, tk, [a.ctx], [0], pt1], extra=([0],))
    g["checks"] = {
        "verify_row0_vs_decode_rel_err": gpu_bench.rel_err(lv[0], ld[0]),
        "verify_row0_vs_decode_top1_equal": bool(int(np.argmax(lv[0])) == int(np.argmax(ld[0]))),
        "mtp_prefill_vs_mtp_step_rel_err": gpu_bench.rel_err(lp[0][0], ls[0][0]),
        "logits_finite": bool(all(np.all(np.isfinite(x)) for x in (ld, lv, ls[0], lp[0]))),
    }
    print("checks: " + json.dumps(g["checks"]), flush=True)
    save()

    # ---- timings
    for name in ("decode", "verify", "mtp_step", "mtp_prefill", "snapshot"):
        g[name] = {}
    for b in batches:
        if time.time() > deadline:
            g.setdefault("skipped_batches", []).append(b)
            print(f"geometry b={b}: skipped (budget)", flush=True)
            continue
        sb = str(b)
        din = decode_in(b)
        row = {"eager_ms": _timed(lambda: eager("decode", din, 1), sync, a.steps, a.warm)}
        if g_dec is not None:
            n0 = g_dec.stats["replays"]
            row["graph_ms"] = _timed(lambda: fetch(g_dec(din, persistent), 1), sync, a.steps, warm_g)
            if g_dec.stats["replays"] - n0 < a.steps:  # capture failed: that was the eager path
                row["graph_failed"] = row.pop("graph_ms") is not None
        g["decode"][sb] = row
        print(f"b={b} decode: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
        g["verify"][sb] = {}
        for m in range(1, mmax + 1):
            if time.time() > deadline:
                break
            vin = verify_in(b, m)
            row = {"eager_ms": _timed(lambda: eager("verify", vin, 2), sync, a.steps, a.warm)}
            if g_ver is not None:
                n0 = g_ver.stats["replays"]
                row["graph_ms"] = _timed(lambda: fetch(g_ver(vin, persistent), 2), sync, a.steps, warm_g)
                if g_ver.stats["replays"] - n0 < a.steps:
                    row["graph_failed"] = row.pop("graph_ms") is not None
            g["verify"][sb][str(m)] = row
            print(f"b={b} verify {m} rows/seq: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()), flush=True)
        mi = mtp_in(b, 1, 1)
        g["mtp_step"][sb] = {"eager_ms": _timed(lambda: mtp("mtp_step", mi), sync, a.steps, a.warm)}
        g["mtp_prefill"][sb] = {}
        for m in range(1, kmax + 2):
            mi = mtp_in(b, m)
            lr = np.arange(m - 1, b * m, m)
            g["mtp_prefill"][sb][str(m)] = {
                "eager_ms": _timed(lambda: mtp("mtp_prefill", mi, extra=(lr,)), sync, a.steps, a.warm)}
        s = slice(B, B + b)

        def snap():
            conv[s].copy_(conv[:b])
            ssm[s].copy_(ssm[:b])

        g["snapshot"][sb] = {"eager_ms": _timed(snap, sync, a.steps, a.warm),
                             "bytes": b * (conv[0].numel() * conv.element_size() + ssm[0].numel() * 4)}
        print(f"b={b} mtp_step {g['mtp_step'][sb]['eager_ms']:.2f} ms; mtp_prefill " +
              ", ".join(f"{m} rows {v['eager_ms']:.2f}" for m, v in g["mtp_prefill"][sb].items()) +
              f" ms; snapshot {g['snapshot'][sb]['eager_ms']:.3f} ms", flush=True)
        save()
    if use_graphs:
        g["graph_stats"] = {"decode": dict(g_dec.stats, last_error=g_dec.last_error),
                            "verify": dict(g_ver.stats, last_error=g_ver.last_error)}
        g_dec.close()
        g_ver.close()
    if kind == "cuda":
        g["torch_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
    save()
    del vm, params, keep, persistent, kv_t, mtp_kv_t, conv_t, ssm_t, kv, mtp_kv, conv, ssm
    if kind == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# projection
def tokens_per_round(acc: float, k: int) -> float:
    return float(k + 1) if acc >= 1 else (1 - acc ** (k + 1)) / (1 - acc)


def _interp(table: dict, x):
    """Piecewise-linear in rows per sequence (linear extrapolation past the last measured point)."""
    xs = sorted(int(m) for m in table)
    ys = [table[str(m)] for m in xs]
    x = np.asarray(x, np.float64)
    y = np.interp(x, xs, ys)
    if len(xs) >= 2:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        y = np.where(x > xs[-1], ys[-1] + slope * (x - xs[-1]), y)
    return y


def simulate_engine(acc: float, k: int, rounds: int = 20000, seed: int = 0) -> dict:
    """runtime/speculative.py's decode_step for one sequence with i.i.d. acceptance: verify rows = unfed +
    pending + k drafts; a rejection rolls the state back and leaves unfed += 1 + accepted; more than k + 1
    unfed tokens are re-fed by a separate prefill."""
    rng = np.random.default_rng(seed)
    u = 0
    rows, refeed, acc_n = np.zeros(rounds, np.int64), np.zeros(rounds, np.int64), np.zeros(rounds, np.int64)
    draws = rng.random((rounds, k))
    for r in range(rounds):
        rows[r] = u + 1 + k
        n = 0
        while n < k and draws[r, n] < acc:
            n += 1
        acc_n[r] = n
        u = u + 1 + n if n < k else 0
        if u > k + 1:
            refeed[r], u = u, 0
    return {"verify_rows": rows, "refeed_rows": refeed, "accepted": acc_n}


def project(res: dict) -> list:
    g = res.get("geometry") or {}
    if not g.get("decode"):
        return []
    ks = res["args"]["k"]
    meas, prof = {}, {}
    for r in (res.get("tiny") or {}).get("results", []):
        if r.get("draft_tokens") and r["concurrency"] == min(res["args"]["concurrency"]):
            meas[r["draft_tokens"]] = r["acceptance_rate"]
            prof[r["draft_tokens"]] = r
    rows = []
    for sb, dec in g["decode"].items():
        ver = g["verify"].get(sb) or {}
        if sb not in g["mtp_step"] or not ver:
            continue
        # runner: decode the way the runner runs it (graph replay where available), verify/MTP eager;
        # eager: everything eager; graphs: what if verify were replayed as graphs too
        modes = {"runner": ("graph_ms" if "graph_ms" in dec else "eager_ms", "eager_ms"),
                 "eager": ("eager_ms", "eager_ms"), "graphs": ("graph_ms", "graph_ms")}
        for mode, (dkey, vkey) in modes.items():
            if dkey not in dec or any(vkey not in v for v in ver.values()):
                continue
            t_dec = dec[dkey]
            tv = {m: v[vkey] for m, v in ver.items()}
            tmp = {m: v["eager_ms"] for m, v in g["mtp_prefill"][sb].items()}
            t_ms = g["mtp_step"][sb]["eager_ms"]
            t_snap = g["snapshot"][sb]["eager_ms"]
            for k in ks:
                if str(k + 1) not in tv:
                    continue
                accs = ([(meas[k], "tiny")] if k in meas else []) + [(0.6, "fixed"), (0.8, "fixed")]
                for acc, src in accs:
                    tau = tokens_per_round(acc, k)
                    ideal = float(_interp(tv, k + 1) + _interp(tmp, tau) + (k - 1) * t_ms + t_snap)
                    sim = simulate_engine(acc, k)
                    t_ver = _interp(tv, sim["verify_rows"]).mean()
                    t_ref = (_interp(tv, sim["refeed_rows"]) * (sim["refeed_rows"] > 0)).mean()
                    t_mp = _interp(tmp, sim["accepted"] + 1).mean()
                    engine = float(t_ver + t_ref + t_mp + (k - 1) * t_ms + t_snap)
                    tau_sim = float(sim["accepted"].mean() + 1)
                    rows.append({
                        "batch": int(sb), "k": k, "mode": mode, "acceptance": round(acc, 4), "acceptance_source": src,
                        "tokens_per_round": round(tau, 4), "decode_ms": round(t_dec, 3),
                        "verify_ms": round(float(_interp(tv, k + 1)), 3), "mtp_step_ms": round(t_ms, 3),
                        "round_ms_ideal": round(ideal, 3), "speedup_ideal": round(tau * t_dec / ideal, 3),
                        "engine_verify_rows_per_round": round(float(sim["verify_rows"].mean()), 3),
                        "engine_refeed_rows_per_round": round(float(sim["refeed_rows"].mean()), 3),
                        "round_ms_engine": round(engine, 3), "speedup_engine": round(tau_sim * t_dec / engine, 3)})
                    if src == "tiny":  # the tiny engine's own round profile (acceptance is not i.i.d. there)
                        p = prof[k]
                        tau_m, rows_m = p["tokens_per_round"], p["verify_tokens_per_round"]
                        t_m = float(_interp(tv, rows_m) + _interp(tmp, tau_m) + (k - 1) * t_ms + t_snap)
                        rows[-1].update({"tiny_tokens_per_round": tau_m, "tiny_verify_rows_per_round": rows_m,
                                         "round_ms_tiny_profile": round(t_m, 3),
                                         "speedup_tiny_profile": round(tau_m * t_dec / t_m, 3)})
    return rows


def print_tables(res: dict) -> None:
    t = res.get("tiny")
    if t and t.get("results"):
        print(f"\n(a) tiny model end to end ({t['model']}, {t['target']} {t['dtype']}, greedy, {t['requests']} "
              f"requests x {t['max_tokens']} tokens, engine + MTP head):")
        print("  conc  k  accept  tok/round  verify rows/round  tok/s   speedup  identical")
        for r in t["results"]:
            k = r.get("draft_tokens", 0)
            print(f"  {r['concurrency']:4d} {k:2d}  " + (
                f"{r['acceptance_rate']:6.2f}  {r['tokens_per_round']:9.2f}  {r['verify_tokens_per_round']:17.2f}"
                if k else f"{'-':>6}  {1:9.2f}  {1:17.2f}") +
                f"  {r['tokens_per_s']:6.1f}  {r.get('speedup', 1.0):7.2f}  {r.get('identical_to_baseline', '-')}")
    g = res.get("geometry")
    proj = res.get("projection") or []
    if g and g.get("decode"):
        print(f"\n(b) {g['name']} at ctx {g['ctx']} on {res.get('device')}, weights {g['weights']}: acceptance is not "
              "measured on this model" + (" (random weights: it would mean nothing)" if "random" in g["weights"] else "") +
              "; the speedup is PROJECTED from the measured costs (ms) at the tiny model's acceptance and at "
              "a = 0.6 / 0.8:")
        for sb, d in g["decode"].items():
            v = g["verify"].get(sb, {})
            dm = {k: x for k, x in d.items() if k.endswith("_ms")}
            print(f"  b={sb}: decode " + "/".join(f"{x:.2f}" for x in dm.values()) + f" ({'/'.join(dm)}); verify rows " +
                  ", ".join(f"{m}: {x['eager_ms']:.1f}" for m, x in v.items()) +
                  f" (eager); mtp_step {g['mtp_step'].get(sb, {}).get('eager_ms', float('nan')):.2f}; "
                  f"snapshot {g['snapshot'].get(sb, {}).get('eager_ms', float('nan')):.3f}")
        mode = "runner"
        sel = [p for p in proj if p["mode"] == mode]
        if sel:
            gr = {(p["batch"], p["k"], p["acceptance"]): p for p in proj if p["mode"] == "graphs"}
            print("  decode as the runner runs it (CUDA graph where available), verify + MTP eager; ideal = no "
                  "rollback re-feed, engine = re-feed simulated (v.rows: verify rows/round)" +
                  ("; last column: verify graphed too (engine)" if gr else ""))
            print("  b  k  accept (src)   tok/round  decode  verify(k+1)  round ideal/engine  v.rows  "
                  "speedup ideal/engine" + ("  [verify graphed]" if gr else ""))
            for p in sel:
                q = gr.get((p["batch"], p["k"], p["acceptance"]))
                print(f"  {p['batch']}  {p['k']}  {p['acceptance']:.2f} ({p['acceptance_source']:5s})  "
                      f"{p['tokens_per_round']:8.2f}  {p['decode_ms']:6.2f}  {p['verify_ms']:11.2f}  "
                      f"{p['round_ms_ideal']:8.2f}/{p['round_ms_engine']:<8.2f}  "
                      f"{p['engine_verify_rows_per_round']:6.2f}  {p['speedup_ideal']:6.2f}/{p['speedup_engine']:<6.2f}" +
                      (f"        {q['speedup_engine']:.2f}" if q else ""))


def cmd_run(a) -> int:
    _ensure_pkg()
    t0 = time.time()
    res = {"bench": "spec_decode_gpu", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "args": vars(a)}
    if a.device == "cuda":
        import torch

        res["device"] = torch.cuda.get_device_name(0)
    else:
        import platform

        res["device"] = "cpu " + (platform.processor() or platform.machine())

    def save():
        res["wall_seconds"] = round(time.time() - t0, 2)
        Path(a.result).write_text(json.dumps(res, indent=1, default=str))

    if not a.skip_forced:
        try:
            out = Path(a.out)
            res["forced"] = spec_forced.run_forced(
                Path(a.forced_target or out / "q27b-taps"), Path(a.forced_drafter or out / "dflash2-27b"),
                a.forced_ctx, a.forced_gen, [int(x) for x in a.forced_batches.split(",")],
                t0 + (a.budget_s if a.skip_27b and a.skip_tiny else 0.5 * a.budget_s), device=a.device,
                log=lambda *m: print(*m, flush=True), save=save, host_check=not a.forced_no_host,
                refeed_max=a.forced_refeed_max, profile_window_ms=a.forced_profile_ms,
                lm_head_draft=a.forced_lm_head_draft)
        except Exception as e:  # noqa: BLE001 - keep what the other parts measure
            import traceback

            traceback.print_exc()
            res["forced"] = {"error": repr(e)[:600]}
        save()
    if not a.skip_27b:
        try:
            run_geometry(a, res, t0 + 0.65 * a.budget_s, save)
        except Exception as e:  # noqa: BLE001 - keep the tiny part and what was measured
            import traceback

            traceback.print_exc()
            res.setdefault("geometry", {})["error"] = repr(e)[:600]
        res["projection"] = project(res)
        save()
    if not a.skip_tiny:
        try:
            run_tiny(a, res, t0 + a.budget_s, save)
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            res.setdefault("tiny", {})["error"] = repr(e)[:600]
    res["projection"] = project(res)
    save()
    print_tables(res)
    spec_forced.print_forced(res.get("forced"))
    print(f"\nwall {time.time() - t0:.1f}s; result {a.result}", flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap, sub, p, r = gc.prep_run_parser(__doc__)
    p.add_argument("--tiny-quant", default="f32", choices=["f32", "bf16"])
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument("--skip-27b", action="store_true")
    p.add_argument("--skip-forced", action="store_true", help="no (c): the 27B + DFlash2 random-weight artifacts")
    p.add_argument("--forced-quant", default="bf16", choices=["bf16", "nvfp4"])
    p.add_argument("--forced-max-context", type=int, default=16384)
    r.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    r.add_argument("--tiny-dir", default=None, help="tiny model artifact (default OUT/tiny-cuda)")
    r.add_argument("--geo-dir", default=None,
                   help="a compiled artifact standing in for OUT/q27b_mtp.so (CPU dry run; its real weights)")
    r.add_argument("--skip-tiny", action="store_true")
    r.add_argument("--skip-27b", action="store_true")
    r.add_argument("--skip-forced", action="store_true")
    r.add_argument("--forced-target", default=None, help="(c) target artifact with taps (default OUT/q27b-taps)")
    r.add_argument("--forced-drafter", default=None, help="(c) DFlash2 drafter artifact (default OUT/dflash2-27b)")
    r.add_argument("--forced-ctx", type=int, default=8192)
    r.add_argument("--forced-gen", type=int, default=96)
    r.add_argument("--forced-batches", default="1,4")
    r.add_argument("--forced-no-host", action="store_true",
                   help="(c) skip the host-round rerun of each profile (A/B and device = host output check)")
    r.add_argument("--forced-profile-ms", type=float, default=0.0,
                   help="(c) batch-1 rows: a CUPTI timeline of the last MS of a third pass (GPU busy fraction, idle gaps)")
    r.add_argument("--forced-refeed-max", type=int, default=None,
                   help="(c) also run each speculative profile with this re-feed bound (--spec-refeed-max)")
    r.add_argument("--forced-lm-head-draft", default=None, metavar="N|FILE",
                   help="(c) every MTP profile also with the shortlisted proposal head (--lm-head-draft N|FILE)")
    r.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    r.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    r.add_argument("--max-tokens", type=int, default=64)
    r.add_argument("--requests", type=int, default=4)
    r.add_argument("--ctx", type=int, default=8192)
    r.add_argument("--batches", default="1,4")
    r.add_argument("--steps", type=int, default=6)
    r.add_argument("--warm", type=int, default=3)
    r.add_argument("--graphs", type=int, default=1, help="1: also time decode/verify as CUDA graph replays")
    r.add_argument("--budget-s", type=float, default=210)
    a = ap.parse_args(argv)
    return {"prep": cmd_prep, "run": cmd_run}[a.cmd](a) or 0


if __name__ == "__main__":
    sys.exit(main())
