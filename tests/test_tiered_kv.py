"""Tiered KV and prefix reuse on the embedded tiny model.

The multi-agent simulation runs 8 agents with growing histories and side requests through an
engine whose device KV holds a fraction of the total demand. It asserts that every cached turn
is reused (never re-prefilled) while the host tier has room, that nothing is lost, and that the
outputs are token-identical to a run with ample device memory (demote/restore is exact).
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from ninfer_mlc.chat_template import ChatTemplate
from ninfer_mlc.runtime.assemble import open_engine
from ninfer_mlc.paths import default_model_dir
from ninfer_mlc.runtime.config import EngineConfig
from ninfer_mlc.runtime.engine import Finished, GenRequest
from ninfer_mlc.runtime.kv.host_tier import HostTier
from ninfer_mlc.runtime.harness import Harness
from ninfer_mlc.runtime.kv.prefix_cache import PrefixCache, identity_seed
from ninfer_mlc.runtime.sampling import SamplingParams

ART = default_model_dir()
PLENTY = lambda: 64 * 2**30  # noqa: E731  (MemAvailable seen by the host tier)

WORDS = ("alpha beta gamma delta parse file read write module class def return import json value test "
         "function error stack trace build compile kernel page cache state slot host device").split()


def _user_text(rng: np.random.Generator, n: int) -> str:
    return " ".join(rng.choice(WORDS, size=n))


def run_simulation(kv_tokens: int, device_state_slots: int, host_kv_mib: float, agents: int = 8, turns: int = 4):
    opts = EngineConfig(max_concurrency=1, prefill_chunk=96, max_context=4096, default_max_tokens=24,
                         device_state_slots=device_state_slots, host_kv_mib=host_kv_mib, host_state_slots=4,
                         host_ram_reserve_mib=0, max_cache_entries=256)
    opts.kv_capacity = kv_tokens
    eng = open_engine(ART, opts, meminfo_reader=PLENTY)
    tmpl = ChatTemplate.from_model_dir(str(ART))
    rng = np.random.default_rng(7)
    histories = [[{"role": "system", "content": f"You are agent {i}. " + _user_text(rng, 40)}] for i in range(agents)]
    records = []
    try:
        for turn in range(turns):
            for i in range(agents):
                histories[i].append({"role": "user", "content": _user_text(rng, 30 + 10 * turn)})
                text = tmpl.render(histories[i], preserve_thinking=False, enable_thinking=True)
                ids = eng.tok.encode(text, add_special_tokens=False).ids
                h = eng.submit(GenRequest(ids, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                          session_key=f"agent-{i}", cache_mode="think"))
                evs = list(h.iter_sync(timeout=300))
                fin = evs[-1]
                assert isinstance(fin, Finished) and fin.reason == "length", fin
                out = "".join(e.text for e in evs[:-1])
                records.append({"agent": i, "turn": turn, "prompt": ids, "out": out, "usage": fin.usage,
                                "timings": fin.timings})
                # the client keeps the answer but drops its reasoning for the next turn
                histories[i].append({"role": "assistant", "reasoning_content": out, "content": f"done {turn}"})
                if i % 3 == 0:  # a side request (e.g. title generation) that shares no history
                    side = eng.tok.encode(tmpl.render([{"role": "user", "content": "title: " + _user_text(rng, 8)}]),
                                          add_special_tokens=False).ids
                    hs = eng.submit(GenRequest(side, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)))
                    assert list(hs.iter_sync(timeout=120))[-1].reason == "length"
        es = eng.stats()
        snap = {"engine": es.counters, "kv": es.planner, "cache": es.cache, "host": es.arena or None,
                "transfers": es.transfers or None}
    finally:
        eng.stop()
    return records, snap


def _opener_index(prompt: list[int], opener: list[int]) -> int:
    for i in range(len(prompt) - len(opener), -1, -1):
        if prompt[i:i + len(opener)] == opener:
            return i
    raise AssertionError("no assistant opener in prompt")


@pytest.fixture(scope="module")
def simulations():
    tight = run_simulation(kv_tokens=1024, device_state_slots=1, host_kv_mib=64)
    ample = run_simulation(kv_tokens=32768, device_state_slots=160, host_kv_mib=64)
    return tight, ample


def test_device_capacity_is_far_below_demand(simulations):
    (records, snap), _ = simulations
    per_agent_final = {}
    for r in records:
        per_agent_final[r["agent"]] = len(r["prompt"])
    assert sum(per_agent_final.values()) > 3 * 1024
    assert snap["kv"]["private_owners_demoted"] > 0
    assert snap["kv"]["restores_host"] > 0


def test_cached_turns_are_never_reprefilled(simulations):
    (records, snap), _ = simulations
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(ART / "tokenizer.json"))
    opener = tok.encode("<|im_start|>assistant", add_special_tokens=False).ids
    prev = {}
    for r in records:
        if r["agent"] in prev:
            boundary = _opener_index(prev[r["agent"]], opener)
            assert r["usage"]["cached_tokens"] >= boundary, (r["agent"], r["turn"])
            # only the new part of the conversation was computed
            assert r["timings"]["prompt_n"] == len(r["prompt"]) - r["usage"]["cached_tokens"]
        prev[r["agent"]] = r["prompt"]
    assert snap["cache"]["checkpoint_hits"] >= 8 * 3


def test_restored_sequences_continue_exactly(simulations):
    (tight, tsnap), (ample, asnap) = simulations
    assert asnap["kv"]["private_owners_demoted"] == 0  # the reference never left the device
    assert [r["out"] for r in tight] == [r["out"] for r in ample]
    assert [r["usage"]["cached_tokens"] for r in tight] == [r["usage"]["cached_tokens"] for r in ample]


def test_host_tier_reports_fragmentation_figures(simulations):
    (_, snap), _ = simulations
    host = snap["host"]
    for key in ("capacity_bytes", "free_bytes", "largest_free_run_bytes", "fragmented_misses", "grows"):
        assert key in host
    assert snap["transfers"]["kv_d2h_pages"] > 0 and snap["transfers"]["kv_h2d_pages"] > 0
    print("\nsimulation figures:", {"cache": snap["cache"], "kv": snap["kv"], "host": {
        k: host[k] for k in ("capacity_bytes", "free_bytes", "largest_free_run_bytes", "fragmented_misses",
                             "grows", "scatter_allocations")}})


def test_no_space_on_host_falls_back_to_eviction():
    records, snap = run_simulation(kv_tokens=1024, device_state_slots=1, host_kv_mib=0, agents=4, turns=2)
    assert all(r["usage"]["completion_tokens"] == 24 for r in records)
    assert snap["kv"]["private_owners_evicted"] > 0


# ---- the seal-window race -------------------------------------------------------------------
def _attached_runner(num_slots: int):
    """A tiny-model harness with a prefix cache and a 16 MiB host tier attached: (runner, cache, kv manager)."""
    runner = Harness(ART, kv_capacity_tokens=1024, num_slots=num_slots)
    cache = PrefixCache()
    kv = runner.attach(cache, HostTier(runner, 16, 2, 0, meminfo_reader=PLENTY))
    return runner, cache, kv


def test_demote_between_assess_and_seal_is_detected_and_restore_stays_exact():
    runner, cache, kv = _attached_runner(num_slots=4)
    seed = identity_seed("x")
    rng = np.random.default_rng(1)
    toks = rng.integers(0, 1900, size=150).tolist()

    ref = runner.new_seq()  # reference: uninterrupted
    runner.prefill([(ref, toks[:100])])
    want = runner.decode([ref], [toks[100]])[0]
    runner.free_seq(ref)

    s = runner.new_seq()
    runner.prefill([(s, toks[:100])])
    kv.release(s, toks[:100], seed, "sess")  # becomes a device frontier entry
    entry = next(iter(cache.entries.values()))

    real_lookup = cache.lookup
    moved = threading.Event()

    def racing_lookup(*a, **k):
        m = real_lookup(*a, **k)
        if not moved.is_set():  # a concurrent planner demotes the entry right after the assessment
            t = threading.Thread(target=lambda: (kv.demote(entry), moved.set()))
            t.start()
            t.join()
        return m

    cache.lookup = racing_lookup
    seq = kv.admit(toks[:120], seed, "sess", max_reuse=119)
    cache.lookup = real_lookup
    assert moved.is_set() and entry.tier == "host"
    assert cache.stats["claim_conflicts"] == 1
    assert seq.length == 100 and kv.stats["restores_host"] == 1
    got = runner.decode([seq], [toks[100]])[0]
    np.testing.assert_array_equal(got, want)


def test_slot_for_a_hit_never_moves_the_hit_and_moves_the_fewest_bytes():
    """Both state slots held by cached entries: admitting a request that extends the long one claims it first,
    then frees a slot by demoting the short entry (not the long prefix about to be restored, which the
    old order demoted to the host and copied straight back)."""
    runner, cache, kv = _attached_runner(num_slots=2)
    seed = identity_seed("x")
    rng = np.random.default_rng(2)
    long_t, short_t = rng.integers(0, 1900, size=300).tolist(), rng.integers(0, 1900, size=20).tolist()
    for toks in (long_t, short_t):
        s = runner.new_seq()
        runner.prefill([(s, toks)])
        kv.release(s, toks, seed, None)
    assert kv.slots.free_slots == 0
    long_e = next(e for e in cache.entries.values() if e.length == 300)
    short_e = next(e for e in cache.entries.values() if e.length == 20)
    seq = kv.admit(long_t + [1, 2, 3], seed, None, max_reuse=302)
    assert seq is not None and seq.length == 300
    assert kv.stats["restores_device"] == 1 and kv.stats["restores_host"] == 0
    assert long_e.tier == "device" and short_e.tier == "host"
    assert kv.stats["spill_pages"] == len(short_e.host_alloc.pages()) == 1
    assert not kv.audit(live=(seq,))


def test_claimed_entry_cannot_be_moved():
    cache = PrefixCache()
    e = cache.add("frontier", [1, 2, 3], 0, None, slot=0, pages=[0])
    m = cache.lookup([1, 2, 3, 4], 0)
    assert m is not None and cache.claim(m)
    assert not cache.begin_move(e)
    cache.release_claim(e)
    assert cache.begin_move(e)
    assert not cache.claim(m)  # the move invalidated the old assessment


def test_lookup_needs_exact_identity_even_with_session_key():
    cache = PrefixCache()
    cache.add("frontier", [5, 6, 7], identity_seed("think"), "s1", slot=0, pages=[])
    assert cache.lookup([5, 6, 7, 8], identity_seed("nothink"), "s1") is None
    assert cache.lookup([5, 6, 9, 8], identity_seed("think"), "s1") is None
    m = cache.lookup([5, 6, 7, 8], identity_seed("think"), "other-session")
    assert m is not None and m.length == 3


# ---- the MTP head's KV travels with the main pages ----------------------------------------------
def test_host_tier_moves_mtp_kv_pages():
    runner = Harness(ART, kv_capacity_tokens=1024, num_slots=3)
    assert runner.mtp_kv_pool is not None  # the embedded tiny model ships its MTP head
    host = HostTier(runner, 16, 2, 0, meminfo_reader=PLENTY)
    assert host.host_page_bytes == runner.page_bytes + host.mtp_page_bytes > runner.page_bytes
    rng = np.random.default_rng(2)
    pages = runner.kv.pages.alloc(3)
    main = rng.standard_normal((3,) + runner.kv_shape[1:]).astype(np.float32)
    mtp = rng.standard_normal((3,) + runner.mtp_kv_shape[1:]).astype(np.float32)
    runner.write_pages(pages, main)
    for p, block in zip(pages, mtp):
        runner.mtp_page_view(p).copyfrom(block)
    alloc = host.store_pages(pages)
    runner.kv.pages.release(pages)
    for p in pages:  # the freed pages get other contents
        runner.mtp_page_view(p).copyfrom(np.zeros(runner.mtp_kv_shape[1:], np.float32))
    back = runner.kv.pages.alloc(3)[::-1]
    host.load_pages(alloc, back)
    np.testing.assert_array_equal(runner.read_pages(back), main)
    np.testing.assert_array_equal(np.stack([runner.mtp_page_view(p).numpy() for p in back]), mtp)
    assert host.stats["kv_d2h_bytes"] == 3 * runner.page_bytes
    assert host.stats["mtp_kv_d2h_bytes"] == host.stats["mtp_kv_h2d_bytes"] == 3 * host.mtp_page_bytes
    # one copy per part (main, MTP) for the run of 3 pages; the reversed restore is three runs of one
    assert pages == list(range(pages[0], pages[0] + 3)) and back == pages[::-1]
    assert host.stats["kv_d2h_copies"] == 2 and host.stats["kv_h2d_copies"] == 6
    # the device's drain of queued work before a copy is counted apart from the copy
    drain = host.copier.drain
    host.copier.drain = lambda: (time.sleep(0.2), drain())
    before = dict(host.stats)
    host.free_pages(host.store_pages(back))
    assert host.stats["kv_d2h_wait_seconds"] - before["kv_d2h_wait_seconds"] >= 0.2
    assert host.stats["kv_d2h_seconds"] - before["kv_d2h_seconds"] < 0.2


def _spec_restore_session(kv_tokens: int, stale_mtp: bool = False):
    """A prompt, an unrelated request, then the first conversation continued (--spec mtp, greedy): with
    `kv_tokens` 384 the first entry is demoted to the host while the second request reuses its device
    pages, and comes back from the host; with 4096 it is restored from the device."""
    opts = EngineConfig(max_concurrency=1, max_context=1024, host_kv_mib=16, host_state_slots=2,
                         host_ram_reserve_mib=0, device_state_slots=1, spec="mtp", draft_tokens=3)
    opts.kv_capacity = kv_tokens
    eng = open_engine(ART, opts, meminfo_reader=PLENTY)
    if stale_mtp:  # what the host tier did before: main pages only
        host = eng.kv.host
        host._plan = lambda *a, f=host._plan: [c for c in f(*a) if host.parts[c.part].name == "kv"]
    rng = np.random.default_rng(3)
    prompt, other, extra = (rng.integers(0, 1900, n).tolist() for n in (150, 250, 20))
    drafts: list = []  # every draft the MTP head proposed, in order
    prop = eng.spec.proposer
    propose, launch = prop.propose, prop.launch_device
    prop.propose = lambda items, choose: drafts.append(propose(items, choose)) or drafts[-1]

    def launch_device(staged, argmax):  # greedy rounds draft on the device: read the drafts it chose
        rows = launch(staged, argmax)
        drafts.append(rows.numpy().T.tolist())
        return rows

    prop.launch_device = launch_device

    def ask(ids, n):
        h = eng.submit(GenRequest(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=True)))
        evs = list(h.iter_sync(timeout=300))
        assert isinstance(evs[-1], Finished) and evs[-1].reason == "length", evs[-1]
        return [t for e in evs[:-1] if hasattr(e, "token_ids") for t in e.token_ids], evs[-1]

    try:
        out1, _ = ask(prompt, 24)
        ask(other, 24)
        n_before = len(drafts)
        out2, fin = ask(prompt + out1 + extra, 32)
        return out2, fin, dict(eng.kv.stats), drafts[n_before:]
    finally:
        eng.stop()


def test_mtp_acceptance_after_host_restore_equals_device_restore():
    out_d, fin_d, st_d, dr_d = _spec_restore_session(4096)
    out_h, fin_h, st_h, dr_h = _spec_restore_session(384)
    assert st_d["restores_device"] == 1 and st_d["restores_host"] == 0
    assert st_h["restores_host"] == 1 and st_h["private_owners_demoted"] >= 1
    assert fin_h.usage["cached_tokens"] == fin_d.usage["cached_tokens"] > 150
    assert out_h == out_d
    acc = lambda f: (f.timings["draft_n"], f.timings["draft_n_accepted"])  # noqa: E731
    assert fin_d.timings["draft_n"] > 0
    assert acc(fin_h) == acc(fin_d) and dr_h == dr_d
    # without the head's pages the restored prefix drafts from stale MTP KV: same output, other drafts
    out_s, fin_s, st_s, dr_s = _spec_restore_session(384, stale_mtp=True)
    assert st_s["restores_host"] == 1 and out_s == out_d
    assert dr_s != dr_d


# ---- which cached entries are redundant under pressure (planner policy) --------------------------------
def _entry(eid, kind, toks, created, session="s", seed=7):
    from ninfer_mlc.runtime.kv.prefix_cache import Entry
    return Entry(eid, kind, np.asarray(toks, np.int32), seed, 0, session, created=created, last_used=created)


def test_redundant_entries_of_an_agent_session():
    from ninfer_mlc.runtime.kv.planner import PressurePlanner, redundant

    hist = list(range(1000))
    c1 = _entry(1, "checkpoint", hist[:600], 1.0)
    f1 = _entry(2, "frontier", hist[:600] + [5000 + i for i in range(100)], 2.0)  # + reasoning and answer
    # while the session waits: the checkpoint (which the next turn needs) is kept although f1 extends it; f1 is
    # kept too (it is not 90 % checkpoint)
    assert not redundant(c1, [c1, f1]) and not redundant(f1, [c1, f1])
    # next turn: the client dropped the reasoning; its checkpoint extends c1, and f1 diverged after 600 tokens
    c2 = _entry(3, "checkpoint", hist[:600] + [7000, 7001] + hist[600:900], 3.0)
    assert redundant(c1, [c1, f1, c2]) and redundant(f1, [c1, f1, c2]) and not redundant(c2, [c1, f1, c2])
    # another session's frontier sharing only a system prompt is not stale for this one
    other = _entry(4, "frontier", hist[:100] + [9] * 400, 0.5, session="t")
    assert not redundant(other, [c1, f1, c2, other])
    # a shared prefix (another session's, or no session key) that a conversation extends stays: others branch off it
    shared = _entry(7, "checkpoint", hist[:300], 0.2, session=None)
    assert not redundant(shared, [shared, c1, c2])
    c0 = _entry(8, "checkpoint", hist[:300], 0.3, session="t")
    assert not redundant(c0, [c0, c1, c2])
    # a different identity (template mode / media) never makes an entry redundant
    c2b = _entry(5, "checkpoint", c2.tokens, 3.0, seed=8)
    assert not redundant(c1, [c1, c2b])
    # a frontier that its own checkpoint holds >= 90 % of costs at most its tail
    f2 = _entry(6, "frontier", list(c2.tokens) + [1, 2, 3], 4.0)
    assert redundant(f2, [c2, f2])
    # the victim is the least recently used redundant unclaimed entry
    f1.claimed = 1
    assert PressurePlanner().redundant_victim([c1, f1, c2], [c1, f1, c2]) is c1
