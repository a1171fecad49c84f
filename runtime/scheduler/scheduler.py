"""The scheduler: plans each step and is the one place where tokens are committed.

`schedule()` admits waiting requests (restoring cached prefixes through the KV manager), picks the
prefill chunks and the decode rows of the next step, reserves their pages (preempting the youngest
request when the device is full) and returns a StepPlan. The engine executes it and hands back the
tokens each row produced; `update(plan, results)` commits them: thinking budget, stop tokens, stop
strings and the length limit apply here to every token, whether plain decoding sampled it or a
speculative method accepted it, and the speculative method is told how many survived so it can roll
its state back. Only the engine thread touches a Scheduler.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Protocol

from ..errors import ContextTooLong, QueueTimeout
from ..kv.manager import KVManager
from ..stats import Counters, SchedulerState
from ..step_timing import StepTimer
from .request import Delta, Finished, Request


# ---- the plan and what execution returns ------------------------------------------------------
@dataclass
class PrefillWork:
    req: Request
    tokens: list[int]
    samples: bool  # the chunk ends the prompt: its last row gives the first generated token


@dataclass
class DecodeWork:
    req: Request
    feed: list[int]  # tokens the model consumes this step (re-fed tokens, then the pending token)
    draft: int = 0  # draft tokens to propose (speculative decoding; 0 = plain decode)


@dataclass
class StepPlan:
    prefill: list[PrefillWork] = field(default_factory=list)
    decode: list[DecodeWork] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.prefill or self.decode)


@dataclass
class RowResult:
    """Tokens one row produced, in order, for `update` to commit (it may keep fewer)."""

    tokens: list[int]
    logprobs: list  # one entry per token (None when not requested)
    fed: int = 0  # tokens the model consumed this step (KV written, state advanced)
    drafted: int = 0
    accepted: int = 0


class Speculation(Protocol):
    """What the scheduler asks of a speculative method (runtime/spec)."""

    def refeed(self, req: Request) -> list[int]: ...  # committed tokens the state must consume again

    def draft_budget(self, req: Request, room: int) -> int: ...

    def settle(self, req: Request, committed: int) -> None: ...

    def release(self, req: Request) -> None: ...


@dataclass
class ThinkControl:
    """Token ids of the reasoning markers and the text forced when a thinking budget runs out."""

    start_id: Optional[int] = None
    end_id: Optional[int] = None
    close_ids: list[int] = field(default_factory=list)


# ---- the scheduler ------------------------------------------------------------------------------
class Scheduler:
    def __init__(self, kv: KVManager, counters: Counters, *, max_concurrency: int, prefill_chunk: int,
                 max_context: int, pending_timeout_ms: int, turn_start: Optional[list[int]] = None,
                 think: Optional[ThinkControl] = None, spec: Optional[Speculation] = None,
                 checkpoint_turns: int = 2):
        self.kv, self.counters = kv, counters
        self.max_concurrency, self.prefill_chunk = max_concurrency, prefill_chunk
        self.max_context, self.pending_timeout_ms = max_context, pending_timeout_ms
        self.turn_start = list(turn_start or [])
        self.checkpoint_turns = checkpoint_turns
        self.think = think or ThinkControl()
        self.spec = spec
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.timer: Optional[StepTimer] = None  # the engine's: detok / emit seconds of each commit

    # ---- queue -------------------------------------------------------------------------
    def add(self, r: Request) -> None:
        self.waiting.append(r)

    def cancel(self, rid: int) -> None:
        for r in list(self.waiting):
            if r.rid == rid:
                self.waiting.remove(r)
                self.finish(r, "cancelled")
        running = self.running.get(rid)
        if running is not None:
            self.finish(running, "cancelled")

    def state(self) -> SchedulerState:
        acts = list(self.running.values())
        return SchedulerState(running=len(acts), prefilling=sum(1 for a in acts if a.feed),
                              decode_ready=sum(1 for a in acts if a.decoding), waiting=len(self.waiting))

    def idle(self) -> bool:
        return not self.waiting and not self.running

    # ---- planning -------------------------------------------------------------------------
    def schedule(self) -> StepPlan:
        self._expire()
        self._admit()
        plan = StepPlan()
        planned: set[int] = set()
        budget = self.prefill_chunk
        for r in list(self.running.values()):
            if not r.feed or budget <= 0 or r.rid not in self.running:
                continue
            assert r.seq is not None  # running requests hold their sequence
            limit = budget
            nxt = next((c for c in r.checkpoints if c > r.seq.length), None)
            if nxt is not None:
                limit = min(limit, nxt - r.seq.length)  # stop exactly at the turn boundary
            take = r.feed[:limit]
            if not self._reserve(r, len(take), planned):
                continue
            plan.prefill.append(PrefillWork(r, take, samples=len(take) == len(r.feed) and r.pending_token is None))
            planned.add(r.rid)
            budget -= len(take)
        for r in list(self.running.values()):
            if not r.decoding or r.rid not in self.running or r.rid in planned:
                continue
            assert r.seq is not None and r.pending_token is not None  # running and decoding
            feed = (self.spec.refeed(r) if self.spec else []) + [r.pending_token]
            k = 0
            if self.spec is not None:
                room = min(r.max_tokens - len(r.generated) - 1,  # this round emits up to k + 1 tokens
                           self.max_context - r.seq.length - len(feed))
                k = self.spec.draft_budget(r, max(0, room))
                if k and not self.kv.ensure(r.seq, len(feed) + k):
                    k = 0
            if not k and not self._reserve(r, len(feed), planned):
                continue
            plan.decode.append(DecodeWork(r, feed, k))
            planned.add(r.rid)
        # a preemption may have removed a row planned before its victim was chosen
        plan.prefill = [w for w in plan.prefill if w.req.rid in self.running]
        plan.decode = [w for w in plan.decode if w.req.rid in self.running]
        return plan

    def _expire(self) -> None:
        limit = self.pending_timeout_ms / 1000.0
        now = time.monotonic()
        for r in [r for r in self.waiting if not r.t_admit and now - r.t_submit > limit]:
            self.waiting.remove(r)
            self.counters.requests_queue_timeout += 1
            self.counters.requests_finished += 1
            r.sink.admit(QueueTimeout(now - r.t_submit))

    def _admit(self) -> None:
        while len(self.running) < self.max_concurrency and self.waiting:
            r = self.waiting[0]
            need = self.kv.pages_for(len(r.req.prompt_ids) + 1)
            if need > self.kv.pages.num_pages:
                self.waiting.popleft()
                self.counters.requests_rejected_context += 1
                self.counters.requests_finished += 1
                r.sink.admit(ContextTooLong(len(r.req.prompt_ids), self.kv.capacity_tokens - 1, "device KV pool"))
                continue
            history = r.fed_tokens()
            if self.running and self.kv.pages_for(len(history) + 1) > self.kv.reclaimable_pages():
                return  # admitting it now would only preempt a running request (and be preempted back)
            resumed = r.pending_token is not None
            t_kv = time.monotonic()
            seq = self.kv.admit(r.cache_keys(history), r.identity, r.req.session_key,
                                max_reuse=len(history) if resumed else len(history) - 1)
            if seq is None:
                return  # wait for running requests to release a state slot
            self.waiting.popleft()
            seq.media = r.req.media  # the executor reads image rows / M-RoPE positions from here
            r.seq = seq
            r.feed = history[seq.length:]
            if not r.t_admit:  # first admission (a preempted request keeps its figures)
                r.cached_tokens = seq.length
                r.checkpoints = self._checkpoints(r.req.prompt_ids, seq.length)
                r.t_admit = time.monotonic()
                r.admit_ms = (r.t_admit - t_kv) * 1000
                r.sink.cached_tokens = seq.length
                q_ms = (r.t_admit - r.t_submit) * 1000
                self.counters.queue_time_ms_last = q_ms
                self.counters.queue_time_ms_max = max(self.counters.queue_time_ms_max, q_ms)
                r.sink.admit(None)
            self.running[r.rid] = r

    def _checkpoints(self, prompt: list[int], cached: int) -> list[int]:
        """Positions of the last `checkpoint_turns` turn openers after the cached prefix: the opener
        of the generation prompt (the next turn reuses the history even when the client drops this
        answer's reasoning) and of the message before it (a client that edits or appends to its last
        message, as agents do on retries and reminders, reuses everything before that message)."""
        k = len(self.turn_start)
        if not k:
            return []
        out: list[int] = []
        for i in range(len(prompt) - k, cached, -1):
            if prompt[i:i + k] == self.turn_start:
                out.append(i)
                if len(out) == self.checkpoint_turns:
                    break
        return sorted(out)

    def _reserve(self, r: Request, n: int, protect: set) -> bool:
        """Pages for n more tokens of r, preempting other requests (never those in `protect`)."""
        assert r.seq is not None  # running requests hold their sequence
        while not self.kv.ensure(r.seq, n):
            victims = [v for v in self.running.values() if v is not r and v.rid not in protect]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda v: v.t_admit))
        return True

    def _preempt(self, v: Request) -> None:
        """Send v back to the head of the queue. Its sequence is released like a finished one (kept as
        a cache entry, spilled to the host under pressure), so readmission restores it instead of
        recomputing whenever the entry survives."""
        if self.spec is not None:
            self.spec.release(v)
        assert v.seq is not None  # running requests hold their sequence
        self.kv.release(v.seq, v.cache_keys(v.fed_tokens()), v.identity, v.req.session_key)
        v.seq = None
        v.preemptions += 1
        self.counters.preemptions += 1
        del self.running[v.rid]
        self.waiting.appendleft(v)

    # ---- committing -------------------------------------------------------------------------
    def update(self, plan: StepPlan, results: dict[int, RowResult], advanced: bool = False) -> None:
        """Advance sequences by what the step fed and commit what it produced. advanced: the decode rows'
        feed was accounted when the step was launched (overlapped steps, `advance_launched`); a row whose
        request ended while the step ran is then dropped (its token is never committed)."""
        now = time.monotonic()
        if plan.prefill:
            self.counters.prefill_rounds += 1
        for w in plan.prefill:
            r = w.req
            assert r.seq is not None  # planned rows are running
            self.kv.advance(r.seq, len(w.tokens))
            r.feed = r.feed[len(w.tokens):]
            r.prompt_computed += len(w.tokens)
            self.counters.computed_prefill_tokens += len(w.tokens)
            if r.seq.length in r.checkpoints:
                self.kv.checkpoint(r.seq, r.cache_keys(r.req.prompt_ids), r.identity, r.req.session_key)
                r.checkpoints = [c for c in r.checkpoints if c > r.seq.length]
            if w.samples:
                r.t_prefill_done = r.t_prefill_done or now
                self._commit_row(r, results[r.rid], now)
        if plan.decode:
            self.counters.decode_rounds += 1
            self.counters.decode_row_rounds += len(plan.decode)
        for d in plan.decode:
            if advanced and d.req.rid not in self.running:
                continue  # ended by the previous step's commit: this row's token is discarded
            res = results[d.req.rid]
            assert d.req.seq is not None  # planned rows are running
            if not advanced:
                self.kv.advance(d.req.seq, res.fed)
            d.req.pending_token = None
            self._commit_row(d.req, res, now)

    # ---- overlapped decode (the engine launches step N+1 before committing step N) ----------------
    def overlappable(self, r: Request) -> bool:
        """r's next token can be fed before it is committed: committing it will not replace it (a
        thinking budget's forced close) and no grammar needs it to mask the following draw."""
        if r.grammar is not None or r.forced:
            return False
        budget, th = r.req.thinking_budget, self.think
        return budget is None or th.end_id is None or not r.in_think or r.think_tokens < budget

    def continues(self, r: Request, t: int) -> bool:
        """Committing t leaves r running as far as ids and lengths tell (a stop string may still end it)."""
        return t not in r.stop_ids and len(r.generated) + 1 < r.max_tokens and self.overlappable(r)

    def plan_next(self, prev: StepPlan, results: dict[int, RowResult]) -> Optional[StepPlan]:
        """The decode step after `prev` (all of whose rows were launched with `advance_launched`), feeding
        each row the token prev sampled, planned before prev is committed; None when the next step needs
        the scheduler (a request it could admit, one prefilling, no page for a row). Requests waiting
        for a lane while every lane is busy do not stop it (their queue timeout still applies)."""
        if self.waiting:
            self._expire()
            if self.waiting and len(self.running) < self.max_concurrency:
                return None
        if not set(self.running) <= {d.req.rid for d in prev.decode}:
            return None
        rows = []
        for d in prev.decode:
            r = d.req
            if r.rid not in self.running:
                continue  # ended by the commit before: its row in prev is discarded
            t = results[r.rid].tokens[-1]
            if self.continues(r, t):
                rows.append(DecodeWork(r, [t]))
        if not rows or not all(self.kv.ensure(w.req.live_seq, 1) for w in rows):
            return None  # (a page reserved here stays with its sequence, as schedule() leaves it)
        return StepPlan(decode=rows)

    def advance_launched(self, plan: StepPlan) -> None:
        """Account a launched decode step's feed now (its commit then passes advanced=True): the
        state slot moves when the step runs, so a request that ends before its row commits releases a
        sequence whose length matches what the slot and pages hold."""
        for d in plan.decode:
            self.kv.advance(d.req.live_seq, len(d.feed))

    def _commit_row(self, r: Request, res: RowResult, now: float) -> None:
        committed, end = self._commit(r, res.tokens, res.logprobs, now)
        r.draft_n += res.drafted
        r.draft_accepted += min(res.accepted, max(0, committed - 1))
        if self.spec is not None:
            self.spec.settle(r, committed)
        if end is not None and end[0] == "error":
            self.finish(r, "error", error=f"token {res.tokens[committed - 1]} violates the response constraint")
        elif end is not None:
            self.finish(r, end[0], stop_matched=end[1])

    def _commit(self, r: Request, tokens: list[int], logprobs: list, now: float):
        """Commit tokens in order; returns (how many were kept, (finish reason, matched) or None).
        A token the thinking budget replaces is the last one kept: the rest were drawn after the
        token it replaced."""
        for i, t in enumerate(tokens):
            forced = self._think_budget(r, t)
            end = self._commit_one(r, forced, logprobs[i] if i < len(logprobs) else None, now)
            if forced != t:  # the sampler recorded its own draws: penalties follow what is fed
                r.row.rollback(len(tokens) - i)
                r.row.append(forced)
                return i + 1, end
            if end is not None:
                return i + 1, end
        return len(tokens), None

    def _think_budget(self, r: Request, t: int) -> int:
        """Track reasoning; past its budget a request gets Qwen's early-close text and </think>
        instead of what was drawn (one forced token per position, so KV and state follow it)."""
        th = self.think
        if not r.in_think and th.start_id is not None and t == th.start_id and not r.generated:
            r.in_think = True  # the model opened its own reasoning block
        budget = r.req.thinking_budget
        if not r.forced and budget is not None and th.end_id is not None and r.in_think and r.think_tokens >= budget:
            r.forced = list(th.close_ids)
        if r.forced:
            t = r.forced.pop(0)
        if r.in_think:
            r.think_tokens += 1
            r.reasoning_tokens += 1
            r.in_think = t != th.end_id
        return t

    def _emit(self, r: Request, text: str, lp) -> None:
        t0 = time.perf_counter()
        r.sink.push(Delta(text, r.unsent_ids, [lp] if lp is not None else []))
        r.unsent_ids = []
        if self.timer is not None:
            self.timer.add("emit", time.perf_counter() - t0)

    def _commit_one(self, r: Request, t: int, lp, now: float):
        """Record one token: stream it, apply stop tokens/strings and the length limit. Returns
        (reason, matched stop string) when the request ends, else None (t is then pending)."""
        if not r.t_first:
            r.t_first = now
        if r.grammar is not None and not r.grammar.accept(t):  # a forced token left the grammar
            return "error", None
        r.generated.append(t)
        self.counters.committed_decode_tokens += 1
        if t in r.stop_ids or (r.grammar is not None and r.grammar.is_terminated()):
            emit, stopped, _ = r.stops.feed(r.detok.flush())
            emit += "" if stopped else r.stops.flush()
            if emit or r.unsent_ids:
                self._emit(r, emit, None)
            return "stop", None
        r.unsent_ids.append(t)
        t0 = time.perf_counter()
        emit, stopped, matched = r.stops.feed(r.detok.add(t))
        if self.timer is not None:
            self.timer.add("detok", time.perf_counter() - t0)
        if emit or lp is not None:
            self._emit(r, emit, lp)
        if stopped:
            return "stop", matched
        if len(r.generated) >= r.max_tokens:
            rest = r.stops.feed(r.detok.flush())[0] + r.stops.flush()
            if rest or r.unsent_ids:
                self._emit(r, rest, None)
            return "length", None
        r.pending_token = t
        return None

    # ---- endings ------------------------------------------------------------------------------
    def finish(self, r: Request, reason: str, stop_matched: Optional[str] = None, error: Optional[str] = None) -> None:
        self.running.pop(r.rid, None)
        if self.spec is not None:
            self.spec.release(r)
        if r.seq is not None:
            # an engine error may have interrupted an in-place forward: never cache that state
            self.kv.release(r.seq, r.cache_keys(r.all_tokens()), r.identity, r.req.session_key,
                            keep=reason != "error")
            r.seq = None
        r.sink.admit(None)  # a no-op once admitted
        end = time.monotonic()
        t_first = r.t_first or end
        prompt_ms = ((r.t_prefill_done or t_first) - (r.t_admit or end)) * 1000
        pred_ms = (end - t_first) * 1000
        n_out = len(r.generated)
        n_in = len(r.req.prompt_ids)
        usage = {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out,
                 "cached_tokens": r.cached_tokens, "reasoning_tokens": r.reasoning_tokens}
        timings = {
            "cache_n": r.cached_tokens, "prompt_n": r.prompt_computed, "prompt_ms": round(prompt_ms, 3),
            "prompt_per_second": round(r.prompt_computed / prompt_ms * 1000, 3) if prompt_ms > 0 else 0.0,
            "predicted_n": n_out, "predicted_ms": round(pred_ms, 3),
            "predicted_per_second": round((n_out - 1) / pred_ms * 1000, 3) if pred_ms > 0 and n_out > 1 else 0.0,
            "queue_ms": round(((r.t_admit or end) - r.t_submit) * 1000, 3), "admit_ms": round(r.admit_ms, 3),
            "draft_n": r.draft_n, "draft_n_accepted": r.draft_accepted,
        }
        forced = getattr(getattr(self.spec, "forced", None), "tokens_per_round", None)
        if forced is not None:  # a benchmark profile, not the model's output: say so wherever timings go
            timings["draft_forced_acceptance"] = forced
        c = self.counters
        if reason == "cancelled":
            c.requests_cancelled += 1
        elif reason == "error":
            c.requests_failed += 1
        c.requests_finished += 1
        r.sink.push(Finished(reason, usage, timings, stop_matched, error))

    def fail_running(self, error: str) -> None:
        """A step raised: end every running request with the error (their state is not cached)."""
        for r in list(self.running.values()):
            self.finish(r, "error", error=error)

    def stop_all(self, error: str) -> None:
        for r in list(self.waiting):
            self.waiting.remove(r)
            self.finish(r, "error", error=error)
        self.fail_running(error)
