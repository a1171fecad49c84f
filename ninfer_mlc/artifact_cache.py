"""Compiled artifacts of Hub repos and Hugging Face directories, compiled once and reused.

Layout under cache_root() ($NINFER_CACHE_DIR, else $XDG_CACHE_HOME/ninfer-mlc, else ~/.cache/ninfer-mlc):

    artifacts/<source>/<variant>/   one artifact, exactly what `ninfer compile -o DIR` writes
      source:  <org>--<name>/<commit[:12]>        a Hub repo at its resolved commit
               local--<dirname>-<digest[:12]>     a directory (digest of its config, tokenizer, weight files)
      variant: <target>-<quant>-kv<kv dtype>-c<compiler[:10]>

The compiled context is the model's own (config.json + rope setup, so it is fixed by the source);
a smaller `--max-context` is applied at run time and never recompiles. `c<compiler>` hashes the
compiler and contract sources, the CUDA schedules and the TVM version, so upgrading ninfer
recompiles rather than loading a library the runtime no longer matches. A compile runs in
`<variant>.partial` under a file lock and is renamed into place when complete, so concurrent
`ninfer serve` processes compile once and a crash never leaves a half artifact that looks done.
Deleting any directory (or the whole cache) is safe: it is rebuilt on next use.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
from pathlib import Path
from typing import Callable

from .compile.options import CompileOptions
from .compile.progress import Progress
from .contract.manifest import MANIFEST

CACHE_ENV = "NINFER_CACHE_DIR"
# files whose content says what a local directory holds (weights by name, size and mtime: hashing
# tens of GB on every start would be too slow)
_IDENTITY_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "generation_config.json")


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "ninfer-mlc"


def hub_source_key(repo_id: str, commit: str) -> str:
    return f"{repo_id.replace('/', '--')}/{commit[:12]}"


def local_source_key(model_dir: Path) -> str:
    from .contract.safetensors_io import weight_files

    model_dir = model_dir.resolve()
    h = hashlib.sha256(str(model_dir).encode())
    for name in _IDENTITY_FILES:
        f = model_dir / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    for f in weight_files(model_dir):
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    return f"local--{model_dir.name}-{h.hexdigest()[:12]}"


def compiler_fingerprint() -> str:
    """Changes whenever a cached artifact could stop matching this installation."""
    from . import compile as compile_pkg
    from . import contract

    h = hashlib.sha256(importlib.metadata.version("apache-tvm").encode())
    for pkg in (compile_pkg, contract):
        assert pkg.__file__ is not None  # regular packages (with __init__.py), never namespace packages
        root = Path(pkg.__file__).parent
        for src in sorted(root.rglob("*.py")):
            h.update(str(src.relative_to(root)).encode() + b"\0" + src.read_bytes())
    schedules = Path(os.environ.get("NINFER_SCHEDULE_DIR") or Path(__file__).resolve().parent.parent / "schedules")
    for f in sorted(schedules.glob("*.json")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:10]


def variant_key(opts: CompileOptions) -> str:
    """opts after resolved(): concrete target and quant."""
    return f"{opts.target.replace(':', '-')}-{opts.quant}-kv{opts.kv_dtype or 'default'}-c{compiler_fingerprint()}"


def artifact_dir(source_key: str, opts: CompileOptions) -> Path:
    return cache_root() / "artifacts" / source_key / variant_key(opts)


def is_complete(art: Path) -> bool:
    return (art / MANIFEST).is_file()


def compiled_artifact(model_dir: Path, source_key: str, name: str, opts: CompileOptions,
                      progress: Progress, log: Callable[[str], None] = print) -> Path:
    """The cached artifact of `model_dir` compiled with `opts` (resolved), compiling it if absent."""
    from filelock import FileLock, Timeout

    final = artifact_dir(source_key, opts)
    if is_complete(final):
        log(f"ninfer: using the compiled model in {final}")
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(final) + ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log(f"ninfer: another process is compiling {final}; waiting for it")
        lock.acquire()
    try:
        if is_complete(final):
            return final
        partial = final.with_name(final.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)  # left by an interrupted compile
        log(f"ninfer: compiling {name} ({opts.target}, {opts.quant}) into {final}")
        from .compile.build import compile_model

        compile_model(model_dir, out_dir=partial, name=name, log=log, progress=progress, **opts.compile_kwargs())
        os.replace(partial, final)
        log(f"ninfer: compiled model ready in {final}")
        return final
    finally:
        lock.release()
