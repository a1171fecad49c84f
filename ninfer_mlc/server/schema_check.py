"""A structural check of the JSON Schemas clients send as tool parameters: the mistakes the real APIs
refuse (an unknown type, properties that are not an object of schemas, required that is not a list of
names ...) get a 400 naming the exact place, instead of reaching the chat template or the grammar."""
from __future__ import annotations

from typing import Any

from .errors import bad_request

TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def check_schema(schema: Any, param: str) -> None:
    stack = [(schema, param)]
    while stack:
        s, p = stack.pop()
        if isinstance(s, bool):  # true / false are schemas too
            continue
        if not isinstance(s, dict):
            raise bad_request(f"{p} must be a JSON schema object", param=p)
        t = s.get("type")
        if t is not None:
            names = t if isinstance(t, list) else [t]
            if not names or any(not isinstance(n, str) or n not in TYPES for n in names):
                raise bad_request(f"{p}.type must be one of {sorted(TYPES)} (or a list of them), got {t!r}",
                                  param=f"{p}.type")
        for key in _SCHEMA_MAPS:
            if key in s:
                m = s[key]
                if not isinstance(m, dict):
                    raise bad_request(f"{p}.{key} must be an object of schemas", param=f"{p}.{key}")
                stack.extend((v, f"{p}.{key}.{k}") for k, v in m.items())
        for key in _SCHEMA_LISTS:
            if key in s:
                lst = s[key]
                if not isinstance(lst, list):
                    raise bad_request(f"{p}.{key} must be an array of schemas", param=f"{p}.{key}")
                stack.extend((v, f"{p}.{key}[{i}]") for i, v in enumerate(lst))
        for key in ("items", "additionalProperties", "not", "contains"):
            if key in s:
                stack.append((s[key], f"{p}.{key}"))
        req = s.get("required")
        if req is not None and (not isinstance(req, list) or any(not isinstance(x, str) for x in req)):
            raise bad_request(f"{p}.required must be an array of property names", param=f"{p}.required")
        enum = s.get("enum")
        if enum is not None and not isinstance(enum, list):
            raise bad_request(f"{p}.enum must be an array", param=f"{p}.enum")
