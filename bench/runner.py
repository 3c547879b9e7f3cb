"""Runs a workload on every backend, one cell at a time, and writes results as it goes.

For each backend (and each server variant the workload asks for, e.g. prefix caching on and off):
install its environment (once), start the server (or attach to a running one), send warm-up requests,
then for each cell (prompt length x load point x repeat) sample memory, KV in use and the engine's queue
while the cell's load runs, and append the cell's row. Anything that goes wrong with one backend
(install, start, crash, timeout) becomes failed rows with the engine's log tail; the other backends
still run; a server kvbench started is always stopped, also on Ctrl-C.
"""
from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pandas as pd
import psutil
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

import bench
from backends import REGISTRY
from backends.base import Backend, EngineStartError, ModelFiles, RequestResult, ServerSpec
from bench import models
from bench.config import BackendConfig
from bench.envs import EnvInstallError, ensure_env
from bench.kvmodel import kv_bytes_per_token
from bench.cells import Cell, CellPrompts, cells_for, server_variants
from bench.kvmodel import sequences_in_pool
from bench.load import concurrent, frozen_heap, rate, run_async, sweep
from bench.metrics import RequestTimes, cell_metrics, percentiles, request_verdict
from bench.results import CellRow, RequestRow, RunWriter, ensure_parquet
from bench.samplers import NVML, EnginePoller, KVSample, ProcessTreeMemorySampler, QueueSample, tree_rss
from workloads import Workload
from workloads.prompts import Prompt, PromptBuilder


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


def new_run_id(workload: str) -> str:
    return f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{workload}-{socket.gethostname()[:12]}"


def _sigterm_as_interrupt(signum, frame):  # so `finally` blocks stop the servers on SIGTERM too
    raise KeyboardInterrupt


def environment_info() -> dict:
    nvml = NVML()
    gpus = nvml.devices() if nvml.available else []
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    from backends.llamacpp import _cpu_model

    return {"kvbench_version": bench.__version__, "kvbench_commit": commit, "python": platform.python_version(),
            "os": platform.platform(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total, "gpus": gpus, "nvml": nvml.error or "ok"}


class Runner:
    def __init__(self, options: RunOptions, console: Console | None = None):
        self.o = options
        self.console = console or Console()
        self.run_id = options.run_id or new_run_id(options.workload.name)
        self.writer = RunWriter(options.results_dir / self.run_id)
        self.nvml = NVML()
        self.reported_versions: dict[str, str] = {}
        self.token_checks: dict[str, str] = {}
        self.gpu_baselines: dict[str, dict | None] = {}
        self.gpu_baseline = None

    @property
    def run_dir(self) -> Path:
        return self.writer.root

    @property
    def repeats(self) -> int:
        return self.o.repeats or self.o.workload.repeats

    # --- the whole run ---------------------------------------------------------------------------
    def run(self) -> Path:
        previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
        try:
            return self._run()
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _run(self) -> Path:
        o, w = self.o, self.o.workload
        info = {"run_id": self.run_id, "command": " ".join(o.command),
                "started_at": datetime.now(timezone.utc).isoformat(), "status": "running",
                "environment": environment_info(), "workload": w.model_dump(), "repeats": self.repeats,
                "kv_dtype": o.kv_dtype, "backends": [b.model_dump() | {"label": b.label} for b in o.backends]}
        self.writer.write_run_info(info)
        self.console.print(f"[bold]kvbench run[/] {self.run_id} -> {self.run_dir}")
        try:
            model = self._prepare_model()
        except models.ModelError as exc:
            self.writer.update_run_info(status="failed", error=str(exc))
            raise
        max_context = min(model.geometry.max_context or 2048, o.max_context or 10**9)
        lengths = w.prompt_lengths(max_context)
        skipped = [n for n in w.prompt_tokens if n != "max" and n not in lengths]
        if skipped:
            self.console.print(f"[yellow]prompt lengths {skipped} skipped: they do not fit the context limit "
                               f"{max_context} with {w.output_tokens} output tokens[/]")
        if not lengths:
            error = f"no prompt length of {w.name} fits the context limit {max_context}"
            self.writer.update_run_info(status="failed", error=error)
            raise models.ModelError(error)
        self.lengths = lengths
        self.points = sweep.static_points(w)
        self.writer.update_run_info(model={"name": model.name, "sha256": model.sha256,
                                           "gguf": str(model.gguf_path) if model.gguf_path else None,
                                           "hf_dir": str(model.hf_dir), "geometry": asdict(model.geometry),
                                           "max_context": max_context},
                                    skipped_prompt_lengths=skipped, prompt_lengths=lengths,
                                    load_points=[asdict(p) for p in self.points])
        self.prompts = CellPrompts(PromptBuilder(model.hf_dir / "tokenizer.json"), w)
        spec = ServerSpec(model=model, max_context=w.longest_prompt(max(lengths)) + w.output_tokens,
                          max_concurrency=sweep.max_in_flight(w), kv_dtype=o.kv_dtype,
                          kv_pool_sequences=w.kv_pool_sequences)
        # cells per engine start, for the progress bar: a saturation sweep adds its open-loop rates later
        per_start = self.repeats * len(cells_for(w, lengths, self.points, 0, None))
        if w.request_rates == "saturation":
            per_start += self.repeats * len(lengths) * w.saturation_steps * (w.turns if w.family == "multi_turn" else 1)
        self.cells_per_start = per_start
        status = "interrupted"
        columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("cells"),
                   TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
        try:
            with Progress(*columns, console=self.console) as progress:
                task = progress.add_task("cells", total=per_start * len(server_variants(w)) * len(o.backends))
                for cfg in o.backends:
                    for prefix_caching in server_variants(w):
                        self._run_backend(cfg, replace(spec, prefix_caching=prefix_caching), progress, task)
            status = "finished"
        finally:
            self.writer.update_run_info(status=status, finished_at=datetime.now(timezone.utc).isoformat())
            if (self.run_dir / "cells.jsonl").exists():
                ensure_parquet(self.run_dir)  # the columnar copy beside the JSONL record
        return self.run_dir

    def _prepare_model(self) -> ModelFiles:
        """The model in every format; converting a GGUF (once) needs the hf environment."""
        return models.resolve(self.o.model, lambda: models.converter_python(self.console.print),
                              log=self.console.print)

    def _planned_cells(self, spec: ServerSpec) -> list[Cell]:
        return [c for r in range(self.repeats)
                for c in cells_for(self.o.workload, self.lengths, self.points, r, spec.prefix_caching)]

    # --- one backend (one server start) ---------------------------------------------------------
    def _run_backend(self, cfg: BackendConfig, spec: ServerSpec, progress, task):
        o, w = self.o, self.o.workload
        cls = REGISTRY[cfg.engine]
        planned = self._planned_cells(spec)  # grows as a saturation sweep finds its rates
        position = 0  # planned[:position] have their rows written

        def fail_remaining(error: str, log_tail: str = "", status: str = "failed"):
            for cell in planned[position:]:
                self.writer.write_cell(self._empty_row(cfg, spec, cell, status, error, log_tail))
            self.console.print(f"[red]{cfg.label}: {error}[/]" + (f"\n{log_tail}" if log_tail else ""))

        if spec.prefix_caching is not None and not cls.supports_prefix_caching:
            fail_remaining(f"the {cfg.engine} adapter cannot switch prefix caching "
                           f"{'on' if spec.prefix_caching else 'off'}", status="not run")
            return progress.advance(task, self.cells_per_start)
        if cfg.url:
            backend = cls(cfg.version, None, cfg.options)
        else:
            progress.update(task, description=f"{cfg.label}: installing")
            try:
                env_path = ensure_env(cls.recipe(cfg.version), log=self.console.print)
            except EnvInstallError as exc:
                fail_remaining(f"install failed: {exc}", exc.log_tail)
                return progress.advance(task, self.cells_per_start)
            backend = cls(cfg.version, env_path, cfg.options)
        progress.update(task, description=f"{cfg.label}: {'attaching' if cfg.url else 'starting'}")
        started = False
        try:
            if cfg.url:
                backend.attach(spec, cfg.url, timeout_s=min(o.start_timeout_s, 60))
            else:
                # GPU memory before the engine exists: its figures are measured against this
                self.gpu_baseline = self.nvml.idle_baseline()  # None without a GPU
                self.gpu_baselines[cfg.label] = self.gpu_baseline.to_dict() if self.gpu_baseline else None
                self.writer.update_run_info(gpu_baselines=self.gpu_baselines)
                backend.start(spec, self.writer.log_path(cfg.label), o.start_timeout_s)
            started = True
            version = backend.reported_version()
            self.reported_versions[cfg.label] = version
            self.writer.update_run_info(engine_versions=self.reported_versions)
            contract = self._token_contract(backend, cfg)
            progress.update(task, description=f"{cfg.label}: warm-up")
            warmup = self.prompts.warmup()
            if warmup:
                load = run_async(concurrent.run(backend, warmup, 1, o.request_timeout_s))
                for r in load.results:
                    self.writer.write_request(request_row(self.run_id, f"{cfg.label}_warmup", cfg.label, r, warmup=True))
            while position < len(planned):
                cell = planned[position]
                if died := backend.exit_description():
                    return fail_remaining(f"engine {died} during the run", backend.log_tail())
                progress.update(task, description=f"{cfg.label}: {cell.describe()}")
                row = self._run_cell(backend, cfg, spec, cell, version, contract)
                self.writer.write_cell(row)
                position += 1
                progress.advance(task)
                self.console.print(summary_line(row))
                if w.request_rates == "saturation" and cell.load.profile == "concurrent":
                    # the closed loop found the saturation rate: the open-loop rates follow it
                    planned[position:position] = [replace(cell, load=point) for point in
                                                  sweep.saturation_points(w, row.requests_per_s or 0)]
        except (EngineStartError, ValueError, httpx.HTTPError) as exc:
            # an HTTP error here is one of the harness's own calls (e.g. a cell's counter reset)
            detail = f"{type(exc).__name__}: {exc}" if isinstance(exc, httpx.HTTPError) else str(exc)
            died = backend.exit_description(wait_s=ENGINE_EXIT_WAIT_S) if started else ""
            what = f"engine {died} during the run" if died else ("engine failed" if started else
                                                                  "engine failed to start")
            fail_remaining(f"{what}: {detail}", getattr(exc, "log_tail", "") or backend.log_tail())
        finally:
            progress.update(task, description=f"{cfg.label}: stopping")
            backend.stop()
            # this start's share of the bar, whatever ran: failed cells, and sweep rates never found
            progress.advance(task, max(0, self.cells_per_start - position))

    def _token_contract(self, backend: Backend, cfg: BackendConfig) -> str:
        """How prompts reach the engine and how output length is forced, plus a check of the prompt
        tokens against the engine's own tokenizer where it has a tokenize endpoint."""
        parts = ["token ids" if backend.accepts_token_ids else "text",
                 "output forced" if backend.forces_output_length else "output as generated"]
        probe = self.prompts.builder.build(64, self.o.workload.seed, "tokenizer-check", 1)
        with httpx.Client(timeout=10.0) as client:
            try:
                ids = backend.tokenize(client, probe.text)
            except httpx.HTTPError as exc:
                ids, note = None, f"tokenize endpoint failed ({type(exc).__name__})"
            else:
                note = "no tokenize endpoint: checked per request by the engine's usage report"
        if ids is not None:
            if list(ids) != list(probe.token_ids):
                raise ValueError(f"the engine's tokenizer disagrees with the model's tokenizer.json: 64 prompt "
                                 f"tokens became {len(ids)} ({list(ids)[:8]}... vs {list(probe.token_ids)[:8]}...)")
            note = "tokenizer checked against the engine's tokenize endpoint"
        self.token_checks[cfg.label] = note
        self.writer.update_run_info(token_checks=self.token_checks)
        return ", ".join(parts)

    def _empty_row(self, cfg, spec: ServerSpec, cell: Cell, status, error, log_tail) -> CellRow:
        w = self.o.workload
        return CellRow(run_id=self.run_id, cell_id=cell.cell_id(cfg.label), backend=cfg.label, engine=cfg.engine,
                       engine_version=cfg.version, model=spec.model.name, workload=w.name, variant=cell.variant,
                       prompt_tokens=w.prompt_tokens_sent(cell.prompt_tokens, cell.turn),
                       output_tokens=w.output_tokens, load_profile=cell.load.profile,
                       concurrency=cell.load.concurrency, request_rate=cell.load.request_rate, repeat=cell.repeat,
                       kv_dtype=spec.kv_dtype, attached=bool(cfg.url), status=status, error=error,
                       log_tail=log_tail or None, slo_ttft_s=w.slo_ttft_s, slo_tpot_s=w.slo_tpot_s)

    # --- one cell --------------------------------------------------------------------------------
    def _run_load(self, backend: Backend, cell: Cell, prompts: list[Prompt]):
        o, w, point = self.o, self.o.workload, cell.load
        if point.profile == "concurrent":
            return run_async(concurrent.run(backend, prompts, point.concurrency, o.request_timeout_s, w.duration_s))
        seed = rate.schedule_seed(w.seed, cell.prompt_tokens, cell.repeat, point.slug)
        return run_async(rate.run(backend, prompts, point.request_rate, point.profile, o.request_timeout_s,
                                  point.concurrency, seed, w.duration_s))

    def _run_cell(self, backend: Backend, cfg, spec, cell: Cell, version: str, contract: str) -> CellRow:
        o, w = self.o, self.o.workload
        row = self._empty_row(cfg, spec, cell, "ok", None, None)
        row.engine_version_reported = version
        row.token_contract = contract
        prompts = self.prompts.for_cell(cell, w.requests_per_cell(cell.load.concurrency, cell.load.request_rate))
        with httpx.Client(timeout=5.0) as client:
            backend.reset_cell(client)
        memory = None
        if backend.pid:
            row.rss_baseline_bytes = tree_rss(backend.pid)[0]
            memory = ProcessTreeMemorySampler(backend.pid, o.memory_hz, self.nvml, baseline=self.gpu_baseline)
        engine = EnginePoller(backend, o.kv_poll_hz)
        samplers = [s for s in (memory, engine) if s]
        with frozen_heap():  # no full garbage collection while the client and samplers measure
            t0 = row.t_cell_start = time.perf_counter()
            for s in samplers:
                s.start()
            try:
                load = self._run_load(backend, cell, prompts)
            finally:
                for s in samplers:
                    s.stop()
        results = load.results
        row.n_requests = len(results)
        for r in results:
            self.writer.write_request(request_row(self.run_id, row.cell_id, cfg.label, r, repeat=cell.repeat))

        # load achieved
        row.offered_request_rate = load.offered_request_rate
        row.achieved_request_rate = load.achieved_request_rate
        row.max_in_flight = load.max_in_flight
        if load.send_lags:
            row.send_lag_s_p99 = percentiles(load.send_lags, "lag")["lag_p99"]
        row.client_loop_lag_s_max = load.loop_lag_s_max

        # token contract: what was sent and asked for against what the engine says it did
        good, flags, counts = [], [], {"failed": 0, "truncated": 0, "short": 0}
        for r in results:
            verdict = request_verdict(r.error, r.prompt_tokens_sent, r.prompt_tokens_reported,
                                      r.output_tokens_requested, r.output_tokens_reported, sum(r.chunk_tokens))
            if verdict == "ok":
                good.append(r)
                continue
            counts[verdict] = counts.get(verdict, 0) + 1
            if len(flags) < 10:
                flags.append(f"{r.request_id}: {verdict}: " + (r.error or
                             f"prompt {r.prompt_tokens_sent} sent / {r.prompt_tokens_reported} read, output "
                             f"{r.output_tokens_requested} asked / {r.output_tokens_reported} reported / "
                             f"{sum(r.chunk_tokens)} received"))
        bad = len(results) - len(good)
        if bad > len(flags):
            flags.append(f"... {bad - len(flags)} more requests broke the token contract")
        row.flags = flags
        row.n_ok, row.n_failed, row.n_truncated, row.n_short = (len(good), counts["failed"], counts["truncated"],
                                                                 counts["short"])
        row.status = "failed" if not good else ("flagged" if flags else "ok")
        # A killed engine closes its sockets a moment before its exit can be read: wait for it briefly,
        # so that requests cut off by a dead engine are put down to the engine.
        died = backend.exit_description(wait_s=ENGINE_EXIT_WAIT_S) if counts["failed"] else ""
        if died:
            row.flags.insert(0, f"engine {died} during the cell")
        if not good:
            failed = [r for r in results if r.error]
            row.error = failed[0].error if failed else "no request met the token contract"
            if died:
                row.error = f"engine {died} during the cell: {row.error}"
            row.log_tail = backend.log_tail() or None
        metrics = cell_metrics([RequestTimes.of(r) for r in good], [r.prompt_tokens_sent for r in good],
                               w.slo_ttft_s, w.slo_tpot_s)
        for k, v in metrics.items():
            setattr(row, k, v)

        # KV: predicted from the config, the engine's pool, and the peak in use
        row.kv_dtype = backend.kv_dtype_name()
        per_token = kv_bytes_per_token(spec.model.geometry, row.kv_dtype)
        row.kv_bytes_per_token_predicted = per_token
        pool = backend.kv_pool()
        if pool:
            row.kv_pool_bytes_engine, row.kv_pool_tokens_engine, row.kv_pool_source = pool.bytes, pool.tokens, pool.source
            if pool.tokens:
                row.kv_pool_bytes_predicted = pool.tokens * per_token
                row.kv_pool_sequences_predicted = sequences_in_pool(
                    cfg.engine, pool.tokens, row.prompt_tokens + w.output_tokens, pool.details.get("block_size"))
        # The last sampled token is never fed back, so its K/V never exist: prompt + output - 1 per sequence.
        # Sequences held at once: as many as were in flight, unless the pool holds fewer (the KV boundary).
        held = max(1, min(row.max_in_flight or 1, row.kv_pool_sequences_predicted or 10**9))
        row.kv_tokens_peak_predicted = held * (row.prompt_tokens + w.output_tokens - 1)
        row.kv_bytes_peak_predicted = per_token * row.kv_tokens_peak_predicted
        with httpx.Client(timeout=5.0) as client:
            try:
                peak = backend.kv_peak(client)
            except httpx.HTTPError:
                peak = None
        windows = [(r.t_sent, r.t_done or (r.chunk_times[-1] if r.chunk_times else r.t_sent)) for r in results]
        if peak is None and engine.kv_samples:
            best, row.kv_in_use_source = polled_kv_peak(engine.kv_samples, windows, engine.kv_source)
            if best is not None:
                row.kv_in_use_peak_bytes, row.kv_in_use_peak_tokens = best.kv_bytes_in_use, best.kv_tokens_in_use
        elif peak is not None:
            row.kv_in_use_peak_bytes, row.kv_in_use_peak_tokens, row.kv_in_use_source = peak.bytes, peak.tokens, peak.source
            row.kv_allocator_bytes_peak = peak.details.get("allocator_bytes")
            row.kv_allocator_generate_peak_bytes = peak.details.get("allocator_generate_peak_bytes")
            row.kv_allocator_reserved_delta_bytes = peak.details.get("allocator_reserved_delta_bytes")
        if row.kv_in_use_peak_bytes and row.kv_bytes_peak_predicted:
            row.kv_measured_over_predicted = row.kv_in_use_peak_bytes / row.kv_bytes_peak_predicted

        # the engine's queue: the KV boundary shows as requests waiting or preempted
        if engine.queue_samples:
            (row.requests_waiting_peak, row.requests_running_peak, row.preemptions,
             row.queue_source) = queue_peaks(engine.queue_samples, windows, engine.queue_source)

        # memory timeline (not measured for an attached server: its processes are not ours)
        samples = memory.samples if memory else []
        row.memory_samples = len(samples)
        if samples:
            row.rss_peak_bytes = max(s.rss_bytes for s in samples)
            span = samples[-1].t - samples[0].t
            row.memory_sample_hz = (len(samples) - 1) / span if span > 0 else None
            gpu = [s.gpu_process_bytes for s in samples if s.gpu_process_bytes is not None]
            row.gpu_process_peak_bytes = max(gpu) if gpu else None
            dev = [s.gpu_device_used_bytes for s in samples if s.gpu_device_used_bytes is not None]
            row.gpu_device_peak_bytes = max(dev) if dev else None
            over = [s.gpu_device_over_baseline_bytes for s in samples if s.gpu_device_over_baseline_bytes is not None]
            row.gpu_device_over_baseline_peak_bytes = max(over) if over else None
            row.gpu_device_total_bytes = samples[-1].gpu_device_total_bytes
            row.gpu_device_reserved_bytes = samples[-1].gpu_device_reserved_bytes
            row.gpu_baseline_used_bytes = self.gpu_baseline.used_bytes if self.gpu_baseline else None
        self.writer.write_timeline(row.cell_id, timeline_frame(t0, samples, engine.kv_samples, engine.queue_samples))
        return row


def polls_during(samples, windows: list[tuple[float, float]]) -> int:
    """How many polls (anything with a ``t``) fell inside a request's window (sent to done)."""
    return sum(1 for s in samples if any(start <= s.t <= end for start, end in windows))


def queue_peaks(samples: list[QueueSample], windows: list[tuple[float, float]], source: str | None):
    """(waiting peak, running peak, preemptions, how found) of a cell from the engine's queue polls.
    Peaks of zero from polls of which none fell while a request was in flight are a blind spot, "not
    measured"; the preemption counter is cumulative, so it stays right whenever the polls bracket the cell."""
    waiting = [q.waiting for q in samples if q.waiting is not None]
    running = [q.running for q in samples if q.running is not None]
    preempted = [q.preemptions for q in samples if q.preemptions is not None]
    preemptions = preempted[-1] - preempted[0] if preempted else None
    if windows and not any(running) and not any(waiting) and not polls_during(samples, windows):
        return None, None, preemptions, (f"not measured: none of {len(samples)} polls of {source} fell while "
                                         "a request was in flight")
    return (max(waiting) if waiting else None, max(running) if running else None, preemptions,
            f"max of {len(samples)} polls of {source}")


def polled_kv_peak(samples: list[KVSample], windows: list[tuple[float, float]], source: str | None):
    """The largest polled "KV in use" of a cell and how it was found, or None: when every poll read
    nothing and none of them fell while a request was in flight (a starved poller, a cell shorter than
    the poll period), a zero would be the polls' blind spot, not a measurement."""
    best = max(samples, key=lambda s: s.kv_bytes_in_use or 0)
    if not best.kv_bytes_in_use and windows and not polls_during(samples, windows):
        return None, (f"not measured: none of {len(samples)} polls of {source} fell while a request was in "
                      "flight")
    return best, f"max of {len(samples)} polls of {source}"


def request_row(run_id: str, cid: str, label: str, r: RequestResult, warmup: bool = False,
                repeat: int = 0) -> RequestRow:
    times = RequestTimes.of(r)
    return RequestRow(run_id=run_id, cell_id=cid, backend=label, request_id=r.request_id, warmup=warmup,
                      prompt_tokens_sent=r.prompt_tokens_sent, prompt_tokens_reported=r.prompt_tokens_reported,
                      output_tokens_requested=r.output_tokens_requested, output_tokens_received=times.output_tokens,
                      output_tokens_reported=r.output_tokens_reported, t_sent=r.t_sent, t_done=r.t_done,
                      chunk_times=r.chunk_times, chunk_tokens=r.chunk_tokens, ttft_s=times.ttft, e2e_s=times.e2e,
                      error=r.error, engine_details=r.engine_details, t_scheduled=r.t_scheduled,
                      repeat=repeat)


def timeline_frame(t0: float, memory, kv, queue=()) -> pd.DataFrame:
    """Memory, KV and queue samples on one time axis (seconds since the cell started)."""
    rows = [{"t_s": s.t - t0, "series": "memory", "rss_bytes": s.rss_bytes, "n_processes": s.n_processes,
             "gpu_process_bytes": s.gpu_process_bytes, "gpu_device_used_bytes": s.gpu_device_used_bytes,
             "gpu_device_reserved_bytes": s.gpu_device_reserved_bytes,
             "gpu_device_over_baseline_bytes": s.gpu_device_over_baseline_bytes} for s in memory]
    rows += [{"t_s": s.t - t0, "series": "kv", "kv_bytes_in_use": s.kv_bytes_in_use,
              "kv_tokens_in_use": s.kv_tokens_in_use} for s in kv]
    rows += [{"t_s": s.t - t0, "series": "queue", "requests_waiting": s.waiting, "requests_running": s.running,
              "preemptions": s.preemptions} for s in queue]
    columns = ["t_s", "series", "rss_bytes", "n_processes", "gpu_process_bytes", "gpu_device_used_bytes",
               "gpu_device_reserved_bytes", "gpu_device_over_baseline_bytes", "kv_bytes_in_use", "kv_tokens_in_use", "requests_waiting", "requests_running", "preemptions"]
    return pd.DataFrame(rows, columns=columns).sort_values("t_s")


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:,.1f} MB"


CLIENT_LAG_WARN_S = 0.05  # docs/metrics.md, "Client lag"
ENGINE_EXIT_WAIT_S = 2.0  # how long a cell with failed requests waits to learn whether the engine died


def summary_line(row: CellRow) -> str:
    load = f"x{row.concurrency}" if row.load_profile == "concurrent" else f"{row.load_profile} {row.request_rate:g}/s"
    head = f"{row.backend:<18} prompt {row.prompt_tokens:>6} {load:<8}" + (f" {row.variant}" if row.variant else "")
    if row.status == "failed":
        return f"{head} [red]failed[/]: {row.error}"
    color = "green" if row.status == "ok" else "yellow"
    ratio = f" (x{row.kv_measured_over_predicted:.3f} of predicted)" if row.kv_measured_over_predicted else ""
    queue = f", waiting peak {row.requests_waiting_peak:g}" if row.requests_waiting_peak else ""
    lag = row.client_loop_lag_s_max
    lagged = (f"\n  [yellow]warning[/]: the client's event loop ran up to {lag * 1000:.0f} ms late: its TTFT/ITL "
              "may be late by as much (a CPU shared with the engine or another process)"
              if lag is not None and lag > CLIENT_LAG_WARN_S else "")
    return (f"{head} [{color}]{row.status}[/] TTFT p50 {row.ttft_s_p50:.3f} s, ITL p50 "
            f"{(row.itl_s_p50 or 0) * 1000:.1f} ms, {row.output_tokens_per_s or 0:.1f} out tok/s, "
            f"KV peak {_mb(row.kv_in_use_peak_bytes)}{ratio}, RSS peak {_mb(row.rss_peak_bytes)}{queue}{lagged}")
