"""Host time of the engine's decode steps, split by phase.

Why: through HTTP a decode step costs the device step plus whatever host work the engine does not
hide behind it (planning, staging inputs, reading sampled ids, committing, detokenizing, pushing
events). Each decode step's phases go into a fixed ring of recent steps; `summary()` gives p50 /
p99 / mean per phase in ms for /stats (the GPU serve bench records it per cell).

Phases (seconds are charged to the phase that was running, so they add up to the step):
  loop      engine loop between steps: inbox, cancellations, statistics
  schedule  Scheduler.schedule() (or building the overlapped next step's plan)
  inputs    staging and uploading the decode call's inputs (ModelRunner.decode)
  launch    the decode call and the sampler call (on the CPU the forward runs here: llvm is synchronous)
  read      reading the sampled ids (on CUDA this includes waiting for the device)
  commit    Scheduler.update() without detok and emit: stop tokens, limits, finishing requests
  detok     incremental detokenizer and stop-string matching
  emit      pushing events to the request handles (call_soon_threadsafe onto the server's loop)
Only steps with decode rows and no prefill rows are recorded (the inter-token regime).
"""
from __future__ import annotations

import time
import numpy as np

PHASES = ("loop", "schedule", "inputs", "launch", "read", "commit", "detok", "emit")
_INDEX = {p: i for i, p in enumerate(PHASES)}
_NESTED = (_INDEX["detok"], _INDEX["emit"], _INDEX["inputs"])  # measured inside commit / launch


class StepTimer:
    """Per-phase host seconds of the current step, and a ring of the last `window` decode steps."""

    def __init__(self, window: int = 1024):
        self._ring = np.zeros((window, len(PHASES)), np.float64)
        self._n = 0  # steps recorded (the ring holds the last min(n, window))
        self._sums = np.zeros(len(PHASES), np.float64)  # seconds per phase over every recorded step
        self.overlapped = 0  # recorded steps whose next step was launched before this one's commit
        self._cur = [0.0] * len(PHASES)
        self._t = time.perf_counter()
        self._inner = [0.0] * len(PHASES)  # nested phases' seconds since the last lap (charged out of it)

    def start(self) -> None:
        """A step begins (after any idle wait)."""
        self._cur = [0.0] * len(PHASES)
        self._inner = [0.0] * len(PHASES)
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to `phase`, less what nested phases took meanwhile."""
        now = time.perf_counter()
        nested = sum(self._inner)
        self._cur[_INDEX[phase]] += now - self._t - nested
        for i in _NESTED:
            self._cur[i] += self._inner[i]
        self._inner = [0.0] * len(PHASES)
        self._t = now

    def add(self, phase: str, seconds: float) -> None:
        """Seconds of a nested phase (detok / emit inside commit, inputs inside launch)."""
        self._inner[_INDEX[phase]] += seconds

    def record(self, overlapped: bool = False) -> None:
        """The step was a decode step: keep its phases."""
        self._ring[self._n % len(self._ring)] = self._cur
        self._sums += self._cur
        self._n += 1
        self.overlapped += int(overlapped)

    def summary(self) -> dict:
        """{'steps', 'overlapped_steps', '<phase>_sum_ms' (every step: diff two snapshots for a run's mean),
        '<phase>_p50_ms', '<phase>_p99_ms', '<phase>_mean_ms' over the recorded window, the same for 'total'}
        (flat, so /metrics and bench deltas read it like any section)."""
        k = min(self._n, len(self._ring))
        out: dict = {"steps": self._n, "overlapped_steps": self.overlapped, "window": k}
        for p, v in zip(PHASES, self._sums):
            out[f"{p}_sum_ms"] = round(float(v) * 1e3, 3)
        out["total_sum_ms"] = round(float(self._sums.sum()) * 1e3, 3)
        if not k:
            return out
        rows = self._ring[:k] * 1e3
        cols = [(p, rows[:, i]) for i, p in enumerate(PHASES)] + [("total", rows.sum(axis=1))]
        for name, v in cols:
            p50, p99 = np.percentile(v, [50, 99])
            out[f"{name}_p50_ms"] = round(float(p50), 4)
            out[f"{name}_p99_ms"] = round(float(p99), 4)
            out[f"{name}_mean_ms"] = round(float(v.mean()), 4)
        return out

