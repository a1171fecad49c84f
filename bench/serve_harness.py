"""Kernel-harness figures for the shapes a serving benchmark measures, with their floors.

The serving benchmark (serve_bench.py --harness) runs this in its own process before the server
starts, so the two never hold the device memory at the same time and each engine figure can sit
beside the executor's own rate for the same shape, measured in the same run:

* decode at (context, batch): `runtime.harness.Harness` decode steps with every sequence at the
  context (pages reserved, not prefilled: the step cost does not depend on the KV values), wall clock
  over N steps after warm-up steps (VM dispatch, CUDA-graph replay, logits to the host included);
* prefill of one fresh prompt of each context in the server's prefill chunk size (as the engine feeds it);
* floors as in BENCHMARKS.md: decode = bytes a step must move (weights except the embedding table,
  KV read, GDN state read + write) / device copy bandwidth; prefill = (2 x matmul parameters x tokens +
  causal attention FLOPs) / bf16 matmul rate, the two rates measured here with torch when present.

    python bench/serve_harness.py MODEL_DIR --decode 8192x1,8192x8 --prefill 8192 -o harness.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_common import device_rates, write_json  # noqa: E402


def model_facts(runner) -> dict:
    """Bytes and FLOP counts of the artifact the floors need, from its manifest and pool layout.
    Matmul parameters are the 2-D projection weights (NVFP4 codes hold two per byte) without the
    embedding, lm_head and MTP head; a decode step reads every weight but the embedding and MTP head.
    MoE (stacked `.experts.` tensors [E (+1 shared), ...]): a step reads only the experts its rows select
    (decode_floor_s), and a token's matmul work counts its top-k experts and the shared one."""
    m, cfg = runner.manifest, runner.cfg
    itemsize = {"float32": 4, "float16": 2, "bfloat16": 2, "uint8": 1, "int8": 1, "int32": 4, "uint32": 4}
    skipped = mm_params = expert_bytes = expert_mm = 0
    stack = 0
    for name, shape, dtype in m.params:
        n = int(np.prod(shape))
        if "embed_tokens" in name or name.startswith("mtp"):
            skipped += n * itemsize.get(str(dtype), 2)
        elif ".experts." in name and len(shape) >= 2:
            stack = int(shape[0])
            expert_bytes += n * itemsize.get(str(dtype), 2)
            if name.endswith("weight") and len(shape) == 3:
                expert_mm += n // stack * (2 if str(dtype) == "uint8" else 1)
        elif (len(shape) == 2 and name.endswith("weight") and "lm_head" not in name and "norm" not in name
              and "conv1d" not in name):
            mm_params += n * (2 if str(dtype) == "uint8" else 1)
    layers = cfg.get("layer_types") or []
    routed, top_k = int(cfg.get("num_experts") or 0), int(cfg.get("num_experts_per_tok") or 0)
    always = max(0, stack - routed) if routed else 0  # shared experts folded into the stacks
    facts = {"weights_bytes": int(runner.weights_bytes), "embedding_and_mtp_bytes": int(skipped),
             "weights_read_per_step": int(runner.weights_bytes - skipped - expert_bytes),
             "matmul_params": int(mm_params + expert_mm * (top_k + always)),
             "kv_bytes_per_token": runner.page_bytes / runner.page_size,
             "state_bytes_per_seq": int(runner.conv_slot_bytes + runner.ssm_slot_bytes),
             "n_attn_layers": layers.count("full_attention"),
             "num_attention_heads": int(cfg.get("num_attention_heads", 0)), "head_dim": int(cfg.get("head_dim", 0)),
             "dtype": m.dtype, "kv_dtype": m.kv_dtype}
    if expert_bytes:
        facts.update({"expert_bytes": int(expert_bytes), "expert_stack": stack, "routed_experts": routed,
                      "experts_per_token": top_k, "shared_experts": always})
    return facts


def experts_read(facts: dict, batch: int) -> float:
    """Expected experts a decode step of `batch` rows reads: the union of the rows' top-k (uniform routing,
    as random weights give) plus the shared ones."""
    e, k = facts["routed_experts"], facts["experts_per_token"]
    return e * (1 - (1 - k / e) ** batch) + facts["shared_experts"]


def decode_floor_s(facts: dict, batch: int, ctx: int, copy_bw) -> tuple[int, object]:
    byts = int(facts["weights_read_per_step"] + batch * ctx * facts["kv_bytes_per_token"]
               + 2 * batch * facts["state_bytes_per_seq"])
    if facts.get("expert_bytes"):
        byts += int(facts["expert_bytes"] / facts["expert_stack"] * experts_read(facts, batch))
    return byts, (byts / copy_bw if copy_bw else None)


def prefill_flops(facts: dict, n: int, matmul_params: int) -> float:
    attn = facts["n_attn_layers"] * 4 * facts["num_attention_heads"] * facts["head_dim"] * n * (n + 1) / 2
    return 2.0 * matmul_params * n + attn


def _fit_tokens(runner_kv_bytes_per_token: float, reserve_bytes: int) -> int | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    free, _ = torch.cuda.mem_get_info()
    return int(max(0, free - reserve_bytes) // runner_kv_bytes_per_token)


def run_harness(model_dir: str, decode_shapes: list[tuple[int, int]], prefill_ctxs: list[int], steps: int = 8,
                warm: int = 3, prefill_chunk: int = 512, rates: bool = True, reserve_gib: float = 8.0,
                budget_s: float = 1e9, profile: bool = False, device_argmax: bool = False,
                programmatic_launch: bool = False, verify: str = "size") -> dict:
    """Harness decode step times and prefill times for the given shapes, with floors (see module doc).
    profile: also a CUPTI kernel breakdown (gpu_bench._profile) of one decode step per shape and of the
    first prefill chunk per context, under res["profile"].
    device_argmax: each decode step ends in the library's sampler (greedy) on the device and only the token ids
    come to the host, as in the engine with device sampling (default: the [B, V] logits come to the host).
    programmatic_launch: graphs with programmatic kernel edges where the library allows (EngineConfig
    programmatic_launch; off by default). verify: the manifest check (read_manifest's; "none" lets a copy without the
    tokenizer, which the harness never reads, travel to the GPU machine)."""
    from ninfer_mlc.contract.manifest import read_manifest
    from ninfer_mlc.runtime.harness import Harness

    t0 = time.perf_counter()
    res: dict = {"model": str(model_dir), "steps": steps, "prefill_chunk": prefill_chunk, "decode": [],
                 "prefill": [], "skipped": []}
    res["rates"] = device_rates(("floors",)) if rates else {}
    bw, rate = res["rates"].get("copy_bandwidth_Bps"), res["rates"].get("bf16_matmul_flops")

    man = read_manifest(model_dir, verify=verify)
    lay = man.layout()
    per_tok = lay.page_bytes / man.page_size
    max_b = max([b for _, b in decode_shapes] + [1])
    ps = man.page_size  # each sequence rounds up to whole pages
    want = max([b * -(-(c + steps + warm + 1) // ps) * ps for c, b in decode_shapes]
               + [c + 1 for c in prefill_ctxs] + [1024])
    weights = sum(int(np.prod(s)) * {"float32": 4, "bfloat16": 2, "float16": 2}.get(str(d), 1)
                  for _, s, d in man.params)
    fit = _fit_tokens(per_tok, int(weights + reserve_gib * 2 ** 30 + (max_b + 1) * lay.state_slot_bytes))
    cap = want if fit is None else max(min(want, fit), man.page_size)
    res["kv_pool_tokens"], res["kv_pool_tokens_wanted"] = cap, want
    h = Harness(model_dir, kv_capacity_tokens=cap, num_slots=max_b + 1, max_batch=max_b,
                programmatic_launch=programmatic_launch, verify=verify)
    res["programmatic_launch"] = bool(programmatic_launch and man.extras.get("grid_dependency_wait"))
    facts = model_facts(h.runner)
    res["facts"] = facts
    rng = np.random.default_rng(0)
    vocab = h.vocab_size
    res["decode_output"] = "token ids (device argmax)" if device_argmax else "logits to the host"
    argmax = None
    if device_argmax:
        from ninfer_mlc.runtime.spec.device_round import DeviceArgmax
        argmax = DeviceArgmax(h.runner)

    trace: list = []  # each step's greedy ids: equal digests = the same outputs (e.g. with and without PDL)

    def decode_step(seqs, toks):
        if argmax is None:
            logits = h.decode(seqs, toks)
            trace.append(np.argmax(logits, axis=-1).astype(np.int64))
            return logits
        ids = argmax.run(h.decode(seqs, toks, on_device=True))[0].numpy()
        trace.append(ids.astype(np.int64))
        return np.zeros((len(ids), 1), np.float32) if np.all((ids >= 0) & (ids < vocab)) else np.full((1, 1), np.nan)

    for ctx, b in decode_shapes:
        pages = b * -(-(ctx + steps + warm + 1) // h.page_size)
        if ctx + steps + warm + 1 > man.max_context:
            res["skipped"].append({"kind": "decode", "context": ctx, "batch": b,
                                   "why": f"past the compiled max_context {man.max_context}"})
            continue
        if pages > h.kv.pages.free_pages:
            res["skipped"].append({"kind": "decode", "context": ctx, "batch": b,
                                   "why": f"pool: needs {pages} pages, {h.kv.pages.free_pages} free"})
            continue
        if time.perf_counter() - t0 > budget_s:
            res["skipped"].append({"kind": "decode", "context": ctx, "batch": b, "why": "time budget"})
            continue
        trace.clear()
        seqs = [h.new_seq() for _ in range(b)]
        for s in seqs:  # the context exists as reserved pages; the step cost does not depend on their values
            h.reserve(s, ctx + steps + warm + 1)
            h.kv.advance(s, ctx - 1)
        for _ in range(warm):
            decode_step(seqs, rng.integers(0, vocab, b).tolist())
        ts = time.perf_counter()
        for _ in range(steps):
            logits = decode_step(seqs, rng.integers(0, vocab, b).tolist())
        dt = (time.perf_counter() - ts) / steps
        if profile:
            res.setdefault("profile", []).append(_profile(
                lambda: decode_step(seqs, rng.integers(0, vocab, b).tolist()), f"decode ctx={ctx} b={b}"))
        for s in seqs:
            h.free_seq(s)
        byts, floor = decode_floor_s(facts, b, ctx, bw)
        row = {"context": ctx, "batch": b, "step_ms": round(dt * 1e3, 3), "tok_s": round(b / dt, 2),
               "tok_s_per_stream": round(1 / dt, 2), "bytes_per_step": byts,
               "floor_ms": None if floor is None else round(floor * 1e3, 3),
               "fraction_of_floor": None if floor is None else round(floor / dt, 4),
               "logits_finite": bool(np.all(np.isfinite(logits))),
               "ids_sha": hashlib.sha256(np.concatenate(trace[:warm + steps]).tobytes()).hexdigest()[:16]}
        res["decode"].append(row)
        print(f"harness decode ctx={ctx} b={b}: {dt * 1e3:.2f} ms/step", flush=True)

    mm = facts["matmul_params"]
    if prefill_ctxs:  # first calls of the prefill function (kernel loading, workspace) stay out of the figures
        s = h.new_seq()
        h.prefill([(s, rng.integers(0, vocab, min(64, prefill_chunk)).tolist())])
        h.free_seq(s)
    for n in prefill_ctxs:
        if n + 1 > man.max_context:
            res["skipped"].append({"kind": "prefill", "context": n, "why": f"past the compiled max_context {man.max_context}"})
            continue
        if -(-n // h.page_size) > h.kv.pages.free_pages:
            res["skipped"].append({"kind": "prefill", "context": n, "why": "pool"})
            continue
        if time.perf_counter() - t0 > budget_s:
            res["skipped"].append({"kind": "prefill", "context": n, "why": "time budget"})
            continue
        s = h.new_seq()
        toks = rng.integers(0, vocab, n).tolist()
        ts = time.perf_counter()
        for c0 in range(0, n, prefill_chunk):
            out = h.prefill([(s, toks[c0:c0 + prefill_chunk])])
        dt = time.perf_counter() - ts
        h.free_seq(s)
        if profile:
            s = h.new_seq()
            res.setdefault("profile", []).append(_profile(
                lambda: h.prefill([(s, toks[:prefill_chunk])]), f"prefill chunk {min(n, prefill_chunk)}"))
            h.free_seq(s)
        fl = prefill_flops(facts, n, mm)
        floor = fl / rate if rate else None
        res["prefill"].append({"context": n, "seconds": round(dt, 4), "tok_s": round(n / dt, 2), "flops": fl,
                               "floor_s": None if floor is None else round(floor, 4),
                               "fraction_of_floor": None if floor is None else round(floor / dt, 4),
                               "logits_finite": bool(np.all(np.isfinite(out[0])))})
        print(f"harness prefill {n}: {dt:.3f} s", flush=True)
    g = getattr(h.runner, "decode_graphs", None)
    res["decode_graphs"] = dict(g.stats, last_error=g.last_error) if g is not None else None
    res["wall_s"] = round(time.perf_counter() - t0, 3)
    return res


def _profile(fn, label: str) -> dict:
    """CUPTI kernel times of one call (bench/gpu_bench.py's breakdown by kernel category)."""
    import torch
    from gpu_bench import _profile as cupti_profile

    return cupti_profile(torch, fn, label, top=40)


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'8192x1,8192x8' -> [(8192, 1), (8192, 8)] (context x batch)."""
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            c, b = part.lower().split("x")
            out.append((int(c), int(b)))
        except ValueError:
            raise SystemExit(f"serve_harness: bad shape {part!r}, expected CONTEXTxBATCH") from None
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--decode", default="", help="CONTEXTxBATCH,... decode shapes")
    ap.add_argument("--prefill", default="", help="CONTEXT,... prompt lengths")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--no-rates", action="store_true", help="skip the torch copy/matmul rates (floors null)")
    ap.add_argument("--reserve-gib", type=float, default=8.0, help="device memory left beside weights and KV")
    ap.add_argument("--budget-s", type=float, default=1e9)
    ap.add_argument("--profile", action="store_true", help="CUPTI kernel breakdown of each shape (needs torch)")
    ap.add_argument("--device-argmax", action="store_true",
                    help="decode steps end in the device sampler (greedy); only token ids come to the host")
    ap.add_argument("--programmatic-launch", action="store_true",
                    help="graphs with programmatic kernel -> kernel edges (PDL) where the library's kernels wait")
    ap.add_argument("--verify", choices=("none", "size"), default="size",
                    help="manifest check; none: an artifact copy without its tokenizer")
    ap.add_argument("-o", "--output", default=None)
    a = ap.parse_args(argv)
    res = run_harness(a.model, parse_shapes(a.decode), [int(x) for x in a.prefill.split(",") if x.strip()],
                      a.steps, prefill_chunk=a.prefill_chunk, rates=not a.no_rates, reserve_gib=a.reserve_gib,
                      budget_s=a.budget_s, profile=a.profile, device_argmax=a.device_argmax,
                      programmatic_launch=a.programmatic_launch, verify=a.verify)
    write_json(a.output, res)
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
