"""Overlapped decode (async scheduling): step N+1 is launched with step N's tokens before step N is committed.

On llvm the step runs synchronously, so nothing is hidden, but the engine takes the same path as on CUDA:
read, plan the next step, launch it, commit. Every output must equal the in-order engine's, token for
token: greedy and seeded draws (penalty state on the device sampler), stop strings (the request ends
while its next row is in flight: that row is discarded), stop ids and length limits (the row is never
launched), a thinking budget (its steps fall back to in-order), a request joining mid-stream, logprobs,
cancellation, and a follow-up turn restored from a frontier cached by a request whose extra row ran.
"""
from __future__ import annotations

import pytest

from ninfer_mlc.runtime.engine import Finished, GenRequest
from ninfer_mlc.runtime.sampling import SamplingParams

from test_engine import engine, prompts

QWEN = dict(temperature=0.7, top_p=0.95, top_k=20, presence_penalty=1.0)


def _run(eng, reqs: list[GenRequest]) -> list[tuple]:
    hs = [eng.submit(r) for r in reqs]
    out = []
    for h in hs:
        evs = list(h.iter_sync(timeout=300))
        fin = evs[-1]
        assert isinstance(fin, Finished), fin
        ids = [t for e in evs[:-1] for t in e.token_ids]
        lps = [(lp.token_id, round(lp.logprob, 4), lp.top_ids.tolist()) for e in evs[:-1] for lp in e.logprobs]
        out.append(("".join(e.text for e in evs[:-1]), fin.reason, fin.stop_matched,
                    fin.usage["completion_tokens"], ids, lps, fin.usage["cached_tokens"]))
    return out


def _mix(eng_ref) -> list[GenRequest]:
    """Six requests for four lanes, ending at different steps for every reason an overlapped row can meet."""
    ps = prompts(6, seed=21)
    greedy = lambda **k: SamplingParams(temperature=0, ignore_eos=True, **k)  # noqa: E731
    (full, *_), (_, _, _, _, ids, *_) = _run(eng_ref, [GenRequest(ps[3], greedy(max_tokens=40)),
                                                     GenRequest(ps[5], greedy(max_tokens=30))])
    stop_str = full[len(full) // 2: len(full) // 2 + 3]
    think = eng_ref.tok.encode("<think>\n", add_special_tokens=False).ids
    return [
        GenRequest(ps[0], greedy(max_tokens=12)),
        GenRequest(ps[1], greedy(max_tokens=50, logprobs=True, top_logprobs=2)),
        GenRequest(ps[2], SamplingParams(max_tokens=25, seed=5, **QWEN)),
        GenRequest(ps[3], greedy(max_tokens=40, stop=[stop_str])),  # ends mid-stream with its next row in flight
        GenRequest(ps[4] + think, greedy(max_tokens=8), thinking_budget=2, started_in_think=True),  # in order while forced
        GenRequest(ps[5], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[ids[7]])),  # never launched past it
    ]


@pytest.fixture(scope="module")
def reference():
    eng = engine(max_concurrency=4, prefix_reuse=False, device_sampling="on", async_scheduling="off")
    try:
        assert not eng.overlap
        reqs = _mix(eng)
        return reqs, _run(eng, reqs)
    finally:
        eng.stop()


@pytest.mark.parametrize("device_sampling", ["on", "off"])
def test_overlapped_outputs_equal_in_order_outputs(reference, device_sampling):
    reqs, want = reference
    eng = engine(max_concurrency=4, prefix_reuse=False, device_sampling=device_sampling, async_scheduling="on")
    try:
        got = _run(eng, reqs)
        assert [g[:4] for g in got] == [w[:4] for w in want]  # text, reason, stop string, token count
        if device_sampling == "on":
            assert got == want
        else:  # the host sampler draws the same tokens; its logprob values are its own
            assert [g[:5] + g[6:] for g in got] == [w[:5] + w[6:] for w in want]
            assert [[(t, ids) for t, _, ids in g[5]] for g in got] == [[(t, ids) for t, _, ids in w[5]] for w in want]
        assert want[3][1] == "stop" and want[3][2] is not None and want[5][1] == "stop"
        c = eng.stats().counters
        assert c.overlapped_decode_rounds > 10
        hs = eng.stats().host_step
        assert hs["steps"] > c.overlapped_decode_rounds and hs["overlapped_steps"] == c.overlapped_decode_rounds
        assert all(hs[f"{p}_p50_ms"] >= 0 for p in ("schedule", "inputs", "launch", "read", "commit", "detok", "emit"))
        assert eng.audit() == []
    finally:
        eng.stop()


def test_cancel_mid_stream_keeps_the_batch_exact(reference):
    reqs, want = reference
    eng = engine(max_concurrency=4, prefix_reuse=False, device_sampling="on", async_scheduling="on")
    try:
        long = eng.submit(GenRequest(prompts(1, seed=3)[0], SamplingParams(temperature=0, max_tokens=400,
                                                                            ignore_eos=True)))
        others = [eng.submit(r) for r in reqs[:3]]
        seen = 0
        for ev in long.iter_sync(timeout=300):
            seen += len(getattr(ev, "token_ids", []))
            if seen >= 5:
                long.cancel()
                break
        rest = list(long.iter_sync(timeout=300))
        assert isinstance(rest[-1], Finished) and rest[-1].reason == "cancelled"
        assert rest[-1].usage["completion_tokens"] < 400
        for h, w in zip(others, want[:3]):
            evs = list(h.iter_sync(timeout=300))
            assert "".join(e.text for e in evs[:-1]) == w[0]
        assert eng.stats().counters.overlapped_decode_rounds > 0
        assert eng.audit() == []
    finally:
        eng.stop()


def test_frontier_cached_with_a_discarded_row_restores_exactly():
    """A request that ends on a stop string while its next row runs is released with that row's feed
    counted: the cached frontier (pages + recurrent state) is prompt + every generated token, and a
    follow-up turn restored from it decodes what a cold prefill gives."""
    p = prompts(1, seed=33)[0]
    cold = engine(max_concurrency=2, prefix_reuse=False, device_sampling="on", async_scheduling="off")
    try:
        (full, *_), = _run(cold, [GenRequest(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))])
    finally:
        cold.stop()
    stop = full[len(full) // 2: len(full) // 2 + 3]
    first = GenRequest(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop]))

    def follow_up(eng, history):
        return _run(eng, [GenRequest(history + prompts(1, seed=34, lo=8, hi=12)[0],
                                     SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))])[0]

    warm = engine(max_concurrency=2, device_sampling="on", async_scheduling="on")
    ended: dict = {}
    finish = warm.scheduler.finish

    def spy(r, reason, *a, **k):
        ended[r.rid] = (reason, r.all_tokens(), None if r.seq is None else r.seq.length)
        return finish(r, reason, *a, **k)

    warm.scheduler.finish = spy  # type: ignore[method-assign]
    try:
        _run(warm, [first])
        (reason, history, length), = ended.values()
        assert reason == "stop" and length == len(history)  # the in-flight row's feed is counted
        assert warm.stats().counters.discarded_decode_rows == 1
        got = follow_up(warm, history)
        assert warm.audit() == []
    finally:
        warm.stop()
    cold = engine(max_concurrency=2, prefix_reuse=False, device_sampling="on", async_scheduling="off")
    try:
        want = follow_up(cold, history)
    finally:
        cold.stop()
    assert got[:5] == want[:5]
    assert got[6] >= len(history) - 1 and want[6] == 0  # restored from the first request's frontier


def test_flag_and_defaults():
    from ninfer_mlc.runtime.config import EngineConfig
    from ninfer_mlc.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes").validate()
    eng = engine(max_concurrency=1, prefix_reuse=False)
    try:
        assert not eng.overlap  # auto: on CUDA only
    finally:
        eng.stop()


def test_no_upload_between_an_overlapped_forward_and_its_read():
    """Every host-to-device upload waits for the device stream: one issued after an overlapped step's forward
    is queued would wait for that forward, and the commit it was meant to hide would run after it. So the
    draw's parameters go up before the forward, and nothing is uploaded until the step's ids are read."""
    eng = engine(max_concurrency=2, prefix_reuse=False, device_sampling="on", async_scheduling="on")
    ds, runner, events = eng.device_sampler, eng.runner, []
    decode, collect, copy = runner.decode, ds.collect, ds._copy

    def logged(name, fn):
        def call(*a, **k):
            events.append((name, k.get("wait", True)))
            return fn(*a, **k)
        return call

    runner.decode, ds.collect, ds._copy = logged("decode", decode), logged("collect", collect), logged("upload", copy)
    try:
        _run(eng, [GenRequest(p, SamplingParams(max_tokens=12, seed=1, **QWEN)) for p in prompts(2, seed=5)])
    finally:
        eng.stop()
    names = [n for n, _ in events]
    launched = [i for i, (n, wait) in enumerate(events) if n == "decode" and not wait]
    assert len(launched) > 5
    for i in launched:
        j = names.index("collect", i)
        assert names[i - 1] == "upload" and "upload" not in names[i:j], names[i - 1: j + 1]
