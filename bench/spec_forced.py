"""Speculative rounds at FORCED acceptance profiles, through the engine (bench/spec_gpu_bench.py part (c)).

Random weights give no real acceptance, so the decoder's benchmark-only forced acceptance
(runtime/spec/forced.py) keeps a set number of drafts per round whatever the target says; every result
row names its profile. What is measured is the engine's real round: proposer, one batched verify,
acceptance, rollback and re-feed of what a round did not keep, host syncs.

  prep   OUT/q27b-taps/      the Qwen3.x-27B geometry (gpu_bench.Q27B) WITH its MTP head and the tap layers
                             5/19/33/47/61, `ninfer compile --random-weights` (weights drawn on the GPU at load)
         OUT/dflash2-27b/    a DFlash2 drafter of the Qwen3.8-27B-DFlash2 shape (QWEN38_DFLASH2: block 8, those
                             taps, 5 layers), random weights too
  run    one target runner shared by engines for: no speculation; MTP k=3 forced to 3.18 and 3.4 tokens per
         round (the incumbent's code / reasoning profiles); DFlash2 k=7 forced to 5.4 (its published
         acceptance length); each at every batch, prompts of --ctx tokens, --gen greedy tokens (ignore EOS).

Per row: decode tokens/s per request, aggregate tokens/s, rounds per request, tokens per row-round (all
rounds) and per drafting round (rounds that re-feed rolled-back tokens without drafting are counted in
the first), ms per round, a round's cost in plain decode steps and the speedup over no speculation, and
the round's phases in ms (runtime/stats.py SpecCounters: snapshot, propose, verify, accept, settle, glue), and the
steady decode rate per request (while every request of the row decodes: at batch > 1 a request's own rate also
covers steps that carried the others' prefill chunks) with its speedup; batch > 1 rows need enough generated tokens
(--forced-gen) for such a window to exist.
With lm_head_draft (`--forced-lm-head-draft N|FILE`): every MTP profile also runs with the shortlisted proposal
head (EngineConfig.lm_head_draft), rows labelled "<profile> head<N>" and carrying lm_head_draft and
head_on_device (whether the draft chain ran over the head on the device: a library built before
mtp_step_hd drafts with a shortlist in host rounds only), beside the full-head rows.
"""
from __future__ import annotations

import json
import shutil
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

import numpy as np

TAPS = [5, 19, 33, 47, 61]
# The drafter: Qwen3.8-27B-DFlash2's published shape (block 8, taps 5/19/33/47/61, 5 layers, selector rank 256,
# top-16 candidates, 2-tap convolutions in groups of 16). Its layer pattern and window are not published; this
# takes Qwen3.6-27B-DFlash's [S, S, S, S, F] with a 2048-token window (research/anchors_2.md section 1).
QWEN38_DFLASH2 = {
    "architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "vocab_size": 248320, "hidden_size": 5120,
    "intermediate_size": 17408, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "rms_norm_eps": 1e-6, "hidden_act": "silu", "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0},
    "layer_types": ["sliding_attention"] * 4 + ["full_attention"], "use_sliding_window": True,
    "sliding_window": 2048, "num_target_layers": 64,
    "dflash_config": {"target_layer_ids": TAPS, "block_size": 8, "mask_token_id": 248070, "conv_kernel_size": 2,
                      "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16},
}
# (label, spec, draft tokens, forced tokens per round)
PROFILES = [("none", "none", 0, None), ("mtp3@3.18", "mtp", 3, 3.18), ("mtp3@3.4", "mtp", 3, 3.4),
            ("dflash2-b8@5.4", "dflash2", 7, 5.4)]


def prep_forced(out: Path, arch: str, quant: str, max_context: int, log=print) -> None:
    """Build OUT/q27b-taps and OUT/dflash2-27b (random weights: only config.json and the tokenizer go in)."""
    import gpu_bench
    from wide_tokenizer import widen

    from ninfer_mlc.compile.build import compile_model
    from ninfer_mlc.compile.tiny_default import generate

    with tempfile.TemporaryDirectory(prefix="ninfer_forced_") as tmp:
        tmp = Path(tmp)
        tiny = generate(tmp / "tiny")  # a tokenizer for the engine (prompts are ids; its vocabulary bounds sampling)
        tgt, drf = tmp / "q27b", tmp / "dflash2"
        tgt.mkdir()
        drf.mkdir()
        for f in ("tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
            if (tiny / f).is_file():
                shutil.copy2(tiny / f, tgt / f)
        # widened to the full vocabulary (bench/wide_tokenizer.py): the engine samples, and the DFlash2 selector
        # takes its top-K, over the ids the tokenizer can produce; 2,000 would hide those costs
        wide = widen(json.loads((tiny / "tokenizer.json").read_text()), gpu_bench.Q27B["vocab_size"])
        (tgt / "tokenizer.json").write_text(json.dumps(wide, ensure_ascii=False))
        (tgt / "config.json").write_text(json.dumps(dict(gpu_bench.Q27B, mtp_num_hidden_layers=1)))
        (drf / "config.json").write_text(json.dumps(QWEN38_DFLASH2))
        t0 = time.time()
        compile_model(tgt, target="cuda:" + arch, quant=quant, max_context=max_context, out_dir=out / "q27b-taps",
                      name="q27b-taps", random_weights=1, tap_layers=",".join(map(str, TAPS)),
                      log=lambda *m: log("q27b-taps:", *m))
        drafter_quant = "bf16" if quant in ("bf16", "nvfp4") else quant
        compile_model(drf, target="cuda:" + arch, quant=drafter_quant, out_dir=out / "dflash2-27b",
                      name="dflash2-27b", random_weights=2, log=lambda *m: log("dflash2-27b:", *m))
        log(f"forced-profile artifacts in {time.time() - t0:.1f}s")


def _engine(runner, kv, tok, cfg):
    from ninfer_mlc.runtime.engine import Engine

    return Engine(runner, kv, tok, cfg, []).start()


def gpu_timeline(kernels: list[tuple[float, float, str]], window_us: float) -> dict:
    """Where the device idles in the last window_us of a kernel timeline [(start us, end us, name)]: the busy
    fraction (union of kernel intervals), and the idle gaps of >= 50 us summed by the kernels around them."""
    ks = sorted(kernels)
    if not ks:
        return {}
    end = max(e for _, e, _ in ks)
    ks = [k for k in ks if k[1] > end - window_us]
    busy, cur_s, cur_e, prev = 0.0, ks[0][0], ks[0][1], ks[0][2]
    gaps: dict = {}
    for st, en, name in ks[1:]:
        if st > cur_e:
            busy += cur_e - cur_s
            if st - cur_e >= 50:
                key = f"{prev[:48]} -> {name[:48]}"
                g = gaps.setdefault(key, [0, 0.0])
                g[0] += 1
                g[1] += st - cur_e
            cur_s, cur_e = st, en
        else:
            cur_e = max(cur_e, en)
        if en >= cur_e:
            prev = name
    busy += cur_e - cur_s
    span = end - ks[0][0]
    top = sorted(gaps.items(), key=lambda kv: -kv[1][1])[:10]
    by_name: dict = {}
    for st, en, name in ks:
        e = by_name.setdefault(name[:64], [0, 0.0])
        e[0] += 1
        e[1] += en - st
    busiest = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
    return {"window_us": round(span, 1), "busy_us": round(busy, 1), "busy_fraction": round(busy / span, 4),
            "kernels": len(ks), "idle_gaps": [{"between": k, "count": c, "us": round(t, 1)} for k, (c, t) in top],
            "top_kernels": [{"kernel": k, "count": c, "us": round(t, 1)} for k, (c, t) in busiest]}


def _profiled(run) -> list[tuple[float, float, str]]:
    """run() under torch's CUPTI profiler: [(start us, end us, kernel name)] (TVM's kernels included)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    out = []
    for e in prof.events():
        if str(getattr(e, "device_type", "")).endswith("CUDA") and e.time_range.end > e.time_range.start:
            out.append((float(e.time_range.start), float(e.time_range.end), e.name))
    return out


def steady_decode_rate(arrivals: list) -> Optional[float]:
    """Tokens/s per request while EVERY request decodes: from the last request's first token to the first request's
    last one, the tokens all requests received in that window over its length, divided by their number. A request's
    decode rate from its own first token (timings predicted_per_second) also covers steps that carried other
    requests' prefill chunks, so at batch > 1 it mixes prefill into the decode figure. None when no such window exists
    (a request finished before the last one started decoding: generate more tokens)."""
    if not arrivals or any(len(a) < 2 for a in arrivals):
        return None
    lo = max(a[0][0] for a in arrivals)
    hi = min(a[-1][0] for a in arrivals)
    if hi <= lo:
        return None
    n = sum(k for a in arrivals for t, k in a if lo < t <= hi)
    return round(n / (hi - lo) / len(arrivals), 2)


def _measure(eng, prompts, gen: int, profile_window_ms: float = 0.0) -> dict:
    """Warm-up pass (first-call costs, CUDA graph captures at these page widths), then the measured pass.
    profile_window_ms: a third pass under the CUPTI profiler, its last window_ms summarised (gpu_timeline)."""
    from ninfer_mlc.runtime.engine import GenRequest
    from ninfer_mlc.runtime.sampling import SamplingParams

    arrivals: list = []  # per request of the measured pass: [(perf_counter, tokens)] of its token events

    def once():
        hs = [eng.submit(GenRequest(list(p), SamplingParams(temperature=0, max_tokens=gen, ignore_eos=True)))
              for p in prompts]
        t0 = time.perf_counter()
        seen: list = [[] for _ in hs]
        arrivals[:] = [[] for _ in hs]

        def drain(i):  # a thread per request, so every token event is stamped when it arrives
            for ev in hs[i].iter_sync(timeout=1800):
                if hasattr(ev, "token_ids"):
                    seen[i].extend(ev.token_ids)
                    arrivals[i].append((time.perf_counter(), len(ev.token_ids)))

        threads = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(len(hs))]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return time.perf_counter() - t0, [h.finished for h in hs], seen

    once()
    before = eng.stats().spec
    wall, fins, toks = once()
    steady = steady_decode_rate(arrivals)
    sp = eng.stats().spec
    rows = sp.row_rounds - before.row_rounds
    drafting = rows - (sp.no_draft_rounds - before.no_draft_rounds)
    emitted = sp.emitted_tokens - before.emitted_tokens
    t = [f.timings for f in fins]
    pred_ms = float(np.mean([x["predicted_ms"] for x in t]))
    out = {"requests": len(prompts), "wall_s": round(wall, 3),
           "decode_tokens_per_s_per_request": round(float(np.mean([x["predicted_per_second"] for x in t])), 2),
           "aggregate_tokens_per_s": round(sum(x["predicted_n"] for x in t) / wall, 2),
           "predicted_ms_per_request": round(pred_ms, 2), "forced_acceptance": t[0].get("draft_forced_acceptance"),
           "steady_decode_tokens_per_s_per_request": steady, "tokens": toks}
    if rows:
        per_req_rounds = rows / len(prompts)
        out.update({"row_rounds": rows, "drafting_row_rounds": drafting,
                    "tokens_per_round": round(emitted / rows, 3),
                    "tokens_per_drafting_round": round((sp.accepted_tokens - before.accepted_tokens) / max(1, drafting)
                                                       + 1, 3),
                    "rounds_per_request": round(per_req_rounds, 2),
                    "ms_per_round": round(pred_ms / per_req_rounds, 3),
                    # rollbacks by GDN state replay (no re-feed) vs re-fed rows (libraries without gdn_replay)
                    "state_replays": sp.state_replays - before.state_replays,
                    "recompute_tokens": sp.recompute_tokens - before.recompute_tokens})
    rounds = sp.rounds - before.rounds
    if rounds:  # where a round's time goes (runtime/stats.py SpecCounters phases), per engine round
        from ninfer_mlc.runtime.stats import phase_ms

        out["device_rounds"] = sp.device_rounds - before.device_rounds
        out["device_drafts"] = sp.device_drafts - before.device_drafts  # rounds whose draft chain ran on the device
        out["phase_ms_per_round"] = phase_ms(sp, rounds, before)
    if profile_window_ms > 0:
        try:
            out["gpu_timeline"] = gpu_timeline(_profiled(once), profile_window_ms * 1e3)
        except Exception as e:  # noqa: BLE001 - profiling is optional
            out["gpu_timeline"] = {"error": repr(e)[:300]}
    return out


def head_label(lm_head_draft: str) -> str:
    """Row label suffix of the shortlisted-head profiles: head<N>, or head:<file name>."""
    spec = str(lm_head_draft).strip()
    return f"head{spec}" if spec.isdigit() else f"head:{Path(spec).name}"


def run_forced(target_dir: Path, drafter_dir: Optional[Path], ctx: int, gen: int, batches: list[int], deadline: float,
               device: str = "auto", log=print, save=lambda: None, host_check: bool = True,
               refeed_max: Optional[int] = None, profile_window_ms: float = 0.0,
               lm_head_draft: Optional[str] = None) -> dict:
    """host_check: every speculative row is run again with its rounds on the host (device_sampling off: the
    host-side rounds, for comparison) and the two outputs compared (device_matches_host: forced rows keep the
    device-chosen drafts and the target's argmax, so any difference is a device-round bug).
    refeed_max: also run every speculative profile with this re-feed bound (EngineConfig.spec_refeed_max; rows
    labelled "refeed N"): rounds that keep drafting after rejections, at the cost of longer verifies.
    profile_window_ms: batch-1 rows also get a CUPTI timeline of their last window (gpu_timeline).
    drafter_dir None: no DFlash2 profiles. lm_head_draft: every MTP profile again with this shortlisted head."""
    from ninfer_mlc.runtime.assemble import open_engine
    from ninfer_mlc.runtime.config import EngineConfig

    b_max = max(batches)
    cfg = EngineConfig(device=device, max_concurrency=b_max, max_pending_requests=b_max, max_context=ctx + gen + 64,
                       kv_capacity=str(b_max * (ctx + gen + 256)), prefix_reuse=False, prefill_chunk=2048,
                       spec="mtp", draft_tokens=3)
    from ninfer_mlc.runtime.spec.dflash_runner import attach_paged_pool

    t0 = time.time()
    # opened as a speculative engine (MTP: no drafter to load) so the runner has its slot count: one
    # pre-verification snapshot slot per lane; with only the plain engine's slots no row of a full batch
    # could take a snapshot, and full batches would never draft
    base = open_engine(target_dir, replace(cfg, spec="mtp", draft_model=None, draft_tokens=3), start=False)
    runner, kv, tok = base.runner, base.kv, base.tok
    del base
    if drafter_dir is not None:
        attach_paged_pool(runner, drafter_dir)  # the drafter's paged layers on the target's page ids
    res = {"target": str(target_dir), "drafter": str(drafter_dir) if drafter_dir is not None else None, "ctx": ctx,
           "gen": gen, "lm_head_draft": lm_head_draft,
           "random_weights": bool(runner.random_weights), "load_seconds": round(time.time() - t0, 2),
           "rows": [], "skipped": []}
    rng = np.random.default_rng(0)
    prompts = rng.integers(10, runner.sample_vocab, (b_max, ctx)).tolist()
    plain = {}
    profiles = [(label, spec, k, forced, None) for label, spec, k, forced in PROFILES
                if spec != "dflash2" or drafter_dir is not None]
    if lm_head_draft is not None:  # each MTP profile with the shortlisted head, after the full-head one
        profiles = [r for x in profiles for r in ([x] if x[1] != "mtp" else
                                                  [x, (f"{x[0]} {head_label(lm_head_draft)}", *x[1:4], lm_head_draft)])]
    runs = [(label, spec, k, forced, "auto", None, head) for label, spec, k, forced, head in profiles]
    if host_check:  # after every device-round run: the same profile with host rounds
        runs = [r for x in runs for r in ([x] if x[1] == "none" else [x, (x[0] + " host", *x[1:4], "off", None, x[6])])]
    if refeed_max is not None:
        runs += [(f"{label} refeed {refeed_max}", spec, k, forced, "auto", refeed_max, head)
                 for label, spec, k, forced, head in profiles if spec != "none"]
    device_tokens = {}
    for label, spec, k, forced, sampling, refeed, head in runs:
        pc = replace(cfg, spec=spec, draft_tokens=max(k, 1), forced_acceptance=forced, device_sampling=sampling,
                     spec_refeed_max=refeed, draft_model=str(drafter_dir) if spec == "dflash2" else None,
                     lm_head_draft=head)
        for b in batches:
            if time.time() > deadline:
                res["skipped"].append({"profile": label, "batch": b})
                log(f"forced {label} b={b}: skipped (budget)")
                continue
            eng = _engine(runner, kv, tok, pc)
            try:
                row = {"profile": label, "spec": spec, "draft_tokens": k, "batch": b, **_measure(eng, prompts[:b], gen,
                                                                                             profile_window_ms if b == 1 else 0.0)}
                if head is not None:  # the shortlisted proposal head (runtime/executor/draft_head.py)
                    proposer = getattr(getattr(eng, "spec", None), "proposer", None)
                    row["lm_head_draft"] = head
                    row["head_on_device"] = bool(getattr(proposer, "device_head", False))
                    if runner.draft_head is not None:
                        row["head_rows"] = runner.draft_head.rows
            finally:
                eng.stop()
            toks = row.pop("tokens")
            # CUDA-graph counters so far (cumulative over the runs): replays vs eager calls of the round's functions
            row["graphs"] = {n: dict(g.stats) for n in ("decode_graphs", "verify_graphs", "verify_t_graphs", "mtp_graphs",
                                                       "mtp_hd_graphs", "replay_graphs")
                             if (g := getattr(runner, n, None)) is not None}
            dr = getattr(getattr(getattr(eng, "spec", None), "proposer", None), "dr", None)  # a DFlash drafter's
            for n in ("ctx_graphs", "draft_graphs"):
                if (g := getattr(dr, n, None)) is not None:
                    row["graphs"]["drafter_" + n] = dict(g.stats)
            if refeed is not None:
                pass  # another round structure: forced rows keep other tokens
            elif sampling == "auto":
                device_tokens[(spec, forced, head, b)] = toks
            elif (spec, forced, head, b) in device_tokens:
                row["device_matches_host"] = device_tokens[(spec, forced, head, b)] == toks
            if spec == "none":
                plain[b] = row
            elif b in plain:
                p = plain[b]
                step_ms = p["predicted_ms_per_request"] / max(1, gen - 1)
                row["plain_step_ms"] = round(step_ms, 3)
                if "ms_per_round" in row:
                    row["round_cost_in_plain_steps"] = round(row["ms_per_round"] / step_ms, 3)
                row["speedup"] = round(row["decode_tokens_per_s_per_request"] / p["decode_tokens_per_s_per_request"], 3)
                if row.get("steady_decode_tokens_per_s_per_request") and p.get("steady_decode_tokens_per_s_per_request"):
                    row["steady_speedup"] = round(row["steady_decode_tokens_per_s_per_request"]
                                                  / p["steady_decode_tokens_per_s_per_request"], 3)
            res["rows"].append(row)
            log("forced " + json.dumps(row))
            save()
    return res


def print_forced(res: dict) -> None:
    if not res or not res.get("rows"):
        return
    print(f"\n(c) forced acceptance through the engine ({res['target']}, ctx {res['ctx']}, {res['gen']} greedy tokens"
          f"{', RANDOM weights' if res.get('random_weights') else ''}): FORCED profiles, not the model's acceptance")
    print("  profile (\"host\": rounds on the host, device_sampling off)")
    if res.get("lm_head_draft") is not None:
        print(f"  (\"{head_label(res['lm_head_draft'])}\": MTP drafts over the shortlisted proposal head "
              f"--lm-head-draft {res['lm_head_draft']}; lossless, only the drafts change)")
    print("  (steady: tok/s per request while every request of the row decodes, and its speedup; - where no such window)")
    print("  profile                   b  tok/s/req  agg tok/s  tok/round  tok/draft-round  ms/round  round/plain-steps  speedup"
          "  steady tok/s/req  steady speedup")
    for r in res["rows"]:
        st, ss = r.get("steady_decode_tokens_per_s_per_request"), r.get("steady_speedup", 1.0 if r["spec"] == "none" else None)
        print(f"  {r['profile']:24s} {r['batch']:2d}  {r['decode_tokens_per_s_per_request']:9.1f}  "
              f"{r['aggregate_tokens_per_s']:9.1f}  {r.get('tokens_per_round', 1.0):9.2f}  "
              f"{r.get('tokens_per_drafting_round', 1.0):15.2f}  {r.get('ms_per_round', float('nan')):8.2f}  "
              f"{r.get('round_cost_in_plain_steps', 1.0):17.2f}  {r.get('speedup', 1.0):7.2f}"
              f"  {'-' if st is None else f'{st:16.1f}'}  {'-' if ss is None else f'{ss:14.2f}'}"
              + ("" if "device_matches_host" not in r else
                 "  device rounds = host rounds" if r["device_matches_host"] else "  DEVICE ROUNDS DIFFER FROM HOST"))
        if r.get("phase_ms_per_round"):
            print("      ms/round by phase: " + "  ".join(f"{k} {v:.2f}" for k, v in r["phase_ms_per_round"].items())
                  + f"  (device rounds {r.get('device_rounds', 0)}, device draft chains {r.get('device_drafts', 0)})"
                  + ("" if "lm_head_draft" not in r else
                     f"  head {r.get('head_rows', '?')} ids, " + ("on the device" if r.get("head_on_device") else
                                                                 "HOST ROUNDS ONLY (library predates mtp_step_hd)")))
        tl = r.get("gpu_timeline") or {}
        if tl.get("busy_fraction") is not None:
            print(f"      GPU busy {100 * tl['busy_fraction']:.1f} % of the last {tl['window_us'] / 1e3:.0f} ms "
                  f"({tl['kernels']} kernels); idle gaps >= 50 us:")
            for g in tl["idle_gaps"][:8]:
                print(f"        {g['us'] / 1e3:7.2f} ms in {g['count']:3d}  {g['between']}")
            print("      busiest kernels:")
            for g in tl.get("top_kernels", [])[:12]:
                print(f"        {g['us'] / 1e3:7.2f} ms in {g['count']:4d}  {g['kernel']}")
