"""The HTTP server: app factory, ASGI guard (auth, body limit), error handlers, ``ninfer serve``.

``create_app(state)`` builds the FastAPI app around a ``ServerState`` (engine + template +
settings) so tests and embedders can run it on any engine; ``run_server(args)`` turns the
``ninfer serve`` flags into that state (every bad flag is a one-line error naming it), loads
the engine and runs uvicorn, plus the optional ``--stats-port`` listener.
"""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from . import anthropic_api, openai_api, responses_api
from .errors import APIError, error_response, send_error
from .state import ServerConfig, ServerState

log = logging.getLogger("ninfer.server")

try:  # /stats, /metrics, /monitor (server/monitor.py), when present
    from . import monitor as _monitor
except ImportError:  # pragma: no cover - the basic /stats below stands in
    _monitor = None

# reachable without an API key (anchor §3: /health, /stats and OPTIONS stay open)
OPEN_PATHS = {"/health", "/stats"} | set(getattr(_monitor, "MONITOR_PATHS", ()))
_DRAIN_CAP = 256 << 20  # read (and drop) at most this much of an oversized body before answering 413


class GuardMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware, so streaming and disconnects pass straight through):
    API-key check, Content-Length limit, in-flight accounting."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, method = scope.get("path", ""), scope.get("method", "GET")
        cfg = self.state.config
        headers = Headers(scope=scope)
        if cfg.api_key and method != "OPTIONS" and path not in OPEN_PATHS:
            if not authorized(headers, cfg.api_key):
                await send_error(send, path, APIError(401, "invalid or missing API key (send 'Authorization: Bearer "
                                                           "KEY' or 'x-api-key: KEY')", code="invalid_api_key"),
                                 [(b"www-authenticate", b"Bearer")])
                return
        cl = headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > cfg.max_request_bytes:
            if int(cl) <= _DRAIN_CAP:
                await drain(receive)
            await send_error(send, path, APIError(
                413, f"request body of {cl} bytes exceeds the limit of {cfg.max_request_bytes} bytes "
                     f"(--max-request-mib)", code="request_too_large"))
            return
        counted = method == "POST" and path.startswith("/v1/")
        if counted:
            self.state.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            if counted:
                self.state.leave()


async def drain(receive) -> None:
    """Consume the rest of a request body so the client can read our answer."""
    while True:
        msg = await receive()
        if msg.get("type") != "http.request" or not msg.get("more_body", False):
            return


def authorized(headers: Headers, key: str) -> bool:
    given = headers.get("x-api-key")
    if given is None:
        auth = headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = token.strip()
    return hmac.compare_digest(given.encode(), key.encode())


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="ninfer-mlc", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.ninfer = state

    @app.get("/health")
    async def health():
        if not getattr(state.engine, "_running", True):
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    if _monitor is not None:
        _monitor.register_monitoring_routes(app, lambda: state.engine, state.http, state.config.model_id)
    else:
        @app.get("/stats")
        async def stats():
            return state.stats()

    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(responses_api.router)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        msg = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            msg = f"no route for {request.method} {request.url.path}"
        return error_response(request.url.path, APIError(exc.status_code, msg), headers=getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        param = ".".join(str(x) for x in errs[0].get("loc", ())[1:]) if errs else None
        return error_response(request.url.path, APIError(400, f"invalid request: {errs}", param=param or None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return error_response(request.url.path, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    app.add_middleware(GuardMiddleware, state=state)
    if state.config.cors:  # outermost, so preflights never meet the API-key check
        app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["x-request-id", "request-id"], max_age=600)
    return app


def create_stats_app(state: ServerState) -> FastAPI:
    """The ``--stats-port`` listener: /health, /stats (+ /metrics, /monitor), never authenticated."""
    if _monitor is not None:
        return _monitor.make_stats_app(lambda: state.engine, state.http, state.config.model_id)
    app = FastAPI(title="ninfer-mlc stats", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/stats")
    async def stats():
        return state.stats()

    return app


# ---- ninfer serve -------------------------------------------------------------------------
def _cli_error(msg: str):
    from ..cli import CLIError

    return CLIError(msg)


_SAMPLING_FLAGS = {"temperature": "--temperature", "top_p": "--top-p", "top_k": "--top-k", "min_p": "--min-p",
                   "presence_penalty": "--presence-penalty", "frequency_penalty": "--frequency-penalty",
                   "seed": "--seed"}


def sampling_overrides_from_args(args) -> dict:
    from ..runtime.sampling import SamplingError, merge_sampling_params

    over = {k: getattr(args, k, None) for k in _SAMPLING_FLAGS}
    over = {k: v for k, v in over.items() if v is not None}
    if getattr(args, "greedy", False):
        if over.get("temperature", 0) != 0:
            raise _cli_error("--greedy contradicts --temperature")
        over["temperature"] = 0.0
    try:
        merge_sampling_params(over)
    except SamplingError as e:
        raise _cli_error(f"{_SAMPLING_FLAGS.get(e.param, e.param)}: {e.message}") from None
    return over


def check_flags(args, manifest) -> dict:
    """Validate the flags against the artifact; return the pieces ``load_state`` needs."""
    from ..runtime.engine import EngineOptions

    if not 0 <= args.port <= 65535:
        raise _cli_error(f"--port must be in 0..65535, got {args.port}")
    if not 0 <= args.stats_port <= 65535:
        raise _cli_error(f"--stats-port must be in 0..65535 (0 = off), got {args.stats_port}")
    if args.stats_port and args.stats_port == args.port:
        raise _cli_error("--stats-port must differ from --port")
    if getattr(args, "default_thinking_budget", None) is not None and args.default_thinking_budget < 1:
        raise _cli_error(f"--default-thinking-budget must be >= 1, got {args.default_thinking_budget}")
    if not args.max_request_mib > 0:
        raise _cli_error(f"--max-request-mib must be > 0, got {args.max_request_mib}")
    if args.default_max_tokens < 1:
        raise _cli_error(f"--default-max-tokens must be >= 1, got {args.default_max_tokens}")
    if args.api_key is not None and not args.api_key.strip():
        raise _cli_error("--api-key must not be empty")
    native = int(manifest.max_context)
    max_context = native if args.max_context is None else args.max_context
    if max_context < 2:
        raise _cli_error(f"--max-context must be >= 2, got {max_context}")
    if max_context > native:
        raise _cli_error(f"--max-context {max_context} exceeds the {native} tokens this artifact was compiled for "
                         f"(recompile with `ninfer compile --max-context`)")
    concurrency = args.max_concurrency
    kv = "auto" if args.kv_capacity == "auto" else None
    if args.kv_capacity not in (None, "auto"):
        try:
            kv = int(args.kv_capacity)
        except ValueError:
            raise _cli_error(f"--kv-capacity must be a token count or 'auto', got {args.kv_capacity!r}") from None
        if kv < max_context:
            raise _cli_error(f"--kv-capacity {kv} is smaller than --max-context {max_context}")
    if args.device not in ("auto", "cpu", "cuda"):
        raise _cli_error(f"--device must be auto, cpu or cuda, got {args.device!r}")
    opts = EngineOptions(max_concurrency=concurrency, max_pending=args.max_pending_requests,
                         pending_timeout_ms=args.pending_timeout_ms, prefill_chunk=args.prefill_chunk,
                         max_context=max_context, default_max_tokens=args.default_max_tokens)
    # tiered KV / prefix reuse flags (options.add_cache_args), when this engine has them
    for flag, field in (("no_prefix_reuse", "prefix_reuse"), ("device_state_slots", "device_state_slots"),
                        ("host_kv_mib", "host_kv_mib"), ("host_state_slots", "host_state_slots"),
                        ("host_ram_reserve_mib", "host_ram_reserve_mib"), ("max_cache_entries", "max_cache_entries")):
        if hasattr(args, flag) and hasattr(opts, field):
            v = getattr(args, flag)
            setattr(opts, field, (not v) if flag == "no_prefix_reuse" else v)
    from .options import apply_spec_args  # speculative decoding flags (--spec, --draft-tokens, ...)

    apply_spec_args(args, opts)
    try:
        opts.validate()
    except ValueError as e:
        raise _cli_error(str(e)) from None
    if args.request_log_jsonl:
        try:
            with open(args.request_log_jsonl, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise _cli_error(f"--request-log-jsonl: cannot write {args.request_log_jsonl}: {e}") from None
    return {"options": opts, "kv_capacity": kv, "overrides": sampling_overrides_from_args(args)}


def load_state(args, engine: Any = None) -> ServerState:
    """Flags -> a ready ``ServerState`` (loads the engine unless one is given)."""
    from ..chat_template import ChatTemplate, ChatTemplateError
    from ..paths import default_model_dir
    from ..runtime.artifact import ArtifactError, read_manifest

    model_dir = Path(args.model) if args.model else default_model_dir()
    try:
        manifest = read_manifest(model_dir, verify="none")
    except ArtifactError as e:
        raise _cli_error(f"model: {e}") from None
    parts = check_flags(args, manifest)
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        raise _cli_error(f"--chat-template: no such file {args.chat_template}")
    try:
        template = ChatTemplate.from_model_dir(str(model_dir), args.chat_template)
    except ChatTemplateError as e:
        raise _cli_error(f"--chat-template: {e}" if args.chat_template else f"model: {e}") from None
    if engine is None:
        from ..generate import open_engine

        runner_kw: dict = {"device": args.device, "cuda_graphs": getattr(args, "cuda_graphs", "on") == "on"}
        if parts["kv_capacity"]:
            runner_kw["kv_capacity_tokens"] = parts["kv_capacity"]
        try:
            engine = open_engine(model_dir, parts["options"], **runner_kw)
        except (ArtifactError, ValueError, FileNotFoundError) as e:
            raise _cli_error(f"model: {e}") from None
    cfg = manifest.config
    config = ServerConfig(
        model_id=args.model_id or manifest.name,
        max_context=engine.opt.max_context,
        api_key=args.api_key,
        cors=args.cors,
        max_request_bytes=int(args.max_request_mib * (1 << 20)),
        enable_thinking=not args.no_thinking,
        messages_thinking_default=getattr(args, "messages_thinking_default", "off") == "on",
        preserve_thinking=args.preserve_thinking,
        tolerant_tool_calls=args.tolerant_tool_calls,
        default_thinking_budget=getattr(args, "default_thinking_budget", None),
        sampling_overrides=parts["overrides"],
        family=cfg.get("family") or cfg.get("model_type"),
        request_log_path=args.request_log_jsonl,
    )
    return ServerState(engine, template, config)


_UVICORN_LEVELS = {"trace": "trace", "debug": "debug", "info": "info", "warning": "warning", "error": "error",
                   "off": "critical"}


class _NoSignalServer:
    """uvicorn.Server variants: ``make`` leaves signals alone (extra listeners, threads);
    ``make_main`` handles SIGINT/SIGTERM as a graceful shutdown without re-raising them after
    (uvicorn's default), so ``ninfer serve`` exits 0 when asked to stop."""

    @staticmethod
    def make(config):
        import uvicorn

        class Quiet(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                yield

        return Quiet(config)

    @staticmethod
    def make_main(config):
        import signal

        import uvicorn

        class Main(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                sigs = (signal.SIGINT, signal.SIGTERM)
                old = {s: signal.signal(s, self.handle_exit) for s in sigs}
                try:
                    yield
                finally:
                    for s, h in old.items():
                        signal.signal(s, h)

        return Main(config)


async def serve_all(main, extra: list) -> None:
    tasks = [asyncio.create_task(s.serve()) for s in extra]
    try:
        await main.serve()
    finally:
        for s in extra:
            s.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)


def run_server(args) -> int:
    import uvicorn

    level = _UVICORN_LEVELS.get(args.log_level, "info")
    py_level = {"trace": logging.DEBUG, "critical": logging.CRITICAL}.get(level) or getattr(logging, level.upper())
    logging.basicConfig(level=py_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state = load_state(args)
    app = create_app(state)
    main = _NoSignalServer.make_main(uvicorn.Config(app, host=args.host, port=args.port, log_level=level,
                                                    timeout_graceful_shutdown=5))
    extra = []
    if args.stats_port:
        extra.append(_NoSignalServer.make(uvicorn.Config(create_stats_app(state), host=args.host,
                                                         port=args.stats_port, log_level="warning")))
    c = state.config
    print(f"ninfer: serving {c.model_id} on http://{args.host}:{args.port} (max context {c.max_context}, "
          f"concurrency {state.engine.opt.max_concurrency})", flush=True)
    try:
        asyncio.run(serve_all(main, extra))
    finally:
        state.engine.stop()
    return 0


# ---- embedding / tests --------------------------------------------------------------------
class ServerThread:
    """Run an app with uvicorn on a background thread (tests, notebooks, benches).

    ``port=0`` picks a free port; ``url`` is known once ``start()`` returns.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.host = host
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self.port = self._sock.getsockname()[1]
        self.server = _NoSignalServer.make(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2))
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "ServerThread":
        self._thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self._sock])),
                                        name=f"uvicorn-{self.port}", daemon=True)
        self._thread.start()
        import time

        t_end = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > t_end:
                raise RuntimeError("server thread failed to start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        self._sock.close()
