"""bench/serve_bench.py and bench/agent_replay.py end to end on the embedded tiny model, tiny settings.

The serving benchmark starts its own `ninfer serve` process (the user's path); the agent replay attaches
to the session's shared test server. Both must produce a complete, self-consistent JSON document: every
field present, monotone timestamps, token counts that match the server's usage.
"""
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import agent_replay  # noqa: E402
import serve_bench  # noqa: E402
import serve_common  # noqa: E402
import serve_harness  # noqa: E402

from ninfer_mlc.paths import default_model_dir  # noqa: E402


def _summary_ok(s: dict, positive: bool = True) -> None:
    assert set(s) == {"n", "mean", "p50", "p90", "p99", "min", "max"}
    assert s["n"] > 0 and s["min"] <= s["p50"] <= s["p99"] <= s["max"]
    if positive:
        assert s["min"] > 0


def test_serve_bench_end_to_end(tmp_path):
    out = tmp_path / "serve.json"
    assert serve_bench.main(["--contexts", "96,160", "--concurrency", "2", "--max-tokens", "6",
                             "--extra-cells", "9000:1", "--shared-prefix", "0.5", "--shared-prefix-min-context", "160",
                             "--no-rates", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["server"]["exit_code"] == 0 and doc["server"]["start_seconds"] > 0
    load = doc["load"]
    for k in ("model_id", "dtype", "kv_dtype", "target", "random_weights", "kv_capacity_tokens", "max_context"):
        assert k in load
    assert load["kv_dtype"] == "float32" and load["max_context"] == 8192
    overhead = doc["calibration"]["template_overhead_tokens"]
    assert 0 < overhead["user"] < overhead["system+user"] < 96
    # the 9000-token cell cannot fit the tiny model's 8192-token context: skipped with the reason
    assert [(s["context"], "max context" in s["why"]) for s in doc["skipped"]] == [(9000, True)]
    assert [(c["context"], c["concurrency"], c["status"]) for c in doc["cells"]] == [(96, 2, "ok"), (160, 2, "ok")]
    for c in doc["cells"]:
        assert c["prompt_tokens"]["all_match"] and c["prompt_tokens"]["seen"] == [c["context"]]
        assert c["completion_tokens"]["all_match"] and c["completion_tokens"]["total"] == 2 * 6
        for k in ("ttft_s", "itl_ms", "chunk_gap_ms", "decode_tok_s_per_stream", "prefill_tok_s_client",
                  "prefill_tok_s_server"):
            _summary_ok(c[k])
        assert c["itl_method"] == "even split of usage over chunks"
        assert c["decode_tok_s_full_batch"] > 0 and c["output_tok_s"] > 0
        hs = c["host_step"]  # the engine's host time per decode step over the cell, by phase
        assert hs["steps"] > 0 and hs["total_mean_ms"] >= hs["commit_mean_ms"] >= 0 and "emit_p99_ms" in hs
        assert c["stats_delta"]["counters"]["requests_finished"] == 2
        assert c["stats_delta"]["counters"]["committed_decode_tokens"] == 12
        assert c["preemptions"] == 0
        sp = c["shared_prefix"]
        if c["context"] == 96:  # every prompt its own: nothing for the prefix cache
            assert sp["fraction"] == 0 and sp["prime"] is None and c["cached_tokens_total"] == 0
        else:  # half the words in a system message, primed once: both requests reuse at least that
            assert sp["fraction"] == 0.5 and sp["prime"]["error"] is None
            assert sp["prime"]["usage"]["prompt_tokens"] == 160
            assert c["cached_tokens_total"] >= 2 * sp["tokens"] > 0
        for r in c["requests_detail"]:
            ts = [r[k] for k in ("t_send", "t_headers", "t_first_token", "t_last_chunk", "t_finish", "t_done")]
            assert ts == sorted(ts) and ts[0] >= 0, ts
            assert r["error"] is None and r["finish_reason"] == "length"
            u, t = r["usage"], r["timings"]
            assert u["prompt_tokens"] == c["context"] and u["completion_tokens"] == 6
            assert t["prompt_n"] + t["cache_n"] == c["context"] and t["predicted_n"] == 6
            assert 1 <= r["chunks"] <= 6


def test_stream_record_token_accounting():
    """Tokens per chunk: exact from logprobs, else usage spread over the chunks after the first."""
    rec = serve_common.StreamRecord(t_send=0.0, status=200, usage={"completion_tokens": 7}, timings={})
    rec.chunks = [(1.0, 3, None), (1.1, 2, None), (1.3, 5, None), (1.4, 1, None)]
    rec.t_finish = 1.4
    toks, how = serve_common.chunk_tokens(rec)
    assert toks == [1.0, 2.0, 2.0, 2.0] and how.startswith("even split")
    assert serve_common.inter_token_latencies(rec) == pytest.approx([0.05, 0.1, 0.05])
    assert serve_common.decode_rate(rec) == pytest.approx(6 / 0.4)
    rec.chunks = [(1.0, 3, 1), (1.1, 2, 1), (1.3, 5, 4), (1.4, 1, 1)]
    toks, how = serve_common.chunk_tokens(rec)
    assert toks == [1.0, 1.0, 4.0, 1.0] and how == "logprobs"
    # two streams: only the time both are decoding counts for the full-batch rate
    a = serve_common.StreamRecord(t_send=0.0, status=200, usage={"completion_tokens": 3}, timings={})
    a.chunks, a.t_finish = [(1.0, 1, None), (2.0, 1, None), (3.0, 1, None)], 3.0
    b = serve_common.StreamRecord(t_send=0.0, status=200, usage={"completion_tokens": 3}, timings={})
    b.chunks, b.t_finish = [(1.5, 1, None), (2.5, 1, None), (3.5, 1, None)], 3.5
    assert serve_bench.full_batch_rate([a, b], 2) == pytest.approx(3 / 1.5)
    assert serve_bench.full_batch_rate([a], 2) is None


def test_agent_replay_against_server(server, tmp_path):
    out = tmp_path / "agent.json"
    assert agent_replay.main([str(default_model_dir()), "--url", server.url, "--sessions", "2",
                              "--target-tokens", "330", "--initial-tokens", "48", "--turn-tokens", "90,150",
                              "--max-tokens", "4", "--no-tools", "--no-rates", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["stopped_by"] == "target" and doc["target_tokens_effective"] == 330
    assert doc["reached_tokens"]["min"] >= 330
    turns, rounds = doc["turns"], doc["rounds"]
    assert len(rounds) >= 2 and len(turns) == sum(len(r["prompt_tokens"]) for r in rounds)
    by_session = {}
    for t in turns:
        assert t["error"] is None and t["prompt_tokens_match"] and t["completion_tokens"] == 4
        assert t["ttft_s"] > 0 and t["new_tokens"] > 0
        assert t["cached_tokens"] + t["computed_tokens"] == t["prompt_tokens"]
        assert 0 <= t["admit_ms"] <= t["queue_ms"] and 0 <= t["lane_wait_s"] <= t["queue_ms"] / 1000 + 1e-3
        assert t["ttft_service_s"] == pytest.approx(t["ttft_s"] - t["lane_wait_s"], abs=1e-3)
        by_session.setdefault(t["session"], []).append(t)
        if t["turn"] > 0:
            # a tool-call turn appends to the history: everything before its first new template turn is reused
            assert t["re_prefilled_tokens"] == 0, t
            assert t["new_tokens"] >= t["appended_tokens"] and t["cached_tokens"] > 0
            assert t["ttft_target_s"] > 0.25
    for rows in by_session.values():
        lens = [t["prompt_tokens"] for t in rows]
        assert lens == sorted(lens) and [t["turn"] for t in rows] == list(range(len(rows)))
    for r in rounds:
        tr = r["transfers"]
        for k in ("restore", "spill"):
            assert tr[f"{k}_bytes"] >= 0 and tr[f"{k}_seconds"] >= 0
            assert (tr[f"{k}_GBps"] is None) == (tr[f"{k}_bytes"] == 0 or tr[f"{k}_seconds"] == 0)
            assert tr[f"{k}_vs_pinned"] is None  # no pinned rate measured
            assert tr[f"{k}_wait_seconds"] >= 0 and (tr[f"{k}_kv_copies"] > 0) == (tr[f"{k}_kv_pages"] > 0)
    s = doc["summary"]
    assert s["errors"] == 0 and s["prompt_tokens_all_match"]
    assert s["restore_wait_seconds"] >= 0 and s["spill_wait_seconds"] >= 0
    assert s["re_prefilled_tokens_cached_turns"]["total"] == 0 and s["prefill_rate_tok_s"] > 0


def test_harness_figures_beside_cells():
    """After the server tests: the TVM import is already paid."""
    res = serve_harness.run_harness(str(default_model_dir()), [(96, 2)], [96], steps=2, warm=1, rates=False)
    assert res["skipped"] == [] and res["facts"]["matmul_params"] > 0
    (d,), (p,) = res["decode"], res["prefill"]
    assert d["context"] == 96 and d["batch"] == 2 and d["step_ms"] > 0 and d["logits_finite"]
    assert d["bytes_per_step"] > res["facts"]["weights_read_per_step"] and d["floor_ms"] is None
    assert p["tok_s"] > 0 and p["flops"] > 0 and p["logits_finite"]
    cell = {"context": 96, "concurrency": 2, "status": "ok", "decode_tok_s_per_stream": {"p50": 10.0},
            "decode_tok_s_full_batch": 20.0, "prefill_tok_s_server": {"p50": 50.0}}
    serve_bench.attach_harness([cell], res)
    h = cell["harness"]
    assert h["decode"] is d and h["prefill"] is p
    assert h["decode_per_stream_vs_harness"] == pytest.approx(10.0 / d["tok_s_per_stream"], rel=1e-3, abs=6e-5)  # rounded to 4 places
    assert h["prefill_server_vs_harness"] == pytest.approx(50.0 / p["tok_s"], rel=1e-3, abs=6e-5)


def test_harness_device_argmax_steps():
    """--device-argmax: decode steps end in the library's sampler and only token ids reach the host."""
    res = serve_harness.run_harness(str(default_model_dir()), [(96, 2)], [], steps=2, warm=1, rates=False,
                                    device_argmax=True)
    (d,) = res["decode"]
    assert res["decode_output"] == "token ids (device argmax)" and d["step_ms"] > 0 and d["logits_finite"]


def test_agent_server_flags_size_device_kv_below_total():
    a = agent_replay.build_parser().parse_args(["--sessions", "3", "--target-tokens", "1000", "--turn-tokens",
                                                "100,200", "--max-tokens", "50"])
    flags, sized = agent_replay.server_flags(a, str(default_model_dir()))
    one = 1000 + 200 + 50
    assert sized["sessions_total_tokens"] == 3 * one
    assert serve_common.flag_value(flags, "--max-concurrency") == "2"
    assert int(serve_common.flag_value(flags, "--max-context")) == one + 1024
    assert int(serve_common.flag_value(flags, "--kv-capacity")) == 2 * one < 3 * one
    kv_per_token = 1024  # tiny model: 1 attention layer x K,V x 2 heads x 64 dims x f32
    slots = (8 + 2 * 3) * agent_replay.state_slot_bytes(str(default_model_dir()))  # host floor + a waiting session's
    assert slots > 0
    assert int(serve_common.flag_value(flags, "--host-kv-mib")) == int((one * kv_per_token * 1.25 + slots) / 2 ** 20) + 256
    assert int(serve_common.flag_value(flags, "--pending-timeout-ms")) >= 600_000
    a = agent_replay.build_parser().parse_args(["--serve-args", "--kv-capacity 5000 --max-concurrency=1"])
    flags, sized = agent_replay.server_flags(a, str(default_model_dir()))
    assert serve_common.flag_value(flags, "--kv-capacity") == "5000" and "kv_capacity_tokens" not in sized
    assert serve_common.flag_value(flags, "--max-concurrency") == "1" and "max_concurrency" not in sized
