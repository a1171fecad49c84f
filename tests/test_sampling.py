"""Tests for runtime/sampling.py.

Processing is checked against HF transformers' logits processors (independent reference),
presence/frequency/logit_bias against a dense straightforward reference, and the draw
against the processed distribution with a chi-square test (fixed seeds => deterministic).
"""

from __future__ import annotations

import math
import time

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ninfer_mlc.runtime import sampling as S
from ninfer_mlc.runtime.sampling import (
    PRESETS,
    RowState,
    Sampler,
    SamplingError,
    SamplingParams,
    get_preset,
    merge_sampling_params,
    probs_after_processing,
    resolve_sampling_params,
    sample_from_probs,
)


# ----------------------------------------------------------------------------------------
# HF reference
# ----------------------------------------------------------------------------------------
def hf_probs(logits: np.ndarray, input_ids, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0,
             repetition_penalty=1.0) -> np.ndarray:
    scores = torch.from_numpy(logits.astype(np.float32)).unsqueeze(0).clone()
    ids = torch.tensor([list(input_ids)], dtype=torch.long) if len(input_ids) else torch.zeros((1, 0), dtype=torch.long)
    if repetition_penalty != 1.0 and ids.shape[1]:
        scores = RepetitionPenaltyLogitsProcessor(repetition_penalty)(ids, scores)
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    if min_p > 0.0:
        scores = MinPLogitsWarper(min_p)(ids, scores)
    return torch.softmax(scores.double(), dim=-1)[0].numpy()


HF_CONFIGS = [
    dict(temperature=1.0),
    dict(temperature=0.7),
    dict(temperature=1.3, top_k=20),
    dict(temperature=1.0, top_k=1),
    dict(temperature=0.9, top_p=0.9),
    dict(temperature=1.0, top_p=0.5),
    dict(temperature=0.6, top_p=0.95, top_k=20),
    dict(temperature=0.7, top_p=0.8, top_k=20),
    dict(temperature=1.0, min_p=0.05),
    dict(temperature=0.8, min_p=0.2, top_p=0.9),
    dict(temperature=1.2, top_k=50, top_p=0.7, min_p=0.1),
    dict(temperature=1.0, repetition_penalty=1.3),
    dict(temperature=0.7, repetition_penalty=0.8, top_k=40),
    dict(temperature=1.0, repetition_penalty=1.1, top_p=0.9, min_p=0.02),
]


@pytest.mark.parametrize("cfg", HF_CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
@pytest.mark.parametrize("V,scale", [(64, 2.0), (1000, 3.0), (20000, 1.0), (20000, 6.0)])
def test_matches_hf_processors(cfg, V, scale):
    rng = np.random.default_rng(V * 7 + int(scale * 10))
    for trial in range(3):
        logits = (rng.standard_normal(V) * scale).astype(np.float32)
        prompt = rng.integers(0, V, size=min(V // 2, 300)).tolist()
        generated = rng.integers(0, V, size=40).tolist()
        params = SamplingParams(**cfg).validate(V)
        state = RowState(params, prompt_token_ids=prompt)
        state.extend(generated)
        ours = probs_after_processing(logits, params, state)
        ref = hf_probs(logits, prompt + generated, **cfg)
        assert ours.shape == (V,)
        np.testing.assert_array_equal(ours > 0, ref > 0)
        np.testing.assert_allclose(ours, ref, rtol=2e-5, atol=1e-9)
        assert abs(ours.sum() - 1.0) < 1e-9


def test_top_p_large_vocab_paths_agree_with_hf():
    # Large V: exercises both probe (partition) sizes for peaky logits, the full-sort path
    # for flat logits, and the blocked prefix sums.
    V = 100_000
    rng = np.random.default_rng(5)
    for scale, top_p in [(8.0, 0.9), (2.5, 0.9), (1.0, 0.95), (0.2, 0.5)]:
        logits = (rng.standard_normal(V) * scale).astype(np.float32)
        cfg = dict(temperature=1.0, top_p=top_p)
        ours = probs_after_processing(logits, SamplingParams(**cfg))
        ref = hf_probs(logits, [], **cfg)
        # float32 (HF) vs float64 (ours) cumulative sums may disagree on the one token at
        # the boundary; everything else must match.
        assert np.count_nonzero((ours > 0) != (ref > 0)) <= 1
        both = (ours > 0) & (ref > 0)
        np.testing.assert_allclose(ours[both] / ours[both].sum(), ref[both] / ref[both].sum(), rtol=1e-4)


# ----------------------------------------------------------------------------------------
# Penalties / bias against a dense reference
# ----------------------------------------------------------------------------------------
def ref_penalised(logits, prompt, generated, *, logit_bias=None, presence=0.0, frequency=0.0, rep=1.0):
    x = logits.astype(np.float64).copy()
    for k, v in (logit_bias or {}).items():
        x[int(k)] += v
    seen = set(prompt) | set(generated)
    for t in seen:
        x[t] = x[t] * rep if x[t] < 0 else x[t] / rep
    for t in set(generated):
        c = generated.count(t)
        x[t] -= frequency * c + presence
    return x


def softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("presence,frequency,rep,bias", [
    (0.0, 0.0, 1.0, {3: 5.0, 10: -100.0}),
    (1.5, 0.0, 1.0, None),
    (0.0, 0.7, 1.0, None),
    (-1.0, 2.0, 1.0, None),
    (0.5, 0.5, 1.2, {"7": 2.5, 0: -3.0}),
])
def test_penalties_and_bias_match_reference(presence, frequency, rep, bias):
    V = 50
    rng = np.random.default_rng(11)
    logits = (rng.standard_normal(V) * 2).astype(np.float32)
    prompt = [1, 2, 3, 3, 4]
    generated = [3, 5, 5, 5, 7, 9, 9, 3]
    params = SamplingParams(temperature=0.8, presence_penalty=presence, frequency_penalty=frequency,
                            repetition_penalty=rep, logit_bias=bias or {}).validate(V)
    state = RowState(params, prompt_token_ids=prompt)
    state.extend(generated)
    ours = probs_after_processing(logits, params, state)
    ref = softmax(ref_penalised(logits, prompt, generated, logit_bias=params.logit_bias, presence=presence,
                                frequency=frequency, rep=rep) / 0.8)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-12)


def test_presence_frequency_apply_to_generated_only():
    V = 10
    logits = np.zeros(V, np.float32)
    params = SamplingParams(temperature=1.0, presence_penalty=2.0, frequency_penalty=1.0)
    state = RowState(params, prompt_token_ids=[1, 2, 3])
    p = probs_after_processing(logits, params, state)
    np.testing.assert_allclose(p, np.full(V, 0.1))  # prompt tokens are not penalised
    state.extend([4, 4])
    p = probs_after_processing(logits, params, state)
    assert p[4] < p[1] and math.isclose(p[4] / p[1], math.exp(-(2.0 + 2 * 1.0)), rel_tol=1e-6)


def test_repetition_penalty_rollback_and_mask():
    logits = np.array([1, -1, 2, -2, 0.5, 0.5, 3, -3], np.float32)
    params = SamplingParams(temperature=1.0, repetition_penalty=2.0)
    state = RowState(params, prompt_token_ids=[0])
    base = probs_after_processing(logits, params, state)
    state.extend([1, 6])
    mid = probs_after_processing(logits, params, state)
    assert not np.allclose(base, mid)
    state.rollback(2)
    np.testing.assert_allclose(probs_after_processing(logits, params, state), base)
    # prompt token stays penalised after rolling back a generated duplicate of it
    state.append(0)
    state.rollback(1)
    np.testing.assert_allclose(probs_after_processing(logits, params, state), base)


# ----------------------------------------------------------------------------------------
# Greedy
# ----------------------------------------------------------------------------------------
def test_greedy_argmax_ties_lowest_id():
    logits = np.array([[0, 5, 1, 5, 5], [3, 3, 3, 3, 3]], np.float32)
    rows = [RowState(SamplingParams(temperature=0)) for _ in range(2)]
    out = Sampler().sample(logits, rows)
    assert out.dtype == np.int32
    assert out.tolist() == [1, 0]
    p = probs_after_processing(logits[0], SamplingParams(temperature=0))
    assert p.tolist() == [0, 1, 0, 0, 0]


def test_greedy_applies_bias_and_penalties():
    logits = np.array([[0, 5, 1, 4.9, 0]], np.float32)
    r = RowState(SamplingParams(temperature=0, logit_bias={4: 10.0}))
    assert Sampler().sample(logits, [r]).tolist() == [4]
    r = RowState(SamplingParams(temperature=0, presence_penalty=1.0))
    r.append(1)
    assert Sampler().sample(logits, [r], update_state=False).tolist() == [3]


def test_greedy_ignores_rng_and_nan_rows():
    logits = np.array([[0, np.nan, 1, 2]], np.float32)
    r = RowState(SamplingParams(temperature=0))
    assert Sampler().sample(logits, [r]).tolist() == [3]


# ----------------------------------------------------------------------------------------
# Sampled frequencies vs processed distribution (chi-square, fixed seeds)
# ----------------------------------------------------------------------------------------
# chi-square critical values at p = 0.001 by degrees of freedom
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12, 9: 27.88,
             10: 29.59, 11: 31.26}


@pytest.mark.parametrize("cfg", [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=6),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=1.0, top_k=10, top_p=0.9, min_p=0.05),
    dict(temperature=0.9, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={0: 2.0}),
])
def test_sampled_frequencies_match_distribution(cfg):
    V = 12
    rng = np.random.default_rng(3)
    logits = (rng.standard_normal(V) * 1.5).astype(np.float32)
    params = SamplingParams(seed=1234, **cfg).validate(V)
    state = RowState(params)
    state.extend([2, 2, 5])
    probs = probs_after_processing(logits, params, state)
    N = 10_000
    # many rows sharing the state history but each with its own generator
    batch = np.repeat(logits[None, :], 1000, axis=0)
    counts = np.zeros(V, np.int64)
    sampler = Sampler()
    rows = []
    for j in range(1000):
        r = RowState(params, rng=np.random.default_rng([17, j]))
        r.extend([2, 2, 5])
        rows.append(r)
    for _ in range(N // 1000):
        out = sampler.sample(batch, rows, update_state=False)
        counts += np.bincount(out, minlength=V)
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a filtered token"
    expected = probs[support] * N
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    df = int(support.sum()) - 1
    if df == 0:
        return
    assert chi2 < _CHI2_999[df], (chi2, df, counts, expected)


def test_blocked_draw_equals_plain_inverse_cdf():
    rng = np.random.default_rng(0)
    for n in [1, 3, 4096, 4097, 10_000, 250_000]:
        p = rng.random(n) ** 4 + 1e-12
        ids = np.arange(n)
        cs = np.cumsum(p)
        for u in rng.random(30):
            ref = min(int(np.searchsorted(cs, u * cs[-1], side="right")), n - 1)
            assert S._draw(ids, p, float(u)) == ref


def test_sample_from_probs_matches_sampler_draw():
    V = 3000
    rng = np.random.default_rng(8)
    logits = (rng.standard_normal(V) * 2).astype(np.float32)
    for cfg in [dict(temperature=0.8), dict(temperature=1.0, top_p=0.9), dict(temperature=1.0, top_k=50, min_p=0.1)]:
        params = SamplingParams(seed=99, **cfg)
        probs = probs_after_processing(logits, params)
        for step in range(5):
            a = RowState(params, rng=np.random.default_rng(step))
            tok = Sampler().sample(logits[None], [a])[0]
            assert tok == sample_from_probs(probs, np.random.default_rng(step))


# ----------------------------------------------------------------------------------------
# Seeds
# ----------------------------------------------------------------------------------------
def _run_seeded(position: int, batch_size: int, others_seed: int, steps: int = 25):
    V = 500
    lrng = np.random.default_rng(42)
    seq_logits = (lrng.standard_normal((steps, V)) * 2).astype(np.float32)
    orng = np.random.default_rng(others_seed)
    target = RowState(SamplingParams(temperature=0.9, top_p=0.95, top_k=100, seed=777))
    rows = []
    for i in range(batch_size):
        if i == position:
            rows.append(target)
        else:
            kind = i % 3
            p = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=int(orng.integers(1e6))),
                 SamplingParams(temperature=0.5, top_k=5)][kind]
            rows.append(RowState(p))
    sampler = Sampler()
    toks = []
    for s in range(steps):
        batch = (orng.standard_normal((batch_size, V)) * 2).astype(np.float32)
        batch[position] = seq_logits[s]
        toks.append(int(sampler.sample(batch, rows)[position]))
    return toks


def test_seed_reproducible_regardless_of_batch():
    ref = _run_seeded(0, 1, 0)
    assert _run_seeded(3, 7, 1) == ref
    assert _run_seeded(5, 6, 2) == ref
    assert _run_seeded(0, 4, 3) == ref
    assert len(set(ref)) > 3  # actually sampling


def test_different_seeds_differ_and_snapshot_restore():
    V = 1000
    logits = np.zeros((1, V), np.float32)
    a = RowState(SamplingParams(seed=1))
    b = RowState(SamplingParams(seed=2))
    sa = [int(Sampler().sample(logits, [a])[0]) for _ in range(10)]
    sb = [int(Sampler().sample(logits, [b])[0]) for _ in range(10)]
    assert sa != sb
    snap = a.snapshot()
    first = [int(Sampler().sample(logits, [a])[0]) for _ in range(5)]
    assert a.num_generated == 15
    a.restore(snap)
    assert a.num_generated == 10
    assert [int(Sampler().sample(logits, [a])[0]) for _ in range(5)] == first
    # negative seeds are accepted (OpenAI allows any integer)
    RowState(SamplingParams(seed=-5).validate())


# ----------------------------------------------------------------------------------------
# Logprobs
# ----------------------------------------------------------------------------------------
def test_logprobs_raw_and_top():
    V = 300
    rng = np.random.default_rng(1)
    logits = (rng.standard_normal((3, V)) * 3).astype(np.float32)
    logits[2, 10] = logits[2, 20] = logits[2].max() + 1  # tie at the top
    rows = [RowState(SamplingParams(temperature=0, logprobs=True, top_logprobs=5)),
            RowState(SamplingParams(temperature=0.7, top_k=10, seed=3, logprobs=True, top_logprobs=0)),
            RowState(SamplingParams(temperature=0, logprobs=True, top_logprobs=20))]
    # a 4th row that does not ask for logprobs gets None
    toks, lps = Sampler().sample(np.concatenate([logits, logits[:1]]),
                                 rows + [RowState(SamplingParams(temperature=0))], return_logprobs=True)
    assert lps[3] is None and toks[3] == toks[0]
    ref = torch.log_softmax(torch.from_numpy(logits).double(), dim=-1).numpy()
    for i in range(3):
        lp = lps[i]
        assert lp.token_id == toks[i]
        assert math.isclose(lp.logprob, ref[i, toks[i]], rel_tol=1e-6, abs_tol=1e-6)
        assert lp.rank == 1 + int((ref[i] > ref[i, toks[i]]).sum())
        n = rows[i].params.top_logprobs
        assert len(lp.top_ids) == n and lp.top_ids.dtype == np.int32
        if n:
            order = np.lexsort((np.arange(V), -ref[i]))[:n]
            assert lp.top_ids.tolist() == order.tolist()
            np.testing.assert_allclose(lp.top_logprobs, ref[i, order], rtol=1e-5)
    assert toks[2] == 10 and lps[2].top_ids[:2].tolist() == [10, 20]


def test_logprobs_processed_mode():
    V = 50
    logits = np.random.default_rng(2).standard_normal((1, V)).astype(np.float32)
    params = SamplingParams(temperature=0.5, logit_bias={7: 3.0}, seed=1, logprobs=True, top_logprobs=3)
    toks, lps = Sampler(logprobs_mode="processed").sample(logits, [RowState(params)], return_logprobs=True)
    x = logits[0].astype(np.float64)
    x[7] += 3.0
    ref = np.log(softmax(x / 0.5))
    assert math.isclose(lps[0].logprob, ref[toks[0]], rel_tol=1e-5)
    assert lps[0].top_ids[0] == int(np.argmax(ref))


# ----------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------
BAD = [
    ("temperature", dict(temperature=-0.1), "[0, 2]"),
    ("temperature", dict(temperature=2.5), "[0, 2]"),
    ("temperature", dict(temperature=float("nan")), "NaN"),
    ("temperature", dict(temperature="hot"), "number"),
    ("top_p", dict(top_p=0.0), "(0, 1]"),
    ("top_p", dict(top_p=1.01), "(0, 1]"),
    ("top_k", dict(top_k=-2), "-1 or 0"),
    ("top_k", dict(top_k=2.5), "integer"),
    ("min_p", dict(min_p=-0.01), "[0, 1]"),
    ("min_p", dict(min_p=1.5), "[0, 1]"),
    ("presence_penalty", dict(presence_penalty=2.5), "[-2, 2]"),
    ("frequency_penalty", dict(frequency_penalty=-3), "[-2, 2]"),
    ("repetition_penalty", dict(repetition_penalty=0), "must be in"),
    ("repetition_penalty", dict(repetition_penalty=-1.0), "must be in"),
    ("max_tokens", dict(max_tokens=0), "at least 1"),
    ("max_tokens", dict(max_tokens=1.5), "integer"),
    ("stop", dict(stop=[f"s{i}" for i in range(17)]), "at most 16"),
    ("stop", dict(stop=["ok", ""]), "empty"),
    ("stop", dict(stop=["ok", 3]), "string"),
    ("stop_token_ids", dict(stop_token_ids=[5, 1000]), "out of the vocabulary"),
    ("logit_bias", dict(logit_bias={1000: 1.0}), "out of the vocabulary"),
    ("logit_bias", dict(logit_bias={-1: 1.0}), "out of the vocabulary"),
    ("logit_bias", dict(logit_bias={"abc": 1.0}), "not an integer"),
    ("logit_bias", dict(logit_bias={5: 101.0}), "[-100, 100]"),
    ("logit_bias", dict(logit_bias={5: -150}), "[-100, 100]"),
    ("n", dict(n=2), "only n=1"),
    ("top_logprobs", dict(top_logprobs=21), "[0, 20]"),
    ("seed", dict(seed=1.5), "integer"),
]


@pytest.mark.parametrize("param,kwargs,fragment", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_validation_errors(param, kwargs, fragment):
    with pytest.raises(SamplingError) as ei:
        SamplingParams(**kwargs).validate(vocab_size=1000)
    assert ei.value.param == param
    assert fragment in ei.value.message
    assert str(ei.value).startswith(f"{param}: ")
    assert isinstance(ei.value, ValueError)


def test_validation_accepts_edges_and_normalises():
    p = SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=1.0, presence_penalty=-2, frequency_penalty=2,
                       repetition_penalty=0.01, max_tokens=1, stop="###", logit_bias={"12": -100, 3: 100},
                       stop_token_ids=(1, 2), top_logprobs=20).validate(vocab_size=100)
    assert p.stop == ["###"] and p.logit_bias == {12: -100.0, 3: 100.0} and p.stop_token_ids == [1, 2]
    assert p.greedy and p.effective_top_k == 0
    SamplingParams(temperature=2.0, stop=[f"s{i}" for i in range(16)]).validate()
    SamplingParams(logit_bias={10**6: 1.0}).validate()  # vocab unknown: only checks >= 0


# ----------------------------------------------------------------------------------------
# Presets and merging
# ----------------------------------------------------------------------------------------
def test_presets():
    t = get_preset("qwen3.5", thinking=True)
    assert t == dict(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=0.0)
    nt = get_preset("Qwen3_5", "non_thinking")
    assert nt == dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, presence_penalty=1.5)
    assert get_preset("unknown-family", True) == {}
    t["temperature"] = 5  # a copy
    assert PRESETS["qwen3.5"]["thinking"]["temperature"] == 1.0
    for fam in PRESETS.values():
        for mode in fam.values():
            SamplingParams(**mode).validate()


def test_merge_priority_and_none():
    p = resolve_sampling_params(request={"temperature": None, "top_p": 0.5, "seed": None},
                                overrides={"temperature": 0.3, "top_p": 0.9, "max_tokens": 100},
                                family="qwen3.5", thinking=False)
    assert p.temperature == 0.3  # override beats preset; request None = not given
    assert p.top_p == 0.5  # request beats override
    assert p.top_k == 20 and p.presence_penalty == 1.5  # preset
    assert p.max_tokens == 100 and p.seed is None
    p = resolve_sampling_params({"top_k": -1}, None, "qwen3.5")
    assert p.effective_top_k == 0
    with pytest.raises(SamplingError) as ei:
        merge_sampling_params({"temprature": 1.0})
    assert ei.value.param == "temprature"
    with pytest.raises(SamplingError) as ei:
        resolve_sampling_params({"top_p": 0}, family="qwen3.5")
    assert ei.value.param == "top_p"


# ----------------------------------------------------------------------------------------
# Batch API / efficiency smoke
# ----------------------------------------------------------------------------------------
def test_batch_shape_checks():
    with pytest.raises(ValueError):
        Sampler().sample(np.zeros((2, 5), np.float32), [RowState(SamplingParams())])
    with pytest.raises(ValueError):
        Sampler().sample(np.zeros(5, np.float32), [RowState(SamplingParams())])


def test_large_vocab_batch_is_fast():
    V, B = 248_320, 8
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal((B, V)) * 4).astype(np.float32)
    cfgs = [get_preset("qwen3.5", True), get_preset("qwen3.5", False), dict(temperature=0),
            dict(temperature=0.8, min_p=0.1), dict(temperature=1.0, top_p=0.9)]
    rows = [RowState(SamplingParams(seed=i, **cfgs[i % len(cfgs)]), prompt_token_ids=rng.integers(0, V, 4000))
            for i in range(B)]
    sampler = Sampler()
    sampler.sample(logits, rows)
    t0 = time.perf_counter()
    for _ in range(5):
        toks = sampler.sample(logits, rows)
    per_step = (time.perf_counter() - t0) / 5
    assert toks.shape == (B,) and (toks >= 0).all() and (toks < V).all()
    assert per_step < 0.25, per_step  # generous: ~10-30 ms on a laptop core


def test_numeric_extremes_are_greedy_or_refused():
    """Found by the server fuzz: a denormal temperature overflowed logits / t, a repetition penalty below float32's
    range became 0 and turned logits into NaN. Now a temperature below GREEDY_BELOW is greedy (as vLLM does) and a
    penalty outside [1e-6, 1e6] is refused naming the field."""
    from ninfer_mlc.runtime.sampling import GREEDY_BELOW, SamplingError, SamplingParams

    p = SamplingParams(temperature=1e-300).validate()
    assert p.temperature == 0 and p.greedy
    assert SamplingParams(temperature=GREEDY_BELOW).validate().temperature == GREEDY_BELOW
    for rp in (1e-300, 1e-7, 1e7):
        with pytest.raises(SamplingError) as e:
            SamplingParams(repetition_penalty=rp).validate()
        assert e.value.param == "repetition_penalty"
    SamplingParams(repetition_penalty=1e-6).validate()
