"""Runs a workload on every backend, one cell at a time, and writes results as it goes.

For each backend: install its environment (once), start the server, send warm-up requests, then for
each cell (prompt length x concurrency) sample memory and KV in use while a closed loop of requests runs,
and append the cell's row. Anything that goes wrong with one backend (install, start, crash, timeout)
becomes failed rows with the engine's log tail; the other backends still run; the server is always
stopped, also on Ctrl-C.
"""
from __future__ import annotations

import asyncio
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
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
from bench.loadgen import run_closed_loop
from bench.metrics import RequestTimes, cell_metrics
from bench.results import CellRow, RequestRow, RunWriter
from bench.samplers import NVML, KVPoller, ProcessTreeMemorySampler, tree_rss
from workloads import Workload
from workloads.prompts import PromptBuilder


@dataclass
class RunOptions:
    model: str
    workload: Workload
    backends: list[BackendConfig]
    results_dir: Path = Path("results/runs")
    run_id: str | None = None
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
    gpus = []
    if nvml.available:
        for h in nvml.handles:
            gpus.append({"name": nvml.nv.nvmlDeviceGetName(h), "memory_bytes": nvml.nv.nvmlDeviceGetMemoryInfo(h).total})
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=5).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        commit = None
    from backends.llamacpp import _cpu_model

    return {"kvbench_version": bench.__version__, "kvbench_commit": commit, "python": platform.python_version(),
            "os": platform.platform(), "cpu": _cpu_model(), "cpu_count": os.cpu_count(),
            "memory_bytes": psutil.virtual_memory().total, "gpus": gpus}


class Runner:
    def __init__(self, options: RunOptions, console: Console | None = None):
        self.o = options
        self.console = console or Console()
        self.run_id = options.run_id or new_run_id(options.workload.name)
        self.writer = RunWriter(options.results_dir / self.run_id)
        self.nvml = NVML()
        self.reported_versions: dict[str, str] = {}

    @property
    def run_dir(self) -> Path:
        return self.writer.root

    # --- the whole run ---------------------------------------------------------------------------
    def run(self) -> Path:
        previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt)
        try:
            return self._run()
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _run(self) -> Path:
        o = self.o
        info = {"run_id": self.run_id, "command": " ".join(o.command),
                "started_at": datetime.now(timezone.utc).isoformat(), "status": "running",
                "environment": environment_info(), "workload": o.workload.model_dump(), "kv_dtype": o.kv_dtype,
                "backends": [b.model_dump() | {"label": b.label} for b in o.backends]}
        self.writer.write_run_info(info)
        self.console.print(f"[bold]kvbench run[/] {self.run_id} -> {self.run_dir}")
        try:
            model = self._prepare_model()
        except models.ModelError as exc:
            self.writer.update_run_info(status="failed", error=str(exc))
            raise
        max_context = min(model.geometry.max_context or 2048, o.max_context or 10**9)
        lengths = o.workload.prompt_lengths(max_context)
        skipped = [n for n in o.workload.prompt_tokens if n != "max" and n not in lengths]
        if skipped:
            self.console.print(f"[yellow]prompt lengths {skipped} skipped: longer than the context limit "
                               f"{max_context} minus {o.workload.output_tokens} output tokens[/]")
        if not lengths:
            error = f"no prompt length of {o.workload.name} fits the context limit {max_context}"
            self.writer.update_run_info(status="failed", error=error)
            raise models.ModelError(error)
        cells = [(p, c) for p in lengths for c in o.workload.concurrency]
        self.writer.update_run_info(model={"name": model.name, "sha256": model.sha256,
                                           "gguf": str(model.gguf_path) if model.gguf_path else None,
                                           "hf_dir": str(model.hf_dir), "geometry": asdict(model.geometry),
                                           "max_context": max_context},
                                    skipped_prompt_lengths=skipped, cells=[{"prompt_tokens": p, "concurrency": c} for p, c in cells])
        builder = PromptBuilder(model.hf_dir / "tokenizer.json")
        prompts = {(p, c): [builder.build(p, o.workload.seed, f"p{p}-c{c}-r{i}", o.workload.output_tokens)
                            for i in range(c * o.workload.rounds)] for p, c in cells}
        warmup = [builder.build(o.workload.warmup_prompt_tokens, o.workload.seed, f"warmup-{i}", 8)
                  for i in range(o.workload.warmup_requests)]
        spec = ServerSpec(model=model, max_context=max(lengths) + o.workload.output_tokens,
                          max_concurrency=max(o.workload.concurrency), kv_dtype=o.kv_dtype)
        status = "interrupted"
        columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("cells"),
                   TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
        try:
            with Progress(*columns, console=self.console) as progress:
                task = progress.add_task("cells", total=len(cells) * len(o.backends))
                for cfg in o.backends:
                    self._run_backend(cfg, spec, cells, prompts, warmup, progress, task)
            status = "finished"
        finally:
            self.writer.update_run_info(status=status, finished_at=datetime.now(timezone.utc).isoformat())
        return self.run_dir

    def _prepare_model(self) -> ModelFiles:
        """The model in every format; converting a GGUF (once) needs the hf environment."""
        return models.resolve(self.o.model, lambda: models.converter_python(self.console.print),
                              log=self.console.print)

    # --- one backend -----------------------------------------------------------------------------
    def _run_backend(self, cfg: BackendConfig, spec: ServerSpec, cells, prompts, warmup, progress, task):
        o = self.o
        cls = REGISTRY[cfg.engine]

        def fail_remaining(remaining, error: str, log_tail: str = ""):
            for p, c in remaining:
                self.writer.write_cell(self._empty_row(cfg, spec, p, c, "failed", error, log_tail))
                progress.advance(task)
            self.console.print(f"[red]{cfg.label}: {error}[/]" + (f"\n{log_tail}" if log_tail else ""))

        progress.update(task, description=f"{cfg.label}: installing")
        try:
            env_path = ensure_env(cls.recipe(cfg.version), log=self.console.print)
        except EnvInstallError as exc:
            return fail_remaining(cells, f"install failed: {exc}", exc.log_tail)
        backend = cls(cfg.version, env_path, cfg.options)
        progress.update(task, description=f"{cfg.label}: starting")
        done, started = 0, False
        try:
            backend.start(spec, self.writer.log_path(cfg.label), o.start_timeout_s)
            started = True
            version = backend.reported_version()
            self.reported_versions[cfg.label] = version
            self.writer.update_run_info(engine_versions=self.reported_versions)
            progress.update(task, description=f"{cfg.label}: warm-up")
            if warmup:
                for r in asyncio.run(run_closed_loop(backend, warmup, 1, o.request_timeout_s)):
                    self.writer.write_request(request_row(self.run_id, f"{cfg.label}_warmup", cfg.label, r, warmup=True))
            for p, c in cells:
                if not backend.alive():
                    return fail_remaining(cells[done:], f"engine {backend.exit_description()} during the run",
                                          backend.log_tail())
                progress.update(task, description=f"{cfg.label}: {p} tok x{c}")
                row = self._run_cell(backend, cfg, spec, p, c, prompts[(p, c)], version)
                self.writer.write_cell(row)
                done += 1
                progress.advance(task)
                self.console.print(summary_line(row))
        except (EngineStartError, ValueError) as exc:
            what = "engine failed" if started else "engine failed to start"
            fail_remaining(cells[done:], f"{what}: {exc}", getattr(exc, "log_tail", "") or backend.log_tail())
        finally:
            progress.update(task, description=f"{cfg.label}: stopping")
            backend.stop()

    def _empty_row(self, cfg, spec, p, c, status, error, log_tail) -> CellRow:
        return CellRow(run_id=self.run_id, cell_id=cell_id(cfg.label, p, c), backend=cfg.label, engine=cfg.engine,
                       engine_version=cfg.version, model=spec.model.name, workload=self.o.workload.name,
                       prompt_tokens=p, output_tokens=self.o.workload.output_tokens, concurrency=c,
                       kv_dtype=spec.kv_dtype, status=status, error=error, log_tail=log_tail or None)

    # --- one cell --------------------------------------------------------------------------------
    def _run_cell(self, backend: Backend, cfg, spec, p: int, c: int, prompts, version: str) -> CellRow:
        o = self.o
        row = self._empty_row(cfg, spec, p, c, "ok", None, None)
        row.engine_version_reported = version
        row.n_requests = len(prompts)
        with httpx.Client(timeout=5.0) as client:
            backend.reset_cell(client)
        row.rss_baseline_bytes = tree_rss(backend.pid)[0]
        memory = ProcessTreeMemorySampler(backend.pid, o.memory_hz, self.nvml)
        kv = KVPoller(backend, o.kv_poll_hz)
        t0 = row.t_cell_start = time.perf_counter()
        memory.start()
        kv.start()
        try:
            results = asyncio.run(run_closed_loop(backend, prompts, c, o.request_timeout_s))
        finally:
            memory.stop()
            kv.stop()
        for r in results:
            self.writer.write_request(request_row(self.run_id, row.cell_id, cfg.label, r))

        # token contract: what was sent and asked for against what the engine says it did
        good, flags = [], []
        failed = [r for r in results if r.error]
        for r in results:
            if r.error:
                continue
            received = sum(r.chunk_tokens)
            if r.prompt_tokens_reported != r.prompt_tokens_sent:
                flags.append(f"{r.request_id}: engine read {r.prompt_tokens_reported} prompt tokens, "
                             f"{r.prompt_tokens_sent} sent")
            elif r.output_tokens_reported != r.output_tokens_requested or received != r.output_tokens_requested:
                flags.append(f"{r.request_id}: {r.output_tokens_requested} output tokens asked, engine reported "
                             f"{r.output_tokens_reported}, client received {received}")
            else:
                good.append(r)
        if failed:
            flags.append(f"{len(failed)} of {len(results)} requests failed: {failed[0].error}")
        row.flags = flags
        row.n_ok = len(good)
        row.status = "failed" if not good else ("flagged" if flags else "ok")
        if not good:
            row.error = failed[0].error if failed else "no request met the token contract"
            if not backend.alive():
                row.error = f"engine {backend.exit_description()} during the cell: {row.error}"
            row.log_tail = backend.log_tail() or None
        metrics = cell_metrics([RequestTimes(r.t_sent, tuple(r.chunk_times), tuple(r.chunk_tokens), r.t_done)
                                for r in good], [r.prompt_tokens_sent for r in good])
        for k, v in metrics.items():
            setattr(row, k, v)

        # KV: predicted from the config, the engine's pool, and the peak in use
        row.kv_dtype = backend.kv_dtype_name()
        per_token = kv_bytes_per_token(spec.model.geometry, row.kv_dtype)
        row.kv_bytes_per_token_predicted = per_token
        # The last sampled token is never fed back, so its K/V never exist: prompt + output - 1 per sequence.
        row.kv_tokens_peak_predicted = c * (p + o.workload.output_tokens - 1)
        row.kv_bytes_peak_predicted = per_token * row.kv_tokens_peak_predicted
        pool = backend.kv_pool()
        if pool:
            row.kv_pool_bytes_engine, row.kv_pool_tokens_engine, row.kv_pool_source = pool.bytes, pool.tokens, pool.source
            if pool.tokens:
                row.kv_pool_bytes_predicted = pool.tokens * per_token
        with httpx.Client(timeout=5.0) as client:
            try:
                peak = backend.kv_peak(client)
            except httpx.HTTPError:
                peak = None
        if peak is None and kv.samples:
            best = max(kv.samples, key=lambda s: s.kv_bytes_in_use or 0)
            row.kv_in_use_peak_bytes, row.kv_in_use_peak_tokens = best.kv_bytes_in_use, best.kv_tokens_in_use
            row.kv_in_use_source = f"max of {len(kv.samples)} polls of {kv.source}"
        elif peak is not None:
            row.kv_in_use_peak_bytes, row.kv_in_use_peak_tokens, row.kv_in_use_source = peak.bytes, peak.tokens, peak.source
            row.kv_allocator_bytes_peak = peak.details.get("allocator_bytes")
        if row.kv_in_use_peak_bytes and row.kv_bytes_peak_predicted:
            row.kv_measured_over_predicted = row.kv_in_use_peak_bytes / row.kv_bytes_peak_predicted

        # memory timeline
        samples = memory.samples
        row.memory_samples = len(samples)
        if samples:
            row.rss_peak_bytes = max(s.rss_bytes for s in samples)
            span = samples[-1].t - samples[0].t
            row.memory_sample_hz = (len(samples) - 1) / span if span > 0 else None
            gpu = [s.gpu_process_bytes for s in samples if s.gpu_process_bytes is not None]
            row.gpu_process_peak_bytes = max(gpu) if gpu else None
            dev = [s.gpu_device_used_bytes for s in samples if s.gpu_device_used_bytes is not None]
            row.gpu_device_peak_bytes = max(dev) if dev else None
        self.writer.write_timeline(row.cell_id, timeline_frame(t0, memory.samples, kv.samples))
        return row


def cell_id(label: str, prompt_tokens: int, concurrency: int) -> str:
    return f"{label}_p{prompt_tokens}_c{concurrency}"


def request_row(run_id: str, cid: str, label: str, r: RequestResult, warmup: bool = False) -> RequestRow:
    times = RequestTimes(r.t_sent, tuple(r.chunk_times), tuple(r.chunk_tokens), r.t_done)
    return RequestRow(run_id=run_id, cell_id=cid, backend=label, request_id=r.request_id, warmup=warmup,
                      prompt_tokens_sent=r.prompt_tokens_sent, prompt_tokens_reported=r.prompt_tokens_reported,
                      output_tokens_requested=r.output_tokens_requested, output_tokens_received=times.output_tokens,
                      output_tokens_reported=r.output_tokens_reported, t_sent=r.t_sent, t_done=r.t_done,
                      chunk_times=r.chunk_times, chunk_tokens=r.chunk_tokens, ttft_s=times.ttft, e2e_s=times.e2e,
                      error=r.error, engine_details=r.engine_details)


def timeline_frame(t0: float, memory, kv) -> pd.DataFrame:
    """Memory and KV samples on one time axis (seconds since the cell started)."""
    rows = [{"t_s": s.t - t0, "series": "memory", "rss_bytes": s.rss_bytes, "n_processes": s.n_processes,
             "gpu_process_bytes": s.gpu_process_bytes, "gpu_device_used_bytes": s.gpu_device_used_bytes}
            for s in memory]
    rows += [{"t_s": s.t - t0, "series": "kv", "kv_bytes_in_use": s.kv_bytes_in_use,
              "kv_tokens_in_use": s.kv_tokens_in_use} for s in kv]
    columns = ["t_s", "series", "rss_bytes", "n_processes", "gpu_process_bytes", "gpu_device_used_bytes",
               "kv_bytes_in_use", "kv_tokens_in_use"]
    return pd.DataFrame(rows, columns=columns).sort_values("t_s")


def _mb(x) -> str:
    return "-" if x is None else f"{x / 1e6:,.1f} MB"


def summary_line(row: CellRow) -> str:
    head = f"{row.backend:<18} prompt {row.prompt_tokens:>6} x{row.concurrency:<2}"
    if row.status == "failed":
        return f"{head} [red]failed[/]: {row.error}"
    color = "green" if row.status == "ok" else "yellow"
    ratio = f" (x{row.kv_measured_over_predicted:.3f} of predicted)" if row.kv_measured_over_predicted else ""
    return (f"{head} [{color}]{row.status}[/] TTFT p50 {row.ttft_s_p50:.3f} s, ITL p50 "
            f"{(row.itl_s_p50 or 0) * 1000:.1f} ms, {row.output_tokens_per_s or 0:.1f} out tok/s, "
            f"KV peak {_mb(row.kv_in_use_peak_bytes)}{ratio}, RSS peak {_mb(row.rss_peak_bytes)}")
