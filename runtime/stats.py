"""Engine statistics: counters the engine thread mutates, and the one typed snapshot it produces
for readers on other threads (/stats, /metrics and the monitor render it; nothing walks engine
objects across threads)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Optional


@dataclass
class Counters:
    requests_total: int = 0
    requests_finished: int = 0
    requests_cancelled: int = 0
    requests_failed: int = 0
    requests_rejected_queue_full: int = 0
    requests_rejected_context: int = 0
    requests_queue_timeout: int = 0
    computed_prefill_tokens: int = 0
    committed_decode_tokens: int = 0
    decode_rounds: int = 0
    decode_row_rounds: int = 0
    prefill_rounds: int = 0
    preemptions: int = 0
    step_failures: int = 0
    overlapped_decode_rounds: int = 0  # decode steps launched before the previous step's commit
    discarded_decode_rows: int = 0  # rows of overlapped steps whose request ended before they committed
    queue_time_ms_last: float = 0.0
    queue_time_ms_max: float = 0.0


@dataclass
class SpecCounters:
    backend: str = "none"
    draft_tokens_max: int = 0
    rounds: int = 0
    row_rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    verify_tokens: int = 0
    recompute_tokens: int = 0
    rollbacks: int = 0
    state_replays: int = 0  # rollbacks that replayed the accepted prefix's GDN state (no re-feed: gdn_replay)
    replayed_rows: int = 0  # verify rows those replays ran through the GDN layers
    no_draft_rounds: int = 0
    forced_acceptance: Optional[float] = None  # BENCHMARK ONLY: forced tokens per round (spec/forced.py)
    device_rounds: int = 0  # rounds whose drafts / acceptance ran on the device (spec/device_round.py)
    device_drafts: int = 0  # device rounds whose drafts were chosen on the device too (e.g. an MTP draft chain)
    # wall seconds per phase of the rounds, summed (engine thread, perf_counter): where a round's time goes.
    # A phase ends where the host next waits for a result, so device work queued in one phase and waited for
    # in a later one is counted there. Host rounds wait in every phase. Device rounds (device_rounds) queue the
    # draft chain and the verify without waiting: propose_s and verify_s are host staging and launches, and
    # the device's work on both lands in accept_s, whose read is the round's one wait.
    snapshot_s: float = 0.0  # GDN state snapshots before the verify (the rollback's copy)
    propose_s: float = 0.0  # the proposer's drafts
    verify_s: float = 0.0  # the (k+1)-row target forward, incl. the re-fed rows of a rollback
    accept_s: float = 0.0  # acceptance and logprobs
    settle_s: float = 0.0  # after the scheduler commits: snapshot restore or drop, proposer bookkeeping
    round_s: float = 0.0  # the whole round() call (its remainder over the phases above is host glue)
    # the device's idle time between device rounds: host seconds from one round's read of the device to the next
    # round's first launch (settle, the engine's commit and schedule, snapshot, staging), over `gaps` such pairs of
    # back-to-back device rounds (a prefill or a host round in between starts over)
    gap_s: float = 0.0
    gaps: int = 0

    @property
    def acceptance_rate(self) -> float:
        return round(self.accepted_tokens / self.draft_tokens, 6) if self.draft_tokens else 0.0

    @property
    def tokens_per_round(self) -> float:
        return round(self.emitted_tokens / self.row_rounds, 6) if self.row_rounds else 0.0

    def phase_ms_per_round(self) -> dict[str, float]:
        """Mean milliseconds per round of each phase; `glue` is round() minus its phases, `total` adds settle;
        `gap`: mean ms from a device round's read to the next one's first launch (gap_s)."""
        return phase_ms(self, self.rounds)


PHASES = ("snapshot", "propose", "verify", "accept", "settle")


def phase_ms(c: SpecCounters, rounds: int, before: Optional[SpecCounters] = None) -> dict[str, float]:
    """Mean ms per round of each phase of c (minus `before`, for a window of `rounds` rounds); zeros without rounds."""
    if rounds <= 0:
        return {k: 0.0 for k in PHASES + ("glue", "total", "gap")}

    def d(name: str) -> float:
        return getattr(c, name) - (getattr(before, name) if before is not None else 0.0)
    out = {p: d(p + "_s") for p in PHASES}
    out["glue"] = d("round_s") - sum(out[p] for p in PHASES if p != "settle")
    out["total"] = d("round_s") + out["settle"]
    ms = {k: round(1000.0 * v / rounds, 4) for k, v in out.items()}
    gaps = d("gaps")
    ms["gap"] = round(1000.0 * d("gap_s") / gaps, 4) if gaps > 0 else 0.0
    return ms


@dataclass(frozen=True)
class SchedulerState:
    running: int = 0
    prefilling: int = 0
    decode_ready: int = 0
    waiting: int = 0


@dataclass(frozen=True)
class ModelInfo:
    """What was loaded and how the pools were sized (fixed after start-up)."""

    name: str = ""
    random_weights: bool = False  # a benchmark artifact: weights drawn at load time
    architecture: str = ""
    target: str = ""
    dtype: str = ""
    kv_dtype: str = ""
    device: str = ""
    device_name: str = ""
    device_total_bytes: int = 0
    load_seconds: float = 0.0
    max_context: int = 0
    page_size: int = 0
    kv_pages: int = 0
    kv_page_bytes: int = 0
    state_slots: int = 0
    state_slot_bytes: int = 0
    weights_bytes: int = 0
    prefix_reuse: bool = False
    host_tier: bool = False
    max_cache_entries: int = 0
    host_state_slots: int = 0


@dataclass(frozen=True)
class EngineStats:
    """One consistent picture of the engine, taken on its own thread between steps."""

    taken_unix_ms: int
    running: bool
    scheduler: SchedulerState
    counters: Counters
    spec: SpecCounters
    model: ModelInfo
    cache: dict = field(default_factory=dict)  # prefix cache: lookups, hits, entries ...
    planner: dict = field(default_factory=dict)  # KV manager: demotions, evictions, restores ...
    occupancy: dict = field(default_factory=dict)  # device pages / slots in use
    transfers: dict = field(default_factory=dict)  # host tier copies: pages, bytes, seconds
    arena: dict = field(default_factory=dict)  # pinned host arena: capacity, free, fragmentation
    cuda_graphs: dict = field(default_factory=dict)
    vision: dict = field(default_factory=dict)  # the vision tower: device, weights, encode time, images
    host_step: dict = field(default_factory=dict)  # host ms per decode step by phase (runtime/step_timing.py)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["spec"]["acceptance_rate"] = self.spec.acceptance_rate
        d["spec"]["tokens_per_round"] = self.spec.tokens_per_round
        d["spec"]["phase_ms_per_round"] = self.spec.phase_ms_per_round()
        return d
