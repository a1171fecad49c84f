"""Monitoring routes: GET /stats (JSON), GET /metrics (Prometheus), GET /monitor (dashboard).

    from ninfer_mlc.server.monitor import register_monitoring_routes, make_stats_app, MONITOR_PATHS
    register_monitoring_routes(app, lambda: state.engine, http_counters, model_id)
    stats_app = make_stats_app(lambda: state.engine, http_counters, model_id)   # --stats-port

The routes are meant to stay open when `--api-key` is set (like /health): the auth guard
should let every path in `MONITOR_PATHS` through. `get_engine` is called on every request,
so the engine may be swapped or not loaded yet (then /stats and /metrics answer 503).
Stats are built in the threadpool (sync endpoints), never on the event loop.
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


def _resolve(get_engine: Any):
    if get_engine is None:
        return None
    if callable(get_engine) and not hasattr(get_engine, "snapshot"):
        return get_engine()
    return get_engine


def monitor_html() -> str:
    return MONITOR_HTML.read_text(encoding="utf-8")


def register_monitoring_routes(app: FastAPI, get_engine: Callable[[], Any], http_counters: Any = None,
                               model_id: Optional[str] = None, *, stats: bool = True, metrics: bool = True,
                               monitor: bool = True) -> None:
    """Add GET /stats, /metrics and /monitor to `app` (each can be left out)."""
    html_cache: dict = {}

    def current() -> Optional[dict]:
        eng = _resolve(get_engine)
        if eng is None:
            return None
        return build_stats(eng, http_counters, model_id=model_id)

    if stats:
        @app.get("/stats", include_in_schema=False)
        def ninfer_stats():
            doc = current()
            if doc is None:
                return JSONResponse({"status": "unavailable", "error": "the engine is not loaded"}, status_code=503,
                                    headers=_NO_STORE)
            return JSONResponse(doc, headers=_NO_STORE)

    if metrics:
        @app.get("/metrics", include_in_schema=False)
        def ninfer_metrics():
            doc = current()
            if doc is None:
                return Response("# the engine is not loaded\n", status_code=503, media_type=METRICS_CONTENT_TYPE)
            return Response(prometheus_text(doc), media_type=METRICS_CONTENT_TYPE, headers=_NO_STORE)

    if monitor:
        @app.get("/monitor", include_in_schema=False)
        async def ninfer_monitor():
            if "html" not in html_cache:
                html_cache["html"] = monitor_html()
            return HTMLResponse(html_cache["html"], headers={"Cache-Control": "no-cache"})


def make_stats_app(get_engine: Callable[[], Any], http_counters: Any = None, model_id: Optional[str] = None,
                   *, monitor: bool = True) -> FastAPI:
    """The `--stats-port` listener: /health, /stats, /metrics (and /monitor), never authenticated."""
    app = FastAPI(title="ninfer-mlc stats", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health", include_in_schema=False)
    def ninfer_health():
        eng = _resolve(get_engine)
        if eng is None or not getattr(eng, "_running", True):
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    register_monitoring_routes(app, get_engine, http_counters, model_id, monitor=monitor)
    return app
