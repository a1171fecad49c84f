"""Speculative rollback without a re-feed (compile/model.py gdn_replay, runtime/spec/decoder.py settle) on the
embedded tiny model:

* a verify's kept GDN projections replayed over its accepted prefix from the pre-verify state give exactly
  (bit for bit, llvm) the conv and recurrent state a verify of only those tokens reaches, for several
  sequences of one verify in one replay call, and the state a plain decode over them reaches (to rounding);
* through the engine, a rejected round re-feeds nothing (no recomputed rows, every round drafts) and greedy
  output stays identical to decoding without speculation; the library without replay falls back to re-feeding.
"""
from __future__ import annotations

import numpy as np
import pytest

from ninfer_mlc.paths import default_model_dir
from ninfer_mlc.runtime.assemble import open_engine
from ninfer_mlc.runtime.config import EngineConfig
from ninfer_mlc.runtime.engine import GenRequest
from ninfer_mlc.runtime.harness import Harness
from ninfer_mlc.runtime.sampling import SamplingParams
from ninfer_mlc.runtime.tokenizer import load_tokenizer

ART = default_model_dir()


@pytest.fixture(scope="module")
def prompts():
    tok = load_tokenizer(ART)
    return [tok.encode(p).ids for p in ("def main(self):\n    return x + y", "Once upon a time there was a king")]


def _state(h: Harness, seq):
    return h.read_state(seq.slot)


def test_replay_equals_verify_of_the_accepted_prefix(prompts):
    h = Harness(ART, num_slots=8, kv_capacity_tokens=1024)
    assert h.has_gdn_replay
    feeds = [[5, 77, 300, 9], [41, 8, 1200, 66, 3]]  # pending token + drafts of two rows
    keep = [2, 3]  # rows of each the round keeps (pending + accepted drafts)
    spec, ref, dec = ([h.new_seq() for _ in feeds] for _ in range(3))
    for group in (spec, ref, dec):
        h.prefill([(s, p) for s, p in zip(group, prompts)])
    snaps = [(h.kv.snapshot_state(s), s.length) for s in spec]
    h.verify(list(zip(spec, feeds)))  # one verify of both rows
    rows = h.verify_gdn_rows
    assert rows is not None and int(rows[0].shape[1]) == sum(map(len, feeds))
    firsts = [0, len(feeds[0])]
    for s, (slot, length), n in zip(spec, snaps, keep):
        h.kv.restore_snapshot(s, slot, length + n)
    h.replay_gdn(rows, [(s, f, n) for s, f, n in zip(spec, firsts, keep)])  # one call for both
    h.verify([(s, f[:n]) for s, f, n in zip(ref, feeds, keep)])
    for s, r, d, f, n in zip(spec, ref, dec, feeds, keep):
        (cs, ss), (cr, sr) = _state(h, s), _state(h, r)
        assert s.length == r.length
        assert np.array_equal(cs, cr) and np.array_equal(ss, sr)  # bit-exact: the verify's own arithmetic
        for t in f[:n]:
            h.decode([d], [t])
        cd, sd = _state(h, d)
        for x, y in ((cs, cd), (ss, sd)):  # chunked vs recurrent delta rule: rounding apart
            assert np.abs(x - y).max() < 1e-4 * max(1.0, float(np.abs(y).max()))
    # the replayed state continues like the reference: the next verify gives the same logits
    (la,), _ = h.verify([(spec[0], [12, 13])])
    (lb,), _ = h.verify([(ref[0], [12, 13])])
    assert np.array_equal(la, lb)
    with pytest.raises(ValueError, match="outside"):
        h.replay_gdn(h.verify_gdn_rows, [(spec[0], 1, 5)])


def _generate(prompts, **opts):
    o = EngineConfig(max_concurrency=2, max_pending_requests=len(prompts), max_context=1024, host_kv_mib=0,
                     draft_tokens=3, **{"spec": "mtp", **opts})
    eng = open_engine(ART, o)
    try:
        hs = [eng.submit(GenRequest(p, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)))
              for p in prompts]
        outs = [[t for ev in hd.iter_sync(timeout=300) if hasattr(ev, "token_ids") for t in ev.token_ids] for hd in hs]
        return outs, eng.stats()
    finally:
        eng.stop()


def test_rejected_rounds_do_not_refeed(prompts, request):
    base, _ = _generate(prompts, spec="none")
    outs, st = _generate(prompts)
    forced, fst = _generate(prompts, forced_acceptance=2.5)  # a benchmark profile: rejections every other round
    assert outs == base
    for sp in (st.spec, fst.spec):
        assert sp.rollbacks > 0 and sp.state_replays == sp.rollbacks
        assert sp.recompute_tokens == 0  # nothing re-fed: every verified row is a pending token or a draft
        assert sp.verify_tokens == sp.row_rounds + sp.draft_tokens
    request.getfixturevalue("without_gdn_replay")
    old, ost = _generate(prompts)
    assert old == base and ost.spec.state_replays == 0 and ost.spec.recompute_tokens > 0
    _, oft = _generate(prompts, forced_acceptance=2.5)
    assert oft.spec.no_draft_rounds > fst.spec.no_draft_rounds  # rounds that only re-feed
    assert oft.spec.tokens_per_round < fst.spec.tokens_per_round


def test_state_of_an_ending_row_is_replayed_before_it_is_cached(prompts):
    """A request that ends on a stop token inside a round (its state rolls back) while a later row of that round
    has not settled: its replay runs before the KV manager keeps its state in the prefix cache, so a follow-up
    turn reusing that state decodes as without speculation."""
    def turns(spec, stop=None):
        o = EngineConfig(max_concurrency=2, max_pending_requests=2, max_context=1024, host_kv_mib=0, spec=spec,
                         draft_tokens=3)
        eng = open_engine(ART, o)

        def run(ids, stops=()):
            return eng.submit(GenRequest(ids, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True,
                                                             stop_token_ids=list(stops))))

        def read(hd):
            return [t for ev in hd.iter_sync(timeout=300) if hasattr(ev, "token_ids") for t in ev.token_ids]
        try:
            first, other = run(prompts[0], [stop] if stop is not None else []), run(prompts[1])
            a = read(first)
            read(other)
            if stop is None:
                return a
            follow = read(run(prompts[0] + a + [5, 6, 7]))
            return a, follow, eng.stats()
        finally:
            eng.stop()

    plain = turns("none")
    stop = next(t for i, t in enumerate(plain) if i >= 6 and t not in plain[:i])  # ends the first request early
    base_a, base_follow, _ = turns("none", stop)
    a, follow, st = turns("mtp", stop)
    assert len(a) < 30 and st.cache["reused_prompt_tokens"] > 0 and st.spec.state_replays > 0
    assert (a, follow) == (base_a, base_follow)
