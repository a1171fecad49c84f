"""numpy sampler (runtime/sampling.py) vs the device sampler built for llvm, on this CPU.

The sampler functions alone (compile/sampler_module.py) are built for llvm at Qwen3.5's vocabulary and
timed exactly as bench/sampler_gpu_check.py times the CUDA build on the GPU (its `timing`): batch 1 and 8,
greedy / Qwen's preset (T 0.6, top-p 0.95, top-k 20, presence 1.0) / top-p 0.95 alone on LLM-like logits
(N(0, 2^2) + 12 on 50 tokens) and on flat N(0, 2.5^2) ones, rows with a 4096-token prompt and 512 generated
tokens. "device" is DeviceSampler.sample (the llvm kernels on the CPU, the token ids back), "numpy" is
Sampler.sample on the logits copied out of the tensor. Median and min per case (min: this machine is shared).

Usage: python bench/sampler_bench.py [--out sampler_bench.json] [--vocab 248320] [--reps 7]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sampler_gpu_check import timing  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="sampler_bench.json")
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args(argv)
    import tvm
    from tvm import relax

    from ninfer_mlc.compile.sampler_module import sampler_module

    t0 = time.time()
    vm = relax.VirtualMachine(relax.build(sampler_module(a.vocab, "llvm"), target="llvm"), tvm.cpu())
    build_s = time.time() - t0
    rows = timing(tvm, vm, tvm.cpu(), a.vocab, a.reps, print)
    res = {"vocab": a.vocab, "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "tvm_num_threads": os.environ.get("TVM_NUM_THREADS"), "build_s": round(build_s, 1), "cases": rows}
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"{'case':10s} {'B':>2s} {'device ms (min)':>16s} {'numpy ms (min)':>16s}")
    for r in rows:
        print(f"{r['case']:10s} {r['batch']:2d} {r['device_ms']:8.2f} ({r['device_min_ms']:5.2f}) "
              f"{r['numpy_ms']:8.2f} ({r['numpy_min_ms']:5.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
