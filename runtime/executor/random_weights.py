"""Random weights for benchmark artifacts (`ninfer compile --random-weights`), made where they live.

A 27B-geometry benchmark needs ~55 GB of weights that no one wants to move; the artifact carries only the
parameter list (and the small exact tables: rope frequencies) and the runtime fills every other parameter
on the device. The values keep activations finite through any depth: projections ~ N(0, 1/fan_in), norms
~ 1, GDN decay parameters in their trained ranges, NVFP4 codes uniform with E4M3 scales near 1 and the
per-row global scale chosen so the dequantised rows have the same spread. Such an artifact is labelled
in its manifest (extras.random_weights) and refused by `ninfer serve` unless asked for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)  # RMS of a uniform random E2M1 code


@dataclass(frozen=True)
class Rule:
    kind: str  # normal | log_uniform | bytes | const
    a: float = 0.0  # normal: mean;  log_uniform / bytes: low;  const: value
    b: float = 0.0  # normal: std;   log_uniform / bytes: high (exclusive for bytes)


def rule_for(name: str, shape: tuple, dtype: str, params: dict) -> Rule:
    """How to draw one parameter (params: name -> (shape, dtype) of the whole list, for NVFP4 siblings)."""
    if dtype == "uint8" and name.endswith("weight_scale"):
        return Rule("bytes", 0x30, 0x40)  # E4M3 0.5 .. 1.9
    if dtype == "uint8":
        return Rule("bytes", 0, 256)  # E2M1 code pairs: every nibble is a valid code
    if name.endswith("weight_scale_2"):  # per output row: w = e2m1 * e4m3 * this
        codes_shape = params[name[: -len("_scale_2")]][0]
        fan_in = codes_shape[-1] * 2
        return Rule("const", fan_in ** -0.5 / E2M1_RMS)
    if name.endswith("A_log"):
        return Rule("log_uniform", 1.0, 16.0)
    if name.endswith("dt_bias"):
        return Rule("normal", 0.0, 0.5)
    if "norm" in name:
        return Rule("normal", 1.0, 0.05)
    if "conv1d" in name:
        return Rule("normal", 0.0, 0.3)
    fan_in = shape[-1] if len(shape) == 2 and "embed" not in name else 1
    return Rule("normal", 0.0, fan_in ** -0.5)


def generate(specs: list, skip: set, seed: int, dev, tvm) -> dict:
    """{name: device tensor} for every parameter in specs ([(name, shape, dtype)]) not in skip. On CUDA the
    values are drawn on the GPU with torch when it is importable (nothing large crosses the bus), else
    with numpy on the host."""
    params = {n: (tuple(s), d) for n, s, d in specs}
    torch: Any = None  # the module when drawing on the GPU
    if dev.dlpack_device_type() == 2:  # kDLCUDA
        try:
            import torch as torch_module  # optional: the GPU machine has it, runtime-only installs may not
        except ImportError:
            pass
        else:
            torch = torch_module
    out = {}
    rng = np.random.default_rng(seed)
    gen = None
    if torch is not None:
        gen = torch.Generator(device="cuda")
        gen.manual_seed(seed)
    for name, shape, dtype in specs:
        if name in skip:
            continue
        r = rule_for(name, tuple(shape), dtype, params)
        if torch is not None:
            out[name] = tvm.runtime.from_dlpack(_torch_draw(torch, gen, r, tuple(shape), dtype))
        else:
            out[name] = tvm.runtime.tensor(_numpy_draw(rng, r, tuple(shape), dtype), dev)
    return out


def _numpy_draw(rng, r: Rule, shape: tuple, dtype: str) -> np.ndarray:
    import ml_dtypes

    np_dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    if r.kind == "bytes":
        return rng.integers(int(r.a), int(r.b), size=shape, dtype=np.uint8)
    if r.kind == "const":
        return np.full(shape, r.a, np_dt)
    if r.kind == "log_uniform":
        return np.log(rng.uniform(r.a, r.b, size=shape)).astype(np_dt)
    return (r.a + r.b * rng.standard_normal(shape, dtype=np.float32)).astype(np_dt)


def _torch_draw(torch, gen, r: Rule, shape: tuple, dtype: str):
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "uint8": torch.uint8}[dtype]
    if r.kind == "bytes":
        return torch.randint(int(r.a), int(r.b), shape, device="cuda", dtype=torch.uint8, generator=gen)
    if r.kind == "const":
        return torch.full(shape, r.a, device="cuda", dtype=tdt)
    if r.kind == "log_uniform":
        return torch.empty(shape, device="cuda", dtype=torch.float32).uniform_(r.a, r.b, generator=gen).log_().to(tdt)
    t = torch.randn(shape, device="cuda", dtype=torch.float32, generator=gen)
    return (t * r.b + r.a).to(tdt).contiguous()
