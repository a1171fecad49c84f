"""YaRN / linear RoPE scaling end to end: compiled llvm model vs HF past the original context.

A tiny HF model is built twice with identical weights: once with the scaled rope (the reference)
and once with the default rope (what is compiled). `ninfer compile --rope-scaling-*` must turn the
second into the first: prefill (chunked across the original context of 256) and decode logits at
positions up to 620 match HF to 1e-3, while the unscaled model is far off there. --max-context past
original x factor is refused by the CLI, and the runtime refuses sequences past the manifest's
max_context.
"""
from __future__ import annotations

import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from hf_tiny import make_hf_model, save_hf  # noqa: E402

from ninfer_mlc.cli import main  # noqa: E402
from ninfer_mlc.compile.build import compile_model  # noqa: E402
from ninfer_mlc.contract.manifest import read_manifest  # noqa: E402
from ninfer_mlc.runtime.harness import Harness  # noqa: E402

logging.getLogger("transformers").setLevel(logging.ERROR)

ORIG, FACTOR = 256, 4.0
PROMPT = 600            # > ORIG, chunked as 200 + 400
DECODE = 20
REL_TOL = 1e-3
BASE_ROPE = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
SCALED = {
    "yarn": {**BASE_ROPE, "rope_type": "yarn", "factor": FACTOR, "original_max_position_embeddings": ORIG},
    "linear": {**BASE_ROPE, "rope_type": "linear", "factor": FACTOR},
}
FLAGS = ["--rope-scaling-factor", "4", "--rope-scaling-original-context", str(ORIG)]


def rel_err(got, ref) -> float:
    return float(np.abs(np.asarray(got) - np.asarray(ref)).max() / np.abs(ref).max())


@pytest.fixture(scope="module", params=[("yarn", "qwen3_next"), ("linear", "qwen3_5")], ids=["yarn", "linear"])
def case(request, tmp_path_factory):
    rope_type, family = request.param
    ref_model = make_hf_model(family, seed=31, rope_parameters=SCALED[rope_type])
    plain = make_hf_model(family, seed=31)
    for (n, a), (_, b) in zip(ref_model.state_dict().items(), plain.state_dict().items()):
        if not n.endswith("inv_freq"):
            assert torch.equal(a, b), n
    hf_dir = save_hf(plain, tmp_path_factory.mktemp(f"hf_{rope_type}"))
    art = tmp_path_factory.mktemp(f"art_{rope_type}")
    assert main(["compile", str(hf_dir), "-o", str(art), "--name", f"rope-{rope_type}",
                 "--rope-scaling-type", rope_type, *FLAGS]) == 0
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, ref_model.config.vocab_size, (1, PROMPT + DECODE), generator=gen)
    with torch.no_grad():
        ref = ref_model(ids).logits[0].numpy()
        unscaled = plain(ids).logits[0].numpy()
    return rope_type, hf_dir, art, ids[0].numpy().tolist(), ref, unscaled


def test_manifest_records_scaling(case):
    rope_type, _, art, *_ = case
    m = read_manifest(art)
    assert m.rope["type"] == rope_type and m.rope["factor"] == FACTOR
    assert m.rope["original_context"] == ORIG and m.max_context == int(ORIG * FACTOR)
    if rope_type == "yarn":
        assert m.rope["attention_factor"] == pytest.approx(0.1 * np.log(FACTOR) + 1)


def test_prefill_and_decode_match_hf_past_original_context(case):
    _, _, art, ids, ref, unscaled = case
    # the scaling matters at these positions: the unscaled model is far off
    assert rel_err(unscaled[ORIG:PROMPT], ref[ORIG:PROMPT]) > 20 * REL_TOL  # measured 0.056 yarn, 0.048 linear
    runner = Harness(art, num_slots=2)
    seq = runner.new_seq()
    (a,) = runner.prefill([(seq, ids[:200])], all_logits=True)
    (b,) = runner.prefill([(seq, ids[200:PROMPT])], all_logits=True)
    pre = np.concatenate([a, b])
    assert rel_err(pre, ref[:PROMPT]) < REL_TOL
    assert rel_err(pre[ORIG:], ref[ORIG:PROMPT]) < REL_TOL
    for t in range(PROMPT, PROMPT + DECODE):
        lg = runner.decode([seq], [ids[t]])[0]
        assert rel_err(lg, ref[t]) < REL_TOL, f"decode at position {t}"
    runner.free_seq(seq)


def test_config_driven_yarn_equals_flags(case, tmp_path):
    """A checkpoint whose config.json already carries the yarn rope compiles to the same tables."""
    rope_type, _, art, *_ = case
    if rope_type != "yarn":
        pytest.skip("config-driven check done for yarn")
    model = make_hf_model("qwen3_next", seed=31, rope_parameters=SCALED["yarn"])
    out = compile_model(save_hf(model, tmp_path / "hf"), out_dir=tmp_path / "art", name="cfg-yarn",
                        log=lambda *_: None)
    assert read_manifest(out).rope == read_manifest(art).rope


def test_max_context_past_scaled_limit_is_refused(case, tmp_path, capsys):
    rope_type, hf_dir, *_ = case
    with pytest.raises(SystemExit) as e:
        main(["compile", str(hf_dir), "-o", str(tmp_path / "x"), "--rope-scaling-type", rope_type, *FLAGS,
              "--max-context", str(int(ORIG * FACTOR) + 1)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--max-context" in err and str(int(ORIG * FACTOR)) in err
    assert not (tmp_path / "x").exists()


def test_runtime_refuses_sequences_past_max_context(case):
    _, _, art, ids, _, _ = case
    limit = int(ORIG * FACTOR)
    runner = Harness(art, kv_capacity_tokens=2 * limit, num_slots=2)  # pages are not the limit
    seq = runner.new_seq()
    runner.prefill([(seq, ids[:PROMPT])])
    with pytest.raises(ValueError, match=f"max_context {limit}"):
        runner.prefill([(seq, (ids * 2)[:limit - PROMPT + 1])])
    assert seq.length == PROMPT
    runner.prefill([(seq, (ids * 2)[:limit - PROMPT])])   # exactly at the limit is fine
    with pytest.raises(ValueError, match=f"max_context {limit}"):
        runner.decode([seq], [ids[0]])
    runner.free_seq(seq)
