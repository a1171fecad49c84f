"""Fault paths in the KV tiers: an exception injected into a restore, a spill, a demotion, host growth
and a forward pass. Afterwards every page, slot, claim and host extent is accounted for
(KVManager.audit), and the engine keeps serving with unchanged outputs."""
from __future__ import annotations

import time

import numpy as np
import pytest

from ninfer_mlc.paths import default_model_dir
from ninfer_mlc.runtime.assemble import open_engine
from ninfer_mlc.runtime.config import EngineConfig
from ninfer_mlc.runtime.engine import Finished, GenRequest
from ninfer_mlc.runtime.sampling import SamplingParams

ART = default_model_dir()
PLENTY = lambda: 64 * 2**30  # noqa: E731


def engine(**kw):
    cfg = dict(max_concurrency=1, max_context=1024, prefill_chunk=128, kv_capacity=6 * 64, device_state_slots=1,
               host_kv_mib=16, host_state_slots=2, host_ram_reserve_mib=0)
    cfg.update(kw)
    return open_engine(ART, EngineConfig(**cfg), meminfo_reader=PLENTY)


def ask(eng, ids, n=8) -> Finished:
    h = eng.submit(GenRequest(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
    return list(h.iter_sync(timeout=300))[-1]


def turn(eng, ids, n=8) -> list[int]:
    """The next turn's prompt: ids + what the model answered (a frontier entry covers all of it) + 2."""
    h = eng.submit(GenRequest(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
    evs = list(h.iter_sync(timeout=300))
    assert evs[-1].reason == "length", evs[-1]
    return ids + [t for e in evs[:-1] for t in e.token_ids] + [7, 8]


def text(eng, ids, n=8) -> str:
    h = eng.submit(GenRequest(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)))
    evs = list(h.iter_sync(timeout=300))
    assert evs[-1].reason == "length", evs[-1]
    return "".join(e.text for e in evs[:-1])


def idle_audit(eng) -> list[str]:
    t_end = time.monotonic() + 10
    while time.monotonic() < t_end and (eng.stats().scheduler.running or eng.stats().scheduler.waiting):
        time.sleep(0.01)
    return eng.audit()


RNG = np.random.default_rng(11)
A, B, C = (RNG.integers(0, 1900, n).tolist() for n in (150, 250, 120))


class Boom(RuntimeError):
    pass


def once(fn):
    """fn, raising Boom on its first call."""
    state = {"armed": True}

    def wrapped(*a, **k):
        if state["armed"]:
            state["armed"] = False
            raise Boom("injected")
        return fn(*a, **k)

    return wrapped


@pytest.fixture(scope="module")
def reference():
    eng = engine(prefix_reuse=False)
    try:
        out = {}
        for k, ids in (("A", A), ("B", B)):
            nxt = turn(eng, ids)
            out[k] = (nxt, text(eng, nxt))
        return out
    finally:
        eng.stop()


def test_restore_from_host_fails_then_recomputes(reference):
    eng = engine()
    try:
        ask(eng, A)
        ask(eng, B)  # A is demoted to the host to make room
        assert eng.stats().planner["private_owners_demoted"] >= 1
        eng.kv.host.load_pages = once(eng.kv.host.load_pages)
        assert text(eng, reference["A"][0]) == reference["A"][1]  # the restore failed: recomputed, same answer
        st = eng.stats()
        assert st.planner["restore_failures"] == 1 and st.planner["restores_host"] == 0
        assert idle_audit(eng) == []
        assert text(eng, reference["B"][0]) == reference["B"][1]  # still serving
        assert idle_audit(eng) == []
    finally:
        eng.stop()


def test_restore_on_device_fails_then_recomputes(reference):
    eng = engine(kv_capacity=2048)
    try:
        ask(eng, A)
        eng.kv.runner.copy_state = once(eng.kv.runner.copy_state)
        eng.kv.host.copy_state_d2d = once(eng.kv.host.copy_state_d2d)
        assert text(eng, reference["A"][0]) == reference["A"][1]
        assert eng.stats().planner["restore_failures"] == 1
        assert idle_audit(eng) == []
    finally:
        eng.stop()


@pytest.mark.parametrize("where", ["store_state", "store_pages"])
def test_spill_fault_fails_the_step_and_leaks_nothing(reference, where):
    eng = engine()
    try:
        ask(eng, A)
        setattr(eng.kv.host, where, once(getattr(eng.kv.host, where)))
        fin = ask(eng, B)  # admitting B must demote A: the spill raises inside a step, the next one admits B
        assert eng.stats().counters.step_failures == 1  # the fault fired
        # B fails with the error when the spill ran for its own pages, or succeeds when it ran at admission
        assert fin.reason == "length" or (fin.reason == "error" and "Boom" in fin.error)
        assert idle_audit(eng) == []
        assert text(eng, reference["B"][0]) == reference["B"][1]  # the retry (and everything after) works
        assert idle_audit(eng) == []
    finally:
        eng.stop()


def test_host_growth_refused_evicts_instead(reference):
    """The host arena starts at a quarter of its 1 MiB ceiling, less than B's pages: demoting B needs the
    arena to grow, the growth hook fails, the planner evicts B instead."""
    eng = engine(host_kv_mib=1)
    try:
        def refuse(chunk):
            raise Boom("no pinned memory")

        eng.kv.host.arena._on_kv_grow = refuse
        ask(eng, B)
        assert text(eng, reference["A"][0]) == reference["A"][1]
        st = eng.stats()
        assert "not pinned" in st.arena["last_veto"] and st.planner["private_owners_evicted"] >= 1
        assert idle_audit(eng) == []
        assert text(eng, reference["B"][0]) == reference["B"][1]
        assert idle_audit(eng) == []
    finally:
        eng.stop()


def test_forward_fault_fails_the_batch_and_keeps_serving(reference):
    eng = engine(max_concurrency=2, kv_capacity=2048)
    try:
        eng.runner.prefill = once(eng.runner.prefill)
        fin = ask(eng, A)
        assert fin.reason == "error" and "Boom" in fin.error
        assert eng.stats().counters.step_failures == 1
        assert idle_audit(eng) == []
        assert text(eng, reference["A"][0]) == reference["A"][1]
        eng.runner.decode = once(eng.runner.decode)
        assert ask(eng, B).reason == "error"
        assert idle_audit(eng) == []
        assert text(eng, reference["B"][0]) == reference["B"][1]
        assert idle_audit(eng) == []
    finally:
        eng.stop()


def test_host_tier_size_too_small_names_the_setting():
    """A ceiling below the host state-slot floor is a ConfigError naming host_kv_mib (the CLI names the flag),
    not a ValueError from inside the arena; None sizes it from the machine and always holds the floor."""
    from ninfer_mlc.runtime.assemble import host_tier_mib
    from ninfer_mlc.runtime.errors import ConfigError
    from ninfer_mlc.runtime.executor.model_runner import ModelRunner

    runner = ModelRunner(ART)
    slot_mib = runner.layout.state_slot_bytes / 2**20
    with pytest.raises(ConfigError) as e:
        host_tier_mib(EngineConfig(host_kv_mib=slot_mib, host_state_slots=4), runner)
    assert e.value.field == "host_kv_mib" and "host state slots" in str(e.value)
    assert host_tier_mib(EngineConfig(host_kv_mib=0), runner) == 0
    assert host_tier_mib(EngineConfig(), runner) == 1024  # CPU: 1024 MiB (the tiny model's slot floor is far below)
    runner.device_kind = "cuda"  # the CUDA rule: a quarter of MemAvailable, never below the floor + 1 GiB
    big = EngineConfig(host_state_slots=10_000)
    assert host_tier_mib(big, runner) >= 10_000 * slot_mib + 1024
