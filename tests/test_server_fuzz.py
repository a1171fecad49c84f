"""Schema-driven fuzzing of every route: schemathesis generates requests from the server's own
/openapi.json (request bodies of server/openapi_doc.py), valid ones and schema-violating ones, and sends
them to the real server on loopback. No answer may be a 5xx (or a stream that fails), every 4xx body is
JSON in the route's error shape, and afterwards the server still serves, its KV audit is clean and it
counted no 5xx. Bounded: at most 8 generated tokens per request, a fixed number of examples per route,
derandomized (the same requests on every run)."""
from __future__ import annotations

import json
import os
import time

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import response_schema_conformance

from conftest import start_test_server

MAX_TOKENS = 8  # per generated request: the fuzzer tests parsing and answering, not long generation
TOKEN_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
# examples per route and generation mode: bodies that break the schema are cheap (a 400 before any token) and
# find the parsing bugs, so they get more; NINFER_FUZZ_SCALE=N runs N times as many (a longer local hunt)
SCALE = int(os.environ.get("NINFER_FUZZ_SCALE", "1"))
EXAMPLES = {("POST", "positive"): 30, ("POST", "negative"): 60, "GET": 12, "DELETE": 12, "HEAD": 4}
OPENAI_MODEL_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
ROUTES = [  # every operation of /openapi.json (test_every_route_is_fuzzed keeps this list complete)
    ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("POST", "/v1/messages"),
    ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses"), ("POST", "/v1/responses/input_tokens"),
    ("GET", "/v1/responses/{rid}"), ("GET", "/v1/responses/{rid}/input_items"), ("DELETE", "/v1/responses/{rid}"),
    ("GET", "/v1/models"), ("GET", "/v1/models/{model_id}"), ("GET", "/health"), ("GET", "/stats"),
    ("GET", "/metrics"), ("GET", "/monitor"), ("GET", "/api/hello"), ("HEAD", "/api/hello"),
]
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def fuzz_srv(server_engine):
    """A server of its own (its HTTP counters count only the fuzzer's requests) on the shared engine, whose
    default token budget (for a request that names none) is MAX_TOKENS meanwhile; it holds a stored
    response for the {rid} routes to find."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server_engine.cfg, "default_max_tokens", MAX_TOKENS)
        s, state = start_test_server(server_engine)
        s.state = state
        with httpx.Client(base_url=s.url, timeout=60) as c:
            r = c.post("/v1/responses", json={"model": state.config.model_id, "max_output_tokens": 2, "input": [
                {"role": "user", "content": "a"}, {"role": "user", "content": "b"}]})
            assert r.status_code == 200, r.text
            s.stored_id = r.json()["id"]
        yield s
        s.stop()


def bounded(node):
    """The document as the fuzzer generates from it: objects with documented keys take only those, other
    objects at most 2 keys, arrays at most 3 items. Open objects make hypothesis draw deep random JSON for
    every undeclared key (~0.5 s an example); unknown keys still come from the negative mode."""
    if isinstance(node, dict):
        types = node.get("type") if isinstance(node.get("type"), list) else [node.get("type")]
        if "object" in types:
            if "properties" in node:
                node.setdefault("additionalProperties", False)
            else:
                node.setdefault("maxProperties", 2)
        if "array" in types:
            node.setdefault("maxItems", 3)
        for v in node.values():
            bounded(v)
    elif isinstance(node, list):
        for v in node:
            bounded(v)
    return node


@pytest.fixture(scope="module")
def api(fuzz_srv):
    with httpx.Client(base_url=fuzz_srv.url, timeout=30) as c:
        doc = bounded(c.get("/openapi.json").json())
    # whole streams: the check reads them to their end (schemathesis stops after 20 events by default)
    return schemathesis.openapi.from_dict(doc, config=schemathesis.Config.from_dict({"max-stream-events": 10_000}))


def steered(case_and_name_it, model_id: str):
    """Every token budget at most MAX_TOKENS (an absent one means the engine default, MAX_TOKENS too), and
    on the OpenAI routes, which serve one model id, three cases in four name it: a random name is a 404
    before anything else is read."""
    case, name_it = case_and_name_it
    if isinstance(case.body, dict):
        for k in TOKEN_FIELDS:
            v = case.body.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v > MAX_TOKENS:
                case.body[k] = MAX_TOKENS
        if case.operation.path.startswith(OPENAI_MODEL_ROUTES) and name_it and isinstance(case.body.get("model"), str):
            case.body["model"] = model_id
    return case


def cases(api, fuzz_srv, method: str, path: str, mode: GenerationMode):
    op = api[path][method]
    strategy = op.as_strategy(generation_mode=mode)
    real = {"rid": fuzz_srv.stored_id, "model_id": fuzz_srv.state.config.model_id}
    names = [k for k in real if "{%s}" % k in path]
    if names:  # half of them name an object that exists
        strategy = st.one_of(strategy, op.as_strategy(generation_mode=mode,
                                                      path_parameters={k: real[k] for k in names}))
    model_id = fuzz_srv.state.config.model_id
    return st.tuples(strategy, st.sampled_from([True, True, True, False])).map(lambda cn: steered(cn, model_id))


def check_error_shape(path: str, status: int, raw: bytes) -> None:
    """The route's error shape: OpenAI {"error": {message, type, param, code}}, Anthropic
    {"type": "error", "error": {type, message}} on /v1/messages*."""
    body = json.loads(raw)
    if path.startswith("/v1/messages"):
        assert body.get("type") == "error", body
        err = body["error"]
        assert isinstance(err.get("type"), str) and isinstance(err.get("message"), str), body
    else:
        err = body["error"]
        assert {"message", "type", "param", "code"} <= set(err), body
        assert isinstance(err["message"], str) and isinstance(err["type"], str), body
        assert err["param"] is None or isinstance(err["param"], str), body
        assert err["code"] is None or isinstance(err["code"], str), body
    assert err["message"], body


def check_stream(path: str, raw: bytes) -> None:
    """A 200 stream: every event is JSON and none reports a failed generation."""
    for line in raw.decode("utf-8").splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        assert ev.get("type") not in ("error", "response.failed") and not ev.get("error"), ev


def check_answer(case, resp) -> None:
    path, status = case.operation.path, resp.status_code
    what = f"{case.method} {case.formatted_path} {json.dumps(case.body, default=str)[:2000]} -> {status} " \
           f"{resp.content[:1000]!r}"
    assert status < 500, what
    if case.method == "HEAD":
        return
    ctype = resp.headers.get("content-type", [""])[0]
    assert not resp.stream_cut_short, what
    if status >= 400:
        assert ctype.startswith("application/json"), what
        try:
            check_error_shape(path, status, resp.content)
        except (AssertionError, KeyError, TypeError, ValueError) as e:
            raise AssertionError(f"bad error shape ({e!r}): {what}") from None
    elif ctype.startswith("text/event-stream"):
        check_stream(path, resp.content)
    elif ctype.startswith("application/json"):
        json.loads(resp.content)


def idle_audit(engine, timeout: float = 30.0) -> list[str]:
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        sch = engine.stats().scheduler
        if not sch.running and not sch.waiting:
            break
        time.sleep(0.02)
    else:
        return [f"engine not idle after {timeout}s: {engine.stats().scheduler}"]
    return engine.audit()


def test_every_route_is_fuzzed(api):
    ops = {(op.ok().method.upper(), op.ok().path) for op in api.get_all_operations()}
    assert ops == set(ROUTES)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda m: m.value)
@pytest.mark.parametrize("method,path", ROUTES, ids=[f"{m} {p}" for m, p in ROUTES])
def test_fuzz_route(api, fuzz_srv, method, path, mode):
    op = api[path][method]
    if mode is GenerationMode.NEGATIVE and not (op.body or op.query):
        pytest.skip("nothing to violate: no body, no query, any string is a path parameter")
    session = requests.Session()  # keep-alive: one answer must not break the next one's connection
    n = EXAMPLES.get((method, mode.value), EXAMPLES.get(method))

    @settings(max_examples=n * SCALE, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases(api, fuzz_srv, method, path, mode))
    def fuzz(case):
        resp = case.call(base_url=fuzz_srv.url, session=session, timeout=60)
        check_answer(case, resp)
        if resp.status_code >= 400:  # the documented error schema matches what was answered
            case.validate_response(resp, checks=[response_schema_conformance])

    try:
        fuzz()
    finally:
        session.close()


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": [], "text": "x"}]}]},
     "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ("/v1/responses", {"input": [{"role": "user", "content": [{"type": {}, "text": "x"}]}]}, "input[0].content[0].type"),
    ("/v1/responses", {"input": "x", "reasoning": {"effort": ["high"]}}, "reasoning.effort"),
    ("/v1/responses", {"input": "x", "reasoning": {"summary": {}}}, "reasoning.summary"),
])
def test_a_field_holding_an_array_or_object_where_a_name_goes_is_a_400(fuzz_srv, path, body, param):
    """Found by the fuzzer: such a value reached a set lookup (TypeError: unhashable type), a 500."""
    with httpx.Client(base_url=fuzz_srv.url, timeout=30) as c:
        r = c.post(path, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_server_serves_after_fuzzing(fuzz_srv):
    with httpx.Client(base_url=fuzz_srv.url, timeout=60) as c:
        assert c.get("/health").json() == {"status": "ok"}
        r = c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 3})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("stop", "length"), r.text
        http = c.get("/stats").json()["http"]
    assert http["responses_5xx"] == 0, http
    assert idle_audit(fuzz_srv.state.engine) == []
