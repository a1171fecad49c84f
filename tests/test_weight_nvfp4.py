"""NVFP4 weights: quantizer round trip, ModelOpt pass-through, and the compiled model vs transformers
running the same dequantized weights (so only kernel arithmetic can differ)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hf_tiny import make_hf_model, save_hf  # noqa: E402

from ninfer_mlc.compile import nvfp4  # noqa: E402
from ninfer_mlc.compile.build import compile_model  # noqa: E402
from ninfer_mlc.compile.weight_quant import dequantize_weight, from_modelopt, quantize_weight  # noqa: E402
from ninfer_mlc.contract import safetensors_io  # noqa: E402
from ninfer_mlc.runtime.harness import Harness  # noqa: E402

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj",
             "gate_proj", "up_proj", "down_proj")


def test_quantize_weight_matches_block_reference():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((48, 64)) * rng.uniform(0.01, 3, (48, 1))).astype(np.float32)
    q = quantize_weight(w)
    assert q["weight"].shape == (48, 32) and q["weight_scale"].shape == (48, 4) and q["weight_scale_2"].shape == (1,)
    gs = 1.0 / q["weight_scale_2"][0]
    codes, scales = nvfp4.quantize_nvfp4(w, global_scale=gs)
    np.testing.assert_array_equal(q["weight"], codes)
    np.testing.assert_array_equal(q["weight_scale"], scales)
    deq = dequantize_weight(q)
    # per-element error bounded by half a grid step of the block (<= 1/6 of the block max after rounding)
    blocks = np.abs(w).reshape(48, 4, 16).max(-1, keepdims=True)
    err = np.abs(deq - w).reshape(48, 4, 16)
    assert np.all(err <= blocks / 6 * 1.1 + 1e-6)


def test_modelopt_tensors_are_taken_as_is():
    rng = np.random.default_rng(1)
    q = quantize_weight(rng.standard_normal((32, 32)).astype(np.float32))
    import ml_dtypes

    tensors = {"l.weight": q["weight"], "l.weight_scale": q["weight_scale"].view(ml_dtypes.float8_e4m3fn),
               "l.weight_scale_2": q["weight_scale_2"][0]}
    got = from_modelopt(tensors, "l")
    for k in q:
        np.testing.assert_array_equal(got[k], q[k])
    assert from_modelopt({"l.weight": np.zeros((2, 16), np.float32)}, "l") is None


@pytest.mark.parametrize("modelopt", [False, True], ids=["from-f32", "modelopt-checkpoint"])
def test_nvfp4_model_matches_hf_with_dequantized_weights(tmp_path, modelopt):
    model = make_hf_model("qwen3_5", seed=31)
    state = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    deq_state, disk = {}, {}
    for n, w in state.items():
        if n.endswith(".weight") and n.split(".")[-2] in QUANTIZED:
            q = quantize_weight(w)
            deq_state[n] = dequantize_weight(q)
            if modelopt:
                import ml_dtypes

                base = n[: -len(".weight")]
                disk[base + ".weight"] = q["weight"]
                disk[base + ".weight_scale"] = q["weight_scale"].view(ml_dtypes.float8_e4m3fn)
                disk[base + ".weight_scale_2"] = q["weight_scale_2"]
                continue
        disk[n] = w
    hf_dir = save_hf(model, tmp_path / "hf")
    if modelopt:  # replace the float weights with a ModelOpt-style NVFP4 checkpoint
        for f in hf_dir.glob("*.safetensors"):
            f.unlink()
        safetensors_io.save(hf_dir / "model.safetensors", disk)
    art = compile_model(hf_dir, target="llvm", quant="nvfp4", out_dir=tmp_path / "art", log=lambda *_: None)
    with torch.no_grad():  # the HF reference runs the dequantized weights
        for n, p in model.named_parameters():
            if n in deq_state:
                p.copy_(torch.from_numpy(deq_state[n]))
    ids = torch.randint(0, model.config.vocab_size, (1, 90), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits[0].numpy()
    runner = Harness(art, kv_capacity_tokens=512, num_slots=2)
    manifest_params = {n: dt for n, _, dt in runner.manifest.params}
    assert manifest_params["model.layers.0.mlp.gate_up_proj.weight"] == "uint8"
    seq = runner.new_seq()
    (got,) = runner.prefill([(seq, ids[0, :80].tolist())], all_logits=True)
    steps = [runner.decode([seq], [int(t)])[0] for t in ids[0, 80:90]]
    scale = np.abs(ref).max()
    assert np.abs(got - ref[:80]).max() / scale < 1e-3
    assert np.abs(np.stack(steps) - ref[80:90]).max() / scale < 1e-3
    # and the NVFP4 library really stores 4.5 bits per quantized weight
    assert runner.weights_bytes < sum(a.nbytes for a in state.values())


# ---- the CUDA decode GEMV's in-register dequantization (compile/kernels/cuda/gemv.py) ----------------
@pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="needs g++")
def test_gemv_nvfp4_register_dequant_is_exact(tmp_path):
    """ninfer_nvfp4_dq32 (the C text the CUDA kernel inlines; only its bf16x2 multiply is emulated here,
    as the CPU emulator of ninfer_mlc.compile.kernels.cuda.emulate does) turns every code in every nibble
    position and every E4M3 scale byte (zero and subnormals included) into exactly
    bf16(e2m1 * e4m3 * 2^-NVFP4_SHIFT)."""
    import ctypes

    import ml_dtypes

    from ninfer_mlc.compile.kernels.cuda import gemv as G
    from ninfer_mlc.compile.kernels.cuda.emulate import prelude
    from ninfer_mlc.compile.kernels.cuda.emulate.lib import compile_shared

    src = prelude.source() + r"""
extern "C" void dq(const unsigned* w, const unsigned* sc, unsigned* out, int calls) {
  for (int c = 0; c < calls; ++c)
    ninfer_nvfp4_dq32(out + 16 * c, w[4 * c], w[4 * c + 1], w[4 * c + 2], w[4 * c + 3], sc[c]);
}
"""
    lib = compile_shared(src, tmp_path, "dq")
    rng = np.random.default_rng(0)
    pairs = np.arange(256, dtype=np.uint32)  # (nibble i, nibble i+4) = (p & 15, p >> 4) in every position i
    words = np.concatenate([(pairs & 15) * 0x1111 | (pairs >> 4) * 0x11110000,
                            rng.integers(0, 2 ** 32, 256, dtype=np.uint64).astype(np.uint32)])
    b = np.arange(127, dtype=np.uint32)  # every E4M3 byte but NaN (0x7F); scales are never negative
    calls = []
    for sb in (b, b[::-1]):
        for k in range(0, len(words), 4):
            calls.append((words[k:k + 4], sb))
    w = np.concatenate([np.tile(ws, (len(sb), 1)) for ws, sb in calls]).astype(np.uint32)  # [calls, 4]
    sc = np.concatenate([sb | (sb[::-1] << 8) for _, sb in calls]).astype(np.uint32)
    out = np.zeros((len(sc), 16), np.uint32)
    lib.dq(w.ctypes.data_as(ctypes.c_void_p), sc.ctypes.data_as(ctypes.c_void_p),
           out.ctypes.data_as(ctypes.c_void_p), len(sc))
    codes = (w[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15  # [calls, word m, element t]
    vals = nvfp4.decode_e2m1(codes) * np.where(np.arange(4) < 2, nvfp4.decode_e4m3(sc & 0xFF)[:, None],
                                               nvfp4.decode_e4m3(sc >> 8)[:, None])[:, :, None]
    want = (vals * np.float32(2.0 ** -G.NVFP4_SHIFT)).astype(ml_dtypes.bfloat16).view(np.uint16)
    lo = want[:, :, 0:4].reshape(-1, 16).astype(np.uint32)  # d[4m+i] = (element 8m+i, element 8m+i+4)
    hi = want[:, :, 4:8].reshape(-1, 16).astype(np.uint32)
    np.testing.assert_array_equal(out, lo | (hi << 16))
