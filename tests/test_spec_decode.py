"""Speculative decoding (runtime/spec/) on the embedded tiny model, which has an MTP head.

* the MTP head's logits match a torch reference built from the same weights (transformers'
  Qwen3_5DecoderLayer for the layer, plain torch for fc / norms / lm_head), through the proposer's
  chunked prompt fill and chained drafts;
* greedy output with --spec mtp / --spec draft is token-for-token the output without speculation,
  batch 1 and batch > 1, with chunked prefill and under KV-pool preemption;
* sampled output has the target distribution: rejection sampling checked exactly on synthetic
  distributions, and end to end with a chi-square test on the first tokens over many seeds;
* acceptance rate / tokens per round are reported in engine stats and request timings.
"""
from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from ninfer_mlc.runtime.assemble import open_engine
from ninfer_mlc.paths import default_model_dir
from ninfer_mlc.contract import safetensors_io
from ninfer_mlc.contract.manifest import read_manifest
from ninfer_mlc.runtime.config import EngineConfig
from ninfer_mlc.runtime.errors import ConfigError
from ninfer_mlc.runtime.engine import GenRequest
from ninfer_mlc.runtime.harness import Harness
from ninfer_mlc.runtime.sampling import RowState, Sampler, SamplingParams
from ninfer_mlc.runtime.spec.acceptance import accept
from ninfer_mlc.runtime.spec.mtp import MTPProposer
from ninfer_mlc.runtime.tokenizer import load_tokenizer

ART = default_model_dir()
PROMPTS = ["The quick brown fox jumps over the lazy dog and then", "def main(self):\n    return x + y",
           "import os\nimport sys\nfrom json import loads", "Once upon a time there was a king who"]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(ART)


@pytest.fixture(scope="module")
def prompts(tok):
    return [tok.encode(p).ids for p in PROMPTS]


def generate(prompts, params_for, spec="none", k=3, concurrency=4, kv_tokens=None, art=ART, **opts):
    """Token ids of every request (logprobs on, so every token reaches the event stream), stats."""
    o = EngineConfig(max_concurrency=concurrency, max_pending_requests=len(prompts), max_context=1024, host_kv_mib=0,
                      spec=spec, draft_tokens=k, **opts)
    o.kv_capacity = kv_tokens
    eng = open_engine(art, o)
    try:
        hs = [eng.submit(GenRequest(p, params_for(i))) for i, p in enumerate(prompts)]
        outs, timings = [], []
        for h in hs:
            outs.append([t for ev in h.iter_sync(timeout=300) if hasattr(ev, "token_ids") for t in ev.token_ids])
            assert h.finished.reason == "length", h.finished
            timings.append(h.finished.timings)
        return outs, timings, eng.stats()
    finally:
        eng.stop()


def greedy(n):
    return lambda i: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=True)


# ---- compiler / artifact ------------------------------------------------------------------------
def test_manifest_records_mtp_head():
    m = read_manifest(ART)
    assert m.extras.get("mtp") is True
    names = [p[0] for p in m.params]
    for n in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
              "mtp.layers.0.self_attn.qkv_proj.weight", "mtp.layers.0.mlp.down_proj.weight", "mtp.norm.weight"):
        assert n in names


# ---- MTP parity against a torch reference ---------------------------------------------------------
def _torch_mtp_reference(params: dict, prompt_hidden, next_tokens, n_chain: int, draft_fn):
    """Reference MTP over rows (h_i, token_{i+1}) then n_chain chained rows (own hidden, own draft)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as M

    cfg = transformers.AutoConfig.from_pretrained(ART)
    cfg._attn_implementation = "eager"
    attn_index = cfg.layer_types.index("full_attention")
    layer = M.Qwen3_5DecoderLayer(cfg, layer_idx=attn_index).eval()
    prefix = "mtp.layers.0."
    folded = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
              "self_attn.k_norm.weight")
    sd = {k[len(prefix):]: torch.tensor(np.array(v)) - (1.0 if k.endswith(folded) else 0.0)
          for k, v in params.items() if k.startswith(prefix)}
    # the compiled model fuses projections that read the same input; split them back for transformers
    q_rows = cfg.num_attention_heads * cfg.head_dim * 2
    kv_rows = cfg.num_key_value_heads * cfg.head_dim
    q, k, v = torch.split(sd.pop("self_attn.qkv_proj.weight"), [q_rows, kv_rows, kv_rows])
    sd.update({"self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v})
    gate, up = torch.chunk(sd.pop("mlp.gate_up_proj.weight"), 2)
    sd.update({"mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up})
    layer.load_state_dict(sd, strict=True)
    rot = M.Qwen3_5TextRotaryEmbedding(cfg)
    T = lambda n: torch.tensor(np.array(params[n]))  # noqa: E731

    def norm(x, name):  # the artifact's norm weights already carry the +1
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * T(name)

    def run(hidden, toks):
        n = hidden.shape[0]
        x = torch.cat([norm(T("model.embed_tokens.weight")[torch.tensor(toks)], "mtp.pre_fc_norm_embedding.weight"),
                       norm(hidden, "mtp.pre_fc_norm_hidden.weight")], -1) @ T("mtp.fc.weight").T
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        with torch.no_grad():
            out = layer(x[None], position_embeddings=rot(x[None], pos), attention_mask=mask, position_ids=pos)
        out = norm((out[0] if isinstance(out, tuple) else out)[0], "mtp.norm.weight")
        return out, out @ T("lm_head.weight").T

    hidden, toks = torch.tensor(np.asarray(prompt_hidden)), list(next_tokens)
    logits_rows = []
    for j in range(n_chain + 1):
        out, logits = run(hidden, toks)
        logits_rows.append(logits[-1].numpy())
        if j < n_chain:  # chain: the head's own output hidden with its own draft, one position further
            hidden = torch.cat([hidden, out[-1:]])
            toks.append(draft_fn(logits_rows[-1]))
    return logits_rows


def test_mtp_head_matches_torch_reference(prompts):
    runner = Harness(ART, num_slots=4, kv_capacity_tokens=1024)
    params = {}
    for rel in runner.manifest.weight_shards:
        params.update(safetensors_io.load(ART / rel))
    ids = (prompts[0] * 6)[:70]
    seq = runner.new_seq()
    act = SimpleNamespace(req=SimpleNamespace(prompt_ids=ids), generated=[], seq=seq)
    act.all_tokens = lambda: list(ids) + act.generated
    act.tokens_between = lambda lo, hi: act.all_tokens()[lo:hi]
    prop = MTPProposer(runner)
    st = SimpleNamespace(mtp_pos=0, mtp_hidden=None, unfed=None)
    hidden = []
    for lo, hi in ((0, 33), (33, 70)):  # chunked prompt: the head's KV is filled chunk by chunk
        start = seq.length
        logits, (h,) = runner.prefill_h([(seq, ids[lo:hi])])
        prop.after_prefill([(act, st, start, h)])
        hidden.append(h)
    assert st.mtp_pos == 69 and len(st.mtp_hidden) == 1  # the last row waits for the sampled token
    pending = int(np.argmax(logits[0]))
    act.generated = [pending]
    got = []

    def choose(a, row, j):
        got.append(np.array(row))
        return int(np.argmax(row))

    (drafts,) = prop.propose([(act, st, 3)], choose)
    ref = _torch_mtp_reference(params, np.concatenate(hidden), ids[1:] + [pending], 2, lambda r: int(np.argmax(r)))
    assert len(got) == 3 and len(drafts) == 3
    for j in range(3):
        err = np.abs(got[j] - ref[j]).max() / np.abs(ref[j]).max()
        assert err < 1e-4, f"draft {j + 1}: rel err {err}"
    assert drafts == [int(np.argmax(r)) for r in ref]
    runner.free_seq(seq)


def test_verify_rows_match_decode(prompts):
    """verify (one multi-token forward) returns what token-by-token decode would, plus post-norm hidden."""
    runner = Harness(ART, num_slots=4, kv_capacity_tokens=1024)
    ids = prompts[1]
    feed = [5, 77, 300, 9]
    a, b = runner.new_seq(), runner.new_seq()
    runner.prefill([(a, ids)])
    step = np.stack([runner.decode([a], [t])[0] for t in feed])
    _, (h,) = runner.prefill_h([(b, ids)])
    (vl,), (vh,) = runner.verify([(b, feed)])
    assert vl.shape == (4, runner.vocab_size) and vh.shape == (4, runner.cfg["hidden_size"])
    assert np.abs(vl - step).max() < 1e-4 * np.abs(step).max()
    head = safetensors_io.load(ART / runner.manifest.weight_shards[0])["lm_head.weight"]
    assert np.abs(vh @ np.asarray(head).T - vl).max() < 1e-4 * np.abs(vl).max()  # post-norm: lm_head(h) = logits
    runner.free_seq(a)
    runner.free_seq(b)


# ---- greedy: token-for-token identical ------------------------------------------------------------
@pytest.fixture(scope="module")
def baseline(prompts):
    return generate(prompts, greedy(40))[0]


@pytest.mark.parametrize("case", [
    dict(spec="mtp", k=3, concurrency=4),
    dict(spec="mtp", k=1, concurrency=1, prefill_chunk=16),
    dict(spec="mtp", k=5, concurrency=4, prefill_chunk=16, kv_tokens=3 * 64),  # preemption under KV pressure
    dict(spec="mtp", k=2, concurrency=2, lm_head_draft="600"),
    dict(spec="draft", k=3, concurrency=4, draft_model=str(ART)),
], ids=["mtp-k3-b4", "mtp-k1-b1-chunked", "mtp-k5-b4-preempt", "mtp-shortlist", "draft-self-k3"])
def test_greedy_identical(prompts, baseline, case):
    outs, timings, stats = generate(prompts, greedy(40), **case)
    assert outs == baseline
    k = case["k"]
    sp = stats.spec
    assert sp.backend == case["spec"]
    assert sp.draft_tokens > 0 and sp.rounds > 0
    assert 0 < sp.acceptance_rate <= 1
    assert 1 <= sp.tokens_per_round <= k + 1
    assert sp.emitted_tokens + len(prompts) == sum(len(o) for o in outs)  # + the first tokens
    assert sum(t["draft_n"] for t in timings) == sp.draft_tokens
    assert sum(t["draft_n_accepted"] for t in timings) == sp.accepted_tokens
    assert sp.device_rounds == sp.rounds  # greedy rounds accept on the device (tests/test_spec_device.py)
    assert sp.recompute_tokens == 0 and sp.state_replays == sp.rollbacks  # rollback by replay (test_spec_rollback.py)
    if case.get("kv_tokens"):
        assert stats.counters.preemptions > 0
    if case["spec"] == "draft":  # the model drafting for itself: every greedy draft is accepted
        assert sp.acceptance_rate > 0.95 and sp.tokens_per_round > 3
    print(case, sp)


# ---- sampling: the target distribution ------------------------------------------------------------
def _chi2_sf(x: float, df: int) -> float:
    """P(chi2_df > x): regularised upper incomplete gamma Q(df/2, x/2) (series / continued fraction)."""
    a, x = df / 2.0, x / 2.0
    if x <= 0:
        return 1.0
    lg = a * math.log(x) - x - math.lgamma(a)
    if x < a + 1:
        s = term = 1.0 / a
        n = a
        while abs(term) > 1e-15 * abs(s):
            n += 1
            term *= x / n
            s += term
        return max(0.0, 1.0 - s * math.exp(lg))
    b, c, d = x + 1 - a, 1e300, 1 / (x + 1 - a)
    h = d
    for i in range(1, 500):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = 1 / (d if abs(d) > 1e-300 else 1e-300)
        c = b + an / c
        c = c if abs(c) > 1e-300 else 1e-300
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(lg) * h


def _homogeneity_p(a: list, b: list, min_expected: float = 5.0) -> float:
    """Two-sample chi-square test of homogeneity; rare categories are pooled."""
    ca, cb = Counter(a), Counter(b)
    n_a, n_b = len(a), len(b)
    keys = sorted(set(ca) | set(cb), key=lambda k: -(ca[k] + cb[k]))
    cols, other = [], [0, 0]
    for k in keys:
        if (ca[k] + cb[k]) * min(n_a, n_b) / (n_a + n_b) >= min_expected:
            cols.append([ca[k], cb[k]])
        else:
            other[0] += ca[k]
            other[1] += cb[k]
    if sum(other):
        cols.append(other)
    tab = np.array(cols, float).T
    if tab.shape[1] < 2:
        return 1.0
    exp = tab.sum(1, keepdims=True) * tab.sum(0, keepdims=True) / tab.sum()
    return _chi2_sf(float(((tab - exp) ** 2 / exp).sum()), tab.shape[1] - 1)


def test_chi2_helper():
    assert abs(_chi2_sf(3.841458820694124, 1) - 0.05) < 1e-6
    assert abs(_chi2_sf(18.307038053275146, 10) - 0.05) < 1e-6
    assert abs(_chi2_sf(124.34211340400407, 100) - 0.05) < 1e-6


def _accept_trials(p, q, trials, broken=False):
    """First emitted token of one speculative step with a single draft from q, target p."""
    sampler = Sampler()
    params = SamplingParams(temperature=1.0)
    lp = np.log(p).astype(np.float32)
    out = []
    for s in range(trials):
        row = RowState(params, rng=np.random.default_rng(s))
        d = int(row.rng.choice(len(q), p=q))
        if broken:  # what a "trust the draft" implementation would emit
            out.append(d)
            continue
        toks, n = accept(row, np.stack([lp, lp]), [d], [q], sampler)
        out.append(toks[0])
    return out


def test_rejection_sampling_is_exact():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(6))
    q = rng.dirichlet(np.ones(6))
    n = 6000
    got = Counter(_accept_trials(p, q, n))
    obs = np.array([got[i] for i in range(6)], float)
    chi = float(((obs - n * p) ** 2 / (n * p)).sum())
    assert _chi2_sf(chi, 5) > 1e-3, (obs / n, p)
    bad = Counter(_accept_trials(p, q, n, broken=True))
    obs = np.array([bad[i] for i in range(6)], float)
    assert _chi2_sf(float(((obs - n * p) ** 2 / (n * p)).sum()), 5) < 1e-6  # the test has the power to see it


@pytest.mark.parametrize("spec", ["mtp", "draft"])
def test_sampled_distribution_unchanged(tok, spec):
    """Joint distribution of the first three sampled tokens (top-k 3, temperature 1) with and without
    speculation: independent seeds, chi-square homogeneity test."""
    prompt = tok.encode("the big dog").ids
    n = 240

    def params(offset):
        return lambda i: SamplingParams(temperature=1.0, top_k=3, seed=offset + i, max_tokens=3, ignore_eos=True,
                                        logprobs=True)

    extra = {"draft_model": str(ART)} if spec == "draft" else {}
    base, _, _ = generate([prompt] * n, params(0), concurrency=8, prefix_reuse=False)
    spec_out, _, stats = generate([prompt] * n, params(10_000), spec=spec, k=2, concurrency=8, prefix_reuse=False,
                                  **extra)
    assert all(len(o) == 3 for o in base + spec_out)
    assert stats.spec.draft_tokens > 0
    for what, key in (("joint", lambda o: tuple(o)), ("token 2", lambda o: o[1]), ("token 3", lambda o: o[2])):
        pval = _homogeneity_p([key(o) for o in base], [key(o) for o in spec_out])
        assert pval > 1e-3, f"{spec}: {what} distribution differs (p={pval:.2g})"
    print(spec, stats.spec)


# ---- options -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,field,msg", [
    (dict(spec="eagle"), "spec", "must be one of"),
    (dict(spec="mtp", draft_tokens=0), "draft_tokens", "1..5"),
    (dict(spec="mtp", draft_tokens=6), "draft_tokens", "1..5"),
    (dict(spec="draft"), "draft_model", "spec draft needs"),
    (dict(spec="draft", draft_model="/nonexistent"), "draft_model", "not a compiled model"),
    (dict(spec="mtp", draft_model=str(ART)), "draft_model", "only used with spec draft"),
    (dict(spec="draft", draft_model=str(ART), lm_head_draft="100"), "lm_head_draft", "only used with spec mtp"),
    (dict(spec="mtp", lm_head_draft="0"), "lm_head_draft", "positive token count"),
])
def test_options_validation(kw, field, msg):
    with pytest.raises(ConfigError, match=msg) as e:
        EngineConfig(**kw).validate()
    assert e.value.field == field


def test_mtp_without_head_is_a_clear_error():
    with pytest.raises(ValueError, match="no MTP head"):
        MTPProposer(SimpleNamespace(has_mtp=False, art_dir=Path("some-model")))


def test_device_slots_cover_snapshots():
    assert EngineConfig(max_concurrency=3, spec="mtp").device_slots == EngineConfig(max_concurrency=3).device_slots + 3
