"""The real server over raw HTTP (httpx): framing, errors, auth/CORS, disconnects, queue limits,
robustness against junk, and `ninfer serve` as a subprocess."""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parent.parent
HI = [{"role": "user", "content": "Say hi."}]
LONG = {"max_tokens": 900, "ignore_eos": True, "temperature": 0}  # runs for a few seconds on the tiny model


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def wait_idle(engine, timeout=10.0):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        s = engine.stats()
        if s.scheduler.running == 0 and s.scheduler.waiting == 0:
            return s
        time.sleep(0.02)
    raise AssertionError(f"engine still busy: {engine.stats().scheduler}")


def sse_events(raw: bytes):
    text = raw.decode()
    assert text.endswith("\n\n")
    return [e for e in text.split("\n\n") if e]


# ---- framing ------------------------------------------------------------------------------
def test_openai_sse_framing(http):
    r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 5, "stream": True},
                  headers={"x-request-id": "my-req-42"})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-request-id"] == "my-req-42"
    events = sse_events(r.content)
    assert events[-1] == "data: [DONE]"
    ids = set()
    for e in events[:-1]:
        assert e.startswith("data: ") and "\n" not in e
        obj = json.loads(e[6:])
        assert obj["object"] == "chat.completion.chunk"
        ids.add(obj["id"])
    assert len(ids) == 1
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["finish_reason"] in ("stop", "length") and "timings" in last


def test_anthropic_sse_framing(http):
    r = http.post("/v1/messages?beta=true", json={"model": "m", "messages": HI, "max_tokens": 5, "stream": True})
    assert r.status_code == 200 and r.headers["request-id"]
    names = []
    for e in sse_events(r.content):
        lines = e.split("\n")
        assert len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: ")
        assert json.loads(lines[1][6:])["type"] == lines[0][7:]
        names.append(lines[0][7:])
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]


# ---- errors -------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [b"{not json", b"", b"[1, 2]", b"\xff\xfe"])
def test_malformed_json(http, body):
    r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json" and err["message"]
    r = http.post("/v1/messages", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_unknown_route_and_method(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]
    r = http.options("/v1/chat/completions")  # no --cors here: answered, not crashed
    assert r.status_code == 405


def test_chunked_body_over_limit(http):
    def gen():
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"x" * 65536
        yield b'"}]}'

    r = http.post("/v1/chat/completions", content=gen(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = http.post("/v1/messages", content=b"x" * (2 << 20))
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


_FIELDS = ["messages", "tools", "tool_choice", "temperature", "top_p", "top_k", "min_p", "stop", "logit_bias",
           "logprobs", "top_logprobs", "seed", "n", "stream", "stream_options", "chat_template_kwargs",
           "reasoning_effort", "user", "presence_penalty", "repetition_penalty", "response_format", "model",
           "system", "thinking", "stop_sequences", "metadata", "prompt", "echo", "tool_choice"]
_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=True) | st.text(max_size=5),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=5), kids, max_size=3),
                     max_leaves=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(junk=st.dictionaries(st.sampled_from(_FIELDS), _json, max_size=4),
       route=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens"]))
def test_junk_never_breaks_the_server(http, junk, route):
    base = {"messages": HI, "prompt": "hi", "model": "m" if "messages" in route else None}
    body = {**{k: v for k, v in base.items() if v is not None}, **junk, "max_tokens": 2}
    r = http.post(route, content=json.dumps(body, allow_nan=True), headers={"content-type": "application/json"})
    assert r.status_code in (200, 400, 404), (r.status_code, r.text)
    if r.status_code != 200:
        j = r.json()
        assert ("error" in j) and (j.get("type") == "error") == route.startswith("/v1/messages")


def test_template_kwargs_cannot_clobber_render_arguments(http):
    kw = {"self": 1, "messages": [], "tools": "x", "add_generation_prompt": False, "template_name": "nope",
          "not an identifier": 1, "custom_flag": True}
    r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, "chat_template_kwargs": kw})
    assert r.status_code == 200, r.text


def test_still_serving_after_junk(http, server):
    r = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 3})
    assert r.status_code == 200
    wait_idle(server.state.engine)


def test_kept_alive_answers_are_not_held_by_nagle(http):
    """An answer goes out in pieces (headers, then body; each SSE event). Without TCP_NODELAY on the
    accepted connection (a listening socket made with proto 0 does not get it from asyncio), Nagle holds
    the second piece until the client's delayed ACK, 40 ms on Linux, on every request of a kept-alive
    connection: found by the fuzz test, whose requests took 45 ms each for a /health."""
    took = []
    for _ in range(15):
        t0 = time.perf_counter()
        assert http.get("/health").status_code == 200
        took.append(time.perf_counter() - t0)
    assert sorted(took)[len(took) // 2] < 0.025, [f"{t * 1000:.1f} ms" for t in took]


# ---- auth and CORS ------------------------------------------------------------------------
def test_auth_and_cors(secured_server):
    with httpx.Client(base_url=secured_server.url, timeout=30) as c:
        assert c.get("/health").json() == {"status": "ok"}
        r = c.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = c.post("/v1/messages", json={"model": "m", "messages": HI, "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert c.get("/v1/models", headers={"Authorization": "Bearer sekret"}).status_code == 200
        assert c.get("/v1/models", headers={"x-api-key": "sekret"}).status_code == 200
        assert c.get("/v1/models", headers={"x-api-key": "nope"}).status_code == 401
        pre = c.options("/v1/chat/completions", headers={
            "Origin": "http://example.com", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] in ("*", "http://example.com")
        assert "POST" in pre.headers["access-control-allow-methods"]
        r = c.get("/v1/models", headers={"Origin": "http://example.com", "x-api-key": "sekret"})
        assert r.headers["access-control-allow-origin"] in ("*", "http://example.com")


# ---- disconnects --------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_the_request(server):
    eng = server.state.engine
    wait_idle(eng)
    before = eng.stats().counters.requests_cancelled
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json={"messages": HI, "stream": True, **LONG}) as r:
            it = r.iter_lines()
            got = [next(it) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert eng.stats().scheduler.running == 1
    snap = wait_idle(eng)
    assert snap.counters.requests_cancelled == before + 1


def test_disconnect_anthropic_stream_and_nonstream(server):
    eng = server.state.engine
    wait_idle(eng)
    before = eng.stats().counters.requests_cancelled
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/messages", json={"model": "m", "messages": HI, "stream": True, **LONG}) as r:
            next(r.iter_lines())
    wait_idle(eng)
    with httpx.Client(base_url=server.url, timeout=0.5) as c:  # the client gives up on a long answer
        with pytest.raises(httpx.ReadTimeout):
            c.post("/v1/chat/completions", json={"messages": HI, **LONG})
    snap = wait_idle(eng)
    assert snap.counters.requests_cancelled == before + 2


# ---- queue limits (their own engine: 1 lane, 1 queue place, 1.5 s queue deadline) ------------
@pytest.fixture(scope="module")
def tight_server():
    from conftest import start_test_server  # noqa: PLC0415  (tests/ is on sys.path under pytest)

    from ninfer_mlc.runtime.assemble import open_engine
    from ninfer_mlc.paths import default_model_dir
    from ninfer_mlc.runtime.config import EngineConfig

    eng = open_engine(default_model_dir(), EngineConfig(max_concurrency=1, max_pending_requests=1, pending_timeout_ms=1500,
                                                         max_context=8192, host_kv_mib=16))
    srv, state = start_test_server(eng, "--max-concurrency", "1", "--max-pending-requests", "1",
                                   "--pending-timeout-ms", "1500")
    srv.state = state
    yield srv
    srv.stop()
    eng.stop()


def test_queue_full_429_and_timeout_503(tight_server):
    eng = tight_server.state.engine
    hold = {"messages": HI, "stream": True, "max_tokens": 5000, "ignore_eos": True}
    results = {}
    with httpx.Client(base_url=tight_server.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=hold) as active:
            lines = active.iter_lines()  # keep a reference: dropping the iterator closes the response
            next(lines)  # admitted and generating

            def queued():
                with httpx.Client(base_url=tight_server.url, timeout=30) as c2:
                    results["b"] = c2.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})

            t = threading.Thread(target=queued)
            t.start()
            t_end = time.monotonic() + 5
            while eng.stats().scheduler.waiting != 1 and time.monotonic() < t_end:
                time.sleep(0.01)
            r = c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["code"] == "server_overloaded"
            r = c.post("/v1/messages", json={"model": "m", "messages": HI, "max_tokens": 2})
            assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
            t.join(10)
            b = results["b"]
            assert b.status_code == 503 and b.json()["error"]["code"] == "request_queue_timeout"
    wait_idle(eng)
    with httpx.Client(base_url=tight_server.url, timeout=30) as c:
        assert c.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2}).status_code == 200


# ---- `ninfer serve` as a process ------------------------------------------------------------
def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_ninfer_serve_process(tmp_path):
    port, stats_port = _free_ports(2)
    log = tmp_path / "requests.jsonl"
    cmd = [sys.executable, "-m", "ninfer_mlc.cli", "serve", "--port", str(port), "--stats-port", str(stats_port),
           "--api-key", "k", "--max-context", "512", "--max-concurrency", "2", "--log-level", "warning",
           "--request-log-jsonl", str(log), "--host-kv-mib", "16"]
    env = {**os.environ, "TVM_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        t_end = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < t_end, "server did not come up"
            time.sleep(0.2)
        h = {"x-api-key": "k"}
        models = httpx.get(url + "/v1/models", headers=h).json()["data"]
        assert models[0]["id"] == "qwen3x-tiny" and models[0]["max_model_len"] == 512
        r = httpx.post(url + "/v1/chat/completions", headers=h, json={"messages": HI, "max_tokens": 3}, timeout=30)
        assert r.status_code == 200
        stats = httpx.get(f"http://127.0.0.1:{stats_port}/stats").json()
        assert stats["counters"]["requests_finished"] >= 1 and "scheduler" in stats
        assert httpx.get(f"http://127.0.0.1:{stats_port}/health").json() == {"status": "ok"}
        assert httpx.get(url + "/stats").status_code == 200  # open even with --api-key
        rec = json.loads(log.read_text().splitlines()[-1])
        assert rec["api"] == "openai.chat" and 1 <= rec["completion_tokens"] <= 3 and rec["finish_reason"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0
