"""EngineConfig: every setting of the engine, its default and its help text, in one typed place.

The CLI generates its `ninfer serve` flags from these fields (ninfer_mlc/config.py: field
`max_concurrency` is flag `--max-concurrency`), and embedders construct it directly. `validate`
raises ConfigError naming the field; it never mentions flags.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from .errors import ConfigError

SPEC_METHODS = ("none", "mtp", "draft", "dflash", "dflash2")
DFLASH_METHODS = ("dflash", "dflash2")  # block drafters: draft tokens up to the drafter's block_size - 1
MAX_DRAFT_TOKENS = 5
MAX_CONCURRENCY = 8


def _f(default: Any, help: str, **meta: Any) -> Any:
    return field(default=default, metadata={"help": help, **meta})


@dataclass
class EngineConfig:
    # ---- loading
    device: str = _f("auto", "where the library runs: auto (the artifact's target), cpu or cuda",
                     choices=("auto", "cpu", "cuda"))
    kv_capacity: Optional[str] = _f(None, "device KV pool in tokens, or 'auto' (all free device memory but 1 GiB)",
                                    metavar="TOKENS|auto",
                                    default_text="auto on CUDA, max-context x max-concurrency on the CPU")
    cuda_graphs: bool = _f(True, "replay decode steps as CUDA graphs (CUDA libraries only)")
    programmatic_launch: bool = _f(False, "inside CUDA graphs, launch each kernel while the one before it drains "
                                          "(programmatic dependent launch: sm_90+ libraries whose kernels wait for "
                                          "their predecessor on the device; measured within 3 percent of off on the "
                                          "H200, hence off)")
    device_sampling: str = _f("auto", "sample decode rows inside the library (only token ids cross to the host): "
                                      "auto = on CUDA when the library carries the sampler, on / off. "
                                      "Greedy speculative rounds choose MTP drafts and accept on the device "
                                      "unless off",
                              choices=("auto", "on", "off"))
    async_scheduling: str = _f("auto", "launch each decode step before committing the previous step's tokens, so "
                                       "detokenizing, stop strings and streaming run while the device computes "
                                       "(plain decode rows; prefill, speculation and grammar steps run in order): "
                                       "auto = on CUDA, on / off", choices=("auto", "on", "off"))
    vision: str = _f("auto", "where the vision tower of an image-capable model runs: auto (the model's device), "
                             "cpu (host cores, weights in host RAM, device memory left to KV) or off (images refused)",
                     choices=("auto", "cpu", "off"))
    # ---- scheduling
    max_context: Optional[int] = _f(None, "per-sequence token limit (at most what the model was compiled for)",
                                    metavar="TOKENS", default_text="the compiled model's")
    max_concurrency: int = _f(4, f"active sequences (continuous batching), 1..{MAX_CONCURRENCY}", metavar="N")
    max_pending_requests: int = _f(16, "waiting requests beyond the active set; a full queue rejects new ones",
                                   metavar="N")
    pending_timeout_ms: int = _f(30000, "how long a request may wait in the queue before it is rejected")
    prefill_chunk: Optional[int] = _f(None, "prompt tokens per prefill step (shared by the sequences prefilling); "
                                            "larger is faster prefill, smaller keeps running streams' token gaps "
                                            "short", metavar="TOKENS", default_text="2048 on CUDA, 512 on the CPU")
    default_max_tokens: int = _f(8192, "generated-token limit when a request gives none")
    # ---- tiered KV / prefix reuse
    prefix_reuse: bool = _f(True, "prefix caching, turn checkpoints and the host tier",
                            off_help="no prefix caching, turn checkpoints or host tier")
    device_state_slots: Optional[int] = _f(None, "device state slots for cached checkpoints beyond the active "
                                                 "lanes (default: 2 x max-concurrency: a turn leaves a frontier and "
                                                 "a checkpoint per session)", metavar="N")
    host_kv_mib: Optional[float] = _f(None, "ceiling of the host tier (pinned KV pages + state slots), MiB; "
                                            "0 = no host tier", metavar="MIB",
                                      default_text="a quarter of the RAM available at start on CUDA (at least the "
                                                   "host state slots + 1 GiB), 1024 on the CPU")
    host_state_slots: int = _f(8, "host state slots kept as a floor", metavar="N")
    host_ram_reserve_mib: float = _f(2048.0, "RAM that host-tier growth must leave free, MiB")
    max_cache_entries: int = _f(64, "cached execution points (frontiers + checkpoints)", metavar="N")
    # ---- speculative decoding
    spec: str = _f("none", "speculative decoding: mtp (the model's MTP head), draft (a second compiled model), "
                           "dflash / dflash2 (a compiled DFlash / DFlash2 block drafter)", choices=SPEC_METHODS)
    draft_tokens: int = _f(3, f"draft tokens proposed per round, 1..{MAX_DRAFT_TOKENS} (dflash / dflash2: "
                              "1..block_size - 1 of the drafter)", metavar="N")
    draft_model: Optional[str] = _f(None, "spec draft: compiled drafter directory (same tokenizer); spec dflash / "
                                          "dflash2: the compiled DFlash drafter (the target needs its tap layers: "
                                          "ninfer compile --tap-layers DRAFTER_DIR)", metavar="DIR")
    lm_head_draft: Optional[str] = _f(None, "spec mtp: shortlisted proposal head, N (the N lowest token ids) or a "
                                            "file of token ids; verification always uses the full head",
                                      metavar="N|FILE")
    spec_refeed_max: Optional[int] = _f(None, "libraries without gdn_replay only (compiled before it; current ones "
                                              "replay the kept rows' GDN state and re-feed nothing): most rolled-back "
                                              "tokens a row re-feeds at the front of a verify that still drafts; past "
                                              "it a round re-feeds them without drafts", metavar="N",
                                        default_text="draft tokens + 1")
    forced_acceptance: Optional[float] = _f(None, "BENCHMARK ONLY: force this many tokens per round (kept drafts + "
                                                  "1, e.g. 3.18) whatever the target says; the output is not the "
                                                  "model's (ninfer serve needs --allow-forced-acceptance)",
                                            metavar="T", default_text="off")

    # -------------------------------------------------------------------------------------------
    def validate(self) -> "EngineConfig":
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ConfigError(name, msg)

        def integer(name: str) -> int:
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool), name, f"must be an integer, got {v!r}")
            return v

        need(self.device in ("auto", "cpu", "cuda"), "device", f"must be auto, cpu or cuda, got {self.device!r}")
        need(self.vision in ("auto", "cpu", "off"), "vision", f"must be auto, cpu or off, got {self.vision!r}")
        need(self.device_sampling in ("auto", "on", "off"), "device_sampling",
             f"must be auto, on or off, got {self.device_sampling!r}")
        need(self.async_scheduling in ("auto", "on", "off"), "async_scheduling",
             f"must be auto, on or off, got {self.async_scheduling!r}")
        if self.kv_capacity is not None and str(self.kv_capacity) != "auto":
            try:
                cap = int(str(self.kv_capacity))
            except ValueError:
                raise ConfigError("kv_capacity", f"must be a token count or 'auto', got {self.kv_capacity!r}") from None
            need(cap >= 1, "kv_capacity", f"must be >= 1, got {cap}")
        need(1 <= integer("max_concurrency") <= MAX_CONCURRENCY, "max_concurrency",
             f"must be in 1..{MAX_CONCURRENCY}, got {self.max_concurrency}")
        need(integer("max_pending_requests") >= 0, "max_pending_requests", "must be >= 0")
        need(integer("pending_timeout_ms") >= 1, "pending_timeout_ms", "must be >= 1")
        if self.prefill_chunk is not None:
            need(integer("prefill_chunk") >= 1, "prefill_chunk", "must be >= 1")
        need(integer("default_max_tokens") >= 1, "default_max_tokens", "must be >= 1")
        if self.max_context is not None:
            need(integer("max_context") >= 2, "max_context", f"must be >= 2, got {self.max_context}")
        if self.device_state_slots is not None:
            need(integer("device_state_slots") >= 0, "device_state_slots", "must be >= 0")
        for name in ("host_kv_mib", "host_ram_reserve_mib"):
            v = getattr(self, name)
            if v is not None:
                need(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0, name,
                     f"must be a number >= 0, got {v!r}")
        need(integer("host_state_slots") >= 0, "host_state_slots", "must be >= 0")
        need(integer("max_cache_entries") >= 1, "max_cache_entries", "must be >= 1")
        self._validate_spec()
        return self

    def _validate_spec(self) -> None:
        if self.spec not in SPEC_METHODS:
            raise ConfigError("spec", f"must be one of {', '.join(SPEC_METHODS)}, got {self.spec!r}")
        d = self.draft_tokens
        top = self._block_drafts() if self.spec in DFLASH_METHODS else MAX_DRAFT_TOKENS
        if isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= top:
            raise ConfigError("draft_tokens", f"must be an integer in 1..{top}, got {d!r}")
        r = self.spec_refeed_max
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 1):
            raise ConfigError("spec_refeed_max", f"must be a positive integer, got {r!r}")
        if self.forced_acceptance is not None:
            f = self.forced_acceptance
            if self.spec == "none" or isinstance(f, bool) or not isinstance(f, (int, float)) or not 1 <= f <= d + 1:
                raise ConfigError("forced_acceptance", f"needs --spec and a number of tokens per round in "
                                                       f"1..{d + 1} (draft tokens + 1), got {f!r}")
        if self.spec in DFLASH_METHODS:
            return
        if self.spec == "draft":
            if not self.draft_model:
                raise ConfigError("draft_model", "spec draft needs a compiled drafter directory with the same tokenizer")
            if not (Path(self.draft_model) / "manifest.json").is_file():
                raise ConfigError("draft_model", f"{self.draft_model}: not a compiled model directory (no manifest.json)")
        elif self.draft_model:
            raise ConfigError("draft_model", "is only used with spec draft, dflash or dflash2")
        if self.lm_head_draft is not None:
            if self.spec != "mtp":
                raise ConfigError("lm_head_draft", "is only used with spec mtp")
            v = str(self.lm_head_draft).strip()
            if (v.isdigit() and int(v) < 1) or (not v.isdigit() and not Path(v).is_file()):
                raise ConfigError("lm_head_draft", f"must be a positive token count or a file of token ids, got {v!r}")

    def _block_drafts(self) -> int:
        """spec dflash / dflash2: the drafter artifact's block size - 1 (checks the drafter's kind)."""
        import json

        if not self.draft_model:
            raise ConfigError("draft_model", f"spec {self.spec} needs a compiled DFlash drafter directory")
        path = Path(self.draft_model) / "manifest.json"
        try:
            info = json.loads(path.read_text()).get("extras", {}).get("dflash")
        except (OSError, ValueError):
            raise ConfigError("draft_model", f"{self.draft_model}: not a compiled model directory (no readable "
                                             "manifest.json)") from None
        if not info:
            raise ConfigError("draft_model", f"{self.draft_model}: not a DFlash drafter (compile the drafter's "
                                             "Hugging Face directory with `ninfer compile`)")
        if info.get("kind") != self.spec:
            raise ConfigError("spec", f"{self.draft_model} is a {info.get('kind')} drafter: use spec {info.get('kind')}")
        if self.lm_head_draft is not None:
            raise ConfigError("lm_head_draft", "is only used with spec mtp")
        return int(info["block_size"]) - 1

    # ---- derived sizes -----------------------------------------------------------------------
    @property
    def cached_state_slots(self) -> int:
        """Device state slots that hold cached execution points (0 without prefix reuse)."""
        if not self.prefix_reuse:
            return 0
        return 2 * self.max_concurrency if self.device_state_slots is None else self.device_state_slots

    @property
    def device_slots(self) -> int:
        """All device state slots: active lanes, cached points, pre-verification snapshots."""
        spec = self.max_concurrency if self.spec != "none" else 0
        return self.max_concurrency + self.cached_state_slots + spec


def config_fields() -> list:
    return list(fields(EngineConfig))
