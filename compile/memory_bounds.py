"""Static memory plans for the prefill-style functions: a compiled upper bound on their row count.

Why: Relax's StaticPlanBlockMemory can only give an intermediate a planned storage when its size is
known at compile time. Without a bound, every tensor sized by the token count `n` is allocated at
run time from the VM's pooled allocator, which keeps a freed block per distinct size and never gives
it back: a server whose prefill chunks take many distinct lengths grows by the intermediates of each
new length (hundreds of MB per length on a 27B model, whose KV pool leaves ~1 GiB of headroom).

With the function attribute `tir_var_upper_bound` {"n": max_rows} the planner sizes each storage for
n = max_rows, so a function allocates the same few storages on every call whatever its n, and the
pool stops growing once each function has run. `relax.memory_plan_dynamic_func_output` extends that
to the tensors it cannot share (outputs, values crossing blocks): one storage of the bounded size
each. The logits of `logit_rows` (r rows) stay exactly sized: r is not bounded (bounding it would
reserve max_rows x vocab floats, ~2 GB on a 27B model), and its distinct values are the number of
sequences in a chunk.

Bounded: the functions whose n is a prefill chunk (the engine's `prefill_chunk` must not exceed
max_rows; the manifest records it as extras.max_prefill_chunk). The decode / verify / mtp_step(_sl)
functions are left as they are: their row counts are batch shapes (a few distinct values, captured in
CUDA graphs), and bounding them would reserve a whole chunk's intermediates for a handful of rows.
Measured (bench/plan_footprint.py, max_rows 2048): 27B bf16 on sm_90 plans 321 MiB for prefill,
361 MiB for prefill_h, 168 MiB for mtp_prefill; the tiny model 15-16 MiB each.
"""
from __future__ import annotations

import tvm
from tvm import relax

DEFAULT_MAX_ROWS = 2048  # the CUDA engine's default prefill chunk (runtime/assemble.py)
ROW_VAR = "n"
# functions called with a prefill chunk of rows. Not mtp_step_sl: the engine calls it with the few rows a
# draft round has pending, and bounded it would hold ~300 MB at 27B for them (bench/plan_footprint.py)
CHUNK_FUNCTIONS = ("prefill", "prefill_h", "prefill_t", "prefill_mm", "mtp_prefill")


def bound_chunk_rows(mod: tvm.IRModule, max_rows: int, functions: tuple = CHUNK_FUNCTIONS) -> tvm.IRModule:
    """Attach the row bound (and output planning) to the module's chunk functions (those named in functions;
    a DFlash drafter's `ctx`, which takes a prefill chunk's tap rows, is bounded the same way)."""
    if int(max_rows) < 1:
        raise ValueError(f"max_rows must be positive, got {max_rows}")
    mod = mod.clone()
    for gv, func in list(mod.functions_items()):
        if isinstance(func, relax.Function) and gv.name_hint in functions:
            mod[gv] = func.with_attrs({"tir_var_upper_bound": {ROW_VAR: int(max_rows)},
                                       "relax.memory_plan_dynamic_func_output": True})
    return mod
