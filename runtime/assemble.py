"""Put an engine together for an artifact: executor (library + weights + pools), KV manager with its
prefix cache and host tier, tokenizer, generation defaults, engine thread.

This is the one place that knows how the pieces are sized from an EngineConfig.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Optional

from ..contract.generation import read_generation_defaults
from ..contract.manifest import read_manifest
from .config import DFLASH_METHODS, EngineConfig
from .engine import Engine
from .executor.model_runner import ModelRunner
from .errors import ConfigError
from .kv.host_arena import read_mem_available
from .kv.host_tier import HostTier
from .kv.manager import KVManager
from .kv.prefix_cache import PrefixCache
from .scheduler.scheduler import ThinkControl
from .spec.mtp import shortlist_rows
from .stats import ModelInfo
from .tokenizer import load_tokenizer
from .vision.encoder import open_vision

TURN_START = "<|im_start|>"
# what Qwen's own serving inserts when a thinking budget runs out
THINK_EARLY_CLOSE = ("\n\nConsidering the limited time by the user, I have to give the solution based on the "
                     "thinking directly now.\n</think>\n\n")


def host_tier_mib(cfg: EngineConfig, runner: ModelRunner) -> float:
    """The host tier's ceiling in MiB: cfg.host_kv_mib, or by default (None) a quarter of the RAM available now
    on CUDA (at least the host state-slot floor + 1 GiB: a 27B model's 8 slots alone are 1.2 GB) and 1024 on the
    CPU, where host and device memory are the same RAM. 0 = no host tier."""
    floor_mib = cfg.host_state_slots * runner.layout.state_slot_bytes / 2**20
    least_mib = floor_mib + 4 * runner.page_bytes / 2**20  # the slot floor and a few pages
    if cfg.host_kv_mib is not None:
        if 0 < cfg.host_kv_mib < least_mib:
            raise ConfigError("host_kv_mib", f"{cfg.host_kv_mib:g} MiB cannot hold the {cfg.host_state_slots} host "
                                             f"state slots ({floor_mib:.1f} MiB) and KV pages: give at least "
                                             f"{least_mib:.1f}, or 0 for no host tier")
        return float(cfg.host_kv_mib)
    if runner.device_kind != "cuda":
        return max(1024.0, floor_mib + 64)
    avail = read_mem_available() or 0
    return max(avail / 4 / 2**20, floor_mib + 1024)


def kv_pool_tokens(cfg: EngineConfig, runner: ModelRunner, max_context: int) -> int:
    """Device KV pool size: the configured token count, 'auto' (free device memory), or by default
    all free memory on CUDA and max_context x max_concurrency on the CPU."""
    cap: int | str | None = cfg.kv_capacity
    if cap is None:
        cap = "auto" if runner.device_kind == "cuda" else max_context * cfg.max_concurrency
    if str(cap) == "auto":
        extra = 0
        if cfg.spec in DFLASH_METHODS:  # [dflash hook] the drafter's paged layers share the page ids
            from .spec.dflash_runner import paged_bytes_per_page

            assert cfg.draft_model  # validate() requires it for DFlash
            extra = paged_bytes_per_page(cfg.draft_model)
        rows = max(int(cfg.prefill_chunk or 0), cfg.max_concurrency * (cfg.draft_tokens + 1))
        head = 0  # the shortlisted MTP head built on the device after the pools (executor/draft_head.py)
        if cfg.spec == "mtp" and cfg.lm_head_draft:
            head = runner.draft_head_bytes(shortlist_rows(cfg.lm_head_draft, runner.vocab_size))
        cap = runner.auto_kv_tokens(cfg.device_slots, extra_page_bytes=extra, step_rows=rows, extra_bytes=head)
    return int(cap)


def prefill_chunk_for(cfg: EngineConfig, runner: ModelRunner) -> int:
    """The configured prefill chunk, or the device's default, capped by the compiled row bound of the
    library and of a draft model / DFlash drafter (their prefill memory is planned for at most that many
    tokens per call)."""
    bounds = [runner.max_prefill_chunk]
    if cfg.draft_model:  # a drafter prefills (or takes the taps of) the same chunks
        bounds.append(read_manifest(cfg.draft_model).extras.get("max_prefill_chunk"))
    bound = min((int(b) for b in bounds if b), default=None)
    if cfg.prefill_chunk is not None:
        if bound is not None and cfg.prefill_chunk > bound:
            raise ConfigError("prefill_chunk", f"{cfg.prefill_chunk} exceeds the {bound} tokens per prefill call the "
                                               "libraries were compiled for (their max_prefill_chunk)")
        return cfg.prefill_chunk
    # H200, 27B, 8k prompt: 7.6k tok/s at 512-token chunks, 9.4k at 8192
    default = 2048 if runner.device_kind == "cuda" else 512
    return min(default, bound) if bound is not None else default


def open_engine(art_dir: str | Path, cfg: Optional[EngineConfig] = None, meminfo_reader=None,
                start: bool = True) -> Engine:
    cfg = (cfg or EngineConfig()).validate()
    runner = ModelRunner(art_dir, device=cfg.device)
    cfg = replace(cfg, prefill_chunk=prefill_chunk_for(cfg, runner))
    m = runner.manifest
    max_context = min(cfg.max_context or m.max_context, m.max_context)
    num_pages = -(-kv_pool_tokens(cfg, runner, max_context) // runner.page_size)
    runner.allocate(num_pages, cfg.device_slots, cfg.max_concurrency, cuda_graphs=cfg.cuda_graphs,
                    programmatic_launch=cfg.programmatic_launch)
    if cfg.spec in DFLASH_METHODS:  # [dflash hook] before the host tier, which moves it with the pages
        from .spec.dflash_runner import attach_paged_pool

        assert cfg.draft_model  # validate() requires it for DFlash
        attach_paged_pool(runner, cfg.draft_model)
    runner.vision = open_vision(runner, cfg.vision)
    cache = host = None
    if cfg.prefix_reuse:
        cache = PrefixCache(cfg.max_cache_entries)
        host_mib = host_tier_mib(cfg, runner)
        if host_mib > 0:
            host = HostTier(runner, host_mib, cfg.host_state_slots, cfg.host_ram_reserve_mib,
                            meminfo_reader=meminfo_reader)
    kv = KVManager(runner, num_pages, cfg.device_slots, cache, host)
    tok = load_tokenizer(art_dir)
    runner.sample_vocab = min(runner.vocab_size, tok.get_vocab_size(with_added_tokens=True))
    gen = read_generation_defaults(art_dir, m.config)
    turn = tok.encode(TURN_START, add_special_tokens=False).ids if tok.token_to_id(TURN_START) is not None else []
    end_id = tok.token_to_id("</think>")
    think = ThinkControl(tok.token_to_id("<think>"), end_id,
                         tok.encode(THINK_EARLY_CLOSE, add_special_tokens=False).ids if end_id is not None else [])
    dev = runner.dev
    info = ModelInfo(
        name=m.name, random_weights=runner.random_weights, architecture=str(m.config.get("architecture") or ""),
        target=m.target, dtype=m.dtype,
        kv_dtype=m.kv_dtype, device=f"{runner.device_kind}:{int(getattr(dev, 'index', 0) or 0)}",
        device_name=str(getattr(dev, "device_name", "") or "") if runner.device_kind == "cuda" else "",
        device_total_bytes=int(getattr(dev, "total_global_memory", 0) or 0) if runner.device_kind == "cuda" else 0,
        load_seconds=round(runner.load_seconds, 6), max_context=max_context, page_size=runner.page_size,
        kv_pages=num_pages, kv_page_bytes=runner.page_bytes, state_slots=cfg.device_slots,
        state_slot_bytes=runner.layout.state_slot_bytes, weights_bytes=runner.weights_bytes,
        prefix_reuse=cache is not None, host_tier=host is not None,
        max_cache_entries=cfg.max_cache_entries if cache is not None else 0,
        host_state_slots=cfg.host_state_slots if host is not None else 0)
    eng = Engine(runner, kv, tok, cfg, gen.eos_ids(tok.token_to_id), turn_start=turn, think=think, model_info=info,
                 generation=gen)
    return eng.start() if start else eng
