"""Relax -> CUDA pipeline: legalize, fuse, DLight-schedule what our kernels do not bind, build.

Per-target choices live in schedules/cuda_<arch>.json (read here and by
compile/kernels/cuda/registry.py):
  dlight.rules            ordered DLight GPU rules tried on every prim_func that is not already
                          thread-bound (our attention / GDN kernels are, and are left alone)
  dlight.low_batch        [[max_rows, bucket], ...]: a matmul whose only dynamic dim is the row
                          count (the decode batch or the prefill length; one prim_func serves
                          both) gets one LowBatchGEMV(bucket) version per entry plus the general
                          rule's version, dispatched at run time on the row count
  dlight.overrides        {prim_func name substring: rule}: force a rule for matching funcs
  tensor_core             TiledTensorCoreMatmul tiling (warps_m/n, frags_m/n, k_frags), measured per
                          arch with bench/gemm_gpu_check.py
  cuda_graph              value of PassContext "relax.backend.use_cuda_graph" (TVM's own graph rewrite;
                          decode graphs are captured by the runtime instead, runtime/cuda_graph.py)
  kernels.*               thread/block sizes of the hand-written kernels (registry.py)
The rule that scheduled each prim_func is returned by `last_report()` (and written next to the
library by build tools that ask for it), so what a build did can be checked against the file.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import tvm
from tvm import relax, tirx

SCHEDULE_DIR = Path(__file__).resolve().parent.parent / "schedules"
DEFAULT_SCHEDULE = {
    "dlight": {
        "rules": ["TensorCoreMatmul", "Matmul", "GEMV", "LowBatchGEMV", "Reduction", "GeneralReduction", "RMSNorm",
                  "Fallback"],
        "low_batch": [[1, 1], [4, 4], [8, 8]],
        "overrides": {},
    },
    "cuda_graph": False,
}
_REPORT: dict = {}


def schedule_dir() -> Path:
    """schedules/ of the repository, or NINFER_SCHEDULE_DIR (experiments with other choices)."""
    return Path(os.environ.get("NINFER_SCHEDULE_DIR") or SCHEDULE_DIR)


def schedule_for(target) -> dict:
    arch = str(getattr(target, "arch", "") or "sm_90")
    f = schedule_dir() / f"cuda_{arch}.json"
    sched = json.loads(f.read_text()) if f.is_file() else {}
    out = json.loads(json.dumps(DEFAULT_SCHEDULE))
    for k, v in sched.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k].update(v)
        else:
            out[k] = v
    out["_file"] = str(f) if f.is_file() else None
    return out


def last_report() -> dict:
    """{prim_func name: rule or 'thread-bound' or 'low-batch(...)'} of the last build_cuda call."""
    return dict(_REPORT)


def _make_rule(name: str, arg=None):
    """A DLight rule or one of ours by name; arg: the rule's parameter (a dict -> keyword args)."""
    from tvm.s_tir import dlight as dl

    from .kernels.cuda.tensor_core import TensorCoreMatmul, TiledTensorCoreMatmul

    cls = {"TensorCoreMatmul": TensorCoreMatmul, "TiledTensorCoreMatmul": TiledTensorCoreMatmul}.get(name) \
        or getattr(dl.gpu, name)
    if isinstance(arg, dict):
        return cls(**arg)
    return cls(arg) if arg is not None else cls()


_BOUND = re.compile(r"T\.(thread_binding|launch_thread|env_thread)\(|\"thread_extent\"")


def is_thread_bound(func: tirx.PrimFunc) -> bool:
    """True if the function already binds GPU threads (our hand-written kernels).

    (tvm 0.27 exposes no TIR visitor to Python; the printed script is the reliable check.)
    """
    return bool(_BOUND.search(func.script()))


def _apply_one(func: tirx.PrimFunc, target, rule) -> tirx.PrimFunc | None:
    from tvm.s_tir.dlight.base.transform import _apply_rules

    sch = _apply_rules(func, target, [rule], tunable=False)
    if sch is None:
        return None
    return sch[0].mod["main"]


def _dynamic_vars(func: tirx.PrimFunc) -> set:
    """Symbolic extents of the function's main block iterators (DLight's own analysis)."""
    from tvm import s_tir
    from tvm.s_tir.dlight.analysis import normalize_prim_func

    infos = normalize_prim_func(s_tir.Schedule(func))
    out = set()
    for info in infos or []:
        for it in info.iters:
            if isinstance(it.dom, int) or isinstance(it.dom, tirx.IntImm):
                continue
            if isinstance(it.dom, tirx.Var):
                out.add(it.dom)
            else:
                return {None}
    return out


def _low_batch_version(func, target, low_batch, general) -> tuple[tirx.PrimFunc, str] | None:
    """MLC-style specialisation: one LowBatchGEMV version per bucket + the general schedule,
    picked at run time on the single dynamic dimension."""
    from tvm import s_tir

    dyn = _dynamic_vars(func)
    if len(dyn) != 1 or None in dyn or not low_batch:
        return None
    var = next(iter(dyn))
    versions = []
    for limit, bucket in low_batch:
        f = _apply_one(func, target, _make_rule("LowBatchGEMV", int(bucket)))
        if f is None:
            return None
        versions.append((int(limit), f))
    if general is None:
        return None
    g_func, g_name = general
    body = g_func.body
    for limit, f in reversed(versions):
        body = tirx.IfThenElse(tirx.op.tvm_thread_invariant(var <= limit), f.body, body)
    block = s_tir.SBlock([], [], [], "root", body)
    new = func.with_body(s_tir.SBlockRealize([], True, block))
    new = new.with_attr("tirx.is_scheduled", True)
    label = "low-batch(" + ",".join(f"<={l}:LowBatchGEMV({b})" for l, b in low_batch) + f";else:{g_name})"
    return new, label


@tvm.transform.module_pass(opt_level=0, name="NinferDLight")
class NinferDLight:
    """Schedule every unbound prim_func with the first DLight rule that applies (per the schedule
    file); hand-written thread-bound kernels are kept as they are."""

    def __init__(self, sched: dict, report: dict):
        self.sched = sched
        self.report = report

    def transform_module(self, mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        cfg = self.sched["dlight"]
        rule_args = {"TiledTensorCoreMatmul": self.sched.get("tensor_core") or {}}
        rules = [(n, _make_rule(n, rule_args.get(n))) for n in cfg["rules"]]
        overrides = [(re.compile(pat), name) for pat, name in cfg.get("overrides", {}).items()]
        target = tvm.target.Target.current(allow_none=False)
        updates = {}
        for gv, func in mod.functions_items():
            if not isinstance(func, tirx.PrimFunc):
                continue
            name = gv.name_hint
            if is_thread_bound(func):
                self.report[name] = "thread-bound"
                continue
            if func.attrs is not None and "tirx.is_scheduled" in func.attrs and func.attrs["tirx.is_scheduled"]:
                self.report[name] = "pre-scheduled"
                continue
            chosen = None
            for pat, rname in overrides:
                if pat.search(name):
                    f = _apply_one(func, target, _make_rule(rname))
                    if f is not None:
                        chosen = (f, rname)
                    break
            if chosen is None:
                for rname, rule in rules:
                    f = _apply_one(func, target, rule)
                    if f is not None:
                        chosen = (f, rname)
                        break
            if chosen is None:
                raise RuntimeError(f"no DLight rule schedules prim_func {name}")
            if chosen[1] in ("Matmul", "TensorCoreMatmul", "TiledTensorCoreMatmul"):  # decode rows: GEMV versions
                lb = _low_batch_version(func, target, cfg.get("low_batch"), chosen)
                if lb is not None:
                    chosen = lb
            f, rname = chosen
            updates[gv] = f.with_attr("tirx.is_scheduled", True)
            self.report[name] = rname
        for gv, f in updates.items():
            mod[gv] = f
        return mod


def relax_pipeline(target, sched: dict, report: dict) -> tvm.transform.Pass:
    from tvm.relax.backend.cuda import pipeline as cuda_pipe

    @tvm.transform.module_pass(opt_level=0, name="NinferCUDAPipeline")
    def _pipeline(mod: tvm.IRModule, _ctx) -> tvm.IRModule:
        with target:
            seq = tvm.transform.Sequential(
                cuda_pipe.library_dispatch_passes(target)
                + [
                    # x @ permute_dims(W) -> one matmul reading W in place (no weight transposes)
                    relax.transform.FuseTransposeMatmul(),
                    relax.transform.LegalizeOps(),
                    relax.transform.AnnotateTIROpPattern(),
                    relax.transform.FoldConstant(),
                    relax.transform.FuseOps(),
                    relax.transform.FuseTIR(),
                    relax.transform.DeadCodeElimination(),
                    NinferDLight(sched, report),
                ]
                + cuda_pipe.dataflow_lower_passes(target)
                + cuda_pipe.finalize_passes(target)
            )
            return seq(mod)

    return _pipeline


def build_cuda(mod: tvm.IRModule, target):
    """Build a relax module for a CUDA target; returns the relax executable.

    Call inside compile/targets.py:cuda_build_env(target) so nvcc emits a fatbin.
    """
    sched = schedule_for(target)
    _REPORT.clear()
    cfg = {"relax.backend.use_cuda_graph": bool(sched.get("cuda_graph", False))}
    with tvm.transform.PassContext(opt_level=3, config=cfg):
        ex = relax.build(mod, target=target, relax_pipeline=relax_pipeline(target, sched, _REPORT))
    return ex
