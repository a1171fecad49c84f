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
    stats_port: int = _f(0, "port of a second listener with /stats, /metrics, /health and /monitor; 0 = none")
    api_key: Optional[str] = _f(None, "require this key as 'Authorization: Bearer KEY' or 'x-api-key: KEY'",
                                default_text="off")
    model_id: Optional[str] = _f(None, "public model name", default_text="a Hub model's repo id, else the artifact name")
    max_request_mib: float = _f(64.0, "request body limit in MiB (larger bodies get 413)")
    request_log_jsonl: Optional[str] = _f(None, "append one JSON line per finished request to this file",
                                          metavar="FILE", default_text="off")
    enable_thinking: bool = _f(True, "thinking when a request does not say (OpenAI routes; Anthropic follows the "
                                     "request's `thinking` field)",
                               off_help="no thinking unless a request asks for it (OpenAI routes; Anthropic follows "
                                        "the request's `thinking` field)")
    messages_thinking_default: bool = _f(False, "/v1/messages requests without `thinking`: off = no thinking (as the "
                                                "Anthropic API), on = the server default (--no-thinking)")
    preserve_thinking: bool = _f(False, "keep the reasoning of earlier assistant turns in prompts")
    default_thinking_budget: Optional[int] = _f(None, "reasoning tokens before the engine closes </think> itself "
                                                      "(requests may set their own)", metavar="TOKENS",
                                                default_text="off")
    tolerant_tool_calls: bool = _f(False, "recover malformed Qwen XML tool calls instead of returning them as text")
    chat_template: Optional[str] = _f(None, "Jinja chat template file overriding the model's", metavar="FILE")
    cors: bool = _f(False, "permissive CORS headers")
    log_level: str = _f("info", "log verbosity", choices=LOG_LEVELS)
    allow_random_weights: bool = _f(False, "serve a random-weights benchmark artifact (`ninfer compile "
                                           "--random-weights`): its answers are noise; for benchmarks only")
    allow_forced_acceptance: bool = _f(False, "accept --forced-acceptance (a benchmark profile: the output is not the "
                                              "model's)")


@dataclass
class VisionOptions:
    """Bounds on image input (server/vision.py); where the vision tower runs is EngineConfig.vision."""

    max_images_per_request: int = _f(16, "images in one request")
    max_image_mib: float = _f(20.0, "bytes of one image as sent (inline or fetched), MiB")
    max_image_pixels: int = _f(50_000_000, "pixels of one image as sent")
    max_request_image_pixels: int = _f(1 << 25, "pixels of all images of a request after resizing (what the "
                                                "vision tower computes)")
    image_fetch_timeout: float = _f(10.0, "seconds to fetch an http(s) image")


@dataclass
class SamplingFlags:
    """Process-level sampling overrides: request > these flags > the model's presets and defaults."""

    temperature: Optional[float] = _f(None, "sampling temperature override (0 = greedy)", metavar="T")
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
    from ..cli_support import add_model_arg, add_model_compile_flags

    add_model_arg(p, default_text="the embedded tiny model in dist/")
    group(p, "server", ServeOptions)
    group(p, "engine", EngineConfig)
    group(p, "sampling", SamplingFlags, description="process-level overrides: a request's own values win; "
                                                     "unset ones fall back to the model's generation_config.json")
    v = group(p, "images", VisionOptions, description="image input (models compiled from a "
                                                        "Qwen3_5ForConditionalGeneration checkpoint)")
    v.add_argument("--vision-cpu", dest="vision", action="store_const", const="cpu",
                   help="same as --vision cpu: the vision tower on the host cores, its weights in host RAM")
    v.add_argument("--no-vision", dest="vision", action="store_const", const="off",
                   help="same as --vision off: images refused, no vision tower loaded")
    add_model_compile_flags(p)
