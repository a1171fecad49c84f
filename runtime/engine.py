"""The engine: a thread that owns the scheduler, the KV manager and the executor, and the handles
through which other threads submit requests and read their streams.

Each step: the scheduler plans (admission, prefill chunks, decode rows), the executor runs the plan
(the speculative decoder runs decode rows when speculation is on), the sampler draws, and the
scheduler commits. HTTP handlers talk to the engine only through `submit`, the request handles and
`stats()`; no lock is held across a forward pass.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Any, Optional

import numpy as np

from ..contract.generation import GenerationDefaults
from .config import EngineConfig
from .errors import BadConstraint, ContextTooLong, EngineStopped, ImagesUnsupported, InvalidRequest, QueueFull
from .device_sampler import DeviceSampler, PendingDraw, supports_device_sampler
from .executor.model_runner import ModelRunner
from .grammar import ConstraintCompiler, ConstraintError, bitmask_words, fill_bitmasks, mask_logits
from .kv.manager import KVManager
from .sampling import Sampler
from .scheduler.request import Delta, Finished, GenRequest, Request
from .scheduler.scheduler import RowResult, Scheduler, StepPlan, ThinkControl
from .stats import Counters, EngineStats, ModelInfo, SpecCounters
from .step_timing import StepTimer

log = logging.getLogger("ninfer.engine")

__all__ = ["Engine", "RequestHandle", "GenRequest", "Delta", "Finished"]


@dataclass
class _InFlight:
    """A decode step launched, its feed accounted, its tokens neither read nor committed."""

    plan: StepPlan
    rows: list[Request]
    draw: Optional[PendingDraw]  # the device sampler's queued draw
    logits: Any  # the step's device logits when the host sampler draws


class RequestHandle:
    """What `submit` returns: the event stream of one request (async or blocking), plus cancel()."""

    def __init__(self, engine: "Engine", req_id: int, loop: Optional[asyncio.AbstractEventLoop]):
        self._engine, self.id = engine, req_id
        self._loop = loop
        self._aq: Optional[asyncio.Queue] = asyncio.Queue() if loop else None
        self._sq: "queue.SimpleQueue" = queue.SimpleQueue()
        self.admitted = threading.Event()
        self.cached_tokens = 0  # prompt tokens restored from the prefix cache (set before admission)
        self.finished: Optional[Finished] = None

    # ---- engine thread -------------------------------------------------------------------
    def push(self, ev: Any) -> None:
        if isinstance(ev, Finished):
            self.finished = ev
            self._engine._on_finished(self)
        if self._loop is not None:
            assert self._aq is not None  # made together with the loop
            try:
                self._loop.call_soon_threadsafe(self._aq.put_nowait, ev)
            except RuntimeError:  # loop closed: the client is gone
                pass
        else:
            self._sq.put(ev)

    def admit(self, err: Optional[Exception] = None) -> None:
        if self.admitted.is_set():
            return
        self.admitted.set()
        self._engine._on_admitted(err is None)
        self.push(("admitted", err))

    # ---- any thread ------------------------------------------------------------------------
    def cancel(self) -> None:
        self._engine._cancel(self.id)

    async def wait_admitted(self) -> None:
        """Return once the request left the queue; raise its admission error if it failed."""
        assert self._aq is not None, "wait_admitted() needs a handle submitted from an event loop"
        while True:
            ev = await self._aq.get()
            if isinstance(ev, tuple) and ev[0] == "admitted":
                if ev[1] is not None:
                    raise ev[1]
                return

    async def events(self):
        assert self._aq is not None, "events() needs a handle submitted from an event loop"
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


class Engine:
    def __init__(self, runner: ModelRunner, kv: KVManager, tokenizer, cfg: EngineConfig, eos_ids: list[int], *,
                 turn_start: Optional[list[int]] = None, think: Optional[ThinkControl] = None,
                 model_info: Optional[ModelInfo] = None, generation: Optional[GenerationDefaults] = None):
        cfg.validate()
        assert cfg.prefill_chunk is not None, "assemble() resolves prefill_chunk for the device"
        self.runner, self.kv, self.tok, self.cfg = runner, kv, tokenizer, cfg
        self.max_context = min(cfg.max_context or runner.manifest.max_context, runner.manifest.max_context)
        self.eos_ids = set(eos_ids)
        self.generation = generation or GenerationDefaults(sorted(self.eos_ids))  # the model's sampling defaults
        self.sampler = Sampler()
        self.counters = Counters()
        self.spec_counters = SpecCounters()
        self.model_info = model_info or ModelInfo()
        # constrained decoding: specs -> xgrammar matchers over the sampled vocabulary (loaded on first use)
        self.constraints = ConstraintCompiler(tokenizer, runner.sample_vocab, sorted(self.eos_ids))
        self.spec = None
        if cfg.spec != "none":
            from .spec.decoder import SpeculativeDecoder, make_proposer

            self.spec = SpeculativeDecoder(runner, kv, make_proposer(cfg, runner, kv, sorted(self.eos_ids)),
                                           cfg.draft_tokens, self.sampler, self.spec_counters,
                                           forced_acceptance=cfg.forced_acceptance,
                                           device_rounds=cfg.device_sampling != "off",
                                           refeed_max=cfg.spec_refeed_max)
        self.device_sampler = self._device_sampler(cfg, runner)
        self._lanes: dict[int, int] = {}  # request id -> device sampler lane (penalty state)
        self._sampled: dict[int, int] = {}  # request id -> the token the device sampler drew this step
        self._limit_masks: dict[int, np.ndarray] = {}  # rows -> bitmask of the tokenizer's vocabulary (reused)
        # overlapped decode: step N+1 is launched before step N's tokens are committed
        self.overlap = self.spec is None and (cfg.async_scheduling == "on" or (
            cfg.async_scheduling == "auto" and runner.device_kind == "cuda"))
        self._inflight: Optional[_InFlight] = None
        self.timer = StepTimer()
        self.scheduler = Scheduler(kv, self.counters, max_concurrency=cfg.max_concurrency,
                                   prefill_chunk=cfg.prefill_chunk, max_context=self.max_context,
                                   pending_timeout_ms=cfg.pending_timeout_ms, turn_start=turn_start, think=think,
                                   spec=self.spec)
        self.scheduler.timer = self.timer
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._stats_ready = threading.Condition(self._lock)
        self._inbox: deque[Request] = deque()
        self._cancelled: set[int] = set()
        self._queued = 0  # submitted, not yet admitted or rejected
        self._live = 0  # admitted, not yet finished
        self._running = False
        self._thread: Optional[threading.Thread] = None
        self._stats_wanted = False
        self._stats: Optional[EngineStats] = None

    @property
    def running(self) -> bool:
        return self._running

    def _device_sampler(self, cfg: EngineConfig, runner: ModelRunner) -> Optional[DeviceSampler]:
        """Decode rows sampled inside the library (CUDA by default): only token ids cross to the host.
        Speculative rounds keep the host sampler (rejection sampling needs the probabilities)."""
        want = cfg.device_sampling == "on" or (cfg.device_sampling == "auto" and runner.device_kind == "cuda")
        if not want or self.spec is not None or not supports_device_sampler(runner.manifest, runner.vm):
            return None
        return DeviceSampler(runner.tvm, runner.vm, runner.dev, runner.vocab_size, cfg.max_concurrency)

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self) -> "Engine":
        if not self._running:
            self._running = True
            self._thread = threading.Thread(target=self._loop, name="ninfer-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        with self._wake:
            self._running = False
            self._wake.notify_all()
        if self._thread:
            self._thread.join(timeout=30)
        with self._lock:
            inbox, self._inbox = list(self._inbox), deque()
        for r in inbox:
            self.scheduler.add(r)
        self.scheduler.stop_all("engine stopped")

    # ---- any thread ------------------------------------------------------------------------
    def submit(self, req: GenRequest, loop: Optional[asyncio.AbstractEventLoop] = None) -> RequestHandle:
        if not self._running:
            raise EngineStopped()
        n = len(req.prompt_ids)
        if n == 0:
            raise InvalidRequest("the prompt is empty")
        ids = np.asarray(req.prompt_ids)
        if ids.min() < 0 or ids.max() >= self.runner.vocab_size:
            raise InvalidRequest(f"prompt token ids must lie in [0, {self.runner.vocab_size})")
        if n >= self.max_context:
            with self._lock:
                self.counters.requests_rejected_context += 1
            raise ContextTooLong(n, self.max_context - 1)
        room = self.max_context - n
        max_tokens = max(1, min(req.params.max_tokens or self.cfg.default_max_tokens, room))
        stop_ids = set(req.params.stop_token_ids) | (set() if req.params.ignore_eos else self.eos_ids)
        if req.media is not None and self.spec is not None:
            raise ImagesUnsupported("images are not supported with speculative decoding (--spec) yet")
        rid = next(self._ids)
        handle = RequestHandle(self, rid, loop)
        r = Request(rid, req, handle, max_tokens, stop_ids, self.tok)
        if req.constraint is not None:  # compiled (and cached) by the server before it submits
            try:
                r.grammar = self.constraints.matcher(req.constraint, reasoning=req.started_in_think)
            except ConstraintError as e:
                raise BadConstraint(str(e)) from None
        with self._wake:
            if self._queued >= self.cfg.max_pending_requests and self._live >= self.cfg.max_concurrency:
                self.counters.requests_rejected_queue_full += 1
                raise QueueFull(self._queued)
            self.counters.requests_total += 1
            self._queued += 1
            self._inbox.append(r)
            self._wake.notify_all()
        return handle

    def _cancel(self, rid: int) -> None:
        with self._wake:
            self._cancelled.add(rid)
            self._wake.notify_all()

    def _on_admitted(self, ok: bool) -> None:
        with self._lock:
            self._queued -= 1
            if ok:
                self._live += 1

    def _on_finished(self, handle: RequestHandle) -> None:
        if handle.admitted.is_set():
            with self._lock:
                self._live -= 1

    def stats(self, timeout: float = 2.0) -> EngineStats:
        """A snapshot taken by the engine thread between steps (the previous one if a step runs longer
        than `timeout`); taken here only when no engine thread runs."""
        with self._lock:
            if self._running and self._thread is not None and self._thread is not threading.current_thread():
                self._stats_wanted = True
                self._wake.notify_all()
                self._stats_ready.wait_for(lambda: not self._stats_wanted, timeout=timeout)
                if self._stats is not None:
                    return self._stats
        return self._take_stats()

    # ---- engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._wake:
                while (self._running and not self._inbox and self.scheduler.idle() and not self._cancelled
                       and not self._stats_wanted and self._inflight is None):
                    self._wake.wait(timeout=0.5)
                if not self._running:
                    return
                cancelled, self._cancelled = self._cancelled, set()
                inbox, self._inbox = list(self._inbox), deque()
                wanted = self._stats_wanted
            self.timer.start()
            for r in inbox:
                self.scheduler.add(r)
            for rid in cancelled:  # an in-flight row of a cancelled request is dropped at its commit
                self.scheduler.cancel(rid)
            if wanted:
                self._publish_stats()
            self.timer.lap("loop")
            try:
                self._step()
            except Exception as e:  # a bug must not wedge every client: fail the batch, keep serving
                log.exception("engine step failed")
                self.counters.step_failures += 1
                self._inflight = None
                self.scheduler.fail_running(f"{type(e).__name__}: {e}")

    def _publish_stats(self) -> None:
        snap = self._take_stats()
        with self._lock:
            self._stats, self._stats_wanted = snap, False
            self._stats_ready.notify_all()

    def _step(self) -> None:
        fl, self._inflight = self._inflight, None
        if fl is None:
            plan = self.scheduler.schedule()
            self.timer.lap("schedule")
            if not plan:
                return
            if not self._overlaps(plan):
                self.scheduler.update(plan, self._execute(plan))
                if self._sampled:
                    self._sync_lanes()
                self.timer.lap("commit")
                if plan.decode and not plan.prefill:
                    self.timer.record()
                return
            fl = self._launch(plan)
        # overlapped decode: read step N, launch step N+1 with N's tokens, then commit N while N+1 runs
        results = self._read(fl)
        self.timer.lap("read")
        nxt = self.scheduler.plan_next(fl.plan, results)
        self.timer.lap("schedule")
        if nxt is not None:
            self._inflight = self._launch(nxt)
            self.counters.overlapped_decode_rounds += 1
        self.counters.discarded_decode_rows += sum(1 for w in fl.plan.decode if w.req.rid not in self.scheduler.running)
        self.scheduler.update(fl.plan, results, advanced=True)
        self.timer.lap("commit")
        self.timer.record(overlapped=nxt is not None)

    def _overlaps(self, plan: StepPlan) -> bool:
        """Plain decode rows whose tokens can be fed before they are committed (no prefill, speculation,
        grammar, or thinking budget about to force a token): the step runs overlapped."""
        return (self.overlap and bool(plan.decode) and not plan.prefill
                and all(self.scheduler.overlappable(w.req) for w in plan.decode))

    def _launch(self, plan: StepPlan) -> _InFlight:
        """Queue a decode step and its draw on the device without reading anything back; its feed is
        accounted now (Scheduler.advance_launched)."""
        rows = [w.req for w in plan.decode]
        ds = self.device_sampler
        # every upload waits for the device stream: the draw's inputs go up before the forward is queued (after
        # it they would wait for the forward, and the host would commit nothing while it runs)
        draw = self._prepare_draw(rows) if ds is not None else None
        logits = self.runner.decode([r.live_seq for r in rows], [w.feed[-1] for w in plan.decode], True, wait=False)
        self.timer.add("inputs", self.runner.last_inputs_s)
        if ds is not None and draw is not None:
            ds.start(logits, draw)
        self.scheduler.advance_launched(plan)
        self.timer.lap("launch")
        return _InFlight(plan, rows, draw, None if draw is not None else logits)

    def _read(self, fl: _InFlight) -> dict[int, RowResult]:
        """The tokens of a launched step (waits for the device)."""
        if fl.draw is not None:
            return self._draw_results(fl.rows, fl.draw)
        return self._sample(fl.rows, self.runner.host_logits(fl.logits), fed=1)

    def _execute(self, plan: StepPlan) -> dict[int, RowResult]:
        """Run the plan on the executor and sample; returns what each row produced."""
        results: dict[int, RowResult] = {}
        if plan.prefill:
            batch = [(w.req, w.tokens) for w in plan.prefill]
            if self.spec is not None:
                logits = self.spec.prefill(batch)
            else:
                logits = self.runner.prefill([(r.live_seq, t) for r, t in batch])
            done = [(w.req, lg) for w, lg in zip(plan.prefill, logits) if w.samples]
            if done:
                results.update(self._sample([r for r, _ in done], np.stack([lg for _, lg in done])))
        if plan.decode:
            if self.spec is not None:
                results.update(self.spec.round(plan.decode))
            else:
                rows = [w.req for w in plan.decode]
                on_device = self.device_sampler is not None
                logits = self.runner.decode([r.live_seq for r in rows], [w.feed[-1] for w in plan.decode], on_device)
                self.timer.add("inputs", self.runner.last_inputs_s)
                self.timer.lap("launch")
                results.update(self._sample_on_device(rows, logits) if on_device else self._sample(rows, logits, fed=1))
                self.timer.lap("read")
        return results

    def _sample_on_device(self, reqs: list[Request], logits) -> dict[int, RowResult]:
        """The library's sampler over the decode logits where they are; grammar masks and the tokenizer's
        vocabulary limit travel as one bitmask."""
        ds = self.device_sampler
        assert ds is not None  # called only when the library samples on the device
        results = self._draw_results(reqs, ds.start(logits, self._prepare_draw(reqs)))
        self._sampled = {rid: res.tokens[0] for rid, res in results.items()}
        return results

    def _draw_results(self, reqs: list[Request], draw: PendingDraw) -> dict[int, RowResult]:
        ds = self.device_sampler
        assert ds is not None  # draws come from the device sampler
        res = ds.collect(draw)
        toks, lps = res if draw.return_logprobs else (res, [None] * len(reqs))
        return {r.rid: RowResult([int(t)], [lp], fed=1) for r, t, lp in zip(reqs, toks, lps)}

    def _prepare_draw(self, reqs: list[Request]) -> PendingDraw:
        """Lanes bound, row parameters and masks uploaded (DeviceSampler.prepare); `start` queues the draw."""
        ds = self.device_sampler
        assert ds is not None  # called only when the library samples on the device
        live = self.scheduler.running
        for rid in [rid for rid in self._lanes if rid not in live]:  # finished or preempted: lane freed
            ds.release(self._lanes.pop(rid))
        free = sorted(set(range(ds.max_lanes)) - set(self._lanes.values()))
        for r in reqs:
            if r.rid not in self._lanes:
                self._lanes[r.rid] = lane = free.pop(0)
                ds.bind(lane, r.row)
        bitmask = None
        limit = self.runner.sample_vocab
        grammars = [r.grammar for r in reqs]
        if any(g is not None for g in grammars):
            bitmask = self._vocab_mask(len(reqs)).copy()
            sub = np.full((len(reqs), bitmask_words(limit)), -1, np.int32)
            fill_bitmasks(grammars, sub)
            bitmask[:, : sub.shape[1]] &= sub
        elif limit < self.runner.vocab_size:
            bitmask = self._vocab_mask(len(reqs))  # one array per batch size: the sampler keeps it on the device
        want_lp = any(r.params.logprobs or r.params.top_logprobs > 0 for r in reqs)
        return ds.prepare([r.row for r in reqs], [self._lanes[r.rid] for r in reqs], bitmask, return_logprobs=want_lp)

    def _vocab_mask(self, n: int) -> np.ndarray:
        """[n, words] bitmask allowing the tokenizer's ids only (ids past it are never drawn); never modified."""
        mask = self._limit_masks.get(n)
        if mask is None:
            limit = self.runner.sample_vocab
            mask = np.full((n, bitmask_words(self.runner.vocab_size)), -1, np.int32)
            w, b = divmod(limit, 32)
            if b:
                mask[:, w] &= np.int32((1 << b) - 1) if b < 31 else np.int32(0x7FFFFFFF)
            mask[:, w + (1 if b else 0):] = 0
            mask.flags.writeable = False
            self._limit_masks[n] = mask
        return mask

    def _sync_lanes(self) -> None:
        """A committed token the thinking budget replaced: the lane's counts follow what was committed."""
        ds = self.device_sampler
        assert ds is not None  # called only when _sampled holds device sampler draws
        for rid, t in self._sampled.items():
            r = self.scheduler.running.get(rid)
            if r is not None and r.generated and r.generated[-1] != t and rid in self._lanes:
                ds.remove_tokens(self._lanes[rid], [t])
                ds.add_tokens(self._lanes[rid], [r.generated[-1]])
        self._sampled = {}

    def _sample(self, reqs: list[Request], logits: np.ndarray, fed: int = 0) -> dict[int, RowResult]:
        logits = mask_logits([r.grammar for r in reqs], logits)  # -inf where a grammar forbids the next token
        want_lp = any(r.params.logprobs or r.params.top_logprobs > 0 for r in reqs)
        res = self.sampler.sample(logits, [r.row for r in reqs], return_logprobs=want_lp)
        toks, lps = res if want_lp else (res, [None] * len(reqs))
        return {r.rid: RowResult([int(t)], [lp], fed=fed) for r, t, lp in zip(reqs, toks, lps)}

    def audit(self) -> list[str]:
        """KVManager.audit over the live sequences (call while the engine is idle: tests, debugging)."""
        live = tuple(r.seq for r in list(self.scheduler.running.values()) + list(self.scheduler.waiting))
        return self.kv.audit(live)

    # ---- statistics ------------------------------------------------------------------------------
    def _take_stats(self) -> EngineStats:
        kv = self.kv
        cache, host = kv.cache, kv.host
        graphs = self.runner.decode_graphs
        g = {"enabled": graphs is not None, "graphs": len(graphs.graph_nodes()) if graphs else 0,
             **(dict(graphs.stats) if graphs else {})}
        return EngineStats(
            taken_unix_ms=int(time.time() * 1000), running=self._running, scheduler=self.scheduler.state(),
            counters=replace(self.counters), spec=replace(self.spec_counters), model=self.model_info,
            cache=cache.summary() if cache is not None else {}, planner=dict(kv.stats), occupancy=kv.occupancy(),
            transfers=dict(host.stats) if host is not None else {},
            arena=host.arena.stats() if host is not None else {}, cuda_graphs=g, host_step=self.timer.summary(),
            vision=self.runner.vision.snapshot() if self.runner.vision is not None else {})
