"""Parse Qwen XML tool calls out of generated text.

Qwen3.x models emit calls as::

    <tool_call>
    <function=NAME>
    <parameter=P>
    value
    </parameter>
    </function>
    </tool_call>

The parser is a left-to-right cursor over the region that starts at the first
``<tool_call>`` (text before it is content).  Parameter values end at the
``</parameter>`` that balances their opener, so a value may itself contain
balanced ``<parameter=..>..</parameter>`` pairs or literal ``<tool_call>`` /
``</function>`` text (file-writing tools whose payload is XML).

Strict mode (default) is all or nothing: any defect turns the whole region back
into plain content and records why.  Tolerant mode recovers the defects that
real Qwen3.x checkpoints produce (truncated output, corrupted openers, junk
after the last call).  Values are typed with the declared JSON schema because
the model writes every value as bare text.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Iterable

__all__ = [
    "ToolCall",
    "ToolCallParse",
    "ToolCallStreamDecoder",
    "parse_tool_calls",
    "tool_schemas",
    "convert_value",
    "new_call_id",
    "anthropic_tool_id",
    "FALLBACK_REASONS",
]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNC_CLOSE = "</function>"
PARAM_OPEN = "<parameter="
PARAM_CLOSE = "</parameter>"
MAX_NAME_LEN = 128
FALLBACK_REASONS = (
    "malformed_structure",
    "duplicate_parameter",
    "invalid_tool_name",
    "undeclared_tool",
    "trailing_content",
    "truncated_tail",  # tolerant only: calls kept, the tail after them dropped
)

_WS = " \t\r\n"
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]{1,%d}" % MAX_NAME_LEN)
_PARAM_OPEN_RE = re.compile(r"<parameter=([A-Za-z0-9_.\-]{1,%d})>" % MAX_NAME_LEN)
_PARAM_OPEN_CUT_RE = re.compile(r"<parameter=[A-Za-z0-9_.\-]{0,%d}" % MAX_NAME_LEN)
_FUNC_NAME_SPAN_RE = re.compile(r"[^>\n<]{0,%d}" % (2 * MAX_NAME_LEN))
# Opener spellings accepted in tolerant mode, longest alternatives first.
_FUNC_OPEN_TOLERANT_RE = re.compile(
    r"<<function=|<function=|<\|im_start\|>function=|<\|im_start\|>=|<=|function="
)


def new_call_id() -> str:
    """OpenAI-style id: ``call_`` + 24 hex digits."""
    return "call_" + secrets.token_hex(12)


def anthropic_tool_id(call_id: str | None = None) -> str:
    """Anthropic ``toolu_`` id; derived from a ``call_`` id so both APIs agree."""
    if call_id and call_id.startswith("call_"):
        return "toolu_" + call_id[len("call_"):]
    return "toolu_" + secrets.token_hex(12)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    arguments_json: str = ""
    id: str = field(default_factory=new_call_id)

    def __post_init__(self) -> None:
        if not self.arguments_json:
            self.arguments_json = json.dumps(self.arguments, ensure_ascii=False)


@dataclass
class ToolCallParse:
    content: str
    calls: list[ToolCall]
    fallback_reason: str | None = None
    marker_seen: bool = False
    recoveries: list[str] = field(default_factory=list)  # tolerant-mode repairs, for logs


# ----------------------------------------------------------------------------- schema typing


def tool_schemas(tools: Iterable[dict] | None) -> dict[str, dict] | None:
    """Map tool name -> parameters JSON schema (OpenAI, flat Responses, or Anthropic form)."""
    if tools is None:
        return None
    out: dict[str, dict] = {}
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        fn = tool["function"] if isinstance(tool.get("function"), dict) else tool
        name = fn.get("name")
        if not isinstance(name, str):
            continue
        schema = fn.get("parameters")
        if schema is None:
            schema = fn.get("input_schema")
        out[name] = schema if isinstance(schema, dict) else {}
    return out


def _schema_types(schema: Any) -> set[str] | None:
    """Primitive JSON types a parameter schema allows (direct type, list, anyOf/oneOf, enum)."""
    if not isinstance(schema, dict):
        return None
    types: set[str] = set()
    t = schema.get("type")
    if isinstance(t, str):
        types.add(t)
    elif isinstance(t, list):
        types.update(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or ():
            sub_types = _schema_types(sub)
            if sub_types:
                types |= sub_types
    if not types and isinstance(schema.get("enum"), list):
        for v in schema["enum"]:
            types.add(_json_type_name(v))
    return types or None


def _json_type_name(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def _type_matches(v: Any, types: set[str]) -> bool:
    name = _json_type_name(v)
    return name in types or (name == "integer" and "number" in types)


def _reject_constant(c: str) -> Any:
    raise ValueError(c)  # NaN / Infinity are not JSON


def _try_json(text: str) -> tuple[bool, Any]:
    try:
        return True, json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return False, None


_OMIT = object()
# string schemas whose values are tokens rather than free text: the whitespace around them is layout
# (constrained decoding lets the model put any around such values, as xgrammar's qwen_xml style does)
_SHAPED_STRING_KEYS = ("enum", "const", "pattern", "format", "minLength", "maxLength")


def convert_value(raw: str, schema: Any) -> Any:
    """Type one raw parameter text by its schema; returns ``_OMIT`` for empty non-string values."""
    types = _schema_types(schema)
    if types is None:
        ok, v = _try_json(raw)
        return v if ok else raw
    if types == {"string"}:
        if isinstance(schema, dict) and any(k in schema for k in _SHAPED_STRING_KEYS):
            return raw.strip()
        return raw
    text = raw.strip()
    if not text:
        return raw if "string" in types else _OMIT
    low = text.lower()
    if "boolean" in types and low in ("true", "false"):
        return low == "true"
    if "null" in types and low in ("null", "none"):
        return None
    ok, v = _try_json(text)
    if "string" in types:
        # A string alternative wins unless the text is JSON of another declared type.
        return v if ok and not isinstance(v, str) and _type_matches(v, types) else raw
    return v if ok else raw


# ----------------------------------------------------------------------------- core parser


class _Fail(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def _skip_ws(s: str, i: int) -> int:
    n = len(s)
    while i < n and s[i] in _WS:
        i += 1
    return i


def _is_cut_prefix(rest: str, *tags: str) -> bool:
    """True when ``rest`` (text up to EOF) is a proper prefix of one of ``tags``."""
    return bool(rest) and any(len(rest) < len(t) and t.startswith(rest) for t in tags)


def _partial_suffix_len(s: str, marker: str) -> int:
    """Length of the longest suffix of ``s`` that is a proper prefix of ``marker``."""
    for k in range(min(len(s), len(marker) - 1), 0, -1):
        if s.endswith(marker[:k]):
            return k
    return 0


def _trim_value(v: str) -> str:
    if v.startswith("\r\n"):
        v = v[2:]
    elif v.startswith("\n"):
        v = v[1:]
    if v.endswith("\r\n"):
        v = v[:-2]
    elif v.endswith("\n"):
        v = v[:-1]
    return v


def _scan_value(s: str, j: int) -> int:
    """Index of the ``</parameter>`` closing the value that starts at ``j``; -1 at EOF."""
    depth = 1
    i = j
    while True:
        k = s.find("<", i)
        if k < 0:
            return -1
        if s.startswith(PARAM_CLOSE, k):
            depth -= 1
            if depth == 0:
                return k
            i = k + len(PARAM_CLOSE)
            continue
        m = _PARAM_OPEN_RE.match(s, k)
        if m:
            depth += 1
            i = m.end()
        else:
            i = k + 1


class _RegionParser:
    def __init__(self, tools: Iterable[dict] | None, tolerant: bool, truncated: bool):
        self.schemas = tool_schemas(tools)
        self.tolerant = tolerant
        self.truncated = truncated
        self.recoveries: list[str] = []

    def _note(self, what: str) -> None:
        if what not in self.recoveries:
            self.recoveries.append(what)

    def parse(self, s: str, pos: int) -> tuple[list[ToolCall], str | None]:
        """Parse the region starting at ``pos`` (which holds ``<tool_call>``)."""
        calls: list[ToolCall] = []
        i = pos
        while True:
            try:
                call, i, _closed = self.parse_call(s, i)
            except _Fail as e:
                if self.tolerant and calls:
                    return calls, "truncated_tail"
                return [], e.reason
            calls.append(call)
            i = _skip_ws(s, i)
            if i >= len(s):
                return calls, None
            if s.startswith(TOOL_CALL_OPEN, i):
                continue
            if self.tolerant:
                return calls, "truncated_tail"
            return [], "trailing_content"

    def _function_open(self, s: str, i: int) -> tuple[str, int]:
        if self.tolerant:
            m = _FUNC_OPEN_TOLERANT_RE.match(s, i)
            if not m:
                raise _Fail("malformed_structure")
            if m.group() != "<function=":
                self._note("corrupted_function_opener")
            j = m.end()
        elif s.startswith("<function=", i):
            j = i + len("<function=")
        else:
            raise _Fail("malformed_structure")
        span = _FUNC_NAME_SPAN_RE.match(s, j)
        assert span is not None  # {0,n} matches the empty string too
        cand, k = span.group(), span.end()
        if k < len(s) and s[k] == ">":
            if not _NAME_RE.fullmatch(cand):
                raise _Fail("invalid_tool_name")
            return cand, k + 1
        if self.tolerant:
            # Dropped '>' after the name: accept when whitespace then '<' or EOF follows.
            name = cand.rstrip(_WS)
            end = j + len(name)
            k2 = _skip_ws(s, end)
            if _NAME_RE.fullmatch(name) and k2 > end and (k2 >= len(s) or s[k2] == "<"):
                self._note("missing_function_gt")
                return name, k2
        raise _Fail("malformed_structure")

    def parse_call(self, s: str, pos: int) -> tuple[ToolCall, int, bool]:
        """Parse one call at ``pos``; returns (call, end, closed_by_real_</tool_call>)."""
        n = len(s)
        i = _skip_ws(s, pos + len(TOOL_CALL_OPEN))
        name, i = self._function_open(s, i)
        schema = None
        if self.schemas is not None:
            if name in self.schemas:
                schema = self.schemas[name]
            elif self.tolerant:
                self._note("undeclared_tool")
            else:
                raise _Fail("undeclared_tool")
        props = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(props, dict):
            props = {}
        args: dict[str, Any] = {}
        seen: set[str] = set()

        def add(pname: str, raw: str) -> None:
            if pname in seen:
                raise _Fail("duplicate_parameter")
            seen.add(pname)
            v = convert_value(raw, props.get(pname))
            if v is not _OMIT:
                args[pname] = v

        def done(end: int, closed: bool) -> tuple[ToolCall, int, bool]:
            return ToolCall(name, args), end, closed

        while True:
            i = _skip_ws(s, i)
            if s.startswith(PARAM_OPEN, i):
                m = _PARAM_OPEN_RE.match(s, i)
                if not m:
                    cut = _PARAM_OPEN_CUT_RE.match(s, i)
                    if self.tolerant and seen and cut and cut.end() == n:
                        self._note("cut_parameter_opener")
                        return done(n, False)
                    raise _Fail("malformed_structure")
                close = _scan_value(s, m.end())
                if close < 0:
                    if self.tolerant and self.truncated and seen:
                        raw = s[m.end():]
                        raw = raw[: len(raw) - _partial_suffix_len(raw, PARAM_CLOSE)]
                        add(m.group(1), _trim_value(raw))
                        self._note("cut_parameter_value")
                        return done(n, False)
                    raise _Fail("malformed_structure")
                add(m.group(1), _trim_value(s[m.end():close]))
                i = close + len(PARAM_CLOSE)
                continue
            if s.startswith(FUNC_CLOSE, i):
                i = _skip_ws(s, i + len(FUNC_CLOSE))
                if s.startswith(TOOL_CALL_CLOSE, i):
                    return done(i + len(TOOL_CALL_CLOSE), True)
                if self.tolerant and (i >= n or _is_cut_prefix(s[i:], TOOL_CALL_CLOSE)):
                    self._note("missing_tool_call_close")
                    return done(n, False)
                if self.tolerant and s.startswith(TOOL_CALL_OPEN, i):
                    self._note("missing_tool_call_close")
                    return done(i, False)
                raise _Fail("malformed_structure")
            if self.tolerant:
                if s.startswith(TOOL_CALL_CLOSE, i):
                    self._note("missing_function_close")
                    return done(i + len(TOOL_CALL_CLOSE), True)
                rest = s[i:]
                if seen and (not rest or _is_cut_prefix(rest, FUNC_CLOSE, TOOL_CALL_CLOSE, PARAM_OPEN)):
                    self._note("missing_function_close")
                    return done(n, False)
            raise _Fail("malformed_structure")


def parse_tool_calls(
    text: str,
    tools: Iterable[dict] | None = None,
    *,
    tolerant: bool = False,
    truncated: bool = False,
) -> ToolCallParse:
    """Split ``text`` into content and tool calls.

    ``tools``: declared tools (None = accept any name, no typing).  ``truncated``:
    generation stopped on the token budget; only then may tolerant mode keep a
    parameter value that was cut before its ``</parameter>``.
    """
    start = text.find(TOOL_CALL_OPEN)
    if start < 0:
        return ToolCallParse(text, [], None, False)
    rp = _RegionParser(tools, tolerant, truncated)
    calls, reason = rp.parse(text, start)
    if not calls:
        return ToolCallParse(text, [], reason, True)
    return ToolCallParse(text[:start], calls, reason, True, rp.recoveries)


# ----------------------------------------------------------------------------- streaming


class ToolCallStreamDecoder:
    """Incremental front end of :func:`parse_tool_calls`.

    ``feed`` returns events ``("content", str)`` and ``("tool_call", ToolCall)``.
    Content streams immediately except a suffix that could begin ``<tool_call>``.
    Once the marker appears the region is buffered: strict mode decides at
    ``finish`` (all or nothing); tolerant mode emits each call as soon as its
    ``</tool_call>`` arrives, since later defects can no longer undo it.
    The final answer always equals the one-shot parse of the whole text.
    """

    def __init__(self, tools: Iterable[dict] | None = None, *, tolerant: bool = False):
        self._tools = list(tools) if tools is not None else None
        self._tolerant = tolerant
        self._early = _RegionParser(self._tools, tolerant, False)
        self._content: list[str] = []  # content already emitted
        self._pre = ""  # held-back possible marker prefix
        self._region: list[str] | None = None
        self._region_len = 0
        self._tail = ""  # last chars of the region, to spot a split </tool_call>
        self._next = 0  # region offset where the next unemitted call starts
        self._stop_early = False
        self._emitted: list[ToolCall] = []
        self.result: ToolCallParse | None = None

    @property
    def marker_seen(self) -> bool:
        return self._region is not None

    @property
    def held_back(self) -> str:
        """Text fed but not yet emitted as content or as a call."""
        if self._region is None:
            return self._pre
        return "".join(self._region)[self._next:]

    @property
    def holding(self) -> bool:
        return bool(self._pre) or (self._region is not None and self._region_len > self._next)

    def feed(self, delta: str) -> list[tuple[str, Any]]:
        if self.result is not None:
            raise RuntimeError("feed() after finish()")
        if not delta:
            return []
        if self._region is not None:
            return self._grow_region(delta)
        buf = self._pre + delta
        k = buf.find(TOOL_CALL_OPEN)
        out: list[tuple[str, Any]] = []
        if k >= 0:
            self._pre = ""
            self._emit_content(out, buf[:k])
            self._region = []
            return out + self._grow_region(buf[k:])
        hold = _partial_suffix_len(buf, TOOL_CALL_OPEN)
        self._emit_content(out, buf[: len(buf) - hold])
        self._pre = buf[len(buf) - hold:]
        return out

    def finish(self, truncated: bool = False) -> list[tuple[str, Any]]:
        if self.result is not None:
            raise RuntimeError("finish() called twice")
        out: list[tuple[str, Any]] = []
        if self._region is None:
            self._emit_content(out, self._pre)
            self._pre = ""
            self.result = ToolCallParse("".join(self._content), [], None, False)
            return out
        region = "".join(self._region)
        prefix = "".join(self._content)
        res = parse_tool_calls(prefix + region, self._tools, tolerant=self._tolerant, truncated=truncated)
        if res.calls:
            k = len(self._emitted)
            res.calls[:k] = self._emitted  # same calls (prefix-stable parse); keep their ids
            out.extend(("tool_call", c) for c in res.calls[k:])
        else:
            self._emit_content(out, region)
        self._next = self._region_len
        self.result = res
        return out

    def _emit_content(self, out: list, text: str) -> None:
        if text:
            self._content.append(text)
            out.append(("content", text))

    def _grow_region(self, delta: str) -> list[tuple[str, Any]]:
        assert self._region is not None  # called only once the opening marker started the region
        self._region.append(delta)
        self._region_len += len(delta)
        window = self._tail + delta
        self._tail = window[-(len(TOOL_CALL_CLOSE) - 1):]
        if not self._tolerant or self._stop_early or TOOL_CALL_CLOSE not in window:
            return []
        s = "".join(self._region)
        self._region = [s]
        out: list[tuple[str, Any]] = []
        while True:
            i = _skip_ws(s, self._next)
            if i >= len(s):
                break
            if not s.startswith(TOOL_CALL_OPEN, i):
                if not TOOL_CALL_OPEN.startswith(s[i:]):
                    self._stop_early = True  # junk after a call: finish() reports truncated_tail
                break
            try:
                call, end, closed = self._early.parse_call(s, i)
            except _Fail:
                break  # maybe incomplete; finish() decides
            if not closed:
                break
            self._emitted.append(call)
            self._next = end
            out.append(("tool_call", call))
        return out
