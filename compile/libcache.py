"""NINFER_LIB_CACHE=DIR: compiled libraries reused across builds of the same geometry (the test suite sets it,
so a suite run compiles each geometry once).

The key covers what shapes a library: geometry and dtypes, KV format and rotation, the MTP head, the weight
format, the FP4 MMA path and the multimodal functions (or the vision tower's config), the target, the TVM
version, the schedule files of CUDA targets, and the code that builds it: the syntax trees of compile/ and
contract/ without docstrings, comments or formatting (so editing those rebuilds nothing). compile/ modules
that never run in a build (LEFT_OUT) are not part of it.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import shutil
from pathlib import Path

from .. import contract
from .config import ModelConfig
from .targets import TargetSpec

COMPILE_DIR = Path(__file__).resolve().parent
CONTRACT_DIR = Path(contract.__file__).resolve().parent
# verification tools under compile/: the CPU emulator of the CUDA kernels, the fatbin reader
LEFT_OUT = ("kernels/cuda/emulate", "fatbin.py")


def _code_tree(src: str) -> str:
    """The module's syntax tree without docstrings and positions, as text."""
    tree = ast.parse(src)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def build_sources() -> list[tuple[str, Path]]:
    """[(name, file)] of the code a build runs: compile/ (but LEFT_OUT) and contract/."""
    out = []
    for label, root in (("compile", COMPILE_DIR), ("contract", CONTRACT_DIR)):
        for f in sorted(root.rglob("*.py")):
            rel = f.relative_to(root).as_posix()
            if label == "compile" and any(rel == x or rel.startswith(x + "/") for x in LEFT_OUT):
                continue
            out.append((f"{label}/{rel}", f))
    return out


@functools.lru_cache(maxsize=None)
def code_digest() -> str:
    """sha256 over the syntax trees of the compiler's build code (computed once per process)."""
    h = hashlib.sha256()
    for name, f in build_sources():
        h.update(name.encode() + b"\0" + _code_tree(f.read_text()).encode() + b"\0")
    return h.hexdigest()


def build_key(parts: list, target: TargetSpec) -> str:
    """Key of a library built from `parts` (JSON-able: what the caller's module depends on) for `target`: their
    digest with the target, TVM, the build code and, for CUDA targets, the schedule files."""
    import tvm

    from .kernels.registry import llvm_norm_gemv

    if target.kind == "llvm" and llvm_norm_gemv() is not None:  # a verification build: norms folded into GEMVs
        parts = [parts, ["llvm_norm_gemv", llvm_norm_gemv()]]
    h = hashlib.sha256(json.dumps([parts, target.name, tvm.__version__], sort_keys=True).encode())
    h.update(code_digest().encode())
    if target.kind == "cuda":  # schedule choices shape the CUDA library
        from .gpu_pipeline import SCHEDULE_DIR

        for f in sorted(Path(os.environ.get("NINFER_SCHEDULE_DIR", SCHEDULE_DIR)).glob("*.json")):
            h.update(f.read_bytes())
    return h.hexdigest()[:24]


def library_key(cfg: ModelConfig, dtype: str, target: TargetSpec, kv_dtype: str, kv_hadamard: bool, mtp: bool,
                weight_quant: str | None, fp4_mma: bool, multimodal: bool = False, tap_layers: tuple = (),
                max_rows: int | None = None) -> str:
    """Key of a model library (compile/build.py). The MTP head is compiled only when the checkpoint has it,
    the DFlash taps (prefill_t / verify_t) only for tap_layers; max_rows: the prefill-chunk row bound the
    memory is planned for (compile/memory_bounds.py)."""
    geo = {k: v for k, v in cfg.to_dict().items() if k not in ("bos_token_id", "eos_token_id", "architecture", "family", "rope")}
    parts = [geo, dtype, kv_dtype, kv_hadamard] + (["mtp"] if mtp else []) + ([["taps", list(tap_layers)]] if tap_layers else [])
    parts += [["rows", int(max_rows)]] if max_rows is not None else []
    return (build_key(parts, target)
            + (f"-{weight_quant}" if weight_quant else "") + ("-fp4mma" if fp4_mma else "") + ("-mm" if multimodal else ""))


def vision_key(vcfg, dtype: str, target: TargetSpec) -> str:
    """Key of a vision tower library (compile/vision_build.py; vcfg: a VisionConfig)."""
    return build_key([vcfg.to_dict(), dtype], target) + "-vision"


def _cache_dir() -> Path | None:
    d = os.environ.get("NINFER_LIB_CACHE")
    return Path(d) if d else None


def fetch(key: str, lib_path: Path) -> list | None:
    """Copy the cached library `key` to lib_path and return its parameter list [(name, shape, dtype)];
    None when it is not cached (or no cache is set)."""
    d = _cache_dir()
    if d is None or not (d / f"{key}.so").is_file() or not (d / f"{key}.json").is_file():
        return None
    specs = [tuple(x) for x in json.loads((d / f"{key}.json").read_text())]
    lib_path.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(d / f"{key}.so", lib_path)
    return specs


def store(key: str, lib_path: Path, specs: list) -> None:
    """Put a freshly built library and its parameter list into the cache (each file replaced atomically,
    the parameter list last: concurrent builders may race, a reader needs both)."""
    d = _cache_dir()
    if d is None:
        return
    d.mkdir(parents=True, exist_ok=True)
    for name, write in ((f"{key}.so", lambda t: shutil.copy2(lib_path, t)),
                        (f"{key}.json", lambda t: t.write_text(json.dumps(specs)))):
        tmp = d / f"{name}.{os.getpid()}.tmp"
        write(tmp)
        os.replace(tmp, d / name)
