"""/stats, /metrics and the request log on a real engine (the embedded tiny model).

The engine's device pool is small (16 KV pages, 3 state slots) and the host tier is a few MiB,
so a handful of requests exercises prefix reuse, demotion to the host and the transfer
counters; the checks compare the JSON against what the requests must have done.
"""
from __future__ import annotations

import json
import math
import re
import threading
import time

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from ninfer_mlc.runtime.assemble import open_engine
from ninfer_mlc.paths import default_model_dir
from ninfer_mlc.runtime.config import EngineConfig
from ninfer_mlc.runtime.engine import Finished, GenRequest
from ninfer_mlc.runtime.sampling import SamplingParams
from ninfer_mlc.server.metrics import CONTENT_TYPE, prometheus_text
from ninfer_mlc.server.monitor import MONITOR_PATHS, make_stats_app, register_monitoring_routes
from ninfer_mlc.server.request_log import RequestLogger
from ninfer_mlc.server.stats import SCHEMA, SCHEMA_VERSION, HttpCounters, build_stats

ART = default_model_dir()
PLENTY = lambda: 64 * 2**30  # noqa: E731  (MemAvailable seen by the host tier)

# the fields the issue asks for, per section (the document may carry more)
REQUIRED = {
    "http": {"in_flight", "max_in_flight"},
    "scheduler": {"running", "prefilling", "decode_ready", "waiting"},
    "counters": {"computed_prefill_tokens", "committed_decode_tokens", "decode_rounds", "decode_row_rounds",
                 "prefill_rounds", "preemptions", "requests_total", "requests_finished", "requests_cancelled",
                 "requests_rejected_queue_full", "requests_queue_timeout"},
    "cache_reuse": {"lookups", "frontier_hits", "checkpoint_hits", "misses", "reused_prompt_tokens",
                    "claim_conflicts", "session_shortlist_hits", "entries", "device_entries", "host_entries",
                    "checkpoints"},
    "kv_transfers": {f"kv_{d}_{u}" for d in ("d2h", "h2d", "d2d") for u in ("pages", "bytes", "seconds")},
    "state_transfers": {f"state_{d}_{u}" for d in ("d2h", "h2d", "d2d") for u in ("count", "bytes", "seconds")},
    "pressure": {"device_kv_occupied_pages", "device_state_occupied_slots", "host_kv_occupied_bytes",
                 "host_state_occupied_slots", "spill_pages", "partial_tail_cow_pages", "private_owners_demoted",
                 "private_owners_evicted", "owners_evicted_total", "checkpoints_dropped", "planner_runs"},
    "memory": {"device", "max_context", "kv_capacity_tokens", "kv_page_bytes", "weights_bytes",
               "host_pinned_capacity_bytes", "host_pinned_free_bytes", "host_pinned_largest_free_run_bytes",
               "host_pinned_fragmentation", "fragmented_misses", "grows", "grow_refusals", "last_veto"},
    "queue": {"queue_time_ms_last", "queue_time_ms_max", "recent"},
    "spec": {"backend", "draft_n", "draft_n_accepted", "acceptance_rate"},
    "load": {"model_id", "architecture", "load_seconds", "target"},
}


def _opts(**kw) -> EngineConfig:
    base = dict(kv_capacity=1024, max_concurrency=2, max_context=1024, prefill_chunk=128, default_max_tokens=16, device_state_slots=1,
                host_kv_mib=8, host_state_slots=2, host_ram_reserve_mib=0, max_cache_entries=64)
    base.update(kw)
    return EngineConfig(**base)


def _prompt(seed: int, n: int) -> list[int]:
    return [5 + (seed * 131 + j * 7) % 1900 for j in range(n)]


def _run(eng, ids, http: HttpCounters | None = None, rid: str = "", max_tokens: int = 12):
    if http is not None:
        http.enter()
    try:
        h = eng.submit(GenRequest(ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                                  request_id=rid))
        evs = list(h.iter_sync(timeout=120))
    finally:
        if http is not None:
            http.exit()
    fin = evs[-1]
    assert isinstance(fin, Finished) and fin.reason == "length", fin
    if http is not None:
        http.record_request(rid, fin.timings, finish_reason=fin.reason, api="test", usage=fin.usage)
    return fin, evs


@pytest.fixture(scope="module")
def served():
    """An engine after: a fresh request, a follow-up that reuses it, then enough distinct
    requests to push cached entries out to the host tier."""
    eng = open_engine(ART, _opts(), meminfo_reader=PLENTY)
    http = HttpCounters()
    fins = []
    try:
        a = _prompt(0, 150)
        fin, gen = _run(eng, a, http, "req-a")
        fins.append(fin)
        # the frontier entry holds the prompt + all but the last sampled token; continue from it
        (front,) = [e for e in eng.kv.cache.entries.values() if e.tokens[:150].tolist() == a]
        assert front.length == 150 + 11
        follow = front.tokens.tolist() + [11, 12, 13]
        fin_b, _ = _run(eng, follow, http, "req-b")
        fins.append(fin_b)
        for i in range(1, 6):
            fin, _ = _run(eng, _prompt(i, 140 + 30 * i), http, f"req-{i}")
            fins.append(fin)
        yield eng, http, fins, fin_b
    finally:
        eng.stop()


def test_schema_and_consistency(served):
    eng, http, fins, fin_b = served
    t0 = time.time() * 1000
    s = build_stats(eng, http, model_id="tiny-test")
    json.dumps(s, allow_nan=False)  # strict JSON
    assert s["schema"] == SCHEMA == "ninfer_mlc_stats" and s["schema_version"] == SCHEMA_VERSION == 1
    assert abs(s["timestamp_unix_ms"] - t0) < 5000
    for sec, keys in REQUIRED.items():
        assert keys <= set(s[sec]), (sec, keys - set(s[sec]))

    c, p, m, r = s["counters"], s["pressure"], s["memory"], s["cache_reuse"]
    n = len(fins)
    assert c["requests_total"] == c["requests_finished"] == n
    assert c["computed_prefill_tokens"] > 0
    assert c["computed_prefill_tokens"] == sum(f.timings["prompt_n"] for f in fins)
    assert c["committed_decode_tokens"] == sum(f.usage["completion_tokens"] for f in fins)
    assert c["decode_row_rounds"] >= c["decode_rounds"] > 0 and c["prefill_rounds"] > 0
    assert s["scheduler"] == {"running": 0, "prefilling": 0, "decode_ready": 0, "waiting": 0}

    # reuse: req-b restored req-a's frontier
    assert fin_b.usage["cached_tokens"] > 150
    assert r["frontier_hits"] >= 1 and r["reused_prompt_tokens"] >= fin_b.usage["cached_tokens"]
    assert r["frontier_hits"] + r["checkpoint_hits"] + r["misses"] <= r["lookups"]
    assert r["entries"] == r["device_entries"] + r["host_entries"] > 0

    # occupancy within totals
    assert 0 < p["device_kv_occupied_pages"] <= p["device_kv_pages_total"] == m["kv_capacity_pages"] == 16
    assert m["kv_capacity_tokens"] == 16 * m["kv_page_tokens"] == 1024
    assert 0 < p["device_state_occupied_slots"] <= p["device_state_slots_total"] == 3
    assert m["kv_page_bytes"] == eng.runner.page_bytes > 0 and m["weights_bytes"] == eng.runner.weights_bytes > 0
    assert m["max_context"] == 1024 and m["device"].startswith(eng.runner.device_kind)

    # the device is too small for every entry: some were demoted to the host
    assert p["private_owners_demoted"] >= 1 and r["host_entries"] >= 1
    kv, st = s["kv_transfers"], s["state_transfers"]
    assert kv["kv_d2h_pages"] >= p["spill_pages"] > 0
    assert kv["kv_d2h_bytes"] == kv["kv_d2h_pages"] * m["kv_page_bytes"]
    assert st["state_d2h_count"] >= p["private_owners_demoted"]
    assert st["state_d2h_bytes"] == st["state_d2h_count"] * m["host_state_slot_bytes"]
    assert 0 < p["host_kv_occupied_bytes"] <= m["host_pinned_capacity_bytes"]
    assert p["host_kv_occupied_bytes"] + m["host_pinned_free_bytes"] == m["host_pinned_capacity_bytes"]
    assert 0 <= m["host_pinned_largest_free_run_bytes"] <= m["host_pinned_free_bytes"]
    assert 0 <= m["host_pinned_fragmentation"] < 1
    if m["host_pinned_free_bytes"]:
        assert math.isclose(m["host_pinned_fragmentation"],
                            1 - m["host_pinned_largest_free_run_bytes"] / m["host_pinned_free_bytes"], abs_tol=1e-6)
    assert p["host_state_occupied_slots"] <= p["host_state_capacity_slots"]
    assert m["host_pinned_total_bytes"] <= m["host_kv_ceiling_bytes"]

    # queue, http, spec, load
    q = s["queue"]
    assert [x["request_id"] for x in q["recent"]] == ["req-a", "req-b"] + [f"req-{i}" for i in range(1, 6)]
    assert all(x["queue_ms"] >= 0 for x in q["recent"])
    assert q["queue_time_ms_max"] >= q["queue_time_ms_last"] >= 0
    assert s["http"]["in_flight"] == 0 and s["http"]["max_in_flight"] == 1
    assert s["spec"]["backend"] == "none" and all(v == 0 for k, v in s["spec"].items() if k != "backend")
    ld = s["load"]
    assert ld["model_id"] == "tiny-test" and ld["architecture"] and ld["target"] == eng.runner.manifest.target
    assert ld["load_seconds"] >= 0
    assert ld["cuda_graphs"] == {"enabled": False, "graphs": 0, "replays": 0, "captures": 0, "eager": 0,
                                 "capture_failures": 0, "evictions": 0}  # llvm library: no graphs
    assert build_stats(eng, None)["load"]["model_id"] == eng.runner.manifest.name


def _key_shape(d: dict) -> dict:
    return {k: (sorted(v) if isinstance(v, dict) else type(v).__name__) for k, v in d.items()
            if k != "queue"} | {"queue": sorted(d["queue"])}


@pytest.mark.parametrize("kw", [dict(prefix_reuse=False), dict(host_kv_mib=0)], ids=["no-reuse", "no-host"])
def test_every_field_present_when_disabled(served, kw):
    eng_full = served[0]
    full = build_stats(eng_full, HttpCounters())
    eng = open_engine(ART, _opts(**kw), meminfo_reader=PLENTY)
    try:
        _run(eng, _prompt(9, 100))
        s = build_stats(eng, None)
    finally:
        eng.stop()
    json.dumps(s, allow_nan=False)
    assert _key_shape(s) == _key_shape(full)
    assert all(v == 0 for v in s["kv_transfers"].values()) and all(v == 0 for v in s["state_transfers"].values())
    m = s["memory"]
    assert m["host_pinned_capacity_bytes"] == m["host_pinned_free_bytes"] == 0 and m["host_pinned_fragmentation"] == 0
    assert s["pressure"]["host_kv_occupied_bytes"] == 0 and s["counters"]["computed_prefill_tokens"] == 100
    assert s["cache_options"]["host_tier"] is False
    if kw.get("prefix_reuse") is False:
        assert s["cache_options"]["enabled"] is False and all(v == 0 for v in s["cache_reuse"].values())
        assert s["pressure"]["device_kv_occupied_pages"] == 0  # nothing cached
    else:
        assert s["cache_reuse"]["lookups"] == 1 and s["cache_reuse"]["entries"] == 1


# ---- Prometheus ---------------------------------------------------------------------------------
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*"'
                    r'(?:,[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\]|\\.)*")*)?\})? (\S+)$')


def parse_prometheus(text: str) -> dict:
    assert text.endswith("\n")
    types, out = {}, {}
    for line in text.splitlines():
        assert line.strip() == line and line, repr(line)
        if line.startswith("#"):
            parts = line.split(" ", 3)
            assert parts[1] in ("HELP", "TYPE") and len(parts) >= 3, line
            if parts[1] == "TYPE":
                assert parts[3] in ("counter", "gauge"), line
                assert parts[2] not in types, f"duplicate TYPE {parts[2]}"
                types[parts[2]] = parts[3]
            continue
        mt = SAMPLE.match(line)
        assert mt, f"not a sample line: {line!r}"
        name, value = mt.group(1), mt.group(4)
        assert name in types, f"{name} has no TYPE"
        assert name not in out, f"duplicate sample {name}"
        out[name] = float(value)
        if types[name] == "counter":
            assert name.endswith("_total") and out[name] >= 0
    return out


def test_prometheus_text(served):
    eng, http, _, _ = served
    s = build_stats(eng, http, model_id='ti"ny\\x')
    text = prometheus_text(s)
    vals = parse_prometheus(text)
    assert vals["ninfer_counters_computed_prefill_tokens_total"] == s["counters"]["computed_prefill_tokens"]
    assert vals["ninfer_pressure_device_kv_occupied_pages"] == s["pressure"]["device_kv_occupied_pages"]
    assert vals["ninfer_kv_transfers_kv_d2h_bytes_total"] == s["kv_transfers"]["kv_d2h_bytes"]
    assert vals["ninfer_memory_host_pinned_fragmentation"] == pytest.approx(s["memory"]["host_pinned_fragmentation"])
    assert vals["ninfer_cache_reuse_entries"] == s["cache_reuse"]["entries"]
    assert vals["ninfer_info"] == 1 and 'load_model_id="ti\\"ny\\\\x"' in text
    assert vals["ninfer_queue_recent_requests"] == len(s["queue"]["recent"])
    # every numeric leaf of the document is exported
    n_numeric = sum(1 for sec in s.values() if isinstance(sec, dict)
                    for v in sec.values() if isinstance(v, (int, float)))
    assert len(vals) >= n_numeric


# ---- request log ---------------------------------------------------------------------------------
def test_request_log(served, tmp_path):
    _, _, fins, _ = served
    path = tmp_path / "requests.jsonl"
    log = RequestLogger(str(path))
    log.check_writable()
    tool = {"marker_seen": True, "structured_call_count": 1, "fallback_reason": None, "recoveries": []}
    for i, f in enumerate(fins):
        log.log(request_id=f"chatcmpl-{i}", model="tiny", api="openai.chat", finish_reason=f.reason, usage=f.usage,
                timings=f.timings, stream=bool(i % 2), wall_ms=12.5, tool_call_parse=tool if i == 0 else None)
    log.log(request_id="gone", model="tiny", api="anthropic.messages", finish_reason=None)

    def spam(k):
        for j in range(100):
            log.write({"thread": k, "j": j, "pad": "x" * 3000})  # > PIPE_BUF: still one write per line

    threads = [threading.Thread(target=spam, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == len(fins) + 1 + 800 and log.lines_written == len(lines) and log.write_errors == 0
    recs = [json.loads(x) for x in lines]
    for i, (rec, f) in enumerate(zip(recs, fins)):
        assert rec["request_id"] == f"chatcmpl-{i}" and rec["model"] == "tiny" and rec["api"] == "openai.chat"
        assert rec["prompt_tokens"] == f.usage["prompt_tokens"]
        assert rec["completion_tokens"] == f.usage["completion_tokens"]
        assert rec["cached_tokens"] == f.usage["cached_tokens"]
        assert rec["queue_ms"] == f.timings["queue_ms"] and rec["prompt_ms"] == f.timings["prompt_ms"]
        assert rec["predicted_ms"] == f.timings["predicted_ms"] and rec["finish_reason"] == "length"
    assert recs[0]["tool_call_parse"] == tool and recs[1]["tool_call_parse"] is None
    assert recs[len(fins)]["finish_reason"] == "disconnected"
    assert sorted((r["thread"], r["j"]) for r in recs[len(fins) + 1:]) == [(k, j) for k in range(8) for j in range(100)]

    bad = RequestLogger(str(tmp_path / "no" / "such" / "dir.jsonl"))
    bad.write({"x": 1})  # never raises on a request path
    assert bad.write_errors == 1
    with pytest.raises(OSError):
        bad.check_writable()
    RequestLogger(None).write({"x": 1})  # disabled: a no-op


def test_http_counters_thread_safe():
    hc = HttpCounters(recent=4)
    barrier = threading.Barrier(8)

    def work():
        barrier.wait()
        for _ in range(2000):
            with hc:
                pass

    ts = [threading.Thread(target=work) for _ in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert hc.in_flight == 0 and 1 <= hc.max_in_flight <= 8 and hc.requests_started == 16000
    for i in range(6):
        hc.record_request(f"r{i}", {"queue_ms": i})
    assert [r["request_id"] for r in hc.recent_requests()] == ["r2", "r3", "r4", "r5"]


# ---- routes ------------------------------------------------------------------------------------------
def test_routes(served):
    eng, http, _, _ = served
    app = FastAPI()
    register_monitoring_routes(app, lambda: eng, http, "tiny-route")
    with TestClient(app) as cl:
        r = cl.get("/stats")
        assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
        d = r.json()
        assert d["schema"] == "ninfer_mlc_stats" and d["load"]["model_id"] == "tiny-route"
        assert d["pressure"]["device_kv_occupied_pages"] == build_stats(eng, http)["pressure"]["device_kv_occupied_pages"]
        r = cl.get("/metrics")
        assert r.status_code == 200 and r.headers["content-type"] == CONTENT_TYPE
        assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
        parse_prometheus(r.text)
        r = cl.get("/monitor")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        html = r.text
        assert 'id="kv-pages"' in html and "<canvas" in html and "fetch(" in html
        # self-contained: no external scripts, styles, fonts or images
        assert not re.search(r'(src|href)\s*=\s*["\']?(https?:)?//', html, re.I)
        assert "@import" not in html and "url(" not in html

    stats_app = make_stats_app(lambda: eng, http, "tiny-side")
    with TestClient(stats_app) as cl:
        assert cl.get("/health").json() == {"status": "ok"}
        assert cl.get("/stats").json()["load"]["model_id"] == "tiny-side"
        parse_prometheus(cl.get("/metrics").text)
        assert cl.get("/monitor").status_code == 200
        assert cl.get("/v1/models").status_code == 404
    assert {"/health", "/stats", "/metrics", "/monitor"} == set(MONITOR_PATHS)

    # no engine yet: 503, not a crash
    with TestClient(make_stats_app(lambda: None)) as cl:
        assert cl.get("/health").status_code == 503
        assert cl.get("/stats").status_code == 503 and cl.get("/metrics").status_code == 503


def test_stats_under_load(served):
    """Polling while requests run: every snapshot is well-formed and within bounds."""
    eng, http, _, _ = served
    errors: list = []

    def client(k):
        try:
            for i in range(3):
                _run(eng, _prompt(20 + 3 * k + i, 120 + 20 * i), http, f"load-{k}-{i}", max_tokens=8)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=client, args=(k,)) for k in range(3)]
    for t in ts:
        t.start()
    polls, busy = 0, 0
    while any(t.is_alive() for t in ts):
        s = build_stats(eng, http)
        p, sch = s["pressure"], s["scheduler"]
        assert 0 <= p["device_kv_occupied_pages"] <= p["device_kv_pages_total"]
        assert 0 <= p["device_state_occupied_slots"] <= p["device_state_slots_total"]
        assert sch["running"] <= eng.cfg.max_concurrency and 0 <= s["http"]["in_flight"] <= 3
        busy += sch["running"] > 0 or sch["waiting"] > 0
        prometheus_text(s)
        polls += 1
        time.sleep(0.005)
    for t in ts:
        t.join()
    assert not errors, errors
    assert polls > 5 and busy > 0
    s = build_stats(eng, http)
    assert s["http"]["max_in_flight"] >= 2 and s["scheduler"]["running"] == 0


def test_spec_section_with_a_speculator():
    eng = open_engine(ART, _opts(spec="mtp", max_concurrency=1), meminfo_reader=PLENTY)
    try:
        fin, _ = _run(eng, _prompt(3, 120), max_tokens=16)
        s = build_stats(eng, None)
    finally:
        eng.stop()
    sp = s["spec"]
    assert sp["backend"] == "mtp"
    assert sp["draft_n"] == fin.timings["draft_n"] > 0 and sp["draft_n_accepted"] == fin.timings["draft_n_accepted"]
    assert sp["acceptance_rate"] == pytest.approx(sp["draft_n_accepted"] / sp["draft_n"], abs=1e-6)
    assert sp["rounds"] > 0
    vals = parse_prometheus(prometheus_text(s))
    assert vals["ninfer_spec_draft_n_total"] == sp["draft_n"]
