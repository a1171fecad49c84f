"""Monitoring routes: GET /stats (JSON), GET /metrics (Prometheus), GET /monitor (dashboard), and the
`--stats-port` listener that serves them (plus /health) without authentication.

`get_engine` is called on every request, so the engine may be swapped or not loaded yet (then the
routes answer 503). The engine part of /stats is one snapshot its own thread takes between steps
(Engine.stats()); routes are sync endpoints, so waiting for it never blocks the event loop.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, Response

from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import prometheus_text
from .stats import build_stats

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
MONITOR_HTML = STATIC_DIR / "monitor.html"
MONITOR_PATHS = frozenset({"/health", "/stats", "/metrics", "/monitor"})
_NO_STORE = {"Cache-Control": "no-store"}
_UNAVAILABLE = {"status": "unavailable", "error": "the engine is not loaded"}


def monitor_html() -> str:
    return MONITOR_HTML.read_text(encoding="utf-8")


def register_monitoring_routes(app: FastAPI, get_engine: Callable[[], Any], http_counters: Any = None,
                               model_id: Optional[str] = None) -> None:
    """Add GET /stats, /metrics and /monitor to `app`."""
    html_cache: dict = {}

    def current() -> Optional[dict]:
        eng = get_engine()
        return None if eng is None else build_stats(eng, http_counters, model_id=model_id)

    @app.get("/stats")
    def ninfer_stats():
        doc = current()
        if doc is None:
            return JSONResponse(_UNAVAILABLE, status_code=503, headers=_NO_STORE)
        return JSONResponse(doc, headers=_NO_STORE)

    @app.get("/metrics")
    def ninfer_metrics():
        doc = current()
        if doc is None:
            return Response("# the engine is not loaded\n", status_code=503, media_type=METRICS_CONTENT_TYPE)
        return Response(prometheus_text(doc), media_type=METRICS_CONTENT_TYPE, headers=_NO_STORE)

    @app.get("/monitor")
    async def ninfer_monitor():
        if "html" not in html_cache:
            html_cache["html"] = monitor_html()
        return HTMLResponse(html_cache["html"], headers={"Cache-Control": "no-cache"})


def make_stats_app(get_engine: Callable[[], Any], http_counters: Any = None,
                   model_id: Optional[str] = None) -> FastAPI:
    """The `--stats-port` listener: /health, /stats, /metrics and /monitor, never authenticated."""
    app = FastAPI(title="ninfer-mlc stats", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health", include_in_schema=False)
    def ninfer_health():
        eng = get_engine()
        if eng is None or not eng.running:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    register_monitoring_routes(app, get_engine, http_counters, model_id)
    return app
