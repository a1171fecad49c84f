"""GPU check and timing of the CUDA chunked GDN prefill kernel (compile/kernels/cuda/gdn.py, gdn_chunk).

  prep OUT [--arch sm_90] [--baseline REV|none]
        (here: nvcc + stub libcuda) OUT/gdn.so: gdn_chunk for the tiny geometry (Hk 2, Hv 6, dk 16,
        dv 8) and the 27B geometry (16, 48, 128, 128), both with a 2-layer state pool, plus the
        old kernel as gdn_q27_old for a same-GPU speed and error comparison: by default (REV simt)
        the SIMT sequential pass of this tree (mma=False, the kernel before the tensor-core pass),
        else gdn.py of git revision REV. OUT/gdn.npz: inputs and llvm-kernel outputs of the small
        cases (OUT < 10 MB); OUT/gdn.json: the case list.
  run OUT RESULT.json
        (GPU machine, runtime-only TVM + numpy + torch) every case: max relative error of o and of
        the new state vs the llvm kernel (small cases) and vs a float64 torch token recurrence
        (all cases); untouched state entries must stay bit-identical. Big cases (27B geometry,
        inputs generated on the GPU from a seed): time per call of the new and the old kernel.
        Prints a table last; exit status 1 if a check fails.
  emulate [--full]
        (here, g++; no GPU) the generated CUDA source of gdn_chunk run on the CPU emulator of
        ninfer_mlc.compile.kernels.cuda.emulate (a fiber per CUDA thread, blocks in sequence, barriers,
        shuffles and mma.sync m16n8k8 tf32 (and its 3xTF32 split) as warp collectives, shared arrays and
        workspaces NaN-filled), compared with the llvm kernel. Quick: small geometries that cover 1, 4
        and 8 lanes per state column (SIMT) and the tensor-core launches with 1, 2, 4 n tiles, 3xTF32 and
        plain tf32; --full adds dk = dv = 128 with 6 and 48 value heads (tensor cores).

Inputs (ninfer_mlc.compile.kernels.cuda.emulate.gdn.inputs) follow the model: q, k l2-normalised, beta in
(0.1, 0.9), g < 0, "strong" or "mixed" decays.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

import gpu_common as gc
from ninfer_mlc.compile.kernels.cuda.emulate.gdn import (
    LAYER, LAYERS, inputs, layout, llvm_kernels, llvm_outputs, rel_err, run_emulation, state_init,
)

GEO = {"tiny": (2, 6, 16, 8), "q27": (16, 48, 128, 128)}
BASELINE_REV = "simt"  # the SIMT sequential pass of this tree (else a git revision of gdn.py)
# small cases: inputs and llvm outputs travel in gdn.npz
SMALL = [
    dict(name="tiny_strong", geo="tiny", lens=[150, 64, 1, 33], decay="strong", seed=1),
    dict(name="tiny_mixed", geo="tiny", lens=[150, 0, 64, 1, 33], decay="mixed", seed=2),
    dict(name="q27_ragged", geo="q27", lens=[70, 33, 5], decay="mixed", seed=3),
]
# big cases: generated on the GPU from the seed, checked against torch, timed
BIG = [
    dict(name="q27_2048", geo="q27", lens=[2048], seed=11),
    dict(name="q27_8192", geo="q27", lens=[8192], seed=12),
    dict(name="q27_4x2048", geo="q27", lens=[2048] * 4, seed=13),
    dict(name="q27_ragged4k", geo="q27", lens=[3000, 1, 1000, 17], seed=14),
]
DEVICE = "cuda"  # torch device of `run` (a CPU dry run of the script logic sets "cpu")
# layout variants of the 27B kernel timed (and checked) next to the default one: the knobs of
# chunked_delta_rule (chunk, state_tile = value columns per block of the sequential pass, ept = state
# rows per thread); the fastest goes into the registry defaults / schedules/cuda_<arch>.json
# tensor-core pass: mma_tile (32 default, 16, 8), tf32x3 False = one tf32 mma per product (faster,
# ~1e-3 error: checked against the relaxed TF32_TOL); "tol" is not a kernel argument
TF32_TOL = 2e-3
VARIANTS = {"t16": dict(mma_tile=16), "t8": dict(mma_tile=8), "tf32": dict(tf32x3=False, tol=TF32_TOL),
            "tf32t16": dict(tf32x3=False, mma_tile=16, tol=TF32_TOL),
            # timing breakdown (no check): one of the two launches alone, new and old kernel
            "pass1": dict(passes=1, timing=True), "pass2": dict(passes=2, timing=True),
            "old_p1": dict(mma=False, passes=1, timing=True), "old_p2": dict(mma=False, passes=2, timing=True)}


def _kw(v: dict) -> dict:
    return {k: x for k, x in v.items() if k not in ("tol", "timing")}


STATE_SAMPLE = 7  # q27_ragged: every 7th entry of the updated slots' state goes into the npz


def _small_inputs(case):
    return inputs(GEO[case["geo"]], case["lens"], case["decay"], case["seed"])


def _ssm_shape(case):
    hk, hv, dk, dv = GEO[case["geo"]]
    return (len(case["lens"]) + 1, LAYERS, hv, dk, dv)


def _load_baseline(rev: str):
    """compile/kernels/cuda/gdn.py at git revision rev, as a module (TVMScript needs a real file)."""
    return gc.module_at_rev(rev, "compile/kernels/cuda/gdn.py", "gdn_old")


def cmd_prep(a) -> int:
    import tvm

    from ninfer_mlc.compile.kernels.cuda import gdn
    from ninfer_mlc.compile.targets import cuda_build_env, parse_target

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    funcs = {f"gdn_{g}": gdn.chunked_delta_rule(*geo, LAYERS) for g, geo in GEO.items()}
    for v, kw in VARIANTS.items():
        funcs[f"gdn_q27_{v}"] = gdn.chunked_delta_rule(*GEO["q27"], LAYERS, **_kw(kw))
    if a.baseline == "simt":
        funcs["gdn_q27_old"] = gdn.chunked_delta_rule(*GEO["q27"], LAYERS, mma=False)
    elif a.baseline != "none":
        old = _load_baseline(a.baseline)
        funcs["gdn_q27_old"] = old.chunked_delta_rule(*GEO["q27"], LAYERS)
    funcs = {k: f.with_attr("global_symbol", k) for k, f in funcs.items()}
    tgt = parse_target("cuda:" + a.arch).tvm_target()
    with cuda_build_env(tgt):
        ex = tvm.compile(tvm.IRModule(funcs), target=tgt)
    ex.export_library(str(out / "gdn.so"))
    print(f"built {sorted(funcs)} for {a.arch} in {time.time() - t0:.1f}s", flush=True)

    refs = llvm_kernels(GEO.values())
    data = {}
    for c in SMALL:
        x = _small_inputs(c)
        ssm = state_init(_ssm_shape(c))
        ref_o, ref_s = llvm_outputs(refs[GEO[c["geo"]]], x, ssm)
        for key, val in x.items():
            data[f"{c['name']}/{key}"] = val
        data[f"{c['name']}/ref_o"] = ref_o
        new = ref_s[x["slot"], LAYER]  # the updated slots (other entries must stay as they were)
        if c["geo"] == "tiny":
            data[f"{c['name']}/ref_state"] = new
        else:
            data[f"{c['name']}/ref_state_sample"] = new.reshape(-1)[::STATE_SAMPLE]
        changed = np.argwhere((ref_s != ssm).reshape(ssm.shape[0], -1).any(1)).ravel()
        assert set(changed.tolist()) <= set(x["slot"].tolist()), "llvm kernel touched other slots"
    np.savez_compressed(out / "gdn.npz", **data)
    meta = {"arch": a.arch, "baseline": a.baseline, "geo": GEO, "layers": LAYERS, "layer": LAYER,
            "small": SMALL, "big": BIG, "state_sample": STATE_SAMPLE,
            "layout": {g: layout(geo[2], geo[3], {}) for g, geo in GEO.items()},
            "old_layout": layout(128, 128, dict(mma=False)) if a.baseline == "simt" else a.baseline,
            "variants": {v: dict(kw, layout=layout(128, 128, _kw(kw))) for v, kw in VARIANTS.items()}}
    (out / "gdn.json").write_text(json.dumps(meta, indent=1))
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    print(f"prep done in {time.time() - t0:.1f}s; {out} holds {size / 1e6:.1f} MB", flush=True)
    return 0


# ----------------------------------------------------------------------------------------------
def _torch_reference(torch, q, k, v, g, beta, cu, s0):
    """float64 token recurrence per row (FLA fused_recurrent order): S = e^g S;
    S += k (beta (v - k S)); o = q S. s0: [rows, Hv, dk, dv]. Returns (o, new states)."""
    hk, hv = q.shape[1], v.shape[1]
    r = hv // hk
    qd = q.double().repeat_interleave(r, dim=1)
    kd = k.double().repeat_interleave(r, dim=1)
    vd, bd, eg = v.double(), beta.double(), torch.exp(g.double())
    o = torch.empty(v.shape, dtype=torch.float64, device=v.device)
    states = []
    for row in range(len(cu) - 1):
        S = s0[row].double().clone()
        for t in range(int(cu[row]), int(cu[row + 1])):
            S.mul_(eg[t][:, None, None])
            delta = bd[t][:, None] * (vd[t] - torch.einsum("he,hed->hd", kd[t], S))
            S.add_(kd[t][:, :, None] * delta[:, None, :])
            o[t] = torch.einsum("he,hed->hd", qd[t], S)
        states.append(S)
    return o, torch.stack(states) if states else s0.double()


def _rel(torch, got, ref) -> float:
    got, ref = got.double(), ref.double()
    if not bool(torch.isfinite(got).all()):
        return float("inf")
    return float(((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item())


def cmd_run(a) -> int:
    import torch

    from ninfer_mlc.runtime.tvm_loader import import_tvm

    tvm = import_tvm("cuda")
    tvm.cuda(0)  # fail early without a GPU
    out = Path(a.out)
    meta = json.loads((out / "gdn.json").read_text())
    lib = tvm.runtime.load_module(str(out / "gdn.so"))
    data = dict(np.load(out / "gdn.npz"))
    res = {"device": torch.cuda.get_device_name(0), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
           "layout": meta["layout"], "cases": []}
    tol_llvm, tol_ref = 1e-4, 2e-4
    ok = True
    cudev = torch.device(DEVICE)

    def tv(t):
        return tvm.runtime.from_dlpack(t.contiguous())

    def targs(x, ssm, o):
        return [tv(x["q"]), tv(x["k"]), tv(x["v"]), tv(x["g"]), tv(x["beta"]), tv(x["cu"]), tv(x["slot"]), tv(ssm),
                LAYER, tv(o)]

    def call(fn, x, ssm, o):
        fn(*targs(x, ssm, o))

    def reference(x, ssm0):
        return _torch_reference(torch, x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu"].cpu().tolist(),
                                ssm0[x["slot"].long(), LAYER])

    def check(fn, x, ssm0, ref, row, tol=tol_ref):
        """One call from ssm0; errors of o and of the updated slots vs torch; untouched entries."""
        hv, dv = x["v"].shape[1], x["v"].shape[2]
        ssm = ssm0.clone()
        o = torch.full((x["q"].shape[0], hv, dv), float("nan"), device=cudev)
        call(fn, x, ssm, o)
        torch.cuda.synchronize()
        slots = x["slot"].long()
        row["o_err_torch"] = _rel(torch, o, ref[0])
        row["state_err_torch"] = _rel(torch, ssm[slots, LAYER], ref[1])
        mask = torch.ones(ssm.shape[:2], dtype=torch.bool, device=cudev)
        mask[slots, LAYER] = False
        row["untouched_equal"] = bool(torch.equal(ssm[mask], ssm0[mask]))
        row["pass"] = row["o_err_torch"] < tol and row["state_err_torch"] < tol and row["untouched_equal"]
        return o, ssm

    def timed(fn, x, ssm, o, reps):
        """Seconds per call: reps back-to-back calls between two events (after one warm-up call);
        the state keeps evolving, which does not change the work."""
        args = targs(x, ssm, o)
        fn(*args)
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(reps):
            fn(*args)
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / 1e3 / reps

    for c in meta["small"]:
        nm = c["name"]
        row = {"case": nm, "tokens": int(sum(c["lens"])), "rows": len(c["lens"]), "lens": c["lens"]}
        try:
            x = {k: torch.from_numpy(data[f"{nm}/{k}"]).to(cudev).clone() for k in ("q", "k", "v", "g", "beta", "cu", "slot")}
            ssm0 = torch.from_numpy(state_init(tuple(_ssm_shape(c)))).to(cudev)
            o, ssm = check(lib[f"gdn_{c['geo']}"], x, ssm0, reference(x, ssm0), row)
            new = ssm[x["slot"].long(), LAYER].cpu().numpy()
            row["o_err_llvm"] = rel_err(o.cpu().numpy(), data[f"{nm}/ref_o"])
            if f"{nm}/ref_state" in data:
                row["state_err_llvm"] = rel_err(new, data[f"{nm}/ref_state"])
            else:
                row["state_err_llvm"] = rel_err(new.reshape(-1)[::meta["state_sample"]],
                                                   data[f"{nm}/ref_state_sample"])
            row["pass"] = (row["o_err_llvm"] < tol_llvm and row["state_err_llvm"] < tol_llvm
                           and row["o_err_torch"] < tol_ref and row["state_err_torch"] < tol_ref
                           and row["untouched_equal"])
        except Exception as ex:  # noqa: BLE001
            row.update(error=repr(ex)[:400], **{"pass": False})
        ok &= row["pass"]
        gc.record_row(res, row, a.result)

    for c in meta["big"]:
        nm = c["name"]
        hk, hv, dk, dv = meta["geo"][c["geo"]]
        lens = c["lens"]
        n, b = sum(lens), len(lens)
        row = {"case": nm, "tokens": n, "rows": b, "lens": lens}
        try:
            gen = torch.Generator(device=DEVICE).manual_seed(c["seed"])

            x = {
                "q": gc.l2norm(torch.randn((n, hk, dk), device=cudev, generator=gen)) * dk ** -0.5,
                "k": gc.l2norm(torch.randn((n, hk, dk), device=cudev, generator=gen)),
                "v": torch.randn((n, hv, dv), device=cudev, generator=gen),
                "g": -torch.exp(torch.empty((n, hv), device=cudev).uniform_(np.log(1e-3), np.log(0.5), generator=gen)),
                "beta": torch.empty((n, hv), device=cudev).uniform_(0.1, 0.9, generator=gen),
                "cu": torch.tensor(gc.cu_seqlens(lens), dtype=torch.int32, device=cudev),
                "slot": torch.arange(b, 0, -1, dtype=torch.int32, device=cudev),  # slots b..1, slot 0 untouched
            }
            ssm0 = torch.randn((b + 1, LAYERS, hv, dk, dv), device=cudev, generator=gen) * 0.3
            t1 = time.time()
            ref = reference(x, ssm0)
            row["reference_seconds"] = time.time() - t1
            o, ssm = check(lib["gdn_q27"], x, ssm0, ref, row)
            reps = 50 if n <= 4096 else 20
            row["ms"] = timed(lib["gdn_q27"], x, ssm, o, reps) * 1e3
            row["ms_x48_layers"] = row["ms"] * 48
            if meta["baseline"] != "none":
                try:
                    old = {}
                    check(lib["gdn_q27_old"], x, ssm0, ref, old)
                    row["old"] = old
                    row["ms_old"] = timed(lib["gdn_q27_old"], x, ssm, o, 10) * 1e3
                    row["speedup"] = row["ms_old"] / row["ms"]
                except Exception as ex:  # noqa: BLE001 - prep without a baseline
                    row["old_error"] = repr(ex)[:200]
            row["variants"] = {}
            for v in meta.get("variants", {}):
                vr = {}
                try:
                    if meta["variants"][v].get("timing"):
                        vr.update(timing_only=True, **{"pass": True})
                    else:
                        check(lib[f"gdn_q27_{v}"], x, ssm0, ref, vr, meta["variants"][v].get("tol", tol_ref))
                    vr["ms"] = timed(lib[f"gdn_q27_{v}"], x, ssm, o, reps) * 1e3
                except Exception as ex:  # noqa: BLE001
                    vr.update(error=repr(ex)[:300], **{"pass": False})
                row["variants"][v] = vr
            del x, ssm0, ssm, o
            torch.cuda.empty_cache()
        except Exception as ex:  # noqa: BLE001
            row.update(error=repr(ex)[:400], **{"pass": False})
        ok &= row["pass"]
        gc.record_row(res, row, a.result)

    res["pass"] = ok
    gc.write_result(a.result, res)
    print(f"\n{res['device']}   tolerances: vs llvm {tol_llvm:g}, vs float64 torch {tol_ref:g}")
    print(f"{'case':14s} {'tokens':>6s} {'rows':>4s} {'o/llvm':>8s} {'S/llvm':>8s} {'o/torch':>8s} {'S/torch':>8s} "
          f"{'ms':>8s} {'ms old':>8s} {'speedup':>7s} {'x48 ms':>8s} pass")

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"
    for r in res["cases"]:
        print(f"{r['case']:14s} {r['tokens']:6d} {r['rows']:4d} {f(r.get('o_err_llvm'), '8.1e'):>8s} "
              f"{f(r.get('state_err_llvm'), '8.1e'):>8s} {f(r.get('o_err_torch'), '8.1e'):>8s} "
              f"{f(r.get('state_err_torch'), '8.1e'):>8s} {f(r.get('ms'), '8.3f'):>8s} {f(r.get('ms_old'), '8.3f'):>8s} "
              f"{f(r.get('speedup'), '7.1f'):>7s} {f(r.get('ms_x48_layers'), '8.1f'):>8s} "
              f"{'PASS' if r['pass'] else 'FAIL'} {r.get('error', '')}")
    vs = list(meta.get("variants", {}))
    if vs:
        print("\nms per call of the layout variants (* = a correctness check failed; pass1 / pass2 / old_p1 /"
              " old_p2: one launch alone, timing only); default: "
              + json.dumps(meta["layout"]["q27"]))
        for v in vs:
            print(f"  {v:6s} {json.dumps(meta['variants'][v]['layout'])}")
        print(f"{'case':14s} {'default':>9s} " + " ".join(f"{v:>9s}" for v in vs))
        for r in res["cases"]:
            if "variants" not in r:
                continue
            cells = [f(r.get("ms"), "9.3f")] + [
                f(r["variants"][v].get("ms"), "9.3f") + ("" if r["variants"][v].get("pass") else "*") for v in vs]
            print(f"{r['case']:14s} " + " ".join(f"{x:>9s}" for x in cells))
        print("max relative error vs float64 torch, o / state (variants marked tf32 are checked against "
              f"{TF32_TOL:g})")
        print(f"{'case':14s} {'default':>17s} {'old':>17s} " + " ".join(f"{v:>17s}" for v in vs))
        for r in res["cases"]:
            if "variants" not in r:
                continue
            cells = [r] + [r.get("old", {})] + [r["variants"][v] for v in vs]
            print(f"{r['case']:14s} " + " ".join(
                f"{f(c.get('o_err_torch'), '.1e') + '/' + f(c.get('state_err_torch'), '.1e'):>17s}" for c in cells))
    if any("old" in r for r in res["cases"]):
        print("\nold kernel: " + json.dumps(meta.get("old_layout")))
    print("ALL PASS" if ok else "SOME CASES FAILED")
    return 0 if ok else 1


def cmd_emulate(a) -> int:
    rows = run_emulation(quick=not a.full)
    return 0 if rows and all(r["ok"] for r in rows) else 1


def main(argv=None) -> int:
    ap, sub, p, r = gc.prep_run_parser(__doc__)
    p.add_argument("--baseline", default=BASELINE_REV, help="git revision of the old kernel, or none")
    e = sub.add_parser("emulate")
    e.add_argument("--full", action="store_true")
    a = ap.parse_args(argv)
    return {"prep": cmd_prep, "run": cmd_run, "emulate": cmd_emulate}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
