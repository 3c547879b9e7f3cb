"""Where the memory wall falls for the real engines: ``python -m kvbench.selfcheck.memory_wall_ladder``.

Each setting is one start of the engine through its adapter (``Backend.start`` with
``ServerSpec(memory_limit_bytes=...)``), its whole process tree inside a memory wall (a memory-limited
cgroup, :mod:`kvbench.common.memory_wall`), then one round of requests, then the stop:

* llama.cpp (``llama-server``) allocates its KV pool at start: a ladder of ``-c`` (per-slot contexts at a
  fixed number of slots, ``-c`` = slots x context), one short request per slot;
* transformers (the hf worker, static batching) grows its cache with the batch: a ladder of batch sizes at
  one prompt length, the whole batch sent at once;
* vLLM sizes its pool from a budget at start (kvbench's sized mode: --kv-cache-memory-bytes for the batch
  at the context, --max-num-seqs the batch) beside a process of its own: a ladder of batch sizes at one
  context, one short request per sequence.

llama.cpp runs with ``--cache-ram 0``: its prompt cache (8 GiB of host RAM by default) would otherwise grow
with the traffic, which the plan counts at its limit (``KVRules.host_memory``).

Then the planner's answer at each wall (``kvbench plan --memory WALL``): the longest context per slot
(llama.cpp), the most requests at once (transformers, vLLM), with the overhead calibrated on the smallest
wall's settings that ran clear of it (``kvbench.planner.overhead.overheads_from_trials``): the larger walls
check the plan on figures it was not fitted on. "Right" when the answer is within one rung of the boundary:
from the rung below the largest that ran to the smallest killed.

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
import json
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
from kvbench.common.files import atomic_write_text
from kvbench.common.memory_wall import format_bytes, parse_size
from kvbench.kv.units import GIB
from kvbench.planner import PlanInput, engine_rules, plan, resolve_model, served_weights
from kvbench.planner.overhead import Overhead, overheads_from_trials
from kvbench.workloads.prompts import Prompt

MIB = 2**20
START_TIMEOUT_S = 120.0
VLLM_START_TIMEOUT_S = 400.0  # vLLM's CPU start on two loaded cores
# the hf worker starts a batch when it is full or when this long has passed since its first request: long
# enough that a loaded machine's slow sends still make one batch (a full batch starts at once)
HF_BATCH_WAIT_MS = 10_000
REQUEST_TIMEOUT_S = 300.0
HF_OUTPUT_TOKENS = 2


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
    rung: int = 0  # the ladder's value: llama.cpp's context per slot, the batch elsewhere
    tokens_in_flight: int = 0  # the batch x its tokens (prompt + output)
    weights_bytes: float | None = None  # as the engine reported them (or the planner's, where it reports none)
    unreclaimable_bytes: int | None = None  # anonymous + shared memory in the wall after the requests (it ran)

    @property
    def kv_bytes(self) -> float | None:
        if self.kv_pool and self.kv_pool.bytes:
            return float(self.kv_pool.bytes)
        return float(self.engine_kv["cache_bytes"]) if self.engine_kv else None

    def record(self) -> dict:
        """The trial as one JSON line (trials.jsonl)."""
        return {"engine": self.engine, "setting": self.setting, "rung": self.rung, "wall_bytes": self.wall_bytes,
                "verdict": self.verdict, "at_the_wall": self.at_the_wall, "peak_bytes": self.peak_bytes,
                "oom_kills": self.oom_kills, "kv_bytes": self.kv_bytes, "weights_bytes": self.weights_bytes,
                "tokens_in_flight": self.tokens_in_flight, "unreclaimable_bytes": self.unreclaimable_bytes,
                "requests_ok": self.requests_ok,
                "requests": self.requests, "seconds": round(self.seconds, 1), "exit": self.exit}

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
                options: dict | None = None, start_timeout_s: float = START_TIMEOUT_S, rung: int = 0) -> Trial:
    """Start ``engine`` for ``spec`` (its wall: ``spec.memory_limit_bytes``), send ``batch`` at once, stop it."""
    cls = REGISTRY[engine]
    backend = cls(cls.default_version, ensure_env(cls.recipe(cls.default_version)), options)
    evict_page_cache(spec.model)
    t0 = time.monotonic()
    pool, ok, died, engine_kv, unreclaimable = None, 0, "", None, None
    try:
        backend.start(spec, log_path, start_timeout_s)
        pool = backend.kv_pool()
        results = asyncio.run(_send(backend, batch))
        ok = sum(_whole(r, p) for r, p in zip(results, batch))
        kv = [r.engine_details for r in results if isinstance(r, RequestResult) and "batch_size" in r.engine_details]
        engine_kv = max(kv, key=lambda d: d["batch_size"]) if kv else None
        died = backend.exit_description(wait_s=5.0 if ok < len(batch) else 0.0)
        if backend.server and backend.server.wall and not died:
            unreclaimable = backend.server.wall.unreclaimable_bytes()
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
    weights = (pool.details.get("weights_bytes") if pool else None) or planned_weights(engine, spec.model)
    return Trial(engine, setting, spec.memory_limit_bytes or 0, verdict, record["peak_bytes"] if record else None,
                 kills, died, pool, ok, len(batch), time.monotonic() - t0, record, survivors, log_path, tree,
                 engine_kv, rung, sum(p.prompt_tokens + p.output_tokens for p in batch), weights, unreclaimable)


def planned_weights(engine: str, model) -> float | None:
    """The weights the planner counts for ``engine`` (for an engine that reports none: vLLM on a CPU)."""
    return served_weights(resolve_model(model.name), engine_rules(engine), None).bytes


def llamacpp_trial(model, wall: int, slots: int, context: int, log_dir: Path, prompt_tokens: int = 32,
                   output_tokens: int = 4) -> Trial:
    spec = ServerSpec(model=model, max_context=context, max_concurrency=slots, kv_dtype="auto", memory_limit_bytes=wall)
    return try_setting("llamacpp", spec, prompts(slots, prompt_tokens, output_tokens),
                       log_dir / f"llamacpp-{wall}-{slots}x{context}.log", f"-c {slots * context} ({slots} x {context})",
                       options={"extra_args": "--cache-ram 0"}, rung=context)


def hf_trial(model, wall: int, batch: int, prompt_tokens: int, log_dir: Path, output_tokens: int = HF_OUTPUT_TOKENS,
             batch_wait_ms: int = HF_BATCH_WAIT_MS) -> Trial:
    spec = ServerSpec(model=model, max_context=prompt_tokens + output_tokens, max_concurrency=batch, kv_dtype="auto",
                      memory_limit_bytes=wall)
    return try_setting("hf", spec, prompts(batch, prompt_tokens, output_tokens),
                       log_dir / f"hf-{wall}-{batch}x{prompt_tokens}.log", f"batch {batch} x {prompt_tokens}",
                       options={"batch_wait_ms": batch_wait_ms}, rung=batch)


def vllm_trial(model, wall: int, batch: int, context: int, log_dir: Path, prompt_tokens: int = 32,
               output_tokens: int = 4) -> Trial:
    spec = ServerSpec(model=model, max_context=context, max_concurrency=batch, kv_dtype="auto", memory_limit_bytes=wall)
    return try_setting("vllm", spec, prompts(batch, prompt_tokens, output_tokens),
                       log_dir / f"vllm-{wall}-{batch}x{context}.log", f"{batch} x {context} (pool for the batch)",
                       start_timeout_s=VLLM_START_TIMEOUT_S, rung=batch)


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


@dataclass
class Prediction:
    """The planner's answer at one wall, against the ladder's boundary there."""

    engine: str
    wall_bytes: int
    question: str  # what was asked, e.g. "longest context per slot at 8 slots"
    answer: int  # the plan's: tokens per slot, or requests at once
    largest_ran: int | None
    smallest_killed: int | None
    right: bool  # within one rung: from the rung below the largest that ran to the smallest killed
    calibration: bool  # this wall's settings calibrated the overhead (the smallest wall)


def plan_at(engine: str, wall: int, overhead: Overhead, slots: int, context: int) -> tuple[str, int]:
    """(the question, the plan's answer) for ``engine`` at ``wall``: llama.cpp's longest context per slot at
    ``slots`` slots (its --cache-ram 0), the others' most requests at once of ``context`` tokens."""
    model = resolve_model("smollm2")
    common = dict(model=model, engine=engine, memory=float(wall), device="cpu", margin=0.0,
                  overhead_gib=overhead.fixed_bytes / GIB, overhead_per_token_bytes=overhead.per_token_bytes,
                  overhead_source=overhead.source)
    if engine == "llamacpp":
        r = plan(PlanInput(batch=slots, engine_options={"cache_ram_mib": 0}, **common), with_levers=False)
        return f"longest context per slot at {slots} slots", int(r["max_context_at_batch"])
    r = plan(PlanInput(context=context, max_model_len=context, batch=1, **common), with_levers=False)
    return f"requests at once of {context:,} tokens", int(r["max_batch"])


def predictions(records: list[dict], rungs: dict[str, list[int]], slots: int, contexts: dict[str, int],
                overheads: dict[str, Overhead]) -> list[Prediction]:
    """The plan's answer at each engine's walls against the trials' boundary there (``records``: the
    trials as :meth:`Trial.record` writes them, so that a published trials.jsonl can be checked again)."""
    out = []
    for engine in dict.fromkeys(t["engine"] for t in records):
        if engine not in overheads:
            continue
        walls = sorted(dict.fromkeys(t["wall_bytes"] for t in records if t["engine"] == engine))
        ladder_rungs = sorted(rungs[engine])
        for wall in walls:
            mine = [t for t in records if t["engine"] == engine and t["wall_bytes"] == wall]
            ran = max((t["rung"] for t in mine if t["verdict"] == "ran"), default=None)
            killed = min((t["rung"] for t in mine if t["verdict"] == "killed"), default=None)
            question, answer = plan_at(engine, wall, overheads[engine], slots, contexts.get(engine, 0))
            below = max((r for r in ladder_rungs if ran is not None and r < ran), default=0)
            right = ran is not None and below <= answer and (killed is None or answer <= killed)
            out.append(Prediction(engine, wall, question, answer, ran, killed, right, wall == walls[0]))
    return out


def table(trials: list[Trial], command: str, forecasts: list[Prediction] = ()) -> str:
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
    if forecasts:
        out += ["", ("| engine | wall | the plan's answer (`kvbench plan --memory`) | largest that ran | smallest killed "
                     "| within one rung | overhead |"), "|---|---|---|---|---|---|---|"]
        for f in forecasts:
            out.append(f"| {f.engine} | {format_bytes(f.wall_bytes)} | {f.question}: {f.answer:,} | "
                       f"{f.largest_ran if f.largest_ran is not None else '-'} | "
                       f"{f.smallest_killed if f.smallest_killed is not None else '-'} | {'yes' if f.right else 'NO'} | "
                       f"{'calibrated on this wall' if f.calibration else 'not fitted here'} |")
    return "\n".join(out)


def overheads_toml(overheads: dict[str, Overhead]) -> str:
    """The shipped table's ``[cpu.ENGINE]`` entries (bench/planner/overheads.toml)."""
    out = []
    for engine, o in overheads.items():
        source = o.source.replace('"', "'")
        out += [f"[cpu.{engine}]", f"fixed_bytes = {round(o.fixed_bytes)}", f"per_token_bytes = {o.per_token_bytes:.1f}",
                f'model = "{o.model}"', f'source = "{source}"', ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--walls", default=None, help="every engine's walls, comma-separated (512M, 1.5G, ...)")
    parser.add_argument("--llamacpp-walls", default="1G,1.2G", help="llama.cpp's walls (--walls wins)")
    parser.add_argument("--hf-walls", default="1G,1.5G", help="transformers' walls (--walls wins)")
    parser.add_argument("--vllm-walls", default="3.25G,3.75G", help="vLLM's walls (--walls wins)")
    parser.add_argument("--engines", default="llamacpp,hf,vllm")
    parser.add_argument("--llamacpp-slots", type=int, default=8, help="llama.cpp: slots (-np)")
    parser.add_argument("--llamacpp-contexts", default="2048,3072,4096,5120,6144,7168,8192",
                        help="llama.cpp: context per slot (-c is slots x this)")
    parser.add_argument("--hf-prompt", type=int, default=2048, help="transformers: prompt tokens")
    parser.add_argument("--hf-batches", default="1,2,4,8,16", help="transformers: batch sizes")
    parser.add_argument("--hf-batch-wait-ms", type=int, default=HF_BATCH_WAIT_MS,
                        help="transformers: how long the worker waits to fill a batch (its batch_wait_ms option)")
    parser.add_argument("--vllm-context", type=int, default=2048, help="vLLM: --max-model-len, and the pool's "
                                                                       "sequences' length")
    parser.add_argument("--vllm-batches", default="4,8,12,16,20,24,28,32,40,48", help="vLLM: sequences the pool holds "
                                                                               "(--max-num-seqs)")
    parser.add_argument("--log-dir", type=Path, default=None, help="where the engines' logs go (a temporary folder)")
    parser.add_argument("--out", type=Path, default=None, help="a folder for trials.jsonl (every trial) and "
                                                               "overheads.toml (the calibrated overheads)")
    parser.add_argument("--label", default="this ladder", help="the overheads' source, e.g. the published folder")
    args = parser.parse_args(argv)

    def walls(text: str | None) -> list[int]:
        return [parse_size(w) for w in (args.walls or text).split(",")]

    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]
    engines = args.engines.split(",")
    command = "python -m kvbench.selfcheck.memory_wall_ladder " + shlex.join(argv if argv is not None else sys.argv[1:])
    model = models.resolve("smollm2", gguf_converter())
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvbench-wall-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    say = lambda text: print(text, file=sys.stderr, flush=True)
    say(f"logs in {log_dir}")
    t0 = time.monotonic()
    trials: list[Trial] = []
    rungs = {"llamacpp": ints(args.llamacpp_contexts), "hf": ints(args.hf_batches), "vllm": ints(args.vllm_batches)}
    if "llamacpp" in engines:
        trials += ladder(lambda w, c: llamacpp_trial(model, w, args.llamacpp_slots, c, log_dir), rungs["llamacpp"],
                         walls(args.llamacpp_walls), say)
    if "hf" in engines:
        trials += ladder(lambda w, b: hf_trial(model, w, b, args.hf_prompt, log_dir,
                                               batch_wait_ms=args.hf_batch_wait_ms), rungs["hf"],
                         walls(args.hf_walls), say)
    if "vllm" in engines:
        trials += ladder(lambda w, b: vllm_trial(model, w, b, args.vllm_context, log_dir), rungs["vllm"],
                         walls(args.vllm_walls), say)
    records = [t.record() for t in trials]
    overheads = overheads_from_trials(records, {e: engine_rules(e).pool_at_start for e in engines}, args.label,
                                      model="smollm2")
    contexts = {"hf": args.hf_prompt + HF_OUTPUT_TOKENS, "vllm": args.vllm_context}
    forecasts = predictions(records, rungs, args.llamacpp_slots, contexts, overheads)
    print(table(trials, command.strip(), forecasts))
    print(f"\n({len(trials)} starts in {time.monotonic() - t0:.0f} s; SmolLM2-135M, the embedded model: llama.cpp "
          f"serves its Q4_1 GGUF, transformers and vLLM its bf16 copy. \"At the wall\": it ran with its usage held "
          f"at the wall, the kernel reclaiming clean page cache, i.e. the weights' file pages, instead of killing "
          f"it; only memory it cannot reclaim, as the KV pool, kills)")
    for engine, o in overheads.items():
        print(f"- overhead {engine}: {o.fixed_bytes / MIB:,.1f} MiB + {o.per_token_bytes / 1024:,.2f} KiB per token "
              f"in flight ({o.source})")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.out / "trials.jsonl", "".join(json.dumps(r) + "\n" for r in records))
        atomic_write_text(args.out / "overheads.toml", overheads_toml(overheads))
    left = [s for t in trials for s in t.survivors]
    if left:
        print(f"processes survived a stop: {left}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
