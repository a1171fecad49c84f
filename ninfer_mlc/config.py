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
from typing import Any, Optional, TypeVar

T = TypeVar("T")

# field name -> flag spelling for the few that do not follow the rule
FLAG_NAMES = {"enable_thinking": "--no-thinking", "prefix_reuse": "--no-prefix-reuse"}
ON_OFF = {"cuda_graphs"}  # booleans shown as `--flag on|off`


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
    text = f.metadata.get("help", "")
    if shown_default is None:
        return text
    return f"{text} (default: {shown_default})" if text else f"(default: {shown_default})"


def add_flags(parser: argparse.ArgumentParser | Any, cls: type, skip: tuple = ()) -> None:
    """Add one flag per field of dataclass `cls` (fields in `skip` left out)."""
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        tp = _base_type(f.type)
        flag = flag_for(f.name)
        choices = f.metadata.get("choices")
        if tp is bool:
            if f.name in ON_OFF:
                parser.add_argument(flag, dest=f.name, choices=("on", "off"), default="on" if f.default else "off",
                                    help=_help(f, "on" if f.default else "off"))
            elif f.default:
                parser.add_argument(flag, dest=f.name, action="store_false", default=True,
                                    help="turn off: " + f.metadata.get("help", f.name))
            else:
                parser.add_argument(flag, dest=f.name, action="store_true", default=False, help=f.metadata.get("help"))
            continue
        parser.add_argument(flag, dest=f.name, type=tp if tp in (int, float) else str, default=f.default,
                            choices=choices, metavar=None if choices else f.name.split("_")[-1].upper(),
                            help=_help(f, f.default))


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


def group(parser: argparse.ArgumentParser, title: str, cls: type, skip: tuple = (), description: Optional[str] = None):
    g = parser.add_argument_group(title, description)
    add_flags(g, cls, skip)
    return g
