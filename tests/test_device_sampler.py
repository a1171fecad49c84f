"""The device sampler (compile/kernels/sampling.py, runtime/device_sampler.py) against runtime/sampling.py.

The sampler functions are built alone for llvm at a small vocabulary (not a multiple of 32): greedy tokens,
seeded draws and logprobs must be numpy's; draw frequencies pass a chi-square test against
probs_after_processing; bitmasks are honoured. The CUDA kernels' generated source runs in the CPU emulator
against the llvm kernels, and the compiled model library exports the sampler.
"""
from __future__ import annotations

import math
import shutil

import numpy as np
import pytest

from ninfer_mlc.contract import sampler_abi as abi
from ninfer_mlc.runtime.device_sampler import AllTokensMaskedError, DeviceSampler, supports_device_sampler
from ninfer_mlc.runtime.sampling import RowState, Sampler, SamplingParams, probs_after_processing

V = 3000  # above the 1024 candidates the llvm select gathers: the vocabulary-wide passes run too
LANES = 8
QWEN_PRESET = dict(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=1.0)


@pytest.fixture(scope="module")
def lib():
    import tvm
    from tvm import relax

    from ninfer_mlc.compile.sampler_module import sampler_module

    ex = relax.build(sampler_module(V, "llvm"), target="llvm")
    return tvm, relax.VirtualMachine(ex, tvm.cpu())


def make_sampler(lib, mode="raw") -> DeviceSampler:
    tvm, vm = lib
    return DeviceSampler(tvm, vm, tvm.cpu(), V, LANES, logprobs_mode=mode)


def twin_rows(params: SamplingParams, n: int, rng, seeds=None, history: bool = True):
    """Two identical lists of RowStates (device, numpy): same params, seeds, prompt and generated tokens."""
    dev, ref = [], []
    for i in range(n):
        p = params.replace(seed=None if seeds is None else seeds[i])
        prompt = rng.integers(0, V, 30).tolist()
        gen = rng.integers(0, V, 12).tolist() if history else []
        for out in (dev, ref):
            r = RowState(p, prompt)
            r.extend(gen)
            out.append(r)
    return dev, ref


def bind_all(ds: DeviceSampler, rows) -> list[int]:
    for i, r in enumerate(rows):
        ds.bind(i, r)
    return list(range(len(rows)))


def tensor(lib, a):
    return lib[0].runtime.tensor(np.ascontiguousarray(a, np.float32), lib[0].cpu())


def random_params(rng, greedy: bool) -> SamplingParams:
    kw = dict(temperature=0.0 if greedy else float(rng.choice([0.6, 1.0, 1.4])))
    if rng.random() < 0.5:
        kw["repetition_penalty"] = float(rng.uniform(0.5, 2.0))
    if rng.random() < 0.5:
        kw["presence_penalty"] = float(rng.uniform(-2, 2))
        kw["frequency_penalty"] = float(rng.uniform(-2, 2))
    if rng.random() < 0.5:
        kw["logit_bias"] = {int(t): float(rng.uniform(-5, 5)) for t in rng.integers(0, V, 6)}
    return SamplingParams(**kw).validate(V)


# ---- greedy: identical tokens ---------------------------------------------------------------------------
def test_greedy_identical_to_numpy(lib):
    """Random rows (ties from rounded logits, -inf, NaN, +inf; bias; all three penalties), 3 steps each: the
    device's tokens are numpy's, and the device counts keep following the appended tokens."""
    rng = np.random.default_rng(0)
    ds, ref = make_sampler(lib), Sampler()
    for trial in range(40):
        B = 4
        dev_rows, ref_rows = [], []
        for _ in range(B):
            d, r = twin_rows(random_params(rng, greedy=True), 1, rng)
            dev_rows += d
            ref_rows += r
        lanes = bind_all(ds, dev_rows)
        for _step in range(3):
            logits = (rng.normal(size=(B, V)) * 3).astype(np.float32)
            if trial % 2:
                logits = np.round(logits)  # many exact ties
            if trial % 5 == 0:
                logits[0, : V // 2] = -np.inf
                logits[1, 7] = np.nan
                logits[2, 11] = np.inf
            want = ref.sample(logits, ref_rows)
            got = ds.sample(tensor(lib, logits), dev_rows, lanes)
            np.testing.assert_array_equal(got, want)


# ---- sampled rows: the same draws as numpy --------------------------------------------------------------
PARAM_SETS = {
    "qwen_preset": QWEN_PRESET,
    "top_p": dict(top_p=0.9),
    "top_p_flat": dict(top_p=0.9),  # nearly flat logits: the nucleus is wider than the select's probe
    "min_p": dict(min_p=0.05, temperature=0.8),
    "top_k": dict(top_k=7),
    "top_k_ties": dict(top_k=7),  # logits in 3 values: thousands of keys tie at the k-th (all kept, as HF)
    "plain": dict(),
    "all": dict(top_k=300, top_p=0.6, min_p=0.02, temperature=1.3, repetition_penalty=1.2, frequency_penalty=0.4,
                logit_bias={3: 4.0}),
}


@pytest.mark.parametrize("name", PARAM_SETS)
def test_seeded_draws_identical_to_numpy(lib, name):
    """The same RowStates (seeds, histories) draw the same tokens as Sampler for 10 steps of 8 rows: the row's
    uniform is drawn on the host exactly as Sampler draws it and the inverse CDF walks ids in ascending order."""
    rng = np.random.default_rng(1)
    ds, ref = make_sampler(lib), Sampler()
    params = SamplingParams(**PARAM_SETS[name]).validate(V)
    dev_rows, ref_rows = twin_rows(params, 8, rng, seeds=list(range(100, 108)))
    lanes = bind_all(ds, dev_rows)
    for _ in range(10):
        logits = (rng.normal(size=(8, V)) * (0.05 if name.endswith("flat") else 2.5)).astype(np.float32)
        if name.endswith("ties"):
            logits = np.clip(np.round(logits / 4), -1, 1)
        np.testing.assert_array_equal(ds.sample(tensor(lib, logits), dev_rows, lanes), ref.sample(logits, ref_rows))


def test_seeded_rows_reproducible_and_batch_independent(lib):
    """A seeded row gives the same tokens alone and at position 3 of a batch of 6 (other rows unseeded)."""
    rng = np.random.default_rng(2)
    ds = make_sampler(lib)
    params = SamplingParams(**QWEN_PRESET, seed=1234).validate(V)
    steps = [(rng.normal(size=(6, V)) * 2).astype(np.float32) for _ in range(8)]
    prompt = rng.integers(0, V, 20).tolist()
    alone = RowState(params, prompt)
    ds.bind(0, alone)
    toks_alone = [int(ds.sample(tensor(lib, s[3:4]), [alone], [0])[0]) for s in steps]
    batch = [RowState(SamplingParams(**QWEN_PRESET).validate(V), rng.integers(0, V, 20).tolist()) for _ in range(6)]
    batch[3] = RowState(params, prompt)
    lanes = [5, 1, 2, 0, 7, 4]  # another lane too
    for r, lane in zip(batch, lanes):
        ds.bind(lane, r)
    toks_batch = [int(ds.sample(tensor(lib, s), batch, lanes)[3]) for s in steps]
    assert toks_alone == toks_batch


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper 1e-4 quantile of chi-square(df) (Wilson-Hilferty)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


@pytest.mark.parametrize("name", ["qwen_preset", "top_p", "min_p", "top_k"])
def test_draw_frequencies_chi_square(lib, name):
    """4000 draws of one processed row (history fixed: update_state=False) against probs_after_processing."""
    rng = np.random.default_rng(3)
    ds = make_sampler(lib)
    params = SamplingParams(**PARAM_SETS[name]).validate(V)
    logits = (rng.normal(size=V) * 1.5).astype(np.float32)
    prompt, gen = rng.integers(0, V, 30).tolist(), np.argsort(-logits)[:6].tolist()  # penalise likely tokens
    rows = []
    for i in range(LANES):
        r = RowState(params.replace(seed=9000 + i), prompt)
        r.extend(gen)
        rows.append(r)
    lanes = bind_all(ds, rows)
    batch = tensor(lib, np.tile(logits, (LANES, 1)))
    counts = np.zeros(V)
    for _ in range(4000 // LANES):
        np.add.at(counts, ds.sample(batch, rows, lanes, update_state=False), 1)
    probs = probs_after_processing(logits, params, rows[0])
    assert counts[probs == 0].sum() == 0, "drew a token the processed distribution excludes"
    exp = probs * counts.sum()
    big = exp >= 5
    obs_b, exp_b = np.append(counts[big], counts[~big].sum()), np.append(exp[big], exp[~big].sum())
    keep = exp_b > 0
    stat = float(((obs_b[keep] - exp_b[keep]) ** 2 / exp_b[keep]).sum())
    df = int(keep.sum()) - 1
    assert df >= 3 and stat < _chi2_critical(df), (stat, df)


# ---- bitmask --------------------------------------------------------------------------------------------
def _mask_bits(mask: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    return (mask.view(np.uint32)[np.arange(len(tokens)), tokens // 32] >> (tokens % 32).astype(np.uint32)) & 1


def test_bitmask_honoured(lib):
    """Sampled rows never draw a masked token; greedy rows take the argmax of the allowed tokens (numpy on
    the logits with masked tokens at -inf)."""
    rng = np.random.default_rng(4)
    ds, ref = make_sampler(lib), Sampler()
    W = abi.mask_words(V)
    for greedy in (False, True):
        params = SamplingParams(**(dict(temperature=0.0) if greedy else QWEN_PRESET)).validate(V)
        dev_rows, ref_rows = twin_rows(params, 8, rng, seeds=list(range(8)))
        lanes = bind_all(ds, dev_rows)
        for _ in range(15):
            words = rng.integers(0, 1 << 32, size=(8, W), dtype=np.uint64) & rng.integers(0, 1 << 32, size=(8, W),
                                                                                          dtype=np.uint64)
            mask = words.astype(np.uint32).view(np.int32)
            logits = (rng.normal(size=(8, V)) * 2).astype(np.float32)
            toks = ds.sample(tensor(lib, logits), dev_rows, lanes, bitmask=mask)
            assert (_mask_bits(mask, toks) == 1).all()
            if greedy:
                allowed = (mask.view(np.uint32)[:, np.arange(V) // 32] >> (np.arange(V) % 32).astype(np.uint32)) & 1
                np.testing.assert_array_equal(toks, ref.sample(np.where(allowed == 1, logits, -np.inf), ref_rows))


def test_bitmask_errors(lib):
    ds = make_sampler(lib)
    rows = [RowState(SamplingParams(temperature=0.0)) for _ in range(3)]
    lanes = bind_all(ds, rows)
    logits = tensor(lib, np.zeros((3, V)))
    mask = np.full((3, abi.mask_words(V)), -1, np.int32)
    mask[1] = 0
    with pytest.raises(AllTokensMaskedError) as e:
        ds.sample(logits, rows, lanes, bitmask=mask)
    assert e.value.row == 1 and e.value.param == "bitmask"
    mask[1, -1] = np.int32(-1) << (V % 32)  # only bits past the vocabulary
    with pytest.raises(AllTokensMaskedError):
        ds.sample(logits, rows, lanes, bitmask=mask)
    with pytest.raises(ValueError, match="bitmask must be int32"):
        ds.sample(logits, rows, lanes, bitmask=mask[:, :-1])
    assert all(r.num_generated == 0 for r in rows)  # nothing sampled, no state touched


# ---- logprobs -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_logprobs_match_numpy(lib, mode):
    """Chosen token logprob, rank and the top-N (ties -> lower id) of Sampler, within 1e-5."""
    rng = np.random.default_rng(5)
    ds, ref = make_sampler(lib, mode), Sampler(mode)
    for trial in range(12):
        dev_rows, ref_rows = [], []
        for i in range(4):
            p = random_params(rng, greedy=bool(i % 2)).replace(logprobs=bool(i != 3),
                                                                top_logprobs=int(rng.integers(0, 21)))
            d, r = twin_rows(p, 1, rng, seeds=[trial * 10 + i])
            dev_rows += d
            ref_rows += r
        lanes = bind_all(ds, dev_rows)
        logits = (rng.normal(size=(4, V)) * 3).astype(np.float32)
        if trial % 2:
            logits = np.round(logits)
        if trial % 3 == 0:
            logits[0, :1800] = -np.inf
            logits[1, 5] = np.nan
        t_ref, l_ref = ref.sample(logits, ref_rows, return_logprobs=True)
        t_dev, l_dev = ds.sample(tensor(lib, logits), dev_rows, lanes, return_logprobs=True)
        np.testing.assert_array_equal(t_dev, t_ref)
        for a, b in zip(l_ref, l_dev):
            if a is None:
                assert b is None
                continue
            assert (b.token_id, b.rank) == (a.token_id, a.rank)
            np.testing.assert_array_equal(b.top_ids, a.top_ids)
            assert abs(b.logprob - a.logprob) <= 1e-5
            np.testing.assert_allclose(b.top_logprobs, a.top_logprobs, rtol=0, atol=1e-5)


# ---- penalty state --------------------------------------------------------------------------------------
def test_counts_follow_tokens(lib):
    """bind uploads the history, sample(update_state) appends on the device, add_tokens / remove_tokens edit
    the counts (speculative decoding's accept / reject): the lane's counts stay the RowState's."""
    rng = np.random.default_rng(6)
    ds = make_sampler(lib)
    row = RowState(SamplingParams(**QWEN_PRESET, frequency_penalty=0.5, seed=3).validate(V), [1, 2, 3])
    row.extend([5, 5, 9])
    ds.bind(2, row)

    def check():
        np.testing.assert_array_equal(ds.counts.numpy()[2], np.bincount(row.output_token_ids, minlength=V))

    check()
    for _ in range(4):
        ds.sample(tensor(lib, rng.normal(size=(1, V))), [row], [2])
    check()
    row.extend([11, 11])
    ds.add_tokens(2, [11, 11])
    check()
    gone = row.output_token_ids[-3:]
    row.rollback(3)
    ds.remove_tokens(2, gone)
    check()


def test_api_errors(lib):
    ds = make_sampler(lib)
    rows = [RowState(SamplingParams(presence_penalty=1.0)) for _ in range(2)]
    logits = tensor(lib, np.zeros((2, V)))
    with pytest.raises(ValueError, match="not bound"):
        ds.sample(logits, rows, [0, 1])
    ds.bind(0, rows[0])
    ds.bind(1, rows[1])
    with pytest.raises(ValueError, match="lane 9 is out of range"):
        ds.bind(9, rows[0])
    with pytest.raises(ValueError, match="2 row states and 1 lanes"):
        ds.sample(logits, rows, [0])
    with pytest.raises(ValueError, match=r"logits must be float32 \[n, 3000\]"):
        ds.sample(tensor(lib, np.zeros((2, V - 1))), rows, [0, 1])
    with pytest.raises(ValueError, match="appears twice"):
        ds.sample(logits, [rows[0], rows[0]], [0, 0])
    ds.release(0)
    assert ds.bound(0) is None


# ---- CUDA kernels (CPU emulator) and the compiled model library --------------------------------------------
@pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")
def test_cuda_kernels_on_cpu_emulator():
    """The generated CUDA of process / select / logprobs / append (1024-thread blocks) run in the CPU emulator
    (compile/kernels/cuda/emulate) matches the llvm sampler on rows covering every path (greedy, top_k gathered
    and not, top_p over the vocabulary, min_p, penalties, masks incl. an all-masked row, -inf / NaN / +inf rows)."""
    from ninfer_mlc.compile.kernels.cuda.emulate.sampler import run_emulation

    rows = run_emulation(threads=1024, vocabs=(1500,), seeds=(0,), log=lambda *_: None)
    bad = [r for r in rows if not r["ok"]]
    assert rows and not bad, bad


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_cuda_kernels_compile_without_spills(tmp_path):
    """At Qwen3.5's vocabulary (248,320) every sampler kernel compiles for sm_90 without register spills (the
    1024-thread select block has 64 registers a thread)."""
    import re
    import subprocess

    from ninfer_mlc.compile.kernels.cuda.emulate import cuda_source
    from ninfer_mlc.compile.kernels.cuda.sampling import sampler_kernels

    k = sampler_kernels(248320)
    names = ("process", "select", "logprobs", "append", "counts_add")
    src, _ = cuda_source({f"s_{n}": getattr(k, n).with_attr("global_symbol", f"s_{n}") for n in names})
    (tmp_path / "s.cu").write_text(src)
    r = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "--use_fast_math", "-Xptxas", "-v", str(tmp_path / "s.cu"),
                        "-o", str(tmp_path / "s.cubin")], capture_output=True, text=True, check=True)
    spills = re.findall(r"(\d+) bytes spill stores", r.stderr)
    assert len(spills) == len(names) and set(spills) == {"0"}, r.stderr


def test_model_library_samples_on_device(lib, tmp_path):
    """A compiled model's library carries the sampler (manifest extras + functions): sampling its prefill logits
    on the device gives numpy's tokens. (Same geometry as tests/test_parity_hf.py: the library is cached.)"""
    torch = pytest.importorskip("torch")  # noqa: F841
    from hf_tiny import make_hf_model, save_hf

    from ninfer_mlc.compile.build import compile_model
    from ninfer_mlc.runtime.harness import Harness

    hf_dir = save_hf(make_hf_model("qwen3_5", seed=11), tmp_path / "hf")
    art = compile_model(hf_dir, target="llvm", quant="f32", out_dir=tmp_path / "art", name="parity-qwen3_5",
                        log=lambda *_: None)
    runner = Harness(art, kv_capacity_tokens=256, num_slots=2)
    assert runner.manifest.extras["device_sampler"] == abi.ABI_VERSION
    assert supports_device_sampler(runner.manifest, runner.vm)
    ds = DeviceSampler(runner.tvm, runner.vm, runner.dev, runner.vocab_size, 2)
    rng = np.random.default_rng(7)
    seqs = [runner.new_seq() for _ in range(2)]
    prompts = [rng.integers(0, runner.vocab_size, 9).tolist() for _ in range(2)]
    logits = np.stack(runner.prefill(list(zip(seqs, prompts))))
    params = SamplingParams(**QWEN_PRESET).validate(runner.vocab_size)
    dev_rows = [RowState(params.replace(seed=i), p) for i, p in enumerate(prompts)]
    ref_rows = [RowState(params.replace(seed=i), p) for i, p in enumerate(prompts)]
    lanes = bind_all(ds, dev_rows)
    got = ds.sample(runner.tvm.runtime.tensor(logits, runner.dev), dev_rows, lanes)
    np.testing.assert_array_equal(got, Sampler().sample(logits, ref_rows))
