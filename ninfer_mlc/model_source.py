"""What a MODEL argument names, the same for every `ninfer` command.

MODEL is one of
  - a compiled artifact directory (has manifest.json): used as it is;
  - a Hugging Face model directory (config.json + safetensors): compiled once into the artifact cache;
  - a Hub repo id `org/name` or `org/name@revision`: downloaded into the HF cache, compiled once.
An existing directory always wins over a repo id of the same spelling. `ninfer compile` takes the
last two (`source_for_compile`); serve, generate and bench take all three (`artifact_for`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from .compile.options import CompileOptions
from .compile.progress import Progress
from .contract.manifest import MANIFEST
from .hub import HubError, Snapshot, fetch, parse_ref


class ModelSourceError(Exception):
    """MODEL names nothing usable; the message says what was tried."""


@dataclass(frozen=True)
class Source:
    """An uncompiled model: where its files are, what to call it, and its key in the artifact cache."""

    path: Path
    name: str  # artifact name stem (file-name safe)
    cache_key: str
    repo_id: Optional[str] = None  # set for Hub models


def is_artifact(path: Path) -> bool:
    return (path / MANIFEST).is_file()


def source_for_compile(model: str) -> Source:
    """A Hugging Face directory or a Hub repo id (downloaded) as an uncompiled Source."""
    from .artifact_cache import hub_source_key, local_source_key

    path = Path(model).expanduser()
    if path.is_dir():
        if is_artifact(path):
            raise ModelSourceError(f"{model} is a compiled model already (it has {MANIFEST}); compile its source")
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{model}: neither a compiled model ({MANIFEST}) nor a Hugging Face model "
                                   f"directory (config.json + *.safetensors)")
        return Source(path, path.resolve().name, local_source_key(path))
    ref = parse_ref(model)
    if ref is None:
        raise ModelSourceError(f"{model}: no such directory, and not a Hugging Face repo id (org/name[@revision])")
    try:
        snap: Snapshot = fetch(ref)
    except HubError as e:
        raise ModelSourceError(str(e)) from None
    return Source(snap.path, snap.name, hub_source_key(ref.repo_id, snap.commit), ref.repo_id)


def artifact_for(model: Optional[str], opts: CompileOptions, default: Path, progress: Progress,
                 log: Callable[[str], None] = print) -> tuple[Path, Optional[str]]:
    """(compiled artifact directory, Hub repo id or None) for MODEL (None = `default`).

    Uncompiled models are compiled with `opts` (auto target/quant resolved here) into the artifact
    cache the first time and found there afterwards.
    """
    if model is None:
        return default, None
    path = Path(model).expanduser()
    if path.is_dir() and is_artifact(path):
        return path, None
    src = source_for_compile(model)
    from .artifact_cache import compiled_artifact

    resolved = opts.resolved()
    return compiled_artifact(src.path, src.cache_key, artifact_name(src, resolved), resolved, progress, log), src.repo_id


def artifact_name(src: Source, opts: CompileOptions) -> str:
    """NAME-QUANT-TARGET, the name `ninfer compile` gives a model (opts resolved)."""
    return f"{src.name}-{opts.quant}-{opts.target.replace(':', '-')}"
