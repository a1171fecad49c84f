"""`ninfer serve` flags (modelled on the incumbent ninfer-serve, research/ninfer_anchor.md §3)."""
from __future__ import annotations

import argparse


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="compiled model directory (default: the embedded tiny model in dist/)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--stats-port", type=int, default=0, help="second listener for /stats, /metrics, /health (0 = off)")
    p.add_argument("--api-key", default=None, help="require this key as Bearer token or x-api-key")
    p.add_argument("--model-id", default=None, help="public model name (default: the artifact name)")
    p.add_argument("--max-context", type=int, default=None, help="per-sequence token limit (default: the artifact's)")
    p.add_argument("--kv-capacity", default=None, help="device KV pool size in tokens (default: max-context; auto: all free device memory but 1 GiB)")
    p.add_argument("--max-concurrency", type=int, default=4, help="active sequences, 1..8")
    p.add_argument("--max-pending-requests", type=int, default=16, help="queued requests beyond the active set (full -> 429)")
    p.add_argument("--pending-timeout-ms", type=int, default=30000, help="queue deadline (-> 503)")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens per prefill step")
    p.add_argument("--max-request-mib", type=float, default=64, help="request body limit (-> 413)")
    p.add_argument("--default-max-tokens", type=int, default=8192)
    p.add_argument("--request-log-jsonl", default=None, help="append one JSON line per finished request")
    p.add_argument("--no-thinking", action="store_true", help="default enable_thinking=false")
    p.add_argument("--messages-thinking-default", choices=["off", "on"], default="off",
                   help="/v1/messages requests without `thinking`: off = no thinking (as the Anthropic API), "
                        "on = the server default (--no-thinking)")
    p.add_argument("--preserve-thinking", action="store_true", help="keep reasoning of earlier assistant turns in prompts")
    p.add_argument("--default-thinking-budget", type=int, default=None,
                   help="reasoning tokens before the engine closes </think> itself (requests may set their own)")
    p.add_argument("--tolerant-tool-calls", action="store_true", help="recover malformed tool calls")
    p.add_argument("--chat-template", default=None, help="Jinja chat template file overriding the model's")
    p.add_argument("--cors", action="store_true", help="permissive CORS headers")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--cuda-graphs", default="on", choices=["on", "off"],
                   help="replay decode steps as CUDA graphs (CUDA libraries only)")
    p.add_argument("--log-level", default="info", choices=["trace", "debug", "info", "warning", "error", "off"])
    for name, typ in (("temperature", float), ("top-p", float), ("top-k", int), ("min-p", float),
                      ("presence-penalty", float), ("frequency-penalty", float), ("seed", int)):
        p.add_argument(f"--{name}", type=typ, default=None, help="process-level sampling override")
    p.add_argument("--greedy", action="store_true", help="temperature 0 unless a request says otherwise")
    add_cache_args(p)
    add_spec_args(p)


def add_cache_args(p: argparse.ArgumentParser) -> None:
    """Tiered KV / prefix-reuse flags (runtime/tiered_kv.py)."""
    p.add_argument("--no-prefix-reuse", action="store_true", help="disable prefix caching, checkpoints and the host tier")
    p.add_argument("--device-state-slots", type=int, default=None,
                   help="device state slots for cached checkpoints beyond the active lanes (default = max-concurrency)")
    p.add_argument("--host-kv-mib", type=float, default=1024, help="ceiling of pinned host memory for KV + states (0 = no host tier)")
    p.add_argument("--host-state-slots", type=int, default=8, help="host state slots kept as a floor")
    p.add_argument("--host-ram-reserve-mib", type=float, default=2048, help="RAM that host-tier growth must leave free")
    p.add_argument("--max-cache-entries", type=int, default=64, help="cached execution points (frontiers + checkpoints)")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding flags (runtime/speculative.py; EngineOptions spec / draft_tokens / ...)."""
    p.add_argument("--spec", default="none", choices=["none", "mtp", "draft"],
                   help="speculative decoding: mtp = the model's MTP head, draft = a second compiled model")
    p.add_argument("--draft-tokens", type=int, default=3, help="draft tokens proposed per round, 1..5")
    p.add_argument("--draft-model", default=None,
                   help="--spec draft: compiled drafter directory (a smaller model with the same tokenizer)")
    p.add_argument("--lm-head-draft", default=None,
                   help="--spec mtp: shortlisted proposal head, N (the N lowest token ids) or a file of token ids; "
                        "verification always uses the full head")


SPEC_FLAGS = (("spec", "spec"), ("draft_tokens", "draft_tokens"), ("draft_model", "draft_model"),
              ("lm_head_draft", "lm_head_draft"))


def apply_spec_args(args, opts) -> None:
    """Copy the add_spec_args flags onto an EngineOptions (call before opts.validate())."""
    for flag, field in SPEC_FLAGS:
        if hasattr(args, flag) and hasattr(opts, field):
            setattr(opts, field, getattr(args, flag))
