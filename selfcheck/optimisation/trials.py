"""One configuration started inside a memory wall, its requests sent in phases, and what came of it.

A trial is one start of an engine through its adapter (``Backend.start`` with
``ServerSpec(memory_limit_bytes=...)``: its whole process tree in a memory cgroup, as ``kvbench run
--memory-limit`` does), one or more phases of requests, each phase's requests sent together, then the stop.
Every start is cold: the model's files are dropped from the page cache first
(:func:`kvbench.selfcheck.memory_wall_ladder.evict_page_cache`). During a watched phase the engine's own
count of the requests it runs and holds back is polled (``Backend.queue_state``). The trial's record is one
JSON line of trials.jsonl; its requests (timestamps, tokens, the greedy output ids) go to
``requests/<trial id>.jsonl``.

Prompts are natural text (the Book of Genesis, workloads/texts.py), token-exact, request ``r<i>`` the same
window in every configuration, so that a quantised cache's greedy output can be set against the 16-bit one's.
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvbench.backends import REGISTRY
from kvbench.backends.streaming import open_client
from kvbench.backends.types import EngineStartError, RequestResult, ServerSpec
from kvbench.common.envs import ensure_env
from kvbench.common.metrics import RequestTimes, cell_metrics
from kvbench.selfcheck.memory_wall_ladder import evict_page_cache
from kvbench.workloads.prompts import Prompt, PromptBuilder

from .columns import Config, Scale

START_TIMEOUT_S = 400.0  # vLLM's CPU start on two loaded cores
REQUEST_TIMEOUT_S = 900.0
POLL_S = 0.2
SEED = 20261207


@dataclass
class Phase:
    """Requests sent together; ``watch``: the engine's running and waiting counts polled meanwhile."""

    name: str  # "calibrate", "warm", "batch", "arrivals", "speculation"
    prompts: list[Prompt]
    watch: bool = False


@dataclass
class PhaseResult:
    name: str
    requests: list[dict]
    ok: int
    running_peak: int | None = None  # the most requests the engine said it ran at once (None: not said)
    waiting_peak: int | None = None
    batch_size: int | None = None  # transformers: the largest batch its worker ran
    metrics: dict = field(default_factory=dict)  # kvbench.common.metrics.cell_metrics of its whole requests


class Prompts:
    """Token-exact prompts cut from natural text: request ``r<i>`` is the same window in every trial."""

    def __init__(self, model):
        from kvbench.workloads.texts import kjv_genesis

        self.builder = PromptBuilder(Path(model.hf_dir) / "tokenizer.json")
        self.text = kjv_genesis()

    def batch(self, n: int, prompt_tokens: int, output_tokens: int | list[int], prefix_tokens: int = 0,
              logprobs: bool = True, tag: str = "r") -> list[Prompt]:
        """``n`` prompts of ``prompt_tokens``; ``output_tokens`` one length or a mix (request i takes i mod len);
        ``prefix_tokens``: every prompt starts with the same window's first tokens (``prefix``, their own rest)."""
        outs = output_tokens if isinstance(output_tokens, list) else [output_tokens]
        shared = (self.builder.from_text(self.text, prefix_tokens, SEED, "prefix", 1).token_ids
                  if prefix_tokens else ())
        out = []
        for i in range(n):
            p = self.builder.from_text(self.text, prompt_tokens, SEED, f"{tag}{i}", outs[i % len(outs)])
            if shared:
                p = Prompt(p.request_id, shared + p.token_ids[:prompt_tokens - prefix_tokens], "", p.output_tokens)
            out.append(Prompt(p.request_id, p.token_ids, p.text, p.output_tokens, top_logprobs=1 if logprobs else 0))
        return out

    def copied(self, n: int, prompt_tokens: int, output_tokens: int) -> list[Prompt]:
        """A passage given twice (what follows is the passage again: a drafter that looks back can guess it)."""
        out = []
        for i in range(n):
            half = self.builder.from_text(self.text, (prompt_tokens + 1) // 2, SEED, f"copy{i}", output_tokens)
            ids = (half.token_ids + half.token_ids)[:prompt_tokens]
            out.append(Prompt(f"copy{i}", ids, "", output_tokens))
        return out


def spec_for(config: Config, model, scale: Scale, batch: int, wall_bytes: int | None,
             tokens: int | None = None) -> ServerSpec:
    """Room for ``batch`` requests of ``tokens`` (default the scale's N) on ``config``: a pool of batch x tokens
    (the per-request limit the pool, capped at the model's) or ``batch`` slots of ``reserve`` (or the
    request's) tokens; the prefix, where shared, counted once."""
    tokens = tokens or scale.request_tokens
    if config.pool:
        pooled = batch * tokens - (batch - 1) * config.prefix_tokens if config.prefix_tokens else batch * tokens
        return ServerSpec(model=model, max_context=min(pooled, scale.model_limit), max_concurrency=batch,
                          kv_dtype=config.kv_dtype, kv_pool_sequences=1, memory_limit_bytes=wall_bytes,
                          prefix_caching=config.prefix_caching) if pooled <= scale.model_limit else \
            _pool_past_the_limit(config, model, scale, batch, pooled, wall_bytes)
    return ServerSpec(model=model, max_context=config.reserve or tokens, max_concurrency=batch,
                      kv_dtype=config.kv_dtype, memory_limit_bytes=wall_bytes, prefix_caching=config.prefix_caching)


def _pool_past_the_limit(config, model, scale, batch, pooled, wall_bytes) -> ServerSpec:
    """A pool larger than one request may be: sequences of the model's limit, as many as hold ``pooled``
    tokens (the last one's room rounded up to the limit: stated in the trial's setting)."""
    sequences = -(-pooled // scale.model_limit)
    return ServerSpec(model=model, max_context=scale.model_limit, max_concurrency=batch, kv_dtype=config.kv_dtype,
                      kv_pool_sequences=sequences, memory_limit_bytes=wall_bytes, prefix_caching=config.prefix_caching)


def setting(spec: ServerSpec, config: Config) -> str:
    """What the trial asked of the engine, in a few words."""
    if config.pool:
        return (f"a pool of {spec.pool_sequences} x {spec.max_context:,} tokens, {spec.max_concurrency} at once, "
                f"limit {spec.max_context:,}")
    return f"{spec.max_concurrency} slot(s) of {spec.max_context:,} tokens"


def whole(result, prompt: Prompt) -> bool:
    return (isinstance(result, RequestResult) and result.error is None
            and result.output_tokens_reported == prompt.output_tokens
            and sum(result.chunk_tokens) == prompt.output_tokens)


class _Polling:
    """A thread that runs ``_poll`` from ``__enter__`` until ``__exit__`` (which waits up to 10 s for it)."""

    def __init__(self, backend):
        self.backend = backend
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)

    def _poll(self):
        raise NotImplementedError


class Watcher(_Polling):
    """The engine's own running and waiting counts, polled in a thread while a phase runs."""

    def __init__(self, backend):
        super().__init__(backend)
        self.running, self.waiting = None, None

    def _poll(self):
        with self.backend.http_client(5.0) as client:
            while not self._stop.is_set():
                try:
                    state = self.backend.queue_state(client)
                except Exception:  # noqa: BLE001 - a poll that fails (the engine dying) is no figure
                    state = None
                if state:
                    for name in ("running", "waiting"):
                        value = state.get(name)
                        if value is not None:
                            setattr(self, name, max(int(value), getattr(self, name) or 0))
                wall = self.backend.server.wall if self.backend.server else None
                if wall is not None:
                    try:
                        wall.sample()
                    except Exception:  # noqa: BLE001 - a wall already closed
                        pass
                self._stop.wait(POLL_S)


class ResidentPeak(_Polling):
    """The most the wall's processes held and used at once (:meth:`MemoryWall.resident_bytes`), sampled from
    the start on: an engine's start can peak above what it holds once it serves (vLLM's profile run), and the
    cgroup's own peak counts the page cache of every file read, which the kernel gives back at the wall."""

    def __init__(self, backend, every_s: float = 0.05):
        super().__init__(backend)
        self.every_s, self.peak = every_s, None

    def _poll(self):
        while not self._stop.is_set():
            server = self.backend.server
            wall = server.wall if server else None
            try:
                value = wall.resident_bytes() if wall is not None else None
            except Exception:  # noqa: BLE001 - a wall being made or removed
                value = None
            if value is not None:
                self.peak = max(value, self.peak or 0)
            self._stop.wait(self.every_s)


async def _send(backend, batch: list[Prompt]) -> list:
    async with open_client(len(batch), REQUEST_TIMEOUT_S) as client:
        return await asyncio.gather(*(asyncio.wait_for(backend.stream(client, p), REQUEST_TIMEOUT_S) for p in batch),
                                    return_exceptions=True)


def request_record(phase: str, prompt: Prompt, result, t0: float) -> dict:
    """One request as a line of requests/<trial>.jsonl (times in seconds from the trial's start)."""
    if not isinstance(result, RequestResult):
        return {"phase": phase, "request_id": prompt.request_id, "prompt_tokens": prompt.prompt_tokens,
                "output_tokens": prompt.output_tokens, "error": f"{type(result).__name__}: {result}"[:300]}
    return {"phase": phase, "request_id": prompt.request_id, "prompt_tokens": prompt.prompt_tokens,
            "output_tokens": prompt.output_tokens, "whole": whole(result, prompt),
            "t_sent": round(result.t_sent - t0, 6),
            "t_done": None if result.t_done is None else round(result.t_done - t0, 6),
            "chunk_times": [round(t - t0, 6) for t in result.chunk_times], "chunk_tokens": list(result.chunk_tokens),
            "prompt_tokens_reported": result.prompt_tokens_reported,
            "prompt_tokens_cached": result.prompt_tokens_cached,
            "output_tokens_reported": result.output_tokens_reported, "output_ids": list(result.output_ids),
            "spec_draft_tokens": result.spec_draft_tokens, "spec_accepted_tokens": result.spec_accepted_tokens,
            "error": result.error}


def times_of(requests: list[dict]) -> list[RequestTimes]:
    """The whole requests' times as :class:`RequestTimes` (from request_record's lines)."""
    return [RequestTimes(r["t_sent"], tuple(r["chunk_times"]), tuple(r["chunk_tokens"]), r["t_done"])
            for r in requests if r.get("whole")]


def phase_metrics(requests: list[dict]) -> dict:
    done = [r for r in requests if r.get("whole")]
    return cell_metrics(times_of(done), [r["prompt_tokens"] for r in done]) if done else {}


def run_trial(config: Config, spec: ServerSpec, phases: list[Phase], log_path: Path,
              start_timeout_s: float = START_TIMEOUT_S) -> tuple[dict, list[dict], list[dict]]:
    """Start ``config`` for ``spec``, run ``phases`` one after another (stopping at the first that fails), stop.
    (the trial's facts, its requests as records, the processes that survived the stop)."""
    cls = REGISTRY[config.engine]
    backend = cls(cls.default_version, ensure_env(cls.recipe(cls.default_version)), config.all_options)
    evict_page_cache(spec.model)
    t0 = time.monotonic()
    pool, died, resident, results, requests = None, "", None, [], []
    started = False
    sampler = ResidentPeak(backend).__enter__()
    try:
        backend.start(spec, log_path, start_timeout_s)
        started = True
        pool = backend.kv_pool()
        for phase in phases:
            base = time.perf_counter() - (time.monotonic() - t0)  # the trial's start on the requests' clock
            if phase.watch:
                with Watcher(backend) as watcher:
                    got = asyncio.run(_send(backend, phase.prompts))
            else:
                watcher, got = None, asyncio.run(_send(backend, phase.prompts))
            lines = [request_record(phase.name, p, r, base) for p, r in zip(phase.prompts, got)]
            requests += lines
            kv = [r.engine_details for r in got if isinstance(r, RequestResult) and "batch_size" in r.engine_details]
            ok = sum(bool(line.get("whole")) for line in lines)
            results.append(PhaseResult(phase.name, lines, ok, watcher.running if watcher else None,
                                       watcher.waiting if watcher else None,
                                       max((d["batch_size"] for d in kv), default=None), phase_metrics(lines)))
            if ok < len(phase.prompts):
                died = backend.exit_description(wait_s=5.0)
                break
        if not died and backend.server and backend.server.wall:
            resident = backend.server.wall.resident_bytes()
    except EngineStartError as exc:
        died = backend.exit_description(wait_s=5.0) or str(exc)
    finally:
        sampler.__exit__()
        survivors = backend.stop()
    record = backend.server.wall_record() if backend.server else None
    kills = record["oom_kills"] if record else None
    facts = {"started": started, "oom_kills": kills, "peak_bytes": record["peak_bytes"] if record else None,
             "resident_bytes": resident, "resident_peak_bytes": sampler.peak, "exit": died,
             "seconds": round(time.monotonic() - t0, 1),
             "kv_pool_bytes": pool.bytes if pool else None, "kv_pool_tokens": pool.tokens if pool else None,
             "weights_bytes": (pool.details.get("weights_bytes") if pool else None),
             "phases": [{"name": r.name, "requests": len(r.requests), "ok": r.ok, "running_peak": r.running_peak,
                         "waiting_peak": r.waiting_peak, "batch_size": r.batch_size, "metrics": r.metrics}
                        for r in results]}
    return facts, requests, survivors


def verdict(facts: dict, phase: str, sent: int, held_check: bool = True) -> str:
    """What came of ``phase`` of ``sent`` requests: "ran" (every request whole and, with ``held_check``, all
    held at once where the engine says how many it ran), "queued" (whole, but the engine ran fewer at once),
    "killed" (the OOM killer ended a process of the tree before they were whole), "failed" (anything else: a
    start that timed out, a request cut). A later phase's end does not undo one that ran."""
    mine = next((p for p in facts["phases"] if p["name"] == phase), None)
    if mine is not None and mine["ok"] == sent:
        held = mine["batch_size"] if mine["batch_size"] is not None else mine["running_peak"]
        return "queued" if held_check and held is not None and held < sent else "ran"
    return "killed" if facts.get("oom_kills") else "failed"


def greedy_match(a: list[dict], b: list[dict]) -> dict | None:
    """Greedy outputs of the same requests (by id) in two trials: how many are identical, and where the others
    first differ. None where no request has output ids on both sides."""
    ids_a = {r["request_id"]: r.get("output_ids") for r in a if r.get("whole") and r.get("output_ids")}
    pairs = [(ids_a[r["request_id"]], r["output_ids"]) for r in b
             if r.get("whole") and r.get("output_ids") and r["request_id"] in ids_a]
    if not pairs:
        return None
    firsts = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), None) for p, q in pairs]
    differ = [f for f in firsts if f is not None]
    return {"requests": len(pairs), "identical": len(pairs) - len(differ),
            "first_difference_median": float(np.median(differ)) if differ else None}
