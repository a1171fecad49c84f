"""Vision tower speed: a 1024x1024 image through the Qwen3.5/3.6 ViT on the GPU and on the host cores, and
the 27B prefill with that image vs the same number of text tokens.

  prep OUT [--arch sm_90] [--no-lm]      (where the compiler is; no GPU needed)
        OUT/vision-cuda.so   the ViT (depth 27, width 1152, 16 heads, patch 16, merge 2 -> 5120), bf16, cuda:ARCH
        OUT/vision-llvm.so   the same in fp32 for the host (`ninfer serve --vision-cpu`)
        OUT/q27b-mm.so       the 27B text decoder with prefill_mm / decode_mrope (skipped with --no-lm)
        OUT/vision.json      configs and parameter lists
  run OUT RESULT.json [--cpu-reps 1] [--cpu-side 1024] [--skip-cpu]   (GPU machine, runtime-only TVM; numpy,
                                                                        ml_dtypes, torch)
        vit_gpu_ms       median of 5 ViT calls on one 1024x1024 image (4096 patches, 1024 tokens), weights random
        vit_cpu_ms       the fp32 llvm library on the host (cpu_count recorded; runs last: its matmuls are
                         untuned llvm loops, so --cpu-side 512 may be needed inside a step timeout)
        prefill_text_ms  27B prefill of 1024 + 64 text tokens (`prefill`)
        prefill_image_ms the same rows with the 1024 image rows as embeddings (`prefill_mm`, M-RoPE positions)
        with_image_ms    vit_gpu_ms + prefill_image_ms: what an image costs a request end to end

Run: python3 bench/vision_gpu_bench.py prep .gpu/vision && (GPU) python3 bench/vision_gpu_bench.py run .gpu/vision
OUT/vision.json. Random weights: the times are the real kernels' (no data-dependent work in them).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_common as gc  # noqa: E402

IMAGE_SIDE = 1024
TEXT_TOKENS = 64
# Qwen3.5 / 3.6 27B vision_config (research/anchors_2.md §4)
VISION_27B = {"depth": 27, "hidden_size": 1152, "intermediate_size": 4304, "num_heads": 16, "in_channels": 3,
              "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 5120,
              "num_position_embeddings": 2304, "hidden_act": "gelu_pytorch_tanh",
              "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}


def cmd_prep(a):
    from ninfer_mlc.compile.targets import parse_target
    from ninfer_mlc.compile.vision_build import build_vision_library
    from ninfer_mlc.compile.vision_config import parse_vision_config

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    vcfg = parse_vision_config({"vision_config": VISION_27B})
    t0 = time.time()
    specs = build_vision_library(vcfg, "bfloat16", parse_target("cuda:" + a.arch), out / "vision-cuda.so")
    t1 = time.time()
    build_vision_library(vcfg, "float32", parse_target("llvm"), out / "vision-llvm.so")
    meta = {"vision": vcfg.to_dict(), "vision_params": specs, "arch": a.arch,
            "vision_build_seconds": {"cuda": t1 - t0, "llvm": time.time() - t1}}
    print(f"vision: cuda {t1 - t0:.0f}s, llvm {time.time() - t1:.0f}s", flush=True)
    if not a.no_lm:
        from gpu_bench import Q27B

        from ninfer_mlc.compile.build import build_library
        from ninfer_mlc.compile.config import parse_config

        cfg = parse_config({**Q27B, "rope_parameters": {**Q27B["rope_parameters"], "mrope_section": [11, 11, 10]}})
        t2 = time.time()
        meta["lm_params"] = build_library(cfg, "bfloat16", parse_target("cuda:" + a.arch), out / "q27b-mm.so",
                                          multimodal=True)
        meta["lm_config"] = cfg.to_dict()
        meta["lm_build_seconds"] = time.time() - t2
        print(f"27b multimodal decoder: {time.time() - t2:.0f}s", flush=True)
    (out / "vision.json").write_text(json.dumps(meta, indent=1))


def _vision_args(tvm, dev, vcfg: dict, side: int = IMAGE_SIDE):
    """One random side x side image (already normalised) as the library's inputs."""
    from ninfer_mlc.runtime.vision.image_processing import ProcessorSettings, patchify
    from ninfer_mlc.runtime.vision.inputs import vision_tables

    s = ProcessorSettings(vcfg["patch_size"], vcfg["temporal_patch_size"], vcfg["spatial_merge_size"],
                          vcfg["min_pixels"], vcfg["max_pixels"])
    x = np.random.default_rng(0).uniform(-1, 1, (3, side, side)).astype(np.float32)
    patches, grid = patchify(x, s)
    t = vision_tables([grid], s.merge_size, int(round(vcfg["num_position_embeddings"] ** 0.5)),
                      vcfg["hidden_size"] // vcfg["num_heads"], vcfg["rope_theta"])
    arrs = [patches] + [t[k] for k in ("interp_idx", "interp_w", "rope_cos", "rope_sin", "cu_seqlens", "seg")]
    return [tvm.runtime.tensor(np.ascontiguousarray(v), dev) for v in arrs], patches.shape[0]


def _vision_params(tvm, dev, specs, dtype: str):
    import ml_dtypes

    rng = np.random.default_rng(1)
    np_dt = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    out = []
    for name, shape, _ in specs:
        if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name.endswith("norm.weight"):
            a = np.ones(shape, np.float32)
        elif name.endswith("bias"):
            a = np.zeros(shape, np.float32)
        else:
            fan_in = shape[-1] if len(shape) == 2 and "pos_embed" not in name else 1
            a = (rng.standard_normal(shape, dtype=np.float32) * fan_in ** -0.5).astype(np.float32)
        out.append(tvm.runtime.tensor(np.ascontiguousarray(a.astype(np_dt)), dev))
    return out


def _time(fn, sync, reps: int, warm: int) -> float:
    for _ in range(warm):
        fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def cmd_run(a):
    from tvm.runtime.vm import VirtualMachine

    from ninfer_mlc.runtime.tvm_loader import import_tvm

    out = Path(a.out)
    meta = json.loads((out / "vision.json").read_text())
    vcfg = meta["vision"]
    tvm = import_tvm("cuda")
    dev = tvm.cuda(0)
    res = {"device": str(dev), "compute_version": dev.compute_version, "image": f"{IMAGE_SIDE}x{IMAGE_SIDE}",
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "vision_config": vcfg}
    vm = VirtualMachine(tvm.runtime.load_module(str(out / "vision-cuda.so")), dev)
    args, n_patches = _vision_args(tvm, dev, vcfg)
    params = _vision_params(tvm, dev, meta["vision_params"], "bfloat16")
    res["patches"], res["image_tokens"] = n_patches, n_patches // vcfg["spatial_merge_size"] ** 2
    emb = vm["encode"](*args, params)
    res["vit_finite"] = bool(np.isfinite(emb.numpy()).all())
    res["vit_gpu_ms"] = _time(lambda: vm["encode"](*args, params), dev.sync, 5, 2) * 1e3
    print(f"ViT {IMAGE_SIDE}^2 on {dev}: {res['vit_gpu_ms']:.1f} ms", flush=True)
    gc.write_result(a.result, res)

    if "lm_params" in meta:
        res.update(_prefill_with_image(tvm, dev, out, meta, emb, res["image_tokens"]))
        res["with_image_ms"] = res["vit_gpu_ms"] + res["prefill_image_ms"]
        gc.write_result(a.result, res)

    if not a.skip_cpu:  # last: the untuned llvm matmuls are slow, a timeout here keeps the GPU rows
        cpu = tvm.cpu(0)
        res["cpu_count"] = os.cpu_count()
        res["tvm_num_threads"] = os.environ.get("TVM_NUM_THREADS")
        res["cpu_image"] = f"{a.cpu_side}x{a.cpu_side}"
        cvm = VirtualMachine(tvm.runtime.load_module(str(out / "vision-llvm.so")), cpu)
        cargs, _ = _vision_args(tvm, cpu, vcfg, a.cpu_side)
        cparams = _vision_params(tvm, cpu, meta["vision_params"], "float32")
        res["vit_cpu_ms"] = _time(lambda: cvm["encode"](*cargs, cparams), lambda: None, a.cpu_reps, 0) * 1e3
        print(f"ViT {a.cpu_side}^2 on {os.cpu_count()} host cores: {res['vit_cpu_ms']:.0f} ms", flush=True)
        gc.write_result(a.result, res)
    print(json.dumps(res, indent=1))


def _prefill_with_image(tvm, dev, out: Path, meta: dict, emb, n_img: int) -> dict:
    """27B prefill of TEXT_TOKENS + n_img rows: all text (`prefill`) vs the image rows as embeddings (`prefill_mm`)."""
    import torch
    from gpu_bench import PAGE, _gen_params
    from tvm.runtime.vm import VirtualMachine

    from ninfer_mlc.runtime.vision.mrope import rope_positions

    cfg = meta["lm_config"]
    vm = VirtualMachine(tvm.runtime.load_module(str(out / "q27b-mm.so")), dev)
    tparams, keep, _ = _gen_params(torch, meta["lm_params"], cfg)
    params = [tvm.runtime.from_dlpack(t) for t in tparams]
    n = TEXT_TOKENS + n_img
    pages = -(-n // PAGE) + 1
    n_attn, n_gdn = cfg["layer_types"].count("full_attention"), cfg["layer_types"].count("linear_attention")
    conv_dim = 2 * cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"] + \
        cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    kv = torch.zeros((pages, n_attn, 2, cfg["num_key_value_heads"], PAGE, cfg["head_dim"]), device="cuda",
                     dtype=torch.bfloat16)
    conv = torch.zeros((1, n_gdn, conv_dim, cfg["linear_conv_kernel_dim"] - 1), device="cuda", dtype=torch.bfloat16)
    ssm = torch.zeros((1, n_gdn, cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                       cfg["linear_value_head_dim"]), device="cuda", dtype=torch.float32)
    pools = [tvm.runtime.from_dlpack(x) for x in (kv, conv, ssm)]

    def T(x, dt=np.int32):
        return tvm.runtime.tensor(np.ascontiguousarray(x, dt), dev)

    pad = 1000
    ids = np.random.default_rng(2).integers(0, 100000, n).astype(np.int32)
    ids[TEXT_TOKENS // 2:TEXT_TOKENS // 2 + n_img] = pad
    side = IMAGE_SIDE // (meta["vision"]["patch_size"])
    rope, _ = rope_positions(ids, pad, [(1, side, side)], 2)
    base = [T(ids), T(np.arange(n)), T(np.zeros(n)), T([0, n]), T(np.arange(pages)[None]), T([0])]
    row_src = np.arange(n, dtype=np.int32)
    row_src[TEXT_TOKENS // 2:TEXT_TOKENS // 2 + n_img] = n + np.arange(n_img)
    image_embeds = T(emb.numpy().astype(np.float32), np.float32)
    text = lambda: vm["prefill"](*base, T([n - 1]), *pools, params)  # noqa: E731
    mm = lambda: vm["prefill_mm"](base[0], base[1], T(rope), *base[2:], T([n - 1]), image_embeds, T(row_src),  # noqa: E731
                                  *pools, params)
    r = {"prefill_rows": n, "prefill_text_ms": _time(text, dev.sync, 5, 2) * 1e3,
         "prefill_image_ms": _time(mm, dev.sync, 5, 2) * 1e3}
    print(f"27B prefill of {n} rows: text {r['prefill_text_ms']:.1f} ms, with the image rows "
          f"{r['prefill_image_ms']:.1f} ms", flush=True)
    del keep
    return r


def main(argv=None):
    ap, _, p, r = gc.prep_run_parser(__doc__)
    p.add_argument("--no-lm", action="store_true", help="skip the 27B multimodal decoder build")
    r.add_argument("--cpu-reps", type=int, default=1)
    r.add_argument("--skip-cpu", action="store_true")
    r.add_argument("--cpu-side", type=int, default=IMAGE_SIDE, help="image side for the host-core run")
    a = ap.parse_args(argv)
    {"prep": cmd_prep, "run": cmd_run}[a.cmd](a)


if __name__ == "__main__":
    main()
