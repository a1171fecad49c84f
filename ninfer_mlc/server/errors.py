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
                 type: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers  # e.g. Retry-After on 429 / 503

    def message_for(self, path: str) -> str:
        """The message as the API behind ``path`` words it (one wording for most errors)."""
        return self.message


class ContextLengthExceeded(APIError):
    """A prompt over the context limit, worded as each real API words it, because clients key
    their recovery on that text: Claude Code and opencode compact on it, OpenAI clients read
    the ``context_length_exceeded`` code."""

    def __init__(self, prompt_tokens: int, max_prompt_tokens: int, param: Optional[str] = None):
        self.prompt_tokens = prompt_tokens
        self.max_prompt_tokens = max_prompt_tokens
        super().__init__(400, "", param=param, code="context_length_exceeded")
        self.message = self._openai_chat()

    def _openai_chat(self) -> str:
        what = "prompt" if self.param == "prompt" else "messages"
        return (f"This model's maximum context length is {self.max_prompt_tokens + 1} tokens. However, your "
                f"{what} resulted in {self.prompt_tokens} tokens. Please reduce the length of the {what}.")

    def message_for(self, path: str) -> str:
        if is_anthropic_path(path):
            return f"prompt is too long: {self.prompt_tokens} tokens > {self.max_prompt_tokens} maximum"
        if path.startswith("/v1/responses"):
            return (f"Your input exceeds the context window of this model ({self.prompt_tokens} tokens > "
                    f"{self.max_prompt_tokens} maximum). Please adjust your input and try again.")
        return self._openai_chat()


def bad_request(message: str, param: Optional[str] = None, code: Optional[str] = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_engine(e: EngineError, param: Optional[str] = None) -> APIError:
    """Typed runtime errors -> HTTP status, code and the message a client sees."""
    if isinstance(e, ContextTooLong):
        return ContextLengthExceeded(e.prompt_tokens, e.max_prompt_tokens, param or "messages")
    if isinstance(e, QueueFull):
        return APIError(429, f"the server is at capacity: {e} (--max-pending-requests); retry shortly",
                        code="server_overloaded", headers={"Retry-After": "1"})
    if isinstance(e, QueueTimeout):
        return APIError(503, f"{e} (--pending-timeout-ms); retry shortly", code="request_queue_timeout",
                        headers={"Retry-After": "1"})
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
        return {"type": "error", "error": {"type": err.type or atype, "message": err.message_for(path)}}
    return {"error": {"message": err.message_for(path), "type": err.type or otype, "param": err.param,
                      "code": err.code}}


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
