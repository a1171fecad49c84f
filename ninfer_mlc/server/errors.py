"""HTTP errors: one exception type, rendered in the OpenAI or the Anthropic shape by route.

OpenAI routes answer ``{"error": {"message", "type", "param", "code"}}``; ``/v1/messages*``
answers ``{"type": "error", "error": {"type", "message"}}``. Engine and sampling errors are
mapped here so handlers only raise.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from starlette.responses import JSONResponse

from ..runtime.errors import (BadConstraint, ContextTooLong, EngineError, EngineStopped, ImagesUnsupported,
                              InvalidRequest, QueueFull, QueueTimeout)
from ..runtime.sampling import SamplingError

# status -> (OpenAI error type, Anthropic error type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("invalid_request_error", "authentication_error"),
    403: ("invalid_request_error", "permission_error"),
    404: ("invalid_request_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
    504: ("server_error", "timeout_error"),
}


class APIError(Exception):
    """An error answered as JSON with ``status``; ``param`` names the offending request field."""

    def __init__(self, status: int, message: str, *, param: Optional[str] = None, code: Optional[str] = None,
                 type: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_engine(e: EngineError, param: Optional[str] = None) -> APIError:
    """Typed runtime errors -> HTTP status, code and the message a client sees."""
    if isinstance(e, ContextTooLong):
        return APIError(400, f"{e}; shorten the prompt or raise --max-context", param=param or "messages",
                        code="context_length_exceeded")
    if isinstance(e, QueueFull):
        return APIError(429, f"the server is at capacity: {e} (--max-pending-requests); retry shortly",
                        code="server_overloaded")
    if isinstance(e, QueueTimeout):
        return APIError(503, f"{e} (--pending-timeout-ms); retry shortly", code="request_queue_timeout")
    if isinstance(e, EngineStopped):
        return APIError(503, str(e), code="engine_stopped")
    if isinstance(e, ImagesUnsupported):
        return APIError(400, str(e), param=param or "messages", code="images_unsupported")
    if isinstance(e, BadConstraint):
        return APIError(400, str(e), param=param, code="invalid_constraint")
    if isinstance(e, InvalidRequest):
        return APIError(400, str(e), param=param, code="invalid_request")
    return APIError(500, str(e), code="engine_error")


def from_sampling(e: SamplingError, names: Optional[dict] = None) -> APIError:
    """SamplingError -> 400 naming the request's spelling of the parameter (``names`` maps)."""
    param = (names or {}).get(e.param, e.param)
    return APIError(400, f"{param}: {e.message}", param=param, code="invalid_value")


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_body(path: str, err: APIError) -> dict:
    otype, atype = _TYPES.get(err.status, ("server_error" if err.status >= 500 else "invalid_request_error",
                                           "api_error" if err.status >= 500 else "invalid_request_error"))
    if is_anthropic_path(path):
        return {"type": "error", "error": {"type": err.type or atype, "message": err.message}}
    return {"error": {"message": err.message, "type": err.type or otype, "param": err.param, "code": err.code}}


def error_response(path: str, err: APIError, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(path, err), status_code=err.status, headers=headers)


def error_bytes(path: str, err: APIError) -> bytes:
    return json.dumps(error_body(path, err), ensure_ascii=False).encode()


async def send_error(send: Any, path: str, err: APIError, extra_headers: Optional[list] = None) -> None:
    """Answer an error straight from ASGI middleware (before any route ran)."""
    body = error_bytes(path, err)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += extra_headers or []
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
