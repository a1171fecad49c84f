"""Speculative rounds on the device (runtime/spec/device_round.py) on the embedded tiny model (CPU library,
the same compiled `sample` function CUDA runs):

* the device argmax equals the host argmax of the cut logits (ids past the tokenizer's vocabulary masked),
  and its logprobs equal the host's;
* greedy acceptance over device argmax ids keeps exactly what accept() keeps over host logits;
* the MTP chain on the device proposes the drafts the host chain proposes, with the full head and with a
  shortlisted one (--lm-head-draft, executor/draft_head.py);
* through the engine: greedy MTP output is identical with device rounds on and off, forced-acceptance rounds
  emit the same tokens on both paths, and the per-phase round timings reach stats;
* with rollback by re-feed (libraries without gdn_replay), a larger re-feed bound (spec_refeed_max) keeps rows
  drafting after rejections and stays lossless.
The lossless comparison against no speculation (device rounds on by default) is tests/test_spec_decode.py.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from ninfer_mlc.paths import default_model_dir
from ninfer_mlc.runtime.assemble import open_engine
from ninfer_mlc.runtime.config import EngineConfig
from ninfer_mlc.runtime.engine import GenRequest
from ninfer_mlc.runtime.harness import Harness
from ninfer_mlc.runtime.sampling import RowState, Sampler, SamplingParams, log_softmax_top
from ninfer_mlc.runtime.spec.acceptance import accept, accept_argmax
from ninfer_mlc.runtime.spec.device_round import DeviceArgmax, greedy_plain
from ninfer_mlc.runtime.spec.mtp import MTPProposer
from ninfer_mlc.runtime.stats import PHASES
from ninfer_mlc.runtime.tokenizer import load_tokenizer

ART = default_model_dir()


@pytest.fixture(scope="module")
def runner():
    return Harness(ART, num_slots=4, kv_capacity_tokens=1024)


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer(ART)
    return [tok.encode(p).ids for p in ("def main(self):\n    return x + y", "Once upon a time there was a king")]


def _row(**kw) -> RowState:
    return RowState(SamplingParams(temperature=0, **kw))


def test_device_argmax_matches_host(runner):
    rng = np.random.default_rng(1)
    V = runner.vocab_size
    logits = rng.standard_normal((5, V)).astype(np.float32)
    logits[1, 7] = logits[1, 9] = 50.0  # a tie: the lowest id wins, as np.argmax
    am = DeviceArgmax(runner)
    dev = runner.tvm.runtime.tensor(logits, runner.dev)
    out = am.run(dev, [False, True, False, True, True])
    assert out[0].numpy().tolist() == np.argmax(logits, 1).tolist()
    lps = DeviceArgmax.logprobs_of(DeviceArgmax.read_logprobs(out), [1, 3], [3, 0])
    for lp, r, n_top in zip(lps, [1, 3], [3, 0]):
        ref = log_softmax_top(logits[r], int(np.argmax(logits[r])), n_top)
        assert lp.token_id == ref.token_id and lp.rank == ref.rank == 1
        assert abs(lp.logprob - ref.logprob) < 1e-4
        assert lp.top_ids.tolist() == ref.top_ids.tolist()
    # ids the tokenizer cannot produce are never chosen (the host path cuts the logits there)
    keep = runner.sample_vocab
    try:
        runner.sample_vocab = V - 37
        logits[2, V - 5] = 99.0
        out = am.run(runner.tvm.runtime.tensor(logits, runner.dev))
        assert out[0].numpy().tolist() == np.argmax(logits[:, : V - 37], 1).tolist()
    finally:
        runner.sample_vocab = keep


@pytest.mark.parametrize("agree", [0, 1, 2, 3])
def test_accept_argmax_matches_accept(agree):
    rng = np.random.default_rng(agree)
    logits = rng.standard_normal((4, 300)).astype(np.float32)
    target = np.argmax(logits, 1)
    drafts = [int(t) for t in target[:3]]
    if agree < 3:
        drafts[agree] = (drafts[agree] + 1) % 300
    a, b = _row(), _row()
    ref = accept(a, logits, drafts, [None] * 3, Sampler())
    assert accept_argmax(b, target, drafts) == ref
    assert list(a.output_token_ids) == list(b.output_token_ids)


def test_greedy_plain():
    assert greedy_plain(_row())
    assert not greedy_plain(_row(), grammar=object())
    assert not greedy_plain(_row(logit_bias={3: 1.0}))
    assert not greedy_plain(_row(frequency_penalty=0.5))  # no counts yet, but the round's own tokens add some
    assert not greedy_plain(RowState(SamplingParams(temperature=0.7)))


def _host_and_device_chains(runner, prop: MTPProposer, ids: list[int], k: int = 4) -> tuple[list, list]:
    """The same prompt prefilled twice: k drafts of a chain on the host and of one on the device."""
    seqs, states, acts = [], [], []
    for _ in range(2):
        seq = runner.new_seq()
        act = SimpleNamespace(req=SimpleNamespace(prompt_ids=ids), generated=[], seq=seq)
        act.all_tokens = lambda a=act: list(ids) + a.generated
        act.tokens_between = lambda lo, hi, a=act: a.all_tokens()[lo:hi]
        st = SimpleNamespace(mtp_pos=0, mtp_hidden=None, unfed=None)
        logits, (h,) = runner.prefill_h([(seq, ids)])
        prop.after_prefill([(act, st, 0, h)])
        act.generated = [int(np.argmax(logits[0]))]
        seqs.append(seq)
        states.append(st)
        acts.append(act)
    (host,) = prop.propose([(acts[0], states[0], k)], lambda a, row, j: int(np.argmax(row)))
    rows = prop.launch_device(prop.stage_device([(acts[1], states[1], k)]), DeviceArgmax(runner))
    assert states[1].mtp_pos == states[0].mtp_pos and states[1].mtp_hidden is None
    for s in seqs:
        runner.free_seq(s)
    return host, rows.numpy()[:, 0].tolist()


def test_mtp_chain_on_device_matches_host(runner, prompts):
    host, dev = _host_and_device_chains(runner, MTPProposer(runner), prompts[0] * 3)
    assert len(host) == 4 and dev == host


def test_shortlisted_chain_on_device_matches_host(runner, prompts):
    """The shortlisted head drafts on the device (mtp_step_hd over the head's rows, -inf elsewhere) exactly what the
    host chain (mtp_step_sl) drafts: over a shortlist without the full head's drafts, so the head really decides."""
    ids = prompts[0] * 3
    full, _ = _host_and_device_chains(runner, MTPProposer(runner), ids)
    V = runner.sample_vocab
    shortlist = np.array([i for i in range(V) if i not in full and i % 3 != 1], np.int32)
    prop = MTPProposer(runner, shortlist)
    assert prop.device_head and runner.draft_head is not None and runner.draft_head.rows == len(shortlist)
    assert runner.draft_head.weight.shape == (len(shortlist), runner.cfg["hidden_size"])
    host, dev = _host_and_device_chains(runner, prop, ids)
    assert dev == host and set(host) <= set(shortlist.tolist()) and not set(host) & set(full)
    # the head's weight is the lm_head's rows (tied embedding here), gathered on the device
    w = runner.param("lm_head.weight") if "lm_head.weight" in [n for n, _, _ in runner.manifest.params] \
        else runner.param("model.embed_tokens.weight")
    np.testing.assert_array_equal(runner.draft_head.weight.numpy(), w.numpy()[shortlist])


def _generate(prompts, params=None, logprobs=None, spec="mtp", **opts):
    """Token ids per request and the engine stats (params: SamplingParams per request, default greedy; logprobs:
    a list that receives each request's TokenLogprobs)."""
    cfg = EngineConfig(max_concurrency=2, max_pending_requests=len(prompts), max_context=512, host_kv_mib=0,
                       spec=spec, draft_tokens=3, **opts)
    eng = open_engine(ART, cfg)
    params = params or [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(prompts)
    try:
        hs = [eng.submit(GenRequest(p, sp)) for p, sp in zip(prompts, params)]
        outs = []
        for h in hs:
            evs = [ev for ev in h.iter_sync(timeout=300) if hasattr(ev, "token_ids")]
            outs.append([t for ev in evs for t in ev.token_ids])
            if logprobs is not None:
                logprobs.append([lp for ev in evs for lp in ev.logprobs])
        return outs, eng.stats()
    finally:
        eng.stop()


def test_device_logprobs_match_host(prompts):
    params = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=3)] * 2
    dev_lp, host_lp = [], []
    dev, st = _generate(prompts, params, dev_lp)
    host, _ = _generate(prompts, params, host_lp, device_sampling="off")
    assert dev == host and st.spec.device_rounds == st.spec.rounds > 0
    for a_req, b_req in zip(dev_lp, host_lp):
        assert len(a_req) == len(b_req) == 12
        for a, b in zip(a_req, b_req):
            assert a.token_id == b.token_id and a.rank == b.rank and a.top_ids.tolist() == b.top_ids.tolist()
            assert abs(a.logprob - b.logprob) < 1e-4 and np.abs(a.top_logprobs - b.top_logprobs).max() < 1e-4


def test_mixed_batch_rounds_stay_on_the_host(prompts):
    """A sampled row in the batch keeps the round on the host; the greedy row is still lossless."""
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=16, ignore_eos=True)]
    base, _ = _generate(prompts[:1], params[:1], spec="none")
    mixed, st = _generate(prompts, params)
    assert mixed[0] == base[0]
    assert st.spec.device_rounds < st.spec.rounds


@pytest.mark.parametrize("forced", [None, 3.18])
def test_device_rounds_match_host_rounds(prompts, forced):
    dev, st_dev = _generate(prompts, forced_acceptance=forced)
    host, st_host = _generate(prompts, forced_acceptance=forced, device_sampling="off")
    assert dev == host
    sp = st_dev.spec
    assert sp.device_rounds == sp.rounds > 0 and st_host.spec.device_rounds == 0
    assert sp.device_drafts > 0 and st_host.spec.device_drafts == 0  # the MTP chain ran on the device
    if forced is not None:  # forced rows keep drafts whatever the target says: same counts on both paths
        assert sp.accepted_tokens == st_host.spec.accepted_tokens
    phases = st_dev.to_dict()["spec"]["phase_ms_per_round"]
    assert set(phases) == set(PHASES) | {"glue", "total", "gap"}
    assert all(phases[p] >= 0 for p in PHASES) and phases["verify"] + phases["accept"] > 0
    assert phases["total"] >= phases["verify"] + phases["accept"]
    assert sp.gaps > 0 and 0 < phases["gap"] < phases["total"]  # back-to-back device rounds: the host's part


def test_refeed_bound(prompts, without_gdn_replay):
    """Rollback by re-feed (libraries without gdn_replay): a larger re-feed bound keeps rows drafting after
    rejections (forced 3.18: every round drafts) and stays lossless."""
    base, _ = _generate(prompts)
    wide, st = _generate(prompts, spec_refeed_max=12)
    assert wide == base
    _, narrow = _generate(prompts, forced_acceptance=3.18)
    _, widef = _generate(prompts, forced_acceptance=3.18, spec_refeed_max=12)
    assert narrow.spec.no_draft_rounds > 0 and widef.spec.no_draft_rounds < narrow.spec.no_draft_rounds
    assert widef.spec.tokens_per_round > narrow.spec.tokens_per_round


@pytest.fixture
def without_head_draft(monkeypatch):
    """Engines opened while it is active behave as with a library built before the shortlisted head's device
    functions (mtp_head_build / mtp_step_hd / mtp_prefill_hd)."""
    from ninfer_mlc.runtime.executor.model_runner import ModelRunner

    init = ModelRunner.__init__

    def __init__(self, *a, **kw):
        init(self, *a, **kw)
        self.has_head_draft = False

    monkeypatch.setattr(ModelRunner, "__init__", __init__)


@pytest.mark.parametrize("head", ["600", "file"])
def test_shortlisted_head_in_device_rounds(prompts, tmp_path, head):
    """--lm-head-draft N or FILE: greedy rounds draft over the shortlisted head on the device (device_drafts), the
    same drafts as host rounds (same draft and accepted counts) and the same output as no speculation."""
    if head == "file":
        path = tmp_path / "ids.txt"
        path.write_text(" ".join(str(i) for i in range(0, 1900, 2)))  # even ids, whitespace separated
        head = str(path)
    base, _ = _generate(prompts, spec="none")
    dev, st = _generate(prompts, lm_head_draft=head)
    host, st_host = _generate(prompts, lm_head_draft=head, device_sampling="off")
    assert dev == host == base
    sp, hp = st.spec, st_host.spec
    assert sp.device_rounds == sp.rounds > 0 and sp.device_drafts > 0 and hp.device_drafts == 0
    assert (sp.draft_tokens, sp.accepted_tokens) == (hp.draft_tokens, hp.accepted_tokens)


def test_shortlisted_head_with_an_older_library(prompts, without_head_draft):
    """A library without the head's device functions drafts with the shortlist in host rounds (acceptance still on
    the device), losslessly."""
    base, _ = _generate(prompts, spec="none")
    out, st = _generate(prompts, lm_head_draft="600")
    assert out == base
    assert st.spec.device_rounds == st.spec.rounds > 0 and st.spec.device_drafts == 0 and st.spec.draft_tokens > 0
