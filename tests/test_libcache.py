"""The compiled-library cache (compile/libcache.py): keyed on code, not on text; a hit returns what a build
returns."""
from __future__ import annotations

from pathlib import Path

from ninfer_mlc.compile import libcache

SRC = '''"""Module docstring."""
import numpy as np


def f(x):
    """Docstring."""
    # a comment
    return np.exp(x) * 2


class K:
    """Class docstring."""

    def g(self):
        return 1
'''


def test_code_tree_ignores_docstrings_comments_and_layout():
    edited = (SRC.replace('"""Module docstring."""', '"""Another docstring,\nover two lines."""')
              .replace("    # a comment\n", "").replace('"""Docstring."""', '"""Reworded."""')
              .replace("np.exp(x) * 2", "np.exp( x )*2").replace('    """Class docstring."""\n\n', ""))
    assert libcache._code_tree(edited) == libcache._code_tree(SRC)
    for change in (("* 2", "* 3"), ("return 1", "return 2"), ("import numpy as np", "import numpy")):
        assert libcache._code_tree(SRC.replace(*change)) != libcache._code_tree(SRC), change


def test_build_sources_cover_compiler_and_contract_not_verification_tools():
    names = {n for n, _ in libcache.build_sources()}
    assert {"compile/build.py", "compile/model.py", "compile/kernels/cuda/gemv.py",
            "contract/pool_layout.py"} <= names
    assert not [n for n in names if n.startswith("compile/kernels/cuda/emulate/") or n == "compile/fatbin.py"]
    assert all(Path(f).is_file() for _, f in libcache.build_sources())


def test_fetch_returns_the_stored_library_and_parameters(tmp_path, monkeypatch):
    monkeypatch.setenv("NINFER_LIB_CACHE", str(tmp_path / "cache"))
    built = tmp_path / "built.so"
    built.write_bytes(b"\x7fELF library")
    specs = [("w", [4, 8], "float32"), ("b", [8], "bfloat16")]
    assert libcache.fetch("k1", tmp_path / "out" / "a.so") is None
    libcache.store("k1", built, specs)
    got = libcache.fetch("k1", tmp_path / "out" / "a.so")
    assert got == specs and (tmp_path / "out" / "a.so").read_bytes() == b"\x7fELF library"
    assert not list((tmp_path / "cache").glob("*.tmp"))
    monkeypatch.delenv("NINFER_LIB_CACHE")
    assert libcache.fetch("k1", tmp_path / "out" / "b.so") is None
