"""CUDA paged attention (compile/kernels/cuda/attention.py): correctness and decode speed on the GPU.

  prep OUT [--arch sm_90] [--no-baseline] [--no-variants]        (here: compiler + nvcc, no GPU)
      OUT/attn.so     the attention prim_funcs of every case: `new_<tag>` (the current kernel, registry
                      defaults), `vf_<tag>` (its verify attention, bf16 / f16 pages), `old_<tag>`
                      (compile/kernels/cuda/attention.py at git HEAD, for the timing baseline; skipped when it
                      cannot be loaded), `v_<variant>` (other threads / target_blocks / qb of the bf16 27B
                      kernel, timed only) and `vf_tb<N>` (the bf16 verify attend at other split targets)
      OUT/attn.json   the cases: shapes, rows, seeds and function names (a few KB; every array is
                      regenerated from its seed on the GPU)
  run OUT RESULT.json [--only SUBSTR,...] [--skip-variants] [--budget-s 90] [--reps 30]   (GPU machine)
      runtime-only TVM (TVM_USE_RUNTIME_LIB=1) + numpy, ml_dtypes, torch. Per case: builds the page
      pool (torch, seeded, on the GPU; quantized pools are packed with numpy), runs the kernel once,
      checks the appended page rows bit for bit and the output against a float64 reference
      (max |got - ref| / max |ref|), then times the timed cases: median per call of a CUDA graph of
      20 back-to-back calls (what the model runner replays), eager wall time per call, and the CUPTI
      kernel times (append / attend / combine). GB/s = K/V bytes the call must read / time. Prints a
      table last. `--cpu-emulate` runs the same flow for small cases on the CPU emulator (no GPU).
      `--only verify`: the verify cases (b in 1, 4 sequences of R = 4 / 8 rows at 8k, b = 8 x 8 rows, R = 4 at
      32k): the verify attend (vf_bf16, what verify / verify_t run; and the vf_tb<N> split targets) against the
      split attend (new_bf16, before: one token per block; b = 8 x 8 = 64 rows took its prefill launch), each
      output checked against the float64 reference (rel_err of the others in their timing rows).
  emulate [SUBSTR ...]                                            (here, no GPU)
      runs the generated CUDA of the small cases on the CPU: TVM lowers the prim_func (CSE off), the
      CUDA source is compiled with g++ against a tiny fiber emulator (one fiber per CUDA thread;
      warp shuffles, __syncthreads and mma.sync.m16n8k16 as warp collectives) and launched with
      the grid of the host code. This checks the kernel logic (splits, fragment layouts, merges,
      quantized loads) that no CPU build of the thread-bound TIR can run; tests/test_cuda_build.py
      runs a few of these.

GPU driver: `bash .gpu/run.sh attn` (its attn step), or by hand with the runtime bundle of
bench/gpu_bench.py (bench/README.md; `carry: [".gpu"]`):
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/tvmrt/whl/*.whl
  mkdir -p /tmp/site /tmp/pkg/ninfer_mlc && tar -xJf .gpu/tvmrt/site.tar.xz -C /tmp/site
  cp ninfer_mlc/__init__.py /tmp/pkg/ninfer_mlc/ && ln -sfn $PWD/runtime /tmp/pkg/ninfer_mlc/runtime \\
      && ln -sfn $PWD/compile /tmp/pkg/ninfer_mlc/compile
  export LD_LIBRARY_PATH=<dir of libcudart.so.13>:$LD_LIBRARY_PATH PYTHONPATH=/tmp/pkg:/tmp/site TVM_USE_RUNTIME_LIB=1
  python3 bench/attn_gpu_check.py run .gpu/attn $OUT/attn.json
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import gpu_common as gc
from ninfer_mlc.compile.kernels.cuda.emulate import EmuLib
from ninfer_mlc.compile.kernels.cuda.emulate.attention import (
    FUNCS, LAYER, LAYERS, PAGE, _np_dt, all_cases, case_qkv, case_tokens, emulate_case, expected_rows, quant_pool,
    reference, rel_err, row_nbytes, tolerance, write_rows,
)
from ninfer_mlc.compile.kernels.cuda.emulate.attention import kernel_funcs as new_kernel_funcs

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "t128_tb132": dict(threads=128, target_blocks=132),
    "t128_tb528": dict(threads=128, target_blocks=528),
    "t128_tb1056": dict(threads=128, target_blocks=1056),
    "t256_tb264": dict(threads=256, target_blocks=264),
    "t256_tb528": dict(threads=256, target_blocks=528),
    "t64_tb528": dict(threads=64, target_blocks=528),
    "simt": dict(threads=128, target_blocks=264, mma=False),
    "simt_qb8": dict(threads=128, target_blocks=264, mma=False, qb=8),
}
# other split targets of the bf16 verify attend (timed in the verify cases)
VF_VARIANTS = {"vf_tb132": 132, "vf_tb528": 528, "vf_tb1056": 1056}
# tags with an old_<tag> baseline (timed cases)
BASELINE_TAGS = ("bf16", "fp8", "nvfp4")


def attn_flops(m: dict, pos) -> int:
    """Causal attention FLOPs of the call: 4 * (pos + 1) * D per query head and token (QK^T and PV)."""
    hq, hkv, d = m["geo"]
    return int(sum(int(p) + 1 for p in pos)) * 4 * d * hq


def kv_bytes_read(m: dict, pos) -> int:
    hq, hkv, d = m["geo"]
    return int(sum(int(p) + 1 for p in pos)) * hkv * 2 * row_nbytes(m["kv"], d)


# ----------------------------------------------------------------------------------------------
def kernel_funcs(baseline: bool = True, variants: bool = True, tags=None) -> dict:
    """{global symbol: prim_func} of the new kernels (registry defaults), the HEAD baseline and the
    bf16 variants."""
    from ninfer_mlc.compile.kernels.cuda import attention as A

    funcs = new_kernel_funcs(tags, verify=True)
    if variants and (tags is None or "bf16" in tags):
        geo, dt, kv = FUNCS["bf16"]
        for vn, kw in VARIANTS.items():
            funcs[f"v_{vn}"] = A.paged_attention(*geo, PAGE, LAYERS, dt, geo[2] ** -0.5, kv_dtype=kv, **kw)
        for vn, tb in VF_VARIANTS.items():
            funcs[vn] = A.paged_attention(*geo, PAGE, LAYERS, dt, geo[2] ** -0.5, kv_dtype=kv, target_blocks=tb,
                                          short_rows=True)
    if baseline:
        base = _baseline_module()
        if base is not None:
            from ninfer_mlc.compile.kernels.cuda.registry import kernel_params

            kp = kernel_params()["paged_attention"]
            for tag in BASELINE_TAGS:
                if tags is not None and tag not in tags:
                    continue
                geo, dt, kv = FUNCS[tag]
                funcs[f"old_{tag}"] = base.paged_attention(*geo, PAGE, LAYERS, dt, geo[2] ** -0.5, kv_dtype=kv,
                                                           threads=kp["threads"], target_blocks=kp["target_blocks"])
    return {k: f.with_attr("global_symbol", k) for k, f in funcs.items()}


def _baseline_module(rev: str | None = None):
    """compile/kernels/cuda/attention.py at git `rev`, imported next to the current one."""
    rel = "compile/kernels/cuda/attention.py"
    rev = rev or os.environ.get("ATTN_BASELINE_REV", "HEAD")  # e.g. main's commit for a before/after run
    try:
        src = gc.git_show(rev, rel)
    except (OSError, subprocess.CalledProcessError) as e:
        print(f"baseline: cannot read {rev}:{rel} ({e}); no old_* functions", flush=True)
        return None
    if src == (ROOT / rel).read_text():
        print("baseline: HEAD has the same attention.py; no old_* functions", flush=True)
        return None
    return gc.module_from_source(src, "ninfer_mlc.compile.kernels.cuda._attention_base",
                                 package="ninfer_mlc.compile.kernels.cuda")


def cmd_prep(a) -> int:
    import tvm

    from ninfer_mlc.compile.kernels.cuda import attention as A
    from ninfer_mlc.compile.targets import cuda_build_env, parse_target

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    funcs = kernel_funcs(baseline=not a.no_baseline, variants=not a.no_variants)
    tgt = parse_target("cuda:" + a.arch).tvm_target()
    with cuda_build_env(tgt):
        tvm.compile(tvm.IRModule(funcs), target=tgt).export_library(str(out / "attn.so"))
    cases = all_cases()
    plans = {}
    for tag, (geo, dt, kv) in FUNCS.items():
        plans[tag] = A.attend_plan(geo[0], geo[1], geo[2], kv or dt, dtype=dt)
    variants = {k: dict(v) for k, v in VARIANTS.items()} if not a.no_variants else {}
    from ninfer_mlc.compile.kernels.cuda.registry import kernel_params

    meta = dict(cases=cases, funcs=sorted(funcs), plans=plans, variants=variants, arch=a.arch, page=PAGE,
                kernel_params=kernel_params(a.arch)["paged_attention"],
                layers=LAYERS, layer=LAYER, built=time.strftime("%Y-%m-%d %H:%M:%S"),
                git=_git_rev())
    (out / "attn.json").write_text(json.dumps(meta, indent=1))
    print(f"prep: {len(funcs)} functions, {len(cases)} cases, {(out / 'attn.so').stat().st_size} B .so, "
          f"{time.time() - t0:.1f}s", flush=True)
    return 0


def _git_rev() -> str:
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return "?"


# ----------------------------------------------------------------------------------------------
# GPU run
def _time_graph(torch, tvm_ffi, dev, fn, args, calls: int = 20, reps: int = 5):
    """Median seconds per call of a CUDA graph holding `calls` back-to-back calls."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s), tvm_ffi.use_raw_stream(dev, s.cuda_stream):
        fn(*args)  # sizes the workspace pool on this thread before the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s, capture_error_mode="relaxed"):
        with tvm_ffi.use_raw_stream(dev, s.cuda_stream):
            for _ in range(calls):
                fn(*args)
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        e0.record(s)
        g.replay()
        e1.record(s)
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3 / calls)
    del g
    return float(np.median(ts))


def _time_eager(dev, fn, args, reps: int):
    for _ in range(3):
        fn(*args)
    dev.sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn(*args)
    dev.sync()
    return (time.perf_counter() - t) / reps


def _cupti(torch, fn, args, name: str, calls: int = 10) -> dict:
    """Kernel times per call (us) by CUPTI: {append, attend, combine, total}."""
    try:
        from torch.profiler import ProfilerActivity, profile

        fn(*args)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn(*args)
            torch.cuda.synchronize()
        res = {"append": 0.0, "attend": 0.0, "combine": 0.0}
        raw = {}
        for e in prof.key_averages():
            if not e.key.startswith(name + "_kernel"):
                continue
            t = float(getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0) or 0) / calls
            suf = e.key[len(name) + 7:]
            raw[int(suf[1:]) if suf[1:].isdigit() else 0] = raw.get(int(suf[1:]) if suf[1:].isdigit() else 0, 0.0) + t
        # kernel 0 appends, the last one (always launched) combines, the ones between attend (split / prefill)
        for kix, t in raw.items():
            part = "append" if kix == 0 else "combine" if kix == max(raw) else "attend"
            res[part] += t
        res["total"] = res["append"] + res["attend"] + res["combine"]
        return res
    except Exception as e:  # noqa: BLE001 - profiling is optional
        return {"error": repr(e)[:200]}


def _copy_bw(torch) -> float:
    return gc.copy_bw(torch)


class _Gpu:
    """Runs the prep's attn.so on cuda:0 (runtime-only TVM)."""

    device = "cuda"

    def __init__(self, prep: Path, meta: dict):
        import torch
        import tvm_ffi

        from ninfer_mlc.runtime.tvm_loader import import_tvm

        self.torch, self.tvm_ffi = torch, tvm_ffi
        self.tvm = import_tvm("cuda")
        self.dev = self.tvm.cuda(0)
        self.lib = self.tvm.runtime.load_module(str(prep / "attn.so"))
        self.name = torch.cuda.get_device_name(0)

    def bind(self, m, q, k, v, pos, tseq, pt, pool_t):
        """Argument list of the kernel for this case (the pool is pool_t's memory)."""
        tvm, dev = self.tvm, self.dev
        T = lambda x: tvm.runtime.tensor(np.ascontiguousarray(x), dev)  # noqa: E731
        out = tvm.runtime.empty((len(pos), m["geo"][0], m["geo"][2]), m["dtype"], dev)
        return [T(q), T(k), T(v), T(pos), T(tseq), T(pt), tvm.runtime.from_dlpack(pool_t), LAYER, out]

    def call(self, fn, args):
        args[-1].copyfrom(np.full(args[-1].shape, np.nan, np.float32).astype(_np_dt(str(args[-1].dtype))))
        self.lib[fn](*args)
        self.dev.sync()
        return args[-1].numpy().astype(np.float32)

    def cleanup(self):
        self.torch.cuda.empty_cache()


class _Emu:
    """The same run on the CPU: torch CPU tensors and the CUDA emulator (no timing)."""

    device = "cpu"
    name = "cpu-emulator"

    def __init__(self, tags):
        import torch

        self.torch = torch
        self.emu = EmuLib(new_kernel_funcs(tags, verify=True))

    def bind(self, m, q, k, v, pos, tseq, pt, pool_t):
        torch = self.torch
        pool = (pool_t.view(torch.int16).numpy().view(_np_dt("bfloat16")) if pool_t.dtype == torch.bfloat16
                else pool_t.numpy())  # shares pool_t's memory
        return dict(m=m, q=np.ascontiguousarray(q), k=np.ascontiguousarray(k), v=np.ascontiguousarray(v), pos=pos,
                    tseq=tseq, pt=pt, pool=pool)

    def call(self, fn, args):
        m, n = args["m"], len(args["pos"])
        hq, hkv, d = m["geo"]
        arrays = {k_: v_ for k_, v_ in args.items() if k_ != "m"}
        arrays["out"] = np.full((n, hq, d), np.nan, np.float32).astype(_np_dt(m["dtype"]))
        self.emu(fn, arrays, dict(layer=LAYER))
        return arrays["out"].astype(np.float32)

    def cleanup(self):
        pass


def cmd_run(a) -> int:
    import torch

    prep = Path(a.out)
    meta = json.loads((prep / "attn.json").read_text())
    only = [s for s in (a.only or "").split(",") if s]
    cases = [m for m in meta["cases"] if not only or any(s in m["name"] for s in only)]
    if a.cpu_emulate:
        be = _Emu({m["tag"] for m in cases})
        funcs = {m["func"] for m in cases}
    else:
        be = _Gpu(prep, meta)
        funcs = set(meta["funcs"])
    res = {"device": be.name, "git": meta.get("git"), "plans": meta.get("plans"), "variants": meta.get("variants"),
           "kernel_params": meta.get("kernel_params"), "cases": {}}
    timing_on = not a.no_time and not a.cpu_emulate
    bw = _copy_bw(torch) if timing_on else float("nan")
    res["copy_bandwidth_Bps"] = bw
    print(f"device {be.name}: copy bandwidth {bw / 1e12:.2f} TB/s (read+write)", flush=True)
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
    ok = True
    t_start = time.time()
    for m in cases:
        name = m["name"]
        hq, hkv, d = m["geo"]
        row = {"rows": m["rows"], "tag": m["tag"], "func": m["func"], "compare": m.get("compare")}
        try:
            pos, tseq, pt = case_tokens(m)
            q, k, v = case_qkv(m)
            n = len(pos)
            if m["quant"]:
                pool_t = torch.as_tensor(quant_pool(m), device=be.device)
            else:
                g = torch.Generator(device=be.device)
                g.manual_seed(m["seed"])
                pool_t = torch.randn((m["npages"], LAYERS, 2, hkv, PAGE, d), device=be.device, dtype=tdt[m["kv"]],
                                     generator=g)
            exp_rows = expected_rows(m, k, v)
            # reference pool after the append (a torch clone next to the pool)
            ref_pool = pool_t.clone()
            write_rows(ref_pool.view(torch.int16) if exp_rows.dtype == _np_dt("bfloat16") else ref_pool, m, pos,
                       tseq, pt, exp_rows)
            ref = reference(m, np.asarray(q, np.float32), ref_pool.cpu().numpy() if m["quant"] else ref_pool,
                            pos, tseq, pt, torch_dev=be.device if m["quant"] and be.device == "cuda" else None)
            args = be.bind(m, q, k, v, pos, tseq, pt, pool_t)
            got = be.call(m["func"], args)
            err = rel_err(got, ref)
            # appended rows bit for bit, and nothing else touched (small pools)
            if pool_t.numel() * pool_t.element_size() <= (256 << 20):
                differ = int((pool_t.view(torch.uint8) != ref_pool.view(torch.uint8)).sum().item())
            else:
                got_rows = np.stack([np.stack([_row(pool_t, m, pos, tseq, pt, i, c) for c in range(2)])
                                     for i in range(n)])
                differ = int((got_rows.view(np.uint8) != _np_bytes(exp_rows)).sum())
            tol = tolerance(m)
            passed = err <= tol and differ == 0
            ok &= passed
            row.update(rel_err=err, tol=tol, pool_bytes_differing=differ, ok=passed,
                       nsplit=_splits(m, meta, n, pt.shape[1]))
            del ref_pool
            bytes_read = kv_bytes_read(m, pos)
            row["kv_bytes_read"] = bytes_read
            row["flops"] = attn_flops(m, pos)
            print(f"{name:24s} {'PASS' if passed else 'FAIL'} rel_err={err:.2e} (tol {tol:g}) "
                  f"pool_bytes_differing={differ} nsplit={row['nsplit']}", flush=True)
            if m["timed"] and timing_on:
                row["timing"] = _time_case(a, be, m, args, ref, funcs, bytes_read, bw, t_start)
            del pool_t
            be.cleanup()
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            row["error"] = repr(e)[:500]
            ok = False
            print(f"{name:24s} ERROR {e!r}"[:600], flush=True)
        res["cases"][name] = row
        gc.write_result(a.result, res)
    res["ok"] = bool(ok)
    res["wall_s"] = time.time() - t_start
    gc.write_result(a.result, res)
    _print_table(res)
    print("OK" if ok else "FAILED", flush=True)
    return 0 if ok else 1


def _time_case(a, be, m, args, ref, funcs, bytes_read, bw, t_start) -> dict:
    """Times the case's kernel, the HEAD baseline and (bf16, within the budget) the variants."""
    torch, dev = be.torch, be.dev
    # (the old quantized prefill runs the SIMT path over the whole context per token: timed at 2k only)
    slow_old = m["quant"] and "_pf_" in m["name"] and not m["name"].endswith("_pf_2k")
    if m.get("compare"):  # verify cases: the verify attend against the split attend (today's per-row kernel)
        fns = [m["func"], m["compare"]] + [fn for fn in VF_VARIANTS if fn in funcs and m["tag"] == "bf16"]
    else:
        fns = [m["func"]] + [fn for fn in (f"old_{m['tag']}",) if fn in funcs and not slow_old]
    if (m["tag"] == "bf16" and not m.get("compare") and not a.skip_variants and time.time() - t_start < a.budget_s
            and "_pf_" not in m["name"]):
        fns += [fn for fn in sorted(funcs) if fn.startswith("v_")]
    timing = {}
    for fn in fns:
        ff = be.lib[fn]
        tt = {}
        try:
            tt["graph_us"] = _time_graph(torch, be.tvm_ffi, dev, ff, args) * 1e6
        except Exception as e:  # noqa: BLE001
            tt["graph_error"] = repr(e)[:200]
        tt["eager_us"] = _time_eager(dev, ff, args, a.reps) * 1e6
        tt["cupti_us"] = _cupti(torch, ff, args, fn) if fn == m["func"] else {}
        # A torch graph that did not record TVM's launches replays in ~1-2 us whatever the kernel: such a time
        # (below the CUPTI kernel sum, or under a quarter of the eager call) is dropped, not reported.
        floor_us = tt["cupti_us"].get("total") or 0.25 * tt["eager_us"]
        if tt.get("graph_us") is not None and tt["graph_us"] < 0.9 * floor_us:
            tt["graph_invalid_us"] = tt.pop("graph_us")
        best = tt.get("graph_us") or tt["eager_us"]
        tt["GBps"] = bytes_read / (best * 1e-6) / 1e9
        tt["TFLOPs"] = attn_flops(m, case_tokens(m)[0]) / (best * 1e-6) / 1e12
        att = tt["cupti_us"].get("attend") if tt["cupti_us"] else None
        if att:
            tt["attend_TFLOPs"] = attn_flops(m, case_tokens(m)[0]) / (att * 1e-6) / 1e12
        tt["fraction_of_copy_bw"] = bytes_read / (best * 1e-6) / (bw / 2)
        if fn != m["func"]:  # variants / baseline: outputs must agree too
            tt["rel_err"] = rel_err(be.call(fn, args), ref)
        timing[fn] = tt
        cu = tt["cupti_us"]
        print(f"    {fn:14s} graph {tt.get('graph_us', float('nan')):9.1f} us  eager {tt['eager_us']:9.1f} us"
              f"  kernels {cu.get('total', float('nan')):9.1f} us (attend {cu.get('attend', float('nan')):.1f})"
              f"  {tt['GBps']:7.0f} GB/s {100 * tt['fraction_of_copy_bw']:5.1f}% of copy"
              + f"  {tt['TFLOPs']:6.1f} TFLOP/s"
              + (f" (attend kernel {tt['attend_TFLOPs']:.1f})" if "attend_TFLOPs" in tt else "")
              + (f"  rel_err {tt['rel_err']:.1e}" if "rel_err" in tt else ""), flush=True)
    return timing


def _splits(m: dict, meta: dict, n: int, width: int) -> int:
    """Split count of the case's default kernel (registry threads / target_blocks at prep time)."""
    kp = meta.get("kernel_params", {})
    if m.get("verify"):
        from ninfer_mlc.compile.kernels.cuda.attention_verify import verify_splits

        return verify_splits(len(m["rows"]), width, m["geo"][1], PAGE, kp.get("target_blocks", 264))
    return _attn_splits(n, width, m["geo"][1], kp.get("threads", 128), kp.get("target_blocks", 264))


def _attn_splits(n, p, n_kv, threads, target_blocks):
    w = 1 << (max(threads // 32, 1).bit_length() - 1)
    return max(1, min(-(-target_blocks // (n * n_kv)), max(p * (PAGE // 32) // w, 1)))


def _row(pool_t, m, pos, tseq, pt, i, c):
    pg, sl = int(pt[tseq[i], pos[i] // PAGE]), int(pos[i] % PAGE)
    return pool_t[pg, LAYER, c, :, sl].contiguous().view(-1).cpu().view(
        __import__("torch").uint8).numpy().reshape(pool_t.shape[3], -1)


def _np_bytes(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint8).reshape(a.shape[0], 2, a.shape[2], -1)


def _print_table(res: dict) -> None:
    print("\ncase                      err      new(us)  old(us)  speedup  new GB/s  %copy  TFLOP/s new/old  best variant (us)")
    if any(r.get("compare") for r in res["cases"].values()):
        print("(verify_* rows: new = the verify attend vf_<tag>, old = the split attend new_<tag> the call took before)")
    for name, r in res["cases"].items():
        if "error" in r:
            print(f"{name:24s}  ERROR")
            continue
        t = r.get("timing") or {}
        new = t.get(r.get("func") or "") or next((v for k, v in t.items() if k.startswith("new_")), None)
        old = t.get(r.get("compare") or "") or next((v for k, v in t.items() if k.startswith("old_")), None)

        def us(x):
            return (x.get("graph_us") or x.get("eager_us")) if x else None
        vs = {k: us(v) for k, v in t.items() if k.startswith("v_")}
        best = min(vs.items(), key=lambda kv: kv[1]) if vs else None
        nu, ou = us(new), us(old)
        print(f"{name:24s} {r['rel_err']:.1e} " + (f"{nu:9.1f} " if nu else " " * 10)
              + (f"{ou:8.1f} " if ou else " " * 9) + (f"{ou / nu:7.2f}x " if nu and ou else " " * 9)
              + (f"{new['GBps']:8.0f}  {100 * new['fraction_of_copy_bw']:5.1f} " if new else " " * 16)
              + (f" {new['TFLOPs']:6.1f}/{old['TFLOPs'] if old else float('nan'):6.1f}  " if new else " " * 17)
              + (f" {best[0]} ({best[1]:.1f})" if best else ""))


# ----------------------------------------------------------------------------------------------
# CPU emulation of the generated CUDA code
def cmd_emulate(a) -> int:
    sel = [m for m in all_cases() if (any(s in m["name"] for s in a.names) if a.names else m["name"].startswith(("emu_", "f32tiny")))]
    tags = sorted({m["tag"] for m in sel})
    t0 = time.time()
    lib = EmuLib(new_kernel_funcs(tags, verify=True))
    print(f"emulator built ({', '.join(tags)}) in {time.time() - t0:.1f}s", flush=True)
    ok = True
    for m in sel:
        t1 = time.time()
        r = emulate_case(m, lib)
        ok &= r["ok"]
        print(f"{m['name']:22s} {'PASS' if r['ok'] else 'FAIL'} rel_err={r['rel_err']:.2e} (tol {r['tol']:g}) "
              f"pool_bytes_differing={r['pool_bytes_differing']} nsplit={r['nsplit']} {time.time() - t1:.1f}s", flush=True)
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap, sub, p, r = gc.prep_run_parser(__doc__)
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--no-variants", action="store_true")
    r.add_argument("--reps", type=int, default=30)
    r.add_argument("--budget-s", type=float, default=90, help="no more variant timings after this many seconds")
    r.add_argument("--only", default="")
    r.add_argument("--skip-variants", action="store_true")
    r.add_argument("--no-time", action="store_true")
    r.add_argument("--cpu-emulate", action="store_true",
                   help="no GPU: run the (small!) cases' kernels in the CPU emulator, no timing (tests this script)")
    e = sub.add_parser("emulate")
    e.add_argument("names", nargs="*")
    a = ap.parse_args(argv)
    return {"prep": cmd_prep, "run": cmd_run, "emulate": cmd_emulate}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
