"""CUDA paged attention (compile/kernels/cuda/attention.py): correctness and decode speed on the GPU.

  prep OUT [--arch sm_90] [--no-baseline] [--no-variants]        (here: compiler + nvcc, no GPU)
      OUT/attn.so     the attention prim_funcs of every case: `new_<tag>` (the current kernel, registry
                      defaults), `old_<tag>` (compile/kernels/cuda/attention.py at git HEAD, for the
                      timing baseline; skipped when it cannot be loaded) and `v_<variant>` (other
                      threads / target_blocks / qb of the bf16 27B kernel, timed only)
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

import ctypes
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import gpu_common as gc

ROOT = Path(__file__).resolve().parent.parent
PAGE = 64
LAYERS = 2
LAYER = 1  # the call writes / reads layer 1 of 2 (the layer stride is exercised)
GEO27 = (24, 4, 256)
GEO_TINY = (4, 2, 32)
GEO_SMALL = (8, 2, 64)  # G = 4, D = 64: the smallest geometry of the prefill (FlashAttention-2) path
QUANT = ("fp8", "nvfp4")
FP8_ROW_PAD = 4
QPOOL_PAGES = 128  # distinct packed pages of a quantized test pool (larger pools repeat them)
NVFP4_BLOCK = 16

# kernel functions: tag -> (geometry, activation dtype, kv dtype or None)
FUNCS = {
    "bf16": (GEO27, "bfloat16", None),
    "fp8": (GEO27, "bfloat16", "fp8"),
    "nvfp4": (GEO27, "bfloat16", "nvfp4"),
    "f32": (GEO27, "float32", None),
    "f16": (GEO27, "float16", None),
    "f32tiny": (GEO_TINY, "float32", None),
    "fp8tiny": (GEO_TINY, "float32", "fp8"),
    "nvfp4tiny": (GEO_TINY, "bfloat16", "nvfp4"),
    "bf16small": (GEO_SMALL, "bfloat16", None),
    "nvfp4small": (GEO_SMALL, "bfloat16", "nvfp4"),
}
# variants of the bf16 27B kernel, timed next to the default (registry) configuration
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
# tags with an old_<tag> baseline (timed cases)
BASELINE_TAGS = ("bf16", "fp8", "nvfp4")


def _dec(b, ctx):
    return [(ctx - 1, 1)] * b


# name, function tag, rows [(positions already in the pool, new tokens)], timed, emulate (CPU)
CASES = [
    ("bf16_dec_b1_8k", "bf16", _dec(1, 8192), True, False),
    ("bf16_dec_b2_8k", "bf16", _dec(2, 8192), True, False),
    ("bf16_dec_b4_8k", "bf16", _dec(4, 8192), True, False),
    ("bf16_dec_b8_8k", "bf16", _dec(8, 8192), True, False),
    ("bf16_dec_b1_32k", "bf16", _dec(1, 32768), True, False),
    ("bf16_dec_b4_32k", "bf16", _dec(4, 32768), True, False),
    ("bf16_dec_b1_128k", "bf16", _dec(1, 131072), True, False),
    ("bf16_dec_b1_256k", "bf16", _dec(1, 262144), True, False),
    ("bf16_dec_ragged", "bf16", [(8191, 1), (100, 1), (0, 1), (3000, 1), (64, 1)], False, False),
    ("bf16_prefill_300_500", "bf16", [(500, 300)], True, False),
    ("bf16_prefill_ragged", "bf16", [(100, 37), (0, 20), (700, 1)], False, False),
    # prefill (n >= 64 tokens: the FlashAttention-2 attend launch); TFLOP/s = causal attention FLOPs / time
    ("bf16_pf_2k", "bf16", [(0, 2048)], True, False),
    ("bf16_pf_8k", "bf16", [(0, 8192)], True, False),
    ("bf16_pf_2k_after_6k", "bf16", [(6144, 2048)], True, False),
    ("bf16_pf_mixed", "bf16", [(1000, 700), (0, 333), (5000, 65)], False, False),
    ("fp8_dec_b1_2k", "fp8", _dec(1, 2000), True, False),
    ("fp8_dec_b4_2k", "fp8", [(1999, 1), (2047, 1), (1500, 1), (64, 1)], True, False),
    ("fp8_prefill", "fp8", [(300, 90), (0, 33)], False, False),
    ("nvfp4_dec_b1_2k", "nvfp4", _dec(1, 2000), True, False),
    ("nvfp4_dec_b4_2k", "nvfp4", [(1999, 1), (2047, 1), (1500, 1), (64, 1)], True, False),
    ("nvfp4_prefill", "nvfp4", [(300, 90), (0, 33)], False, False),
    ("f32_dec", "f32", [(700, 1), (63, 1), (0, 1)], False, False),
    ("f32_prefill", "f32", [(100, 37), (0, 20)], False, False),
    ("f16_dec", "f16", [(1000, 1), (5, 1)], False, False),
    ("f32tiny_mixed", "f32tiny", [(40, 30), (150, 1)], False, True),
    # small cases the CPU emulator runs (emulate, tests/test_cuda_build.py)
    ("emu_bf16_dec", "bf16", [(300, 1), (63, 1), (0, 1)], False, True),
    ("emu_bf16_prefill", "bf16", [(40, 9), (0, 5)], False, True),
    ("emu_fp8_dec", "fp8", [(200, 1), (31, 1)], False, True),
    ("emu_nvfp4_dec", "nvfp4", [(200, 1), (31, 1)], False, True),
    ("emu_f32_dec", "f32", [(150, 1), (64, 1)], False, True),
    ("emu_fp8tiny", "fp8tiny", [(70, 5), (0, 3)], False, True),
    ("emu_nvfp4tiny", "nvfp4tiny", [(70, 5), (0, 3)], False, True),
    ("emu_f16_dec", "f16", [(90, 1)], False, True),
    # prefill path (n >= 64): several sequences in a row tile, ragged lengths, chunks after existing context
    ("emu_bf16_pf", "bf16", [(40, 30), (0, 21), (100, 19)], False, True),
    ("emu_bf16small_pf", "bf16small", [(70, 33), (0, 31), (5, 9), (130, 3)], False, True),
    ("emu_bf16_pf_long", "bf16", [(333, 77), (64, 64)], False, True),
    ("emu_f16_pf", "f16", [(20, 70)], False, True),
    # quantized pages: the prefill path dequantizes K/V tiles into its bf16 shared tiles
    ("emu_fp8_pf", "fp8", [(40, 30), (0, 21), (100, 19)], False, True),
    ("emu_nvfp4_pf", "nvfp4", [(40, 30), (0, 21), (100, 19)], False, True),
    ("emu_nvfp4small_pf", "nvfp4small", [(70, 33), (0, 31), (5, 9)], False, True),
    # quantized pages at long context (decode: nvfp4 on tensor cores, fp8 on the SIMT split path; prefill: the
    # FlashAttention-2 launch with dequantized tiles), beside the bf16 cases of the same shapes
    *[(f"{kv}_dec_b{b}_{k}k", kv, _dec(b, k * 1024), True, False) for kv in QUANT for b, k in ((1, 8), (1, 32), (4, 32), (1, 128))],
    *[(f"{kv}_pf_{name}", kv, rows, True, False) for kv in QUANT for name, rows in (
        ("2k", [(0, 2048)]), ("8k", [(0, 8192)]), ("2k_after_30k", [(30720, 2048)]))],
    ("bf16_pf_2k_after_30k", "bf16", [(30720, 2048)], True, False),
]


def case_meta(name: str, tag: str, rows, timed: bool, seed: int) -> dict:
    geo, dt, kv = FUNCS[tag]
    need = [-(-(o + c) // PAGE) for o, c in rows]
    width = max(4, 1 << (max(need) - 1).bit_length())  # decode graphs use power-of-two page tables
    return dict(name=name, tag=tag, geo=list(geo), dtype=dt, kv=kv or dt, quant=kv in QUANT, rows=[list(r) for r in rows],
                need=need, width=width, npages=sum(need) + 2, timed=timed, seed=seed,
                func=f"new_{tag}", scale=geo[2] ** -0.5)


def all_cases() -> list[dict]:
    return [case_meta(n, t, r, tm, 1000 + i) for i, (n, t, r, tm, _) in enumerate(CASES)]


# ----------------------------------------------------------------------------------------------
# numpy codecs (no TVM): the page bytes the kernels must write
def _f():
    from ninfer_mlc.compile import nvfp4 as F

    return F


def pack_rows(x, kv: str, head_dim: int) -> np.ndarray:
    """float [..., D] -> page rows in the pool dtype (uint8 rows for fp8 / nvfp4)."""
    F = _f()
    x = np.asarray(x, np.float32)
    if kv == "nvfp4":
        return F.pack_kv_nvfp4(x)
    if kv == "fp8":
        amax = np.where(np.isnan(x), 0, np.abs(x)).max(-1).astype(np.float32)
        u = amax.view(np.uint32).astype(np.int64)
        b = (u >> 23) - 8 + ((u & 0x7FFFFF) > 0x600000)
        eb = np.where(amax > 0, np.clip(b, 1, 253), 127).astype(np.uint8)
        scale = (eb.astype(np.uint32) << 23).view(np.float32)
        codes = F.encode_e4m3(x / scale[..., None])
        pad = np.zeros(x.shape[:-1] + (FP8_ROW_PAD - 1,), np.uint8)
        return np.concatenate([codes, eb[..., None], pad], axis=-1)
    return x.astype(_np_dt(kv))


def unpack_rows(rows, kv: str, head_dim: int) -> np.ndarray:
    """page rows -> float32 [..., D]."""
    F = _f()
    if kv == "nvfp4":
        return F.unpack_kv_nvfp4(rows, head_dim)
    if kv == "fp8":
        rows = np.asarray(rows, np.uint8)
        scale = (rows[..., head_dim].astype(np.uint32) << 23).view(np.float32)
        with np.errstate(over="ignore"):
            return F.decode_e4m3(rows[..., :head_dim]) * scale[..., None]
    return np.asarray(rows, np.float32)


def _np_dt(dt: str):
    if dt == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype({"fp8": "uint8", "nvfp4": "uint8"}.get(dt, dt))


def row_bytes(kv: str, head_dim: int) -> int:
    """last pool extent (elements of the pool dtype)."""
    if kv == "nvfp4":
        return head_dim // 2 + head_dim // NVFP4_BLOCK
    if kv == "fp8":
        return head_dim + FP8_ROW_PAD
    return head_dim


def row_nbytes(kv: str, head_dim: int) -> int:
    return row_bytes(kv, head_dim) * _np_dt(kv).itemsize


# ----------------------------------------------------------------------------------------------
# inputs (seeded) and the float64 reference
def case_tokens(m: dict):
    """pos, tseq, page table (int32) and the (page, slot) each new token writes."""
    rng = np.random.default_rng(m["seed"])
    rows, need = m["rows"], m["need"]
    perm = rng.permutation(m["npages"]).astype(np.int32)
    pt = np.zeros((len(rows), m["width"]), np.int32)
    used, pos, tseq = 0, [], []
    for r, (old, cnt) in enumerate(rows):
        pt[r, :need[r]] = perm[used:used + need[r]]
        used += need[r]
        pos += range(old, old + cnt)
        tseq += [r] * cnt
    pos, tseq = np.asarray(pos, np.int32), np.asarray(tseq, np.int32)
    return pos, tseq, pt


def case_qkv(m: dict):
    """q, k, v (activation dtype) of the call."""
    hq, hkv, d = m["geo"]
    n = sum(c for _, c in m["rows"])
    rng = np.random.default_rng(m["seed"] + 1)
    dt = _np_dt(m["dtype"])
    q = (rng.standard_normal((n, hq, d)) * 3.0).astype(np.float32)
    k = rng.standard_normal((n, hkv, d)).astype(np.float32)
    v = rng.standard_normal((n, hkv, d)).astype(np.float32)
    if m["quant"]:  # rows of very different magnitudes (per-row / per-block scales)
        k *= np.exp(rng.uniform(-4, 4, (n, hkv, 1))).astype(np.float32)
        v *= np.exp(rng.uniform(-4, 4, (n, hkv, 1))).astype(np.float32)
    return q.astype(dt), k.astype(dt), v.astype(dt)


def quant_pool(m: dict) -> np.ndarray:
    """Initial pool of a quantized case (numpy, host): packed Gaussian rows of varied scale in the
    layer the call uses, random bytes in the other one (never read). Pools of more than QPOOL_PAGES
    pages repeat the packed rows of the first QPOOL_PAGES (the numpy codecs pack ~10 M elements/s: a
    128k-context pool would take a minute)."""
    hq, hkv, d = m["geo"]
    rng = np.random.default_rng(m["seed"] + 2)
    pool = rng.integers(0, 256, (m["npages"], LAYERS, 2, hkv, PAGE, row_bytes(m["kv"], d)), dtype=np.uint8)
    shape = (min(m["npages"], QPOOL_PAGES), 2, hkv, PAGE)
    x = rng.standard_normal(shape + (d,)).astype(np.float32)
    x *= np.exp(rng.uniform(-3, 3, shape + (1,))).astype(np.float32)
    x[..., :3, :] *= np.float32(2.0)  # a few larger rows per page
    pool[:, LAYER] = pack_rows(x, m["kv"], d)[np.arange(m["npages"]) % shape[0]]
    return pool


def plain_pool_np(m: dict) -> np.ndarray:
    hq, hkv, d = m["geo"]
    rng = np.random.default_rng(m["seed"] + 2)
    return rng.standard_normal((m["npages"], LAYERS, 2, hkv, PAGE, d)).astype(np.float32).astype(_np_dt(m["kv"]))


def expected_rows(m: dict, k, v):
    """[n, 2, Hkv, row] page rows this call must append (pool dtype)."""
    d = m["geo"][2]
    kr = pack_rows(np.asarray(k, np.float32), m["kv"], d)
    vr = pack_rows(np.asarray(v, np.float32), m["kv"], d)
    return np.stack([kr, vr], axis=1)


def _attend(q, K, V, group: int, scale: float):
    """q [Hq, D], K/V [L, Hkv, D] float64 (numpy or torch) -> [Hq, D]."""
    hkv, d = K.shape[1], K.shape[2]
    qg = q.reshape(hkv, group, d)
    if isinstance(q, np.ndarray):
        s = np.einsum("kgd,lkd->kgl", qg, K) * scale
        p = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("kgl,lkd->kgd", p, V) / p.sum(-1, keepdims=True)
    else:
        import torch

        s = torch.einsum("kgd,lkd->kgl", qg, K) * scale
        p = torch.exp(s - s.amax(-1, keepdim=True))
        o = torch.einsum("kgl,lkd->kgd", p, V) / p.sum(-1, keepdim=True)
    return o.reshape(hkv * group, d)


def reference(m: dict, q, pool_after, pos, tseq, pt, torch_dev=None):
    """float64 attention of every new token over positions 0..pos of its sequence, read from the
    pool after this call's append (numpy; or torch float64 on the GPU when pool_after is a torch
    tensor of a plain dtype). Quantized pools are dequantized with the numpy codecs."""
    hq, hkv, d = m["geo"]
    group = hq // hkv
    out = np.zeros((len(pos), hq, d))
    is_t = not isinstance(pool_after, np.ndarray)
    deq = {}  # quantized pool: sequence -> its K, V rows dequantized once (float64; torch on the GPU run)
    for i in range(len(pos)):
        L = int(pos[i]) + 1
        j = np.arange(L)
        pg = pt[tseq[i], j // PAGE]
        sl = j % PAGE
        if not is_t and m["quant"]:
            r = int(tseq[i])
            if r not in deq:
                jj = np.arange(int(pos[tseq == r].max()) + 1)
                pgs, sls = pt[r, jj // PAGE], jj % PAGE
                kv_ = [unpack_rows(pool_after[:, LAYER, c][pgs, :, sls], m["kv"], d).astype(np.float64) for c in (0, 1)]
                if torch_dev is not None:
                    import torch

                    kv_ = [torch.as_tensor(x, device=torch_dev) for x in kv_]
                deq[r] = kv_
            K, V = deq[r]
            qi = np.asarray(q[i], np.float64)
            if torch_dev is not None:
                qi = torch.as_tensor(qi, device=torch_dev)
            o = _attend(qi, K[:L], V[:L], group, m["scale"])
            out[i] = o.cpu().numpy() if torch_dev is not None else o
        elif is_t:
            import torch

            pgt = torch.as_tensor(pg, device=pool_after.device, dtype=torch.long)
            slt = torch.as_tensor(sl, device=pool_after.device, dtype=torch.long)
            K = pool_after[:, LAYER, 0][pgt, :, slt].to(torch.float64)
            V = pool_after[:, LAYER, 1][pgt, :, slt].to(torch.float64)
            qi = torch.as_tensor(np.asarray(q[i], np.float64), device=pool_after.device)
            out[i] = _attend(qi, K, V, group, m["scale"]).cpu().numpy()
        else:
            K = unpack_rows(pool_after[:, LAYER, 0][pg, :, sl], m["kv"], d).astype(np.float64)
            V = unpack_rows(pool_after[:, LAYER, 1][pg, :, sl], m["kv"], d).astype(np.float64)
            out[i] = _attend(np.asarray(q[i], np.float64), K, V, group, m["scale"])
    return out


def write_rows(pool, m: dict, pos, tseq, pt, rows):
    """pool[pt[tseq, pos // PAGE], LAYER, c, :, pos % PAGE] = rows[:, c] (numpy or torch pool)."""
    for i in range(len(pos)):
        pg, sl = int(pt[tseq[i], pos[i] // PAGE]), int(pos[i] % PAGE)
        for c in range(2):
            r = rows[i, c]
            if not isinstance(pool, np.ndarray):
                import torch

                r = torch.as_tensor(_torch_view(r), device=pool.device)
            pool[pg, LAYER, c, :, sl] = r
    return pool


def _torch_view(a: np.ndarray) -> np.ndarray:
    """numpy array torch can take (bfloat16 -> its uint16 bits; the caller views back)."""
    return a.view(np.int16) if a.dtype == _np_dt("bfloat16") else a


rel_err = gc.rel_err


def tolerance(m: dict) -> float:
    return 1e-4 if m["dtype"] == "float32" else 1e-2


def attn_flops(m: dict, pos) -> int:
    """Causal attention FLOPs of the call: 4 * (pos + 1) * D per query head and token (QK^T and PV)."""
    hq, hkv, d = m["geo"]
    return int(sum(int(p) + 1 for p in pos)) * 4 * d * hq


def kv_bytes_read(m: dict, pos) -> int:
    hq, hkv, d = m["geo"]
    return int(sum(int(p) + 1 for p in pos)) * hkv * 2 * row_nbytes(m["kv"], d)


# ----------------------------------------------------------------------------------------------
# kernels
def kernel_funcs(baseline: bool = True, variants: bool = True, tags=None) -> dict:
    """{global symbol: prim_func} of the new kernels (registry defaults), the HEAD baseline and the
    bf16 variants."""
    from ninfer_mlc.compile.kernels.cuda import attention as A
    from ninfer_mlc.compile.kernels.registry import kernel_set

    funcs = {}
    for tag, (geo, dt, kv) in FUNCS.items():
        if tags is not None and tag not in tags:
            continue
        args = (*geo, PAGE, LAYERS, dt, geo[2] ** -0.5)
        funcs[f"new_{tag}"] = kernel_set("cuda", kv).paged_attention(*args)
        if variants and tag == "bf16":
            for vn, kw in VARIANTS.items():
                funcs[f"v_{vn}"] = A.paged_attention(*args, kv_dtype=kv, **kw)
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
        self.emu = EmuLib(kernel_funcs(baseline=False, variants=False, tags=tags))

    def bind(self, m, q, k, v, pos, tseq, pt, pool_t):
        torch = self.torch
        pool = (pool_t.view(torch.int16).numpy().view(_np_dt("bfloat16")) if pool_t.dtype == torch.bfloat16
                else pool_t.numpy())  # shares pool_t's memory
        return dict(m=m, q=np.ascontiguousarray(q), k=np.ascontiguousarray(k), v=np.ascontiguousarray(v), pos=pos,
                    tseq=tseq, pt=pt, pool=pool)

    def call(self, fn, args):
        m, n, pt = args["m"], len(args["pos"]), args["pt"]
        hq, hkv, d = m["geo"]
        ws = n * hq * 2 * pt.shape[1]
        arrays = {k_: v_ for k_, v_ in args.items() if k_ != "m"}
        arrays.update(out=np.full((n, hq, d), np.nan, np.float32).astype(_np_dt(m["dtype"])),
                      ws_o=np.zeros(ws * d, np.float32), ws_ml=np.zeros(ws * 2, np.float32))
        self.emu(fn, arrays, dict(n=n, b=pt.shape[0], p=pt.shape[1], npages=arrays["pool"].shape[0], layer=LAYER))
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
        row = {"rows": m["rows"], "tag": m["tag"]}
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
    fns = [m["func"]] + [fn for fn in (f"old_{m['tag']}",) if fn in funcs and not slow_old]
    if m["tag"] == "bf16" and not a.skip_variants and time.time() - t_start < a.budget_s and "_pf_" not in m["name"]:
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
    for name, r in res["cases"].items():
        if "error" in r:
            print(f"{name:24s}  ERROR")
            continue
        t = r.get("timing") or {}
        new = next((v for k, v in t.items() if k.startswith("new_")), None)
        old = next((v for k, v in t.items() if k.startswith("old_")), None)

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
_EMU_PRELUDE = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <functional>
#define uint unsigned int
#define uchar unsigned char
#define ushort unsigned short
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define CUDART_INF_F INFINITY
struct emu_dim3 { unsigned x, y, z; };
static emu_dim3 threadIdx, blockIdx, blockDim, gridDim;
struct nv_bfloat16 {
  uint16_t b;
  nv_bfloat16() = default;
  nv_bfloat16(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) b = (uint16_t)((u >> 16) | 0x40);
    else { u += 0x7fffu + ((u >> 16) & 1u); b = (uint16_t)(u >> 16); }
  }
  operator float() const { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
};
typedef _Float16 half;
struct uint2 { unsigned x, y; };
struct uint4 { unsigned x, y, z, w; };
struct int2 { int x, y; };
struct int4 { int x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct ulonglong2 { unsigned long long x, y; };
struct ulonglong4 { unsigned long long x, y, z, w; };
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline float min(float a, float b) { return fminf(a, b); }
template <class A, class B> static inline auto max(A a, B b) { return a > b ? a : b; }
template <class A, class B> static inline auto min(A a, B b) { return a < b ? a : b; }
static inline float __fdiv_rn(float a, float b) { return a / b; }

// ---- fibers: one per CUDA thread of the running block, switched on barriers -----------------
extern "C" void emu_switch(void** save_sp, void* load_sp);
asm(R"(
.text
.globl emu_switch
.hidden emu_switch
.type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
)");
struct EmuFiber { void* sp; char* stack; bool done; int wait_bar; unsigned wait_gen; };
struct EmuBar { int expected, count; unsigned gen; };
static const size_t EMU_STACK = 1 << 18;
static std::vector<EmuFiber> g_fib;
static std::vector<EmuBar> g_bar;  // 0: block, 1 + w: warp w
static int g_cur;
static void* g_sched_sp;
static std::function<void()> g_fn;
static uint64_t g_slot[32][32];
static long long g_switches;

static void emu_yield() { emu_switch(&g_fib[g_cur].sp, g_sched_sp); }
static void emu_bar_wait(int b) {
  EmuBar& B = g_bar[b];
  if (++B.count == B.expected) { B.count = 0; B.gen++; return; }
  g_fib[g_cur].wait_bar = b;
  g_fib[g_cur].wait_gen = B.gen;
  emu_yield();
}
static void emu_fiber_main() {
  g_fn();
  g_fib[g_cur].done = true;
  emu_switch(&g_fib[g_cur].sp, g_sched_sp);
  abort();
}
static void emu_run_block(int nt) {
  if ((int)g_fib.size() < nt) {
    size_t old = g_fib.size();
    g_fib.resize(nt);
    for (size_t t = old; t < (size_t)nt; ++t) g_fib[t].stack = (char*)aligned_alloc(64, EMU_STACK);
  }
  g_bar.assign(1 + (nt + 31) / 32, EmuBar{0, 0, 0});
  g_bar[0].expected = nt;
  for (int w = 0; w * 32 < nt; ++w) g_bar[1 + w].expected = (nt - 32 * w < 32) ? nt - 32 * w : 32;
  for (int t = 0; t < nt; ++t) {
    EmuFiber& f = g_fib[t];
    uintptr_t top = ((uintptr_t)(f.stack + EMU_STACK)) & ~(uintptr_t)15;
    void** sp = (void**)top;
    *--sp = nullptr;
    *--sp = (void*)&emu_fiber_main;
    for (int r = 0; r < 6; ++r) *--sp = nullptr;
    f.sp = sp; f.done = false; f.wait_bar = -1; f.wait_gen = 0;
  }
  int alive = nt;
  while (alive) {
    bool progress = false;
    for (int t = 0; t < nt; ++t) {
      EmuFiber& f = g_fib[t];
      if (f.done) continue;
      if (f.wait_bar >= 0) {
        if (g_bar[f.wait_bar].gen == f.wait_gen) continue;
        f.wait_bar = -1;
      }
      g_cur = t;
      threadIdx = emu_dim3{(unsigned)t, 0, 0};
      ++g_switches;
      emu_switch(&g_sched_sp, f.sp);
      progress = true;
      if (f.done) --alive;
    }
    if (!progress) { fprintf(stderr, "emulator: deadlock in block (%u,%u,%u)\n", blockIdx.x, blockIdx.y, blockIdx.z); abort(); }
  }
}
static void emu_launch(int gx, int gy, int gz, int bx, std::function<void()> fn) {
  g_fn = fn;
  gridDim = emu_dim3{(unsigned)gx, (unsigned)gy, (unsigned)gz};
  blockDim = emu_dim3{(unsigned)bx, 1, 1};
  for (int z = 0; z < gz; ++z)
    for (int y = 0; y < gy; ++y)
      for (int x = 0; x < gx; ++x) {
        blockIdx = emu_dim3{(unsigned)x, (unsigned)y, (unsigned)z};
        emu_run_block(bx);
      }
}
template <class T> static T emu_shfl(T v, int src) {
  int w = g_cur >> 5, l = g_cur & 31;
  uint64_t bits = 0;
  memcpy(&bits, &v, sizeof(T));
  g_slot[w][l] = bits;
  emu_bar_wait(1 + w);
  uint64_t sb = g_slot[w][src & 31];
  T r;
  memcpy(&r, &sb, sizeof(T));
  emu_bar_wait(1 + w);
  return r;
}
template <class T> static T __shfl_xor_sync(unsigned, T v, int m, int = 32) { return emu_shfl(v, (g_cur & 31) ^ m); }
template <class T> static T __shfl_sync(unsigned, T v, int src, int = 32) { return emu_shfl(v, src); }
static void __syncthreads() { emu_bar_wait(0); }
static void __syncwarp(unsigned = 0xffffffffu) { emu_bar_wait(1 + (g_cur >> 5)); }
extern "C" long long emu_switch_count() { return g_switches; }
// ---- the kernels' device helpers (compile/kernels/cuda/attention.py _MMA_SRC / _PACK_SRC) --------
static float emu_h2f_bf16(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }
static float emu_h2f_f16(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static uint32_t g_mma[32][32][6];
// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: a warp-collective D = A B + C with the PTX fragment
// layouts (groupID = lane >> 2, tig = lane & 3): A reg r holds rows g + 8 (r & 1), cols 2 tig + 8 (r >> 1)
// (+0, +1 in the low / high half); B reg r holds rows (k) 2 tig + 8 r (+0, +1), col g; C holds
// (g, 2 tig + {0, 1}) and (g + 8, 2 tig + {0, 1}).
template <int F16> static void emu_mma(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0,
                                       unsigned b1) {
  int w = g_cur >> 5, l = g_cur & 31;
  uint32_t* me = g_mma[w][l];
  me[0] = a0; me[1] = a1; me[2] = a2; me[3] = a3; me[4] = b0; me[5] = b1;
  emu_bar_wait(1 + w);
  auto h2f = [](uint32_t word, int hi) { uint16_t h = (uint16_t)(hi ? word >> 16 : word & 0xffffu);
                                         return F16 ? emu_h2f_f16(h) : emu_h2f_bf16(h); };
  auto A = [&](int r, int k) { int lane = (r & 7) * 4 + ((k & 7) >> 1); int reg = (r >> 3) + 2 * (k >> 3);
                               return h2f(g_mma[w][lane][reg], k & 1); };
  auto B = [&](int k, int n) { int lane = n * 4 + ((k & 7) >> 1); return h2f(g_mma[w][lane][4 + (k >> 3)], k & 1); };
  int g = l >> 2, t = l & 3;
  float d[4];
  for (int o = 0; o < 4; ++o) {
    int r = g + 8 * (o >> 1), n = 2 * t + (o & 1);
    float acc = c[o];
    for (int k = 0; k < 16; ++k) acc += A(r, k) * B(k, n);
    d[o] = acc;
  }
  emu_bar_wait(1 + w);
  for (int o = 0; o < 4; ++o) c[o] = d[o];
}
static void ninfer_attn_mma_bf16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  emu_mma<0>(c, a0, a1, a2, a3, b0, b1);
}
static void ninfer_attn_mma_f16(float* c, unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
  emu_mma<1>(c, a0, a1, a2, a3, b0, b1);
}
static void ninfer_attn_ld16(unsigned* d, const void* p) { memcpy(d, p, 16); }
#define ninfer_attn_pf_mma_bf16 ninfer_attn_mma_bf16
#define ninfer_attn_pf_mma_f16 ninfer_attn_mma_f16
#define ninfer_attn_pf_pack_bf16x2 ninfer_attn_pack_bf16x2
#define ninfer_attn_pf_pack_f16x2 ninfer_attn_pack_f16x2
// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane l gives the row address of matrix l / 8, row l % 8
// (16 bytes); lane (g, t) receives of matrix j: row g, elements 2t, 2t+1 (.trans: rows 2t, 2t+1 of column g)
static const void* g_ldsm[32][32];
template <int TR> static void emu_ldsm(unsigned* r, const void* p) {
  int w = g_cur >> 5, l = g_cur & 31;
  g_ldsm[w][l] = p;
  emu_bar_wait(1 + w);
  int g = l >> 2, t = l & 3;
  unsigned d[4];
  for (int j = 0; j < 4; ++j) {
    uint16_t lo, hi;
    if (TR) {
      memcpy(&lo, (const char*)g_ldsm[w][8 * j + 2 * t] + 2 * g, 2);
      memcpy(&hi, (const char*)g_ldsm[w][8 * j + 2 * t + 1] + 2 * g, 2);
    } else {
      memcpy(&lo, (const char*)g_ldsm[w][8 * j + g] + 4 * t, 2);
      memcpy(&hi, (const char*)g_ldsm[w][8 * j + g] + 4 * t + 2, 2);
    }
    d[j] = (unsigned)lo | ((unsigned)hi << 16);
  }
  emu_bar_wait(1 + w);
  for (int j = 0; j < 4; ++j) r[j] = d[j];
}
static void ninfer_attn_ldsm_x4(unsigned* r, const void* p) { emu_ldsm<0>(r, p); }
static void ninfer_attn_ldsm_x4_t(unsigned* r, const void* p) { emu_ldsm<1>(r, p); }
// cp.async: the copy happens at once (fibers only switch at barriers / warp collectives, and the kernels
// __syncthreads() after cp.async.wait_group before any other thread reads the data)
static void ninfer_attn_cp16(void* dst, const void* src) { memcpy(dst, src, 16); }
static void ninfer_attn_cp_commit() {}
static void ninfer_attn_cp_wait0() {}
static void ninfer_attn_cp_wait1() {}
static unsigned ninfer_attn_pack_bf16x2(float lo, float hi) {
  nv_bfloat16 a(lo), b(hi);
  return (unsigned)a.b | ((unsigned)b.b << 16);
}
static unsigned ninfer_attn_pack_f16x2(float lo, float hi) {
  _Float16 a = (_Float16)lo, b = (_Float16)hi;
  uint16_t x, y; memcpy(&x, &a, 2); memcpy(&y, &b, 2);
  return (unsigned)x | ((unsigned)y << 16);
}
// ---- compile/kernels/cuda/moe.py's helpers ------------------------------------------------------------
#define ninfer_moe_mma_bf16 ninfer_attn_mma_bf16
#define ninfer_moe_mma_f16 ninfer_attn_mma_f16
static inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }
static inline uint4 ninfer_moe_ldw(const void* p) { uint4 r; memcpy(&r, p, 16); return r; }
// fibers switch only at barriers and warp collectives: a plain read-modify-write is atomic here
static inline int ninfer_moe_atomic_add(int* p, int v) { int o = *p; *p += v; return o; }
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  uint64_t v = ((uint64_t)y << 32) | x; unsigned r = 0;
  for (int i = 0; i < 4; ++i) r |= (unsigned)((v >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return r;
}
// fma.rn.bf16x2(a, b, -0): the exact fp32 product rounded to nearest even bf16 (as bench/gemv_gpu_check.py's shim)
static inline unsigned ninfer_moe_bf16x2_mul(unsigned a, unsigned b) {
  float lo = emu_h2f_bf16(a & 0xffffu) * emu_h2f_bf16(b & 0xffffu), hi = emu_h2f_bf16(a >> 16) * emu_h2f_bf16(b >> 16);
  return (unsigned)nv_bfloat16(lo).b | ((unsigned)nv_bfloat16(hi).b << 16);
}
// ---- qattn: fp8 / nvfp4 pages on tensor cores (compile/kernels/cuda/attention.py NVFP4_F16X8_SRC, E4M3*_F16X2_SRC, H2F_SRC)
static unsigned ninfer_attn_e4m3_f16x2(unsigned b) {  // cvt.rn.f16x2.e4m3x2 of the byte pair (b, b)
  b &= 0xFFu;
  const unsigned e = (b >> 3) & 15u, m = b & 7u;
  float v = e ? ldexpf(1.0f + (float)m / 8.0f, (int)e - 7) : ldexpf((float)m, -9);
  if (b & 0x80u) v = -v;
  _Float16 h = (_Float16)v;
  uint16_t u; memcpy(&u, &h, 2);
  return (unsigned)u * 0x10001u;
}
static float ninfer_attn_h2f(unsigned h) { return emu_h2f_f16((uint16_t)(h & 0xFFFFu)); }  // cvt.f32.f16
static unsigned ninfer_attn_e4m3x2_f16x2(unsigned w) {  // cvt.rn.f16x2.e4m3x2 of the low 16 bits
  const unsigned lo = ninfer_attn_e4m3_f16x2(w & 0xFFu), hi = ninfer_attn_e4m3_f16x2((w >> 8) & 0xFFu);
  return (lo & 0xFFFFu) | (hi & 0xFFFF0000u);
}
static void ninfer_attn_nvfp4_f16x8(unsigned* d, unsigned w, unsigned s2) {  // pairs (0,2) (1,3) (4,6) (5,7) x scale
  static const float mag[8] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
  static const int first[4] = {0, 1, 4, 5};
  uint16_t sb = (uint16_t)(s2 & 0xFFFFu); _Float16 s; memcpy(&s, &sb, 2);
  for (int k = 0; k < 4; ++k) {
    unsigned r = 0;
    for (int hh = 0; hh < 2; ++hh) {
      const unsigned c = (w >> (4 * (first[k] + 2 * hh))) & 15u;
      _Float16 x = (_Float16)((c & 8u ? -mag[c & 7u] : mag[c & 7u]) * (float)s);  // exact product, one rounding
      uint16_t u; memcpy(&u, &x, 2);
      r |= (unsigned)u << (16 * hh);
    }
    d[k] = r;
  }
}
"""

_KERNEL_SIG = re.compile(r'extern "C" __global__ void __launch_bounds__\((\d+)(?:, *\d+)?\) (\w+)\((.*?)\) \{')


def _split_args(s: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in s:
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


class _TEval:
    """Evaluates the host TIR's launch-argument expressions (T.min, T.Div, T.Cast, ...)."""

    @staticmethod
    def min(a, b):
        return min(a, b)

    @staticmethod
    def max(a, b):
        return max(a, b)

    @staticmethod
    def Div(a, b):
        q = abs(a) // abs(b)
        return q if (a >= 0) == (b >= 0) else -q

    truncdiv = Div

    @staticmethod
    def FloorDiv(a, b):
        return a // b

    floordiv = FloorDiv

    @staticmethod
    def FloorMod(a, b):
        return a % b

    @staticmethod
    def Cast(_dt, x):
        return int(x)

    @staticmethod
    def Select(c, a, b):
        return a if c else b

    @staticmethod
    def int64(x):
        return int(x)

    int32 = int64


def cuda_source(funcs: dict, arch: str = "sm_90", cse: bool = True):
    """(CUDA source, host TIR script) of prim_funcs lowered for cuda:arch, without compiling it:
    whether or not this process loaded TVM's CUDA runtime (then codegen would call nvcc), the compile
    callback is a no-op while the source is generated."""
    import tvm
    import tvm_ffi
    from tvm.target import Target
    from tvm.tirx.build import split_host_device_mods

    from ninfer_mlc.compile.targets import parse_target

    tgt = parse_target("cuda:" + arch).tvm_target()
    prev = tvm_ffi.get_global_func("tvm_callback_cuda_compile", allow_missing=True)
    tvm_ffi.register_global_func("tvm_callback_cuda_compile", lambda *_a: b"// source only\n", override=True)
    try:
        with tvm.transform.PassContext(config={"tirx.disable_cse_tir": not cse}):
            mod = tvm.tirx.transform.BindTarget(tgt)(tvm.IRModule(funcs))
            pipeline, _fh, fd = tvm.tirx.get_default_tir_pipeline(tgt)
            mod = pipeline(mod)
            host, dev_mods = split_host_device_mods(mod)
            (dtgt, dmod), = dev_mods.items()
            m = tvm.get_global_func("target.build.cuda")(fd()(dmod), Target(dtgt))
            src = m.inspect_source("cuda") or m.inspect_source()
    finally:
        if prev is not None:
            tvm_ffi.register_global_func("tvm_callback_cuda_compile", prev, override=True)
        else:
            tvm_ffi.remove_global_func("tvm_callback_cuda_compile")
    return src, host.script()


class EmuLib:
    """A g++-built CPU emulation of the CUDA kernels of some prim_funcs (see the module docstring)."""

    def __init__(self, funcs: dict, arch: str = "sm_90", workdir: Path | None = None, extra_prelude: str = ""):
        """extra_prelude: C++ emulating device helpers other kernels call (atomics, intrinsics)."""
        src, host = cuda_source(funcs, arch, cse=False)  # CSE off: kernel scalars are the named shape vars
        self.launches = self._parse_host(host, list(funcs))
        body = src[src.index('extern "C"'):]
        # device functions of the kernels' own source (prefill_source) live in the preamble: keep them
        own = dict.fromkeys(re.findall(r"// NINFER_ATTN_SRC_BEGIN.*?// NINFER_ATTN_SRC_END", src[:src.index('extern "C"')],
                                       flags=re.S))
        body = "\n".join(own) + "\n" + body
        # blocks run one at a time: shared memory is static storage (dynamic shared memory: 256 KiB)
        body = re.sub(r"extern __shared__ __align__\((\d+)\) (\w+) (\w+)\[\];", r"alignas(\1) static \2 \3[1 << 18];",
                      body)
        body = re.sub(r"__shared__ (alignas\(\d+\) )?", r"\1static ", body)
        body = re.sub(r"// NINFER_ATTN_DEV_BEGIN.*?// NINFER_ATTN_DEV_END", "", body, flags=re.S)  # emulated above
        self.kernels = {}  # name -> (block threads, [(ctype, param name)])
        wrappers = []
        for nt, name, params in _KERNEL_SIG.findall(body):
            plist = []
            for p in _split_args(params):
                p = p.replace("__restrict__", "").strip()
                ctype, pname = p.rsplit(" ", 1) if "*" not in p else (p[:p.rindex("*") + 1], p[p.rindex("*") + 1:])
                plist.append((ctype.strip(), pname.strip()))
            self.kernels[name] = (int(nt), plist)
            cargs = ", ".join(f"({t})a[{i}]" if t.endswith("*") else f"({t})s[{i}]" for i, (t, _) in enumerate(plist))
            wrappers.append(f'extern "C" void emu_{name}(void** a, const int64_t* s, int gx, int gy, int gz, int bx) '
                            f'{{ emu_launch(gx, gy, gz, bx, [=] {{ {name}({cargs}); }}); }}')
        code = _EMU_PRELUDE + "\n" + extra_prelude + "\n" + body + "\n" + "\n".join(wrappers) + "\n"
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="attn_emu_"))
        self.dir.mkdir(parents=True, exist_ok=True)
        (self.dir / "emu.cpp").write_text(code)
        so = self.dir / "emu.so"
        r = subprocess.run(["g++", "-std=c++20", *os.environ.get("ATTN_EMU_CFLAGS", "-O1").split(), "-w", "-shared", "-fPIC", "-o", str(so), str(self.dir / "emu.cpp")],
                           capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError("g++ failed on the emulated kernels:\n" + r.stderr[-4000:])
        self.lib = ctypes.CDLL(str(so))

    @staticmethod
    def _parse_host(script: str, names) -> dict:
        """{prim_func name: [(kernel, [arg exprs], [launch param names], [(host condition, negated)])]} in
        launch order; the conditions are the host `if` / `else` branches around the launch."""
        out = {}
        cur = None
        stack = []  # (indent, condition, in else branch)
        for line in script.splitlines():
            st = line.strip()
            if not st:
                continue
            ind = len(line) - len(line.lstrip())
            if st == "else:":
                while stack and stack[-1][0] > ind:
                    stack.pop()
                if stack and stack[-1][0] == ind:
                    stack[-1] = (ind, stack[-1][1], True)
                continue
            while stack and stack[-1][0] >= ind:
                stack.pop()
            m = re.match(r"\s*def (\w+)\(", line)
            if m and m.group(1) in names:
                cur = m.group(1)
                out[cur] = []
                stack = []
            m = re.match(r"if (.*):$", st)
            if m:
                stack.append((ind, m.group(1), False))
                continue
            m = re.search(r'T\.call_ffi_kernel\("(\w+)", (.*), launch_params=\[(.*?)\]', line)
            if m and cur:
                out[cur].append((m.group(1), _split_args(m.group(2)), [x.strip().strip('"') for x in m.group(3).split(",")],
                                 [(c, neg) for _, c, neg in stack]))
        return out

    def __call__(self, func: str, arrays: dict, scalars: dict):
        """Run prim_func `func`: arrays by buffer name (numpy, modified in place), scalars by name."""
        keep = []
        for kname, args, lp, conds in self.launches[func]:
            nt, plist = self.kernels[kname]
            nparams = len(plist)
            env = dict(scalars)
            if not all(bool(eval(c, {"T": _TEval}, env)) != neg for c, neg in conds):  # noqa: S307
                continue
            vals = [eval(x, {"T": _TEval}, env) if not x.endswith(".data") else x for x in args]  # noqa: S307
            dims = dict(zip(lp, vals[nparams:]))
            ptrs = (ctypes.c_void_p * nparams)()
            sc = (ctypes.c_int64 * nparams)()
            for i, ((ctype, pname), v) in enumerate(zip(plist, vals[:nparams])):
                if ctype.endswith("*"):
                    base = re.match(r"(\w+?)(_\d+)?\.data$", v).group(1)
                    base = {"poolv": "pool", "poolw": "pool", "poolu": "pool", "qw1": "q", "outv": "out"}.get(base, base)
                    arr = arrays[base]
                    ptrs[i] = arr.ctypes.data
                    keep.append(arr)
                else:
                    sc[i] = int(v)
            gx, gy, gz = (int(dims.get(f"blockIdx.{c}", 1)) for c in "xyz")
            bx = int(dims.get("threadIdx.x", 1))
            if nt != bx:
                raise RuntimeError(f"{kname}: launch bounds {nt} != block {bx}")
            getattr(self.lib, f"emu_{kname}")(ptrs, sc, gx, gy, gz, bx)
        return arrays


def emulate_case(m: dict, lib: EmuLib | None = None, func: str | None = None) -> dict:
    """Run case `m` through the CPU emulator; {rel_err, tol, pool_bytes_differing, ok}."""
    from ninfer_mlc.compile.kernels.cuda import attention as A  # noqa: F401 - fail early without TVM

    if lib is None:
        lib = EmuLib(kernel_funcs(baseline=False, variants=False, tags=[m["tag"]]))
    hq, hkv, d = m["geo"]
    pos, tseq, pt = case_tokens(m)
    q, k, v = case_qkv(m)
    n = len(pos)
    pool0 = quant_pool(m) if m["quant"] else plain_pool_np(m)
    ref_pool = write_rows(pool0.copy(), m, pos, tseq, pt, expected_rows(m, k, v))
    ref = reference(m, np.asarray(q, np.float32), ref_pool, pos, tseq, pt)
    from ninfer_mlc.compile.kernels.cuda.registry import kernel_params

    kp = kernel_params()["paged_attention"]
    ns = A.attend_splits(n, pt.shape[1], hkv, PAGE, kp["threads"], kp["target_blocks"],
                         A.PF_MIN_ROWS if A.prefill_applies(hq, hkv, d, m["dtype"], m["kv"]) else None)
    ws = n * hq * max(2 * pt.shape[1], ns)  # >= any split count (also the baseline kernel's <= p)
    pool = np.ascontiguousarray(pool0.copy())
    out = np.full((n, hq, d), np.nan, np.float32).astype(_np_dt(m["dtype"]))
    arrays = dict(q=np.ascontiguousarray(q), k=np.ascontiguousarray(k), v=np.ascontiguousarray(v), pos=pos, tseq=tseq,
                  pt=pt, pool=pool, out=out, ws_o=np.zeros(ws * d, np.float32), ws_ml=np.zeros(ws * 2, np.float32))
    scalars = dict(n=n, b=pt.shape[0], p=pt.shape[1], npages=pool.shape[0], layer=LAYER)
    lib(func or m["func"], arrays, scalars)
    err = rel_err(out.astype(np.float32), ref)
    differ = int((pool.view(np.uint8) != ref_pool.view(np.uint8)).sum())
    tol = tolerance(m)
    return dict(rel_err=err, tol=tol, pool_bytes_differing=differ, nsplit=ns, ok=err <= tol and differ == 0)


def llvm_case(m: dict) -> dict:
    """Run case `m` with the portable llvm kernel on the CPU and compare it with the float64
    reference (validates the reference and the page-byte expectations used on the GPU)."""
    import tvm

    from ninfer_mlc.compile.kernels.registry import kernel_set

    geo, dt, kv = FUNCS[m["tag"]]
    f = kernel_set("llvm", kv).paged_attention(*geo, PAGE, LAYERS, dt, geo[2] ** -0.5)
    lib = tvm.compile(tvm.IRModule({"attn": f.with_attr("global_symbol", "attn")}), target=tvm.target.Target({"kind": "llvm"}))
    hq, hkv, d = m["geo"]
    pos, tseq, pt = case_tokens(m)
    q, k, v = case_qkv(m)
    pool0 = quant_pool(m) if m["quant"] else plain_pool_np(m)
    ref_pool = write_rows(pool0.copy(), m, pos, tseq, pt, expected_rows(m, k, v))
    ref = reference(m, np.asarray(q, np.float32), ref_pool, pos, tseq, pt)
    cpu = tvm.cpu()
    T = lambda x: tvm.runtime.tensor(np.ascontiguousarray(x), cpu)  # noqa: E731
    pool = T(pool0)
    out = T(np.full((len(pos), hq, d), np.nan, np.float32).astype(_np_dt(m["dtype"])))
    lib["attn"](T(q), T(k), T(v), T(pos), T(tseq), T(pt), pool, LAYER, out)
    err = rel_err(out.numpy().astype(np.float32), ref)
    differ = int((pool.numpy().view(np.uint8) != ref_pool.view(np.uint8)).sum())
    tol = tolerance(m)
    return dict(rel_err=err, tol=tol, pool_bytes_differing=differ, ok=err <= tol and differ == 0)


def cmd_emulate(a) -> int:
    sel = [m for m in all_cases() if (any(s in m["name"] for s in a.names) if a.names else m["name"].startswith(("emu_", "f32tiny")))]
    tags = sorted({m["tag"] for m in sel})
    t0 = time.time()
    lib = EmuLib(kernel_funcs(baseline=False, variants=False, tags=tags))
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
