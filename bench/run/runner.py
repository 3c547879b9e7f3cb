"""Runs a workload on every backend, one cell at a time, and writes results as it goes.

Data flows one way: the workload and the model give a :class:`~kvbench.run.cells.RunPlan` (its cells); for
each backend (and each server variant the workload asks for, e.g. prefix caching on and off) the runner
installs its environment (once), starts the server (or attaches to a running one), sends warm-up
requests, then measures each cell (the load, with memory, KV in use and the engine's queue sampled
alongside) into a raw :class:`~kvbench.run.rows.CellMeasurement`, which the pure
:func:`~kvbench.run.rows.summarize` turns into the cell's row. Anything that goes wrong with one backend
(install, start, crash, timeout) becomes failed rows with the engine's log tail; the other backends still
run; a server kvbench started is always stopped, also on Ctrl-C.

Long because one engine session's steps (install, start or attach, check, warm up and calibrate, the cells
with their progress, prefix-cache resets and counters, stop and record) read in order in one class.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress

from kvbench.backends import REGISTRY, gguf_converter, kv_rules
from kvbench.backends.base import Backend
from kvbench.backends.deployment import Deployment
from kvbench.backends.types import EngineStartError, ServerSpec
from kvbench.common import models
from kvbench.common.envs import EnvInstallError, ensure_env
from kvbench.common.hardware import NVML, GPUBaseline, environment_info
from kvbench.common.metrics import RequestTimes
from kvbench.common.redact import redact_text
from kvbench.load import ONE_AT_A_TIME, LoadSettings, TimeoutStreak, frozen_heap, interrupt, run, run_async
from kvbench.load.open_loop import schedule_seed
from kvbench.run import estimate
from kvbench.run.progress import CellProgress, run_progress, set_eta
from kvbench.run.backend_config import BackendConfig
from kvbench.run import kvquant, startup_checks
from kvbench.run.cells import Cell, CellPrompts, NothingFits, PromptSalt, RunPlan
from kvbench.run.rows import (
    CellMeasurement,
    EngineRun,
    engine_setup,
    failed_row,
    replica_rows,
    request_row,
    request_verdicts,
    summarize,
    summary_line,
    timeline_frame,
)
from kvbench.run.samplers import EnginePoller, ProcessTreeMemorySampler, busy_threads, prefix_counters, tree_rss
from kvbench.run.telemetry import Prometheus, measure_cell
from kvbench.store.errors import ResultsWriteError, RunFolderError
from kvbench.store.readers import ensure_parquet, load_cells, load_run_info
from kvbench.store.run_record import RunRecord
from kvbench.store.writer import RunFolderLock, RunMode, RunWriter
from kvbench.workloads import Workload
from kvbench.workloads.prompts import PromptBuilder

ENGINE_EXIT_WAIT_S = 2.0  # how long a cell with failed requests waits to learn whether the engine died
REPROBE_TIMEOUT_S = 5.0  # a wedged engine's probe before each later cell (at most half the request timeout)
WARMUP_POINT = ONE_AT_A_TIME  # warm-up requests go one at a time


@dataclass
class RunOptions:
    model: str
    workload: Workload
    backends: list[BackendConfig]
    results_dir: Path = Path("results/runs")
    run_id: str | None = None
    repeats: int | None = None  # overrides the workload's
    kv_dtype: str = "auto"
    max_context: int | None = None  # cap below the model's own limit
    start_timeout_s: float = 600.0
    request_timeout_s: float = 900.0
    memory_hz: float = 20.0
    kv_poll_hz: float = 10.0
    command: list[str] = field(default_factory=lambda: list(sys.argv))
    results_mode: RunMode = "new"  # an existing run folder: refused ("new"), finished ("resume") or replaced
    max_consecutive_timeouts: int | None = 3  # an engine whose requests time out this often in a row is wedged
    # A/B on a noisy machine: each repeat runs on every backend in turn (one engine at a time, restarted per
    # repeat), the order reversed on odd repeats (AB BA AB ...), so that drift of the machine hits every
    # side alike; compare then pairs the repeats by index
    interleave: bool = False
    estimate: bool = True  # one calibration request per engine start, to say how long its cells will take
    load_workers: int = 1  # load generator processes (bench/load/workers.py)
    prometheus: Prometheus | None = None  # read after each cell: GPU memory (DCGM) and engine metrics
    memory_limit_bytes: int | None = None  # each engine's process tree runs inside a memory wall this big
    # what keeps this run's prompts apart from every other run's (--prompt-salt): None/"auto" draws one,
    # "none" sends unsalted prompts (an earlier run's, token for token), else the salt itself
    prompt_salt: str | None = None
    reset_cache_between_cells: bool = False  # empty each engine's prefix cache before every cell
    allow_model_mismatch: bool = False  # an attached server serving another model than --model: run anyway
    # a kv_quant workload's KV dtypes (`--kv-dtypes`; None: the workload's), one engine start each
    kv_dtypes: list[str] | None = None


def new_run_id(workload: str) -> str:
    """Time, workload, host and pid: two runs started in the same second (a CI matrix) get two folders."""
    return f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{workload}-{socket.gethostname()[:12]}-{os.getpid()}"


def resumable(info: dict, o: RunOptions) -> None:
    """A resumed run's unfinished cells must measure what its finished ones did: the same workload, backends
    (labels and options) and KV dtype, else RunFolderError naming what differs."""
    differ = []
    try:
        recorded = Workload.model_validate(info.get("workload") or {}).model_dump()
    except ValueError:
        recorded = info.get("workload")
    now = o.workload.model_dump()
    if recorded != now:
        keys = sorted(k for k in now if not isinstance(recorded, dict) or recorded.get(k) != now[k])
        differ.append(f"workload ({', '.join(keys)})")
    before = {b.get("label"): b.get("options", {}) for b in info.get("backends", [])}
    after = {b.label: b.options for b in o.backends}
    if before != after:
        differ.append(f"backends ({', '.join(sorted(before))} then, {', '.join(sorted(after))} now"
                      + (", options differ" if set(before) == set(after) else "") + ")")
    if info.get("kv_dtype", o.kv_dtype) != o.kv_dtype:
        differ.append(f"--kv-dtype ({info['kv_dtype']} then, {o.kv_dtype} now)")
    if differ:
        raise RunFolderError(f"--resume: run {info.get('run_id')} was started with another {'; '.join(differ)}: "
                             "resume it as it was started, or start a new run")


def _interrupt(signum, frame):
    """SIGINT and SIGTERM end the run as Ctrl-C does, so that `finally` blocks stop the servers and run.json
    says "interrupted". Only the first raises KeyboardInterrupt (inside a load, :mod:`kvbench.load.interrupt`
    handles it without raising); later ones are noted only: a second Ctrl-C must not cut the wind-down short
    (an engine left running, run.json left "running", a traceback). SIGINT is handled also where it was
    ignored on entry, as a shell does for a job started with `&`: that SIGINT once went unheeded, and a
    SIGTERM raised KeyboardInterrupt inside the load's event loop ("Fatal error on transport", run going on);
    whoever sends kvbench a SIGINT means it to stop."""
    first = not interrupt.stopping()
    interrupt.note(signum)
    if first:
        raise KeyboardInterrupt


class Runner:
    def __init__(self, options: RunOptions, console: Console | None = None):
        self.o = options
        self.console = console or Console()
        self.run_id = options.run_id or new_run_id(options.workload.name)
        # one live harness per run folder: a second one (same --run-id, a --resume or --overwrite of a run
        # still running) is refused before it touches anything
        self.lock = RunFolderLock(options.results_dir / self.run_id)
        try:
            self._open(options)
        except BaseException:
            self.lock.release()
            raise
        self.nvml = NVML()

    def _open(self, options: RunOptions) -> None:
        """The run's writer, and for a resumed run what it finished and recorded, and its salt."""
        self.writer = RunWriter(options.results_dir / self.run_id, mode=options.results_mode)
        self.record = RunRecord()
        # resuming: the cells that have rows already (any status) are kept, not run again
        self.finished: dict[str, float | None] = {}
        if options.results_mode == "resume":
            resumable(load_run_info(self.writer.root), options)
            done = load_cells(self.writer.root)
            self.finished = dict(zip(done.cell_id, done.requests_per_s))
            self.writer.discard_unfinished_requests()
            # what the earlier invocations recorded per engine stays, beside this one's
            self.record = RunRecord.of_run(self.writer.root)
            self.record.estimates.clear()  # an estimate belongs to the invocation that made it
        isolated = all(REGISTRY[b.engine].capabilities.prefix_cache.isolation_field for b in options.backends)
        # a resumed run keeps its salt: its unfinished cells send the prompts its finished ones sent
        self.salt = (PromptSalt.resumed(load_run_info(self.writer.root).get("prompt_salt"), options.prompt_salt,
                                        isolated) if options.results_mode == "resume"
                     else PromptSalt.parse(options.prompt_salt, isolated))

    @property
    def run_dir(self) -> Path:
        return self.writer.root

    # --- the whole run ---------------------------------------------------------------------------
    def run(self) -> Path:
        interrupt.reset()
        previous = {sig: signal.signal(sig, _interrupt) for sig in interrupt.STOP_SIGNALS}
        try:
            return self._run()
        finally:
            self.lock.release()
            if not interrupt.stopping():  # interrupted: the handlers stay, the process is on its way out
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    def _run(self) -> Path:
        o, w = self.o, self.o.workload
        repeats = o.repeats or w.repeats
        self.writer.write_run_info({
            "run_id": self.run_id, "command": redact_text(" ".join(o.command)), "started_at": datetime.now(timezone.utc).isoformat(),
            "status": "running", "environment": environment_info(), "workload": w.model_dump(), "repeats": repeats,
            "kv_dtype": o.kv_dtype, "backends": [b.model_dump() | {"label": b.label} for b in o.backends],
            "interleaved": o.interleave, "memory_limit_bytes": o.memory_limit_bytes,
            "prompt_salt": self.salt.to_dict(), "reset_cache_between_cells": o.reset_cache_between_cells})
        self.console.print(f"[bold]kvbench run[/] {self.run_id} -> {self.run_dir}")
        try:
            model = models.resolve(o.model, gguf_converter(self.console.print), log=self.console.print)
            plan = RunPlan.make(w, model.geometry.max_context, o.max_context, repeats)
        except (models.ModelError, NothingFits) as exc:
            self.writer.update_run_info(status="failed", error=str(exc))
            raise models.ModelError(str(exc)) from None
        if plan.skipped:
            self.console.print(f"[yellow]prompt lengths {list(plan.skipped)} skipped: they do not fit the context "
                               f"limit {plan.max_context} with {w.output_tokens} output tokens[/]")
        self.writer.update_run_info(model={"name": model.name, "sha256": model.sha256,
                                           "gguf": str(model.gguf_path) if model.gguf_path else None,
                                           "hf_dir": str(model.hf_dir), "geometry": asdict(model.geometry),
                                           "max_context": plan.max_context},
                                    skipped_prompt_lengths=list(plan.skipped), prompt_lengths=list(plan.lengths),
                                    load_points=[asdict(p) for p in plan.points])
        prompts = CellPrompts(PromptBuilder(model.hf_dir / "tokenizer.json"), w, self.salt)
        spec = ServerSpec(model=model, max_context=plan.server_context, max_concurrency=plan.server_concurrency,
                          kv_dtype=o.kv_dtype, kv_pool_sequences=w.kv_pool_sequences,
                          memory_limit_bytes=o.memory_limit_bytes, reset_prefix_cache=o.reset_cache_between_cells)
        status = "interrupted"
        try:
            with run_progress(self.console) as progress:
                self.run_sessions(plan, spec, prompts, progress, model.geometry)
            status = "finished"
        except ResultsWriteError:
            status = "stopped: results folder not writable"
            raise
        finally:
            if self.writer.failed is None:  # else the first error stands alone, not buried under a second
                self.writer.update_run_info(status=status, finished_at=datetime.now(timezone.utc).isoformat())
                if (self.run_dir / "cells.jsonl").exists():
                    ensure_parquet(self.run_dir)  # the columnar copy beside the JSONL record
        return self.run_dir

    def run_sessions(self, plan: RunPlan, spec: ServerSpec, prompts: CellPrompts, progress, geometry) -> None:
        """Every engine start of the run in order: per backend (and repeat, interleaved), per prefix-caching
        variant, per KV dtype of a kv_quant run (recorded in run.json, baseline first, for the report)."""
        o = self.o
        dtypes, record = kvquant.engine_dtypes(o.workload, o.backends, geometry, o.kv_dtypes)
        if record:
            self.writer.update_run_info(kv_quant=record)
        bar = progress.add_task("cells", total=plan.cells_per_start * len(plan.variants)
                                * sum(len(d) for d in dtypes.values()), unit="cells")
        for repeat, backends in self.schedule(plan.repeats):
            for cfg in backends:
                for prefix_caching in plan.variants:
                    for kv in dtypes[cfg.label]:
                        variant = replace(spec, prefix_caching=prefix_caching, **({"kv_dtype": kv} if kv else {}))
                        _EngineSession(self, cfg, variant, plan, prompts, progress, bar, repeat, kv_variant=kv).run()

    def schedule(self, repeats: int) -> list[tuple[int | None, list[BackendConfig]]]:
        """Which repeat (None: all of them) each round of engine starts runs, and on which backends in order."""
        if not self.o.interleave:
            return [(None, list(self.o.backends))]
        return [(r, list(self.o.backends) if r % 2 == 0 else list(reversed(self.o.backends))) for r in range(repeats)]


class _EngineSession:
    """One engine start (or attachment) and the cells it runs: rows for every planned cell, failed ones
    with the reason when the engine cannot install, start or keep running."""

    def __init__(self, runner: Runner, cfg: BackendConfig, spec: ServerSpec, plan: RunPlan, prompts: CellPrompts,
                 progress: Progress, bar, repeat: int | None = None, kv_variant: str | None = None):
        self.r, self.cfg, self.spec, self.plan, self.prompts = runner, cfg, spec, plan, prompts
        self.progress, self.bar = progress, bar
        # grows as a saturation sweep finds its rates; one repeat only when the run is interleaved
        self.cells = [c for c in plan.cells(spec.prefix_caching, kv_variant) if repeat is None or c.repeat == repeat]
        self.expected = plan.cells_per_start // (1 if repeat is None else plan.repeats)  # its share of the bar
        self.done = 0  # cells[:done] have their rows written
        self.info = EngineRun(runner.run_id, cfg.label, cfg.engine, cfg.version, spec.model, plan.workload,
                              spec.kv_dtype, attached=bool(cfg.url), rules=kv_rules(cfg.engine),
                              **engine_setup(REGISTRY[cfg.engine], cfg.options, bool(cfg.url)))
        self.gpu_baseline: GPUBaseline | None = None
        self.log_path: Path | None = None  # the log of the engine kvbench started (None: attached)
        self.streak = TimeoutStreak(runner.o.max_consecutive_timeouts)
        self.recovered = ""  # the flag of the first cell run after a wedged engine answered its probe again
        self.outages: dict[tuple, dict] = {}  # a deployment's replicas out of rotation: (replica, out_at) -> record
        self.stop_reason = "interrupted"  # until the session says otherwise
        self.estimated: dict | None = None  # how long its cells were expected to take (bench/run/estimate.py)
        self.prefix_seen = False  # a cell of this start has sent the workload's shared prefix
        self.cell_estimates: list[float] = []  # from cells done, monotonic time estimate_from: each one's seconds
        self.estimate_from = (0, 0.0)
        variant = {None: "", True: " (prefix caching on)", False: " (prefix caching off)"}[spec.prefix_caching]
        variant += f" (KV {kv_variant})" if kv_variant else ""
        self.kv_variant = kv_variant
        self.key = cfg.label + variant + ("" if repeat is None else f" repeat {repeat}")  # in run.json's engine_stops

    def skip_finished(self) -> None:
        """Resuming: pass over the cells that have rows (the cells a load profile adds come from their rows)."""
        while self.done < len(self.cells) and (cell_id := self.cells[self.done].cell_id(self.cfg.label)) \
                in self.r.finished:
            self.done += 1
            self.progress.advance(self.bar)
            self.cells[self.done:self.done] = self.plan.cells_after(self.cells[self.done - 1],
                                                                    self.r.finished[cell_id] or 0)

    def run(self) -> None:
        cls = REGISTRY[self.cfg.engine]
        try:
            self.skip_finished()
            if self.done == len(self.cells):
                return
            if self.spec.prefix_caching is not None and not cls.capabilities.prefix_cache.switchable:
                return self.fail_remaining(f"the {self.cfg.engine} adapter cannot switch prefix caching "
                                           f"{'on' if self.spec.prefix_caching else 'off'}", status="not run")
            backend = self.make_backend(cls)
            if backend is not None:
                backend.auth_headers = self.cfg.auth_headers()
                self.run_cells(backend)
        except (ResultsWriteError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - whatever goes wrong with one backend fails that backend only
            self.fail_remaining(f"backend failed: {type(exc).__name__}: {exc}", _traceback_tail(exc))
        finally:
            # this start's share of the bar, whatever ran: failed cells, and sweep rates never found
            self.progress.advance(self.bar, max(0, self.expected - self.done))

    def make_backend(self, cls) -> Backend | None:
        if self.cfg.deployment:  # several replicas (or a gateway): one adapter attached to each
            return Deployment.of(cls, self.cfg.version, self.cfg.options, self.cfg.urls, self.cfg.gateway)
        if self.cfg.url:
            return cls(self.cfg.version, None, self.cfg.options)
        self.progress.update(self.bar, description=f"{self.cfg.label}: installing")
        try:
            env_path = ensure_env(cls.recipe(self.cfg.version), log=self.r.console.print)
        except EnvInstallError as exc:
            self.fail_remaining(f"install failed: {exc}", exc.log_tail)
            self.stop_reason = "install failed"
            return None
        return cls(self.cfg.version, env_path, self.cfg.options)

    def run_cells(self, backend: Backend) -> None:
        """Start or attach, check, warm up (and calibrate), measure the cells, stop and record: an engine
        that fails at any step fails the cells it has not run, with the reason and its log."""
        started = False
        try:
            self.start_or_attach(backend)
            started = True
            self.check(backend)
            self.check_startup(backend, started=True)
            self.warm_up(backend)
            self.measure_cells(backend)
        except (EngineStartError, ValueError, httpx.HTTPError) as exc:
            self.fail_engine(backend, exc, started)
        except (ResultsWriteError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - a bug or an engine answer the adapter cannot read
            self.stop_reason = f"backend failed: {type(exc).__name__}: {exc}"
            self.fail_remaining(self.stop_reason, _traceback_tail(exc) + "\n" + backend.log_tail())
        finally:
            self.stop_and_record(backend)

    def start_or_attach(self, backend: Backend) -> None:
        r, cfg = self.r, self.cfg
        self.progress.update(self.bar, description=f"{cfg.label}: {'attaching' if cfg.url else 'starting'}")
        if cfg.url:
            backend.attach(self.spec, cfg.url, timeout_s=min(r.o.start_timeout_s, 60))
            return
        # GPU memory before the engine exists: its figures are measured against this
        self.gpu_baseline = r.nvml.idle_baseline()  # None without a GPU
        r.record.gpu_baselines[cfg.label] = self.gpu_baseline.to_dict() if self.gpu_baseline else None
        r.record.save(r.writer)
        # one log per KV dtype's start: the pool is read from the start's own log lines
        log = cfg.label + (f"_kv-{self.kv_variant}" if self.kv_variant else "")
        self.log_path = r.writer.log_path(log)
        backend.start(self.spec, self.log_path, r.o.start_timeout_s)

    def check_startup(self, backend: Backend, started: bool) -> None:
        """The engine's own figures at startup (its log, read by its adapter) beside the plan's for the same
        deployment (its GPU as NVML names it), into run.json's startup_checks (bench/run/startup_checks.py).
        A server kvbench did not start has no log here. A check that cannot be made is recorded as such; it
        never fails the engine's cells."""
        if self.cfg.url or self.log_path is None or not self.log_path.exists():
            return
        cls, spec = type(backend), self.spec
        try:
            figures = cls.startup_figures_from_log(self.log_path.read_text(errors="replace"))
            if not figures:
                return
            settings = backend.startup_settings(spec)
            hf = spec.model.hf_dir
            model = settings.get("model_file") or (str(hf) if (hf / "config.json").exists() else
                                                   str(spec.model.gguf_path or hf))
            base = self.gpu_baseline
            start = startup_checks.Start(
                self.cfg.engine, self.info.engine_version_reported or backend.version, model,
                cls.gpus_used(self.cfg.options), spec.max_context, settings,
                base.names[0] if base and base.names else None,
                base.device_total_bytes[0] if base and base.device_total_bytes else None, started)
            check = startup_checks.startup_check(figures, start)
        except Exception as exc:  # noqa: BLE001 - a check is a record of the run, never a reason to fail it
            check = {"error": f"{type(exc).__name__}: {exc}"}
        if check:
            self.r.record.startup_checks[self.key] = check
            self.r.record.save(self.r.writer)

    def check(self, backend: Backend) -> None:
        """The version the engine reports, the models it serves (an attached server's checked against
        --model), what it supports and how its prompts and tokenizer were checked, recorded."""
        version = backend.reported_version()
        self.r.record.engine_versions[self.cfg.label] = version
        served_model = backend.capabilities.served_model
        self.r.record.served_models[self.cfg.label] = served = served_model.models(backend)
        self.r.record.capabilities[self.cfg.label] = served_model.support(backend)
        if not self.cfg.url and (build := type(backend).machine_build(backend.version)):
            self.r.record.engine_builds[self.cfg.label] = build
        self.r.record.save(self.r.writer)
        if self.cfg.url and served is not None and not models.serves(served, self.spec.model, self.r.o.model):
            problem = (f"the server serves {', '.join(served) or 'no model'}, not --model {self.r.o.model}: its "
                       f"figures would be set against {self.spec.model.name}'s KV")
            if not self.r.o.allow_model_mismatch:
                raise EngineStartError(problem + " (--allow-model-mismatch to run anyway)")
            self.r.console.print(f"[yellow]warning: {problem} (--allow-model-mismatch)[/]")
        self.info = replace(self.info, engine_version_reported=version, token_contract=self.token_contract(backend))
        self.r.record.save(self.r.writer)

    def measure_cells(self, backend: Backend) -> None:
        r, label = self.r, self.cfg.label
        while self.done < len(self.cells):
            self.skip_finished()
            if self.done == len(self.cells):
                break
            cell = self.cells[self.done]
            if died := backend.exit_description():
                self.stop_reason = f"engine {died} during the run"
                return self.fail_remaining(self.stop_reason, backend.log_tail())
            if self.streak.tripped and not self.answers_again(backend):
                # this cell fails unsent; the next one probes the engine again (it may be back by then)
                said = self.stop_reason.startswith("wedged")
                self.stop_reason = f"wedged: {self.streak.describe()}"
                self.fail_remaining(self.stop_reason, backend.log_tail(), only_next=True, quiet=said)
                continue
            self.progress.update(self.bar, description=f"{label}: {cell.describe()}")
            m = self.measure(backend, cell)
            row = summarize(self.info, m)
            parts = replica_rows(self.info, m, row)  # a deployment's rows per replica
            self.note_stalls(row, parts, m)
            for each in (row, *parts):
                r.writer.write_cell(each)
            self.done += 1
            self.progress.advance(self.bar)
            self.update_eta()
            r.console.print(summary_line(row))
            # the cells the load profile adds after this one (a saturation sweep's rates), from its rate
            self.cells[self.done:self.done] = self.plan.cells_after(cell, row.requests_per_s or 0)
            self.stop_reason = "interrupted"  # a cell ran: no longer wedged; "finished" once the loop ends
        if not self.stop_reason.startswith("wedged"):
            self.stop_reason = "finished"

    def answers_again(self, backend: Backend) -> bool:
        """A wedged engine (its timeout streak tripped) is probed before each later cell: one request of 8
        prompt tokens and 1 output token, with a short timeout (a completion: an engine whose scheduler hangs
        still answers its health route). Answered: the cell runs on probation (one more timeout before an
        answer trips the streak again) and its row says the engine had stopped answering."""
        probe = self.prompts.build(8, f"reprobe-{self.done}", 1)
        timeout_s = min(REPROBE_TIMEOUT_S, self.r.o.request_timeout_s / 2)
        result = run_async(run(backend, [probe], WARMUP_POINT, LoadSettings(timeout_s))).results[0]
        self.r.writer.write_request(request_row(self.r.run_id, f"{self.cfg.label}_reprobe", self.cfg.label, result,
                                                warmup=True))
        # an answer the adapter could not read, or a 4xx, is an answer; a timeout, a refused connection or a
        # 5xx is not
        if result.error and not result.error.startswith(("bad response", "HTTP 4")):
            return False
        self.recovered = (f"the engine had stopped answering ({self.streak.describe()}) and answered a probe "
                          f"before this cell")
        self.streak.probation()
        return True

    def note_stalls(self, row, parts: list, m: CellMeasurement) -> None:
        """Flag a cell run after its engine was wedged, and a deployment's cell during which a replica was
        out of rotation (its row, the total's, and run.json's ``replica_outages``)."""
        notes = [self.recovered] if self.recovered else []
        self.recovered = ""
        for rp in (m.replicas or {}).values():
            for outage in rp.outages:
                back = (f"back by {outage['put_back_by']} after {outage['out_s']:.1f} s" if outage["back_at"]
                        else "still out at the cell's end")
                note = (f"replica {outage['replica']} out of rotation for {outage['seconds_in_cell']:.1f} s of this "
                        f"cell ({outage['reason']}; {back})")
                notes.append(note)
                for part in parts:
                    if part.replica == outage["replica"]:
                        part.flags.insert(0, note)
                self.outages[(outage["replica"], outage["out_at"])] = {k: v for k, v in outage.items()
                                                                       if k != "seconds_in_cell"}
        if self.outages:
            self.r.record.replica_outages[self.key] = list(self.outages.values())
            self.r.record.save(self.r.writer)
        for each in (row, *parts) if notes else ():
            if each is row:
                each.flags[:0] = notes
            if each.status == "ok" and each.flags:
                each.status = "flagged"

    def fail_engine(self, backend: Backend, exc: Exception, started: bool) -> None:
        """The engine failed to start or during the run (an HTTP error here is one of the harness's own
        calls, e.g. a cell's counter reset): the rest of its cells fail with why, and whether it died."""
        detail = f"{type(exc).__name__}: {exc}" if isinstance(exc, httpx.HTTPError) else str(exc)
        if not started:  # its log may hold the engine's refusal, beside the plan's
            self.check_startup(backend, started=False)
        died = backend.exit_description(wait_s=ENGINE_EXIT_WAIT_S) if started else ""
        what = f"engine {died} during the run" if died else ("engine failed" if started else "engine failed to start")
        self.stop_reason = f"{what}: {detail}"
        self.fail_remaining(self.stop_reason, (exc.log_tail if isinstance(exc, EngineStartError) else "")
                            or backend.log_tail())

    def stop_and_record(self, backend: Backend) -> None:
        """Stop the engine first (nothing after it, a full disk included, may leave it running), then record
        the threads it computed on, its estimate against what the cells took, why it stopped and what survived."""
        r, label = self.r, self.cfg.label
        threads = busy_threads(backend.pid) if backend.pid else None
        self.progress.update(self.bar, description=f"{label}: stopping")
        survivors = backend.stop()
        if wall := backend.capabilities.memory_wall.record(backend):
            r.record.memory_walls[self.key] = wall
        if self.estimated:  # the estimate beside what the cells took, so its error here can be read
            self.estimated["took_s"] = round(time.monotonic() - self.estimated.pop("started"), 1)
            r.record.estimates[self.key] = self.estimated
        if threads:
            r.record.engine_threads[self.key] = threads
        if survivors:  # the stop could not end the engine's tree: its memory skews whatever runs next
            names = ", ".join(f"{p['pid']} ({p['name']})" for p in survivors)
            row = failed_row(self.info, self.cells[max(0, self.done - 1)], "failed",
                             f"{len(survivors)} process(es) of the engine survived its stop: {names}", "")
            row.cell_id, row.variant = f"{row.cell_id}_stop", "engine stop"  # a row of its own, never a cell's
            r.writer.write_cell(row)
            r.console.print(f"[red]{label}: processes of the engine survived its stop: {names}[/]")
        if not self.cfg.url:
            r.record.engine_stops[self.key] = {"reason": self.stop_reason, "survivors": survivors}
            # a guard of its tree died and was replaced (backends/process.py)
            if restarts := backend.capabilities.memory_wall.guard_restarts(backend):
                r.record.engine_stops[self.key]["guard_restarts"] = restarts
        r.record.save(r.writer)

    def fail_remaining(self, error: str, log_tail: str = "", status: str = "failed", only_next: bool = False,
                       quiet: bool = False) -> None:
        """Failed rows for the cells not run (``only_next``: the next one only), said on the console unless ``quiet``."""
        for cell in self.cells[self.done:self.done + 1 if only_next else None]:
            self.r.writer.write_cell(failed_row(self.info, cell, status, error, log_tail))
            self.done += 1  # one row per cell, however many failures follow
            self.progress.advance(self.bar)
        if not quiet:
            self.r.console.print(f"[red]{self.cfg.label}: {error}[/]" + (f"\n{log_tail}" if log_tail else ""))

    def token_contract(self, backend: Backend) -> str:
        """How prompts reach the engine and how output length is forced, plus a check of the prompt
        tokens against the engine's own tokenizer where it has a tokenize endpoint."""
        parts = ["token ids" if backend.accepts_token_ids else "text",
                 "output forced" if backend.forces_output_length else "output as generated"]
        probe = self.prompts.build(64, "tokenizer-check", 1)
        try:
            ids = backend.tokenize(probe.text)
        except httpx.HTTPError as exc:
            ids, note = None, f"tokenize endpoint failed ({type(exc).__name__})"
        else:
            note = "no tokenize endpoint: checked per request by the engine's usage report"
        if ids is not None:
            if list(ids) != list(probe.token_ids):
                raise ValueError(f"the engine's tokenizer disagrees with the model's tokenizer.json: 64 prompt "
                                 f"tokens became {len(ids)} ({list(ids)[:8]}... vs {list(probe.token_ids)[:8]}...)")
            note = "tokenizer checked against the engine's tokenize endpoint"
        self.r.record.token_checks[self.cfg.label] = note
        return ", ".join(parts)

    def warm_up(self, backend: Backend) -> None:
        """The workload's warm-up requests, then (for the estimate, once the engine is warm) a short and a
        long calibration request; all are recorded as warm-up requests and count in no figure."""
        w = self.plan.workload
        warmup = self.prompts.warmup()
        longest = max((w.prompt_tokens_sent(c.prompt_tokens, c.turn) for c in self.cells[self.done:]), default=0)
        calibration = [self.prompts.build(n, f"calibration-{n}", 8)
                       for n in sorted({min(32, longest), longest})] if self.r.o.estimate and longest else []
        prompts = warmup + calibration
        if not prompts:
            return
        self.progress.update(self.bar, description=f"{self.cfg.label}: warm-up")
        load = run_async(run(backend, prompts, WARMUP_POINT, LoadSettings(self.r.o.request_timeout_s,
                                                                          streak=self.streak)))
        for result in load.results:
            self.r.writer.write_request(request_row(self.r.run_id, f"{self.cfg.label}_warmup", self.cfg.label, result,
                                                    warmup=True))
        measured = [r for r in load.results[len(warmup):] if not r.error]
        if calibration and measured:
            self.estimate_cells([RequestTimes.of(r) for r in measured], [r.prompt_tokens_sent for r in measured])

    def estimate_cells(self, times: list[RequestTimes], prompt_tokens: list[int]) -> None:
        """Say how long this engine's cells will take here (bench/run/estimate.py), and record it."""
        points = [(p, t.ttft) for p, t in zip(prompt_tokens, times) if t.ttft is not None]
        itls = sorted(x for t in times for x in t.itl_samples())
        if not points or not itls:
            return
        cal = estimate.Calibration.from_points(min(points), max(points), itls[len(itls) // 2])
        w, cells = self.plan.workload, self.cells[self.done:]
        self.cell_estimates = [estimate.cell_seconds(
            cal, w.prompt_tokens_sent(c.prompt_tokens, c.turn), w.output_tokens, w.load.requests_per_cell(c.load),
            c.load.concurrency, c.load.request_rate) for c in cells]
        seconds, self.estimate_from = sum(self.cell_estimates), (self.done, time.monotonic())
        self.update_eta()
        self.estimated = {"estimated_s": round(seconds, 1), "cells": len(cells), "started": time.monotonic(),
                          "prefill_tokens_per_s": round(1 / cal.prefill_s_per_token) if cal.prefill_s_per_token else None,
                          "decode_tokens_per_s": round(1 / cal.decode_s_per_token) if cal.decode_s_per_token else None}
        self.r.console.print(f"{self.cfg.label}: about {estimate.describe(seconds)} for its {len(cells)} cells on "
                             f"this machine (from its {min(points)[0]}- and {max(points)[0]}-token calibration "
                             f"prompts; rough, see bench/run/estimate.py)")

    def update_eta(self) -> None:
        """The bar's ETA from the calibrated estimate, at once and after each cell."""
        set_eta(self.progress, self.bar, self.cell_estimates, self.estimate_from, self.done, len(self.cells))

    def measure(self, backend: Backend, cell: Cell) -> CellMeasurement:
        """One cell: the load with the samplers running alongside, and the engine's figures around it."""
        r, w = self.r, self.plan.workload
        prompts = self.prompts.for_cell(cell, w.load.requests_per_cell(cell.load))
        line = CellProgress(self.progress, cell.describe(), len(prompts)) if r.o.load_workers == 1 else None
        settings = LoadSettings(r.o.request_timeout_s, w.load.duration_s,
                                schedule_seed(w.seed, cell.prompt_tokens, cell.repeat, cell.load.slug), self.streak,
                                workers=r.o.load_workers, on_done=line)
        backend.reset_cell()
        if r.o.reset_cache_between_cells:
            backend.capabilities.prefix_cache.empty(backend)
        counters_before = prefix_counters(backend)
        memory, rss_baseline = None, None
        if backend.pid:
            rss_baseline = tree_rss(backend.pid)[0]
            memory = ProcessTreeMemorySampler(backend.pid, r.o.memory_hz, r.nvml, baseline=self.gpu_baseline)
        engine = EnginePoller(backend, r.o.kv_poll_hz)
        samplers = [s for s in (memory, engine) if s]
        with frozen_heap():  # no full garbage collection while the client and samplers measure
            t0 = time.perf_counter()
            for s in samplers:
                s.start()
            try:
                load = run_async(run(backend, prompts, cell.load, settings))
            finally:
                for s in samplers:
                    s.stop()
                if line:
                    line.close()
        label = self.cfg.label
        counters = (counters_before, prefix_counters(backend))
        prom = measure_cell(r.o.prometheus, t0, load.t_end, r.run_dir, cell.cell_id(label))
        # a deployment: each replica's polls and the requests it served (each marked with its replica)
        replicas = backend.replica_polls(load.results)
        for result in load.results:
            r.writer.write_request(request_row(r.run_id, cell.cell_id(label), label, result, repeat=cell.repeat))
        if w.family == "kv_quant":  # the greedy tokens and log-probabilities the divergence is computed from
            r.writer.write_logprobs(cell.cell_id(label), kvquant.logprob_records(
                load.results, w.top_logprobs, backend.capabilities.kv_quantisation.top_logprobs_max))
        # A killed engine closes its sockets a moment before its exit can be read: wait for it briefly,
        # so that requests cut off by a dead engine are put down to the engine.
        verdicts = request_verdicts(load.results)
        died = backend.exit_description(wait_s=ENGINE_EXIT_WAIT_S) if "failed" in verdicts else ""
        try:
            kv_peak = backend.kv_peak()
        except httpx.HTTPError:
            kv_peak = None
        m = CellMeasurement(cell, load, t0, backend.kv_dtype_name(), engine_exit=died,
                            log_tail=backend.log_tail() if "ok" not in verdicts else "",
                            kv_pool=backend.kv_pool(), kv_peak=kv_peak,
                            kv_samples=engine.kv_samples, kv_source=engine.kv_source,
                            queue_samples=engine.queue_samples, queue_source=engine.queue_source,
                            memory_samples=memory.samples if memory else None, rss_baseline_bytes=rss_baseline,
                            gpu_baseline_used_bytes=self.gpu_baseline.used_bytes if self.gpu_baseline else None,
                            replicas=replicas, telemetry=prom, prefix_counters=counters,
                            prefix_seen=self.prefix_seen)
        self.prefix_seen = self.prefix_seen or bool(w.shared_prefix_tokens)
        r.writer.write_timeline(cell.cell_id(label), timeline_frame(t0, m.memory_samples or [], engine.kv_samples,
                                                                     engine.queue_samples, replicas))
        return m


def _traceback_tail(exc: BaseException, lines: int = 12) -> str:
    """The last lines of an exception's traceback: where a backend failed, for its failed rows."""
    return "\n".join("".join(traceback.format_exception(exc)).rstrip().splitlines()[-lines:])
