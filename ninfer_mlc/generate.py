"""One-shot generation through the engine (the `ninfer generate` command and smoke checks)."""
from __future__ import annotations

from pathlib import Path

from .chat_template import ChatTemplate
from .runtime.assemble import THINK_EARLY_CLOSE, open_engine  # noqa: F401  (re-exported for callers)
from .runtime.config import EngineConfig
from .runtime.engine import Engine, GenRequest
from .runtime.sampling import SamplingParams


def generate_text(art_dir: str | Path, prompt: str, max_tokens: int = 32, temperature: float = 0.0,
                  seed: int | None = None, chat: bool = True) -> str:
    eng = open_engine(art_dir, EngineConfig(max_concurrency=1))
    try:
        return run_prompt(eng, art_dir, prompt, max_tokens, temperature, seed, chat)
    finally:
        eng.stop()


def run_prompt(eng: Engine, art_dir: str | Path, prompt: str, max_tokens: int = 32, temperature: float = 0.0,
               seed: int | None = None, chat: bool = True) -> str:
    """One prompt through an open engine (its artifact directory supplies the chat template)."""
    ids = _prompt_ids(art_dir, eng, prompt, chat)
    h = eng.submit(GenRequest(ids, SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens)))
    return "".join(ev.text for ev in h.iter_sync(timeout=600) if hasattr(ev, "text"))


def _prompt_ids(art_dir, eng: Engine, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return eng.tok.encode(prompt).ids
    text = ChatTemplate.from_model_dir(str(art_dir)).render([{"role": "user", "content": prompt}])
    return eng.tok.encode(text, add_special_tokens=False).ids
