"""The HTTP server: app factory, ASGI guard (auth, body limit), error handlers, ``ninfer serve``.

``create_app(state)`` builds the FastAPI app around a ``ServerState`` (engine + template +
settings) so tests and embedders can run it on any engine; ``run_server(args)`` turns the
``ninfer serve`` flags into that state (every bad flag is a one-line error naming it), loads
the engine and runs uvicorn, plus the optional ``--stats-port`` listener.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import dataclasses
import hmac
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import JSONResponse

from . import anthropic_api, openai_api, responses_api
from .monitor import MONITOR_PATHS, make_stats_app, register_monitoring_routes
from ..config import CLIError, flag_for, from_args
from ..runtime.config import EngineConfig
from ..runtime.errors import ConfigError
from .errors import APIError, error_response, send_error
from .options import SamplingFlags, ServeOptions, VisionOptions
from .state import ServerConfig, ServerState
from .vision import vision_service

log = logging.getLogger("ninfer.server")

# reachable without an API key (anchor §3: /health, /stats and OPTIONS stay open)
OPEN_PATHS = MONITOR_PATHS
_DRAIN_CAP = 256 << 20  # read (and drop) at most this much of an oversized body before answering 413


class GuardMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware, so streaming and disconnects pass straight through):
    API-key check, Content-Length limit, in-flight accounting, every answer counted by status and
    error type (rejected requests also go to the request log), and an unexpected exception answered
    as a 500 JSON body here, so it never reaches the server and the kept-alive connection stays usable."""

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
        seen = _Answer(send)
        t0 = time.monotonic()
        counted = method == "POST" and path.startswith("/v1/")

        def log_rejected() -> None:
            if seen.logged or seen.status is None or seen.status < 400 or not path.startswith("/v1/"):
                return
            seen.logged = True
            self.state.log.log_rejected(
                request_id=headers.get("x-request-id", ""), model=cfg.model_id, method=method, path=path,
                status=seen.status, error_type=seen.error_type, error=seen.error,
                wall_ms=(time.monotonic() - t0) * 1000)

        # a rejection is in the request log before its answer's last byte leaves (a client that reads the log
        # once answered finds it); answers that never finish are logged below
        seen.before_last_body = log_rejected
        if counted:
            self.state.enter()
        try:
            if cfg.api_key and method != "OPTIONS" and path not in OPEN_PATHS and not authorized(headers, cfg.api_key):
                await send_error(seen, path, APIError(401, "invalid or missing API key (send 'Authorization: Bearer "
                                                           "KEY' or 'x-api-key: KEY')", code="invalid_api_key"),
                                 [(b"www-authenticate", b"Bearer")])
                return
            cl = headers.get("content-length")
            if cl is not None and cl.isdigit() and int(cl) > cfg.max_request_bytes:
                if int(cl) <= _DRAIN_CAP:
                    await drain(receive)
                await send_error(seen, path, APIError(
                    413, f"request body of {cl} bytes exceeds the limit of {cfg.max_request_bytes} bytes "
                         f"(--max-request-mib)", code="request_too_large"))
                return
            try:
                await self.app(scope, receive, seen)
            except Exception as exc:  # noqa: BLE001 - a bug must cost one request, not the connection
                if seen.status is not None:
                    raise  # a stream already started: the connection carries a broken answer, it must close
                log.exception("unhandled error on %s", path)
                await send_error(seen, path, APIError(500, f"internal error: {type(exc).__name__}: {exc}"))
        finally:
            if counted:
                self.state.leave()
            if seen.status is not None:
                self.state.http.record_response(seen.status, seen.error_type)
                log_rejected()


class _Answer:
    """An ASGI `send` that remembers the answer's status and, for a JSON error body, its type and message."""

    def __init__(self, send):
        self._send = send
        self.status: Optional[int] = None
        self.error_type: Optional[str] = None
        self.error: Optional[str] = None
        self._json = False
        self.logged = False
        self.before_last_body: Optional[Callable[[], None]] = None

    async def __call__(self, msg) -> None:
        if msg["type"] == "http.response.start":
            self.status = int(msg["status"])
            ct = dict(msg.get("headers") or []).get(b"content-type", b"")
            self._json = self.status >= 400 and ct.startswith(b"application/json")
        elif msg["type"] == "http.response.body":
            if self._json and self.error_type is None:
                self._read_error(msg.get("body", b""))
            if not msg.get("more_body", False) and self.before_last_body is not None:
                self.before_last_body()
        await self._send(msg)

    def _read_error(self, body: bytes) -> None:
        try:
            err = json.loads(body).get("error") or {}
        except (ValueError, AttributeError):
            return
        if isinstance(err, dict):
            self.error_type = err.get("code") or err.get("type")
            self.error = str(err.get("message", ""))[:500]


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
    app = FastAPI(title="ninfer-mlc", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.ninfer = state

    @app.get("/health")
    async def health():
        if not state.engine.running:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    register_monitoring_routes(app, lambda: state.engine, state.http, state.config.model_id)

    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(responses_api.router)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return error_response(request.url.path, exc, headers=exc.headers)

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

    app.add_middleware(GuardMiddleware, state=state)
    if state.config.cors:  # outermost, so preflights never meet the API-key check
        app.add_middleware(CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"],
                           expose_headers=["x-request-id", "request-id"], max_age=600)
    return app


def create_stats_app(state: ServerState) -> FastAPI:
    """The ``--stats-port`` listener: /health, /stats, /metrics, /monitor, never authenticated."""
    return make_stats_app(lambda: state.engine, state.http, state.config.model_id)


# ---- ninfer serve -------------------------------------------------------------------------
def sampling_overrides(flags: SamplingFlags) -> dict:
    from ..runtime.sampling import SamplingError, merge_sampling_params

    over = flags.overrides()
    if flags.greedy:
        if over.get("temperature", 0) != 0:
            raise CLIError("--greedy contradicts --temperature")
        over["temperature"] = 0.0
    try:
        merge_sampling_params(over)
    except SamplingError as e:
        raise CLIError(f"{flag_for(e.param)}: {e.message}") from None
    return over


def check_serve_options(opts: ServeOptions, max_context: int) -> None:
    """Flags of the HTTP layer; every error names its flag."""
    if not 0 <= opts.port <= 65535:
        raise CLIError(f"--port must be in 0..65535, got {opts.port}")
    if not 0 <= opts.stats_port <= 65535:
        raise CLIError(f"--stats-port must be in 0..65535 (0 = off), got {opts.stats_port}")
    if opts.stats_port and opts.stats_port == opts.port:
        raise CLIError("--stats-port must differ from --port")
    if opts.default_thinking_budget is not None and opts.default_thinking_budget < 1:
        raise CLIError(f"--default-thinking-budget must be >= 1, got {opts.default_thinking_budget}")
    if not opts.max_request_mib > 0:
        raise CLIError(f"--max-request-mib must be > 0, got {opts.max_request_mib}")
    if opts.api_key is not None and not opts.api_key.strip():
        raise CLIError("--api-key must not be empty")
    if opts.chat_template is not None and not os.path.isfile(opts.chat_template):
        raise CLIError(f"--chat-template: no such file {opts.chat_template}")
    if opts.request_log_jsonl:
        try:
            with open(opts.request_log_jsonl, "a", encoding="utf-8"):
                pass
        except OSError as e:
            raise CLIError(f"--request-log-jsonl: cannot write {opts.request_log_jsonl}: {e}") from None


def checked_engine_flags(args) -> EngineConfig:
    """EngineConfig from the flags, validated on its own (errors name the flag)."""
    cfg = from_args(EngineConfig, args)
    try:
        cfg.validate()
    except ConfigError as e:
        raise CLIError(f"{flag_for(e.field)}: {e.message}") from None
    return cfg


def engine_config(args, manifest) -> EngineConfig:
    """EngineConfig from the flags, checked against the artifact (errors name the flag)."""
    cfg = checked_engine_flags(args)
    native = int(manifest.max_context)
    if cfg.max_context is not None and cfg.max_context > native:
        raise CLIError(f"--max-context {cfg.max_context} exceeds the {native} tokens this artifact was compiled for "
                       f"(recompile with `ninfer compile --max-context`)")
    max_context = cfg.max_context or native
    if cfg.kv_capacity not in (None, "auto") and int(cfg.kv_capacity) < max_context:
        raise CLIError(f"--kv-capacity {cfg.kv_capacity} is smaller than --max-context {max_context}")
    return cfg


def load_state(args, engine: Any = None) -> ServerState:
    """Flags -> a ready ``ServerState`` (loads the engine unless one is given)."""
    from ..chat_template import ChatTemplate, ChatTemplateError
    from ..contract.manifest import ArtifactError, read_manifest
    from ..paths import default_model_dir

    model_dir = Path(args.model) if args.model else default_model_dir()
    try:
        manifest = read_manifest(model_dir, verify="none")
    except ArtifactError as e:
        raise CLIError(f"model: {e}") from None
    opts = from_args(ServeOptions, args)
    if manifest.extras.get("random_weights") and not opts.allow_random_weights:
        raise CLIError(f"model: {model_dir} is a random-weights benchmark artifact (ninfer compile --random-weights); "
                       "its answers are noise. Pass --allow-random-weights to serve it for a benchmark")
    cfg = engine_config(args, manifest)
    if cfg.forced_acceptance is not None and not opts.allow_forced_acceptance:
        raise CLIError("--forced-acceptance is a benchmark profile (drafts are kept whatever the model says, so the "
                       "output is not the model's); pass --allow-forced-acceptance to run it")
    check_serve_options(opts, cfg.max_context or manifest.max_context)
    overrides = sampling_overrides(from_args(SamplingFlags, args))
    vision_opts = from_args(VisionOptions, args)
    for f in dataclasses.fields(VisionOptions):
        if not getattr(vision_opts, f.name) > 0:
            raise CLIError(f"{flag_for(f.name)} must be > 0, got {getattr(vision_opts, f.name)}")
    try:
        template = ChatTemplate.from_model_dir(str(model_dir), opts.chat_template)
    except ChatTemplateError as e:
        raise CLIError(f"--chat-template: {e}" if opts.chat_template else f"model: {e}") from None
    if engine is None:
        from ..runtime.assemble import open_engine

        try:
            engine = open_engine(model_dir, cfg)
        except ConfigError as e:
            raise CLIError(f"{flag_for(e.field)}: {e.message}") from None
        except (ArtifactError, ValueError, FileNotFoundError) as e:
            raise CLIError(f"model: {e}") from None
    mcfg = manifest.config
    config = ServerConfig(
        model_id=opts.model_id or manifest.name,
        max_context=engine.max_context,
        api_key=opts.api_key,
        cors=opts.cors,
        max_request_bytes=int(opts.max_request_mib * (1 << 20)),
        enable_thinking=opts.enable_thinking,
        messages_thinking_default=opts.messages_thinking_default,
        preserve_thinking=opts.preserve_thinking,
        tolerant_tool_calls=opts.tolerant_tool_calls,
        default_thinking_budget=opts.default_thinking_budget,
        sampling_overrides=overrides,
        model_sampling_defaults=dict(engine.generation.sampling),
        family=mcfg.get("family") or mcfg.get("model_type"),
        request_log_path=opts.request_log_jsonl,
    )
    state = ServerState(engine, template, config)
    state.vision = vision_service(vision_opts, engine)  # None for text-only models / --no-vision
    return state


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


async def serve_all(main: tuple, extra: list) -> None:
    """main and extra: (uvicorn server, its bound sockets)."""
    tasks = [asyncio.create_task(s.serve(sockets=socks)) for s, socks in extra]
    try:
        await main[0].serve(sockets=main[1])
    finally:
        for s, _ in extra:
            s.should_exit = True
        await asyncio.gather(*tasks, return_exceptions=True)


def run_server(args) -> int:
    import uvicorn

    level = _UVICORN_LEVELS.get(args.log_level, "info")
    py_level = {"trace": logging.DEBUG, "critical": logging.CRITICAL}.get(level) or getattr(logging, level.upper())
    logging.basicConfig(level=py_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # ports, then flags, then MODEL -> artifact, all before the model loads
    from ..cli_support import resolve_model
    from ..paths import default_model_dir
    from .listen import bind_listeners, bound_port

    listeners = bind_listeners(args.host, args.port, args.stats_port)
    try:
        sampling_overrides(from_args(SamplingFlags, args))
        checked_engine_flags(args)
        args.model = str(resolve_model(args, default_model_dir()))
        state = load_state(args)
    except BaseException:
        listeners.close()
        raise
    state.engine.constraints.warm_in_background()  # index the vocabulary for constrained decoding now
    app = create_app(state)
    # What is loaded now lives as long as the process: without a freeze, every gen-2 collection walks it
    # (230k containers with a 248k-token vocabulary: 0.4 s on 2 cores), a pause in every stream.
    gc.collect()
    gc.freeze()
    main = _NoSignalServer.make_main(uvicorn.Config(app, host=args.host, port=args.port, log_level=level,
                                                    timeout_graceful_shutdown=5))
    extra = []
    if listeners.stats is not None:
        extra.append((_NoSignalServer.make(uvicorn.Config(create_stats_app(state), host=args.host,
                                                          port=args.stats_port, log_level="warning")),
                      [listeners.stats]))
    c = state.config
    random = " [RANDOM WEIGHTS: benchmark artifact, answers are noise]" if state.engine.model_info.random_weights else ""
    print(f"ninfer: serving {c.model_id} on http://{args.host}:{bound_port(listeners.main)} (max context "
          f"{c.max_context}, concurrency {state.engine.cfg.max_concurrency}){random}", flush=True)
    try:
        asyncio.run(serve_all((main, [listeners.main]), extra))
    finally:
        state.engine.stop()
        listeners.close()
    return 0


# ---- embedding / tests --------------------------------------------------------------------
class ServerThread:
    """Run an app with uvicorn on a background thread (tests, notebooks, benches).

    ``port=0`` picks a free port; ``url`` is known once ``start()`` returns.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        from .listen import bind_port

        self.host = host
        self._sock = bind_port(host, port, "port")
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
