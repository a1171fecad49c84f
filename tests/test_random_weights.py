"""Random-weights benchmark artifacts: built from config.json alone, weights drawn at load time, labelled,
and refused by `ninfer serve` unless asked for."""
from __future__ import annotations

import argparse
import shutil

import numpy as np
import pytest

from ninfer_mlc.compile.build import compile_model
from ninfer_mlc.contract.manifest import read_manifest
from ninfer_mlc.paths import default_model_dir
from ninfer_mlc.runtime.executor.random_weights import E2M1_RMS, rule_for
from ninfer_mlc.runtime.harness import Harness

TINY = default_model_dir()


@pytest.fixture(scope="module")
def random_art(tmp_path_factory):
    src = tmp_path_factory.mktemp("cfg")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        shutil.copy2(TINY / f, src / f)
    return compile_model(src, out_dir=tmp_path_factory.mktemp("art") / "tiny-random", name="tiny-random",
                         random_weights=7, log=lambda *_: None)


def test_artifact_holds_only_the_exact_tables(random_art):
    m = read_manifest(random_art)
    assert m.extras["random_weights"] == {"seed": 7}
    from ninfer_mlc.contract import safetensors_io

    stored = safetensors_io.load(random_art / m.weight_shards[0])
    assert set(stored) == {"rope_inv_freq", "rope_attn_factor"}
    want = safetensors_io.load(TINY / read_manifest(TINY).weight_shards[0])
    np.testing.assert_array_equal(stored["rope_inv_freq"], want["rope_inv_freq"])


def test_weights_are_drawn_deterministically_and_run(random_art):
    ids = list(range(5, 90))
    logits = []
    for _ in range(2):
        h = Harness(random_art, kv_capacity_tokens=256, num_slots=1)
        assert h.random_weights and h.weights_bytes > 0
        seq = h.new_seq()
        out = h.prefill([(seq, ids)])[0]
        step = h.decode([seq], [3])[0]
        assert np.isfinite(out).all() and np.isfinite(step).all() and out.std() > 0
        logits.append((out, step))
    np.testing.assert_array_equal(logits[0][0], logits[1][0])  # same seed, same weights


def test_nvfp4_rules_keep_the_row_spread():
    params = {"w.weight": ((64, 512), "uint8"), "w.weight_scale": ((64, 64), "uint8"),
              "w.weight_scale_2": ((64,), "float32")}
    assert rule_for("w.weight_scale", (64, 64), "uint8", params).a == 0x30  # E4M3 0.5 .. 1.9, never NaN
    r = rule_for("w.weight_scale_2", (64,), "float32", params)
    assert r.kind == "const" and r.a == pytest.approx(1024 ** -0.5 / E2M1_RMS)


def test_serve_refuses_unless_asked(random_art):
    from ninfer_mlc.server.app import load_state
    from ninfer_mlc.server.options import add_serve_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    with pytest.raises(SystemExit) as e:
        load_state(p.parse_args([str(random_art)]), engine=object())
    assert e.value.code == 2
    from ninfer_mlc.runtime.assemble import open_engine
    from ninfer_mlc.runtime.config import EngineConfig
    from ninfer_mlc.server.stats import build_stats

    eng = open_engine(random_art, EngineConfig(max_concurrency=1, max_context=512))
    try:
        state = load_state(p.parse_args([str(random_art), "--allow-random-weights", "--max-context", "512"]),
                           engine=eng)
        s = build_stats(state.engine, state.http, state.config.model_id)
        assert s["load"]["random_weights"] is True and "random" in state.config.model_id
    finally:
        eng.stop()
