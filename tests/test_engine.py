"""Engine behaviour on the embedded tiny model: batching, preemption, queue limits, cancellation.

On llvm the kernels compute each row independently, so greedy outputs must be identical however
requests are batched, preempted or restored.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from ninfer_mlc.runtime.assemble import open_engine
from ninfer_mlc.paths import default_model_dir
from ninfer_mlc.runtime.config import EngineConfig
from ninfer_mlc.runtime.engine import Finished, GenRequest
from ninfer_mlc.runtime.errors import ContextTooLong, QueueFull, QueueTimeout
from ninfer_mlc.runtime.sampling import SamplingParams

ART = default_model_dir()
PLENTY = lambda: 64 * 2**30  # noqa: E731


def prompts(n: int, seed: int = 0, lo: int = 20, hi: int = 140) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1900, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def run_all(eng, ps, max_tokens=40, **sp):
    hs = [eng.submit(GenRequest(p, SamplingParams(temperature=sp.get("temperature", 0), max_tokens=max_tokens,
                                                  ignore_eos=True, seed=sp.get("seed")))) for p in ps]
    outs = []
    for h in hs:
        evs = list(h.iter_sync(timeout=300))
        assert isinstance(evs[-1], Finished)
        outs.append(("".join(e.text for e in evs[:-1]), evs[-1]))
    return outs


def engine(**kw):
    kw["kv_capacity"] = kw.pop("kv_tokens", 8192)
    return open_engine(ART, EngineConfig(**kw), meminfo_reader=PLENTY)


@pytest.fixture(scope="module")
def sequential_outputs():
    eng = engine(max_concurrency=1, prefix_reuse=False)
    try:
        return [o for o, _ in run_all(eng, prompts(6))]
    finally:
        eng.stop()


def test_continuous_batching_matches_sequential(sequential_outputs):
    eng = engine(max_concurrency=4, prefill_chunk=64, prefix_reuse=False)
    try:
        outs = run_all(eng, prompts(6))
        assert [o for o, _ in outs] == sequential_outputs
        assert eng.stats().counters.decode_row_rounds > eng.stats().counters.decode_rounds  # rows were batched
    finally:
        eng.stop()


def test_preemption_under_page_pressure_restores_exactly(sequential_outputs):
    # 6 pages for 4 lanes of ~80 prompt + 40 generated tokens: preemption is forced
    eng = engine(max_concurrency=4, prefill_chunk=64, kv_tokens=6 * 64, host_kv_mib=32, host_ram_reserve_mib=0)
    try:
        outs = run_all(eng, prompts(6))
        assert [o for o, _ in outs] == sequential_outputs
        assert eng.stats().counters.preemptions > 0
        assert all(f.reason == "length" and f.usage["completion_tokens"] == 40 for _, f in outs)
    finally:
        eng.stop()


def test_preemption_without_cache_recomputes_and_completes():
    eng = engine(max_concurrency=3, prefill_chunk=64, kv_tokens=5 * 64, prefix_reuse=False)
    try:
        outs = run_all(eng, prompts(4, seed=3), max_tokens=30)
        assert all(f.reason == "length" and f.usage["completion_tokens"] == 30 for _, f in outs)
        assert eng.stats().counters.preemptions > 0
        assert eng.kv.pages.used_pages == 0 and eng.kv.slots.free_slots == eng.kv.slots.num_slots
    finally:
        eng.stop()


def test_seeded_sampling_is_reproducible_across_batching():
    ps = prompts(3, seed=5)
    e1 = engine(max_concurrency=1, prefix_reuse=False)
    try:
        a = [o for o, _ in run_all(e1, ps, temperature=0.9, seed=42)]
    finally:
        e1.stop()
    e2 = engine(max_concurrency=3, prefix_reuse=False)
    try:
        b = [o for o, _ in run_all(e2, ps, temperature=0.9, seed=42)]
    finally:
        e2.stop()
    assert a == b


def test_queue_full_and_queue_timeout():
    eng = engine(max_concurrency=1, max_pending_requests=1, pending_timeout_ms=300, prefix_reuse=False)
    try:
        long = GenRequest(prompts(1)[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
        h1 = eng.submit(long)
        h1.admitted.wait(10)
        h2 = eng.submit(GenRequest([1, 2, 3], SamplingParams(max_tokens=2)))
        with pytest.raises(QueueFull):
            eng.submit(GenRequest([1, 2, 3], SamplingParams(max_tokens=2)))
        with pytest.raises(QueueTimeout):
            list(h2.iter_sync(timeout=30))
        h1.cancel()
        assert list(h1.iter_sync(timeout=30))[-1].reason == "cancelled"
        assert eng.stats().counters.requests_queue_timeout == 1
    finally:
        eng.stop()


def test_cancellation_frees_pages_and_slots():
    eng = engine(max_concurrency=2, prefix_reuse=False)
    try:
        h = eng.submit(GenRequest(prompts(1)[0], SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)))
        it = h.iter_sync(timeout=30)
        next(it)  # first token arrived: the sequence holds pages and a slot
        assert eng.kv.pages.used_pages > 0
        h.cancel()
        evs = list(it)
        assert evs[-1].reason == "cancelled"
        deadline = time.time() + 5
        while eng.kv.pages.used_pages and time.time() < deadline:
            time.sleep(0.01)
        assert eng.kv.pages.used_pages == 0 and eng.kv.slots.free_slots == eng.kv.slots.num_slots
        assert run_all(eng, prompts(1), max_tokens=3)[0][1].reason == "length"  # still serving
    finally:
        eng.stop()


def test_context_limit_is_enforced():
    eng = engine(max_concurrency=1, max_context=128, prefix_reuse=False)
    try:
        with pytest.raises(ContextTooLong) as e:
            eng.submit(GenRequest(list(range(128)), SamplingParams(max_tokens=4)))
        assert (e.value.prompt_tokens, e.value.max_prompt_tokens) == (128, 127)
        out = run_all(eng, [list(range(100))], max_tokens=1000)[0][1]
        assert out.reason == "length" and out.usage["completion_tokens"] == 28  # clamped to the context
    finally:
        eng.stop()


def test_stop_strings_and_stop_tokens():
    eng = engine(max_concurrency=1, prefix_reuse=False)
    try:
        p = prompts(1, seed=9)[0]
        (full, _), = run_all(eng, [p], max_tokens=30)
        assert len(full) > 6
        stop = full[3:6]
        h = eng.submit(GenRequest(p, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])))
        evs = list(h.iter_sync(timeout=60))
        text = "".join(e.text for e in evs[:-1])
        assert evs[-1].reason == "stop" and evs[-1].stop_matched == stop
        assert text == full[: full.index(stop)]
        first_tok = eng.tok.encode(full, add_special_tokens=False).ids[0]
        h = eng.submit(GenRequest(p, SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[first_tok])))
        evs = list(h.iter_sync(timeout=60))
        assert evs[-1].reason == "stop" and evs[-1].usage["completion_tokens"] == 1
    finally:
        eng.stop()


@pytest.mark.parametrize("spec", ["none", "mtp"])
def test_thinking_budget_closes_reasoning_with_the_early_close_text(spec):
    """The budget holds whoever produced the tokens: plain decoding or speculative rounds, whose
    accepted tokens pass the same commit path (a forced token cuts the rest of the round)."""
    from ninfer_mlc.runtime.assemble import THINK_EARLY_CLOSE

    eng = engine(max_concurrency=1, prefix_reuse=False, spec=spec, draft_tokens=3)
    try:
        p = prompts(1, seed=11)[0] + eng.tok.encode("<think>\n", add_special_tokens=False).ids
        budget = 7
        h = eng.submit(GenRequest(p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True),
                                  thinking_budget=budget, started_in_think=True))
        evs = list(h.iter_sync(timeout=120))
        text = "".join(e.text for e in evs[:-1])
        assert "</think>" in text
        reasoning, answer = text.split("</think>", 1)
        assert reasoning.endswith(THINK_EARLY_CLOSE.split("</think>")[0])
        # exactly `budget` freely sampled reasoning tokens before the forced text starts
        ids = eng.tok.encode(text, add_special_tokens=False).ids
        close = eng.tok.encode(THINK_EARLY_CLOSE, add_special_tokens=False).ids
        n_free = len(eng.tok.encode(reasoning[: -len(THINK_EARLY_CLOSE.split("</think>")[0])],
                                    add_special_tokens=False).ids)
        assert abs(n_free - budget) <= 1 and len(ids) > len(close)
        assert evs[-1].usage["completion_tokens"] == 60  # the answer continues after the close
        assert evs[-1].usage["reasoning_tokens"] == len(eng.tok.encode(reasoning + "</think>",
                                                                      add_special_tokens=False).ids)
        if spec != "none":
            assert eng.stats().spec.rounds > 0 and eng.stats().spec.draft_tokens > 0
    finally:
        eng.stop()


def test_no_preemption_thrash_when_running_sequences_outgrow_the_pool():
    """Two sequences that together need more KV than the pool: one is preempted (its state goes to the
    host tier) and waits until the other finishes, instead of being readmitted at once, preempting the
    other and being recomputed over and over (it did: 30 preemptions for 2 requests)."""
    ps = prompts(2, seed=21, lo=300, hi=301)
    ref = engine(max_concurrency=1, prefix_reuse=False, kv_tokens=4096)
    try:
        want = [o for o, _ in run_all(ref, ps, max_tokens=200)]
    finally:
        ref.stop()
    eng = engine(max_concurrency=2, prefill_chunk=128, kv_tokens=14 * 64, host_kv_mib=32, host_ram_reserve_mib=0)
    try:
        outs = run_all(eng, ps, max_tokens=200)
        assert [o for o, _ in outs] == want
        c = eng.stats().counters
        assert 1 <= c.preemptions <= 2, c
        assert c.computed_prefill_tokens <= 2 * 300 + 64, c  # the preempted one restored, not recomputed
        assert eng.audit() == []
    finally:
        eng.stop()


def test_device_sampling_matches_the_host_sampler():
    """Decode rows sampled inside the library (the CUDA default; forced on here for the llvm build):
    greedy and seeded draws with Qwen's preset (top-k 20, top-p 0.95, presence penalty 1.0) give the
    host sampler's tokens, and a thinking budget's forced tokens keep the lane's penalty counts right."""
    def run(mode):
        eng = engine(max_concurrency=3, prefix_reuse=False, device_sampling=mode)
        try:
            assert (eng.device_sampler is not None) == (mode == "on")
            ps = prompts(3, seed=4)
            hs = [eng.submit(GenRequest(p, SamplingParams(temperature=0.6, top_p=0.95, top_k=20, presence_penalty=1.0,
                                                          max_tokens=40, ignore_eos=True, seed=10 + i)))
                  for i, p in enumerate(ps)]
            hs.append(eng.submit(GenRequest(ps[0] + eng.tok.encode("<think>\n", add_special_tokens=False).ids,
                                            SamplingParams(temperature=0, max_tokens=80, ignore_eos=True,
                                                           presence_penalty=2.0, frequency_penalty=2.0),
                                            thinking_budget=5, started_in_think=True)))
            return [[t for e in h.iter_sync(timeout=300) if hasattr(e, "token_ids") for t in e.token_ids] for h in hs]
        finally:
            eng.stop()

    assert run("on") == run("off")
