"""Constrained-decoding cost on the CPU (runtime/grammar.py): tokenizer setup, grammar compile and the
per-token mask, for a model's real tokenizer or a synthetic large byte-level vocabulary.

    python bench/grammar_bench.py MODEL_DIR [--vocab-size N] [--json OUT.json]
    python bench/grammar_bench.py --synthetic 248320 [--json OUT.json]

MODEL_DIR holds tokenizer.json (a compiled artifact or a Hugging Face directory); --vocab-size is the
model's logits width (config.json's vocab_size when present). --synthetic N extends the embedded tiny
tokenizer with random byte-level tokens up to N ids (Qwen3.5's vocabulary is 248320): the mask cost
depends mostly on the vocabulary size. Prints one line per measurement and writes JSON.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ninfer_mlc.runtime.grammar import ConstraintCompiler, allocate_bitmask, apply_bitmask, load_core  # noqa: E402


def synthetic_tokenizer(n: int):
    """The tiny tokenizer plus random byte-level tokens (2-12 bytes) up to n ids."""
    from tokenizers import Tokenizer

    from ninfer_mlc.paths import default_model_dir

    spec = json.loads((default_model_dir() / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    byte_chars = [c for c in vocab if len(c) == 1][:256]
    rng = np.random.default_rng(0)
    first_free = max(max(vocab.values()), max(a["id"] for a in spec["added_tokens"])) + 1
    added_base = len(vocab)
    for a in spec["added_tokens"]:  # keep the special tokens at the end
        a["id"] += n - first_free
    while len(vocab) < n - len(spec["added_tokens"]):
        s = "".join(rng.choice(byte_chars, size=int(rng.integers(2, 13))))
        if s not in vocab:
            vocab[s] = len(vocab)
    assert len(vocab) >= added_base
    return Tokenizer.from_str(json.dumps(spec))


def tools_like_an_agent(n: int) -> list[dict]:
    """n function tools with agent-sized schemas (strings, enums, arrays, nested objects)."""
    out = []
    for i in range(n):
        out.append({"type": "function", "function": {"name": f"tool_{i}", "parameters": {
            "type": "object", "required": ["path", "mode"], "properties": {
                "path": {"type": "string", "description": "file path"},
                "mode": {"type": "string", "enum": ["read", "write", "append"]},
                "limit": {"type": "integer", "minimum": 1, "maximum": 2000},
                "flags": {"type": "array", "items": {"type": "string"}},
                "options": {"type": "object", "properties": {"recursive": {"type": "boolean"},
                                                             "depth": {"type": "integer"}}}}}}})
    return out


def walk_cost(compiler, spec, reasoning, vocab, steps, seed=0) -> dict:
    """Mean / p99 milliseconds of fill_bitmask + apply_bitmask along a random allowed walk."""
    m = compiler.matcher(spec, reasoning)
    rng = np.random.default_rng(seed)
    mask = allocate_bitmask(vocab)
    fill, apply = [], []
    for _ in range(steps):
        logits = rng.standard_normal(vocab).astype(np.float32)
        t0 = time.perf_counter()
        m.fill_bitmask(mask)
        t1 = time.perf_counter()
        apply_bitmask(logits, mask)
        t2 = time.perf_counter()
        fill.append(t1 - t0)
        apply.append(t2 - t1)
        tok = int(np.argmax(logits))
        if not m.accept(tok) or m.is_terminated():
            break
    def ms(xs):
        return {"mean_ms": round(1e3 * float(np.mean(xs)), 4), "p99_ms": round(1e3 * float(np.quantile(xs, 0.99)), 4)}

    return {"steps": len(fill), "fill": ms(fill), "apply": ms(apply)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model_dir", nargs="?")
    ap.add_argument("--synthetic", type=int, default=0, help="synthetic byte-level vocabulary of N ids")
    ap.add_argument("--vocab-size", type=int, default=0)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    if args.synthetic:
        tok, vocab = synthetic_tokenizer(args.synthetic), args.synthetic
    elif args.model_dir:
        from tokenizers import Tokenizer

        d = Path(args.model_dir)
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        cfg = json.loads((d / "config.json").read_text()) if (d / "config.json").is_file() else {}
        cfg = cfg.get("text_config", cfg)
        vocab = args.vocab_size or cfg.get("vocab_size") or tok.get_vocab_size(with_added_tokens=True)
    else:
        ap.error("give MODEL_DIR or --synthetic N")
    stops = [t for t in (tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")) if t is not None]
    res: dict = {"vocab_size": vocab, "synthetic": bool(args.synthetic)}

    t0 = time.perf_counter()
    load_core()
    t1 = time.perf_counter()
    c = ConstraintCompiler(tok, vocab, stops)
    c.warm()
    t2 = time.perf_counter()
    c.compile({"type": "json_object"})
    t3 = time.perf_counter()
    res.update(load_xgrammar_s=round(t1 - t0, 3), tokenizer_info_s=round(t2 - t1, 3), first_compile_s=round(t3 - t2, 3))
    print(f"vocab {vocab}: load xgrammar {res['load_xgrammar_s']} s, index the vocabulary {res['tokenizer_info_s']} s, "
          f"first compile {res['first_compile_s']} s")

    tools = tools_like_an_agent(20)
    schema = tools[0]["function"]["parameters"]
    specs = {
        "json_object": {"type": "json_object"},
        "json_schema": {"type": "json_schema", "schema": schema},
        "named_tool": {"type": "tool_call", "mode": "named", "name": "tool_3", "tools": tools},
        "required_20_tools": {"type": "tool_call", "mode": "required", "tools": tools},
        "auto_strict_20_tools": {"type": "tool_call", "mode": "auto",
                                 "tools": [{**t, "function": {**t["function"], "strict": True}} for t in tools]},
    }
    res["specs"] = {}
    for name, spec in specs.items():
        for reasoning in (False, True):
            key = f"{name}{'+think' if reasoning else ''}"
            t0 = time.perf_counter()
            c.compile(spec, reasoning)
            compile_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            c.compile(spec, reasoning)
            hit_ms = (time.perf_counter() - t0) * 1e3
            cost = walk_cost(c, spec, reasoning, vocab, args.steps)
            res["specs"][key] = {"compile_s": round(compile_s, 4), "cache_hit_ms": round(hit_ms, 4), **cost}
            print(f"{key:28s} compile {compile_s * 1e3:8.1f} ms  hit {hit_ms:6.3f} ms  "
                  f"fill {cost['fill']['mean_ms']:.3f}/{cost['fill']['p99_ms']:.3f} ms  "
                  f"apply {cost['apply']['mean_ms']:.3f} ms (mean/p99 over {cost['steps']} steps)")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
