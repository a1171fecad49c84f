"""Render a model's Jinja chat template the way HF ``apply_chat_template`` does.

Prompts must be byte-identical to what the model was trained on, and clients
compare against transformers, so the environment mirrors HF: sandboxed jinja2
with ``trim_blocks``/``lstrip_blocks``, ``loopcontrols``, an HTML-safe-free
``tojson``, ``raise_exception`` and ``strftime_now``; messages lose ``None``
keys and get ``reasoning_content``/``thinking`` aliases; special tokens from
``tokenizer_config.json`` are template variables.
"""

from __future__ import annotations

import copy
import json
import os
import re
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterable

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

__all__ = ["ChatTemplate", "ChatTemplateError", "load_chat_template", "strip_prior_reasoning"]

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_THINK_BLOCK_RE = re.compile(r"<think>.*?</think>\n*", re.S)


class ChatTemplateError(Exception):
    """The template could not be loaded or raised / failed while rendering."""


class _GenerationTag(jinja2.ext.Extension):
    """Accept HF's ``{% generation %}`` blocks (assistant-mask markers); render their body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"chat template syntax error at line {e.lineno}: {e.message}") from e


def _token_str(v: Any) -> str | None:
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):  # serialized AddedToken
        return v["content"]
    return None


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ChatTemplateError(f"cannot read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def _templates_from_value(value: Any) -> dict[str, str]:
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in value if isinstance(t, dict) and "name" in t and "template" in t}
    if isinstance(value, dict):
        return {k: v for k, v in value.items() if isinstance(v, str)}
    return {}


def load_chat_template(model_dir: str | None = None, override: str | None = None) -> dict[str, str]:
    """Templates by name (``default`` plus any named ones).

    Order: ``override`` file > ``chat_template.jinja`` (+ ``additional_chat_templates/*.jinja``)
    > ``tokenizer_config.json["chat_template"]`` > ``chat_template.json``.
    """
    if override is not None:
        try:
            with open(override, encoding="utf-8") as f:
                return {"default": f.read()}
        except OSError as e:
            raise ChatTemplateError(f"cannot read chat template override {override}: {e}") from e
    if model_dir is None:
        raise ChatTemplateError("no model directory or template override given")
    templates: dict[str, str] = {}
    cfg_path = os.path.join(model_dir, "tokenizer_config.json")
    if os.path.isfile(cfg_path):
        templates.update(_templates_from_value(_read_json(cfg_path).get("chat_template")))
    legacy_path = os.path.join(model_dir, "chat_template.json")
    if not templates and os.path.isfile(legacy_path):
        templates.update(_templates_from_value(_read_json(legacy_path).get("chat_template")))
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            templates["default"] = f.read()
    extra_dir = os.path.join(model_dir, "additional_chat_templates")
    if os.path.isdir(extra_dir):
        for fn in sorted(os.listdir(extra_dir)):
            if fn.endswith(".jinja"):
                with open(os.path.join(extra_dir, fn), encoding="utf-8") as f:
                    templates[fn[: -len(".jinja")]] = f.read()
    if not templates:
        raise ChatTemplateError(f"no chat template found in {model_dir}")
    return templates


def _strip_think_text(text: str) -> str:
    text = _THINK_BLOCK_RE.sub("", text)
    if "</think>" in text:  # reasoning opened by the prompt: only the closer was generated
        text = text.split("</think>")[-1].lstrip("\n")
    return text


def strip_prior_reasoning(messages: list[dict]) -> list[dict]:
    """Drop reasoning from assistant turns before the last user message (returns copies).

    Keeps earlier turns rendered exactly as they were when they were history,
    so the prompt stays an append-only token stream across turns.
    """
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    out = []
    for i, m in enumerate(messages):
        if i < last_user and m.get("role") == "assistant":
            m = {k: v for k, v in m.items() if k not in _REASONING_FIELDS}
            content = m.get("content")
            if isinstance(content, str):
                m["content"] = _strip_think_text(content)
            elif isinstance(content, list):
                m["content"] = [
                    {**p, "text": _strip_think_text(p["text"])}
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                    else p
                    for p in content
                ]
        out.append(m)
    return out


def _normalize_messages(messages: Iterable[dict]) -> list[dict]:
    out = []
    for m in messages:
        if not isinstance(m, dict):
            raise ChatTemplateError(f"chat messages must be dicts, got {type(m).__name__}")
        m = {k: copy.deepcopy(v) for k, v in m.items() if v is not None}
        calls = m.get("tool_calls")
        if isinstance(calls, list):
            for tc in calls:
                fn = tc.get("function") if isinstance(tc, dict) else None
                target = fn if isinstance(fn, dict) else tc
                args = target.get("arguments") if isinstance(target, dict) else None
                if isinstance(args, str):  # OpenAI sends a JSON string; templates iterate a dict
                    try:
                        parsed = json.loads(args) if args.strip() else {}
                    except ValueError:
                        parsed = None
                    if isinstance(parsed, dict):
                        target["arguments"] = parsed
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


class ChatTemplate:
    """A loaded chat template plus the special-token variables it may reference."""

    def __init__(self, templates: str | dict[str, str], special_tokens: dict[str, Any] | None = None):
        self.templates = {"default": templates} if isinstance(templates, str) else dict(templates)
        self.special_tokens = {
            k: s for k in SPECIAL_TOKEN_KEYS if (s := _token_str((special_tokens or {}).get(k))) is not None
        }

    @classmethod
    def from_model_dir(cls, model_dir: str, override: str | None = None) -> "ChatTemplate":
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        cfg = _read_json(cfg_path) if os.path.isfile(cfg_path) else {}
        return cls(load_chat_template(model_dir, override), cfg)

    def source(self, name: str | None = None, tools: Any = None) -> str:
        """Pick a template like HF: explicit name, else ``tool_use`` when tools are given, else default."""
        if name is not None:
            if name not in self.templates:
                raise ChatTemplateError(f"unknown chat template {name!r}; have {sorted(self.templates)}")
            return self.templates[name]
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        raise ChatTemplateError(f"several chat templates and no default: {sorted(self.templates)}")

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        *,
        add_generation_prompt: bool = True,
        preserve_thinking: bool | None = None,
        template_name: str | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the prompt text.

        ``preserve_thinking=False`` strips reasoning from assistant turns before the
        last user message; ``None`` leaves messages as given.  A non-None value is
        also passed to the template (Qwen3.6-style templates read it).  Extra
        ``kwargs`` (``enable_thinking``, ``reasoning_effort``...) become template variables.
        """
        if preserve_thinking is False:
            messages = strip_prior_reasoning(messages)
        if preserve_thinking is not None:
            kwargs["preserve_thinking"] = preserve_thinking
        msgs = _normalize_messages(messages)
        template = _compile(self.source(template_name, tools))
        variables = {**self.special_tokens, **kwargs}
        try:
            return template.render(
                messages=msgs,
                tools=copy.deepcopy(tools),
                documents=variables.pop("documents", None),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e.message or e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError) as e:
            raise ChatTemplateError(f"chat template failed: {type(e).__name__}: {e}") from e
