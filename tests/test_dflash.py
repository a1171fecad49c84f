"""DFlash / DFlash2 drafters (compile/dflash, runtime/spec/dflash.py) on the embedded tiny model.

* the target's tap outputs (prefill_t) are transformers' hidden_states[id + 1];
* the compiled drafter's logits match the PyPI `dflash` package's PyTorch model on the same weights
  (< 1e-4 relative, f32), with the context written in chunks, rings narrower than the context, and a
  second block after more context; DFlash2's candidate path matches the reference's greedy path;
* (engine) greedy output is token-for-token the output without speculation (batch 1 and > 1, chunked
  prefill, preemption, host-tier restore), sampled output keeps its distribution (chi-square), and
  acceptance / tokens per round reach /stats, timings and the request log.
"""
from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

torch = pytest.importorskip("torch")
pytest.importorskip("dflash")

from dflash_tiny import DRAFTERS, MASK_ID, TAPS, build  # noqa: E402

from ninfer_mlc.runtime.harness import Harness  # noqa: E402
from ninfer_mlc.runtime.spec.dflash_runner import DrafterRunner  # noqa: E402


@pytest.fixture(scope="session")
def arts(tmp_path_factory):
    return build(tmp_path_factory.mktemp("dflash"))


@pytest.fixture(scope="session")
def hf_target(arts):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(arts["hf"], dtype=torch.float32).eval()


def rel_err(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())


def _ids(n: int, seed: int = 0) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(5, 1900, n)]


def _reference_block(model, hf_target, ids: list[int], start: int):
    """The reference's block at `start` (context ids[:start], anchor ids[start]): drafter logits of the
    B - 1 mask rows and, for DFlash2, the greedy candidate path."""
    from dflash.model import extract_context_feature

    B = model.block_size
    with torch.no_grad():
        out = hf_target(torch.tensor([ids[:start]]), output_hidden_states=True)
        ctx = extract_context_feature(out.hidden_states, model.target_layer_ids)
        block = torch.tensor([[ids[start]] + [MASK_ID] * (B - 1)])
        scale = float(model.config.dflash_config.get("input_embedding_scale", 1.0))
        noise = torch.nn.functional.embedding(block, hf_target.get_input_embeddings().weight) * scale
        from transformers import DynamicCache

        hidden = model(target_hidden=ctx, noise_embedding=noise, position_ids=torch.arange(start + B)[None],
                       past_key_values=DynamicCache(config=model.config), use_cache=True)[:, 1 - B:, :]
        logits = model.compute_logits(hidden, hf_target.lm_head)[0].numpy()
        path = None
        if hasattr(model, "propose"):
            path = model.propose(hidden, block[:, 0], hf_target.lm_head, 0.0)[0][0].tolist()
    return logits, path, out


def test_taps_are_transformers_hidden_states(arts, hf_target):
    h = Harness(arts["target"], num_slots=2, kv_capacity_tokens=256)
    assert h.runner.has_taps and h.runner.tap_layers == TAPS
    ids = _ids(70)
    seq = h.new_seq()
    _, (t1,) = h.prefill_h([(seq, ids[:40])], taps=True)
    _, (t2,) = h.prefill_h([(seq, ids[40:])], taps=True)
    with torch.no_grad():
        hs = hf_target(torch.tensor([ids]), output_hidden_states=True).hidden_states
    ref = torch.cat([hs[i + 1] for i in TAPS], -1)[0].numpy()
    got = np.concatenate([t1.numpy(), t2.numpy()])
    assert got.shape == (70, len(TAPS) * 128)
    assert rel_err(got, ref) < 1e-4


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_drafter_matches_reference(arts, hf_target, kind):
    """Context written in chunks longer than the ring and shorter ones, two blocks; every mask row's
    logits against the reference, which recomputes the block from the whole context."""
    art, model = arts[kind]
    B = DRAFTERS[kind]["block"]
    h = Harness(arts["target"], num_slots=2, kv_capacity_tokens=256)
    dr = DrafterRunner(art, h.runner, lanes=2, max_batch=2)
    assert dr.cfg.ring_size == DRAFTERS[kind]["window"] + B
    ids = _ids(80, seed=1)
    seq = h.new_seq()
    lane = 1
    for lo, hi, start in ((0, 40, None), (40, 47, 47), (47, 61, 61)):
        _, (taps,) = h.prefill_h([(seq, ids[lo:hi])], taps=True)
        dr.ctx([(seq, lane, lo, [taps])])
        if start is None:
            continue
        h.reserve(seq, start + B - seq.length)
        logits, sel = dr.draft([(seq, lane, start, ids[start], 0, B - 1)])
        ref, path, _ = _reference_block(model, hf_target, ids, start)
        assert logits.shape == (B - 1, 2048)
        err = rel_err(logits, ref)
        assert err < 1e-4, f"{kind} block at {start}: rel err {err}"
        if kind == "dflash2":
            from ninfer_mlc.runtime.spec.selector import CandidateSelector

            sel_path = CandidateSelector(*dr.codebooks(), model.candidate_selector.top_k).walk(
                logits, sel, ids[start], lambda j, row: int(np.argmax(row)))
            assert sel_path == path
        print(kind, start, err)


def test_select_walk_is_the_host_walk(arts):
    """The drafter's select_walk (DFlash2's greedy walk on the device) picks what CandidateSelector.walk_greedy
    picks: blocks of k rows, candidates tied in value at the top-k boundary (lowest id first), empty slots."""
    from ninfer_mlc.contract.sampler_abi import top_logprob_slots
    from ninfer_mlc.runtime.spec.selector import CandidateSelector

    art, _ = arts["dflash2"]
    h = Harness(arts["target"], num_slots=2, kv_capacity_tokens=256)
    dr = DrafterRunner(art, h.runner, lanes=2, max_batch=3)
    assert dr.has_walk
    cfg = DRAFTERS["dflash2"]["extra"]
    sel = CandidateSelector(*dr.codebooks(), cfg["selector_top_k"])
    b, k, S, V = 3, 5, top_logprob_slots(2048), 2048
    rng = np.random.default_rng(3)
    ids = np.stack([rng.choice(V, S, replace=False) for _ in range(b * k)]).astype(np.int32)
    vals = rng.normal(size=(b * k, S)).astype(np.float32)
    order = np.argsort(-vals, axis=1)
    for r in range(b * k):  # the 4th and 5th best tie: the lower id is the candidate
        vals[r, order[r, 4]] = vals[r, order[r, 3]]
    ids[::4, -3:] = -1  # fewer allowed ids than slots
    hidden = rng.normal(size=(b * k, cfg["selector_rank"])).astype(np.float32)
    anchors = rng.integers(0, V, b).astype(np.int32)
    t = lambda a: h.runner.tvm.runtime.tensor(a, h.runner.dev)  # noqa: E731
    out = dr.run_walk(t(ids), t(vals), t(hidden), t(anchors)).numpy()
    assert out.shape == (k, b)
    for i in range(b):
        rows = slice(i * k, (i + 1) * k)
        assert out[:, i].tolist() == sel.walk_greedy(ids[rows], vals[rows], hidden[rows], int(anchors[i]))


# ---- engine ------------------------------------------------------------------------------------
from ninfer_mlc.runtime.assemble import open_engine  # noqa: E402
from ninfer_mlc.runtime.config import EngineConfig  # noqa: E402
from ninfer_mlc.runtime.engine import Finished, GenRequest  # noqa: E402
from ninfer_mlc.runtime.sampling import SamplingParams  # noqa: E402

PLENTY = lambda: {"MemAvailable": 1 << 40}  # noqa: E731 - /proc/meminfo stand-in for the host tier
PROMPTS = [_ids(n, seed=20 + n) for n in (30, 45, 37, 52)]


def generate(arts, prompts, params_for, spec="none", **opts):
    """test_spec_decode.generate on the tap-enabled target, with the drafter of `spec`: (outputs, timings, stats)."""
    from test_spec_decode import generate as spec_generate

    if spec != "none":
        opts["draft_model"] = str(arts[spec][0])
    return spec_generate(prompts, params_for, spec=spec, art=arts["target"], **opts)


def greedy(n):
    return lambda i: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def baseline(arts):
    return generate(arts, PROMPTS, greedy(20))[0]


@pytest.mark.parametrize("case", [
    dict(spec="dflash", k=3, concurrency=4),
    dict(spec="dflash2", k=7, concurrency=1, prefill_chunk=16),
    dict(spec="dflash2", k=5, concurrency=4, prefill_chunk=16, kv_tokens=3 * 64),  # preemption under KV pressure
], ids=["dflash-k3-b4", "dflash2-k7-b1-chunked", "dflash2-k5-b4-preempt"])
def test_greedy_identical(arts, baseline, case):
    outs, timings, stats = generate(arts, PROMPTS, greedy(20), **case)
    assert outs == baseline
    sp = stats.spec
    assert sp.backend == case["spec"] and sp.draft_tokens_max == case["k"] and sp.forced_acceptance is None
    assert sp.draft_tokens > 0 and sp.rounds > 0
    assert 1 <= sp.tokens_per_round <= case["k"] + 1
    assert sp.emitted_tokens + len(PROMPTS) == sum(len(o) for o in outs)  # + the first tokens
    assert sum(t["draft_n"] for t in timings) == sp.draft_tokens
    assert sum(t["draft_n_accepted"] for t in timings) == sp.accepted_tokens
    assert all("draft_forced_acceptance" not in t for t in timings)
    if case.get("kv_tokens"):
        assert stats.counters.preemptions > 0
    print(case, sp)


def _spy_blocks(eng):
    """Record every drafted block: (request id, start, anchor, logits of its rows), whichever path drafted it
    (the host walk, the device candidates, the whole proposal on the device)."""
    prop = eng.spec.proposer
    blocks, owner, staged = [], {}, []
    entries = {name: getattr(prop, name) for name in ("propose", "propose_greedy", "stage_device")}
    stage_draft, run_draft = prop.dr.stage_draft, prop.dr.run_draft

    def entry(fn):
        def spy(items, *args):
            owner.update({id(req.seq): req.rid for req, _, _ in items})
            return fn(items, *args)
        return spy

    def spy_stage(items, uploads=None):
        staged.append(list(items))
        return stage_draft(items, uploads)

    def spy_run(inputs):
        out = run_draft(inputs)
        host, row = out[0].numpy(), 0
        for seq, _, start, anchor, _, k in staged.pop(0):
            blocks.append((owner[id(seq)], start, anchor, host[row: row + k].copy()))
            row += k
        return out

    for name, fn in entries.items():
        setattr(prop, name, entry(fn))
    prop.dr.stage_draft, prop.dr.run_draft = spy_stage, spy_run
    return blocks


@pytest.mark.parametrize("path", ["walk", "candidates"])
def test_dflash2_device_drafts_match_the_host_walk(arts, baseline, path):
    """Greedy device rounds draft DFlash2's blocks on the device: "walk" = the whole proposal there (stage_device /
    launch_device: the drafter's select_walk over the device sampler's top logprobs, nothing read), "candidates" =
    the top logprobs read and walked on the host (propose_greedy). Every round drafts what the host walk over
    [rows, vocab] logits (propose) drafts, and the output is the output without speculation."""
    from ninfer_mlc.runtime.spec.dflash import DFlashProposer

    case = dict(spec="dflash2", k=5, concurrency=2, prefill_chunk=16)
    stage_fn, launch_fn = DFlashProposer.stage_device, DFlashProposer.launch_device
    greedy_fn, host_fn = DFlashProposer.propose_greedy, DFlashProposer.propose
    seen: dict[str, list] = {"device": [], "host": []}
    declined = lambda self, items, uploads: (self.before_round(), None)[1]  # noqa: E731 - flushes as it declines

    def record(kind, items, drafts):
        seen[kind] += [(st.round.start, st.round.pending, list(d)) for (_, st, _), d in zip(items, drafts)]
        return drafts

    def stage(self, items, uploads):
        staged = stage_fn(self, items, uploads)
        return None if staged is None else (staged, items)

    def launch(self, staged, argmax):
        staged, items = staged
        drafts = launch_fn(self, staged, argmax)
        record("device", items, self.runner.read_host(drafts).T.tolist())
        return drafts

    try:
        if path == "walk":
            DFlashProposer.stage_device, DFlashProposer.launch_device = stage, launch
        else:
            DFlashProposer.stage_device = declined
            DFlashProposer.propose_greedy = lambda self, items, argmax: record("device", items,
                                                                               greedy_fn(self, items, argmax))
        outs, _, stats = generate(arts, PROMPTS, greedy(20), **case)
        DFlashProposer.stage_device, DFlashProposer.launch_device = declined, launch_fn
        DFlashProposer.propose_greedy = lambda self, items, argmax: None  # the host walk in every round
        DFlashProposer.propose = lambda self, items, choose: record("host", items, host_fn(self, items, choose))
        outs_h, _, _ = generate(arts, PROMPTS, greedy(20), **case)
    finally:
        DFlashProposer.stage_device, DFlashProposer.launch_device = stage_fn, launch_fn
        DFlashProposer.propose_greedy, DFlashProposer.propose = greedy_fn, host_fn
    assert outs == baseline and outs_h == baseline
    assert stats.spec.device_rounds == stats.spec.rounds
    assert len(seen["device"]) > 5 and any(len(d) == 5 for _, _, d in seen["device"])
    if path == "walk":  # rounds whose rows draft different counts take another path: a subset of the host's
        host = [repr(x) for x in seen["host"]]
        missing = Counter(repr(x) for x in seen["device"]) - Counter(host)
        assert not missing, f"device blocks the host walk did not draft: {list(missing)[:3]}"
    else:
        assert sorted(seen["device"]) == sorted(seen["host"])


def _replayed_verify(eng):
    """The CUDA-graph contract on the CPU: a verify's tap rows live in ONE output buffer that the next
    verify overwrites (a replay writes its recorded outputs), so they are only good until then."""
    from ninfer_mlc.runtime.executor.device_rows import DeviceRows

    runner, out = eng.runner, {}
    verify = runner.verify

    def replayed(batch, taps: bool = False):
        logits, rows = verify(batch, taps=taps)
        if not taps:
            return logits, rows
        src, n = rows[0].base, sum(len(r) for r in rows)
        if "buf" not in out:
            out["buf"] = runner.tvm.runtime.empty((256, src.shape[1]), src.dtype, runner.dev)
        DeviceRows(src, 0, n).view().copyto(DeviceRows(out["buf"], 0, n).view())
        return logits, [DeviceRows(out["buf"], r.start, len(r)) for r in rows]

    runner.verify = replayed


def test_engine_context_matches_reference(arts, hf_target):
    """Forced acceptance (drafts kept whatever the target says, so rounds keep several rows, and rejected
    rounds roll back by replaying the kept rows' GDN state), chunked prefill, two requests, verify outputs
    overwritten by the next verify as CUDA-graph replays do: every block the engine drafts sees the context
    the reference builds from the committed tokens, also past the ring (window 24 + block 8 < the contexts).
    The forced profile is labelled in the stats and the timings."""
    model = arts["dflash2"][1]
    o = EngineConfig(max_concurrency=2, max_context=1024, host_kv_mib=0, prefill_chunk=16, spec="dflash2",
                     draft_tokens=5, draft_model=str(arts["dflash2"][0]), forced_acceptance=3.5)
    eng = open_engine(arts["target"], o)
    _replayed_verify(eng)
    blocks = _spy_blocks(eng)
    prompts = [_ids(40, seed=5), _ids(57, seed=6)]
    try:
        hs = [eng.submit(GenRequest(p, greedy(30)(0))) for p in prompts]
        outs = [[t for ev in h.iter_sync(timeout=300) if hasattr(ev, "token_ids") for t in ev.token_ids] for h in hs]
        fins = [h.finished for h in hs]
        sp = eng.stats().spec
    finally:
        eng.stop()
    assert sp.forced_acceptance == 3.5 and all(f.timings["draft_forced_acceptance"] == 3.5 for f in fins)
    assert sp.recompute_tokens == 0 and sp.state_replays == sp.rollbacks > 0  # rollback by GDN replay, no re-feed
    drafting_rounds = sp.row_rounds - sp.no_draft_rounds  # the rest had no room left to draft
    assert 1.8 <= sp.accepted_tokens / drafting_rounds <= 2.5  # 3.5 tokens: 2.5 drafts (fewer near the ends)
    tokens = {h.id: p + o for h, p, o in zip(hs, prompts, outs)}
    checked = 0
    for rid, start, anchor, logits in blocks[-4:]:
        toks = tokens[rid]
        assert toks[start] == anchor
        ref, _, _ = _reference_block(model, hf_target, toks, start)
        assert start > 32 and rel_err(logits, ref[: len(logits)]) < 1e-4, (rid, start)
        checked += 1
    assert checked == 4


def _restore_session(arts, kv_tokens: int, stale: bool = False, spec: str = "dflash2"):
    """A prompt, an unrelated request, then the first conversation continued by more than the window
    (greedy, --spec dflash2): with `kv_tokens` 384 the first entry is demoted to the host while the second
    request reuses its device pages and comes back from the host; with 4096 it is restored from the device.
    Returns the continuation, its Finished, the KV stats, the host transfers and the blocks drafted for it."""
    o = EngineConfig(max_concurrency=1, max_context=1024, host_kv_mib=16, host_state_slots=2, host_ram_reserve_mib=0,
                     device_state_slots=1, spec=spec, draft_tokens=3,
                     draft_model=str(arts["dflash2"][0]) if spec != "none" else None, kv_capacity=kv_tokens)
    eng = open_engine(arts["target"], o, meminfo_reader=PLENTY)
    if stale:  # a host tier that moves only the target's pages (and the MTP head's)
        host = eng.kv.host
        host._plan = lambda *a, f=host._plan: [c for c in f(*a) if host.parts[c.part].name in ("kv", "mtp")]
    blocks = _spy_blocks(eng) if spec != "none" else []
    prompt, other, extra = (_ids(n, seed=30 + n) for n in (150, 250, 30))

    def ask(ids, n):
        h = eng.submit(GenRequest(ids, greedy(n)(0)))
        evs = list(h.iter_sync(timeout=300))
        assert isinstance(evs[-1], Finished) and evs[-1].reason == "length", evs[-1]
        return [t for e in evs[:-1] if hasattr(e, "token_ids") for t in e.token_ids], evs[-1]

    try:
        out1, _ = ask(prompt, 16)
        ask(other, 8)
        n_before = len(blocks)
        out2, fin = ask(prompt + out1 + extra, 10)
        return out2, fin, dict(eng.kv.stats), dict(eng.kv.host.stats), blocks[n_before:], prompt + out1 + extra + out2
    finally:
        eng.stop()


def test_drafter_kv_moves_with_the_host_tier(arts, hf_target):
    """The drafter's paged-layer KV of a prefix spilled to the host comes back with it, and the ring layers
    are rebuilt from the rows prefilled after the restore point (more than the window here): the blocks
    drafted after a host restore are those after a device restore and the reference's from the whole
    context; without the paged KV they are not (the test can see it). Greedy output equals no speculation."""
    out_d, fin_d, st_d, _, bl_d, toks = _restore_session(arts, 4096)
    out_h, fin_h, st_h, tr_h, bl_h, _ = _restore_session(arts, 384)
    out_n = _restore_session(arts, 384, spec="none")[0]
    assert st_d["restores_device"] == 1 and st_d["restores_host"] == 0
    assert st_h["restores_host"] == 1 and st_h["private_owners_demoted"] >= 1
    assert fin_h.usage["cached_tokens"] == fin_d.usage["cached_tokens"] > 150
    assert tr_h["draft_kv_d2h_bytes"] > 0 and tr_h["draft_kv_h2d_bytes"] > 0
    assert out_h == out_d == out_n and len(bl_h) == len(bl_d) > 0
    for (_, s1, a1, l1), (_, s2, a2, l2) in zip(bl_d, bl_h):
        assert (s1, a1) == (s2, a2) and np.array_equal(l1, l2)
    for _, start, anchor, logits in bl_h[:2]:
        assert toks[start] == anchor
        ref, _, _ = _reference_block(arts["dflash2"][1], hf_target, toks, start)
        assert rel_err(logits, ref[: len(logits)]) < 1e-4, start
    out_s, _, st_s, _, bl_s, _ = _restore_session(arts, 384, stale=True)
    assert st_s["restores_host"] == 1 and out_s == out_d  # lossless whatever the drafter sees
    assert any(not np.allclose(l1, l2) for (_, _, _, l1), (_, _, _, l2) in zip(bl_d, bl_s))


def test_sampled_distribution_unchanged(arts):
    """First tokens sampled (temperature 4) with and without --spec dflash2: chi-square homogeneity. A
    logit bias confines both the target and the drafter to 8 tokens, so random drafts are often accepted
    (and often rejected): the rejection test and the selector's proposal distribution are both exercised."""
    from test_spec_decode import _homogeneity_p

    S = [7 + 97 * i for i in range(8)]
    prompt = _ids(12, seed=8)
    n = 200

    def params(offset):
        return lambda i: SamplingParams(temperature=4.0, seed=offset + i, max_tokens=3, ignore_eos=True,
                                        logprobs=True, logit_bias={t: 100.0 for t in S})

    base, _, _ = generate(arts, [prompt] * n, params(0), concurrency=8, prefix_reuse=False)
    spec_out, _, stats = generate(arts, [prompt] * n, params(10_000), spec="dflash2", k=2, concurrency=8,
                                  prefix_reuse=False)
    assert all(len(o) == 3 and set(o) <= set(S) for o in base + spec_out)
    sp = stats.spec
    assert sp.draft_tokens > 0 and 0.2 < sp.acceptance_rate < 0.95, sp
    for what, key in (("tokens 2-3", lambda o: tuple(o[1:])), ("token 2", lambda o: o[1]), ("token 3", lambda o: o[2])):
        pval = _homogeneity_p([key(o) for o in base], [key(o) for o in spec_out])
        assert pval > 1e-3, f"{what} distribution differs (p={pval:.2g})"
    print(sp)


# ---- options, errors, labels ---------------------------------------------------------------------
from ninfer_mlc.runtime.errors import ConfigError  # noqa: E402


def test_options_validation(arts):
    d1, d2 = str(arts["dflash"][0]), str(arts["dflash2"][0])
    cases = [
        (dict(spec="dflash"), "draft_model", "needs a compiled DFlash drafter"),
        (dict(spec="dflash2", draft_model="/nonexistent"), "draft_model", "not a compiled model"),
        (dict(spec="dflash2", draft_model=str(arts["target"])), "draft_model", "not a DFlash drafter"),
        (dict(spec="dflash", draft_model=d2), "spec", "is a dflash2 drafter"),
        (dict(spec="dflash2", draft_model=d2, draft_tokens=8), "draft_tokens", "1..7"),
        (dict(spec="dflash", draft_model=d1, draft_tokens=4), "draft_tokens", "1..3"),
        (dict(spec="dflash2", draft_model=d2, lm_head_draft="10"), "lm_head_draft", "only used with spec mtp"),
        (dict(spec="dflash2", draft_model=d2, draft_tokens=3, forced_acceptance=4.5), "forced_acceptance", "1..4"),
        (dict(forced_acceptance=2.0), "forced_acceptance", "needs --spec"),
    ]
    for kw, field, msg in cases:
        with pytest.raises(ConfigError, match=msg) as e:
            EngineConfig(**kw).validate()
        assert e.value.field == field, kw
    EngineConfig(spec="dflash2", draft_model=d2, draft_tokens=7, forced_acceptance=5.4).validate()


def test_target_without_taps_is_a_clear_error(arts):
    from ninfer_mlc.paths import default_model_dir

    o = EngineConfig(spec="dflash2", draft_model=str(arts["dflash2"][0]), max_context=512)
    with pytest.raises(ValueError, match="--tap-layers"):
        open_engine(default_model_dir(), o, start=False)


def test_compile_rejects_bad_tap_layers(arts):
    from ninfer_mlc.compile.config import ConfigError as CompileError
    from ninfer_mlc.compile.dflash.config import parse_tap_layers

    assert parse_tap_layers("0, 2", 4) == (0, 2) and parse_tap_layers(str(arts["dflash2"][0]), 4) == (0, 2)
    for bad in ("3", "0,0", "x", "-1"):
        with pytest.raises(CompileError, match="tap-layers"):
            parse_tap_layers(bad, 4)


def test_serve_refuses_forced_acceptance(arts):
    import argparse

    from ninfer_mlc.config import CLIError
    from ninfer_mlc.server.app import load_state
    from ninfer_mlc.server.options import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    args = p.parse_args([str(arts["target"]), "--spec", "dflash2", "--draft-model", str(arts["dflash2"][0]),
                         "--draft-tokens", "7", "--forced-acceptance", "5.4"])
    with pytest.raises(CLIError):
        load_state(args, engine=object())


def test_stats_and_request_log_label_forced_acceptance(tmp_path):
    import json

    from ninfer_mlc.runtime.stats import Counters, EngineStats, ModelInfo, SchedulerState, SpecCounters
    from ninfer_mlc.server.request_log import RequestLogger
    from ninfer_mlc.server.stats import render_stats

    for forced in (None, 5.4):
        doc = render_stats(EngineStats(0, True, SchedulerState(), Counters(),
                                       SpecCounters(backend="dflash2", forced_acceptance=forced), ModelInfo()))
        assert doc["spec"]["backend"] == "dflash2" and doc["spec"]["forced_acceptance"] == (forced or 0.0)
    log = RequestLogger(str(tmp_path / "log.jsonl"))
    log.log(request_id="a", model="m", api="test", finish_reason="length", timings={"draft_forced_acceptance": 5.4})
    log.log(request_id="b", model="m", api="test", finish_reason="length", timings={})
    lines = [json.loads(x) for x in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [x["draft_forced_acceptance"] for x in lines] == [5.4, 0.0]


def test_drafter_memory_is_bounded(arts):
    """Windowed layers cost a fixed ring per request, paged layers grow with the context: the pools the
    runner allocates are what the drafter config says, and the 27B DFlash2 shape's figures."""
    from ninfer_mlc.contract.drafter import DrafterConfig

    h = Harness(arts["target"], num_slots=2, kv_capacity_tokens=256)
    dr = DrafterRunner(arts["dflash2"][0], h.runner, lanes=3, max_batch=2)
    cfg = dr.cfg
    assert dr.ring_pool.numpy().nbytes == 3 * cfg.ring_bytes_per_sequence(4)
    assert dr.paged_pool.numpy().nbytes == h.runner.num_pages * 64 * cfg.kv_bytes_per_token(4)
    big = DrafterConfig(**{**cfg.to_dict(), "hidden_size": 5120, "num_attention_heads": 32, "num_key_value_heads": 8,
                           "head_dim": 128, "num_hidden_layers": 5, "block_size": 8, "sliding_window": 2048,
                           "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "causal": [True] * 4 + [False]})
    assert big.kv_bytes_per_token(2) == 4096  # bf16: one full layer, 4 KiB per context token (1 GiB at 262k)
    assert big.ring_bytes_per_sequence(2) == 4 * 2 * 8 * 2056 * 128 * 2  # ~32 MiB per request, any context


def test_top_k_ids_is_exact():
    from ninfer_mlc.runtime.spec.selector import top_k_ids

    rng = np.random.default_rng(4)
    for v, k in ((248320, 16), (5000, 4), (40, 4)):
        for _ in range(5):
            row = rng.standard_normal(v).astype(np.float32)
            row[rng.integers(0, v, 8)] += 10  # several large values in few chunks
            assert set(top_k_ids(row, k).tolist()) == set(np.argsort(-row)[:k].tolist())


def test_cuda_drafter_projections_use_the_gemv_and_gemm(arts):
    """On CUDA the block's projections and the lm_head run through the decode GEMV (fp32 logits) and the
    context's through the sm_90 prefill GEMM, the windowed layers through the ring-attention kernel (no dense
    mask / softmax ops); the kernels the drafter adds are thread-bound."""
    import re

    import tvm
    from tvm.target import Target

    from ninfer_mlc.compile.dflash.model import DFlashDrafter
    from ninfer_mlc.compile.gpu_pipeline import is_thread_bound
    from ninfer_mlc.contract.drafter import DrafterConfig
    from ninfer_mlc.contract.manifest import read_manifest

    cfg = DrafterConfig.from_dict(read_manifest(arts["dflash2"][0]).config)
    with Target({"kind": "cuda", "arch": "sm_90"}):
        m = DFlashDrafter(cfg, "bfloat16", "cuda")
    mod = m.export_tvm(spec=m.export_spec())[0]
    fns = {gv.name_hint: f for gv, f in mod.functions_items() if isinstance(f, tvm.relax.Function)}
    draft = fns["draft"].script()
    gemv = set(re.findall(r"call_tir\((?:cls\.)?(gemv\w*)", draft))
    assert any("silu_mul" in c for c in gemv) and any(c.endswith("_f32") for c in gemv)
    assert re.search(r"call_tir\((?:cls\.)?gemm", fns["ctx"].script())
    assert is_thread_bound(m.paged_append) and is_thread_bound(m.ring_append)
    assert re.search(r"call_tir\((?:cls\.)?dflash_ring_attention", draft) and "dflash_ring_mask" not in draft
    assert "softmax" not in draft and all(is_thread_bound(f) for f in m.ring_kernels.values())
