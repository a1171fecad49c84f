"""Host time between speculative rounds (issue 16), measured on the CPU with the embedded tiny model.

A device round's GPU work ends at the round's read; until the next round's first launch the GPU idles while
the host commits, plans and stages (SpecCounters.gap_s). On the CPU (llvm) every call is synchronous, so the
same counter holds the host's work plus the few device calls inside the gap (GDN replay, state snapshot),
which is what this script measures and profiles: MTP k drafts, forced acceptance (spec/forced.py), greedy,
one request with a long prompt (per-step work that grows with the context shows up), the engine's step loop
driven in this thread so cProfile sees it.

  .venv/bin/python bench/spec_host_gap.py [--ctx 6000] [--gen 400] [--breakdown] [--profile 25] [--json OUT]
  GPU (same counters on the 27B forced-profile artifact, runtime-only TVM as bench/gpu_driver.sh sets it up):
  python3 bench/spec_host_gap.py --device cuda --model .gpu/spec/q27b-taps --ctx 8192 --gen 200 --breakdown

Prints: rounds, gap ms per round (mean, and p50 over the measured pass: the host is noisy), the round's phases, host ms per round
outside the round's own calls (loop + schedule + commit: what the engine adds between two rounds), and with
--profile N the top N functions by cumulative and by own time over the measured pass.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _drive(eng, prompt: list[int], gen: int) -> list[int]:
    """Submit one greedy request and run the engine's loop body in this thread until it ends."""
    from ninfer_mlc.runtime.engine import GenRequest
    from ninfer_mlc.runtime.sampling import SamplingParams

    h = eng.submit(GenRequest(list(prompt), SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)))
    while h.finished is None:
        inbox, eng._inbox = list(eng._inbox), type(eng._inbox)()
        eng.timer.start()
        for r in inbox:
            eng.scheduler.add(r)
        eng.timer.lap("loop")
        eng._step()
    return [t for ev in h.iter_sync(timeout=1) if hasattr(ev, "token_ids") for t in ev.token_ids]


def _record_gaps(eng) -> list:
    """Every gap's seconds as the decoder adds it to SpecCounters.gap_s (for a median: the host is noisy)."""
    from ninfer_mlc.runtime.stats import SpecCounters

    samples: list = []

    class Recording(SpecCounters):
        def __setattr__(self, name, value):
            if name == "gap_s":
                samples.append(value - self.gap_s)
            super().__setattr__(name, value)

    c = eng.spec_counters
    rec = Recording(**{f: getattr(c, f) for f in c.__dataclass_fields__})
    eng.spec_counters = eng.spec.counters = rec
    return samples


def _gap_breakdown(eng) -> dict:
    """Wrap the calls that run between a device round's read and the next launch; each accumulates its
    inclusive seconds while the decoder is inside a gap (its _read_at is set). Returns {label: [seconds, calls]}."""
    import time as _t

    from ninfer_mlc.runtime.spec import decoder as dec_mod

    spec, acc = eng.spec, {}

    def wrap(owner, name, label):
        fn = getattr(owner, name)
        acc.setdefault(label, [0.0, 0])

        def timed(*args, **kw):
            if spec._read_at is None:
                return fn(*args, **kw)
            t0 = _t.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                acc[label][0] += _t.perf_counter() - t0
                acc[label][1] += 1
        setattr(owner, name, timed)

    r, kv, sch = eng.runner, eng.kv, eng.scheduler
    for owner, name, label in (
            (r, "split_rows", "accept: split_rows (hidden read)"), (dec_mod, "accept_argmax", "accept: accept_argmax"),
            (sch, "update", "commit: Scheduler.update"), (sch, "_commit", "commit:  _commit (tokens)"),
            (spec, "settle", "commit:  spec.settle"), (spec.proposer, "after_verify", "commit:   proposer.after_verify"),
            (spec, "flush_replays", "flush_replays"), (r, "replay_gdn", "  runner.replay_gdn"),
            (r.replay_inputs, "stage", "   replay_inputs.stage"), (sch, "schedule", "schedule()"),
            (kv, "snapshot_state", "round: kv.snapshot_state"), (spec, "_device_round", "round: _device_round"),
            (spec, "_propose", "round: _propose (stage chain)"), (r, "stage_draft_chain", "round:  runner.stage_draft_chain"),
            (r, "stage_verify", "round: runner.stage_verify"), (r.round_uploads, "send", "round: uploads.send"),
            (eng.timer, "lap", "timer.lap"), (eng.timer, "record", "timer.record")):
        wrap(owner, name, label)

    class _VM:  # the compute of the replay (device work: synchronous on the CPU, queued on CUDA)
        def __init__(self, vm):
            self._vm = vm

        def __getitem__(self, name):
            fn = self._vm[name]
            if name != "gdn_replay":
                return fn
            holder = type("H", (), {})()
            holder.fn = fn
            wrap(holder, "fn", "  (gdn_replay kernel)")
            return holder.fn

        def __getattr__(self, name):
            return getattr(self._vm, name)
    r.vm = _VM(r.vm)
    return acc


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="artifact (default: the embedded tiny model)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda / auto for a GPU artifact (the per-call breakdown then "
                   "shows host time plus any wait for the device inside a call)")
    p.add_argument("--ctx", type=int, default=6000, help="prompt tokens")
    p.add_argument("--gen", type=int, default=400, help="generated tokens per pass")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--forced", type=float, default=3.18, help="forced tokens per round (0: the model's acceptance)")
    p.add_argument("--profile", type=int, default=0, help="print the top N functions of the measured pass")
    p.add_argument("--breakdown", action="store_true", help="time the gap's calls (inclusive ms per gap)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)

    import numpy as np

    from ninfer_mlc.runtime.assemble import open_engine
    from ninfer_mlc.runtime.config import EngineConfig
    from ninfer_mlc.runtime.stats import phase_ms

    if a.model is None:
        from ninfer_mlc.paths import default_model_dir

        a.model = str(default_model_dir())
    cfg = EngineConfig(device=a.device, max_concurrency=1, max_pending_requests=1, max_context=a.ctx + a.gen + 64, host_kv_mib=0,
                       prefix_reuse=False, spec="mtp", draft_tokens=a.k,
                       forced_acceptance=a.forced or None)
    eng = open_engine(a.model, cfg, start=False)
    gap_samples = _record_gaps(eng)
    eng._running = True  # submit() accepts; the loop body runs in this thread (_drive)
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, eng.runner.sample_vocab, a.ctx).tolist()
    _drive(eng, prompt, a.gen)  # warm-up pass: first calls, buffer growth, CUDA graph captures at these widths
    acc = _gap_breakdown(eng) if a.breakdown else None
    before, steps_before = eng._take_stats(), eng.timer.summary()
    del gap_samples[:]
    prof = cProfile.Profile() if a.profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    toks = _drive(eng, prompt, a.gen)
    if prof is not None:
        prof.disable()
    wall = time.perf_counter() - t0
    st = eng._take_stats()
    sp, b = st.spec, before.spec
    rounds = sp.rounds - b.rounds
    gaps = sp.gaps - b.gaps
    host = st.host_step
    n_steps = host["steps"] - steps_before["steps"]
    between = {ph: (host[f"{ph}_sum_ms"] - steps_before[f"{ph}_sum_ms"]) / max(1, n_steps)
               for ph in ("loop", "schedule", "commit", "detok", "emit")}
    out = {"ctx": a.ctx, "gen": a.gen, "k": a.k, "forced": a.forced, "tokens": len(toks), "rounds": rounds,
           "tokens_per_round": round((sp.emitted_tokens - b.emitted_tokens) / max(1, rounds), 3),
           "ms_per_round": round(wall * 1e3 / max(1, rounds), 3),
           "gap_ms_per_round": round((sp.gap_s - b.gap_s) * 1e3 / max(1, gaps), 4), "gaps": gaps,
           "gap_ms_p50": round(float(np.median(gap_samples)) * 1e3, 4) if gap_samples else 0.0,
           "phase_ms_per_round": phase_ms(sp, rounds, b),
           "engine_ms_per_step": {k: round(v, 4) for k, v in between.items()}}
    if acc is not None:
        out["gap_breakdown_ms_per_gap"] = {k: round(v[0] * 1e3 / max(1, gaps), 4) for k, v in acc.items()}
        device = sum(v[0] for k, v in acc.items() if "kernel" in k)
        out["gap_ms_less_replay_kernel"] = round(((sp.gap_s - b.gap_s) - device) * 1e3 / max(1, gaps), 4)
    print(json.dumps(out, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    if prof is not None:
        for key in ("cumulative", "tottime"):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(key).print_stats(a.profile)
            print(s.getvalue())
    eng._running = False
    return 0


if __name__ == "__main__":
    sys.exit(main())
