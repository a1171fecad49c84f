"""Tensor-core matmul check: the CUDA pipeline's bf16/f16 matmul (WMMA via TensorCoreMatmul, and the
low-batch GEMV versions for <= 8 rows) against a numpy fp32 reference.

  prep (here, with nvcc):  python bench/tc_check.py prep OUT_DIR
  run  (on the GPU):       python bench/tc_check.py run OUT_DIR   -> prints max relative error per case
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

K, M = 640, 384
ROWS = (1, 5, 8, 37, 300)


def prep(out: Path) -> None:
    import tvm
    from tvm.relax.frontend import nn

    from ninfer_mlc.compile.gpu_pipeline import build_cuda, last_report
    from ninfer_mlc.compile.model import Linear
    from ninfer_mlc.compile.targets import cuda_build_env

    out.mkdir(parents=True, exist_ok=True)
    for dtype in ("bfloat16", "float16"):
        class M_(nn.Module):
            def __init__(self):
                self.lin = Linear(K, M, dtype)

            def fwd(self, x):
                return self.lin(x)

        mod, _ = M_().export_tvm(spec={"fwd": {"x": nn.spec.Tensor(["n", K], dtype),
                                               "$": {"param_mode": "packed", "effect_mode": "none"}}})
        tgt = tvm.target.Target({"kind": "cuda", "arch": "sm_90"}, host={"kind": "llvm"})
        with cuda_build_env(tgt):
            ex = build_cuda(mod, tgt)
        ex.export_library(str(out / f"tc_{dtype}.so"))
        (out / f"tc_{dtype}.json").write_text(json.dumps(last_report(), indent=1))


def run(out: Path) -> None:
    import ml_dtypes
    import tvm
    from tvm_ffi.libinfo import load_lib_ctypes

    if getattr(tvm.base, "_RUNTIME_ONLY", False):
        tvm.base._LOADED_LIBS["tvm_runtime_cuda"] = load_lib_ctypes(
            "tvm", "tvm_runtime_cuda", "RTLD_LOCAL", extra_lib_paths=tvm.libinfo.package_lib_paths())
    from tvm.runtime.vm import VirtualMachine

    dev = tvm.cuda(0)
    rng = np.random.default_rng(0)
    res = {}
    for dtype in ("bfloat16", "float16"):
        npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float16
        vm = VirtualMachine(tvm.runtime.load_module(str(out / f"tc_{dtype}.so")), dev)
        w = (rng.standard_normal((M, K)) * 0.05).astype(npdt)
        for n in ROWS:
            x = rng.standard_normal((n, K)).astype(npdt)
            got = vm["fwd"](tvm.runtime.tensor(x, dev), [tvm.runtime.tensor(w, dev)]).numpy().astype(np.float32)
            ref = x.astype(np.float32) @ w.astype(np.float32).T
            res[f"{dtype}/rows={n}"] = float(np.abs(got - ref).max() / np.abs(ref).max())
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    {"prep": prep, "run": run}[sys.argv[1]](Path(sys.argv[2]))
