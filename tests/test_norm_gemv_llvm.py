"""The portable norm fold (compile/kernels/norm_gemv.py): the CUDA fold's roundings on the CPU, and the model wiring
of the fold (which norm weight, eps, residual and epilogue each folded GEMV takes) checked numerically."""
import numpy as np
import pytest

from ninfer_mlc.compile.kernels.cuda.emulate.gemv import norm_reference, np_dtype
from ninfer_mlc.compile.kernels.cuda.emulate.numerics import rel_err


@pytest.mark.parametrize("k,o,epilogue,dtype,out_dtype", [
    (64, 40, "none", "bfloat16", "bfloat16"), (96, 48, "silu_mul", "bfloat16", "bfloat16"),
    (64, 33, "none", "bfloat16", "float32"), (80, 24, "residual", "bfloat16", "bfloat16"),
    (64, 36, "none", "float32", "float32")])
def test_norm_gemv_matches_the_fused_roundings(k, o, epilogue, dtype, out_dtype):
    """Rows of very different sizes (the norm is per row), n = 1 / 3 / 17; bf16: equal to the CUDA fold's reference
    (bf16(x * g) into the products, sums / rms) within fp32 summation order (one output rounding)."""
    import tvm

    from ninfer_mlc.compile.kernels.norm_gemv import norm_gemv

    lib = tvm.compile(norm_gemv(k, o, dtype, out_dtype, epilogue, norm_eps=1e-6), target="llvm")
    oo = o // 2 if epilogue == "silu_mul" else o
    for n in (1, 3, 17):
        rng = np.random.default_rng(k + o + n)
        x = (rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-2, 2, (n, 1))).astype(np_dtype(dtype))
        g = rng.uniform(0.5, 1.5, k).astype(np.float32)
        w = (rng.standard_normal((o, k)) * k ** -0.5).astype(np_dtype(dtype))
        r = rng.standard_normal((n, oo)).astype(np_dtype(dtype))
        args = [tvm.runtime.tensor(a) for a in (x, g, w)] + ([tvm.runtime.tensor(r)] if epilogue == "residual" else [])
        out = tvm.runtime.tensor(np.full((n, oo), np.nan, np.float32).astype(np_dtype(out_dtype)))
        lib(*args, out)
        got = out.numpy().astype(np.float32)
        if dtype == "float32":  # nothing to round: rms_norm(x) @ w^T
            rms = np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-6)
            ref = (x / rms * g) @ w.astype(np.float64).T
        else:  # norm_reference: the bf16 roundings of the CUDA fold
            ref = norm_reference(x.astype(np.float32), g, w.astype(np.float32), r.astype(np.float32), epilogue,
                                 out_dtype, 1e-6, fused=True)
        tol = 1e-5 if out_dtype == "float32" else 2 ** -8
        assert rel_err(got, ref) <= tol, (n, rel_err(got, ref))


def test_norm_gemv_applies_where_the_cuda_fold_does():
    from ninfer_mlc.compile.kernels.norm_gemv import norm_gemv
    from ninfer_mlc.compile.kernels.registry import kernel_set, llvm_norm_gemv_scope

    assert norm_gemv(2048, 64, "bfloat16", "bfloat16", "none", norm_eps=1e-6, min_k=4096) is None
    assert norm_gemv(64, 63, "bfloat16", "bfloat16", "silu_mul", norm_eps=1e-6) is None
    assert norm_gemv(64, 64, "bfloat16", "float32", "residual", norm_eps=1e-6) is None
    assert kernel_set("llvm").gemv_norm is None
    with llvm_norm_gemv_scope(0):
        assert kernel_set("llvm").gemv_norm(64, 64, "bfloat16", "bfloat16", "none", norm_eps=1e-6) is not None


def _decode_logits(hf_dir, out, quant, fold):
    from ninfer_mlc.compile.build import compile_model
    from ninfer_mlc.compile.kernels.registry import llvm_norm_gemv_scope
    from ninfer_mlc.runtime.harness import Harness

    with llvm_norm_gemv_scope(0 if fold else None):
        art = compile_model(hf_dir, target="llvm", quant=quant, out_dir=out, name="fold", log=lambda *_: None)
    r = Harness(art, kv_capacity_tokens=512, num_slots=3)
    rng = np.random.default_rng(4)
    seqs = [r.new_seq() for _ in range(2)]
    rows = [list(r.prefill([(s, rng.integers(0, r.vocab_size, n).tolist()) for s, n in zip(seqs, (40, 9))]))]
    for _ in range(6):
        rows.append(r.decode(seqs, rng.integers(0, r.vocab_size, 2).tolist()))
    return np.stack([np.stack(x) for x in rows])


@pytest.mark.parametrize("quant,tol", [("f32", 1e-5), ("bf16", 2e-2)])
def test_folded_decode_equals_the_unfolded_one(tmp_path, quant, tol):
    """The tiny model's decode (batch 2, rows of different lengths) with every foldable norm folded equals the
    unfolded decode: f32 to fp32 rounding (the wiring), bf16 within the changed rounding; prefill is untouched."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from hf_tiny import make_hf_model, save_hf

    hf_dir = save_hf(make_hf_model("qwen3_5", seed=11), tmp_path / "hf")
    a = _decode_logits(hf_dir, tmp_path / "off", quant, False)
    b = _decode_logits(hf_dir, tmp_path / "on", quant, True)
    np.testing.assert_array_equal(a[0], b[0])  # prefill does not fold
    err = rel_err(b[1:], a[1:])
    assert 0 < err <= tol, err  # > 0: the decode did run the folded kernels (another rounding, even in f32)
