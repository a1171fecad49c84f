"""`/stats`: one JSON snapshot of the engine, the tiered KV and the HTTP layer.

Shape (schema "ninfer_mlc_stats", version 1), modelled on the incumbent's gzenz `/stats`
(research/ninfer_anchor.md §4) with the field names our runtime actually has:

  timestamp_unix_ms
  http        in_flight, max_in_flight, requests_started
  scheduler   running, prefilling, decode_ready, waiting
  counters    computed_prefill_tokens, committed_decode_tokens, decode/prefill rounds, preemptions,
              requests_{total,finished,cancelled,rejected_queue_full,queue_timeout}
  cache_reuse lookups, frontier_hits, checkpoint_hits, misses, reused_prompt_tokens, ... entries
  kv_transfers / state_transfers   {kv|state}_{d2h|h2d|d2d}_{pages|count|bytes|seconds}
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

Reading is cheap and never holds an engine-side lock for more than a dict copy: the scheduler
counts come from `Engine.snapshot()` (its admission lock), the prefix cache from
`PrefixCache.summary()` (its lock, O(entries)), the host arena from `HostArena.stats()`; the
plain counter dicts are copied without a lock (the engine thread only ever replaces int/float
values, and a dict copy is atomic under the GIL).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any, Optional

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
                    "requests_started": self.requests_started}


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


def _copy(d: Any) -> dict:
    """Copy a dict another thread may be updating (values only change, keys are fixed)."""
    if not isinstance(d, dict):
        return {}
    for _ in range(3):
        try:
            return dict(d)
        except RuntimeError:  # resized while copying: retry
            continue
    return {}


def _call(obj: Any, name: str, default=None):
    fn = getattr(obj, name, None)
    if fn is None:
        return default
    try:
        return fn()
    except Exception:  # a half-built engine must not break /stats
        return default


def _pick(src: dict, keys, default=0) -> dict:
    return {k: _num(src.get(k, default)) for k in keys}


# ---- sections ----------------------------------------------------------------------------------
SCHEDULER_KEYS = ("running", "prefilling", "decode_ready", "waiting")
COUNTER_KEYS = ("computed_prefill_tokens", "committed_decode_tokens", "decode_rounds", "decode_row_rounds",
                "prefill_rounds", "preemptions", "requests_total", "requests_finished", "requests_cancelled",
                "requests_rejected_queue_full", "requests_queue_timeout")
CACHE_REUSE_KEYS = ("lookups", "frontier_hits", "checkpoint_hits", "misses", "reused_prompt_tokens",
                    "claim_conflicts", "session_shortlist_hits", "entries_added", "entries", "device_entries",
                    "host_entries", "checkpoints")
KV_TRANSFER_KEYS = tuple(f"kv_{d}_{u}" for d in ("d2h", "h2d", "d2d") for u in ("pages", "bytes", "seconds"))
STATE_TRANSFER_KEYS = tuple(f"state_{d}_{u}" for d in ("d2h", "h2d", "d2d") for u in ("count", "bytes", "seconds"))
SPEC_EXTRA_KEYS = ("draft_tokens_max", "rounds", "row_rounds", "emitted_tokens", "tokens_per_round", "verify_tokens",
                   "recompute_tokens", "rollbacks", "no_draft_rounds")
PRESSURE_PLANNER_KEYS = ("spill_pages", "partial_tail_cow_pages", "private_owners_demoted", "private_owners_evicted",
                         "host_owners_evicted", "owners_evicted_total", "checkpoints_taken", "checkpoints_dropped",
                         "restores_device", "restores_host", "planner_runs", "demote_failures")


def _scheduler(snap: dict) -> dict:
    return {k: int(_num(snap.get(k, 0))) for k in SCHEDULER_KEYS}


def _queue(snap: dict, http_state: Any) -> dict:
    recent = []
    if http_state is not None:
        got = _call(http_state, "recent_requests", None)
        if isinstance(got, list):
            recent = [{"request_id": str(r.get("request_id", "")), "queue_ms": _num(r.get("queue_ms", 0.0)),
                       **{k: v for k, v in r.items() if k not in ("request_id", "queue_ms")}}
                      for r in got if isinstance(r, dict)]
    qs = [r["queue_ms"] for r in recent]
    return {
        "queue_time_ms_last": round(float(_num(snap.get("queue_time_ms_last", 0.0))), 3),
        "queue_time_ms_max": round(float(_num(snap.get("queue_time_ms_max", 0.0))), 3),
        "recent_queue_ms_avg": round(sum(qs) / len(qs), 3) if qs else 0.0,
        "recent": recent,
    }


def _spec(engine_stats: dict, engine: Any) -> dict:
    """Speculative decoding: the engine's `spec_*` counters (runtime/speculative.py), or zeros."""
    opt = getattr(engine, "opt", None)
    backend = engine_stats.get("spec_backend") or getattr(opt, "spec", None) or "none"
    draft = int(_num(engine_stats.get("draft_n", engine_stats.get("spec_draft_tokens", 0))))
    acc = int(_num(engine_stats.get("draft_n_accepted", engine_stats.get("spec_accepted_tokens", 0))))
    out = {"backend": str(backend), "draft_n": draft, "draft_n_accepted": acc,
           "acceptance_rate": round(acc / draft, 6) if draft else 0.0}
    for k in SPEC_EXTRA_KEYS:  # always present, 0 without a speculator
        out[k] = _num(engine_stats.get(f"spec_{k}", 0))
    return out


def build_stats(engine: Any, http_state: Any = None, model_id: Optional[str] = None) -> dict:
    """The `/stats` document for a (running) `runtime.engine.Engine`.

    `http_state`: an `HttpCounters` (or anything with `in_flight`/`max_in_flight`, optionally
    `recent_requests()`), or None. `model_id`: the public model name (default: artifact name).
    """
    snap = None
    for _ in range(3):  # snapshot() iterates the active set, which the engine thread may resize meanwhile
        snap = _call(engine, "snapshot", None)
        if isinstance(snap, dict):
            break
    if not isinstance(snap, dict):
        snap = _copy(getattr(engine, "stats", {}))
    engine_stats = snap
    kv = getattr(engine, "kv", None)
    runner = getattr(engine, "runner", None) or getattr(kv, "runner", None)
    cache = getattr(kv, "cache", None)
    host = getattr(kv, "host", None)
    arena = getattr(host, "arena", None)

    kv_stats = _copy(getattr(kv, "stats", {}))
    occ = _call(kv, "occupancy", None) or {}
    cache_sum = _call(cache, "summary", None) or {}
    host_stats = _copy(getattr(host, "stats", {}))
    arena_stats = _call(arena, "stats", None) or {}

    # ---- http
    http = {"in_flight": 0, "max_in_flight": 0, "requests_started": 0}
    if http_state is not None:
        for k in http:
            http[k] = int(_num(getattr(http_state, k, 0)))

    # ---- device geometry
    pages = getattr(runner, "pages", None)
    slots = getattr(runner, "slots", None)
    page_size = int(getattr(runner, "page_size", 0) or 0)
    pages_total = int(occ.get("device_kv_pages_total", getattr(pages, "num_pages", 0)) or 0)
    pages_used = int(occ.get("device_kv_occupied_pages", getattr(pages, "used_pages", 0)) or 0)
    slots_total = int(occ.get("device_state_slots_total", getattr(slots, "num_slots", 0)) or 0)
    slots_used = int(occ.get("device_state_occupied_slots",
                             slots_total - int(getattr(slots, "free_slots", slots_total) or 0)) or 0)
    manifest = getattr(runner, "manifest", None)
    mcfg = getattr(manifest, "config", {}) or {}
    opt = getattr(engine, "opt", None)

    dev_label, dev_name, dev_total = _device_info(runner)

    # ---- pinned host pool (KV arena + state slots)
    a = arena_stats
    cap_b = int(_num(a.get("capacity_bytes", 0)))
    free_b = int(_num(a.get("free_bytes", 0)))
    largest_b = int(_num(a.get("largest_free_run_bytes", 0)))
    frag = round(1.0 - largest_b / free_b, 6) if free_b > 0 else 0.0
    host_state_slot_bytes = int(_num(a.get("state_slot_bytes", getattr(host, "state_bytes", 0))))

    pressure = {
        "device_kv_occupied_pages": pages_used,
        "device_kv_pages_total": pages_total,
        "device_state_occupied_slots": slots_used,
        "device_state_slots_total": slots_total,
        "host_kv_occupied_bytes": int(_num(a.get("allocated_bytes", 0))),
        "host_kv_capacity_bytes": cap_b,
        "host_state_occupied_slots": int(_num(a.get("state_slots_occupied", 0))),
        "host_state_capacity_slots": int(_num(a.get("state_slots_capacity", 0))),
        **_pick(kv_stats, PRESSURE_PLANNER_KEYS),
    }

    memory = {
        "device": dev_label,
        "device_name": dev_name,
        "device_total_bytes": dev_total,
        "max_context": int(getattr(opt, "max_context", 0) or getattr(manifest, "max_context", 0) or 0),
        "kv_capacity_tokens": pages_total * page_size,
        "kv_capacity_pages": pages_total,
        "kv_page_tokens": page_size,
        "kv_page_bytes": int(getattr(runner, "page_bytes", 0) or 0),
        "kv_pool_bytes": pages_total * int(getattr(runner, "page_bytes", 0) or 0),
        "state_slot_bytes": int(getattr(runner, "conv_slot_bytes", 0) or 0) + int(getattr(runner, "ssm_slot_bytes", 0) or 0),
        "device_state_slots": slots_total,
        "weights_bytes": int(getattr(runner, "weights_bytes", 0) or 0),
        "host_kv_ceiling_bytes": int(_num(a.get("ceiling_bytes", 0))),
        "host_ram_reserve_bytes": int(_num(a.get("reserve_bytes", 0))),
        "host_pinned_total_bytes": int(_num(a.get("pinned_bytes", 0))),
        "host_pinned_capacity_bytes": cap_b,
        "host_pinned_free_bytes": free_b,
        "host_pinned_largest_free_run_bytes": largest_b,
        "host_pinned_fragmentation": frag,
        "host_pinned_free_extents": int(_num(a.get("free_extents", 0))),
        "host_pinned_chunks": int(_num(a.get("chunks", 0))),
        "host_state_slot_bytes": host_state_slot_bytes,
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
        "model_id": model_id or getattr(manifest, "name", "") or "",
        "architecture": str(mcfg.get("architecture") or (mcfg.get("architectures") or [""])[0] or ""),
        "load_seconds": round(float(_num(getattr(runner, "load_seconds", 0.0))), 6),
        "target": str(getattr(manifest, "target", "") or ""),
        "dtype": str(getattr(manifest, "dtype", "") or ""),
        "kv_dtype": str(getattr(manifest, "kv_dtype", "") or ""),
        "cuda_graphs": _cuda_graphs(runner),
    }

    cache_options = {
        "enabled": bool(cache is not None),
        "host_tier": bool(host is not None),
        "max_cache_entries": int(getattr(cache, "max_entries", 0) or 0),
        "host_state_slots": int(getattr(opt, "host_state_slots", 0) or 0) if host is not None else 0,
        "host_kv_capacity_bytes": int(_num(a.get("ceiling_bytes", 0))),
    }

    return {
        "schema": SCHEMA,
        "schema_version": SCHEMA_VERSION,
        "timestamp_unix_ms": int(time.time() * 1000),
        "running": bool(getattr(engine, "_running", True)),
        "http": http,
        "scheduler": _scheduler(snap),
        "counters": {k: int(_num(engine_stats.get(k, 0))) for k in COUNTER_KEYS},
        "cache_reuse": {k: int(_num(cache_sum.get(k, 0))) for k in CACHE_REUSE_KEYS},
        "kv_transfers": {k: (round(float(_num(host_stats.get(k, 0.0))), 6) if k.endswith("seconds")
                             else int(_num(host_stats.get(k, 0)))) for k in KV_TRANSFER_KEYS},
        "state_transfers": {k: (round(float(_num(host_stats.get(k, 0.0))), 6) if k.endswith("seconds")
                                else int(_num(host_stats.get(k, 0)))) for k in STATE_TRANSFER_KEYS},
        "pressure": pressure,
        "memory": memory,
        "queue": _queue(snap, http_state),
        "spec": _spec(engine_stats, engine),
        "load": load,
        "cache_options": cache_options,
        "vision": _vision(runner),
    }


def _vision(runner: Any) -> dict:
    """The vision tower (runtime/vision_encoder.py snapshot): device, weights, encode time, image counters."""
    enc = getattr(runner, "vision", None)
    snap = _call(enc, "snapshot", None) if enc is not None else None
    return {"enabled": True, **snap} if isinstance(snap, dict) else {"enabled": False}


def _cuda_graphs(runner: Any) -> dict:
    """Decode CUDA-graph counters (runtime/cuda_graph.py); enabled false on CPU or with --cuda-graphs off."""
    g = getattr(runner, "decode_graphs", None)
    st = dict(getattr(g, "stats", {}) or {})
    out = {"enabled": g is not None, "graphs": len(getattr(g, "_graphs", {}) or {}) if g is not None else 0}
    for k in ("replays", "captures", "eager", "capture_failures", "evictions"):
        out[k] = int(_num(st.get(k, 0)))
    return out


_DEVICE_INFO: dict = {}


def _device_info(runner: Any) -> tuple[str, str, int]:
    """("cuda:0", "NVIDIA H200", total bytes), queried once per runner (the query may be slow)."""
    if runner is None:
        return "", "", 0
    key = id(runner)
    got = _DEVICE_INFO.get(key)
    if got is not None and got[0] is runner:
        return got[1]
    dev = getattr(runner, "dev", None)
    kind = getattr(runner, "device_kind", "") or ""
    try:
        idx = int(getattr(dev, "index", 0) or 0)
    except (TypeError, ValueError):
        idx = 0
    label = f"{kind}:{idx}" if kind else str(dev or "")
    name, total = "", 0
    try:
        name = str(getattr(dev, "device_name", None) or "")
    except Exception:
        pass
    try:
        total = int(getattr(dev, "total_global_memory", None) or 0)
    except Exception:
        pass
    info = (label, name, total)
    if len(_DEVICE_INFO) > 16:
        _DEVICE_INFO.clear()
    _DEVICE_INFO[key] = (runner, info)
    return info
