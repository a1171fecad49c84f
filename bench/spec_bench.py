"""Speculative decoding benchmark: tokens per round, acceptance and wall-clock speedup vs no speculation.

    .venv/bin/python bench/spec_bench.py                       # the embedded tiny model, CPU, MTP k=1..5
    .venv/bin/python bench/spec_bench.py --spec draft --draft-model auto   # + a 2-layer drafter built here
    .venv/bin/python bench/spec_bench.py --model dist/X --k 2 3 --concurrency 1 4 --out result.json

Each configuration runs the same greedy requests (ignore_eos, fixed length) through the engine after a
warm-up; outputs are checked token-for-token against the no-speculation run. JSON on stdout (and --out).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))  # after the installed package: ROOT/ninfer_mlc alone has no runtime/compile

PROMPTS = [
    "The quick brown fox jumps over the lazy dog and then",
    "def main(self):\n    return x + y",
    "import os\nimport sys\nfrom json import loads",
    "Once upon a time there was a king who",
    "class Parser:\n    def __init__(self, path):",
    "the young doctor walked to the old house",
    '{"name": "value", "items": [1, 2, 3], "ok":',
    "In the morning the quiet river was",
]


def build_truncated_drafter(out_dir: Path, keep=(0, 3)) -> Path:
    """A smaller drafter with the tiny model's tokenizer: layers `keep` of the tiny default model (one GDN,
    one full attention), the same embeddings and lm_head, no MTP head."""
    from ninfer_mlc.compile.build import compile_model
    from ninfer_mlc.compile.tiny_default import generate
    from ninfer_mlc.contract import safetensors_io

    with tempfile.TemporaryDirectory(prefix="ninfer_drafter_") as tmp:
        hf = generate(Path(tmp) / "hf")
        cfg = json.loads((hf / "config.json").read_text())
        w = safetensors_io.load(hf / "model.safetensors")
        out = {}
        for name, arr in w.items():
            if name.startswith("mtp."):
                continue
            if name.startswith("model.layers."):
                i = int(name.split(".")[2])
                if i not in keep:
                    continue
                name = name.replace(f"model.layers.{i}.", f"model.layers.{keep.index(i)}.", 1)
            out[name] = arr
        (hf / "model.safetensors").unlink()
        safetensors_io.save(hf / "model.safetensors", {k: out[k].copy() for k in sorted(out)})
        cfg["layer_types"] = [cfg["layer_types"][i] for i in keep]
        cfg["num_hidden_layers"] = len(keep)
        cfg["mtp_num_hidden_layers"] = 0
        (hf / "config.json").write_text(json.dumps(cfg, indent=2))
        return compile_model(hf, target="llvm", quant="f32", out_dir=out_dir, name="qwen3x-tiny-drafter",
                             log=lambda *_: None)


def run(model: Path, prompts, max_tokens: int, concurrency: int, spec: str = "none", k: int = 1,
        draft_model: str | None = None, lm_head_draft: str | None = None):
    from ninfer_mlc.runtime.assemble import open_engine
    from ninfer_mlc.runtime.config import EngineConfig
    from ninfer_mlc.runtime.engine import GenRequest
    from ninfer_mlc.runtime.sampling import SamplingParams

    opts = EngineConfig(max_concurrency=concurrency, max_pending_requests=len(prompts), max_context=2048, host_kv_mib=0,
                         prefix_reuse=False, spec=spec, draft_tokens=k, draft_model=draft_model,
                         lm_head_draft=lm_head_draft)
    eng = open_engine(model, opts)
    try:
        def once():
            t0 = time.perf_counter()
            hs = [eng.submit(GenRequest(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True,
                                                          logprobs=True))) for p in prompts]
            outs = [[t for ev in h.iter_sync(timeout=900) if hasattr(ev, "token_ids") for t in ev.token_ids]
                    for h in hs]
            return outs, time.perf_counter() - t0, [h.finished.timings for h in hs]

        once()  # warm-up (first-call costs, page allocation)
        before = dict(eng.snapshot())
        outs, wall, timings = once()
        after = eng.snapshot()
    finally:
        eng.stop()
    d = {key: after[key] - before.get(key, 0) for key in after
         if isinstance(after[key], (int, float)) and not isinstance(after[key], bool)}
    n_tok = sum(len(o) for o in outs)
    res = {"spec": spec, "draft_tokens": k if spec != "none" else 0, "concurrency": concurrency,
           "requests": len(prompts), "generated_tokens": n_tok, "wall_s": round(wall, 4),
           "tokens_per_s": round(n_tok / wall, 2),
           "decode_tokens_per_s_per_request": round(sum(t["predicted_per_second"] for t in timings) / len(timings), 2)}
    if spec != "none":
        drafted, acc = d.get("spec_draft_tokens", 0), d.get("spec_accepted_tokens", 0)
        rows = max(1, d.get("spec_row_rounds", 0))
        res.update({
            "draft_n": drafted, "draft_n_accepted": acc, "acceptance_rate": round(acc / drafted, 4) if drafted else 0.0,
            "tokens_per_round": round(d.get("spec_emitted_tokens", 0) / rows, 4),
            "verify_tokens_per_round": round(d.get("spec_verify_tokens", 0) / rows, 4),
            "recomputed_tokens_per_round": round(d.get("spec_recompute_tokens", 0) / rows, 4),
            "target_forwards": d.get("decode_rounds", 0),
        })
    else:
        res["target_forwards"] = d.get("decode_rounds", 0)
    return res, outs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="compiled model (default: the embedded tiny model)")
    ap.add_argument("--spec", default="mtp", choices=["mtp", "draft"])
    ap.add_argument("--draft-model", default=None, help="--spec draft: compiled drafter, or 'auto' (2-layer tiny)")
    ap.add_argument("--lm-head-draft", default=None)
    ap.add_argument("--k", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=4, help="requests per configuration (cycled prompts)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from ninfer_mlc.paths import default_model_dir
    from ninfer_mlc.runtime.tokenizer import load_tokenizer

    model = Path(args.model) if args.model else default_model_dir()
    tok = load_tokenizer(model)
    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)]).ids for i in range(args.requests)]
    draft = args.draft_model
    tmpdir = None
    if args.spec == "draft" and draft in (None, "auto"):
        tmpdir = tempfile.TemporaryDirectory(prefix="ninfer_spec_bench_")
        draft = str(build_truncated_drafter(Path(tmpdir.name) / "drafter"))
    results = []
    for c in args.concurrency:
        base, base_out = run(model, prompts, args.max_tokens, c)
        results.append(base)
        print(json.dumps(base), file=sys.stderr)
        for k in args.k:
            r, outs = run(model, prompts, args.max_tokens, c, args.spec, k, draft, args.lm_head_draft)
            r["identical_to_baseline"] = outs == base_out
            r["speedup"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
            r["forward_ratio"] = round(base["target_forwards"] / max(1, r["target_forwards"]), 3)
            results.append(r)
            print(json.dumps(r), file=sys.stderr)
    doc = {"bench": "spec_decode", "model": model.name, "spec": args.spec,
           "draft_model": (Path(draft).name if draft else None), "device": "cpu",
           "cpu": platform.processor() or platform.machine(), "threads": os.environ.get("TVM_NUM_THREADS", os.cpu_count()),
           "max_tokens": args.max_tokens, "results": results}
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if tmpdir is not None:
        tmpdir.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
