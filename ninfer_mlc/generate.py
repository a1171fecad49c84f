"""One-shot generation through the engine (the `ninfer generate` command and smoke checks)."""
from __future__ import annotations

from pathlib import Path

from .chat_template import ChatTemplate
from .runtime.engine import Engine, EngineOptions, GenRequest
from .runtime.host_tier import HostTier
from .runtime.model_runner import ModelRunner
from .runtime.prefix_cache import PrefixCache
from .runtime.sampling import SamplingParams
from .runtime.tiered_kv import TieredKV
from .runtime.tokenizer import eos_token_ids, load_tokenizer
from .runtime.vision_encoder import open_vision

TURN_OPENER = "<|im_start|>assistant"
# what Qwen's own serving inserts when a thinking budget runs out
THINK_EARLY_CLOSE = ("\n\nConsidering the limited time by the user, I have to give the solution based on the "
                     "thinking directly now.\n</think>\n\n")


def open_engine(art_dir: str | Path, options: EngineOptions | None = None, meminfo_reader=None,
                vision: str = "auto", **runner_kw) -> Engine:
    """Runner + tiered KV + engine for an artifact, started.
    vision: where the vision tower of a VLM artifact runs (auto = the runner's device, cpu, off)."""
    options = options or EngineOptions()
    options.validate()
    runner = ModelRunner(art_dir, num_slots=options.device_slots, **runner_kw)
    runner.vision = open_vision(runner, vision)
    options.max_context = min(options.max_context, runner.manifest.max_context)
    tok = load_tokenizer(art_dir)
    if options.prefix_reuse:
        host = HostTier(runner, options.host_kv_mib, options.host_state_slots, options.host_ram_reserve_mib,
                        meminfo_reader=meminfo_reader) if options.host_kv_mib > 0 else None
        kv = TieredKV(runner, PrefixCache(options.max_cache_entries), host)
    else:
        kv = TieredKV(runner, None, None)
    opener = tok.encode(TURN_OPENER, add_special_tokens=False).ids if tok.token_to_id("<|im_start|>") is not None else []
    eng = Engine(runner, tok, options, eos_token_ids(art_dir, tok, runner.cfg), kv=kv, turn_opener=opener)
    end_id = tok.token_to_id("</think>")
    if end_id is not None:
        eng.think_end_id = end_id
        eng.think_close = tok.encode(THINK_EARLY_CLOSE, add_special_tokens=False).ids
    eng.start()
    return eng


def generate_text(art_dir: str | Path, prompt: str, max_tokens: int = 32, temperature: float = 0.0,
                  seed: int | None = None, chat: bool = True) -> str:
    eng = open_engine(art_dir)
    try:
        ids = _prompt_ids(art_dir, eng, prompt, chat)
        h = eng.submit(GenRequest(ids, SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens)))
        return "".join(ev.text for ev in h.iter_sync(timeout=600) if hasattr(ev, "text"))
    finally:
        eng.stop()


def _prompt_ids(art_dir, eng: Engine, prompt: str, chat: bool) -> list[int]:
    if not chat:
        return eng.tok.encode(prompt).ids
    text = ChatTemplate.from_model_dir(str(art_dir)).render([{"role": "user", "content": prompt}])
    return eng.tok.encode(text, add_special_tokens=False).ids
