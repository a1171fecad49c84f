"""inspect.getmodule without the repeated sys.modules scan for frames that belong to no module.

TVMScript's parser calls inspect.stack() / inspect.getouterframes() for every prim_func it parses (to see
the caller's variables). For a frame whose file is not on disk (<frozen importlib._bootstrap>, <frozen
runpy>, <ast>, ...) inspect.getsourcefile asks inspect.getmodule, which then walks every module in
sys.modules (hasattr(module, "__file__") on each) and finds none; with torch and transformers loaded that
is thousands of modules, per such frame, per parse. A CUDA build parses hundreds of prim_funcs (our
kernels, tvm.s_tir.tensor_intrin): the tiny-model sm_120 build under pytest spent 190 s of CPU, 45 s
without the scans; importing tvm.s_tir.tensor_intrin with torch loaded, 45 s instead of 7.

install() wraps inspect.getmodule: a frame or code object whose file name found no module is answered None
again without the walk until a module is added to or removed from sys.modules. Every other call goes to
the original.
"""
from __future__ import annotations

import inspect
import sys

_misses: dict[str, int] = {}  # file name -> len(sys.modules) when its lookup found no module


def _getmodule(obj, _filename=None, _orig=inspect.getmodule):
    if _filename is None or not (inspect.isframe(obj) or inspect.iscode(obj)):
        return _orig(obj, _filename)
    if _misses.get(_filename) == len(sys.modules):
        return None
    module = _orig(obj, _filename)
    if module is None:
        _misses[_filename] = len(sys.modules)
    return module


def install() -> None:
    """Put the wrapper in place (once; ninfer_mlc.compile does it on import)."""
    inspect.getmodule = _getmodule
