"""Checks of the device sampler's CUDA kernels (compile/kernels/cuda/sampling.py): random inputs covering
every kernel path and run_emulation, which runs process -> select -> logprobs -> append as generated CUDA on
the CPU emulator against the llvm sampler (compile/sampler_module.py) on the same inputs: tokens, ranks, top
ids and counts identical, logprobs within 1e-5. The shared-memory atomics are plain adds there (fibers switch
only at barriers: prelude.SAMPLER). bench/sampler_gpu_check.py checks the GPU build. Numpy only at module level.
"""
from __future__ import annotations

import json
import time

import numpy as np


def random_table(rng, vocab: int, n: int, lanes: int, threads: int = 1024) -> np.ndarray:
    """A row-parameter table (ninfer_mlc/contract/sampler_abi.py) covering the kernel paths: greedy, top_k with few / more
    candidates than the block gathers, top_p alone, min_p, penalties, bias, mask, logprobs (raw / processed)."""
    from .....contract import sampler_abi as A

    t = np.zeros((n, A.NUM_PARAMS), np.float64)
    kinds = ["greedy", "topk_small", "topk_big", "top_p", "min_p", "plain", "preset", "topk_top_p"]
    first = int(rng.integers(len(kinds)))
    for i in range(n):
        kind = kinds[(first + i) % len(kinds)]
        flags = A.F_APPEND | A.F_LOGPROBS
        if rng.random() < 0.5:
            flags |= A.F_LP_PROCESSED
        if rng.random() < 0.4:
            flags |= A.F_BIAS
        if rng.random() < 0.4:
            flags |= A.F_REPETITION
            t[i, A.P_REPETITION] = rng.uniform(0.5, 2.0)
        if rng.random() < 0.4 or kind == "preset":
            flags |= A.F_FREQ_PRES
            t[i, A.P_FREQUENCY] = rng.uniform(-1, 1)
            t[i, A.P_PRESENCE] = 1.0 if kind == "preset" else rng.uniform(-2, 2)
        if rng.random() < 0.3:
            flags |= A.F_MASK
        t[i, A.P_LANE] = i % lanes
        t[i, A.P_TEMPERATURE] = 0.0 if kind == "greedy" else float(rng.choice([0.6, 1.0, 1.5]))
        t[i, A.P_TOP_P] = {"top_p": 0.9, "preset": 0.95, "topk_top_p": 0.7}.get(kind, 1.0)
        t[i, A.P_TOP_K] = {"topk_small": 5, "preset": 20, "topk_top_p": 50,
                           "topk_big": min(vocab - 1, threads + 200)}.get(kind, 0)
        t[i, A.P_MIN_P] = 0.1 if kind == "min_p" else 0.0
        t[i, A.P_UNIFORM] = rng.random()
        t[i, A.P_FLAGS] = flags
    return t


def random_inputs(rng, vocab: int, n: int, lanes: int, threads: int = 1024) -> dict:
    """Logits with ties, -inf, NaN and +inf rows; penalty state; masks (one all-masked row when n > 3)."""
    from .....contract import sampler_abi as A

    W = A.mask_words(vocab)
    logits = (rng.normal(size=(n, vocab)) * 3).astype(np.float32)
    logits[0] = np.round(logits[0])  # many ties
    if n > 1:
        logits[1, : vocab // 2] = -np.inf
        logits[1, 3] = np.nan
    if n > 2:
        logits[2, 7] = np.inf
    counts = rng.integers(0, 3, size=(lanes, vocab)).astype(np.int32) * (rng.random((lanes, vocab)) < 0.01)
    prompt = rng.integers(-(1 << 31), 1 << 31, size=(lanes, W), dtype=np.int64).astype(np.int32)
    prompt &= rng.integers(0, 2, size=(lanes, W)).astype(np.int32) * -1
    bias = np.where(rng.random((lanes, vocab)) < 0.01, rng.uniform(-5, 5, (lanes, vocab)), 0).astype(np.float32)
    mask = rng.integers(-(1 << 31), 1 << 31, size=(n, W), dtype=np.int64).astype(np.int32)
    table = random_table(rng, vocab, n, lanes, threads)
    if n > 3:
        mask[3] = 0
        table[3, A.P_FLAGS] = int(table[3, A.P_FLAGS]) | A.F_MASK
    if n > 5:  # top_p alone over nearly flat logits: the nucleus is wider than the probe
        logits[5] *= 0.02
        table[5, [A.P_TOP_K, A.P_TOP_P, A.P_MIN_P, A.P_TEMPERATURE]] = (0, 0.9, 0, 1.0)
    return dict(logits=logits, params=table, mask=mask, counts=counts, prompt=prompt, bias=bias)


def kernel_funcs(vocab: int, threads: int) -> dict:
    from .. import sampling as S

    k = S.sampler_kernels(vocab, threads=threads)
    return {f"s_{name}": getattr(k, name).with_attr("global_symbol", f"s_{name}")
            for name in ("process", "select", "logprobs", "append")}


def llvm_sampler(vocab: int):
    """The llvm sampler functions as a relax VM (the reference of the emulation)."""
    import tvm
    from tvm import relax

    from ....sampler_module import sampler_module

    ex = relax.build(sampler_module(vocab, "llvm"), target="llvm")
    return relax.VirtualMachine(ex, tvm.cpu())


def emulate_case(lib, vm, vocab: int, inputs: dict) -> dict:
    """Run process -> select -> logprobs -> append on the emulator and `sample` on the llvm VM; compare."""
    import tvm

    from .....contract.sampler_abi import top_logprob_slots

    n, lanes = inputs["logits"].shape[0], inputs["counts"].shape[0]
    K = top_logprob_slots(vocab)
    a = {k: np.ascontiguousarray(v.copy()) for k, v in inputs.items()}
    a.update(keys=np.zeros((n, vocab), np.uint32), tokens=np.zeros(n, np.int32), token_lp=np.zeros(n, np.float32),
             rank=np.zeros(n, np.int32), top_ids=np.zeros((n, K), np.int32), top_lp=np.zeros((n, K), np.float32))
    sc = dict(n=n, lanes=lanes)
    for f in ("s_process", "s_select", "s_logprobs", "s_append"):
        lib(f, a, sc)
    T = lambda x: tvm.runtime.tensor(np.ascontiguousarray(x), tvm.cpu())  # noqa: E731
    ref = [o.numpy() for o in vm["sample"](T(inputs["logits"]), T(inputs["params"]), T(inputs["mask"]),
                                           T(inputs["counts"]), T(inputs["prompt"]), T(inputs["bias"]))]
    tok_ok = np.array_equal(a["tokens"], ref[0])
    lp_err = float(np.nanmax(np.abs(np.where(np.isfinite(ref[1]), a["token_lp"] - ref[1], 0))))
    top_err = float(np.nanmax(np.abs(np.where(np.isfinite(ref[4]), a["top_lp"] - ref[4], 0))))
    same = dict(tokens=tok_ok, rank=np.array_equal(a["rank"], ref[2]), top_ids=np.array_equal(a["top_ids"], ref[3]),
                counts=np.array_equal(a["counts"], ref[5]))
    ok = all(same.values()) and lp_err <= 1e-5 and top_err <= 1e-5
    return dict(ok=ok, **same, lp_err=lp_err, top_lp_err=top_err, got=a["tokens"].tolist(),
                want=ref[0].tolist())


def run_emulation(threads: int = 1024, vocabs=(700, 2500), rows: int = 8, seeds=(0, 1, 2), log=print) -> list[dict]:
    """Per vocabulary: the four kernels in one emulator build and the llvm sampler; per seed one case of
    `rows` rows over 4 penalty lanes (emulate_case's dict, with vocab, seed and threads added)."""
    from .lib import EmuLib

    out = []
    for vocab in vocabs:
        t0 = time.time()
        lib = EmuLib(kernel_funcs(vocab, threads))
        vm = llvm_sampler(vocab)
        log(f"V={vocab}: emulator and llvm sampler built in {time.time() - t0:.1f}s")
        for seed in seeds:
            rng = np.random.default_rng(seed)
            r = emulate_case(lib, vm, vocab, random_inputs(rng, vocab, rows, 4, threads))
            r.update(vocab=vocab, seed=seed, threads=threads)
            log(json.dumps(r))
            out.append(r)
    return out
