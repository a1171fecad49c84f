"""Helpers shared by the GPU check scripts in bench/ (gpu_bench, gemm/gemv/gdn/attn checks, spec bench).

Only the standard library, numpy and the package's light numerics at module level: the scripts import this
on the GPU machine, which has the TVM runtime, numpy, ml_dtypes and torch (passed in as an argument where
needed), no compiler.
"""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

import numpy as np

# errors and inputs of the kernel checks: shared with their CPU emulation (re-exported for the scripts)
from ninfer_mlc.compile.kernels.cuda.emulate.numerics import cu_seqlens, l2_qk, l2norm, rel_err  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------------------------
# timing / floors
def cuda_median_s(torch, fn, reps: int = 10, warm: int = 3) -> float:
    """Median seconds of fn() on the current CUDA stream, timed with CUDA events after `warm` calls."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(s.elapsed_time(e) / 1e3)
    return float(np.median(ts))


def copy_bw(torch, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read + written (2 GiB buffers)."""
    x = torch.empty(nbytes // 4, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 4 / cuda_median_s(torch, lambda: y.copy_(x))
    del x, y
    torch.cuda.empty_cache()
    return bw


def matmul_rate(torch, n: int = 8192) -> float:
    """bf16 n x n x n matmul rate in FLOP/s, random data."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    rate = 2 * n ** 3 / cuda_median_s(torch, lambda: a @ b)
    del a, b
    torch.cuda.empty_cache()
    return rate


def measure_floors(torch):
    """(copy bandwidth in bytes/s read + written, bf16 matmul FLOP/s)."""
    return copy_bw(torch), matmul_rate(torch)


# ----------------------------------------------------------------------------------------------
# git baselines
def git_show(rev: str, rel: str) -> str:
    """The text of ROOT/rel at git revision `rev` (raises OSError / CalledProcessError)."""
    return subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{rel}"], capture_output=True, text=True,
                          check=True).stdout


def module_from_source(src: str, name: str, package: str | None = None):
    """Python source imported as module `name` from a temporary file (TVMScript needs a real file)."""
    import importlib.util
    import tempfile

    f = Path(tempfile.mkdtemp(prefix="gpu_base_")) / f"{name.rsplit('.', 1)[-1]}.py"
    f.write_text(src)
    spec = importlib.util.spec_from_file_location(name, f)
    mod = importlib.util.module_from_spec(spec)
    if package:
        mod.__package__ = package
    spec.loader.exec_module(mod)
    return mod


def module_at_rev(rev: str, rel: str, name: str, package: str | None = None):
    """ROOT/rel as it was at git revision `rev`, imported as module `name`."""
    return module_from_source(git_show(rev, rel), name, package)


# ----------------------------------------------------------------------------------------------
# results / command line
def write_result(path, res: dict) -> None:
    Path(path).write_text(json.dumps(res, indent=1))


def record_row(res: dict, row: dict, path) -> None:
    """Append a case row to res["cases"], print it as JSON and rewrite the result file."""
    res["cases"].append(row)
    print(json.dumps(row), flush=True)
    write_result(path, res)


def prep_run_parser(doc: str | None):
    """(parser, subparsers, prep, run): `prep OUT [--arch sm_90]` and `run OUT RESULT`, the common
    command line of the GPU check scripts; each adds its own options and commands."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prep")
    p.add_argument("out")
    p.add_argument("--arch", default="sm_90")
    r = sub.add_parser("run")
    r.add_argument("out")
    r.add_argument("result")
    return ap, sub, p, r


def prep_run_main(doc: str | None, prep, run, argv=None) -> int:
    """main() of a check script with just the common `prep OUT` / `run OUT RESULT` commands."""
    a = prep_run_parser(doc)[0].parse_args(argv)
    return {"prep": prep, "run": run}[a.cmd](a)
