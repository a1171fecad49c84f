"""Programmatic dependent launch (sm_90+): every kernel of a library waits for its predecessor's grid itself.

Why: a decode step is ~900-1000 kernels replayed as a CUDA graph, and each graph edge costs the next kernel's
launch and block scheduling after the previous one has drained (0.6 ms of a 9 ms 27B NVFP4 step measured between
kernels, more for the 35B-A3B's ~1000 small launches). With programmatic edges (runtime/executor/cuda_graph.py
rewrites a captured graph's kernel -> kernel edges) the next grid is launched while the previous one still runs;
its blocks then sit in `griddepcontrol.wait` until that grid has completed and its writes are visible.

That is only correct if every kernel begins with the wait before touching memory, so this pass inserts it at the
top of every `extern "C" __global__` definition of the CUDA source TVM hands to nvcc (compile/targets.py). The
trigger (schedule file kernels.grid_dependency.trigger): "exit" leaves it implicit, so the successor is launched
as this grid's blocks exit (the launch latency and the completion flush overlap, the successor's blocks still find
every SM free); "entry" adds `griddepcontrol.launch_dependents` after the wait (the successor's blocks become
resident while this grid runs). exit_kernels: name prefixes of kernels that keep the implicit trigger under
"entry". Measured on the H200 (BENCHMARKS.md run 8, bench/pdl_ab.py, decode 8k): "entry" costs 5 % on the 27B
NVFP4 step (its issue-bound GEMVs share their SMs with waiting blocks); "exit", and "entry" with the NVFP4 GEMVs
exempt, are within 2 % of graphs without programmatic edges on the 27B (bf16, NVFP4) and within 3 % on the
35B-A3B: the graph's launches were not what the decode step waits for. So the runtime leaves it off by default
(EngineConfig programmatic_launch). On a launch without a programmatic edge the instructions return at once (the
waiting library measured as fast as one built before this pass). The artifact records extras.grid_dependency_wait
so the runtime never rewrites the edges of a library built without them.

A kernel may call the wait itself (TIR `T.evaluate(T.call_extern("void", WAIT_FUNC))`) after work that touches no
memory a predecessor writes or reads (an L2 prefetch of its weights, say: safe even of bytes a predecessor writes,
L2 being the point of coherence); such kernels get no second wait. (Measured on the H200, run 8: the decode GEMVs'
bulk L2 prefetch of their first iteration before the wait cost 2-4 %, with and without PDL; not used.)
"""
from __future__ import annotations

import re

WAIT_FUNC = "ninfer_grid_dependency_sync"
MIN_ARCH = 90

TRIGGERS = ("entry", "exit")
TRIGGER_FUNC = "ninfer_grid_dependency_trigger"
_DEVICE_FUNCS = f"""
// compile/grid_dependency.py: wait for the preceding grid (programmatic dependent launch) / let the next launch now
__device__ __forceinline__ void {WAIT_FUNC}() {{
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= {MIN_ARCH * 10})
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}}
__device__ __forceinline__ void {TRIGGER_FUNC}() {{
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ >= {MIN_ARCH * 10})
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}}
"""
_KERNEL_NAME = re.compile(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(")
# a kernel definition (a declaration ends in ';' before any '{')
_KERNEL_DEF = re.compile(r'extern "C" __global__ [^;{]*?\)\s*\{')
_ANY_KERNEL = re.compile(r'\b__global__\b')
_DECL = re.compile(r'extern "C" __global__ [^;{]*?\)\s*;')


class GridDependencyError(RuntimeError):
    pass


def arch_supports(arch: str) -> bool:
    """Whether an sm_XX[a] arch has griddepcontrol (sm_90 and later)."""
    m = re.fullmatch(r"sm_(\d+)[a-z]?", arch or "")
    return m is not None and int(m.group(1)) >= MIN_ARCH


def _kernel_bodies(code: str) -> list:
    """[(definition match, end of its body's text)]: a kernel's body runs up to the next definition."""
    defs = list(_KERNEL_DEF.finditer(code))
    return list(zip(defs, [m.start() for m in defs[1:]] + [len(code)]))


def inject(code: str, trigger: str = "exit", exit_kernels: tuple = ()) -> str:
    """The CUDA source with the wait as the first statement of every kernel definition. Raises if a __global__
    function is neither a declaration nor a definition this pass recognised (a kernel without the wait would race
    under a programmatic edge), or if the source already carries the pass. trigger, exit_kernels: see the module
    docstring (a kernel that waits itself triggers as its blocks exit)."""
    if trigger not in TRIGGERS:
        raise GridDependencyError(f"grid_dependency trigger {trigger!r}: one of {TRIGGERS}")
    if "void " + WAIT_FUNC + "()" in code:
        raise GridDependencyError("CUDA source already carries the grid-dependency wait")
    bodies = _kernel_bodies(code)
    if not bodies:
        return code
    decls = list(_DECL.finditer(code))
    n_global = len(_ANY_KERNEL.findall(code))
    if n_global != len(bodies) + len(decls):
        raise GridDependencyError(f"{n_global} __global__ functions, {len(bodies)} definitions and {len(decls)} "
                                  "declarations recognised: refusing to build kernels that might not wait")
    first = min(m.start() for m in [m for m, _ in bodies] + decls)
    out, at = [code[:first], _DEVICE_FUNCS], first
    for m, end in bodies:
        out.append(code[at:m.end()])
        if WAIT_FUNC + "()" not in code[m.end():end]:  # (a kernel that waits itself, later: left alone)
            out.append(f"\n  {WAIT_FUNC}();")
            name = _KERNEL_NAME.search(m.group(0))
            if trigger == "entry" and not (name and name.group(1).startswith(tuple(exit_kernels))):
                out.append(f"\n  {TRIGGER_FUNC}();")
        at = m.end()
    out.append(code[at:])
    return "".join(out)


def count_waiting_kernels(code: str) -> int:
    """Kernel definitions that call the wait (first, or after their own pre-wait work): tests, build checks."""
    return sum(WAIT_FUNC + "();" in code[m.end():end] for m, end in _kernel_bodies(code))


__all__ = ["GridDependencyError", "MIN_ARCH", "TRIGGERS", "TRIGGER_FUNC", "WAIT_FUNC", "arch_supports", "count_waiting_kernels", "inject"]
