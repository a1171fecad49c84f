"""Tokenizer and end-of-sequence ids of a compiled artifact."""
from __future__ import annotations

import json
from pathlib import Path


def load_tokenizer(art_dir: str | Path):
    from tokenizers import Tokenizer

    path = Path(art_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{art_dir} has no tokenizer.json")
    return Tokenizer.from_file(str(path))


def eos_token_ids(art_dir: str | Path, tokenizer, config: dict) -> list[int]:
    """Union of generation_config eos ids, config eos ids and the tokenizer_config eos token."""
    ids: set[int] = set(config.get("eos_token_id") or [])
    art_dir = Path(art_dir)
    gen = art_dir / "generation_config.json"
    if gen.is_file():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids.update([e] if isinstance(e, int) else (e or []))
    tc = art_dir / "tokenizer_config.json"
    if tc.is_file():
        tok = json.loads(tc.read_text()).get("eos_token")
        if isinstance(tok, dict):
            tok = tok.get("content")
        if tok and tokenizer.token_to_id(tok) is not None:
            ids.add(tokenizer.token_to_id(tok))
    return sorted(ids)
