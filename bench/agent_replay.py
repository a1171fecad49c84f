"""Agent-session replay: concurrent coding-agent conversations that grow turn by turn, over HTTP.

N sessions (default 3) run in lockstep rounds against `ninfer serve` (started here, or --url): in each
round every session sends its whole conversation as a streamed OpenAI chat completion (tools offered,
`user` = the session key, `max_tokens` generated with `ignore_eos`), then appends a tool-call-shaped turn
of 1-4k new tokens: an assistant tool call (OpenAI `tool_calls`, which the chat template renders in the
model's XML format) and the tool's result (optionally a user message every --user-every turns). Sessions
grow to --target-tokens or to what the time budget holds (the output states which). When this script
starts the server, it runs sessions - 1 sequences at a time (--server-concurrency) with a device KV pool
that holds only those, below the sessions' total, and a host tier for the rest: each round one session
waits while the others run, its cached KV is demoted to the host meanwhile and restored for its turn.

Per turn: prompt tokens, new tokens (the prompt past the longest run of whole chat-template turns it
shares with the session's previous prompt, i.e. past the last turn opener the engine can checkpoint),
cached tokens, computed (prefilled) tokens (the engine's timings.prompt_n, which also counts prompts
recomputed after a preemption), re-prefilled tokens = computed - new when positive (reused_beyond_history
when negative: the cache held more, e.g. another session's identical system prompt), TTFT, the service TTFT
(TTFT minus the wait for a free lane: the server's queue_ms less its admit_ms, the admission's own KV work) and
the target it is held to = new tokens / prefill rate + 0.25 s (prefill rate: the median of the sessions' cold first turns, or
--prefill-rate). Per round: /stats deltas of the host<->device transfers (restore = h2d, spill = d2h; KV
pages + state slots), their GB/s from the engine's own copy timings, and that rate against the pinned
host<->device copy bandwidth measured with torch in the same run (null without torch and a GPU); beside
them the seconds the device spent draining queued compute before the copies (not copy time).

Prompt token counts are computed here with the model's chat template and tokenizer (one segment per
template turn, cached) and checked against the server's usage.prompt_tokens.

    python bench/agent_replay.py                        # embedded tiny model, a short replay
    python bench/agent_replay.py .gpu/q27b --sessions 3 --target-tokens 400000 --budget-s 540 -o agent.json
"""
from __future__ import annotations

import argparse
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_common import (PRESETS, BenchError, WordPool, decode_rate, device_rates_subprocess, flag_value,  # noqa: E402
                          get_stats, read_manifest_json, run_threads, serving, stats_delta, stream_chat, summarize, transfer_rates,
                          run_and_report, write_json)

TURN_OPENER = "<|im_start|>"
SYSTEM = ("You are a coding agent working in a large repository. Use the tools to read files, search and run "
          "commands; keep going until the task is done.")
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "description": "Read a file of the repository",
                                      "parameters": {"type": "object", "properties": {
                                          "path": {"type": "string", "description": "path from the repository root"}},
                                          "required": ["path"]}}},
    {"type": "function", "function": {"name": "run_command", "description": "Run a shell command",
                                      "parameters": {"type": "object", "properties": {
                                          "command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {"name": "search", "description": "Search the repository for a pattern",
                                      "parameters": {"type": "object", "properties": {
                                          "pattern": {"type": "string"}, "path": {"type": "string"}},
                                          "required": ["pattern"]}}},
]


# ---- conversations ---------------------------------------------------------------------------------------
class PromptTokens:
    """Exact prompt token ids of a conversation, rendered with the model's chat template as the server
    renders it. The text is tokenized one template turn at a time (a turn opener is a special token, which
    the tokenizer splits on before anything else, so the pieces add up exactly) and every piece is cached,
    so a growing conversation costs only its new turns."""

    def __init__(self, model_dir: str, words: WordPool, thinking: bool, tools: Optional[list]):
        from ninfer_mlc.chat_template import ChatTemplate

        self.template = ChatTemplate.from_model_dir(model_dir)
        self.tok, self.thinking, self.tools = words.tok, thinking, tools
        self._memo: dict[str, int] = {}
        self._lock = threading.Lock()

    def segments(self, messages: list[dict]) -> list[tuple[str, int]]:
        """[(template-turn text, tokens)] of the prompt, generation prompt included."""
        text = self.template.render(messages, tools=self.tools, add_generation_prompt=True, preserve_thinking=False,
                                    enable_thinking=self.thinking)
        parts = text.split(TURN_OPENER)
        segs = ([parts[0]] if parts[0] else []) + [TURN_OPENER + p for p in parts[1:]]
        out = []
        for s in segs:
            with self._lock:
                n = self._memo.get(s)
            if n is None:
                n = len(self.tok.encode(s, add_special_tokens=False).ids)
                with self._lock:
                    self._memo[s] = n
            out.append((s, n))
        return out


def shared_turns_tokens(prev: list[tuple[str, int]], cur: list[tuple[str, int]]) -> int:
    """Tokens of the leading template turns two prompts have in common (the engine's best reuse: its
    checkpoints sit at turn openers)."""
    n = 0
    for (a, k), (b, _) in zip(prev, cur):
        if a != b:
            break
        n += k
    return n


class Session:
    """One agent conversation and the tool-call-shaped turns appended to it."""

    def __init__(self, idx: int, words: WordPool, seed: int, initial_tokens: int, turn_tokens: tuple[int, int],
                 user_every: int):
        self.idx, self.words = idx, words
        self.rng = np.random.default_rng([seed, idx])
        self.turn_tokens, self.user_every = turn_tokens, user_every
        self.key = f"agent-session-{idx}"
        task = "Task: fix the failing build and explain the cause. Repository notes follow.\n"
        self.messages: list[dict] = [{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": task + words.text(initial_tokens, self.rng, 12)}]
        self.prev_segments: Optional[list] = None
        self.turn = 0
        self.prompt_tokens = 0

    def _word(self) -> str:
        return self.words.words[int(self.rng.integers(0, len(self.words.words)))]

    def append_turn(self) -> int:
        """An assistant tool call and its result (about turn_tokens[0..1] tokens); returns the target size."""
        lo, hi = self.turn_tokens
        n = int(self.rng.integers(lo, hi + 1))
        kind = int(self.rng.integers(0, 3))
        path = f"src/{self._word()}/{self._word()}_{self._word()}.py"
        if kind == 0:
            name, args, head = "read_file", {"path": path}, f"# {path}\n"
        elif kind == 1:
            name, args, head = "run_command", {"command": f"python -m pytest -x tests/test_{self._word()}.py"}, "$ \n"
        else:
            name, args, head = "search", {"pattern": self._word(), "path": "src"}, f"matches in {path}:\n"
        call_id = f"call_{self.idx}_{self.turn}"
        self.messages.append({"role": "assistant", "content": "",
                              "tool_calls": [{"id": call_id, "type": "function",
                                              "function": {"name": name, "arguments": args}}]})
        self.messages.append({"role": "tool", "tool_call_id": call_id,
                              "content": head + self.words.text(max(1, n * 12 // 13), self.rng, 12)})
        if self.user_every and (self.turn + 1) % self.user_every == 0:
            self.messages.append({"role": "user", "content": "Good. Continue with the next step."})
        return n


# ---- one turn --------------------------------------------------------------------------------------------
def run_turn(url: str, headers: dict, s: Session, counter: PromptTokens, a, deadline: float) -> dict:
    segs = counter.segments(s.messages)
    local = sum(k for _, k in segs)
    shared = shared_turns_tokens(s.prev_segments, segs) if s.prev_segments else 0
    body = {"messages": s.messages, "max_tokens": a.max_tokens, "ignore_eos": True, "user": s.key,
            "chat_template_kwargs": {"enable_thinking": counter.thinking}, **PRESETS[a.preset]}
    if counter.tools:
        body["tools"] = counter.tools
    if a.preset != "greedy":
        body["seed"] = a.seed * 100_000 + s.idx * 1000 + s.turn
    rec = stream_chat(url, body, timeout=a.request_timeout_s, headers=headers, deadline=deadline)
    u, t = rec.usage or {}, rec.timings or {}
    computed = t.get("prompt_n")
    new = local - shared
    row = {"session": s.idx, "turn": s.turn, "prompt_tokens": u.get("prompt_tokens"), "prompt_tokens_local": local,
           "prompt_tokens_match": u.get("prompt_tokens") == local,
           "appended_tokens": local - s.prompt_tokens if s.turn else local,
           "new_tokens": new, "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens"),
           "computed_tokens": computed, "re_prefilled_tokens": None if computed is None else max(0, computed - new),
           "reused_beyond_history": None if computed is None else max(0, new - computed),
           "ttft_s": None if rec.ttft is None else round(rec.ttft, 4),
           "completion_tokens": u.get("completion_tokens"), "decode_tok_s": decode_rate(rec),
           "queue_ms": t.get("queue_ms"), "admit_ms": t.get("admit_ms"), "prompt_ms": t.get("prompt_ms"),
           "prompt_per_second": t.get("prompt_per_second"), "finish_reason": rec.finish_reason, "error": rec.error}
    if row["decode_tok_s"] is not None:
        row["decode_tok_s"] = round(row["decode_tok_s"], 2)
    # the wait for a free lane (the replay runs sessions - 1 lanes by design) is not the turn's service time:
    # queue_ms minus the admission's own KV work (lookup, restore, room made), as the server reports them
    if row["ttft_s"] is not None and t.get("queue_ms") is not None and t.get("admit_ms") is not None:
        row["lane_wait_s"] = round(max(0.0, t["queue_ms"] - t["admit_ms"]) / 1000, 4)
        row["ttft_service_s"] = round(row["ttft_s"] - row["lane_wait_s"], 4)
    s.prev_segments, s.prompt_tokens = segs, local
    s.turn += 1
    return row


# ---- the run ---------------------------------------------------------------------------------------------
def _layout(model_dir: Optional[str]):
    """The compiled model's pool layout (manifest), or None without a manifest (e.g. --url)."""
    if not read_manifest_json(model_dir):
        return None
    from ninfer_mlc.contract.manifest import read_manifest

    man = read_manifest(model_dir, verify="none")
    return man.layout(), man.page_size


def kv_bytes_per_token(model_dir: Optional[str]) -> Optional[float]:
    got = _layout(model_dir)
    return None if got is None else got[0].page_bytes / got[1]


def state_slot_bytes(model_dir: Optional[str]) -> int:
    """One recurrent-state slot (conv + SSM) of the model: a host-tier entry holds one beside its KV pages."""
    got = _layout(model_dir)
    return 0 if got is None else int(got[0].state_slot_bytes)


def server_flags(a, model_dir: Optional[str]) -> tuple[list[str], dict]:
    """`ninfer serve` flags: the user's, plus (each only where the user set none) `active` concurrent
    sequences (default sessions - 1, so a session's request waits while others run and its KV is
    demoted to the host tier meanwhile), a max context just above the target, a device KV pool that holds
    the active sequences and no more (below the sessions' total; never below the max context, which the
    server refuses), a host tier sized for the rest, and a queue deadline long enough for a waiting turn."""
    flags = shlex.split(a.serve_args)
    sized: dict = {}
    one = a.target_tokens + a.turn_tokens[1] + a.max_tokens
    total = a.sessions * one
    active = flag_value(flags, "--max-concurrency")
    if active is None:
        active = a.server_concurrency or max(1, a.sessions - 1)
        flags += ["--max-concurrency", str(active)]
        sized["max_concurrency"] = active
    man = read_manifest_json(model_dir) or {}
    max_ctx = flag_value(flags, "--max-context")
    if max_ctx is None:
        max_ctx = min(int(man.get("max_context") or one), one + 1024)
        flags += ["--max-context", str(max_ctx)]
        sized["max_context"] = max_ctx
    cap = flag_value(flags, "--kv-capacity")
    if cap is None:
        cap = max(int(active) * one, int(max_ctx))
        flags += ["--kv-capacity", str(cap)]
        sized["kv_capacity_tokens"] = cap
    per_tok = kv_bytes_per_token(model_dir)
    if flag_value(flags, "--host-kv-mib") is None and per_tok and str(cap).isdigit():
        # the KV beyond the device pool, plus the state slots the host tier keeps as its floor (ninfer serve
        # --host-state-slots, default 8) and one per demoted entry (a waiting session: checkpoint + frontier)
        slots = int(flag_value(flags, "--host-state-slots") or 8) + 2 * a.sessions
        mib = int((max(0, total - int(cap)) * per_tok * 1.25 + slots * state_slot_bytes(model_dir)) / 2 ** 20) + 256
        flags += ["--host-kv-mib", str(mib)]
        sized["host_kv_mib"] = mib
    if flag_value(flags, "--pending-timeout-ms") is None:
        flags += ["--pending-timeout-ms", str(int(a.request_timeout_s * 1000))]
    sized["sessions_total_tokens"] = total
    return flags, sized


def round_row(r: int, rows: list[dict], before: dict, after: dict, rates: dict, wall: float) -> dict:
    delta = stats_delta(before, after)
    tr = transfer_rates(delta)
    h2d, d2h = rates.get("pinned_h2d_Bps"), rates.get("pinned_d2h_Bps")
    tr["restore_vs_pinned"] = round(tr["restore_GBps"] * 1e9 / h2d, 4) if tr["restore_GBps"] and h2d else None
    tr["spill_vs_pinned"] = round(tr["spill_GBps"] * 1e9 / d2h, 4) if tr["spill_GBps"] and d2h else None
    return {"round": r, "wall_s": round(wall, 3), "prompt_tokens": [x["prompt_tokens_local"] for x in rows],
            "transfers": tr, "pressure": delta["pressure"], "preemptions": delta["counters"].get("preemptions", 0),
            "cache_reuse": delta["cache_reuse"]}


def summary(turns: list[dict], rounds: list[dict], prefill_rate: Optional[float]) -> dict:
    warm = [t for t in turns if t["turn"] > 0 and t["error"] is None]
    re = [t["re_prefilled_tokens"] for t in warm if t["re_prefilled_tokens"] is not None]
    ttft = lambda t: t.get("ttft_service_s", t["ttft_s"])  # noqa: E731
    within = [ttft(t) <= t["ttft_target_s"] for t in warm if t.get("ttft_target_s") is not None and t["ttft_s"]]
    tot = lambda k: sum(r["transfers"][k] for r in rounds)  # noqa: E731
    rb, rs, sb, ss = tot("restore_bytes"), tot("restore_seconds"), tot("spill_bytes"), tot("spill_seconds")
    waits = {f"{k}_wait_seconds": round(sum(r["transfers"].get(f"{k}_wait_seconds", 0.0) for r in rounds), 6)
             for k in ("restore", "spill")}
    return {"turns": len(turns), "errors": sum(1 for t in turns if t["error"]),
            "prompt_tokens_all_match": all(t["prompt_tokens_match"] for t in turns if t["error"] is None),
            "re_prefilled_tokens_cached_turns": {"total": sum(re), "max": max(re) if re else None,
                                                 "turns_above_zero": sum(1 for x in re if x > 0)},
            "ttft_s_cached_turns": summarize([t["ttft_s"] for t in warm if t["ttft_s"] is not None], nd=4),
            "ttft_service_s_cached_turns": summarize([t["ttft_service_s"] for t in warm if t.get("ttft_service_s") is not None],
                                                     nd=4),
            "ttft_within_target": {"turns": len(within), "met": sum(within),
                                   "measure": "TTFT minus the wait for a free lane (ttft_service_s) where the server "
                                              "reports admit_ms, else TTFT"},
            "prefill_rate_tok_s": prefill_rate,
            "restore_bytes": rb, "restore_GBps": round(rb / rs / 1e9, 3) if rs > 0 and rb else None,
            "spill_bytes": sb, "spill_GBps": round(sb / ss / 1e9, 3) if ss > 0 and sb else None,
            **waits,
            "preemptions": sum(r["preemptions"] for r in rounds),
            "restores_host": sum(r["pressure"].get("restores_host", 0) for r in rounds),
            "decode_tok_s": summarize([t["decode_tok_s"] for t in warm if t["decode_tok_s"]], nd=2)}


def run(a) -> dict:
    t_start = time.perf_counter()
    budget_end = t_start + a.budget_s
    model_dir = a.model
    if model_dir is None:
        if a.url:
            raise BenchError("--url needs the model directory too (chat template and tokenizer)")
        from ninfer_mlc.paths import default_model_dir

        model_dir = str(default_model_dir())
    words = WordPool(model_dir)
    counter = PromptTokens(model_dir, words, a.thinking == "on", None if a.no_tools else TOOLS)
    headers = {"authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    flags, sized = (shlex.split(a.serve_args), {}) if a.url else server_flags(a, model_dir)
    doc: dict = {"schema": "ninfer_mlc_agent_replay", "schema_version": 1,
                 "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                 "config": {"model": model_dir, "url": a.url, "serve_args": flags, "sized_by_bench": sized,
                            "sessions": a.sessions, "target_tokens": a.target_tokens,
                            "initial_tokens": a.initial_tokens, "turn_tokens": list(a.turn_tokens),
                            "max_tokens": a.max_tokens, "preset": a.preset, "sampling": PRESETS[a.preset],
                            "thinking": a.thinking, "tools": not a.no_tools, "user_every": a.user_every,
                            "budget_s": a.budget_s},
                 "turns": [], "rounds": []}
    doc["rates"] = device_rates_subprocess(("pinned",)) if a.rates else {}
    rates = doc["rates"] if "error" not in doc["rates"] else {}
    sessions = [Session(i, words, a.seed, a.initial_tokens, a.turn_tokens, a.user_every) for i in range(a.sessions)]
    with serving(doc, model_dir, flags, a.url, a.server_log, headers) as url:
        # the last turn may add a largest turn, a tool call's template tokens and the generated tokens
        limit = (doc["load"].get("max_context") or a.target_tokens + a.turn_tokens[1] + a.max_tokens + 256) \
            - a.turn_tokens[1] - a.max_tokens - 256
        target = min(a.target_tokens, limit)
        doc["target_tokens_effective"] = target
        if target < a.target_tokens:
            doc["target_note"] = f"capped by the server's max context {doc['load'].get('max_context')}"
        prefill_rate = a.prefill_rate
        stopped_by, last_wall = "target", None
        for r in range(a.max_rounds):
            active = [s for s in sessions if s.prompt_tokens < target]
            if not active:
                break
            left = budget_end - time.perf_counter()
            if last_wall is not None and last_wall * 1.15 > left:
                stopped_by = f"time budget (last round {last_wall:.1f} s, {left:.1f} s left)"
                break
            before = get_stats(url, headers)
            t0 = time.perf_counter()
            rows = run_threads([lambda s=s: run_turn(url, headers, s, counter, a, budget_end) for s in active])
            last_wall = time.perf_counter() - t0
            after = get_stats(url, headers)
            if r == 0 and prefill_rate is None:
                rs = [x["prompt_per_second"] for x in rows if x["prompt_per_second"]]
                prefill_rate = round(float(np.median(rs)), 2) if rs else None
            for x in rows:
                x["round"] = r
                x["ttft_target_s"] = (round(x["new_tokens"] / prefill_rate + 0.25, 4)
                                      if prefill_rate and x["turn"] > 0 else None)
            doc["turns"] += rows
            doc["rounds"].append(round_row(r, rows, before, after, rates, last_wall))
            rt = doc["rounds"][-1]["transfers"]
            print(f"round {r}: prompts {[x['prompt_tokens_local'] for x in rows]}, TTFT "
                  f"{[x['ttft_s'] for x in rows]} s, re-prefilled {[x['re_prefilled_tokens'] for x in rows]}, "
                  f"restore {rt['restore_bytes']} B ({rt['restore_GBps']} GB/s, drain {rt['restore_wait_seconds']} s), "
                  f"spill {rt['spill_bytes']} B ({rt['spill_GBps']} GB/s, drain {rt['spill_wait_seconds']} s)", flush=True)
            if any(x["error"] for x in rows):
                stopped_by = f"request error: {next(x['error'] for x in rows if x['error'])}"
                break
            for s in active:
                s.append_turn()
            write_json(a.output, doc)
        else:
            stopped_by = f"--max-rounds {a.max_rounds}"
        doc["stopped_by"] = stopped_by
        doc["reached_tokens"] = {"min": min(s.prompt_tokens for s in sessions),
                                 "max": max(s.prompt_tokens for s in sessions)}
        doc["summary"] = summary(doc["turns"], doc["rounds"], prefill_rate)
        doc["stats_final"] = get_stats(url, headers)
    doc["wall_s"] = round(time.perf_counter() - t_start, 3)
    write_json(a.output, doc)
    return doc


def _range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected MIN,MAX") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="compiled model directory (default: the embedded model)")
    ap.add_argument("--url", default=None, help="attach to a running server (server flags are then its own)")
    ap.add_argument("--serve-args", default="", help="extra `ninfer serve` flags, one shell-quoted string")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--target-tokens", type=int, default=400_000, help="conversation length to reach")
    ap.add_argument("--initial-tokens", type=int, default=4096, help="words in the first user message")
    ap.add_argument("--turn-tokens", type=_range, default=(1024, 4096), help="new tokens per turn, MIN,MAX")
    ap.add_argument("--max-tokens", type=int, default=256, help="generated tokens per turn (ignore_eos)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="qwen")
    ap.add_argument("--thinking", choices=("on", "off"), default="on")
    ap.add_argument("--no-tools", action="store_true",
                    help="offer no tool definitions (a short system prompt; the history keeps its XML tool calls)")
    ap.add_argument("--user-every", type=int, default=0, help="append a user message every N turns (0: never)")
    ap.add_argument("--server-concurrency", type=int, default=None,
                    help="active sequences when this script starts the server (default: sessions - 1); the device "
                         "KV holds that many sessions, the host tier the others")
    ap.add_argument("--prefill-rate", type=float, default=None, help="tok/s for the TTFT target (default: measured)")
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--max-rounds", type=int, default=100_000)
    ap.add_argument("--request-timeout-s", type=float, default=1800.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-rates", dest="rates", action="store_false", help="skip the pinned copy measurement")
    ap.add_argument("--server-log", default=None)
    ap.add_argument("-o", "--output", default=None)
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.sessions < 1 or a.max_tokens < 2 or a.initial_tokens < 1 or (a.server_concurrency or 1) < 1:
        raise SystemExit("agent_replay: need --sessions >= 1, --max-tokens >= 2, --initial-tokens >= 1, "
                         "--server-concurrency >= 1")
    return run_and_report("agent_replay", run, a)


if __name__ == "__main__":
    sys.exit(main())
