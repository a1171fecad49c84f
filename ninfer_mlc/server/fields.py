"""Reading request bodies: size limit, JSON parsing, and typed field getters that raise a
400 naming the field."""
from __future__ import annotations

import json
import secrets
from typing import Any, Optional

from starlette.requests import ClientDisconnect, Request

from .errors import APIError, bad_request

_DRAIN_CAP = 256 << 20
MAX_JSON_DEPTH = 64  # arrays / objects nested deeper than any API request needs


def _lone_surrogate(s: str) -> bool:
    """Text that cannot be encoded as UTF-8 (a lone UTF-16 surrogate from a JSON escape)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_json(body: Any) -> None:
    """400 naming the field for what json.loads accepts but the rest of the server must not see: nesting
    deeper than MAX_JSON_DEPTH (recursive code downstream) and strings with lone surrogates (they cannot
    be encoded as UTF-8 for the tokenizer). Iterative, one pass over the parsed body."""
    stack: list[tuple[Any, str, int]] = [(body, "", 0)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, str):
            if _lone_surrogate(v):
                raise bad_request(f"{path or 'body'} holds a lone UTF-16 surrogate (invalid Unicode text)",
                                  param=path or None, code="invalid_json")
            continue
        if isinstance(v, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise bad_request(f"{path or 'body'} is nested more than {MAX_JSON_DEPTH} levels deep",
                                  param=path or None, code="invalid_json")
            items = v.items() if isinstance(v, dict) else enumerate(v)
            for k, x in items:
                if isinstance(k, str):
                    if _lone_surrogate(k):
                        raise bad_request(f"a key of {path or 'body'} holds a lone UTF-16 surrogate",
                                          param=path or None, code="invalid_json")
                    sub = f"{path}.{k}" if path else k
                else:
                    sub = f"{path}[{k}]"
                stack.append((x, sub, depth + 1))


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 past ``limit`` bytes, 400 for malformed JSON."""
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise _too_large(int(cl), limit)
    try:
        raw = await _read_body(request, limit)
    except ClientDisconnect:  # nobody to answer: a 499 (client closed request), not a 500 of ours
        raise APIError(499, "the client closed the connection before its request body arrived",
                       code="client_disconnected") from None
    if not raw.strip():
        raise bad_request("the request body is empty; expected a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad_request(f"the request body is nested more than {MAX_JSON_DEPTH} levels deep",
                          code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object", code="invalid_json")
    check_json(body)
    return body


async def _read_body(request: Request, limit: int) -> bytes:
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            if size <= _DRAIN_CAP:  # read the rest so the client gets to see the 413
                async for more in request.stream():
                    size += len(more)
                    if size > _DRAIN_CAP:
                        break
            raise _too_large(size, limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int) -> APIError:
    return APIError(413, f"request body of {size} bytes exceeds the limit of {limit} bytes (--max-request-mib)",
                    code="request_too_large")


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def request_id(request: Request) -> str:
    """Client-supplied ``x-request-id`` when it looks sane, else a fresh ``req_...`` id."""
    rid = request.headers.get("x-request-id", "")
    if rid and len(rid) <= 128 and rid.isascii() and rid.isprintable() and " " not in rid:
        return rid
    return new_id("req_")


def one_of(v: Any, names) -> bool:
    """``v`` is one of the strings ``names``. A JSON array or object is none of them (and cannot even be
    looked up in a set: ``[] in {"a"}`` raises TypeError, a 500 where the client deserves a 400)."""
    return isinstance(v, str) and v in names


def type_name(v: Any) -> str:
    """JSON name of a Python value's type, for error messages."""
    return {dict: "object", list: "array", str: "string", bool: "boolean", int: "integer",
            float: "number", type(None): "null"}.get(type(v), type(v).__name__)


def _typed(body: dict, name: str, default: Any, param: Optional[str], ok, label: str) -> Any:
    """body[name] if present and accepted by ``ok``; default when absent/null; else a 400 naming it."""
    v = body.get(name, None)
    if v is None:
        return default
    if not ok(v):
        raise bad_request(f"{param or name} must be {label}, got {type_name(v)}", param=param or name)
    return v


def get_bool(body: dict, name: str, default: Optional[bool] = None, param: Optional[str] = None) -> Optional[bool]:
    return _typed(body, name, default, param, lambda v: isinstance(v, bool), "a boolean")


def get_str(body: dict, name: str, default: Optional[str] = None, param: Optional[str] = None) -> Optional[str]:
    return _typed(body, name, default, param, lambda v: isinstance(v, str), "a string")


def get_int(body: dict, name: str, default: Optional[int] = None, param: Optional[str] = None,
            minimum: Optional[int] = None) -> Optional[int]:
    v = _typed(body, name, default, param, lambda v: isinstance(v, int) and not isinstance(v, bool), "an integer")
    if v is not None and minimum is not None and v < minimum:
        raise bad_request(f"{param or name} must be >= {minimum}, got {v}", param=param or name)
    return v


def get_dict(body: dict, name: str, param: Optional[str] = None) -> Optional[dict]:
    return _typed(body, name, None, param, lambda v: isinstance(v, dict), "an object")


def get_list(body: dict, name: str, param: Optional[str] = None) -> Optional[list]:
    return _typed(body, name, None, param, lambda v: isinstance(v, list), "an array")


def object_items(raw: Any, param: str) -> list[tuple[str, dict]]:
    """A JSON array of objects -> [(its element's param name, the object)]; 400 naming the bad part."""
    if not isinstance(raw, list):
        raise bad_request(f"{param} must be an array", param=param)
    out = []
    for j, t in enumerate(raw):
        p = f"{param}[{j}]"
        if not isinstance(t, dict):
            raise bad_request(f"{p} must be an object", param=p)
        out.append((p, t))
    return out
