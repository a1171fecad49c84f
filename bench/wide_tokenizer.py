"""Widen a small byte-level BPE tokenizer to a full-size vocabulary (Qwen3.5: 248,320 ids) for GPU
benchmarks of random-weight artifacts.

Why: the engine cuts logits to the ids its tokenizer can produce (runner.sample_vocab), so a 27B
benchmark artifact carrying the tiny model's 2,000-token tokenizer would sample over 2,000 ids and hide
the cost of sampling, penalties, bitmasks and logprobs over the real 248k vocabulary. The new tokens are
concatenations of existing ones, each with its merge, so encoding and decoding stay valid byte-level BPE;
the added (special) tokens keep their ids, which the config and generation_config refer to.

Usage: python bench/wide_tokenizer.py SRC_DIR OUT_DIR [--vocab 248320]
(copies every file of SRC_DIR to OUT_DIR, rewriting tokenizer.json)."""
from __future__ import annotations

import argparse
import itertools
import json
import shutil
from pathlib import Path


def widen(tok: dict, vocab_size: int) -> dict:
    model = tok["model"]
    if model.get("type") != "BPE":
        raise SystemExit(f"tokenizer model {model.get('type')!r} is not BPE")
    vocab: dict[str, int] = dict(model["vocab"])
    taken = set(vocab.values()) | {a["id"] for a in tok.get("added_tokens", [])}
    merges = [m if isinstance(m, list) else m.split(" ") for m in model["merges"]]
    base = sorted(vocab, key=vocab.get)  # deterministic: existing tokens in id order
    next_id = max(taken) + 1
    need = vocab_size - len(taken)
    if need <= 0:
        return tok
    pairs = ((a, b) for a, b in itertools.product(base, repeat=2))
    for a, b in pairs:
        if need == 0:
            break
        t = a + b
        if t in vocab:
            continue
        vocab[t] = next_id
        merges.append([a, b])
        next_id += 1
        need -= 1
    if need:
        raise SystemExit(f"could not reach {vocab_size} ids from {len(base)} tokens")
    out = dict(tok)
    out["model"] = dict(model, vocab=vocab, merges=merges)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, default=248320, help="total ids, added tokens included")
    a = ap.parse_args()
    src, out = Path(a.src), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "tokenizer.json":
            shutil.copy2(f, out / f.name)
    tok = widen(json.loads((src / "tokenizer.json").read_text()), a.vocab)
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    from tokenizers import Tokenizer

    t = Tokenizer.from_file(str(out / "tokenizer.json"))
    text = "def main():\n    return sorted(items, key=len)  # the quick brown fox"
    ids = t.encode(text).ids
    assert t.decode(ids) == text, "round trip failed"
    print(f"{out / 'tokenizer.json'}: {t.get_vocab_size(with_added_tokens=True)} ids; "
          f"{len(text)} chars -> {len(ids)} tokens")


if __name__ == "__main__":
    main()
