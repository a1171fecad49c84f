"""What the compiled row bound costs: each function's statically planned storage, per target.

Lowers the model's relax module through the target's pipeline (no kernel build: seconds for the
tiny model, a few minutes for CUDA geometries) and sums the `alloc_storage` sizes that are compile-time
constants; storages whose size is still symbolic are counted separately (they are allocated per
distinct shape at run time). The planner reuses storage across layers, so a few layers of a geometry
give its full footprint.

    .venv/bin/python bench/plan_footprint.py [--geometry 27b|tiny] [--target cuda:sm_90] [--max-rows 2048]
                                              [--layers 4] [--unbounded]
"""
from __future__ import annotations

import argparse
import re
import sys

# Qwen3.5/3.6-27B text geometry (shared/research/qwen3x_arch.md 1.3), cut to `--layers` layers
GEOMETRIES = {
    "27b": dict(vocab_size=248320, hidden_size=5120, intermediate_size=17408, num_attention_heads=24,
                num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, rms_norm_eps=1e-6,
                max_position_embeddings=262144),
    "tiny": dict(vocab_size=2048, hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                 linear_value_head_dim=32, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=8192),
}
_STORAGE = re.compile(r"R\.vm\.alloc_storage\((?:R\.shape\(\[(\d+)\]\)|(\w+)),")


def planned_storage(func) -> tuple[int, int]:
    """(constant bytes, count of symbolic-size storages) of a lowered relax function."""
    const = sym = 0
    for size, var in _STORAGE.findall(func.script()):
        if size:
            const += int(size)
        else:
            sym += 1
    return const, sym


def lowered_module(geometry: str, target: str, layers: int, max_rows: int | None, mtp: bool = True):
    import tvm

    from ninfer_mlc.compile.config import parse_config
    from ninfer_mlc.compile.memory_bounds import bound_chunk_rows
    from ninfer_mlc.compile.model import Qwen3xForCausalLM
    from ninfer_mlc.compile.sampler_module import add_device_sampler
    from ninfer_mlc.compile.targets import parse_target

    spec = parse_target(target)
    dtype = "bfloat16" if spec.kind == "cuda" else "float32"
    raw = dict(GEOMETRIES[geometry], num_hidden_layers=layers, mtp_num_hidden_layers=int(mtp), architectures=["Qwen3_5ForCausalLM"],
               model_type="qwen3_5_text", layer_types=["linear_attention"] * (layers - 1) + ["full_attention"],
               rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    cfg = parse_config(raw)
    tgt = spec.tvm_target()
    with (tgt if spec.kind == "cuda" else tvm.target.Target("llvm")):
        model = Qwen3xForCausalLM(cfg, dtype, spec.kind, dtype, False, mtp=mtp)
    mod, _ = model.export_tvm(spec=model.export_spec())
    with (tgt if spec.kind == "cuda" else tvm.target.Target("llvm")):
        mod = add_device_sampler(mod, cfg.vocab_size, spec.kind)
    if max_rows:
        mod = bound_chunk_rows(mod, max_rows)
    if spec.kind == "cuda":
        from ninfer_mlc.compile.gpu_pipeline import relax_pipeline, schedule_for

        pipe = relax_pipeline(tgt, schedule_for(tgt), {})
    else:
        from ninfer_mlc.compile.cpu_pipeline import relax_pipeline

        pipe = relax_pipeline(tgt)
    with tvm.transform.PassContext(opt_level=3):
        return pipe(mod)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--geometry", choices=sorted(GEOMETRIES), default="tiny")
    ap.add_argument("--target", default="llvm")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--max-rows", type=int, default=2048)
    ap.add_argument("--unbounded", action="store_true", help="no row bound (the storage sized by n is symbolic)")
    a = ap.parse_args(argv)
    from tvm import relax

    low = lowered_module(a.geometry, a.target, a.layers, None if a.unbounded else a.max_rows)
    print(f"{a.geometry} {a.target} layers={a.layers} max_rows={'none' if a.unbounded else a.max_rows}")
    for gv, func in sorted(low.functions_items(), key=lambda kv: kv[0].name_hint):
        if isinstance(func, relax.Function):
            const, sym = planned_storage(func)
            print(f"  {gv.name_hint:14} planned {const / 2**20:9.1f} MiB   symbolic-size storages {sym}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
