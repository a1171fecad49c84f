"""compile/rope_scaling.py vs HF transformers 5.24 (ROPE_INIT_FUNCTIONS, rotary classes, apply_rotary_pos_emb).

inv_freq agrees to <= 4 float32 ulp (measured <= 2): torch's float32 pow is not correctly rounded,
ours is a float64 pow rounded once; the attention factor is identical.
"""

import argparse
import itertools
import logging
import math

import numpy as np
import pytest
import torch
from transformers import Qwen3NextConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding, apply_rotary_pos_emb

from ninfer_mlc.compile.rope_scaling import (RopeSpec, add_cli_args, apply_partial_rope, cos_sin,
                                             inv_freq_and_attention_factor, spec_from_args)

logging.getLogger("transformers").setLevel(logging.ERROR)  # factor vs max_position_embeddings warnings


def hf_config(rp, head_dim, max_pos):
    return Qwen3NextConfig(head_dim=head_dim, max_position_embeddings=max_pos, rope_parameters=dict(rp))


def hf_inv_freq(rp, head_dim, max_pos):
    c = hf_config(rp, head_dim, max_pos)
    fn = Qwen3NextRotaryEmbedding.compute_default_rope_parameters if rp["rope_type"] == "default" \
        else ROPE_INIT_FUNCTIONS[rp["rope_type"]]
    inv, att = fn(c)
    return inv.numpy(), att


def ulp_diff(a, b):
    return int(np.abs(a.astype(np.float32).view(np.int32).astype(np.int64)
                      - b.astype(np.float32).view(np.int32).astype(np.int64)).max())


CASES = [c for c in itertools.product(
    ["default", "linear", "yarn"], [1e4, 1e6, 1e7], [(128, 1.0), (256, 0.25), (256, 0.5)],
    [1.0, 2.0, 4.0, 32.0], [4096, 32768, 262144]) if not (c[0] == "default" and c[3] != 1.0)]


@pytest.mark.parametrize("rope_type,theta,hd_prf,factor,orig", CASES)
def test_inv_freq_parity_with_hf(rope_type, theta, hd_prf, factor, orig):
    head_dim, prf = hd_prf
    rp = {"rope_type": rope_type, "rope_theta": theta, "partial_rotary_factor": prf}
    if rope_type != "default":
        rp["factor"] = factor
    if rope_type == "yarn":
        rp["original_max_position_embeddings"] = orig
    # yarn configs carry the extended length; linear ones the original (factor extends it)
    max_pos = orig if rope_type == "linear" else int(orig * factor)
    ref, ref_att = hf_inv_freq(rp, head_dim, max_pos)
    spec = RopeSpec.from_hf_config({"head_dim": head_dim, "max_position_embeddings": max_pos, "rope_parameters": rp})
    inv, att = inv_freq_and_attention_factor(spec)
    assert inv.dtype == np.float32 and inv.shape == (int(head_dim * prf) // 2,)
    assert ulp_diff(inv, ref) <= 4
    assert att == ref_att
    assert spec.max_context() == int(orig * factor)


@pytest.mark.parametrize("extra", [
    {"mscale": 0.707, "mscale_all_dim": 0.707},
    {"mscale": 1.0, "mscale_all_dim": 0.8},
    {"attention_factor": 1.5},
    {"beta_fast": 16, "beta_slow": 2},
    {"truncate": False},
    {"beta_fast": 4, "beta_slow": 4},  # low == high -> HF's +0.001 singularity guard
])
def test_yarn_options_parity(extra):
    rp = {"rope_type": "yarn", "rope_theta": 1e7, "partial_rotary_factor": 0.25, "factor": 4.0,
          "original_max_position_embeddings": 262144, **extra}
    ref, ref_att = hf_inv_freq(rp, 256, 1 << 20)
    inv, att = inv_freq_and_attention_factor(
        RopeSpec.from_hf_config({"head_dim": 256, "max_position_embeddings": 1 << 20, "rope_parameters": rp}))
    assert ulp_diff(inv, ref) <= 4
    assert att == ref_att


def test_qwen35_yarn_figures():
    """Research note §6.2: theta 1e7, dim 64, orig 262144, factor 4 -> ramp 14..22, mscale 1.1386."""
    spec = RopeSpec(rope_type="yarn", theta=1e7, rotary_dim=64, factor=4.0, original_max_position_embeddings=262144)
    base, _ = inv_freq_and_attention_factor(RopeSpec(theta=1e7, rotary_dim=64))
    inv, att = inv_freq_and_attention_factor(spec)
    assert math.isclose(att, 1.1386, abs_tol=1e-4) and math.isclose(att ** 2, 1.2965, abs_tol=1e-4)
    np.testing.assert_array_equal(inv[:15], base[:15])
    np.testing.assert_allclose(inv[22:], base[22:] / 4, rtol=1e-6)
    w = (inv[15:22] - base[15:22] / 4) / (base[15:22] - base[15:22] / 4)  # extrapolation weight
    np.testing.assert_allclose(w, 1 - np.arange(1, 8) / 8, atol=1e-5)
    assert spec.max_context() == 1048576


def test_config_key_variants():
    new = {"text_config": {"head_dim": 256, "max_position_embeddings": 262144, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144, "rope_theta": 1e7,
        "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10], "mrope_interleaved": True}}}
    legacy = {"hidden_size": 2048, "num_attention_heads": 16, "head_dim": 256, "rope_theta": 1e7,
              "partial_rotary_factor": 0.25, "max_position_embeddings": 262144,
              "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 262144}}
    a, b = RopeSpec.from_hf_config(new), RopeSpec.from_hf_config(legacy)
    assert a == b
    assert (a.rope_type, a.theta, a.rotary_dim, a.factor, a.original_max_position_embeddings) == \
        ("yarn", 1e7, 64, 4.0, 262144)
    plain = RopeSpec.from_hf_config({"hidden_size": 1024, "num_attention_heads": 8, "max_position_embeddings": 40960,
                                     "rope_theta": 1e6})
    assert (plain.rope_type, plain.rotary_dim, plain.factor, plain.max_context()) == ("default", 128, 1.0, 40960)
    # HF: a top-level original_max_position_embeddings wins; a missing yarn factor = max_pos / original
    top = RopeSpec.from_hf_config({"head_dim": 128, "max_position_embeddings": 131072,
                                   "original_max_position_embeddings": 32768,
                                   "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 1}})
    assert top.original_max_position_embeddings == 32768 and top.factor == 4.0


def test_cli_overrides():
    parser = argparse.ArgumentParser()
    add_cli_args(parser)
    cfg = {"head_dim": 256, "max_position_embeddings": 262144,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}
    assert spec_from_args(cfg, parser.parse_args([])).rope_type == "default"
    s = spec_from_args(cfg, parser.parse_args(["--rope-scaling-type", "yarn", "--rope-scaling-factor", "2"]))
    assert (s.rope_type, s.factor, s.original_max_position_embeddings, s.max_context()) == ("yarn", 2.0, 262144, 524288)
    s = spec_from_args(cfg, parser.parse_args(["--rope-scaling-type", "linear", "--rope-scaling-factor", "4",
                                               "--rope-scaling-original-context", "65536"]))
    assert (s.rope_type, s.max_context()) == ("linear", 262144)
    yarn_cfg = {**cfg, "rope_parameters": {**cfg["rope_parameters"], "rope_type": "yarn", "factor": 4.0,
                                           "original_max_position_embeddings": 262144}}
    assert spec_from_args(yarn_cfg, parser.parse_args(["--rope-scaling-type", "default"])).rope_type == "default"
    assert spec_from_args(yarn_cfg, parser.parse_args(["--rope-scaling-factor", "2"])).factor == 2.0
    with pytest.raises(SystemExit):
        parser.parse_args(["--rope-scaling-type", "dynamic"])


@pytest.mark.parametrize("kwargs,msg", [
    (dict(scaling_type="dynamic", factor=2.0), "unsupported rope scaling type 'dynamic'"),
    (dict(scaling_type="longrope", factor=2.0), "unsupported rope scaling type"),
    (dict(scaling_type="yarn", factor=0.5), r"factor must be in \[1, 32\], got 0.5"),
    (dict(scaling_type="linear", factor=33), r"factor must be in \[1, 32\], got 33"),
    (dict(scaling_type="yarn", factor="4"), "factor must be a number"),
    (dict(scaling_type="yarn", factor=float("nan")), "factor must be a number"),
    (dict(scaling_type="yarn"), "needs a factor"),
    (dict(scaling_type="linear"), "needs a factor"),
    (dict(factor=2.0), "needs --rope-scaling-type linear or yarn"),
    (dict(scaling_type="yarn", factor=2.0, original_context=-5), "original_max_position_embeddings must be"),
])
def test_error_messages(kwargs, msg):
    cfg = {"head_dim": 256, "max_position_embeddings": 262144,
           "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}}
    with pytest.raises(ValueError, match=msg):
        RopeSpec.from_hf_config(cfg, **kwargs)


def test_spec_validation_messages():
    with pytest.raises(ValueError, match="rotary_dim must be a positive even number"):
        RopeSpec(rotary_dim=63)
    with pytest.raises(ValueError, match="rope_theta must be > 0"):
        RopeSpec(theta=0)
    with pytest.raises(ValueError, match="'default' takes no factor"):
        RopeSpec(factor=2.0)
    with pytest.raises(ValueError, match="beta_fast"):
        RopeSpec(rope_type="yarn", factor=2.0, beta_fast=1, beta_slow=32)
    with pytest.raises(ValueError, match="exceeds head_dim"):
        apply_partial_rope(np.zeros((1, 1, 32)), [0], RopeSpec(rotary_dim=64))


@pytest.mark.parametrize("rope_type,factor", [("default", 1.0), ("linear", 4.0), ("yarn", 4.0), ("yarn", 2.0)])
def test_apply_partial_rope_matches_hf(rope_type, factor):
    orig, head_dim, n_heads = 262144, 256, 3
    rp = {"rope_type": rope_type, "rope_theta": 1e7, "partial_rotary_factor": 0.25}
    if rope_type != "default":
        rp["factor"] = factor
    if rope_type == "yarn":
        rp["original_max_position_embeddings"] = orig
    max_pos = int(orig * factor)
    rng = np.random.default_rng(0)
    # positions well past the original context (and some early ones)
    pos = np.concatenate([[0, 1, 17, orig - 1, orig, orig + 1], rng.integers(orig, 4 * orig, 26)]).astype(np.int64)
    q = rng.standard_normal((len(pos), n_heads, head_dim)).astype(np.float32)
    k = rng.standard_normal((len(pos), 1, head_dim)).astype(np.float32)

    rot = Qwen3NextRotaryEmbedding(hf_config(rp, head_dim, max_pos))
    cos, sin = rot(torch.from_numpy(q), torch.from_numpy(pos)[None])
    hq, hk = apply_rotary_pos_emb(torch.from_numpy(q)[None], torch.from_numpy(k)[None], cos, sin, unsqueeze_dim=2)

    spec = RopeSpec.from_hf_config({"head_dim": head_dim, "max_position_embeddings": max_pos, "rope_parameters": rp})
    inv, att = inv_freq_and_attention_factor(spec)
    my_cos, my_sin = cos_sin(pos, inv, att)
    np.testing.assert_allclose(my_cos, cos[0].numpy(), atol=2e-6)
    np.testing.assert_allclose(my_sin, sin[0].numpy(), atol=2e-6)
    mq, mk = apply_partial_rope(q, pos, spec), apply_partial_rope(k, pos, spec)
    np.testing.assert_allclose(mq, hq[0].numpy(), atol=2e-5)
    np.testing.assert_allclose(mk, hk[0].numpy(), atol=2e-5)
    # pass-through dims untouched; rotary dims scaled by the attention factor only
    np.testing.assert_array_equal(mq[..., 64:], q[..., 64:])
    np.testing.assert_allclose(np.linalg.norm(mq[..., :64], axis=-1), att * np.linalg.norm(q[..., :64], axis=-1),
                               rtol=1e-5)

    # Qwen3.5's interleaved-MRoPE class reduces to the same table for text positions (T=H=W)
    c35 = Qwen3_5TextConfig(head_dim=head_dim, max_position_embeddings=max_pos,
                            rope_parameters={**rp, "mrope_section": [11, 11, 10], "mrope_interleaved": True})
    cos35, sin35 = Qwen3_5TextRotaryEmbedding(c35)(torch.from_numpy(q), torch.from_numpy(pos)[None])
    np.testing.assert_allclose(my_cos, cos35[0].numpy(), atol=2e-6)
    np.testing.assert_allclose(my_sin, sin35[0].numpy(), atol=2e-6)
