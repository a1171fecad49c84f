"""`/stats`: one JSON snapshot of the engine, the tiered KV and the HTTP layer.

Shape (schema "ninfer_mlc_stats", version 1), modelled on the incumbent's gzenz `/stats`
(research/ninfer_anchor.md §4) with the field names our runtime actually has:

  timestamp_unix_ms
  http        in_flight, max_in_flight, requests_started
  scheduler   running, prefilling, decode_ready, waiting
  counters    computed_prefill_tokens, committed_decode_tokens, decode/prefill rounds, preemptions,
              requests_{total,finished,cancelled,rejected_queue_full,queue_timeout}
  cache_reuse lookups, frontier_hits, checkpoint_hits, misses, reused_prompt_tokens, ... entries
  kv_transfers / state_transfers   {kv|state}_{d2h|h2d|d2d}_{pages|count|bytes|seconds}, the device
              drain before a host copy apart ({kv|state}_{d2h|h2d}_wait_seconds), kv_{d2h|h2d}_copies
  pressure    device/host occupancy plus the planner's demote/evict/spill counters
  memory      device pool geometry, weights, the pinned host pool (capacity/free/largest free
              run/fragmentation), its growth counters and last veto
  queue       last/max queue time and the most recent requests with their queue_ms
  spec        speculative decoding (backend "none" until the engine has one)
  load        model_id, architecture, load_seconds, target, dtypes
  cache_options  enabled, host tier on/off and its configured sizes

Every key is present whatever the configuration: with prefix reuse or the host tier off the
corresponding numbers are 0 (and strings empty/"none"), so dashboards and scrapers never need
to special-case a missing field.

The engine part comes from one `runtime.stats.EngineStats` snapshot the engine thread takes between
steps (`Engine.stats()`); this module only renders it, so nothing here reads engine objects across
threads. The HTTP part (in-flight requests, answers by status and error type, recent requests)
comes from `HttpCounters`.
"""
from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import asdict
from typing import Any, Optional

from ..runtime.stats import EngineStats, SpecCounters

SCHEMA = "ninfer_mlc_stats"
SCHEMA_VERSION = 1
RECENT_REQUESTS = 32


class HttpCounters:
    """What the HTTP layer tells `/stats`: requests in flight and the most recent finished ones.

    `enter()`/`exit()` bracket a generation request (thread-safe; also usable as a context
    manager). `record_request(...)` appends a finished request to the recent list shown in
    `queue.recent`. Any object with `in_flight`/`max_in_flight` attributes works as the
    `http_state` of `build_stats`; this class is the reference one.
    """

    def __init__(self, recent: int = RECENT_REQUESTS):
        self._lock = threading.Lock()
        self.in_flight = 0
        self.max_in_flight = 0
        self.requests_started = 0
        self._recent: deque = deque(maxlen=max(1, recent))
        self._by_status: Counter = Counter()
        self._by_error: Counter = Counter()

    def record_response(self, status: int, error_type: Optional[str] = None) -> None:
        """Count one answer (every route, rejected requests included)."""
        with self._lock:
            self._by_status[str(int(status))] += 1
            if error_type:
                self._by_error[error_type] += 1

    def enter(self) -> None:
        with self._lock:
            self.in_flight += 1
            self.requests_started += 1
            if self.in_flight > self.max_in_flight:
                self.max_in_flight = self.in_flight

    def exit(self) -> None:
        with self._lock:
            self.in_flight = max(0, self.in_flight - 1)

    leave = exit  # ServerState spelling

    def __enter__(self) -> "HttpCounters":
        self.enter()
        return self

    def __exit__(self, *exc) -> None:
        self.exit()

    def record_request(self, request_id: str, timings: Optional[dict] = None, *, queue_ms: Optional[float] = None,
                       finish_reason: Optional[str] = None, api: Optional[str] = None,
                       usage: Optional[dict] = None) -> None:
        """Note a finished request (engine `Finished.timings` carries queue_ms/prompt_ms/...)."""
        t = timings or {}
        u = usage or {}
        rec = {
            "request_id": str(request_id),
            "queue_ms": _num(queue_ms if queue_ms is not None else t.get("queue_ms", 0.0)),
            "prompt_ms": _num(t.get("prompt_ms", 0.0)),
            "predicted_ms": _num(t.get("predicted_ms", 0.0)),
            "prompt_tokens": int(u.get("prompt_tokens", t.get("prompt_n", 0)) or 0),
            "cached_tokens": int(u.get("cached_tokens", t.get("cache_n", 0)) or 0),
            "completion_tokens": int(u.get("completion_tokens", t.get("predicted_n", 0)) or 0),
            "finish_reason": finish_reason or "",
            "api": api or "",
            "finished_unix_ms": int(time.time() * 1000),
        }
        with self._lock:
            self._recent.append(rec)

    def recent_requests(self) -> list[dict]:
        with self._lock:
            return [dict(r) for r in self._recent]

    def snapshot(self) -> dict:
        with self._lock:
            return {"in_flight": self.in_flight, "max_in_flight": self.max_in_flight,
                    "requests_started": self.requests_started, "responses_by_status": dict(self._by_status),
                    "errors_by_type": dict(self._by_error),
                    "responses_5xx": sum(n for k, n in self._by_status.items() if k.startswith("5"))}


# ---- helpers ----------------------------------------------------------------------------------
def _num(v: Any, default: float = 0.0):
    if isinstance(v, bool):
        return int(v)
    if isinstance(v, (int, float)):
        return v
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


def _pick(src: dict, keys, default=0) -> dict:
    return {k: _num(src.get(k, default)) for k in keys}


# ---- sections ----------------------------------------------------------------------------------
COUNTER_KEYS = ("computed_prefill_tokens", "committed_decode_tokens", "decode_rounds", "decode_row_rounds",
                "prefill_rounds", "preemptions", "requests_total", "requests_finished", "requests_cancelled",
                "requests_failed", "requests_rejected_queue_full", "requests_rejected_context",
                "requests_queue_timeout", "step_failures", "overlapped_decode_rounds", "discarded_decode_rows")
CACHE_REUSE_KEYS = ("lookups", "frontier_hits", "checkpoint_hits", "misses", "reused_prompt_tokens",
                    "claim_conflicts", "session_shortlist_hits", "entries_added", "entries", "device_entries",
                    "host_entries", "checkpoints")
KV_TRANSFER_KEYS = tuple(f"kv_{d}_{u}" for d in ("d2h", "h2d", "d2d") for u in ("pages", "bytes", "seconds")) + \
    tuple(f"kv_{d}_{u}" for d in ("d2h", "h2d") for u in ("wait_seconds", "copies"))
STATE_TRANSFER_KEYS = tuple(f"state_{d}_{u}" for d in ("d2h", "h2d", "d2d") for u in ("count", "bytes", "seconds")) + \
    tuple(f"state_{d}_wait_seconds" for d in ("d2h", "h2d"))
SPEC_EXTRA_KEYS = ("draft_tokens_max", "rounds", "row_rounds", "emitted_tokens", "tokens_per_round", "verify_tokens",
                   "recompute_tokens", "rollbacks", "state_replays", "replayed_rows", "no_draft_rounds", "device_rounds")
PRESSURE_PLANNER_KEYS = ("spill_pages", "partial_tail_cow_pages", "private_owners_demoted", "private_owners_evicted",
                         "host_owners_evicted", "owners_evicted_total", "checkpoints_taken", "checkpoints_dropped",
                         "restores_device", "restores_host", "restore_failures", "planner_runs", "demote_failures",
                         "redundant_evicted")
GRAPH_KEYS = ("replays", "captures", "eager", "capture_failures", "evictions")


def _queue(es: EngineStats, http_state: Any) -> dict:
    recent = http_state.recent_requests() if http_state is not None else []
    qs = [r["queue_ms"] for r in recent]
    return {
        "queue_time_ms_last": round(es.counters.queue_time_ms_last, 3),
        "queue_time_ms_max": round(es.counters.queue_time_ms_max, 3),
        "recent_queue_ms_avg": round(sum(qs) / len(qs), 3) if qs else 0.0,
        "recent": recent,
    }


def _spec(sp: SpecCounters) -> dict:
    out = {"backend": sp.backend, "draft_n": sp.draft_tokens, "draft_n_accepted": sp.accepted_tokens,
           "acceptance_rate": sp.acceptance_rate,
           "forced_acceptance": float(sp.forced_acceptance or 0.0)}  # BENCHMARK forced tokens/round; 0 = lossless
    extra = asdict(sp)
    extra["tokens_per_round"] = sp.tokens_per_round
    for k in SPEC_EXTRA_KEYS:
        out[k] = _num(extra.get(k, 0))
    for phase, ms in sp.phase_ms_per_round().items():  # where a round's time goes (SpecCounters)
        out[f"round_ms_{phase}"] = ms
    return out


def _transfers(src: dict, keys) -> dict:
    return {k: (round(float(_num(src.get(k, 0.0))), 6) if k.endswith("seconds") else int(_num(src.get(k, 0))))
            for k in keys}


def render_stats(es: EngineStats, http_state: Any = None, model_id: Optional[str] = None) -> dict:
    """The `/stats` document from one engine snapshot (runtime.stats.EngineStats) and the HTTP layer's
    counters (`HttpCounters` or None). Every key is present whatever the configuration."""
    m, a, occ = es.model, es.arena, es.occupancy
    http = (http_state or HttpCounters()).snapshot()
    cap_b = int(_num(a.get("capacity_bytes", 0)))
    free_b = int(_num(a.get("free_bytes", 0)))
    largest_b = int(_num(a.get("largest_free_run_bytes", 0)))
    pressure = {
        "device_kv_occupied_pages": int(occ.get("device_kv_occupied_pages", 0)),
        "device_kv_pages_total": int(occ.get("device_kv_pages_total", m.kv_pages)),
        "device_state_occupied_slots": int(occ.get("device_state_occupied_slots", 0)),
        "device_state_slots_total": int(occ.get("device_state_slots_total", m.state_slots)),
        "host_kv_occupied_bytes": int(_num(a.get("allocated_bytes", 0))),
        "host_kv_capacity_bytes": cap_b,
        "host_state_occupied_slots": int(_num(a.get("state_slots_occupied", 0))),
        "host_state_capacity_slots": int(_num(a.get("state_slots_capacity", 0))),
        **_pick(es.planner, PRESSURE_PLANNER_KEYS),
    }
    memory = {
        "device": m.device,
        "device_name": m.device_name,
        "device_total_bytes": m.device_total_bytes,
        "max_context": m.max_context,
        "kv_capacity_tokens": m.kv_pages * m.page_size,
        "kv_capacity_pages": m.kv_pages,
        "kv_page_tokens": m.page_size,
        "kv_page_bytes": m.kv_page_bytes,
        "kv_pool_bytes": m.kv_pages * m.kv_page_bytes,
        "state_slot_bytes": m.state_slot_bytes,
        "device_state_slots": m.state_slots,
        "weights_bytes": m.weights_bytes,
        "host_kv_ceiling_bytes": int(_num(a.get("ceiling_bytes", 0))),
        "host_ram_reserve_bytes": int(_num(a.get("reserve_bytes", 0))),
        "host_pinned_total_bytes": int(_num(a.get("pinned_bytes", 0))),
        "host_pinned_capacity_bytes": cap_b,
        "host_pinned_free_bytes": free_b,
        "host_pinned_largest_free_run_bytes": largest_b,
        "host_pinned_fragmentation": round(1.0 - largest_b / free_b, 6) if free_b > 0 else 0.0,
        "host_pinned_free_extents": int(_num(a.get("free_extents", 0))),
        "host_pinned_chunks": int(_num(a.get("chunks", 0))),
        "host_state_slot_bytes": int(_num(a.get("state_slot_bytes", 0))),
        "host_state_capacity_bytes": int(_num(a.get("state_capacity_bytes", 0))),
        "allocations": int(_num(a.get("allocations", 0))),
        "allocation_refusals": int(_num(a.get("allocation_refusals", 0))),
        "scatter_allocations": int(_num(a.get("scatter_allocations", 0))),
        "fragmented_misses": int(_num(a.get("fragmented_misses", 0))),
        "grows": int(_num(a.get("grows", 0))),
        "grow_refusals": int(_num(a.get("grow_refusals", 0))),
        "state_grows": int(_num(a.get("state_grows", 0))),
        "last_veto": str(a.get("last_veto", "") or ""),
    }
    load = {
        "model_id": model_id or m.name,
        "random_weights": m.random_weights,
        "architecture": m.architecture,
        "load_seconds": round(m.load_seconds, 6),
        "target": m.target,
        "dtype": m.dtype,
        "kv_dtype": m.kv_dtype,
        "cuda_graphs": {"enabled": bool(es.cuda_graphs.get("enabled", False)),
                        "graphs": int(es.cuda_graphs.get("graphs", 0)),
                        **{k: int(_num(es.cuda_graphs.get(k, 0))) for k in GRAPH_KEYS}},
    }
    cache_options = {
        "enabled": m.prefix_reuse,
        "host_tier": m.host_tier,
        "max_cache_entries": m.max_cache_entries,
        "host_state_slots": m.host_state_slots,
        "host_kv_capacity_bytes": int(_num(a.get("ceiling_bytes", 0))),
    }
    counters = asdict(es.counters)
    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "timestamp_unix_ms": int(time.time() * 1000),
        "snapshot_unix_ms": es.taken_unix_ms,
        "running": es.running,
        "http": http,
        "scheduler": asdict(es.scheduler),
        "counters": {k: int(_num(counters.get(k, 0))) for k in COUNTER_KEYS},
        "cache_reuse": {k: int(_num(es.cache.get(k, 0))) for k in CACHE_REUSE_KEYS},
        "kv_transfers": _transfers(es.transfers, KV_TRANSFER_KEYS),
        "state_transfers": _transfers(es.transfers, STATE_TRANSFER_KEYS),
        "pressure": pressure,
        "memory": memory,
        "queue": _queue(es, http_state),
        "spec": _spec(es.spec),
        "load": load,
        "cache_options": cache_options,
        "vision": {"enabled": bool(es.vision), **es.vision},
        "host_step": dict(es.host_step),  # host ms per decode step by phase, recent window (runtime/step_timing.py)
    }


def build_stats(engine: Any, http_state: Any = None, model_id: Optional[str] = None) -> dict:
    """The `/stats` document of a running `runtime.engine.Engine`."""
    return render_stats(engine.stats(), http_state, model_id)
