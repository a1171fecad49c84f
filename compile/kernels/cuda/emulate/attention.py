"""Checks of the CUDA paged attention (compile/kernels/cuda/attention.py): cases, page codecs, seeded inputs
and the float64 reference; emulate_case runs a case's generated CUDA on the CPU emulator, llvm_case the
portable llvm kernel (it validates the reference and the page-byte expectations).

CASES serve bench/attn_gpu_check.py (timed and checked on the GPU) and the emulator (the small `emu_*` and
f32tiny cases, tests/test_cuda_build.py and tests/test_cuda_attn_prefill.py). Every array is regenerated
from the case's seed, so a case travels as a few numbers. Numpy only at module level.
"""
from __future__ import annotations

import numpy as np

from .numerics import rel_err

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


def _verify(b, ctx, r):
    return [(ctx - r, r)] * b


# verify attend (the short_rows kernel, function vf_<tag>; timed against the split attend new_<tag>): sequences of
# few consecutive rows. Emulated ones: R in 1..16, one or several sequences of different R and lengths (not page
# multiples, shorter than a split, a context of 5), 16 rows of G = 6 (two row tiles)
VERIFY_CASES = [
    *[(f"verify_bf16_b{b}_r{r}_8k", "bf16", _verify(b, 8192, r), True, False) for b in (1, 4) for r in (4, 8)],
    ("verify_bf16_b8_r8_8k", "bf16", _verify(8, 8192, 8), True, False),
    ("verify_bf16_b1_r4_32k", "bf16", _verify(1, 32768, 4), True, False),
    ("emu_vf_bf16_r1", "bf16", [(300, 1)], False, True),
    ("emu_vf_bf16_r3", "bf16", [(77, 3)], False, True),
    ("emu_vf_bf16_r4", "bf16", [(129, 4)], False, True),
    ("emu_vf_bf16_r8", "bf16", [(1000, 8)], False, True),
    ("emu_vf_bf16_r16", "bf16", [(130, 16)], False, True),
    ("emu_vf_bf16_b3", "bf16", [(200, 4), (5, 8), (64, 1)], False, True),
    ("emu_vf_bf16_b3_r16", "bf16", [(500, 16), (0, 3), (63, 1)], False, True),
    ("emu_vf_f16_b2", "f16", [(90, 8), (33, 4)], False, True),
    ("emu_vf_bf16small_b3", "bf16small", [(70, 16), (1, 3), (200, 8)], False, True),
]


def case_meta(name: str, tag: str, rows, timed: bool, seed: int, verify: bool = False) -> dict:
    """verify: the case runs the verify attend (func vf_<tag>) and compares the split attend (new_<tag>)."""
    geo, dt, kv = FUNCS[tag]
    need = [-(-(o + c) // PAGE) for o, c in rows]
    width = max(4, 1 << (max(need) - 1).bit_length())  # decode graphs use power-of-two page tables
    return dict(name=name, tag=tag, geo=list(geo), dtype=dt, kv=kv or dt, quant=kv in QUANT, rows=[list(r) for r in rows],
                need=need, width=width, npages=sum(need) + 2, timed=timed, seed=seed,
                func=f"vf_{tag}" if verify else f"new_{tag}", scale=geo[2] ** -0.5, verify=verify,
                **({"compare": f"new_{tag}"} if verify else {}))


def all_cases() -> list[dict]:
    return ([case_meta(n, t, r, tm, 1000 + i) for i, (n, t, r, tm, _) in enumerate(CASES)]
            + [case_meta(n, t, r, tm, 3000 + i, verify=True) for i, (n, t, r, tm, _) in enumerate(VERIFY_CASES)])


# ----------------------------------------------------------------------------------------------
# numpy codecs (no TVM): the page bytes the kernels must write
def _f():
    from .... import nvfp4 as F

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


def quantize_q_nvfp4(q) -> np.ndarray:
    """The fp4_qk kernels' Q as the tensor cores see it (float32, same shape): every row of the last axis (a
    (token, head) row) quantized to NVFP4 as compile/kernels/cuda/fp4_mma.py's activation quantizer (enc = fp32(2688
    / amax) capped at 1e38, 1 for a zero row; E4M3 block scales of the 16-blocks x enc, E2M1 codes), then
    dequantized and multiplied by fp32(1 / enc)."""
    F = _f()
    x = np.asarray(q, np.float32)
    amax = np.where(np.isnan(x), 0, np.abs(x)).max(-1, keepdims=True).astype(np.float32)
    with np.errstate(divide="ignore"):
        enc = np.where(amax > 0, np.minimum(np.float32(2688.0) / amax, np.float32(1.0e38)), np.float32(1.0))
    enc = enc.astype(np.float32)
    codes, scales = F.quantize_nvfp4(x, global_scale=enc)
    return F.dequantize_nvfp4(codes, scales, x.shape[-1]) * (np.float32(1.0) / enc)


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
    used = 0
    pos: list[int] = []
    tseq: list[int] = []
    for r, (old, cnt) in enumerate(rows):
        pt[r, :need[r]] = perm[used:used + need[r]]
        used += need[r]
        pos += range(old, old + cnt)
        tseq += [r] * cnt
    return np.asarray(pos, np.int32), np.asarray(tseq, np.int32), pt


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



def tolerance(m: dict) -> float:
    return 1e-4 if m["dtype"] == "float32" else 1e-2


def kernel_funcs(tags=None, verify: bool = False) -> dict:
    """{"new_<tag>": prim_func} of the kernel set's paged attention (registry defaults) for the FUNCS tags; verify:
    also {"vf_<tag>": its verify attention} where the kernel set has one."""
    from ...registry import kernel_set

    funcs = {}
    for tag, (geo, dt, kv) in FUNCS.items():
        if tags is None or tag in tags:
            ks = kernel_set("cuda", kv)
            f = ks.paged_attention(*geo, PAGE, LAYERS, dt, geo[2] ** -0.5)
            funcs[f"new_{tag}"] = f.with_attr("global_symbol", f"new_{tag}")
            fv = ks.verify_attention(*geo, PAGE, LAYERS, dt, geo[2] ** -0.5) if verify else None
            if fv is not None:
                funcs[f"vf_{tag}"] = fv.with_attr("global_symbol", f"vf_{tag}")
    return funcs


def fp4_kernel_funcs(tags=None) -> dict:
    """{"f4_<tag>": prim_func}: the sm_120 kernel set's paged attention (fp4_qk: Q K^T on the block-scaled FP4
    tensor cores) for the nvfp4 FUNCS tags (all of them build; the FP4 QK is in those where fp4_qk_applies)."""
    from ..registry import kernel_set

    funcs = {}
    for tag, (geo, dt, kv) in FUNCS.items():
        if kv == "nvfp4" and (tags is None or tag in tags):
            f = kernel_set(kv, arch="sm_120").paged_attention(*geo, PAGE, LAYERS, dt, geo[2] ** -0.5)
            funcs[f"f4_{tag}"] = f.with_attr("global_symbol", f"f4_{tag}")
    return funcs


def emulate_case(m: dict, lib=None, func: str | None = None, q_nvfp4: bool = False) -> dict:
    """Run case `m` through the CPU emulator (lib: an EmuLib holding m's kernel, else one is built);
    {rel_err, tol, pool_bytes_differing, nsplit, ok}. The kernel's split workspaces are the host's
    allocations, 0xff-filled: a read of a partial result no split wrote shows up as NaN. q_nvfp4 (an fp4_qk
    kernel): the reference takes Q as quantize_q_nvfp4 gives it; rel_err_q_exact is the error against the
    unquantized Q's reference."""
    from .. import attention as A
    from .lib import EmuLib

    if lib is None:
        lib = EmuLib(kernel_funcs(tags=[m["tag"]]))
    hq, hkv, d = m["geo"]
    pos, tseq, pt = case_tokens(m)
    q, k, v = case_qkv(m)
    n = len(pos)
    pool0 = quant_pool(m) if m["quant"] else plain_pool_np(m)
    ref_pool = write_rows(pool0.copy(), m, pos, tseq, pt, expected_rows(m, k, v))
    ref = reference(m, np.asarray(q, np.float32), ref_pool, pos, tseq, pt)
    ref_q = reference(m, quantize_q_nvfp4(q), ref_pool, pos, tseq, pt) if q_nvfp4 else ref
    from ..registry import kernel_params

    kp = kernel_params()["paged_attention"]
    if m.get("verify"):
        from ..attention_verify import verify_splits

        ns = verify_splits(pt.shape[0], pt.shape[1], hkv, PAGE, kp["target_blocks"])
    else:
        ns = A.attend_splits(n, pt.shape[1], hkv, PAGE, kp["threads"], kp["target_blocks"],
                             A.PF_MIN_ROWS if A.prefill_applies(hq, hkv, d, m["dtype"], m["kv"]) else None)
    pool = np.ascontiguousarray(pool0.copy())
    out = np.full((n, hq, d), np.nan, np.float32).astype(_np_dt(m["dtype"]))
    arrays = dict(q=np.ascontiguousarray(q), k=np.ascontiguousarray(k), v=np.ascontiguousarray(v), pos=pos, tseq=tseq,
                  pt=pt, pool=pool, out=out)
    lib(func or m["func"], arrays, dict(layer=LAYER))
    err = rel_err(out.astype(np.float32), ref_q)
    differ = int((pool.view(np.uint8) != ref_pool.view(np.uint8)).sum())
    tol = tolerance(m)
    r = dict(rel_err=err, tol=tol, pool_bytes_differing=differ, nsplit=ns, ok=err <= tol and differ == 0)
    if q_nvfp4:
        r["rel_err_q_exact"] = rel_err(out.astype(np.float32), ref)
    return r


def llvm_case(m: dict) -> dict:
    """Run case `m` with the portable llvm kernel on the CPU and compare it with the float64
    reference (validates the reference and the page-byte expectations used on the GPU)."""
    import tvm

    from ...registry import kernel_set

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

