"""With kernels.fused.norm_gemv on (a schedule override; min_k 0, the tiny model's K is 128), the CUDA decode folds
every RMSNorm read only by dense bf16 GEMVs into them; verify / mtp_step keep their norm launches."""
import json
import re

import pytest


@pytest.mark.parametrize("on", [True, False])
def test_decode_norms_fold_into_gemvs(tmp_path, monkeypatch, on):
    import tvm
    from tvm.target import Target

    from ninfer_mlc.compile import tiny_default
    from ninfer_mlc.compile.config import parse_config
    from ninfer_mlc.compile.model import Qwen3xForCausalLM

    (tmp_path / "cuda_sm_90.json").write_text(json.dumps({"kernels": {"fused": {"norm_gemv": on},
                                                                     "norm_gemv": {"min_k": 0}}}))
    monkeypatch.setenv("NINFER_SCHEDULE_DIR", str(tmp_path))
    cfg = parse_config(tiny_default.CONFIG)
    with Target({"kind": "cuda", "arch": "sm_90"}):
        m = Qwen3xForCausalLM(cfg, "bfloat16", "cuda", None, mtp=True)
    mod = m.export_tvm(spec=m.export_spec())[0]
    seen = set()
    for gv, f in mod.functions_items():
        if not isinstance(f, tvm.relax.Function) or gv.name_hint not in ("decode", "verify", "mtp_step"):
            continue
        sc = f.script()
        rms = set(re.findall(r"call_tir\((?:cls\.)?(gemv\w*_rms)\b", sc))
        norms = re.findall(r"call_tir\((?:cls\.)?(rms_norm_\w*)", sc)
        seen.add(gv.name_hint)
        if on and gv.name_hint == "decode":
            assert not norms and any("silu_mul" in c for c in rms) and any(c.endswith("_f32_rms") for c in rms)
        else:
            assert norms and not rms, gv.name_hint
    assert seen == {"decode", "verify", "mtp_step"}
