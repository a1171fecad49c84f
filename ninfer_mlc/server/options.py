"""`ninfer serve` settings of the HTTP layer (the engine's are runtime/config.py EngineConfig); the
flags are generated from these dataclasses (ninfer_mlc/config.py)."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Optional

from ..config import group
from ..runtime.config import EngineConfig

LOG_LEVELS = ("trace", "debug", "info", "warning", "error", "off")


def _f(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class ServeOptions:
    host: str = _f("127.0.0.1", "listen address")
    port: int = _f(8080, "listen port")
    stats_port: int = _f(0, "a second listener with /stats, /metrics, /health and /monitor (0 = off)")
    api_key: Optional[str] = _f(None, "require this key as 'Authorization: Bearer KEY' or 'x-api-key: KEY'")
    model_id: Optional[str] = _f(None, "public model name (default: the artifact name)")
    max_request_mib: float = _f(64.0, "request body limit in MiB (larger bodies get 413)")
    request_log_jsonl: Optional[str] = _f(None, "append one JSON line per finished request to this file")
    enable_thinking: bool = _f(True, "thinking when a request does not say (OpenAI routes; Anthropic follows the "
                                     "request's `thinking` field)")
    preserve_thinking: bool = _f(False, "keep the reasoning of earlier assistant turns in prompts")
    default_thinking_budget: Optional[int] = _f(None, "reasoning tokens before the engine closes </think> itself "
                                                      "(requests may set their own)")
    tolerant_tool_calls: bool = _f(False, "recover malformed Qwen XML tool calls instead of returning them as text")
    chat_template: Optional[str] = _f(None, "Jinja chat template file overriding the model's")
    cors: bool = _f(False, "permissive CORS headers")
    log_level: str = _f("info", "log verbosity", choices=LOG_LEVELS)
    allow_random_weights: bool = _f(False, "serve a random-weights benchmark artifact (`ninfer compile "
                                           "--random-weights`): its answers are noise; for benchmarks only")
    allow_forced_acceptance: bool = _f(False, "accept --forced-acceptance (a benchmark profile: the output is not the "
                                              "model's)")


@dataclass
class SamplingFlags:
    """Process-level sampling overrides: request > these flags > the model's presets and defaults."""

    temperature: Optional[float] = _f(None, "sampling temperature override (0 = greedy)")
    top_p: Optional[float] = _f(None, "top-p override")
    top_k: Optional[int] = _f(None, "top-k override")
    min_p: Optional[float] = _f(None, "min-p override")
    presence_penalty: Optional[float] = _f(None, "presence penalty override")
    frequency_penalty: Optional[float] = _f(None, "frequency penalty override")
    seed: Optional[int] = _f(None, "seed override")
    greedy: bool = _f(False, "temperature 0 unless a request says otherwise")

    def overrides(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "greedy" and v is not None}


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="compiled model directory (default: the embedded tiny model in dist/)")
    group(p, "server", ServeOptions)
    group(p, "engine", EngineConfig)
    group(p, "sampling", SamplingFlags)
