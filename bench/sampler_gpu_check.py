"""Device sampler (compile/kernels/cuda/sampling.py + runtime/device_sampler.py): correctness and speed on the GPU.

  prep OUT [--arch sm_90]                                   (here: compiler + nvcc, no GPU)
      OUT/sampler_<V>.so   the sampler functions alone (compile/sampler_module.py) for cuda:ARCH, for
                           V = 248320 (Qwen3.5) and V = 4099 (not a multiple of 32 or of the block)
  run OUT RESULT.json [--reps 20] [--draws 800]            (GPU machine: runtime-only TVM + numpy; ~1 min)
      per vocabulary: DeviceSampler against runtime/sampling.py (the reference) on the same RowStates:
        greedy rows (ties, bias, repetition / frequency / presence penalties) must give identical tokens,
        seeded sampled rows (Qwen's preset with presence 1.0, top-p only, min-p, top-k only, plain) the same
        tokens in >= 99.5% of the draws (the same uniforms; only float rounding at a boundary may differ),
        logprobs (raw and processed) within 1e-4, bitmask rows never a masked token;
      then the time per call at V = 248320, batch 1 and 8, greedy / preset / top-p only (LLM-like and flat
      logits): the device sampler (sample + the token copy back) against numpy on the host (copy of the
      [B, V] logits + Sampler.sample).
      Prints one JSON line per case and a table.
  emulate [--threads 1024]                                  (here, g++, no GPU)
      the generated CUDA of the sampler kernels run by the CPU emulator of ninfer_mlc.compile.kernels.cuda.emulate
      (a fiber per CUDA thread; shuffles and barriers emulated, shared-memory atomics as plain adds since fibers
      only switch at barriers) against the llvm sampler on the same inputs: tokens, ranks, top ids and counts
      identical, logprobs within 1e-5 (emulate/sampler.py; tests/test_device_sampler.py runs it).

GPU driver: `bash bench/gpu_driver.sh sampler` after `python bench/sampler_gpu_check.py prep .gpu/sampler`.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

import gpu_common as gc
from ninfer_mlc.compile.kernels.cuda.emulate.sampler import run_emulation

ROOT = Path(__file__).resolve().parent.parent
VOCABS = (248320, 4099)
QWEN_PRESET = dict(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=1.0)



def cmd_emulate(a) -> int:
    rows = run_emulation(a.threads)
    ok = all(r["ok"] for r in rows)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


# ---- prep (no GPU) / run (GPU) -----------------------------------------------------------------------------
def cmd_prep(a) -> int:
    from ninfer_mlc.compile.gpu_pipeline import build_cuda
    from ninfer_mlc.compile.sampler_module import sampler_module
    from ninfer_mlc.compile.targets import cuda_build_env, parse_target

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tgt = parse_target("cuda:" + a.arch).tvm_target()
    for vocab in VOCABS:
        t0 = time.time()
        with tgt:
            mod = sampler_module(vocab, "cuda")
        with cuda_build_env(tgt):
            ex = build_cuda(mod, tgt)
        ex.export_library(str(out / f"sampler_{vocab}.so"))
        print(f"sampler_{vocab}.so built in {time.time() - t0:.1f}s", flush=True)
    (out / "sampler.json").write_text(json.dumps({"vocabs": VOCABS, "arch": a.arch}))
    return 0


def _rows(params: dict, n: int, vocab: int, seed: int, prompt_len: int = 64, generated: int = 16):
    """Two identical lists of RowStates (device / numpy) with prompt + generated history."""
    from ninfer_mlc.runtime.sampling import RowState, SamplingParams

    rng = np.random.default_rng(seed)
    dev, ref = [], []
    for i in range(n):
        p = SamplingParams(**params).replace(seed=seed * 1000 + i).validate(vocab)
        prompt = rng.integers(0, vocab, prompt_len).tolist()
        gen = rng.integers(0, vocab, generated).tolist()
        for out in (dev, ref):
            r = RowState(p, prompt)
            r.extend(gen)
            out.append(r)
    return dev, ref


def correctness(tvm, vm, dev, vocab: int, draws: int, log) -> list[dict]:
    from ninfer_mlc.runtime.device_sampler import DeviceSampler
    from ninfer_mlc.runtime.sampling import Sampler

    rows_out = []
    B = 8
    cases = {
        "greedy_pen_bias": dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
                                logit_bias={5: 3.0, 17: -2.0}),
        "preset": QWEN_PRESET,
        "top_p": dict(top_p=0.9),
        "min_p": dict(min_p=0.05, temperature=0.8),
        "top_k": dict(top_k=50),
        "plain": dict(),
    }
    rng = np.random.default_rng(7)
    for name, params in cases.items():
        for mode in ("raw", "processed"):
            ds = DeviceSampler(tvm, vm, dev, vocab, B, logprobs_mode=mode)
            ref_s = Sampler(mode)
            rows_d, rows_r = _rows(dict(params, logprobs=True, top_logprobs=5), B, vocab, seed=len(rows_out))
            for i, r in enumerate(rows_d):
                ds.bind(i, r)
            same = total = 0
            lp_err = 0.0
            steps = max(1, draws // B) if mode == "raw" else 2
            for _ in range(steps):
                logits = (rng.normal(size=(B, vocab)) * 2.5).astype(np.float32)
                logits[0] = np.round(logits[0])
                t_ref, l_ref = ref_s.sample(logits, rows_r, return_logprobs=True)
                t_dev, l_dev = ds.sample(tvm.runtime.tensor(logits, dev), rows_d, list(range(B)),
                                         return_logprobs=True)
                same += int((t_ref == t_dev).sum())
                total += B
                # histories diverge where the tokens did: resync the reference rows to the device's
                for i in np.flatnonzero(t_ref != t_dev):
                    rows_r[i].rollback(1)
                    rows_r[i].append(int(t_dev[i]))
                for a, b in zip(l_ref, l_dev):
                    if a.token_id == b.token_id:
                        lp_err = max(lp_err, abs(a.logprob - b.logprob),
                                     float(np.max(np.abs(a.top_logprobs - b.top_logprobs), initial=0)))
            need = 1.0 if name.startswith("greedy") else 0.995
            row = dict(check="draws", vocab=vocab, case=name, logprobs=mode, same=same, total=total,
                       lp_err=lp_err, ok=same >= need * total and lp_err <= 1e-4)
            log(json.dumps(row))
            rows_out.append(row)
    # bitmask: random masks (a quarter of the tokens allowed), never a masked token
    ds = DeviceSampler(tvm, vm, dev, vocab, B)
    rows_d, _ = _rows(QWEN_PRESET, B, vocab, seed=99)
    for i, r in enumerate(rows_d):
        ds.bind(i, r)
    bad = 0
    W = (vocab + 31) // 32
    for _ in range(20):
        mask = (rng.integers(0, 1 << 32, size=(B, W), dtype=np.uint64) & rng.integers(0, 1 << 32, size=(B, W),
                                                                                      dtype=np.uint64))
        mask = mask.astype(np.uint32).view(np.int32)
        logits = (rng.normal(size=(B, vocab)) * 2.5).astype(np.float32)
        toks = ds.sample(tvm.runtime.tensor(logits, dev), rows_d, list(range(B)), bitmask=mask)
        bits = (mask.view(np.uint32)[np.arange(B), toks // 32] >> (toks % 32).astype(np.uint32)) & 1
        bad += int((bits == 0).sum())
    row = dict(check="bitmask", vocab=vocab, masked_tokens_drawn=bad, ok=bad == 0)
    log(json.dumps(row))
    rows_out.append(row)
    return rows_out


def llm_like_logits(rng, B: int, vocab: int) -> np.ndarray:
    """N(0, 2^2) plus 12 on 50 random tokens per row: ~97% of the mass on those 50, as in a next-token
    distribution (top-p 0.95 inside a few dozen tokens)."""
    x = (rng.normal(size=(B, vocab)) * 2).astype(np.float32)
    for b in range(B):
        x[b, rng.choice(vocab, 50, replace=False)] += 12
    return x


def timing(tvm, vm, dev, vocab: int, reps: int, log, prompt_len: int = 4096, generated: int = 512) -> list[dict]:
    """Median (and min) ms per call, batch 1 and 8: greedy, Qwen's preset, top-p 0.95 alone on LLM-like logits and on flat
    N(0, 2.5^2) ones (nucleus wider than the select's probe); rows carry a prompt of prompt_len and
    `generated` tokens (the penalties' state). numpy's time includes the copy of the [B, V] logits."""
    from ninfer_mlc.runtime.device_sampler import DeviceSampler
    from ninfer_mlc.runtime.sampling import Sampler

    out = []
    cases = {"greedy": dict(temperature=0.0), "preset": QWEN_PRESET, "top_p": dict(top_p=0.95),
             "top_p_flat": dict(top_p=0.95)}
    rng = np.random.default_rng(3)
    for B in (1, 8):
        peaked = tvm.runtime.tensor(llm_like_logits(rng, B, vocab), dev)
        flat = tvm.runtime.tensor((rng.normal(size=(B, vocab)) * 2.5).astype(np.float32), dev)
        for name, params in cases.items():
            logits = flat if name.endswith("flat") else peaked
            ds = DeviceSampler(tvm, vm, dev, vocab, B)
            rows_d, rows_r = _rows(params, B, vocab, seed=B, prompt_len=prompt_len, generated=generated)
            for i, r in enumerate(rows_d):
                ds.bind(i, r)
            ref = Sampler()
            lanes = list(range(B))

            def device_call():
                ds.sample(logits, rows_d, lanes, update_state=False)

            def host_call():
                ref.sample(logits.numpy(), rows_r, update_state=False)

            res = {}
            for label, fn in (("device", device_call), ("numpy", host_call)):
                fn()
                dev.sync()
                ts = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    fn()
                    dev.sync()
                    ts.append(time.perf_counter() - t0)
                res[label] = float(np.median(ts)) * 1e3
                res[label + "_min"] = float(np.min(ts)) * 1e3
            row = dict(check="time", vocab=vocab, batch=B, case=name, device_ms=round(res["device"], 4),
                       numpy_ms=round(res["numpy"], 3), speedup=round(res["numpy"] / res["device"], 1),
                       device_min_ms=round(res["device_min"], 4), numpy_min_ms=round(res["numpy_min"], 3))
            log(json.dumps(row))
            out.append(row)
    return out


def cmd_run(a) -> int:
    from ninfer_mlc.runtime.tvm_loader import device_for, import_tvm, load_vm

    tvm = import_tvm("cuda")
    dev = device_for(tvm, "cuda", 0)
    res = {"cases": []}
    ok = True
    for vocab in json.loads((Path(a.out) / "sampler.json").read_text())["vocabs"]:
        vm = load_vm(tvm, str(Path(a.out) / f"sampler_{vocab}.so"), dev)
        for row in correctness(tvm, vm, dev, vocab, a.draws if vocab > 10000 else 4 * a.draws, print):
            ok &= row["ok"]
            res["cases"].append(row)
        if vocab == max(VOCABS):
            res["cases"] += timing(tvm, vm, dev, vocab, a.reps, print)
        gc.write_result(a.result, res)
    print(f"{'case':10s} {'B':>3s} {'device ms':>10s} {'numpy ms':>9s} {'speedup':>8s}")
    for r in res["cases"]:
        if r["check"] == "time":
            print(f"{r['case']:10s} {r['batch']:3d} {r['device_ms']:10.3f} {r['numpy_ms']:9.2f} {r['speedup']:8.1f}")
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap, sub, p, r = gc.prep_run_parser(__doc__)
    r.add_argument("--reps", type=int, default=20)
    r.add_argument("--draws", type=int, default=800)
    e = sub.add_parser("emulate")
    e.add_argument("--threads", type=int, default=1024)
    a = ap.parse_args(argv)
    return {"prep": cmd_prep, "run": cmd_run, "emulate": cmd_emulate}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
