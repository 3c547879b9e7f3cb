"""Where the memory wall falls for the real engines: ``python -m kvbench.selfcheck.memory_wall_ladder``.

Each setting is one start of the engine through its adapter (``Backend.start`` with
``ServerSpec(memory_limit_bytes=...)``), its whole process tree inside a memory wall (a memory-limited
cgroup, :mod:`kvbench.common.memory_wall`), then one round of requests, then the stop:

* llama.cpp (``llama-server``) allocates its KV pool at start: a ladder of ``-c`` (per-slot contexts at a
  fixed number of slots, ``-c`` = slots x context), one short request per slot;
* transformers (the hf worker, static batching) grows its cache with the batch: a ladder of batch sizes at
  one prompt length, the whole batch sent at once.

Every start is cold: the model's files are dropped from the page cache first (``posix_fadvise``
DONTNEED, those files only), so the engine reads its weights into its own wall each time. (A page is
charged to the group that first reads it: a file cached by an earlier start would otherwise be charged to
none, and the peaks would depend on what ran before.)

A setting "ran" when the engine started and every request came back whole, "killed" when the OOM killer
killed a process of its tree (the server's own exit text then says so), "failed" otherwise. For each wall
the ladder goes up until the first kill (the settings above it are not tried). It prints a Markdown table
with its command line at the top: every figure in it is measured here (the peak is the cgroup's
``max_usage_in_bytes`` / ``memory.peak``).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kvbench.backends import REGISTRY, gguf_converter
from kvbench.backends.streaming import open_client
from kvbench.backends.types import EngineStartError, KVPool, RequestResult, ServerSpec
from kvbench.common import models
from kvbench.common.envs import ensure_env
from kvbench.common.memory_wall import format_bytes, parse_size
from kvbench.workloads.prompts import Prompt

MIB = 2**20
START_TIMEOUT_S = 120.0
# the hf worker starts a batch when it is full or when this long has passed since its first request: long
# enough that a loaded machine's slow sends still make one batch (a full batch starts at once)
HF_BATCH_WAIT_MS = 10_000
REQUEST_TIMEOUT_S = 300.0


@dataclass
class Trial:
    """One start of an engine inside a wall, and what came of it."""

    engine: str
    setting: str  # e.g. "-c 32768 (8 x 4096)", "batch 4 x 2048"
    wall_bytes: int
    verdict: str  # "ran", "killed", "failed"
    peak_bytes: int | None
    oom_kills: int | None
    exit: str  # the server's exit_description() ("" while it ran), or the start error
    kv_pool: KVPool | None
    requests_ok: int
    requests: int
    seconds: float
    wall_record: dict | None
    survivors: list[dict]
    log_path: Path
    tree_pids: list[int]  # the server and every process in its wall just before the stop
    engine_kv: dict | None = None  # transformers: the cache its last batch held (cache_bytes, batch_size)

    @property
    def at_the_wall(self) -> bool:
        """It ran with its usage held at the wall: the kernel reclaimed page cache (the weights' file pages)
        to keep it under, rather than kill it."""
        return self.verdict == "ran" and self.peak_bytes is not None and self.peak_bytes >= self.wall_bytes - MIB

    def line(self) -> str:
        peak = format_bytes(self.peak_bytes) if self.peak_bytes is not None else "-"
        return (f"{self.engine} {self.setting} at {format_bytes(self.wall_bytes)}: {self.verdict}, peak {peak}, "
                f"{self.requests_ok}/{self.requests} requests, {self.seconds:.1f} s"
                + (f" ({self.exit})" if self.exit else ""))


def evict_page_cache(model) -> int:
    """Drop the model's files (its GGUF, its HF folder) from the page cache; the bytes of files advised."""
    files = [model.gguf_path] if model.gguf_path else []
    files += [f for f in Path(model.hf_dir).rglob("*") if f.is_file()]
    total = 0
    for path in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def prompts(n: int, prompt_tokens: int, output_tokens: int, seed: int = 0) -> list[Prompt]:
    """``n`` prompts of random ordinary token ids (SmolLM2's special tokens are ids 0-16)."""
    rng = random.Random(seed)
    return [Prompt(f"wall-{i}", tuple(rng.randrange(1000, 40000) for _ in range(prompt_tokens)), "", output_tokens)
            for i in range(n)]


async def _send(backend, batch: list[Prompt]) -> list[RequestResult | BaseException]:
    async with open_client(len(batch), REQUEST_TIMEOUT_S) as client:
        return await asyncio.gather(*(asyncio.wait_for(backend.stream(client, p), REQUEST_TIMEOUT_S) for p in batch),
                                    return_exceptions=True)


def _whole(result, prompt: Prompt) -> bool:
    return (isinstance(result, RequestResult) and result.error is None
            and result.output_tokens_reported == prompt.output_tokens and sum(result.chunk_tokens) == prompt.output_tokens)


def try_setting(engine: str, spec: ServerSpec, batch: list[Prompt], log_path: Path, setting: str,
                options: dict | None = None, start_timeout_s: float = START_TIMEOUT_S) -> Trial:
    """Start ``engine`` for ``spec`` (its wall: ``spec.memory_limit_bytes``), send ``batch`` at once, stop it."""
    cls = REGISTRY[engine]
    backend = cls(cls.default_version, ensure_env(cls.recipe(cls.default_version)), options)
    evict_page_cache(spec.model)
    t0 = time.monotonic()
    pool, ok, died, engine_kv = None, 0, "", None
    try:
        backend.start(spec, log_path, start_timeout_s)
        pool = backend.kv_pool()
        results = asyncio.run(_send(backend, batch))
        ok = sum(_whole(r, p) for r, p in zip(results, batch))
        kv = [r.engine_details for r in results if isinstance(r, RequestResult) and "batch_size" in r.engine_details]
        engine_kv = max(kv, key=lambda d: d["batch_size"]) if kv else None
        died = backend.exit_description(wait_s=5.0 if ok < len(batch) else 0.0)
    except EngineStartError as exc:
        died = backend.exit_description(wait_s=5.0) or str(exc)
    finally:
        server = backend.server
        tree = sorted({*([server.pid] if server and server.pid else []),
                       *(server.wall.pids() if server and server.wall else [])})
        survivors = backend.stop()
    record = backend.server.wall_record() if backend.server else None
    kills = record["oom_kills"] if record else None
    verdict = "killed" if kills else ("ran" if ok == len(batch) and not died else "failed")
    if verdict == "ran" and engine_kv and engine_kv["batch_size"] != len(batch):  # not the setting asked for
        verdict, died = "failed", f"the worker split the batch (its largest: {engine_kv['batch_size']})"
    return Trial(engine, setting, spec.memory_limit_bytes or 0, verdict, record["peak_bytes"] if record else None,
                 kills, died, pool, ok, len(batch), time.monotonic() - t0, record, survivors, log_path, tree,
                 engine_kv)


def llamacpp_trial(model, wall: int, slots: int, context: int, log_dir: Path, prompt_tokens: int = 32,
                   output_tokens: int = 4) -> Trial:
    spec = ServerSpec(model=model, max_context=context, max_concurrency=slots, kv_dtype="auto", memory_limit_bytes=wall)
    return try_setting("llamacpp", spec, prompts(slots, prompt_tokens, output_tokens),
                       log_dir / f"llamacpp-{wall}-{slots}x{context}.log", f"-c {slots * context} ({slots} x {context})")


def hf_trial(model, wall: int, batch: int, prompt_tokens: int, log_dir: Path, output_tokens: int = 2,
             batch_wait_ms: int = HF_BATCH_WAIT_MS) -> Trial:
    spec = ServerSpec(model=model, max_context=prompt_tokens + output_tokens, max_concurrency=batch, kv_dtype="auto",
                      memory_limit_bytes=wall)
    return try_setting("hf", spec, prompts(batch, prompt_tokens, output_tokens),
                       log_dir / f"hf-{wall}-{batch}x{prompt_tokens}.log", f"batch {batch} x {prompt_tokens}",
                       options={"batch_wait_ms": batch_wait_ms})


def ladder(run_one, settings: list[int], walls: list[int], log) -> list[Trial]:
    """The walls from the smallest; at each, the settings in ascending order until the first kill, starting
    at the largest setting that ran under the wall before (a larger wall is not tried below it: each
    wall's largest setting that ran and smallest killed are both measured at that wall)."""
    trials: list[Trial] = []
    start = 0
    settings = sorted(settings)
    for wall in sorted(walls):
        ran = start
        for i in range(start, len(settings)):
            trial = run_one(wall, settings[i])
            log(trial.line())
            trials.append(trial)
            if trial.verdict == "ran":
                ran = i
            if trial.verdict == "killed":
                break
        start = ran
    return trials


def _mib(n: int | None) -> str:
    return f"{n / MIB:.1f} MiB" if n is not None else "-"


def _peak(t: Trial | None) -> str:
    return f"{t.setting} (peak {_mib(t.peak_bytes)})" if t and t.peak_bytes is not None else "-"


def _kv(t: Trial) -> str:
    if t.kv_pool and t.kv_pool.bytes:
        return f"pool {_mib(t.kv_pool.bytes)}"
    if t.engine_kv:
        return f"cache {_mib(t.engine_kv['cache_bytes'])} (batch of {t.engine_kv['batch_size']})"
    return "-"


def table(trials: list[Trial], command: str) -> str:
    out = [f"`{command}`", "", "| engine | setting | wall | verdict | peak in the wall | KV | exit | time |",
           "|---|---|---|---|---|---|---|---|"]
    for t in trials:
        verdict = "ran, at the wall (page cache reclaimed)" if t.at_the_wall else t.verdict
        out.append(f"| {t.engine} | {t.setting} | {format_bytes(t.wall_bytes)} | {verdict} | {_mib(t.peak_bytes)} | "
                   f"{_kv(t)} | {t.exit or '-'} | {t.seconds:.0f} s |")
    out += ["", "| engine | wall | largest that ran | smallest killed |", "|---|---|---|---|"]
    for engine in dict.fromkeys(t.engine for t in trials):
        for wall in dict.fromkeys(t.wall_bytes for t in trials if t.engine == engine):
            mine = [t for t in trials if t.engine == engine and t.wall_bytes == wall]
            ran = [t for t in mine if t.verdict == "ran"]
            killed = [t for t in mine if t.verdict == "killed"]
            out.append(f"| {engine} | {format_bytes(wall)} | {_peak(ran[-1] if ran else None)} | "
                       f"{_peak(killed[0] if killed else None)} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--walls", default=None, help="both engines' walls, comma-separated (512M, 1.5G, ...)")
    parser.add_argument("--llamacpp-walls", default="1G,1.2G", help="llama.cpp's walls (--walls wins)")
    parser.add_argument("--hf-walls", default="1G,1.5G", help="transformers' walls (--walls wins)")
    parser.add_argument("--engines", default="llamacpp,hf")
    parser.add_argument("--llamacpp-slots", type=int, default=8, help="llama.cpp: slots (-np)")
    parser.add_argument("--llamacpp-contexts", default="2048,3072,4096,5120,6144,7168,8192",
                        help="llama.cpp: context per slot (-c is slots x this)")
    parser.add_argument("--hf-prompt", type=int, default=2048, help="transformers: prompt tokens")
    parser.add_argument("--hf-batches", default="1,4,8,16", help="transformers: batch sizes")
    parser.add_argument("--hf-batch-wait-ms", type=int, default=HF_BATCH_WAIT_MS,
                        help="transformers: how long the worker waits to fill a batch (its batch_wait_ms option)")
    parser.add_argument("--log-dir", type=Path, default=None, help="where the engines' logs go (a temporary folder)")
    args = parser.parse_args(argv)
    def walls(text: str | None) -> list[int]:
        return [parse_size(w) for w in (args.walls or text).split(",")]
    engines = args.engines.split(",")
    command = "python -m kvbench.selfcheck.memory_wall_ladder " + shlex.join(argv if argv is not None else sys.argv[1:])
    model = models.resolve("smollm2", gguf_converter())
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvbench-wall-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    say = lambda text: print(text, file=sys.stderr, flush=True)
    say(f"logs in {log_dir}")
    t0 = time.monotonic()
    trials: list[Trial] = []
    if "llamacpp" in engines:
        contexts = [int(x) for x in args.llamacpp_contexts.split(",")]
        trials += ladder(lambda w, c: llamacpp_trial(model, w, args.llamacpp_slots, c, log_dir), contexts,
                         walls(args.llamacpp_walls), say)
    if "hf" in engines:
        batches = [int(x) for x in args.hf_batches.split(",")]
        trials += ladder(lambda w, b: hf_trial(model, w, b, args.hf_prompt, log_dir,
                                                   batch_wait_ms=args.hf_batch_wait_ms), batches,
                         walls(args.hf_walls), say)
    print(table(trials, command.strip()))
    print(f"\n({len(trials)} starts in {time.monotonic() - t0:.0f} s; SmolLM2-135M, the embedded model: llama.cpp "
          f"serves its Q4_1 GGUF, transformers its bf16 copy. \"At the wall\": it ran with its usage held at the "
          f"wall, the kernel reclaiming clean page cache, i.e. the weights' file pages, instead of killing it; "
          f"only memory it cannot reclaim, as the KV pool, kills)")
    left = [s for t in trials for s in t.survivors]
    if left:
        print(f"processes survived a stop: {left}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
