"""Images through the real server: the official openai and anthropic SDKs, a loopback HTTP image host,
limits (clear 400s), prefix reuse keyed by image content, /stats.

One tiny VLM (tests/hf_tiny_vlm.py make_servable_vlm_dir) compiled for llvm; the vision tower runs on
the CPU (the --vision-cpu path: embeddings computed before the request queues).
"""
from __future__ import annotations

import base64
import http.server
import io
import threading

import anthropic
import openai
import pytest

pytest.importorskip("torch")

from conftest import start_test_server  # noqa: E402
from hf_tiny_vlm import make_image, make_servable_vlm_dir  # noqa: E402

from ninfer_mlc.compile.build import compile_model  # noqa: E402
from ninfer_mlc.runtime.assemble import open_engine  # noqa: E402
from ninfer_mlc.runtime.config import EngineConfig  # noqa: E402


def png(w: int, h: int, seed: int) -> bytes:
    buf = io.BytesIO()
    make_image(w, h, seed).save(buf, "PNG")
    return buf.getvalue()


def data_url(b: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(b).decode()


class _Images(http.server.BaseHTTPRequestHandler):
    files: dict = {}

    def do_GET(self):  # noqa: N802
        body = self.files.get(self.path)
        if body is None:
            self.send_error(404)
            return
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the server stopped reading past its byte limit
            pass

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def image_host():
    _Images.files = {"/cat.png": png(40, 40, 21), "/big.png": b"\x89PNG" + b"0" * (3 << 20)}
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory):
    hf = make_servable_vlm_dir(tmp_path_factory.mktemp("hf_vlm_srv"))
    art = compile_model(hf, target="llvm", quant="f32", out_dir=tmp_path_factory.mktemp("art_vlm_srv"),
                        name="vlm-serve", log=lambda *_: None)
    eng = open_engine(art, EngineConfig(max_concurrency=2, max_context=1024, host_kv_mib=16, vision="cpu"))
    srv, state = start_test_server(eng, "--max-images-per-request", "3", "--max-image-mib", "2",
                                   "--max-image-pixels", "40000", "--max-request-image-pixels", "10000",
                                   "--image-fetch-timeout", "5", "--model-id", "vlm")
    srv.state = state
    yield srv
    srv.stop()
    eng.stop()


@pytest.fixture(scope="module")
def oai(vlm_server):
    return openai.OpenAI(base_url=vlm_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def claude(vlm_server):
    return anthropic.Anthropic(base_url=vlm_server.url, api_key="unused", max_retries=0, timeout=60)


def _user(text, *urls):
    return {"role": "user", "content": [{"type": "text", "text": text}]
            + [{"type": "image_url", "image_url": {"url": u}} for u in urls]}


def _chat(oai, messages, **kw):
    return oai.chat.completions.create(model="vlm", messages=messages, max_tokens=4, temperature=0, **kw)


def test_openai_data_url_and_http_url(oai, claude, image_host):
    cat = data_url(png(40, 40, 21))
    a = _chat(oai, [_user("What is this?", cat)])
    assert a.choices[0].finish_reason in ("stop", "length")
    # 40x40 -> 40x40 pixels, 10x10 patches, 25 merged tokens: the prompt grew by 24 placeholders
    # (same route: a Messages request without `thinking` renders the closed think block, chat does not)
    text_only = _chat(oai, [_user("What is this?")])
    assert a.usage.prompt_tokens == text_only.usage.prompt_tokens + 2 + 25
    b = _chat(oai, [_user("What is this?", image_host + "/cat.png")])
    assert b.usage.prompt_tokens == a.usage.prompt_tokens
    assert b.usage.prompt_tokens_details.cached_tokens >= a.usage.prompt_tokens - 8  # same pixels: reused


def test_openai_two_images_and_stream(oai):
    chunks = list(oai.chat.completions.create(
        model="vlm", messages=[_user("Compare", data_url(png(40, 40, 1)), data_url(png(32, 48, 2)))],
        max_tokens=3, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens > 50


def test_anthropic_base64_and_url(claude, image_host):
    img = base64.b64encode(png(40, 40, 21)).decode()
    blocks = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": img}},
              {"type": "text", "text": "Describe."}]
    total = lambda u: u.input_tokens + (u.cache_read_input_tokens or 0)  # noqa: E731
    m = claude.messages.create(model="vlm", max_tokens=4, messages=[{"role": "user", "content": blocks}])
    n = claude.messages.count_tokens(model="vlm", messages=[{"role": "user", "content": blocks}])
    assert total(m.usage) == n.input_tokens
    url = [{"type": "image", "source": {"type": "url", "url": image_host + "/cat.png"}},
           {"type": "text", "text": "Describe."}]
    m2 = claude.messages.create(model="vlm", max_tokens=4, messages=[{"role": "user", "content": url}])
    assert total(m2.usage) == total(m.usage) and m2.usage.cache_read_input_tokens > 25  # same pixels: reused


def test_prefix_cache_keys_on_image_content(oai):
    """Turn 2 with the same image reuses turn 1's checkpoint; the same conversation with a different
    image of equal size reuses nothing past the text before the image."""
    first = [_user("Look at this picture please", data_url(png(40, 40, 31)))]
    r1 = _chat(oai, first)
    answer = r1.choices[0].message.content or "ok"
    r2 = _chat(oai, first + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And now?"}])
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 8
    other = [_user("Look at this picture please", data_url(png(40, 40, 32)))]
    r3 = _chat(oai, other + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And now?"}])
    assert r3.usage.prompt_tokens == r2.usage.prompt_tokens
    assert r3.usage.prompt_tokens_details.cached_tokens < 12  # at most the text before the image


def test_limits_and_bad_images(oai, claude, image_host):
    small = data_url(png(16, 16, 5))
    cases = [
        ([_user("x", small, small, small, small)], "4 images"),
        ([_user("x", data_url(png(300, 300, 6)))], "90000 pixels"),
        ([_user("x", *(data_url(png(64, 64, k)) for k in range(3)))], "after resizing"),
        ([_user("x", "data:image/png;base64,!!!")], "base64"),
        ([_user("x", data_url(b"not an image"))], "cannot decode"),
        ([_user("x", image_host + "/missing.png")], "cannot fetch"),
        ([_user("x", image_host + "/big.png")], "limit"),
        ([_user("x", "ftp://example.com/a.png")], "data:, http"),
        ([{"role": "user", "content": "<|vision_start|><|image_pad|><|vision_end|>"}], None),
    ]
    for messages, needle in cases:
        with pytest.raises(openai.BadRequestError) as e:
            _chat(oai, messages)
        if needle:
            assert needle in str(e.value), (needle, str(e.value))
    bad = [{"type": "image", "source": {"type": "base64", "media_type": "text/plain", "data": "aGk="}}]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.create(model="vlm", max_tokens=4, messages=[{"role": "user", "content": bad}])


def test_stats_report_vision(vlm_server, oai):
    _chat(oai, [_user("stats", data_url(png(24, 40, 9)))])
    import httpx

    v = httpx.get(vlm_server.url + "/stats").json()["vision"]
    assert v["enabled"] and v["device"] == "cpu" and v["weights_bytes"] > 0
    assert v["images_encoded"] >= 1 and v["encode_seconds_total"] > 0 and v["requests_with_images"] >= 1
    metrics = httpx.get(vlm_server.url + "/metrics").text
    assert "vision_images_encoded" in metrics


def test_text_only_server_refuses_images(server):
    c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=server.state.config.model_id, max_tokens=2,
                                  messages=[_user("x", data_url(png(16, 16, 1)))])
    assert "does not take images" in str(e.value)
