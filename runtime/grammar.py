"""Constrained decoding with xgrammar: a constraint spec -> a per-request matcher that masks logits.

The engine calls, for each sampled step of a constrained request::

    matcher.fill_bitmask(out)   # out: int32 [ceil(V/32)], bit t of word t//32 set = token t allowed
    apply_bitmask(logits_row, out)
    ...sample...
    matcher.accept(token)       # False: the token breaks the grammar
    matcher.is_terminated()     # True once the grammar is complete and a stop token was accepted

(``mask_logits`` does the first two for a batch.) The bitmask is xgrammar's layout, so a device
sampler can take the same words: ``fill_bitmasks`` writes a batch's rows into one [B, ceil(V/32)]
array (all-allowed for unconstrained rows).

Specs (see ``structural_tags``) compile into xgrammar structural tags against the artifact's
tokenizer (``tokenizers`` tokenizer.json: vocabulary + the byte-level/byte-fallback metadata
xgrammar detects from it); compiled grammars are kept in an LRU keyed by the spec.

xgrammar's Python package imports torch and transformers at import time (for its torch bitmask
helpers and its transformers tokenizer adapter) although its C++ core, reached through
tvm-ffi, needs neither. Serving installs xgrammar without them, so ``load_core`` imports only
the binding (``xgrammar.base._core``) when torch or transformers is missing, and the whole
package otherwise; this module only uses that core, the same way in both cases.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
import threading
from collections import OrderedDict
from typing import Any, Optional, Sequence

import numpy as np

from .structural_tags import THINK_TAGS, ConstraintError, spec_key, structural_tag, tool_schemas_for_errors

__all__ = ["ConstraintError", "GrammarUnavailable", "ConstraintCompiler", "GrammarMatcher", "load_core",
           "bitmask_words", "allocate_bitmask", "apply_bitmask", "mask_logits", "fill_bitmasks"]

_core_lock = threading.Lock()
_core: Any = None


class GrammarUnavailable(RuntimeError):
    """xgrammar is not installed (or its native library does not load)."""


def load_core():
    """xgrammar's tvm-ffi core module (TokenizerInfo, GrammarCompiler, GrammarMatcher)."""
    global _core
    with _core_lock:
        if _core is None:
            _core = _import_core()
        return _core


def _import_core():
    if importlib.util.find_spec("xgrammar") is None:
        raise GrammarUnavailable("constrained decoding needs the xgrammar package "
                                 "(installed by scripts/serve.sh; see the README)")
    try:
        if "xgrammar" in sys.modules or all(importlib.util.find_spec(m) for m in ("torch", "transformers")):
            return importlib.import_module("xgrammar.base")._core
        return _import_binding_only()
    except (ImportError, OSError) as e:
        raise GrammarUnavailable(f"xgrammar failed to load: {e}") from e


def _import_binding_only():
    """Import xgrammar's native binding without running its package __init__ (which needs torch):
    the package module is created from its spec and registered, then only the modules that load
    the library and bind its objects are imported."""
    spec = importlib.util.find_spec("xgrammar")
    assert spec is not None  # _import_core checked that the package is installed
    pkg = importlib.util.module_from_spec(spec)
    sys.modules["xgrammar"] = pkg
    try:
        importlib.import_module("xgrammar.load_binding")
        return importlib.import_module("xgrammar.base")._core
    except BaseException:
        sys.modules.pop("xgrammar", None)
        raise


# ---- bitmask ---------------------------------------------------------------------------------
def bitmask_words(vocab_size: int) -> int:
    return (int(vocab_size) + 31) // 32


def allocate_bitmask(vocab_size: int) -> np.ndarray:
    """An all-allowed int32 bitmask for one row (xgrammar layout)."""
    return np.full(bitmask_words(vocab_size), -1, dtype=np.int32)


def apply_bitmask(logits_row: np.ndarray, bitmask: np.ndarray) -> None:
    """Set the logits of disallowed tokens to -inf, in place (float row [V], int32 mask [ceil(V/32)])."""
    v = logits_row.shape[-1]
    if bitmask.dtype != np.int32 or bitmask.shape != (bitmask_words(v),):
        raise ValueError(f"bitmask must be int32 [{bitmask_words(v)}] for {v} logits, "
                         f"got {bitmask.dtype} {bitmask.shape}")
    allowed = np.unpackbits(bitmask.view(np.uint8), count=v, bitorder="little")
    logits_row[allowed == 0] = -np.inf


def fill_bitmasks(matchers: Sequence[Optional["GrammarMatcher"]], out: np.ndarray) -> np.ndarray:
    """Each row's allowed tokens into ``out`` (int32 [B, W]); rows without a matcher allow every
    token. Returns bool [B]: the rows that restrict anything (the others need no masking)."""
    need = np.zeros(len(matchers), dtype=bool)
    for i, m in enumerate(matchers):
        if m is None:
            out[i] = -1
        else:
            need[i] = m.fill_bitmask(out[i])
    return need


def mask_logits(matchers: Sequence[Optional["GrammarMatcher"]], logits: np.ndarray) -> np.ndarray:
    """Mask each row of ``logits`` [B, V] whose matcher is set; returns a masked copy (or ``logits``
    itself when no row is constrained)."""
    if all(m is None for m in matchers):
        return logits
    out = np.array(logits, copy=True)
    for i, m in enumerate(matchers):
        if m is not None and m.fill_bitmask(m.scratch):
            apply_bitmask(out[i], m.scratch)
    return out


# ---- matcher ---------------------------------------------------------------------------------
class GrammarMatcher:
    """One request's position in its grammar (xgrammar GrammarMatcher); engine thread only."""

    __slots__ = ("_m", "vocab_size", "scratch")

    def __init__(self, handle, vocab_size: int):
        self._m = handle
        self.vocab_size = vocab_size
        self.scratch = allocate_bitmask(vocab_size)  # reused by mask_logits

    def fill_bitmask(self, out: np.ndarray) -> bool:
        """Write the allowed next tokens into ``out``; False when every token is allowed."""
        return bool(self._m.fill_next_token_bitmask(out, 0, False))

    def accept(self, token: int) -> bool:
        return bool(self._m.accept_token(int(token), False))

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(int(n))

    def is_terminated(self) -> bool:
        return bool(self._m.is_terminated())


# ---- compiler --------------------------------------------------------------------------------
# markers the grammars spell out: kept as text even where a tokenizer flags them special
_GRAMMAR_MARKERS = frozenset(THINK_TAGS) | {"<tool_call>", "</tool_call>"}


def encoded_vocab(tokenizer, vocab_size: int) -> list[str]:
    """Token strings by id, as the tokenizer stores them (byte-level symbols etc.), padded to the
    model's vocab. Special added tokens (<|im_start|> ...) become "" so xgrammar never allows them
    inside constrained text (the detokenizer would drop their text); stop tokens are allowed by id
    regardless."""
    vocab = [""] * vocab_size
    for text, tid in tokenizer.get_vocab(with_added_tokens=True).items():
        if tid < vocab_size:
            vocab[tid] = text
    for tid, added in tokenizer.get_added_tokens_decoder().items():
        if added.special and tid < vocab_size and added.content not in _GRAMMAR_MARKERS:
            vocab[tid] = ""
    return vocab


class ConstraintCompiler:
    """Compiles specs for one tokenizer; thread-safe (the server compiles while preparing a
    request, the engine then finds the grammar cached)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Sequence[int], cache_size: int = 64):
        self.tok = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = sorted({int(t) for t in stop_token_ids})
        self.cache_size = cache_size
        self._compiler = None
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"compiled": 0, "cache_hits": 0}

    def warm(self) -> None:
        """Load xgrammar and index the vocabulary now (seconds for a 250k vocabulary) rather than on
        the first constrained request; GrammarUnavailable when xgrammar is missing."""
        with self._lock:
            self._get_compiler()

    def warm_in_background(self) -> threading.Thread:
        """``warm`` on a daemon thread (serving starts it so the first constrained request is fast);
        a missing xgrammar is left for that request to report."""
        def work():
            try:
                self.warm()
            except GrammarUnavailable:
                pass

        t = threading.Thread(target=work, name="ninfer-grammar-warmup", daemon=True)
        t.start()
        return t

    def _get_compiler(self):
        if self._compiler is None:
            core = load_core()
            meta = json.loads(core.TokenizerInfo._detect_metadata_from_hf(self.tok.to_str()))
            info = core.TokenizerInfo(encoded_vocab(self.tok, self.vocab_size), meta["vocab_type"], self.vocab_size,
                                      self.stop_token_ids, meta["add_prefix_space"])
            threads = max(1, min(8, os.cpu_count() or 1))
            self._compiler = core.GrammarCompiler(info, threads, False, -1)  # our LRU is the cache
        return self._compiler

    def compile(self, spec: dict, reasoning: bool = False):
        """The compiled grammar of ``spec`` (ConstraintError when it cannot be honoured). Compiles
        run outside the lock (xgrammar's compiler is thread-safe), so a cache hit never waits."""
        key = spec_key(spec, reasoning)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.stats["cache_hits"] += 1
                return hit
            compiler = self._get_compiler()
        tag = structural_tag(spec, reasoning)
        try:
            compiled = compiler.compile_structural_tag(json.dumps(tag))
        except Exception as e:  # xgrammar reports bad schemas as RuntimeError / its own errors
            raise self._explain(compiler, spec, e) from None
        with self._lock:
            self._cache[key] = compiled
            self.stats["compiled"] += 1
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return compiled

    @staticmethod
    def _explain(compiler, spec: dict, err: Exception) -> ConstraintError:
        msg = _short_error(err)
        for name, tag in tool_schemas_for_errors(spec):
            try:
                compiler.compile_structural_tag(json.dumps(tag))
            except Exception as e:
                return ConstraintError(f"tool {name!r}: invalid parameters schema: {_short_error(e)}", tool=name)
        return ConstraintError(f"invalid schema: {msg}")

    def matcher(self, spec: dict, reasoning: bool = False) -> GrammarMatcher:
        compiled = self.compile(spec, reasoning)
        return GrammarMatcher(load_core().GrammarMatcher(compiled, None, False, -1, None), self.vocab_size)


def _short_error(e: Exception) -> str:
    """xgrammar's message without its '[time] /project/cpp/file.cc:N:' prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition(": ")
        if ".cc:" in head or ".h:" in head:
            return rest
    return text
