"""Command-line flags generated from the typed configuration dataclasses.

Each dataclass field becomes a flag named after it (`max_concurrency` -> `--max-concurrency`) with the
field's default, type, choices and help text, so a setting is declared once. Booleans that default
to False are switches (`--cors`); booleans that default to True get a negative switch
(`--no-prefix-reuse`) or, where listed, an on/off choice (`--cuda-graphs on|off`). `flag_for` turns
a field name from a ConfigError back into the flag the user typed.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from typing import TYPE_CHECKING, Any, Optional, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")

# field name -> flag spelling for the few that do not follow the rule
FLAG_NAMES = {"enable_thinking": "--no-thinking", "prefix_reuse": "--no-prefix-reuse"}
ON_OFF = {"cuda_graphs", "programmatic_launch", "messages_thinking_default"}  # booleans shown as `--flag on|off`


class CLIError(SystemExit):
    """Exit with status 2 and a one-line message that names the offending flag."""

    def __init__(self, msg: str):
        print(f"ninfer: error: {msg}", file=sys.stderr)
        super().__init__(2)


def flag_for(field_name: str) -> str:
    return FLAG_NAMES.get(field_name, "--" + field_name.replace("_", "-"))


def _base_type(tp: Any) -> Any:
    """int / float / str / bool of a field annotation (Optional[...] unwrapped)."""
    if isinstance(tp, str):
        tp = eval(tp, vars(typing), {})  # noqa: S307 - annotations of our own dataclasses
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0])
    return tp


def _help(f: dataclasses.Field, shown_default: Any) -> str:
    """The field's help with its default: the value, or the field's `default_text` when that is None."""
    text = f.metadata.get("help", "")
    if shown_default is None:
        shown_default = f.metadata.get("default_text")
    if shown_default is None:
        return text
    return f"{text} (default: {shown_default})" if text else f"(default: {shown_default})"


def _metavar(f: dataclasses.Field) -> str:
    return f.metadata.get("metavar") or f.name.split("_")[-1].upper()


def add_flags(parser: argparse.ArgumentParser | Any, cls: type, skip: tuple = (), only: Optional[tuple] = None,
              defaults: Optional[dict] = None) -> None:
    """Add one flag per field of dataclass `cls` (fields in `skip` left out; with `only`, just those).

    `defaults` replaces field defaults for this parser (e.g. `auto` where a command picks for the user).
    Field metadata: help, choices, metavar, default_text (shown when the default is None), off_help
    (the help of a `--no-...` switch).
    """
    for f in dataclasses.fields(cls):
        if f.name in skip or (only is not None and f.name not in only):
            continue
        default = (defaults or {}).get(f.name, f.default)
        tp = _base_type(f.type)
        flag = flag_for(f.name)
        choices = f.metadata.get("choices")
        if tp is bool:
            if f.name in ON_OFF:
                parser.add_argument(flag, dest=f.name, choices=("on", "off"), default="on" if default else "off",
                                    help=_help(f, "on" if default else "off"))
            elif default:
                parser.add_argument(flag, dest=f.name, action="store_false", default=True,
                                    help=f.metadata.get("off_help") or "turn off: " + f.metadata.get("help", f.name))
            else:
                parser.add_argument(flag, dest=f.name, action="store_true", default=False, help=f.metadata.get("help"))
            continue
        parser.add_argument(flag, dest=f.name, type=tp if tp in (int, float) else str, default=default,
                            choices=choices, metavar=None if choices else _metavar(f), help=_help(f, default))


def from_args(cls: type[T], args: argparse.Namespace, **extra: Any) -> T:
    """An instance of `cls` from parsed flags (fields the parser lacks keep their defaults)."""
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not hasattr(args, f.name):
            continue
        v = getattr(args, f.name)
        if f.name in ON_OFF and isinstance(v, str):
            v = v == "on"
        kw[f.name] = v
    kw.update(extra)
    return cls(**kw)


def group(parser: argparse.ArgumentParser, title: str, cls: type, skip: tuple = (), description: Optional[str] = None,
          only: Optional[tuple] = None, defaults: Optional[dict] = None):
    g = parser.add_argument_group(title, description)
    add_flags(g, cls, skip, only, defaults)
    return g
