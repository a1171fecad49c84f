"""The engine's constrained decoding (runtime/engine.py sampling, the scheduler's commit, runtime/spec) on the tiny model:
constrained rows share batches with free ones without changing them, speculative decoding serves
constrained requests without drafts and with the same greedy output, and a grammar that completes
ends the request even when the request ignores EOS."""
import json

import jsonschema
import pytest

from ninfer_mlc.chat_template import ChatTemplate
from ninfer_mlc.runtime.assemble import open_engine
from ninfer_mlc.paths import default_model_dir
from ninfer_mlc.runtime.config import EngineConfig
from ninfer_mlc.runtime.engine import GenRequest
from ninfer_mlc.runtime.errors import BadConstraint
from ninfer_mlc.runtime.sampling import SamplingParams
from ninfer_mlc.tool_calls import parse_tool_calls

ART = default_model_dir()
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ANSWER = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
CALL = {"type": "tool_call", "mode": "named", "name": "get_weather", "tools": TOOLS}
JSON = {"type": "json_schema", "schema": ANSWER}


def prompt(eng, text, tools=None):
    t = ChatTemplate.from_model_dir(str(ART)).render([{"role": "user", "content": text}], tools,
                                                      add_generation_prompt=True, enable_thinking=False)
    return eng.tok.encode(t, add_special_tokens=False).ids


def run(eng, reqs):
    """(text, finish reason) of each request, submitted together so they share batches."""
    hs = [eng.submit(r) for r in reqs]
    out = []
    for h in hs:
        text = "".join(ev.text for ev in h.iter_sync(timeout=300) if hasattr(ev, "text"))
        out.append((text, h.finished.reason))
    return out


def requests(eng):
    p = SamplingParams(temperature=0, max_tokens=120)
    return [GenRequest(prompt(eng, "Weather in Rome?", TOOLS), p, constraint=CALL),
            GenRequest(prompt(eng, "Tell me a story"), SamplingParams(temperature=0, max_tokens=24)),
            GenRequest(prompt(eng, "Is it ok?"), p, constraint=JSON)]


@pytest.fixture(scope="module")
def base_engine(server_engine):
    return server_engine  # the session's engine on the tiny model (tests/conftest.py)


@pytest.fixture(scope="module")
def batched(base_engine):
    return run(base_engine, requests(base_engine))


def check(outs):
    (call, r1), _, (answer, r3) = outs
    assert r1 == "stop" and r3 == "stop"
    res = parse_tool_calls(call, TOOLS)
    assert res.fallback_reason is None and [c.name for c in res.calls] == ["get_weather"]
    jsonschema.validate(res.calls[0].arguments, WEATHER)
    jsonschema.validate(json.loads(answer), ANSWER)


def test_constrained_rows_batch_with_free_rows(base_engine, batched):
    together = batched
    check(together)
    alone = run(base_engine, requests(base_engine)[1:2])
    assert together[1] == alone[0]  # the free request is untouched by its constrained neighbours


def test_speculative_engine_serves_constraints_without_drafts(batched):
    want = batched
    eng = open_engine(ART, EngineConfig(max_concurrency=4, max_context=1024, host_kv_mib=0, spec="mtp"))
    try:
        hs = [eng.submit(r) for r in requests(eng)]
        got = []
        for h in hs:
            got.append(("".join(ev.text for ev in h.iter_sync(timeout=300) if hasattr(ev, "text")),
                        h.finished.reason))
            if h is not hs[1]:
                assert h.finished.timings["draft_n"] == 0
        assert hs[1].finished.timings["draft_n"] > 0  # the free request still drafts
    finally:
        eng.stop()
    assert got == want
    check(got)


def test_completed_grammar_ends_a_request_that_ignores_eos(base_engine):
    p = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    [(text, reason)] = run(base_engine, [GenRequest(prompt(base_engine, "ok?"), p, constraint=JSON)])
    assert reason == "stop"
    jsonschema.validate(json.loads(text), ANSWER)


def test_bad_constraint_is_refused_at_submit(base_engine):
    with pytest.raises(BadConstraint) as ei:
        base_engine.submit(GenRequest(prompt(base_engine, "x"), SamplingParams(max_tokens=4),
                                      constraint={"type": "json_schema", "schema": {"type": "strng"}}))
    assert "strng" in str(ei.value)
