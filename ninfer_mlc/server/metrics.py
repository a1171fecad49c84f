"""`/metrics`: the `/stats` document in the Prometheus text exposition format (version 0.0.4).

Every numeric field of a section becomes one sample named `ninfer_<section>_<field>`
(booleans as 0/1). Monotonic fields are typed `counter` and get the conventional `_total`
suffix; everything else is a `gauge`. String fields (model, device, last veto, ...) go into
the labels of one `ninfer_info` gauge whose value is 1. The per-request recent list is
summarised (average queue time), not exported per request: request ids are unbounded labels.
"""
from __future__ import annotations

import math
import re
from typing import Any

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "ninfer"

# fields that only ever grow, per section (all others are gauges)
_COUNTERS: dict[str, set] = {
    "http": {"requests_started", "responses_5xx"},
    "counters": {"*"},
    "host_step": {"steps", "overlapped_steps"},
    "cache_reuse": {"lookups", "frontier_hits", "checkpoint_hits", "misses", "reused_prompt_tokens",
                    "claim_conflicts", "session_shortlist_hits", "entries_added"},
    "kv_transfers": {"*"},
    "state_transfers": {"*"},
    "pressure": {"spill_pages", "partial_tail_cow_pages", "private_owners_demoted", "private_owners_evicted",
                 "host_owners_evicted", "owners_evicted_total", "checkpoints_taken", "checkpoints_dropped",
                 "restores_device", "restores_host", "planner_runs", "demote_failures", "redundant_evicted"},
    "memory": {"allocations", "allocation_refusals", "scatter_allocations", "fragmented_misses", "grows",
               "grow_refusals", "state_grows"},
    "spec": {"draft_n", "draft_n_accepted", "rounds", "row_rounds", "emitted_tokens", "verify_tokens",
             "recompute_tokens", "rollbacks", "state_replays", "no_draft_rounds"},
}

_HELP: dict[str, str] = {
    "scheduler_running": "Active sequences (admitted requests).",
    "scheduler_waiting": "Requests waiting in the admission queue.",
    "counters_computed_prefill_tokens": "Prompt tokens run through prefill (cache hits excluded).",
    "counters_committed_decode_tokens": "Generated tokens.",
    "cache_reuse_reused_prompt_tokens": "Prompt tokens restored from the prefix cache instead of recomputed.",
    "pressure_device_kv_occupied_pages": "Device KV pages in use (active sequences and cached entries).",
    "pressure_device_kv_pages_total": "Device KV pages in the pool.",
    "pressure_host_kv_occupied_bytes": "Host (pinned) KV arena bytes holding spilled pages.",
    "memory_host_pinned_fragmentation": "1 - largest free run / free bytes of the host KV arena.",
    "memory_weights_bytes": "Bytes of model weights on the device.",
    "load_load_seconds": "Seconds spent loading the model library and weights.",
    "queue_queue_time_ms_last": "Queue time of the most recently admitted request (ms).",
    "queue_queue_time_ms_max": "Longest queue time seen (ms).",
    "spec_acceptance_rate": "Accepted / drafted speculative tokens.",
    "http_responses_by_status": "HTTP answers by status code (rejected requests included).",
    "http_errors_by_type": "Error answers by error type.",
}

_NAME_BAD = re.compile(r"[^a-zA-Z0-9_:]")
_SKIP = {"schema", "schema_version", "timestamp_unix_ms", "snapshot_unix_ms"}
_INFO_SKIP = {"memory_last_veto"}  # free text that changes at runtime: a new series each time


def _metric_name(*parts: str) -> str:
    name = "_".join(p for p in parts if p)
    name = _NAME_BAD.sub("_", name)
    if name[0].isdigit():
        name = "_" + name
    return name


def _label_value(v: Any) -> str:
    return str(v).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _fmt(v: float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


def _is_counter(section: str, field: str) -> bool:
    c = _COUNTERS.get(section, set())
    return "*" in c or field in c


def prometheus_text(stats: dict) -> str:
    """Render a `build_stats` document (or any nested dict of numbers) as Prometheus text."""
    lines: list[str] = []
    info: dict[str, str] = {}

    def emit(name: str, kind: str, value, help_key: str) -> None:
        lines.append(f"# HELP {name} {_HELP.get(help_key, help_key.replace('_', ' '))}")
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name} {_fmt(value)}")

    for section, body in stats.items():
        if section in _SKIP:
            continue
        if isinstance(body, bool) or isinstance(body, (int, float)):
            emit(_metric_name(PREFIX, section), "gauge", body, section)
            continue
        if isinstance(body, str):
            info[section] = body
            continue
        if not isinstance(body, dict):
            continue
        for field, v in body.items():
            key = f"{section}_{field}"
            if isinstance(v, (bool, int, float)):
                counter = _is_counter(section, field) and not isinstance(v, bool)
                name = _metric_name(PREFIX, section, field)
                if counter and not name.endswith("_total"):
                    name += "_total"
                emit(name, "counter" if counter else "gauge", v, key)
            elif isinstance(v, str):
                if _metric_name(section, field) not in _INFO_SKIP:
                    info[_metric_name(section, field)] = v
            elif isinstance(v, dict) and v and section == "http":  # answers by status / errors by type
                label = "status" if field == "responses_by_status" else "type"
                name = _metric_name(PREFIX, section, field) + "_total"
                lines.append(f"# HELP {name} {_HELP.get(key, key.replace('_', ' '))}")
                lines.append(f"# TYPE {name} counter")
                for lv, n in sorted(v.items()):
                    lines.append(f'{name}{{{label}="{_label_value(lv)}"}} {_fmt(n)}')
            elif isinstance(v, list) and section == "queue" and field == "recent":
                emit(_metric_name(PREFIX, "queue_recent_requests"), "gauge", len(v), "queue_recent_requests")
    if info:
        name = _metric_name(PREFIX, "info")
        labels = ",".join(f'{_metric_name(k)}="{_label_value(v)}"' for k, v in sorted(info.items()))
        lines.append(f"# HELP {name} Model, device and configuration strings as labels (value is always 1).")
        lines.append(f"# TYPE {name} gauge")
        lines.append(f"{name}{{{labels}}} 1")
    return "\n".join(lines) + "\n"
