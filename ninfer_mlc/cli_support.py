"""Pieces every `ninfer` subcommand shares: the MODEL argument, the flags that compile it, checked
number types, and one place that turns model and compile failures into a one-line CLIError."""
from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Iterator, Optional

from .config import CLIError, group

MODEL_HELP = ("a compiled model directory, a Hugging Face model directory or a Hub repo id (org/name[@revision]); "
              "the last two are compiled once into the cache (NINFER_CACHE_DIR, default ~/.cache/ninfer-mlc)")


def add_model_arg(parser: argparse.ArgumentParser, required: bool = False, default_text: str = "") -> None:
    help = MODEL_HELP + (f" (default: {default_text})" if default_text else "")
    if required:
        parser.add_argument("model", metavar="MODEL", help=help)
    else:
        parser.add_argument("model", metavar="MODEL", nargs="?", default=None, help=help)


def add_model_compile_flags(parser: argparse.ArgumentParser) -> None:
    """--target/--quant/--kv-dtype (the `ninfer compile` flags) for a MODEL that needs compiling."""
    from .compile.options import ARTIFACT_FIELDS, AUTO_DEFAULTS, CompileOptions

    group(parser, "compiling MODEL", CompileOptions, only=ARTIFACT_FIELDS, defaults=AUTO_DEFAULTS,
          description="used when MODEL is a repo id or a Hugging Face directory (ignored for a compiled model); "
                      "the compiled model is cached per (repo, commit, target, quant, kv dtype)")


def compile_options(args: argparse.Namespace):
    """The compile choices of serve/generate/bench (the rest keep compile's defaults; the context is the
    model's own, since serve's --max-context is a run-time limit)."""
    from .compile.options import ARTIFACT_FIELDS, CompileOptions

    return CompileOptions(**{f: getattr(args, f) for f in ARTIFACT_FIELDS if hasattr(args, f)})


def resolve_model(args: argparse.Namespace, default: Path) -> Path:
    """args.model -> a compiled artifact directory (downloading and compiling once when needed).

    A Hub model served without --model-id is served under its repo id (as vLLM does)."""
    from .compile.progress import Progress
    from .model_source import artifact_for

    with model_errors(args.model):
        art, repo_id = artifact_for(args.model, compile_options(args), default, Progress())
    if repo_id is not None and getattr(args, "model_id", "unset") is None:
        args.model_id = repo_id
    return art


@contextlib.contextmanager
def model_errors(model: Optional[str]) -> Iterator[None]:
    """Failures to find, download, compile or load a model -> `ninfer: error: ...`, no traceback."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - a bug (no message below) is re-raised as it is
        msg = _model_error_message(e, model)
        if msg is None:
            raise
        raise CLIError(msg) from None


def _model_error_message(e: Exception, model: Optional[str]) -> Optional[str]:
    """One line: engine settings name their flag, model problems say what was tried; None for a bug.
    (Imported here, not at the top: the compiler modules import TVM.)"""
    from .compile.config import ConfigError as CompileConfigError
    from .compile.targets import TargetError
    from .config import flag_for
    from .contract.manifest import ArtifactError
    from .contract.safetensors_io import SafetensorsError
    from .model_source import ModelSourceError
    from .runtime.errors import ConfigError

    convert = sys.modules.get(f"{__package__}.compile.convert")  # loaded whenever it raised
    if isinstance(e, ConfigError):
        return f"{flag_for(e.field)}: {e.message}"
    if isinstance(e, (ModelSourceError, CompileConfigError, TargetError)) or (
            convert is not None and isinstance(e, convert.ConversionError)):
        return str(e)
    if isinstance(e, (ArtifactError, SafetensorsError, ValueError, OSError)):
        return f"cannot load model {model}: {e}" if model else f"cannot load the model: {e}"
    return None


def int_at_least(lo: int):
    """argparse type: an integer >= lo (argparse names the flag in its error)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v

    parse.__name__ = f"integer >= {lo}"
    return parse


def non_negative_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not v >= 0 or v == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return v
