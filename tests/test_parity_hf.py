"""Compiled llvm model vs HF transformers (CPU, fp32): prefill, decode, batching, chunking.

Dense Qwen3.5 and Qwen3-Next (tied embeddings), and the MoE hybrids: Qwen3.5-MoE read from a fused-expert
VLM-style checkpoint (hf_tiny.save_fused_vlm) and Qwen3-Next MoE from save_pretrained's per-expert layout,
both with a duplicated expert (routing ties); tests/test_parity_moe.py checks the MoE specifics."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hf_tiny import make_hf_model, save_fused_vlm, save_hf  # noqa: E402

from ninfer_mlc.compile.build import compile_model  # noqa: E402
from ninfer_mlc.runtime.harness import Harness  # noqa: E402

PROMPT_LEN = 150  # > 2 GDN chunks of 64
DECODE_STEPS = 18
REL_TOL = 1e-3


def rel_err(got, ref) -> float:
    return float(np.abs(np.asarray(got) - np.asarray(ref)).max() / np.abs(ref).max())


SEEDS = {"qwen3_5": 11, "qwen3_next": 23, "qwen3_5_moe": 31, "qwen3_next_moe": 37}


@pytest.fixture(scope="module", params=[("qwen3_5", False), ("qwen3_next", True), ("qwen3_5_moe", False),
                                        ("qwen3_next_moe", False)],
                ids=["qwen3_5", "qwen3_next-tied", "qwen3_5_moe-fused-vlm", "qwen3_next_moe"])
def case(request, tmp_path_factory):
    family, tie = request.param
    model = make_hf_model(family, seed=SEEDS[family], tie=tie)
    save = save_fused_vlm if family == "qwen3_5_moe" else save_hf
    hf_dir = save(model, tmp_path_factory.mktemp(f"hf_{family}"))
    art = compile_model(hf_dir, target="llvm", quant="f32", out_dir=tmp_path_factory.mktemp(f"art_{family}"),
                        name=f"parity-{family}", log=lambda *_: None)
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT_LEN + DECODE_STEPS), generator=gen)
    with torch.no_grad():
        ref = model(ids).logits[0].numpy()
    runner = Harness(art, kv_capacity_tokens=2048, num_slots=6)
    return runner, ids[0].numpy().tolist(), ref, model


def test_prefill_logits_match_hf(case):
    runner, ids, ref, _ = case
    seq = runner.new_seq()
    (logits,) = runner.prefill([(seq, ids[:PROMPT_LEN])], all_logits=True)
    runner.free_seq(seq)
    assert logits.shape == (PROMPT_LEN, ref.shape[1])
    assert rel_err(logits, ref[:PROMPT_LEN]) < REL_TOL


def test_incremental_decode_matches_hf(case):
    runner, ids, ref, _ = case
    seq = runner.new_seq()
    last = runner.prefill([(seq, ids[:PROMPT_LEN])])[0]
    assert rel_err(last, ref[PROMPT_LEN - 1]) < REL_TOL
    for t in range(PROMPT_LEN, PROMPT_LEN + DECODE_STEPS):
        lg = runner.decode([seq], [ids[t]])[0]
        assert rel_err(lg, ref[t]) < REL_TOL, f"decode step at position {t}"
    runner.free_seq(seq)


def test_chunked_prefill_equals_one_shot(case):
    runner, ids, ref, _ = case
    seq = runner.new_seq()
    runner.prefill([(seq, ids[:37])])
    runner.prefill([(seq, ids[37:101])])
    (tail,) = runner.prefill([(seq, ids[101:PROMPT_LEN])], all_logits=True)
    runner.free_seq(seq)
    assert rel_err(tail, ref[101:PROMPT_LEN]) < REL_TOL


def test_batched_decode_equals_single(case):
    """Three sequences of different lengths decoded together equal each decoded alone."""
    runner, ids, _, _ = case
    lens = [150, 70, 9]
    starts = [0, 3, 40]
    prompts = [ids[s:s + n] for s, n in zip(starts, lens)]
    steps = 16
    rng = np.random.default_rng(3)
    feeds = rng.integers(0, runner.vocab_size, size=(3, steps)).tolist()

    alone = []
    for p, f in zip(prompts, feeds):
        seq = runner.new_seq()
        out = [runner.prefill([(seq, p)])[0]]
        for t in f:
            out.append(runner.decode([seq], [t])[0])
        runner.free_seq(seq)
        alone.append(np.stack(out))

    seqs = [runner.new_seq() for _ in prompts]
    first = runner.prefill(list(zip(seqs, prompts)))  # one ragged prefill of all three
    together = [[lg] for lg in first]
    for k in range(steps):
        lg = runner.decode(seqs, [f[k] for f in feeds])
        for i in range(3):
            together[i].append(lg[i])
    for s in seqs:
        runner.free_seq(s)
    for i in range(3):
        np.testing.assert_allclose(np.stack(together[i]), alone[i], rtol=0, atol=1e-4 * np.abs(alone[i]).max())


def test_state_save_restore_continues_exactly(case):
    """A sequence parked (state + pages copied out) and restored elsewhere continues identically."""
    runner, ids, ref, _ = case
    seq = runner.new_seq()
    runner.prefill([(seq, ids[:100])])
    conv, ssm = runner.read_state(seq.slot)
    pages = runner.read_pages(seq.pages)
    length = seq.length
    runner.free_seq(seq)
    other = runner.new_seq()
    runner.prefill([(other, ids[5:60])])  # dirty the pool in between
    seq2 = runner.new_seq()
    runner.write_state(seq2.slot, conv, ssm)
    seq2.pages = runner.kv.pages.alloc(len(pages))
    runner.write_pages(seq2.pages, pages)
    seq2.length = length
    lg = runner.decode([seq2], [ids[100]])[0]
    runner.free_seq(seq2)
    runner.free_seq(other)
    assert rel_err(lg, ref[100]) < REL_TOL


def test_out_of_range_token_is_rejected(case):
    runner = case[0]
    seq = runner.new_seq()
    with pytest.raises(ValueError, match="out of range"):
        runner.prefill([(seq, [1, runner.vocab_size])])
    runner.free_seq(seq)
