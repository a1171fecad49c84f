"""The model's generation defaults, from the generation_config.json an artifact carries.

`ninfer compile` copies generation_config.json (and tokenizer_config.json) next to the library; the
runtime reads them through here: the end-of-sequence ids (union of generation_config, config.json and
the tokenizer's eos token) and the sampling defaults the model's authors shipped, which sit below the
family presets, the server flags and the request (runtime/sampling.py resolve_sampling_params).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

# generation_config.json keys that are sampling parameters, under our SamplingParams names
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                  "frequency_penalty": "frequency_penalty"}


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _ids(v: Any) -> list[int]:
    if isinstance(v, bool):
        return []
    if isinstance(v, int):
        return [v]
    if isinstance(v, list):
        return [x for x in v if isinstance(x, int) and not isinstance(x, bool)]
    return []


@dataclass
class GenerationDefaults:
    eos_token_ids: list[int] = field(default_factory=list)
    eos_token: Optional[str] = None  # tokenizer_config's eos token text (the runtime maps it to an id)
    sampling: dict = field(default_factory=dict)  # SamplingParams field -> model default (sampled modes only)

    def eos_ids(self, token_to_id) -> list[int]:
        """All end-of-sequence ids, with the tokenizer's eos token resolved by `token_to_id`."""
        ids = set(self.eos_token_ids)
        if self.eos_token:
            tid = token_to_id(self.eos_token)
            if tid is not None:
                ids.add(int(tid))
        return sorted(ids)


def read_generation_defaults(art_dir: str | Path, config: dict) -> GenerationDefaults:
    art_dir = Path(art_dir)
    gen = _read_json(art_dir / "generation_config.json")
    ids = set(_ids(config.get("eos_token_id"))) | set(_ids(gen.get("eos_token_id")))
    tok = _read_json(art_dir / "tokenizer_config.json").get("eos_token")
    if isinstance(tok, dict):
        tok = tok.get("content")
    sampling = {}
    if gen.get("do_sample", True):  # do_sample false means greedy decoding by default
        sampling = {ours: gen[k] for k, ours in _SAMPLING_KEYS.items()
                    if isinstance(gen.get(k), (int, float)) and not isinstance(gen.get(k), bool)}
    else:
        sampling = {"temperature": 0.0}
    return GenerationDefaults(sorted(ids), tok if isinstance(tok, str) else None, sampling)
