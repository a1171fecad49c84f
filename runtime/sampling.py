"""Token sampling for the runtime (CPU side, pure numpy).

Logits arrive from the model as ``float32`` arrays of shape ``[B, V]``.  Every row carries
its own :class:`RowState` (parameters, private random generator, tokens seen so far), so a
seeded request draws the same tokens whatever batch it lands in and at whatever position.

Processing order for one row (mirrors HF ``generate`` / vLLM):

1. ``logit_bias`` (added to the raw logits)
2. ``repetition_penalty`` (HF / llama.cpp: over prompt + generated tokens; positive logits are
   divided, negative ones multiplied), then ``frequency_penalty`` and ``presence_penalty``
   (OpenAI: over *generated* tokens only)
3. ``temperature`` (0 => greedy: argmax of the penalised logits, ties -> lowest id)
4. ``top_k`` -> ``top_p`` -> ``min_p`` on the (renormalised) probabilities
5. one inverse-CDF draw with a single uniform from the row's generator, candidates in
   ascending token-id order (so the draw depends only on the final distribution).

``probs_after_processing`` exposes the final distribution (speculative decoding needs
target and draft distributions) and ``sample_from_probs`` draws from any distribution
with the same inverse-CDF rule.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

import numpy as np

__all__ = [
    "SamplingError",
    "SamplingParams",
    "PRESETS",
    "get_preset",
    "normalize_family",
    "merge_sampling_params",
    "resolve_sampling_params",
    "RowState",
    "TokenLogprobs",
    "Sampler",
    "probs_after_processing",
    "sample_from_probs",
    "argmax",
    "needs_logit_edit",
    "log_softmax_top",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_TOP_LOGPROBS",
]

MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 2048  # per stop string; matching is linear, the bound keeps requests small
MAX_TOP_LOGPROBS = 20
_LOGIT_BIAS_LIMIT = 100.0
_PENALTY_LIMIT = 2.0
_TEMPERATURE_MAX = 2.0
GREEDY_BELOW = 1e-5  # a temperature below this samples greedily
_REPETITION_MIN = 1e-6  # the penalty divides / multiplies float32 logits: beyond 1e6 either way they overflow or vanish
# When top_p is on and no top_k is given, first try the _TOP_P_PROBE (then 16x that) most
# likely tokens; if they already hold top_p of the mass, only they are sorted (no full sort).
_TOP_P_PROBE = 1024
# Block size for blocked prefix sums over large supports (instead of one full cumsum).
_DRAW_BLOCK = 1024


class SamplingError(ValueError):
    """A bad sampling parameter.  ``param`` names it (the server returns HTTP 400 with it)."""

    def __init__(self, param: str, message: str):
        self.param = param
        self.message = message
        super().__init__(f"{param}: {message}")


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, (bool, np.bool_))


@dataclass
class SamplingParams:
    """Per-request sampling parameters (OpenAI-style names)."""

    temperature: float = 1.0  # 0 => greedy
    top_p: float = 1.0  # (0, 1]; 1 => off
    top_k: int = 0  # 0 or -1 => off
    min_p: float = 0.0  # [0, 1]; 0 => off
    presence_penalty: float = 0.0  # [-2, 2], OpenAI semantics, generated tokens only
    frequency_penalty: float = 0.0  # [-2, 2], OpenAI semantics, generated tokens only
    repetition_penalty: float = 1.0  # > 0; 1 => off; HF semantics over prompt + generated
    seed: Optional[int] = None  # None => fresh OS entropy
    max_tokens: Optional[int] = None  # None => up to the context limit (scheduler decides)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    n: int = 1  # only 1 is supported
    logprobs: bool = False
    top_logprobs: int = 0  # [0, 20]

    def __post_init__(self) -> None:
        # Friendly coercions of shapes the OpenAI API allows; validate() does the checking.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        elif isinstance(self.stop, (tuple, set, frozenset)):
            self.stop = list(self.stop)
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        elif isinstance(self.stop_token_ids, (tuple, set, frozenset, np.ndarray)):
            self.stop_token_ids = list(self.stop_token_ids)
        if self.logit_bias is None:
            self.logit_bias = {}

    # -- helpers -------------------------------------------------------------------------
    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def effective_top_k(self) -> int:
        """``top_k`` with both "off" spellings mapped to 0."""
        return 0 if self.top_k in (0, -1) else int(self.top_k)

    def replace(self, **changes: Any) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # -- validation ----------------------------------------------------------------------
    def validate(self, vocab_size: Optional[int] = None) -> "SamplingParams":
        """Check every field; raise :class:`SamplingError` naming the first bad one.

        ``vocab_size`` (when known) bounds ``logit_bias`` and ``stop_token_ids`` ids.
        ``logit_bias`` keys given as strings (JSON object keys) are converted to ints.
        Returns ``self`` for chaining.
        """

        def number(name: str) -> float:
            v = getattr(self, name)
            if not _is_number(v):
                raise SamplingError(name, f"must be a number, got {v!r}")
            v = float(v)
            if math.isnan(v):
                raise SamplingError(name, "must not be NaN")
            return v

        t = number("temperature")
        if not (0.0 <= t <= _TEMPERATURE_MAX):
            raise SamplingError("temperature", f"must be in [0, {_TEMPERATURE_MAX:g}] (0 means greedy), got {t:g}")
        if 0.0 < t < GREEDY_BELOW:  # logits / t overflows; the distribution is the argmax anyway (as vLLM)
            self.temperature = 0.0

        p = number("top_p")
        if not (0.0 < p <= 1.0):
            raise SamplingError("top_p", f"must be in (0, 1], got {p:g}")

        if not _is_int(self.top_k):
            raise SamplingError("top_k", f"must be an integer, got {self.top_k!r}")
        if self.top_k < -1:
            raise SamplingError("top_k", f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k}")

        mp = number("min_p")
        if not (0.0 <= mp <= 1.0):
            raise SamplingError("min_p", f"must be in [0, 1], got {mp:g}")

        for name in ("presence_penalty", "frequency_penalty"):
            v = number(name)
            if not (-_PENALTY_LIMIT <= v <= _PENALTY_LIMIT):
                raise SamplingError(name, f"must be in [-2, 2], got {v:g}")

        rp = number("repetition_penalty")
        if not (_REPETITION_MIN <= rp <= 1 / _REPETITION_MIN):
            raise SamplingError("repetition_penalty", f"must be in [{_REPETITION_MIN:g}, {1 / _REPETITION_MIN:g}] "
                                                      f"(1 disables it), got {rp:g}")

        if self.seed is not None and not _is_int(self.seed):
            raise SamplingError("seed", f"must be an integer or null, got {self.seed!r}")

        if self.max_tokens is not None:
            if not _is_int(self.max_tokens):
                raise SamplingError("max_tokens", f"must be an integer, got {self.max_tokens!r}")
            if self.max_tokens < 1:
                raise SamplingError("max_tokens", f"must be at least 1, got {self.max_tokens}")

        if not isinstance(self.stop, list):
            raise SamplingError("stop", "must be a string or a list of strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise SamplingError("stop", f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(self.stop)}")
        for i, s in enumerate(self.stop):
            if not isinstance(s, str):
                raise SamplingError("stop", f"stop[{i}] must be a string, got {type(s).__name__}")
            if s == "":
                raise SamplingError("stop", f"stop[{i}] is an empty string; stop strings must be non-empty")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise SamplingError("stop", f"stop[{i}] has {len(s)} characters; at most {MAX_STOP_STRING_CHARS} "
                                            "are allowed")

        if not isinstance(self.stop_token_ids, list):
            raise SamplingError("stop_token_ids", "must be a list of token ids")
        for i, tid in enumerate(self.stop_token_ids):
            if not _is_int(tid) or tid < 0:
                raise SamplingError("stop_token_ids", f"stop_token_ids[{i}] must be a non-negative integer, got {tid!r}")
            if vocab_size is not None and tid >= vocab_size:
                raise SamplingError("stop_token_ids", f"token id {tid} is out of the vocabulary (size {vocab_size})")

        if not isinstance(self.ignore_eos, (bool, np.bool_)):
            raise SamplingError("ignore_eos", f"must be a boolean, got {self.ignore_eos!r}")

        if not isinstance(self.logit_bias, Mapping):
            raise SamplingError("logit_bias", "must be an object mapping token ids to bias values")
        bias: dict[int, float] = {}
        for k, v in self.logit_bias.items():
            try:
                if isinstance(k, (bool, np.bool_)) or isinstance(k, float):
                    raise ValueError
                tid = int(k)  # JSON keys are strings
            except (TypeError, ValueError):
                raise SamplingError("logit_bias", f"key {k!r} is not an integer token id") from None
            if tid < 0 or (vocab_size is not None and tid >= vocab_size):
                size = f" (size {vocab_size})" if vocab_size is not None else ""
                raise SamplingError("logit_bias", f"token id {tid} is out of the vocabulary{size}")
            if not _is_number(v) or math.isnan(float(v)):
                raise SamplingError("logit_bias", f"bias for token {tid} must be a number, got {v!r}")
            if not (-_LOGIT_BIAS_LIMIT <= float(v) <= _LOGIT_BIAS_LIMIT):
                raise SamplingError("logit_bias", f"bias for token {tid} must be in [-100, 100], got {float(v):g}")
            bias[tid] = float(v)
        self.logit_bias = bias

        if not _is_int(self.n):
            raise SamplingError("n", f"must be an integer, got {self.n!r}")
        if self.n != 1:
            raise SamplingError("n", f"only n=1 is supported, got {self.n}")

        if not isinstance(self.logprobs, (bool, np.bool_)):
            raise SamplingError("logprobs", f"must be a boolean, got {self.logprobs!r}")
        if not _is_int(self.top_logprobs):
            raise SamplingError("top_logprobs", f"must be an integer, got {self.top_logprobs!r}")
        if not (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS):
            raise SamplingError("top_logprobs", f"must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}")
        return self


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))

# ---------------------------------------------------------------------------------------
# Presets: recommended sampling per model family and mode ("thinking" / "non_thinking").
# ---------------------------------------------------------------------------------------
_QWEN35_THINKING = dict(temperature=1.0, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=0.0)
_QWEN35_NON_THINKING = dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, presence_penalty=1.5)
_QWEN3_THINKING = dict(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, presence_penalty=0.0)
_QWEN3_NON_THINKING = dict(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, presence_penalty=0.0)

PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # Qwen3.5 hybrid (Gated DeltaNet + gated attention) family.
    "qwen3.5": {"thinking": _QWEN35_THINKING, "non_thinking": _QWEN35_NON_THINKING},
    # Qwen3-Next (model cards: thinking 0.6/0.95/20/0, instruct 0.7/0.8/20/0).
    "qwen3-next": {"thinking": _QWEN3_THINKING, "non_thinking": _QWEN3_NON_THINKING},
    # Original Qwen3 dense/MoE.
    "qwen3": {"thinking": _QWEN3_THINKING, "non_thinking": _QWEN3_NON_THINKING},
    # Unknown families: plain defaults (no overrides).
    "default": {"thinking": {}, "non_thinking": {}},
}

_FAMILY_ALIASES = {
    "qwen3.5": "qwen3.5",
    "qwen3-5": "qwen3.5",
    "qwen35": "qwen3.5",
    "qwen3.5-moe": "qwen3.5",
    "qwen3-5-moe": "qwen3.5",
    "qwen3-next": "qwen3-next",
    "qwen3next": "qwen3-next",
    "qwen3": "qwen3",
    "qwen3-moe": "qwen3",
}


def normalize_family(family: Optional[str]) -> str:
    """Map a model family / HF ``model_type`` (``qwen3_next``, ``Qwen3.5`` ...) to a PRESETS key."""
    if not family:
        return "default"
    key = family.strip().lower().replace("_", "-")
    if key in PRESETS:
        return key
    return _FAMILY_ALIASES.get(key, "default")


def get_preset(family: Optional[str], thinking: bool | str = True) -> dict[str, Any]:
    """Recommended params (a fresh dict) for ``family`` in thinking or non-thinking mode.

    ``thinking`` may be a bool or one of ``"thinking"`` / ``"non_thinking"``.
    """
    if isinstance(thinking, str):
        mode = thinking.strip().lower().replace("-", "_")
        if mode not in ("thinking", "non_thinking"):
            raise ValueError(f"unknown preset mode {thinking!r} (use 'thinking' or 'non_thinking')")
    else:
        mode = "thinking" if thinking else "non_thinking"
    return dict(PRESETS[normalize_family(family)][mode])


def merge_sampling_params(*layers: Optional[Mapping[str, Any]], validate: bool = True,
                          vocab_size: Optional[int] = None) -> SamplingParams:
    """Merge layers of params, lowest priority first, over the dataclass defaults.

    A key whose value is ``None`` counts as "not given" and leaves the lower layer's value.
    Unknown keys raise :class:`SamplingError`.  The result is validated unless
    ``validate=False``.
    """
    merged: dict[str, Any] = {}
    for layer in layers:
        if not layer:
            continue
        for k, v in layer.items():
            if k not in _FIELD_NAMES:
                raise SamplingError(k, "unknown sampling parameter")
            if v is not None:
                merged[k] = v
    params = SamplingParams(**merged)
    if validate:
        params.validate(vocab_size)
    return params


def resolve_sampling_params(request: Optional[Mapping[str, Any]] = None,
                            overrides: Optional[Mapping[str, Any]] = None,
                            family: Optional[str] = None,
                            thinking: bool | str = True,
                            vocab_size: Optional[int] = None,
                            model_defaults: Optional[Mapping[str, Any]] = None) -> SamplingParams:
    """request > process overrides (CLI / server config) > family preset > the model's
    generation_config.json defaults > dataclass defaults."""
    return merge_sampling_params(model_defaults, get_preset(family, thinking), overrides, request,
                                 vocab_size=vocab_size)


# ---------------------------------------------------------------------------------------
# Per-row state
# ---------------------------------------------------------------------------------------
def _make_rng(seed: Optional[int]) -> np.random.Generator:
    if seed is None:
        return np.random.default_rng()
    return np.random.default_rng(int(seed) % (1 << 64))  # negative seeds allowed (OpenAI)


class RowState:
    """Everything one sequence needs for sampling: params, its own RNG, token history.

    ``prompt_token_ids`` feed only ``repetition_penalty``; generated tokens (``append``)
    feed all three penalties.  ``snapshot``/``restore`` and ``rollback`` let speculative
    decoding undo rejected tokens and RNG draws.
    """

    __slots__ = ("params", "rng", "output_token_ids", "output_counts", "_prompt_ids",
                 "_prompt_set", "_rep_mask")

    def __init__(self, params: SamplingParams, prompt_token_ids: Optional[Sequence[int]] = None,
                 rng: Optional[np.random.Generator] = None):
        self.params = params
        self.rng = rng if rng is not None else _make_rng(params.seed)
        self.output_token_ids: list[int] = []
        self.output_counts: dict[int, int] = {}
        if prompt_token_ids is None or len(prompt_token_ids) == 0:
            self._prompt_ids = np.zeros(0, dtype=np.int64)
        else:
            self._prompt_ids = np.unique(np.asarray(prompt_token_ids, dtype=np.int64))
        self._prompt_set: Optional[set[int]] = None
        self._rep_mask: Optional[np.ndarray] = None  # lazily built dense mask [V] (prompt | generated)

    # -- history -------------------------------------------------------------------------
    @property
    def prompt_ids(self) -> np.ndarray:
        """Unique prompt token ids (int64, sorted): what repetition_penalty sees besides generated tokens."""
        return self._prompt_ids

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids)

    def append(self, token_id: int) -> None:
        t = int(token_id)
        self.output_token_ids.append(t)
        self.output_counts[t] = self.output_counts.get(t, 0) + 1
        if self._rep_mask is not None and t < self._rep_mask.shape[0]:
            self._rep_mask[t] = True

    def extend(self, token_ids: Iterable[int]) -> None:
        for t in token_ids:
            self.append(t)

    def rollback(self, n: int) -> None:
        """Forget the last ``n`` generated tokens (not the RNG draws; see ``restore``)."""
        if n < 0 or n > len(self.output_token_ids):
            raise ValueError(f"cannot roll back {n} of {len(self.output_token_ids)} tokens")
        for _ in range(n):
            t = self.output_token_ids.pop()
            c = self.output_counts[t] - 1
            if c:
                self.output_counts[t] = c
            else:
                del self.output_counts[t]
                if self._rep_mask is not None and t < self._rep_mask.shape[0]:
                    if self._prompt_set is None:
                        self._prompt_set = set(self._prompt_ids.tolist())
                    if t not in self._prompt_set:
                        self._rep_mask[t] = False

    def snapshot(self) -> tuple[int, Mapping[str, Any]]:
        """(number of generated tokens, RNG state) to hand to :meth:`restore`."""
        return len(self.output_token_ids), self.rng.bit_generator.state

    def restore(self, snap: tuple[int, Mapping[str, Any]]) -> None:
        n, rng_state = snap
        self.rollback(len(self.output_token_ids) - n)
        self.rng.bit_generator.state = rng_state

    # -- arrays for penalties ------------------------------------------------------------
    def repetition_mask(self, vocab_size: int) -> np.ndarray:
        """Dense bool mask [V] of tokens seen in prompt or generated output."""
        m = self._rep_mask
        if m is None or m.shape[0] != vocab_size:
            m = np.zeros(vocab_size, dtype=bool)
            ids = self._prompt_ids[self._prompt_ids < vocab_size]
            m[ids] = True
            if self.output_counts:
                g = np.fromiter(self.output_counts.keys(), dtype=np.int64, count=len(self.output_counts))
                m[g[(g >= 0) & (g < vocab_size)]] = True
            self._rep_mask = m
        return m

    def output_count_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(unique generated ids, their counts) as int64 / float64 arrays."""
        n = len(self.output_counts)
        ids = np.fromiter(self.output_counts.keys(), dtype=np.int64, count=n)
        counts = np.fromiter(self.output_counts.values(), dtype=np.float64, count=n)
        return ids, counts


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token plus the top-N alternatives (descending, ties -> lower id)."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token in the distribution used
    top_ids: np.ndarray  # int32 [N]
    top_logprobs: np.ndarray  # float32 [N]


# ---------------------------------------------------------------------------------------
# Processing
# ---------------------------------------------------------------------------------------
def needs_logit_edit(params: SamplingParams, state: Optional[RowState]) -> bool:
    if params.logit_bias:
        return True
    if state is None:
        return False
    if params.repetition_penalty != 1.0:
        return True
    return bool(state.output_counts) and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0)


def _penalised_logits(row: np.ndarray, params: SamplingParams, state: Optional[RowState]) -> np.ndarray:
    """logit_bias then repetition / frequency / presence penalties; float32 [V].

    Returns ``row`` itself (not a copy) when nothing applies.
    """
    if not needs_logit_edit(params, state):
        return row
    x = np.array(row, dtype=np.float32, copy=True)
    V = x.shape[0]
    if params.logit_bias:
        ids = np.fromiter((int(k) for k in params.logit_bias.keys()), dtype=np.int64, count=len(params.logit_bias))
        vals = np.fromiter((float(v) for v in params.logit_bias.values()), dtype=np.float32, count=len(ids))
        ok = (ids >= 0) & (ids < V)
        np.add.at(x, ids[ok], vals[ok])
    if state is not None:
        rp = params.repetition_penalty
        if rp != 1.0:
            idx = np.flatnonzero(state.repetition_mask(V))
            if idx.size:
                s = x[idx]
                x[idx] = np.where(s < 0, s * np.float32(rp), s / np.float32(rp))
        if state.output_counts and (params.presence_penalty != 0.0 or params.frequency_penalty != 0.0):
            ids, counts = state.output_count_arrays()
            ok = (ids >= 0) & (ids < V)
            ids, counts = ids[ok], counts[ok]
            pen = counts * params.frequency_penalty + params.presence_penalty
            x[ids] = (x[ids].astype(np.float64) - pen).astype(np.float32)
    return x


def penalised_logits(row: np.ndarray, params: SamplingParams, state: Optional[RowState]) -> np.ndarray:
    """The logits a request samples from before temperature and truncation (logit_bias, penalties):
    what a proposer ranks its candidates by (DFlash2's selector)."""
    return _penalised_logits(row, params, state)


def argmax(x: np.ndarray) -> int:
    """Argmax, ties -> lowest id; NaN logits are treated as -inf."""
    i = int(np.argmax(x))
    if np.isnan(x[i]):
        clean = np.where(np.isnan(x), -np.inf, x)
        i = int(np.argmax(clean))
    return i


def _top_p_keep_count(desc: np.ndarray, top_p: float) -> int:
    """Number of leading entries of ``desc`` (descending probs) whose exclusive prefix
    mass is < top_p, at least 1.  Equals ``count_nonzero(cumsum(desc) - desc < top_p)``
    (exclusive prefix of entry j is cumsum[j-1]); blocked for long arrays."""
    n = desc.shape[0]
    if n <= 4 * _DRAW_BLOCK:
        cs = np.cumsum(desc[:-1])
        return 1 + int(np.searchsorted(cs, top_p, side="left"))
    starts = np.arange(0, n - 1, _DRAW_BLOCK)
    cb = np.cumsum(np.add.reduceat(desc[:-1], starts))
    b = int(np.searchsorted(cb, top_p, side="left"))  # full blocks entirely < top_p
    if b >= starts.shape[0]:
        return n
    lo = int(starts[b])
    cs = np.cumsum(desc[lo:min(lo + _DRAW_BLOCK, n - 1)]) + (cb[b - 1] if b > 0 else 0.0)
    return 1 + lo + int(np.searchsorted(cs, top_p, side="left"))


def _filtered_distribution(x: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Temperature, top-k, top-p, min-p on penalised logits ``x`` (float32 [V]).

    Returns ``(ids, probs)``: candidate token ids in ascending order (int64) and their
    probabilities (float64, summing to 1).  Tokens outside ``ids`` have probability 0.
    Requires ``params.temperature > 0``.
    """
    V = x.shape[0]
    k = params.effective_top_k
    if np.isnan(x).any():
        x = np.where(np.isnan(x), -np.inf, x)
    if 0 < k < V:
        # Threshold semantics (HF TopKLogitsWarper): keep every token >= the k-th largest.
        thr = np.partition(x, V - k)[V - k]
        ids = np.flatnonzero(x >= thr)
        vals = x[ids].astype(np.float64)
    else:
        ids = None
        vals = x.astype(np.float64)
    m = vals.max()
    if not np.isfinite(m):  # every logit -inf (or +inf): fall back to argmax
        i = argmax(x)
        return np.array([i], dtype=np.int64), np.ones(1)
    t = float(params.temperature)
    z = (vals - m) / t if t != 1.0 else vals - m
    p = np.exp(z)
    p /= p.sum()

    if params.top_p < 1.0:
        # HF TopPLogitsWarper: drop tokens whose ascending cumulative mass <= 1 - top_p,
        # i.e. keep (in descending order) while the mass strictly above is < top_p; the
        # top token is always kept.  Only values are sorted (no argsort): the cut-off
        # probability becomes a threshold; exact ties at the threshold are all kept.
        top_p = float(params.top_p)
        n = p.shape[0]
        desc = None
        for probe in (_TOP_P_PROBE, 16 * _TOP_P_PROBE):
            if n > 2 * probe:
                part = np.partition(p, n - probe)[n - probe:]
                if part.sum() >= top_p:
                    desc = np.sort(part)[::-1]
                    break
            else:
                break
        if desc is None:
            desc = np.sort(p)[::-1]
        keep_n = _top_p_keep_count(desc, top_p)
        keep = p >= desc[keep_n - 1]
        ids = np.flatnonzero(keep) if ids is None else ids[keep]
        p = p[keep]
        p = p / p.sum()
    if params.min_p > 0.0:
        keep = p >= params.min_p * p.max()
        if ids is None:
            ids = np.flatnonzero(keep)
        else:
            ids = ids[keep]
        p = p[keep]
        p = p / p.sum()
    if ids is None:
        ids = np.arange(V, dtype=np.int64)
    nz = p > 0
    if not nz.all():
        ids, p = ids[nz], p[nz]
    return ids.astype(np.int64, copy=False), p


def _draw(ids: np.ndarray, probs: np.ndarray, u: float) -> int:
    """Inverse CDF: first candidate (ascending id order) whose cumulative mass exceeds
    ``u * total``.  ``probs`` must be positive.  Large supports are walked in blocks
    (block sums, then a cumsum inside one block) instead of one full cumsum."""
    n = probs.shape[0]
    if n <= 4 * _DRAW_BLOCK:
        cs = np.cumsum(probs)
        j = int(np.searchsorted(cs, u * cs[-1], side="right"))
        return int(ids[min(j, n - 1)])
    starts = np.arange(0, n, _DRAW_BLOCK)
    cb = np.cumsum(np.add.reduceat(probs, starts))
    target = u * cb[-1]
    b = min(int(np.searchsorted(cb, target, side="right")), starts.shape[0] - 1)
    rem = target - (cb[b - 1] if b > 0 else 0.0)
    lo = int(starts[b])
    cs = np.cumsum(probs[lo:lo + _DRAW_BLOCK])
    j = min(int(np.searchsorted(cs, rem, side="right")), cs.shape[0] - 1)
    return int(ids[lo + j])


def sample_from_probs(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Inverse-CDF draw (one uniform from ``rng``) from a dense distribution [V].

    Same rule as :class:`Sampler` (ascending ids, zero-probability ids never drawn);
    useful for the residual distribution in speculative-decoding rejection sampling.
    """
    p = np.asarray(probs, dtype=np.float64)
    ids = np.flatnonzero(p > 0)
    if ids.size == 0:
        raise ValueError("distribution has no positive mass")
    return _draw(ids, p[ids], float(rng.random()))


def probs_after_processing(logits_row: np.ndarray, params: SamplingParams,
                           state: Optional[RowState] = None) -> np.ndarray:
    """Final sampling distribution (float64 [V]) for one row of logits.

    Exactly the distribution :class:`Sampler` draws from; greedy params give a one-hot
    vector at the argmax.  ``state=None`` means no history (no penalties besides bias).
    """
    row = np.asarray(logits_row, dtype=np.float32)
    if row.ndim != 1:
        raise ValueError(f"logits_row must be 1-D, got shape {row.shape}")
    x = _penalised_logits(row, params, state)
    out = np.zeros(row.shape[0], dtype=np.float64)
    if params.temperature == 0:
        out[argmax(x)] = 1.0
        return out
    ids, p = _filtered_distribution(x, params)
    out[ids] = p
    return out


def log_softmax_top(x: np.ndarray, token: int, n_top: int) -> TokenLogprobs:
    xd = x.astype(np.float64)
    if np.isnan(xd).any():
        xd = np.where(np.isnan(xd), -np.inf, xd)
    m = xd.max()
    if not np.isfinite(m):
        lse = m
    else:
        lse = m + math.log(float(np.exp(xd - m).sum()))
    lp = xd - lse
    tok_lp = float(lp[token])
    rank = int(np.count_nonzero(lp > tok_lp)) + 1
    V = lp.shape[0]
    if n_top > 0:
        n_top = min(n_top, V)
        if n_top < V:
            cand = np.argpartition(-lp, n_top - 1)[:n_top]
            # include ties with the n-th value so that the lowest ids win ties
            thr = lp[cand].min()
            cand = np.flatnonzero(lp >= thr)
        else:
            cand = np.arange(V)
        order = np.lexsort((cand, -lp[cand]))[:n_top]
        top = cand[order]
        return TokenLogprobs(token, tok_lp, rank, top.astype(np.int32), lp[top].astype(np.float32))
    return TokenLogprobs(token, tok_lp, rank, np.zeros(0, np.int32), np.zeros(0, np.float32))


class Sampler:
    """Samples one token per row of a ``[B, V]`` float32 logits batch.

    ``logprobs_mode``: ``"raw"`` (default) reports log-softmax of the model's raw logits
    (what vLLM does by default); ``"processed"`` reports log-softmax after logit_bias,
    penalties and temperature (before top-k/top-p/min-p truncation).
    """

    def __init__(self, logprobs_mode: str = "raw"):
        if logprobs_mode not in ("raw", "processed"):
            raise ValueError("logprobs_mode must be 'raw' or 'processed'")
        self.logprobs_mode = logprobs_mode

    def sample(self, logits: np.ndarray, rows: Sequence[RowState], return_logprobs: bool = False,
               update_state: bool = True):
        """Draw one token per row.

        Returns ``int32 [B]``; with ``return_logprobs=True`` returns
        ``(tokens, list[TokenLogprobs | None])``: an entry (with ``row.params.top_logprobs``
        alternatives) for each row whose params ask for logprobs (``logprobs`` or
        ``top_logprobs > 0``), ``None`` for the others.
        ``update_state=True`` appends each sampled token to its row's history.
        """
        logits = np.asarray(logits)
        if logits.ndim != 2:
            raise ValueError(f"logits must be [B, V], got shape {logits.shape}")
        B, V = logits.shape
        if len(rows) != B:
            raise ValueError(f"got {len(rows)} row states for {B} logits rows")
        if logits.dtype != np.float32:
            logits = logits.astype(np.float32)
        out = np.empty(B, dtype=np.int32)
        lps: list[Optional[TokenLogprobs]] = [None] * B

        # Fast path: plain greedy rows (no bias / penalties) in one vectorised argmax.
        plain_greedy = [i for i, r in enumerate(rows)
                        if r.params.temperature == 0 and not needs_logit_edit(r.params, r)]
        if plain_greedy:
            idx = np.asarray(plain_greedy)
            sub = logits[idx]
            am = np.argmax(sub, axis=1)
            for j, i in enumerate(plain_greedy):
                t = int(am[j])
                if np.isnan(sub[j, t]):
                    t = argmax(sub[j])
                out[i] = t
        done = set(plain_greedy)

        for i, r in enumerate(rows):
            params = r.params
            row = logits[i]
            x = None
            if i not in done:
                x = _penalised_logits(row, params, r)
                if params.temperature == 0:
                    out[i] = argmax(x)
                else:
                    ids, p = _filtered_distribution(x, params)
                    out[i] = _draw(ids, p, float(r.rng.random()))
            if return_logprobs and (params.logprobs or params.top_logprobs > 0):
                if self.logprobs_mode == "raw":
                    src = row
                else:
                    if x is None:
                        x = _penalised_logits(row, params, r)
                    src = x if params.temperature in (0, 1.0) else x.astype(np.float64) / params.temperature
                lps[i] = log_softmax_top(src, int(out[i]), int(params.top_logprobs))

        if update_state:
            for i, r in enumerate(rows):
                r.append(int(out[i]))
        if return_logprobs:
            return out, lps
        return out
