"""Images through the compiled llvm model vs transformers Qwen3_5ForConditionalGeneration (CPU, fp32).

A tiny random VLM (tests/hf_tiny_vlm.py, every weight redrawn): our preprocessing equals the HF
image processor's pixel values; vision embeddings, prefill logits and >= 8 decode steps (M-RoPE with
the rope delta) match within 1e-3 relative for a square image, a non-square one, two images in one
prompt and an image in an earlier turn (prefilled in chunks that split the image); text stays
bit-identical through the image functions.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hf_tiny_vlm import IMAGE_TOKEN, VISION_END, VISION_START, image_processor, make_hf_vlm, make_image, save_hf_vlm  # noqa: E402

from ninfer_mlc.compile.build import compile_model  # noqa: E402
from ninfer_mlc.runtime.vision.image_processing import prepare_image  # noqa: E402
from ninfer_mlc.runtime.vision.media import build_media  # noqa: E402
from ninfer_mlc.runtime.harness import Harness  # noqa: E402
from ninfer_mlc.runtime.vision.encoder import VisionEncoder  # noqa: E402

REL_TOL = 1e-3
DECODE_STEPS = 8


def rel_err(got, ref) -> float:
    return float(np.abs(np.asarray(got) - np.asarray(ref)).max() / np.abs(ref).max())


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    model = make_hf_vlm()
    hf_dir = save_hf_vlm(model, tmp_path_factory.mktemp("hf_vlm"))
    art = compile_model(hf_dir, target="llvm", quant="f32", out_dir=tmp_path_factory.mktemp("art_vlm"),
                        name="vlm-tiny", log=lambda *_: None)
    runner = Harness(art, kv_capacity_tokens=2048, num_slots=4)
    runner.runner.vision = VisionEncoder(art, runner.manifest, "cpu")  # the executor runs the image rows
    return model, runner


def _text(rng, n):
    return rng.integers(0, IMAGE_TOKEN, n).tolist()


def _prompt(rng, parts):
    """parts: ints (that many random text tokens) or PIL images (one placeholder each)."""
    ids, images = [], []
    for p in parts:
        if isinstance(p, int):
            ids += _text(rng, p)
        else:
            ids += [VISION_START, IMAGE_TOKEN, VISION_END]
            images.append(p)
    return ids, images


def _reference(model, ids, images):
    """HF logits over prompt + continuation in one forward (rope positions from get_rope_index)."""
    feats = image_processor()(images=images, return_tensors="pt")
    t = torch.tensor([ids])
    with torch.no_grad():
        out = model(input_ids=t, pixel_values=feats["pixel_values"], image_grid_thw=feats["image_grid_thw"],
                    mm_token_type_ids=(t == IMAGE_TOKEN).int())
    return out.logits[0].numpy(), feats


def _run_case(vlm, parts, seed, chunks=None):
    model, runner = vlm
    rng = np.random.default_rng(seed)
    ids, images = _prompt(rng, parts)
    prepared = [prepare_image(img, runner.vision.settings) for img in images]
    prompt, media = build_media(ids, prepared, IMAGE_TOKEN, runner.vision.merge)
    cont = _text(rng, DECODE_STEPS)
    ref, feats = _reference(model, prompt + cont, images)
    np.testing.assert_array_equal(np.concatenate([p.patches for p in prepared]), feats["pixel_values"].numpy())
    seq = runner.new_seq()
    seq.media = media
    try:
        got, at = [], 0
        for n in (chunks or [len(prompt)]):
            got.append(runner.prefill([(seq, prompt[at:at + n])], all_logits=True)[0])
            at += n
        assert at == len(prompt)
        assert rel_err(np.concatenate(got), ref[:len(prompt)]) < REL_TOL
        for k, tok in enumerate(cont):
            lg = runner.decode([seq], [tok])[0]
            assert rel_err(lg, ref[len(prompt) + k]) < REL_TOL, f"decode step {k}"
    finally:
        runner.free_seq(seq)
    return media


def test_vision_embeddings_match_hf(vlm):
    model, runner = vlm
    images = [make_image(40, 40, 1), make_image(57, 23, 2), make_image(200, 90, 3)]
    feats = image_processor()(images=images, return_tensors="pt")
    with torch.no_grad():
        ref = model.model.get_image_features(feats["pixel_values"], feats["image_grid_thw"]).pooler_output
    got = runner.vision.encode([prepare_image(img, runner.vision.settings) for img in images])
    for g, r in zip(got, ref):
        assert g.shape == tuple(r.shape)
        assert rel_err(g, r.numpy()) < REL_TOL


def test_square_image(vlm):
    media = _run_case(vlm, [5, make_image(40, 40, 11), 7], seed=1)
    assert media.delta < 0  # 25 image tokens advance the rope position by 5


def test_non_square_image(vlm):
    media = _run_case(vlm, [3, make_image(64, 24, 12), 6], seed=2)
    assert media.images[0].grid[1] != media.images[0].grid[2]


def test_two_images_in_one_prompt(vlm):
    _run_case(vlm, [4, make_image(40, 40, 13), 5, make_image(30, 70, 14), 3], seed=3)


def test_image_in_earlier_turn_chunked(vlm):
    """Turn 1 has the image, turn 2 is text; chunks split the image and the turns."""
    parts = [4, make_image(48, 40, 15), 20, 30]  # image, answer text, next user turn
    media = _run_case(vlm, parts, seed=4, chunks=[12, 40, 34])
    assert media.prompt_len == 86  # 4 + (1 + 30 + 1) + 20 + 30


def test_text_rows_bit_identical_through_image_functions(vlm):
    """prefill_mm / decode_mrope with text-only positions give the plain functions' logits bit for bit,
    alone and batched next to a sequence with an image."""
    _, runner = vlm
    rng = np.random.default_rng(9)
    text = _text(rng, 70)
    a = runner.new_seq()
    plain = runner.prefill([(a, text)], all_logits=True)[0]
    plain_dec = runner.decode([a], [5])[0]
    runner.free_seq(a)

    ids, images = _prompt(rng, [3, make_image(40, 40, 16), 4])
    prompt, media = build_media(ids, [prepare_image(i, runner.vision.settings) for i in images], IMAGE_TOKEN,
                                runner.vision.merge)
    b, c = runner.new_seq(), runner.new_seq()
    c.media = media
    mixed = runner.prefill([(b, text), (c, prompt)], all_logits=True)[0]  # goes through prefill_mm
    np.testing.assert_array_equal(mixed, plain)
    dec = runner.decode([b, c], [5, 6])[0]  # decode_mrope: c has a nonzero rope delta
    np.testing.assert_array_equal(dec, plain_dec)
    runner.free_seq(b)
    runner.free_seq(c)
