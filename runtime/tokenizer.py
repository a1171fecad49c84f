"""The tokenizer of a compiled artifact."""
from __future__ import annotations

from pathlib import Path


def load_tokenizer(art_dir: str | Path):
    from tokenizers import Tokenizer

    path = Path(art_dir) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{art_dir} has no tokenizer.json")
    return Tokenizer.from_file(str(path))
