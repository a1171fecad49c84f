"""The /monitor dashboard in a real browser: headless Chromium against uvicorn on loopback.

Skipped when Chromium is not installed (`apt-get install chromium`). The page must fill in the
live values from /stats (checked on the DOM after its scripts ran) and render a non-blank
screenshot of the requested size (checked by decoding the PNG here, in pure Python + numpy).
"""
from __future__ import annotations

import asyncio
import html as htmllib
import json
import os
import re
import shutil
import socket
import struct
import subprocess
import threading
import time
import urllib.request
import zlib

import numpy as np
import pytest
from fastapi import FastAPI

from ninfer_mlc.runtime.assemble import open_engine
from ninfer_mlc.paths import default_model_dir
from ninfer_mlc.runtime.config import EngineConfig
from ninfer_mlc.runtime.engine import Finished, GenRequest
from ninfer_mlc.runtime.sampling import SamplingParams
from ninfer_mlc.server.monitor import register_monitoring_routes
from ninfer_mlc.server.stats import HttpCounters

ART = default_model_dir()
W, H = 1280, 900


def _chromium() -> str | None:
    for c in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser"),
              shutil.which("google-chrome")):
        if c and os.path.exists(c):
            return c
    return None


CHROMIUM = _chromium()
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install -y chromium)")


class _Server:
    """uvicorn on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, app):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True)

    def __enter__(self):
        self.thread.start()
        t_end = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < t_end, "uvicorn did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    opts = EngineConfig(max_concurrency=2, max_context=1024, prefill_chunk=128, device_state_slots=1, host_kv_mib=8,
                         host_state_slots=2, host_ram_reserve_mib=0)
    opts.kv_capacity = 1024
    eng = open_engine(ART, opts, meminfo_reader=lambda: 64 * 2**30)
    http = HttpCounters()
    try:
        for i in range(5):  # more than the device holds: some entries are demoted to the host tier
            ids = [5 + (i * 131 + j * 7) % 1900 for j in range(150 + 40 * i)]
            with http:
                h = eng.submit(GenRequest(ids, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)))
                fin = list(h.iter_sync(timeout=120))[-1]
            assert isinstance(fin, Finished)
            if i == 0:
                first = ids
            http.record_request(f"chatcmpl-monitor-{i}", fin.timings, finish_reason=fin.reason, api="openai.chat",
                                usage=fin.usage)
        # a follow-up that continues request 0 from its cached frontier: one prefix-cache hit
        (front,) = [e for e in eng.kv.cache.entries.values() if e.tokens[:150].tolist() == first]
        h = eng.submit(GenRequest(front.tokens.tolist() + [7, 8, 9], SamplingParams(temperature=0, max_tokens=4)))
        assert list(h.iter_sync(timeout=120))[-1].usage["cached_tokens"] == front.length
        app = FastAPI()
        register_monitoring_routes(app, lambda: eng, http, "tiny-monitor")
        with _Server(app) as srv:
            yield f"http://127.0.0.1:{srv.port}", tmp_path_factory.mktemp("chromium")
    finally:
        eng.stop()


def _chrome(url: str, tmp, *extra: str) -> subprocess.CompletedProcess:
    profile = tmp / f"profile-{time.monotonic_ns()}"
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=4000",
           f"--window-size={W},{H}", "--hide-scrollbars", *extra, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _stats(base: str) -> dict:
    with urllib.request.urlopen(base + "/stats", timeout=10) as r:
        return json.loads(r.read())


def _text_of(dom: str, el_id: str) -> str:
    m = re.search(rf'id="{re.escape(el_id)}"[^>]*>([^<]*)<', dom)
    assert m, f"no element #{el_id} in the dumped DOM"
    return htmllib.unescape(m.group(1)).strip()


def test_dashboard_fills_live_values(site):
    base, tmp = site
    s = _stats(base)  # the engine is idle: these numbers do not move while the page loads
    p, c = s["pressure"], s["counters"]
    assert p["device_kv_occupied_pages"] > 0 and p["host_kv_occupied_bytes"] > 0
    res = _chrome(base + "/monitor", tmp, "--dump-dom")
    dom = res.stdout
    assert res.returncode == 0 and "<canvas" in dom, res.stderr[-2000:]
    num = lambda el: int(_text_of(dom, el).replace(",", ""))  # noqa: E731
    assert num("kv-pages") == p["device_kv_occupied_pages"]
    assert num("kv-pages-total") == p["device_kv_pages_total"]
    assert num("state-slots") == p["device_state_occupied_slots"]
    assert num("state-slots-total") == p["device_state_slots_total"]
    assert num("prefill-total") == c["computed_prefill_tokens"]
    assert num("decode-total") == c["committed_decode_tokens"]
    assert num("req-total") == c["requests_total"] == 6
    assert num("frontier-hits") == s["cache_reuse"]["frontier_hits"] == 1
    assert num("reused-tokens") == s["cache_reuse"]["reused_prompt_tokens"] > 150
    assert num("kv-d2h-pages") == s["kv_transfers"]["kv_d2h_pages"] > 0
    assert num("st-d2h-count") == s["state_transfers"]["state_d2h_count"]
    assert num("demoted") == p["private_owners_demoted"]
    assert num("lookups") == s["cache_reuse"]["lookups"]
    assert num("host-slots") == p["host_state_occupied_slots"]
    assert _text_of(dom, "model-id") == "tiny-monitor"
    assert _text_of(dom, "arch") == s["load"]["architecture"]
    assert _text_of(dom, "status") == "live"
    assert _text_of(dom, "pinned-frag").endswith("%")
    assert "chatcmpl-monitor-4" in dom and "chatcmpl-monitor-0" in dom  # recent requests table
    # bars are sized from the numbers
    bar = re.search(r'id="kv-bar" style="width: ([0-9.]+)%', dom)
    assert bar and abs(float(bar.group(1)) - 100 * p["device_kv_occupied_pages"] / p["device_kv_pages_total"]) < 0.2


# ---- PNG ---------------------------------------------------------------------------------------
def decode_png(data: bytes) -> np.ndarray:
    """8-bit RGB/RGBA/grey non-interlaced PNG -> uint8 array [H, W, C]."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, ihdr = 8, [], None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert zlib.crc32(kind + body) & 0xFFFFFFFF == crc, f"bad CRC in {kind!r}"
        if kind == b"IHDR":
            ihdr = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat.append(body)
        elif kind == b"IEND":
            break
        pos += 12 + n
    w, h, depth, ctype, _, _, interlace = ihdr
    assert depth == 8 and interlace == 0 and ctype in (0, 2, 4, 6), ihdr
    bpp = {0: 1, 2: 3, 4: 2, 6: 4}[ctype]
    raw = zlib.decompress(b"".join(idat))
    stride = w * bpp
    assert len(raw) == h * (stride + 1)
    out = np.zeros((h, stride), np.uint8)
    prior = np.zeros(stride, np.int32)
    for y in range(h):
        f = raw[y * (stride + 1)]
        line = np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int32)
        if f == 0:
            cur = line
        elif f == 1:  # Sub: a running sum per channel
            cur = np.empty(stride, np.int32)
            for c in range(bpp):
                cur[c::bpp] = np.cumsum(line[c::bpp]) & 0xFF
        elif f == 2:  # Up
            cur = (line + prior) & 0xFF
        else:  # Average / Paeth depend on the reconstructed left neighbour: byte by byte
            cur_l = [0] * stride
            lv, pv = line.tolist(), prior.tolist()
            for i in range(stride):
                a = cur_l[i - bpp] if i >= bpp else 0
                b = pv[i]
                if f == 3:
                    pred = (a + b) >> 1
                else:
                    cc = pv[i - bpp] if i >= bpp else 0
                    pa, pb, pc = abs(b - cc), abs(a - cc), abs(a + b - 2 * cc)
                    pred = a if pa <= pb and pa <= pc else (b if pb <= pc else cc)
                cur_l[i] = (lv[i] + pred) & 0xFF
            cur = np.asarray(cur_l, np.int32)
        out[y] = cur
        prior = cur
    return out.reshape(h, w, bpp)


def test_screenshot(site):
    base, tmp = site
    png = tmp / "monitor.png"
    res = _chrome(base + "/monitor", tmp, f"--screenshot={png}")
    assert res.returncode == 0 and png.exists(), res.stderr[-2000:]
    img = decode_png(png.read_bytes())
    assert img.shape[:2] == (H, W)
    rgb = img[..., :3].reshape(-1, 3)
    packed = (rgb[:, 0].astype(np.int64) << 16) | (rgb[:, 1].astype(np.int64) << 8) | rgb[:, 2]
    colours, counts = np.unique(packed, return_counts=True)
    assert len(colours) > 200, f"only {len(colours)} colours: blank page?"
    assert counts.max() / packed.size < 0.9, "one colour covers 90% of the page"
    # the dark theme rendered (background #0d1117 is the commonest colour) ...
    assert colours[counts.argmax()] in (0x0D1117, 0x161B22)
    # ... and the device-KV bar (#58a6ff, sized from /stats) and slot bar (#3fb950) are drawn
    assert counts[colours == 0x58A6FF].sum() > 300
    assert counts[colours == 0x3FB950].sum() > 300
