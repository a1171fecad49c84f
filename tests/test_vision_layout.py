"""Image token layout without a compiled model: placeholder expansion, M-RoPE positions vs transformers'
get_rope_index, the rope delta past the prompt, prefix-cache key ids, smart_resize vs transformers."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hf_tiny_vlm import IMAGE_TOKEN, VISION_END, VISION_START, make_hf_vlm, make_image  # noqa: E402

from ninfer_mlc.runtime.vision.image_processing import ProcessorSettings, prepare_image, smart_resize  # noqa: E402
from ninfer_mlc.runtime.vision.media import build_media  # noqa: E402
from ninfer_mlc.runtime.vision.mrope import MediaLayoutError, cache_key_ids, expand_image_pads, rope_positions  # noqa: E402

SETTINGS = ProcessorSettings(4, 2, 2, 16 * 16, 64 * 64)


def test_rope_positions_match_get_rope_index():
    model = make_hf_vlm()
    grids = [(1, 6, 10), (1, 8, 4)]
    ids = [5, 6, VISION_START, IMAGE_TOKEN, VISION_END, 7, 8, 9, VISION_START, IMAGE_TOKEN, VISION_END, 10]
    ids = expand_image_pads(ids, IMAGE_TOKEN, [15, 8])
    pos, delta = rope_positions(ids, IMAGE_TOKEN, grids, 2)
    t = torch.tensor([ids])
    ref, ref_delta = model.model.get_rope_index(t, (t == IMAGE_TOKEN).int(), image_grid_thw=torch.tensor(grids))
    np.testing.assert_array_equal(pos, ref[:, 0].numpy().T)
    assert delta == int(ref_delta) and delta < 0


def test_media_positions_past_the_prompt_and_rows():
    img = prepare_image(make_image(40, 24, 1), SETTINGS)  # 10 x 6 patches -> 15 tokens
    ids, media = build_media([1, VISION_START, IMAGE_TOKEN, VISION_END, 2], [img], IMAGE_TOKEN, 2)
    assert len(ids) == 19 and media.num_image_tokens == 15
    # image at p = 2: T stays 2, H = 2 + 0..2, W = 2 + 0..4; text after it resumes at 2 + max(5, 3) = 7
    assert media.rope_pos[2].tolist() == [2, 2, 2] and media.rope_pos[16].tolist() == [2, 4, 6]
    assert media.rope_pos[17].tolist() == [7, 7, 7] and media.delta == 9 - 19
    assert media.positions(17, 4).tolist() == [[7] * 3, [8] * 3, [9] * 3, [10] * 3]  # generated tokens: + delta
    assert media.rows(0, 4).tolist() == [-1, -1, 0, 1] and media.rows(16, 4).tolist() == [14, -1, -1, -1]


def test_cache_keys_follow_image_content():
    ids = [1, VISION_START] + [IMAGE_TOKEN] * 6 + [VISION_END, 2]
    a = cache_key_ids(ids, IMAGE_TOKEN, ["ab" * 32])
    b = cache_key_ids(ids, IMAGE_TOKEN, ["ab" * 32])
    c = cache_key_ids(ids, IMAGE_TOKEN, ["cd" * 32])
    assert a == b and a != c
    assert a[:2] == ids[:2] and a[-2:] == ids[-2:] and all(k < 0 for k in a[2:8]) and len(set(a[2:8])) == 6


def test_layout_errors():
    with pytest.raises(MediaLayoutError):
        expand_image_pads([1, IMAGE_TOKEN, 2], IMAGE_TOKEN, [4, 4])
    with pytest.raises(MediaLayoutError):
        rope_positions([IMAGE_TOKEN] * 3, IMAGE_TOKEN, [(1, 4, 4)], 2)


@pytest.mark.parametrize("h,w", [(40, 40), (23, 57), (3, 500), (1000, 900), (17, 17)])
def test_smart_resize_matches_transformers(h, w):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf

    assert smart_resize(h, w, 32, 65536, 16777216) == hf(h, w, 32, 65536, 16777216)
    assert smart_resize(h, w, 8, 256, 4096) == hf(h, w, 8, 256, 4096)


def test_vision_weights_of_the_wrong_shape_are_a_config_error():
    """A visual.* tensor that does not fit the vision_config is named in a ConfigError (not a reshape crash)."""
    from ninfer_mlc.compile.config import ConfigError
    from ninfer_mlc.compile.vision_build import vision_weights
    from ninfer_mlc.compile.vision_config import parse_vision_config

    vcfg = parse_vision_config({"vision_config": {"depth": 1}})
    specs = [("patch_embed.proj.weight", [vcfg.hidden_size, 3 * 2 * 16 * 16], "float32")]
    with pytest.raises(ConfigError, match="patch_embed.proj.weight"):
        vision_weights({"model.visual.patch_embed.proj.weight": np.zeros((4, 3), np.float32)}, vcfg, specs)
    with pytest.raises(ConfigError, match="lacks vision weights"):
        vision_weights({}, vcfg, specs)
