"""Continuous-batching engine: admission queue, chunked prefill, batched decode, streaming events.

One background thread owns the model runner; HTTP handlers talk to it only through `submit`
and the per-request event stream, so no lock is held across a forward pass.
"""
from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from .detokenizer import IncrementalDetokenizer
from .kv_pages import OutOfPages
from .model_runner import ModelRunner, SeqKV
from .prefix_cache import identity_seed
from .sampling import RowState, Sampler, SamplingParams
from .stop_strings import StopStringMatcher
from .tiered_kv import TieredKV


class EngineError(RuntimeError):
    """Base of the errors the server maps to HTTP statuses."""

    status = 500
    code = "engine_error"


class QueueFull(EngineError):
    status, code = 429, "server_overloaded"


class QueueTimeout(EngineError):
    status, code = 503, "request_queue_timeout"


class ContextTooLong(EngineError):
    """The prompt does not fit. ``prompt_tokens`` / ``max_tokens`` (the most prompt tokens this
    server takes) let the HTTP layer word it the way each API does."""

    status, code = 400, "context_length_exceeded"

    def __init__(self, message: str, prompt_tokens: Optional[int] = None, max_tokens: Optional[int] = None):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens


class EngineStopped(EngineError):
    status, code = 503, "engine_stopped"


@dataclass
class EngineOptions:
    max_concurrency: int = 4
    max_pending: int = 16
    pending_timeout_ms: int = 30000
    prefill_chunk: int = 512
    max_context: int = 8192
    default_max_tokens: int = 8192
    # tiered KV / prefix reuse
    prefix_reuse: bool = True
    device_state_slots: Optional[int] = None  # extra device slots for cached states (default = max_concurrency)
    host_kv_mib: float = 1024
    host_state_slots: int = 8
    host_ram_reserve_mib: float = 2048
    max_cache_entries: int = 64
    # speculative decoding (runtime/speculative.py)
    spec: str = "none"  # none | mtp (the model's MTP head) | draft (a second compiled model, draft_model)
    draft_tokens: int = 3  # drafts proposed per round, 1..5
    draft_model: Optional[str] = None  # --spec draft: compiled drafter directory (same tokenizer)
    lm_head_draft: Optional[str] = None  # --spec mtp: shortlisted proposal head (N lowest ids, or a file of ids)

    def validate(self) -> None:
        if not 1 <= self.max_concurrency <= 8:
            raise ValueError("--max-concurrency must be in 1..8")
        if self.max_pending < 0:
            raise ValueError("--max-pending-requests must be >= 0")
        if self.pending_timeout_ms < 1:
            raise ValueError("--pending-timeout-ms must be >= 1")
        if self.prefill_chunk < 1:
            raise ValueError("--prefill-chunk must be >= 1")
        if self.max_context < 2:
            raise ValueError("--max-context must be >= 2")
        if self.device_state_slots is not None and self.device_state_slots < 0:
            raise ValueError("--device-state-slots must be >= 0")
        if self.host_kv_mib < 0 or self.host_state_slots < 0 or self.host_ram_reserve_mib < 0:
            raise ValueError("--host-kv-mib, --host-state-slots and --host-ram-reserve-mib must be >= 0")
        self._validate_spec()

    def _validate_spec(self) -> None:
        from pathlib import Path

        from .speculative import MAX_DRAFT_TOKENS, SPEC_METHODS

        if self.spec not in SPEC_METHODS:
            raise ValueError(f"--spec must be one of {', '.join(SPEC_METHODS)}, got {self.spec!r}")
        if isinstance(self.draft_tokens, bool) or not isinstance(self.draft_tokens, int) or \
                not 1 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise ValueError(f"--draft-tokens must be an integer in 1..{MAX_DRAFT_TOKENS}, got {self.draft_tokens!r}")
        if self.spec == "draft":
            if not self.draft_model:
                raise ValueError("--spec draft needs --draft-model DIR (a compiled model with the same tokenizer)")
            if not (Path(self.draft_model) / "manifest.json").is_file():
                raise ValueError(f"--draft-model {self.draft_model}: not a compiled model directory (no manifest.json)")
        elif self.draft_model:
            raise ValueError("--draft-model is only used with --spec draft")
        if self.lm_head_draft is not None:
            if self.spec != "mtp":
                raise ValueError("--lm-head-draft is only used with --spec mtp")
            v = str(self.lm_head_draft).strip()
            if v.isdigit() and int(v) < 1 or not v.isdigit() and not Path(v).is_file():
                raise ValueError(f"--lm-head-draft must be a positive token count or a file of token ids, got {v!r}")

    @property
    def device_slots(self) -> int:
        extra = self.max_concurrency if self.device_state_slots is None else self.device_state_slots
        spec = self.max_concurrency if self.spec != "none" else 0  # pre-verification state snapshots
        return self.max_concurrency + (extra if self.prefix_reuse else 0) + spec


# ---- events ------------------------------------------------------------------------------
@dataclass
class Delta:
    text: str
    token_ids: list[int]
    logprobs: list = field(default_factory=list)


@dataclass
class Finished:
    reason: str  # stop | length | cancelled | error
    usage: dict
    timings: dict
    stop_matched: Optional[str] = None
    error: Optional[str] = None


@dataclass
class GenRequest:
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str = ""
    session_key: Optional[str] = None
    skip_special_tokens: bool = True
    thinking_budget: Optional[int] = None  # reasoning tokens before the engine closes </think> itself
    started_in_think: bool = False  # the prompt's generation prompt opened <think>
    cache_mode: str = ""  # template mode (e.g. thinking on/off) + media: part of the KV identity


class RequestHandle:
    """What `submit` returns: the event stream of one request, plus cancel()."""

    def __init__(self, engine: "Engine", req_id: int, loop: Optional[asyncio.AbstractEventLoop]):
        self._engine, self.id = engine, req_id
        self._loop = loop
        self._aq: Optional[asyncio.Queue] = asyncio.Queue() if loop else None
        self._sq: "queue.SimpleQueue" = queue.SimpleQueue()
        self.admitted = threading.Event()
        self._admit_error: Optional[EngineError] = None
        self.finished: Optional[Finished] = None

    # called on the engine thread
    def _push(self, ev) -> None:
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, ev)
            except RuntimeError:  # loop closed: the client is gone
                pass
        else:
            self._sq.put(ev)

    def _admit(self, err: Optional[EngineError] = None) -> None:
        self._admit_error = err
        self.admitted.set()
        self._push(("admitted", err))

    def cancel(self) -> None:
        self._engine._cancel(self.id)

    async def wait_admitted(self) -> None:
        """Return once the request left the queue; raise its admission error if it failed."""
        while True:
            ev = await self._aq.get()
            if isinstance(ev, tuple) and ev[0] == "admitted":
                if ev[1] is not None:
                    raise ev[1]
                return

    async def events(self):
        while True:
            ev = await self._aq.get()
            if isinstance(ev, tuple):
                if ev[1] is not None:
                    raise ev[1]
                continue
            yield ev
            if isinstance(ev, Finished):
                return

    def iter_sync(self, timeout: Optional[float] = None):
        while True:
            ev = self._sq.get(timeout=timeout)
            if isinstance(ev, tuple):
                if ev[1] is not None:
                    raise ev[1]
                continue
            yield ev
            if isinstance(ev, Finished):
                return


# ---- per-request engine state ------------------------------------------------------------
class _Active:
    def __init__(self, rid: int, req: GenRequest, handle: RequestHandle, max_tokens: int, stop_ids: set,
                 tokenizer):
        self.rid, self.req, self.handle = rid, req, handle
        self.max_tokens = max_tokens
        self.stop_ids = stop_ids
        self.row = RowState(req.params, prompt_token_ids=req.prompt_ids)
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_ids[-8:], skip_special_tokens=req.skip_special_tokens)
        self.stops = StopStringMatcher(req.params.stop)
        self.seq: Optional[SeqKV] = None
        self.feed: list[int] = list(req.prompt_ids)  # tokens still to prefill
        self.generated: list[int] = []
        self.t_submit = time.monotonic()
        self.t_admit = 0.0
        self.t_first = 0.0
        self.t_prefill_done = 0.0
        self.prompt_computed = 0
        self.cached_tokens = 0
        self.pending_token: Optional[int] = None  # sampled, not yet fed to decode
        self.preemptions = 0
        self.identity = identity_seed(req.cache_mode)
        self.in_think = req.started_in_think
        self.think_tokens = 0
        self.forced: list[int] = []
        self.ckpt_at: Optional[int] = None

    def fed_tokens(self) -> list[int]:
        """Prompt + generated tokens whose KV/state the sequence holds (or must hold)."""
        unfed = 1 if self.pending_token is not None else 0
        return list(self.req.prompt_ids) + self.generated[: len(self.generated) - unfed]

    @property
    def decoding(self) -> bool:
        return not self.feed and self.pending_token is not None


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer, options: EngineOptions, eos_ids: list[int],
                 kv: Optional[TieredKV] = None, turn_opener: Optional[list[int]] = None):
        options.validate()
        self.runner, self.tok, self.opt = runner, tokenizer, options
        self.kv = kv or TieredKV(runner, None, None)
        self.turn_opener = list(turn_opener or [])
        self.eos_ids = set(eos_ids)
        self.sampler = Sampler()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pending: deque[_Active] = deque()
        self._active: dict[int, _Active] = {}
        self._cancelled: set[int] = set()
        self._running = False
        self._thread: Optional[threading.Thread] = None
        self.stats = {
            "requests_total": 0, "requests_finished": 0, "requests_cancelled": 0, "requests_rejected_queue_full": 0,
            "requests_queue_timeout": 0, "computed_prefill_tokens": 0, "committed_decode_tokens": 0,
            "decode_rounds": 0, "decode_row_rounds": 0, "prefill_rounds": 0, "preemptions": 0,
            "queue_time_ms_last": 0.0, "queue_time_ms_max": 0.0,
        }
        self.think_close: list[int] = []  # early-close text ending in </think> (set by open_engine)
        self.think_end_id: Optional[int] = None
        self.spec = None  # speculative decoding (runtime/speculative.py), when options.spec != "none"
        if options.spec != "none":
            from .speculative import Speculator

            self.spec = Speculator(self)

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._running:
            return
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="ninfer-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify_all()
        if self._thread:
            self._thread.join(timeout=30)
        for a in list(self._pending) + list(self._active.values()):
            self._finish(a, "error", error="engine stopped")
        self._pending.clear()

    # ---- public API (any thread) ------------------------------------------------------------
    def submit(self, req: GenRequest, loop: Optional[asyncio.AbstractEventLoop] = None) -> RequestHandle:
        if not self._running:
            raise EngineStopped("engine is not running")
        n = len(req.prompt_ids)
        if n == 0:
            raise ContextTooLong("the prompt is empty", 0, self.opt.max_context - 1)
        if n >= self.opt.max_context:
            raise ContextTooLong(
                f"prompt has {n} tokens; the maximum context is {self.opt.max_context} tokens (--max-context)",
                n, self.opt.max_context - 1)
        room = self.opt.max_context - n
        mt = req.params.max_tokens or self.opt.default_max_tokens
        max_tokens = max(1, min(mt, room))
        stop_ids = set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else self.eos_ids)
        rid = next(self._ids)
        handle = RequestHandle(self, rid, loop)
        a = _Active(rid, req, handle, max_tokens, stop_ids, self.tok)
        with self._wake:
            waiting = len(self._pending)
            if waiting >= self.opt.max_pending and len(self._active) >= self.opt.max_concurrency:
                self.stats["requests_rejected_queue_full"] += 1
                raise QueueFull(f"{waiting} requests are already waiting (--max-pending-requests)")
            self.stats["requests_total"] += 1
            self._pending.append(a)
            self._wake.notify_all()
        return handle

    def _cancel(self, rid: int) -> None:
        with self._wake:
            self._cancelled.add(rid)
            self._wake.notify_all()

    def snapshot(self) -> dict:
        with self._lock:
            acts = list(self._active.values())  # one C-level copy: the engine thread mutates the dict
            return {
                "running": len(acts),
                "prefilling": sum(1 for a in acts if a.feed),
                "decode_ready": sum(1 for a in acts if a.decoding),
                "waiting": len(self._pending),
                **self.stats,
            }

    # ---- engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while self._running and not self._pending and not self._active and not self._cancelled:
                    self._wake.wait(timeout=0.5)
                if not self._running:
                    return
                cancelled, self._cancelled = self._cancelled, set()
            try:
                self._apply_cancellations(cancelled)
                self._expire_and_admit()
                if any(a.feed for a in self._active.values()):
                    self._prefill_step()
                if any(a.decoding for a in self._active.values()):
                    self._decode_step()
            except Exception as e:  # a bug must not wedge every client: fail the batch, keep serving
                import traceback

                traceback.print_exc()
                for a in list(self._active.values()):
                    self._finish(a, "error", error=f"{type(e).__name__}: {e}")

    def _apply_cancellations(self, rids: set) -> None:
        if not rids:
            return
        for a in list(self._pending):
            if a.rid in rids:
                self._pending.remove(a)
                self._finish(a, "cancelled")
        for rid in rids:
            a = self._active.get(rid)
            if a is not None:
                self._finish(a, "cancelled")

    def _expire_and_admit(self) -> None:
        now = time.monotonic()
        limit = self.opt.pending_timeout_ms / 1000.0
        with self._lock:
            expired = [a for a in self._pending if now - a.t_submit > limit]
            for a in expired:
                self._pending.remove(a)
        for a in expired:
            self.stats["requests_queue_timeout"] += 1
            a.handle._admit(QueueTimeout(f"request waited {limit:.1f}s in the queue (--pending-timeout-ms)"))
            self.stats["requests_finished"] += 1
        while len(self._active) < self.opt.max_concurrency:
            with self._lock:
                if not self._pending:
                    return
                a = self._pending[0]
            need = self.runner.pages.pages_for(len(a.req.prompt_ids) + 1)
            if need > self.runner.pages.num_pages:
                with self._lock:
                    self._pending.popleft()
                a.handle._admit(ContextTooLong(
                    f"prompt needs {need} KV pages; the pool has {self.runner.pages.num_pages}",
                    len(a.req.prompt_ids), self.runner.pages.num_pages * self.runner.pages.page_size - 1))
                continue
            if not self.kv.make_room(slots=1):
                return  # wait for running requests to release a state slot
            with self._lock:
                self._pending.popleft()
            history = a.fed_tokens()
            resumed = a.pending_token is not None
            a.seq = self.kv.acquire(history, a.identity, a.req.session_key,
                                    max_reuse=len(history) if resumed else len(history) - 1)
            a.feed = history[a.seq.length:]
            if not a.t_admit:  # first admission (a preempted request keeps its figures)
                a.cached_tokens = a.seq.length
                b = self._turn_boundary(a.req.prompt_ids)
                a.ckpt_at = b if b is not None and a.seq.length < b < len(a.req.prompt_ids) else None
                a.t_admit = time.monotonic()
                q_ms = (a.t_admit - a.t_submit) * 1000
                self.stats["queue_time_ms_last"] = q_ms
                self.stats["queue_time_ms_max"] = max(self.stats["queue_time_ms_max"], q_ms)
                a.handle._admit(None)
            self._active[a.rid] = a

    def _turn_boundary(self, prompt: list[int]) -> Optional[int]:
        """Index of the last assistant-turn opener: the checkpoint position for the next turn."""
        k = len(self.turn_opener)
        if not k:
            return None
        for i in range(len(prompt) - k, -1, -1):
            if prompt[i:i + k] == self.turn_opener:
                return i
        return None

    def _prefill_step(self) -> None:
        budget = self.opt.prefill_chunk
        batch: list[tuple[_Active, list[int]]] = []
        for a in list(self._active.values()):
            if not a.feed or budget <= 0 or a.rid not in self._active:
                continue
            limit = budget
            if a.ckpt_at is not None and a.seq.length < a.ckpt_at:
                limit = min(limit, a.ckpt_at - a.seq.length)  # stop exactly at the turn boundary
            take = a.feed[:limit]
            if not self._reserve(a, len(take), protect={b.rid for b, _ in batch}):
                continue
            batch.append((a, take))
            budget -= len(take)
        if not batch:
            return
        if self.spec is not None:
            logits = self.spec.prefill(batch)
        else:
            logits = self.runner.prefill([(a.seq, t) for a, t in batch])
        self.stats["prefill_rounds"] += 1
        done_rows, done = [], []
        for (a, take), lg in zip(batch, logits):
            a.feed = a.feed[len(take):]
            a.prompt_computed += len(take)
            self.stats["computed_prefill_tokens"] += len(take)
            if a.ckpt_at is not None and a.seq.length == a.ckpt_at:
                self.kv.checkpoint(a.seq, a.req.prompt_ids, a.identity, a.req.session_key)
                a.ckpt_at = None
            if not a.feed and a.pending_token is None:  # a resumed request already holds its next token
                a.t_prefill_done = a.t_prefill_done or time.monotonic()
                done_rows.append(lg)
                done.append(a)
        if done:
            self._sample_and_emit(done, np.stack(done_rows))

    def _decode_step(self) -> None:
        if self.spec is not None:  # draft + one batched verification per round
            return self.spec.decode_step()
        rows = [a for a in self._active.values() if a.decoding]
        ok = []
        for a in rows:
            if a.rid in self._active and self._reserve(a, 1, protect={b.rid for b in ok}):
                ok.append(a)
        rows = [a for a in ok if a.rid in self._active]
        if not rows:
            return
        logits = self.runner.decode([a.seq for a in rows], [a.pending_token for a in rows])
        self.stats["decode_rounds"] += 1
        self.stats["decode_row_rounds"] += len(rows)
        for a in rows:
            a.pending_token = None
        self._sample_and_emit(rows, logits)

    def _reserve(self, a: _Active, n: int, protect: set) -> bool:
        """Pages for n more tokens of a, preempting other requests (never those in `protect`)."""
        while True:
            try:
                self.runner.reserve(a.seq, n)
                return True
            except OutOfPages:
                need = self.runner.pages.pages_for(a.seq.length + n) - len(a.seq.pages)
                if self.kv.make_room(pages=need):
                    continue
                victims = [v for v in self._active.values() if v is not a and v.rid not in protect]
                if not victims:
                    return False
                self._preempt(max(victims, key=lambda v: v.t_admit))

    def _preempt(self, v: _Active) -> None:
        """Send v back to the head of the queue. Its sequence is released like a finished one
        (kept as a cache entry, spilled to host under pressure), so readmission restores it
        instead of recomputing whenever the entry survives."""
        self.kv.release(v.seq, v.fed_tokens(), v.identity, v.req.session_key)
        v.seq = None
        v.preemptions += 1
        self.stats["preemptions"] += 1
        del self._active[v.rid]
        with self._lock:
            self._pending.appendleft(v)

    def _sample_and_emit(self, acts: list[_Active], logits: np.ndarray) -> None:
        want_lp = any(a.req.params.logprobs for a in acts)
        res = self.sampler.sample(logits, [a.row for a in acts], return_logprobs=want_lp)
        toks, lps = (res if want_lp else (res, [None] * len(acts)))
        now = time.monotonic()
        for a, t, lp in zip(acts, toks, lps):
            self._commit_token(a, self._apply_thinking_budget(a, int(t)), lp, now)

    def _apply_thinking_budget(self, a: _Active, t: int) -> int:
        """Past its reasoning budget a request gets Qwen's early-close text and </think> instead of
        what it sampled (one forced token per step, so KV and state follow the forced text)."""
        budget = a.req.thinking_budget
        if (not a.forced and budget is not None and self.think_end_id is not None and a.in_think
                and a.think_tokens >= budget):
            a.forced = list(self.think_close)
        if a.forced:
            forced = a.forced.pop(0)
            if forced != t:  # the sampler recorded its own draw: keep penalties on what is fed
                a.row.rollback(1)
                a.row.append(forced)
            t = forced
        if a.in_think:
            a.think_tokens += 1
            a.in_think = t != self.think_end_id
        return t

    def _commit_token(self, a: _Active, t: int, lp, now: float) -> bool:
        """Record one sampled token: stream it, apply stop tokens/strings and the length limit.
        Returns False when the request finished."""
        if not a.t_first:
            a.t_first = now
        a.generated.append(t)
        self.stats["committed_decode_tokens"] += 1
        if t in a.stop_ids:
            emit, stopped, matched = a.stops.feed(a.detok.flush())
            emit += "" if stopped else a.stops.flush()
            if emit:
                a.handle._push(Delta(emit, [], []))
            self._finish(a, "stop")
            return False
        text = a.detok.add(t)
        emit, stopped, matched = a.stops.feed(text)
        if emit or lp is not None:
            a.handle._push(Delta(emit, [t], [lp] if lp is not None else []))
        if stopped:
            self._finish(a, "stop", stop_matched=matched)
            return False
        if len(a.generated) >= a.max_tokens:
            rest = a.stops.feed(a.detok.flush())[0] + a.stops.flush()
            if rest:
                a.handle._push(Delta(rest, [], []))
            self._finish(a, "length")
            return False
        a.pending_token = t
        return True

    def _finish(self, a: _Active, reason: str, stop_matched: Optional[str] = None, error: Optional[str] = None) -> None:
        self._active.pop(a.rid, None)
        spec_t = self.spec.on_finish(a) if self.spec is not None else {}  # before the state is released
        if a.seq is not None:
            # an engine error may have interrupted an in-place forward: never cache that state
            self.kv.release(a.seq, list(a.req.prompt_ids) + a.generated, a.identity, a.req.session_key,
                            keep=reason != "error")
            a.seq = None
        if not a.handle.admitted.is_set():
            a.handle._admit(None)
        end = time.monotonic()
        t_first = a.t_first or end
        prompt_ms = ((a.t_prefill_done or t_first) - (a.t_admit or end)) * 1000
        pred_ms = (end - t_first) * 1000
        n_out = len(a.generated)
        usage = {"prompt_tokens": len(a.req.prompt_ids), "completion_tokens": n_out,
                 "total_tokens": len(a.req.prompt_ids) + n_out, "cached_tokens": a.cached_tokens}
        timings = {
            "cache_n": a.cached_tokens, "prompt_n": a.prompt_computed, "prompt_ms": round(prompt_ms, 3),
            "prompt_per_second": round(a.prompt_computed / prompt_ms * 1000, 3) if prompt_ms > 0 else 0.0,
            "predicted_n": n_out, "predicted_ms": round(pred_ms, 3),
            "predicted_per_second": round((n_out - 1) / pred_ms * 1000, 3) if pred_ms > 0 and n_out > 1 else 0.0,
            "queue_ms": round(((a.t_admit or end) - a.t_submit) * 1000, 3),
            "draft_n": 0, "draft_n_accepted": 0, **spec_t,
        }
        if reason == "cancelled":
            self.stats["requests_cancelled"] += 1
        self.stats["requests_finished"] += 1
        a.handle.finished = Finished(reason, usage, timings, stop_matched, error)
        a.handle._push(a.handle.finished)
