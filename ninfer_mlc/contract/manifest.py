"""The compiled-model artifact: a directory with a manifest, a library, weight shards, tokenizer.

`ninfer compile` writes the manifest, the runtime reads it; it names the library, the parameter
list in call order, the dtypes, the page size and context limit, and a sha256 of every file.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from .pool_layout import PoolLayout

SCHEMA = "ninfer-mlc-artifact"
SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
KV_DTYPES = ("float32", "bfloat16", "fp8", "nvfp4")  # page formats this runtime reads


class ArtifactError(RuntimeError):
    pass


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


@dataclass
class Manifest:
    name: str
    config: dict
    target: str  # llvm | cuda-sm_90 | cuda-sm_120
    dtype: str  # activation / weight dtype: float32 | bfloat16
    kv_dtype: str  # float32 | bfloat16 | fp8 | nvfp4 (`ninfer compile --kv-dtype`)
    page_size: int
    max_context: int
    library: str
    params: list  # [[name, shape, dtype], ...] in the order the library takes them
    weight_shards: list
    tvm_version: str
    files: dict = field(default_factory=dict)  # relative path -> sha256
    rope: dict = field(default_factory=dict)
    extras: dict = field(default_factory=dict)
    schema: str = SCHEMA
    schema_version: int = SCHEMA_VERSION

    def layout(self) -> PoolLayout:
        """Shapes of the pools this library's functions take."""
        return PoolLayout.of(self.config, self.dtype, self.kv_dtype, self.page_size)

    def to_json(self) -> str:
        return json.dumps(self.__dict__, indent=1, sort_keys=True)


def write_manifest(out_dir: Path, manifest: Manifest) -> None:
    files = {}
    for p in sorted(out_dir.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[str(p.relative_to(out_dir))] = sha256_file(p)
    manifest.files = files
    (out_dir / MANIFEST).write_text(manifest.to_json())


def read_manifest(art_dir: str | Path, verify: str = "size") -> Manifest:
    """Read and check an artifact. verify: "none" | "size" (library hashed) | "full" (everything hashed)."""
    art_dir = Path(art_dir)
    path = art_dir / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{art_dir} is not a compiled model: {MANIFEST} missing (run `ninfer compile`)")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ArtifactError(f"{path}: corrupt manifest ({e})") from None
    if raw.get("schema") != SCHEMA:
        raise ArtifactError(f"{path}: not a ninfer-mlc manifest")
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise ArtifactError(f"{path}: schema version {raw.get('schema_version')} (this runtime reads {SCHEMA_VERSION}); recompile")
    m = Manifest(**raw)
    if m.kv_dtype not in KV_DTYPES:
        raise ArtifactError(f"{path}: kv_dtype {m.kv_dtype!r} is not one of {KV_DTYPES}; recompile or upgrade")
    if verify != "none":
        for rel, digest in m.files.items():
            f = art_dir / rel
            if not f.is_file():
                raise ArtifactError(f"{art_dir}: file {rel} listed in the manifest is missing")
            if verify == "full" or rel == m.library:
                if sha256_file(f) != digest:
                    raise ArtifactError(f"{art_dir}: {rel} does not match its sha256 in the manifest")
    return m
