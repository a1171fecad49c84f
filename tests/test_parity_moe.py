"""Mixture-of-experts specifics (tests/test_parity_hf.py runs the dense parity suite on the MoE families too):
config parsing, the test prompt really exercising every expert and routing ties, the router top-k kernel's tie
rule and normalisation, per-expert and fused checkpoint layouts converting to the same parameters (float and
NVFP4), NVFP4 experts against transformers running the dequantized weights, and the MoE MTP head against
transformers' Qwen3_5MoeDecoderLayer."""
from __future__ import annotations

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hf_tiny import DUPLICATE, MOE, ORIGINAL, make_hf_model, router_choices, save_fused_vlm, save_hf  # noqa: E402

from ninfer_mlc.compile.build import compile_model  # noqa: E402
from ninfer_mlc.compile.config import ConfigError, parse_config  # noqa: E402
from ninfer_mlc.compile.weight_quant import dequantize_weight, quantize_weight  # noqa: E402
from ninfer_mlc.contract import safetensors_io  # noqa: E402
from ninfer_mlc.runtime.harness import Harness  # noqa: E402


def rel_err(got, ref) -> float:
    return float(np.abs(np.asarray(got) - np.asarray(ref)).max() / np.abs(ref).max())


# ---- config -------------------------------------------------------------------------------------
def _moe_raw(**kw):
    text = dict(model_type="qwen3_5_moe_text", vocab_size=320, hidden_size=64, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8, num_experts=8,
                num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    text.update(kw)
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "text_config": text}


def test_config_parses_moe_geometry():
    cfg = parse_config(_moe_raw(norm_topk_prob=False, mlp_only_layers=[0]))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.norm_topk_prob and cfg.moe_layers == [0, 1, 2, 3] and cfg.intermediate_size == 0  # 3.5-MoE: always
    nxt = parse_config({"architectures": ["Qwen3NextForCausalLM"], **{k: v for k, v in _moe_raw()["text_config"].items()
                                                                      if k != "model_type"},
                        "intermediate_size": 96, "norm_topk_prob": False, "mlp_only_layers": [1],
                        "decoder_sparse_step": 1})
    assert nxt.family == "qwen3_next" and not nxt.norm_topk_prob and nxt.moe_layers == [0, 2, 3]
    assert "num_experts" in nxt.to_dict() and "num_experts" not in parse_config(
        {**_moe_raw()["text_config"], "model_type": "qwen3_5_text", "num_experts": 0, "intermediate_size": 96}).to_dict()


@pytest.mark.parametrize("kw, msg", [
    (dict(num_experts_per_tok=9), "num_experts_per_tok"),
    (dict(shared_expert_intermediate_size=0), "shared expert"),
    (dict(num_experts=0), "num_experts > 0"),
    (dict(moe_intermediate_size=None), "moe_intermediate_size"),
])
def test_config_rejects_bad_moe(kw, msg):
    raw = _moe_raw(**kw)
    raw["text_config"] = {k: v for k, v in raw["text_config"].items() if v is not None}
    with pytest.raises(ConfigError, match=msg):
        parse_config(raw)


# ---- the parity prompt exercises every expert and the duplicated expert's ties --------------------
@pytest.mark.parametrize("family", list(MOE))
def test_parity_prompt_uses_every_expert_and_ties(family):
    from test_parity_hf import DECODE_STEPS, PROMPT_LEN, SEEDS

    model = make_hf_model(family, seed=SEEDS[family])
    gen = torch.Generator().manual_seed(5)  # the ids of test_parity_hf.case
    ids = torch.randint(0, model.config.vocab_size, (1, PROMPT_LEN + DECODE_STEPS), generator=gen)
    picks = router_choices(model, ids)
    assert len(picks) == (3 if family == "qwen3_next_moe" else 4)  # mlp_only_layers=[1] is dense
    for p in picks:
        assert set(p.flatten().tolist()) == set(range(MOE[family]["num_experts"]))
        # the duplicate ties its original on every token that picks either
        tied = ((p == ORIGINAL) | (p == DUPLICATE)).any(-1)
        assert int(tied.sum()) >= 5


# ---- router top-k kernel ----------------------------------------------------------------------------
def _topk_ref(logits, k, norm):
    """Lowest index first among equal probabilities (vLLM / SGLang fused top-k)."""
    e = logits.shape[1] - 1
    z = np.exp(logits[:, :e] - logits[:, :e].max(1, keepdims=True))
    p = z / z.sum(1, keepdims=True)
    ids = np.stack([sorted(range(e), key=lambda j: (-p[t, j], j))[:k] for t in range(len(p))])
    w = np.take_along_axis(p, ids, 1)
    if norm:
        w = w / w.sum(1, keepdims=True)
    shared = 1 / (1 + np.exp(-logits[:, e:]))
    return np.concatenate([ids, np.full((len(p), 1), e)], 1), np.concatenate([w, shared], 1)


@pytest.mark.parametrize("norm", [True, False])
def test_topk_kernel_ties_to_lower_index(norm):
    import tvm

    from ninfer_mlc.compile.kernels import moe

    E, K = 16, 4
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((40, E + 1)).astype(np.float32)
    logits[:20, :E] = rng.integers(0, 3, (20, E)).astype(np.float32)  # many exact ties, across the k boundary
    logits[20, :E] = 1.0  # all equal
    lib = tvm.compile(tvm.IRModule({"topk": moe.moe_topk(E, K, norm).with_attr("global_symbol", "topk")}),
                      target="llvm")
    dev = tvm.cpu()
    args = [tvm.runtime.tensor(a, dev) for a in (logits, np.zeros((40, K + 1), np.int32),
                                                 np.zeros((40, K + 1), np.float32))]
    lib["topk"](*args)
    ids, w = _topk_ref(logits, K, norm)
    np.testing.assert_array_equal(args[1].numpy(), ids)
    np.testing.assert_allclose(args[2].numpy(), w, rtol=2e-6, atol=0)
    assert args[1].numpy()[20, :K].tolist() == [0, 1, 2, 3]


# ---- conversion: per-expert and fused layouts ---------------------------------------------------------
def _params(hf_dir, quant):
    from ninfer_mlc.compile.build import rope_tables_for
    from ninfer_mlc.compile.config import load_config
    from ninfer_mlc.compile.convert import hf_to_params
    from ninfer_mlc.compile.model import Qwen3xForCausalLM

    cfg = load_config(hf_dir)
    m = Qwen3xForCausalLM(cfg, "float32", "llvm", weight_quant="nvfp4" if quant == "nvfp4" else None)
    specs = [(n, [int(s) for s in p.shape], p.dtype) for n, p in m.export_tvm(spec=m.export_spec())[1]]
    inv_freq, factor, _ = rope_tables_for(cfg, {})
    return hf_to_params(safetensors_io.load_dir(hf_dir), cfg, specs, (inv_freq, factor)), specs


@pytest.mark.parametrize("quant", ["f32", "nvfp4"])
def test_per_expert_and_fused_layouts_convert_identically(tmp_path, quant):
    model = make_hf_model("qwen3_5_moe", seed=4)
    per, specs = _params(save_hf(model, tmp_path / "per_expert"), quant)
    fused, _ = _params(save_fused_vlm(model, tmp_path / "fused"), quant)
    assert per.keys() == fused.keys()
    for k in per:
        np.testing.assert_array_equal(per[k], fused[k], err_msg=k)
    spec = dict((n, (s, dt)) for n, s, dt in specs)
    gu = "model.layers.0.mlp.experts.gate_up_proj.weight"
    if quant == "nvfp4":
        assert spec[gu] == ([9, 64, 32], "uint8") and "model.layers.0.mlp.router.weight_scale" not in spec
    else:  # 8 experts + the folded shared expert; the router carries the shared gate as its last row
        assert spec[gu] == ([9, 64, 64], "float32")
        sd = model.state_dict()
        np.testing.assert_array_equal(per[gu][8, :32], sd["model.layers.0.mlp.shared_expert.gate_proj.weight"])
        np.testing.assert_array_equal(per[gu][3], sd["model.layers.0.mlp.experts.gate_up_proj"][3])
        np.testing.assert_array_equal(per["model.layers.0.mlp.router.weight"][8],
                                      sd["model.layers.0.mlp.shared_expert_gate.weight"][0])


def test_missing_expert_is_named(tmp_path):
    from ninfer_mlc.compile.convert import ConversionError

    hf_dir = save_hf(make_hf_model("qwen3_next_moe", seed=4), tmp_path / "hf")
    f = next(hf_dir.glob("*.safetensors"))
    tensors = safetensors_io.load(f)
    del tensors["model.layers.2.mlp.experts.6.up_proj.weight"]
    f.unlink()
    safetensors_io.save(hf_dir / "model.safetensors", tensors)
    with pytest.raises(ConversionError, match=r"layers\.2\.mlp\.experts\.6\.up_proj"):
        _params(hf_dir, "f32")


# ---- NVFP4 experts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("shared", [32], ids=["shared-folded"])
def test_nvfp4_moe_matches_hf_with_dequantized_weights(tmp_path, shared):
    """A ModelOpt-style NVFP4 checkpoint (per-expert codes / scales) of Qwen3.5-MoE, the shared expert folded
    into the expert arrays or a separate NVFP4 MLP: the compiled llvm model vs transformers running the
    dequantized weights."""
    import ml_dtypes

    model = make_hf_model("qwen3_5_moe", seed=41, shared_expert_intermediate_size=shared)
    hf_dir = save_hf(model, tmp_path / "hf")
    disk = safetensors_io.load(next(hf_dir.glob("*.safetensors")))
    deq = {}
    quantized = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj",
                 "up_proj", "down_proj")
    for n in list(disk):
        if n.endswith(".weight") and n.split(".")[-2] in quantized:
            q = quantize_weight(np.asarray(disk[n], np.float32))
            deq[n] = dequantize_weight(q)
            base = n[: -len(".weight")]
            disk[n] = q["weight"]
            disk[base + ".weight_scale"] = q["weight_scale"].view(ml_dtypes.float8_e4m3fn)
            disk[base + ".weight_scale_2"] = q["weight_scale_2"]
    for f in hf_dir.glob("*.safetensors"):
        f.unlink()
    safetensors_io.save(hf_dir / "model.safetensors", disk)
    art = compile_model(hf_dir, target="llvm", quant="nvfp4", out_dir=tmp_path / "art", log=lambda *_: None)
    with torch.no_grad():  # transformers keeps fused experts in memory: write the dequantized slices back
        for name, w in deq.items():
            parts = name.split(".")
            if ".mlp.experts." in name:
                layer, e, proj = int(parts[2]), int(parts[5]), parts[6]
                experts = model.model.layers[layer].mlp.experts
                i = model.config.moe_intermediate_size
                t = torch.from_numpy(w)
                if proj == "down_proj":
                    experts.down_proj[e].copy_(t)
                else:
                    experts.gate_up_proj[e, (0 if proj == "gate_proj" else i):][:i].copy_(t)
            else:
                model.get_parameter(name).copy_(torch.from_numpy(w))
    ids = torch.randint(0, model.config.vocab_size, (1, 80), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(ids).logits[0].numpy()
    runner = Harness(art, kv_capacity_tokens=512, num_slots=2)
    dts = {n: dt for n, _, dt in runner.manifest.params}
    assert dts["model.layers.0.mlp.experts.gate_up_proj.weight"] == "uint8"
    if shared != 32:
        assert dts["model.layers.0.mlp.shared_expert.gate_up_proj.weight"] == "uint8"
    assert dts["model.layers.0.mlp.router.weight"] == "float32"
    seq = runner.new_seq()
    (got,) = runner.prefill([(seq, ids[0, :72].tolist())], all_logits=True)
    steps = [runner.decode([seq], [int(t)])[0] for t in ids[0, 72:80]]
    assert rel_err(got, ref[:72]) < 1e-3
    assert rel_err(np.stack(steps), ref[72:80]) < 1e-3


# ---- the MoE MTP head --------------------------------------------------------------------------------
def test_moe_mtp_head_matches_transformers_layer(tmp_path):
    """mtp.* weights of a Qwen3.5-MoE checkpoint (the layer's MoE experts in the fused layout): mtp_prefill,
    mtp_step and mtp_step_sl against fc / norms in torch and transformers' Qwen3_5MoeDecoderLayer."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as M

    model = make_hf_model("qwen3_5_moe", seed=43)
    cfg = model.config
    d = cfg.hidden_size
    gen = torch.Generator().manual_seed(9)
    layer = M.Qwen3_5MoeDecoderLayer(cfg, layer_idx=cfg.layer_types.index("full_attention")).eval()
    head = {"fc.weight": torch.randn(d, 2 * d, generator=gen) * 0.1,
            "pre_fc_norm_embedding.weight": torch.randn(d, generator=gen) * 0.3,
            "pre_fc_norm_hidden.weight": torch.randn(d, generator=gen) * 0.3,
            "norm.weight": torch.randn(d, generator=gen) * 0.3}
    with torch.no_grad():
        for n, p in layer.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if "norm" in n else 0.15))
    hf_dir = save_hf(model, tmp_path / "hf")
    f = next(hf_dir.glob("*.safetensors"))
    tensors = safetensors_io.load(f)
    tensors.update({f"mtp.{k}": v.numpy() for k, v in head.items()})
    tensors.update({f"mtp.layers.0.{k}": v.detach().numpy() for k, v in layer.state_dict().items()})
    f.unlink()
    safetensors_io.save(hf_dir / "model.safetensors", tensors)
    raw = json.loads((hf_dir / "config.json").read_text())
    (hf_dir / "config.json").write_text(json.dumps(dict(raw, mtp_num_hidden_layers=1)))
    art = compile_model(hf_dir, target="llvm", quant="f32", out_dir=tmp_path / "art", log=lambda *_: None)
    runner = Harness(art, kv_capacity_tokens=512, num_slots=2)
    assert runner.has_mtp
    ids = torch.randint(0, cfg.vocab_size, (80,), generator=gen).tolist()
    seq = runner.new_seq()
    _, (hidden,) = runner.prefill_h([(seq, ids[:79])])
    last_logits, _ = runner.mtp_prefill([(seq, hidden[:78], ids[1:79], 0)])
    runner.reserve(seq, 1)
    step_logits, _ = runner.mtp_step([seq], hidden[78:79], [ids[79]], [78])
    shortlist = np.array([5, 77, 3, 200], np.int32)
    sl_logits, _ = runner.mtp_step([seq], hidden[78:79], [ids[79]], [78], shortlist=shortlist)

    def norm(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps) * (1 + w)

    emb = model.model.embed_tokens.weight.detach()
    x = torch.cat([norm(emb[torch.tensor(ids[1:80])], head["pre_fc_norm_embedding.weight"]),
                   norm(torch.from_numpy(hidden), head["pre_fc_norm_hidden.weight"])], -1) @ head["fc.weight"].T
    pos = torch.arange(79)[None]
    mask = torch.full((79, 79), float("-inf")).triu(1)[None, None]
    rot = M.Qwen3_5MoeTextRotaryEmbedding(cfg)
    with torch.no_grad():
        out = layer(x[None], position_embeddings=rot(x[None], pos), attention_mask=mask, position_ids=pos)
        out = norm((out[0] if isinstance(out, tuple) else out)[0], head["norm.weight"])
        ref = (out @ model.lm_head.weight.T).numpy()
    assert rel_err(last_logits[0], ref[77]) < 1e-4
    assert rel_err(step_logits[0], ref[78]) < 1e-4
    assert rel_err(sl_logits[0], ref[78][shortlist]) < 1e-4
    runner.free_seq(seq)
