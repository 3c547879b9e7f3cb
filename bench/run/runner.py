"""Runs a workload on every backend, one cell at a time, and writes results as it goes.

A run is named steps, each in its own module: resolve (bench/run/resolve.py: the options from the flags,
the model located, then resolved), plan (bench/run/plan.py: the cells, made once and carried), then per
engine start (bench/run/session.py, in order): start or attach (bench/run/start.py), check
(bench/run/check.py), warm up (bench/run/warmup.py), the cells (bench/run/measure.py), stop and record
(bench/run/stop.py); then the report (bench/commands/run.py). This module is the whole run around them:
the run folder and run.json, the order of the engine starts, and Ctrl-C.

Data flows one way: the workload and the model give a :class:`~kvbench.run.cells.RunPlan` (its cells),
each cell measured into a raw :class:`~kvbench.run.rows.CellMeasurement`, which the pure
:func:`~kvbench.run.rows.summarize` turns into the cell's row. Anything that goes wrong with one backend
(install, start, crash, timeout) becomes failed rows with the engine's log tail; the other backends still
run; a server kvbench started is always stopped, also on Ctrl-C.
"""
from __future__ import annotations

import os
import signal
import socket
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console

from kvbench.backends import REGISTRY
from kvbench.backends.types import ServerSpec
from kvbench.common import bandwidth, models
from kvbench.common.hardware import NVML, environment_info, hardware_differences
from kvbench.kv import bounded
from kvbench.load import interrupt, self_probe
from kvbench.load.owner import BARRIER_TIMEOUT_S, LoadOwner, OwnerClient, OwnerError
from kvbench.run import kvquant
from kvbench.run.backend_config import BackendConfig
from kvbench.run.cells import CellPrompts, NothingFits, RunPlan
from kvbench.run.device_bandwidth import gpu_bandwidth
from kvbench.run.prompt_salt import PromptSalt
from kvbench.run.option_fields import declared, recorded
from kvbench.run.options import RunOptions
from kvbench.run.plan import plan_record, plan_run, recorded_model_path
from kvbench.run.progress import run_progress
from kvbench.run.resolve import resolve_model
from kvbench.run.session import EngineSession
from kvbench.store.errors import ResultsWriteError, RunFolderError
from kvbench.store.readers import ensure_parquet, load_cells, load_run_info
from kvbench.store.run_record import RunRecord
from kvbench.store.writer import RunFolderLock, RunWriter, check_same_schema
from kvbench.workloads import Workload
from kvbench.workloads.prompts import PromptBuilder

__all__ = ["Runner", "RunOptions", "new_run_id", "resumable"]

# run.json's opening keys in the order it has always had them; an option recorded later follows them
RUN_JSON_ORDER = ("run_id", "command", "started_at", "status", "environment", "workload", "repeats", "kv_dtype",
                  "backends", "interleaved", "memory_limit_bytes", "prompt_salt", "reset_cache_between_cells")


def new_run_id(workload: str) -> str:
    """Time, workload, host and pid: two runs started in the same second (a CI matrix) get two folders."""
    return f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{workload}-{socket.gethostname()[:12]}-{os.getpid()}"


def resumable(info: dict, o: RunOptions, plan: RunPlan | None = None, environment: dict | None = None) -> None:
    """A resumed run's unfinished cells must measure what its finished ones did: the same workload, backends
    (labels and options), KV dtype, model (path and sha256), --max-context, every other option run.json
    records and the same machine (``environment``: this one's, against the run's), else RunFolderError
    naming what differs with its two values. ``plan``: the plan made before the folder (its context limit,
    for a run that did not record the --max-context asked). The engines themselves (the version each
    reports, its build) are held to the run's when each is checked (bench/run/check.py)."""
    check_same_schema(info, info.get("run_id") or "?")
    differ = []
    try:
        recorded_workload = Workload.model_validate(info.get("workload") or {}).model_dump()
    except ValueError:
        recorded_workload = info.get("workload")
    now = o.workload.model_dump()
    if recorded_workload != now:
        keys = sorted(k for k in now if not isinstance(recorded_workload, dict) or recorded_workload.get(k) != now[k])
        differ.append(f"workload ({', '.join(keys)})")
    before = {b.get("label"): b.get("options", {}) for b in info.get("backends", [])}
    after = {b.label: b.options for b in o.backends}
    if before != after:
        differ.append(f"backends ({', '.join(sorted(before))} then, {', '.join(sorted(after))} now"
                      + (", options differ" if set(before) == set(after) else "") + ")")
    if info.get("kv_dtype", o.kv_dtype) != o.kv_dtype:
        differ.append(f"--kv-dtype ({info['kv_dtype']} then, {o.kv_dtype} now)")
    differ += _model_differs(info.get("model") or {}, o.model, o.needs_weights)
    differ += _context_differs(info, o, plan)
    differ += _options_differ(info, o)
    if environment is not None and isinstance(info.get("environment"), dict):
        if machine := hardware_differences(info["environment"], environment):
            differ.append(f"machine ({'; '.join(machine)}; then vs now)")
    if differ:
        raise RunFolderError(f"--resume: run {info.get('run_id')} was started with another {'; '.join(differ)}: "
                             "resume it as it was started, or start a new run")


# recorded options compared on their own above (or not settings of the measurement: the run's id, its command,
# the salt, which PromptSalt.resumed keeps)
_COMPARED_APART = {"workload", "backends", "kv_dtype", "run_id", "command", "prompt_salt", "max_context_asked"}


def _options_differ(info: dict, o: RunOptions) -> list[str]:
    """The other options run.json records (repeats, interleave, memory wall, cache resets) that differ."""
    out = []
    for name, opt in declared(RunOptions):
        key = opt.record
        if key is None or key in _COMPARED_APART or key not in info:  # not recorded then: nothing to hold it to
            continue
        value = getattr(o, name)
        now = opt.recorded(value, _Resolved(o)) if opt.recorded else value
        if info[key] != now:
            out.append(f"{key} ({_shown(info[key])} then, {_shown(now)} now)")
    return out


class _Resolved:
    """What an option's ``recorded`` reads of the runner (the workload's repeats), before the runner exists."""

    def __init__(self, o: RunOptions):
        self.o = o


def _shown(value) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _model_differs(recorded_model: dict, given: str, weights: bool = True) -> list[str]:
    """The model given now against the one the run recorded: its path (the GGUF, or the HF folder) and sha256.
    Nothing where the run recorded no model yet (stopped before it was resolved)."""
    then_sha, then_path = recorded_model.get("sha256"), recorded_model_path(recorded_model)
    if not then_sha and not then_path:
        return []
    path = models.locate(given, weights)  # located before the folder was opened: cheap, a missing one refused then
    sha = models.sha256_folder(path) if path.is_dir() else models.sha256_file(path)
    same_path = then_path is None or os.path.realpath(then_path) == os.path.realpath(path)
    if same_path and (then_sha is None or then_sha == sha):
        return []
    return [f"model ({then_path} sha256 {(then_sha or 'unrecorded')[:12]} then, {path} sha256 {sha[:12]} now)"]


def _context_differs(info: dict, o: RunOptions, plan: RunPlan | None) -> list[str]:
    """--max-context as asked (runs that record it), else the context limit the run used against this plan's."""
    if "max_context_asked" in info:
        if info["max_context_asked"] != o.max_context:
            return [f"--max-context ({_shown(info['max_context_asked'])} then, {_shown(o.max_context)} now)"]
        return []
    then = (info.get("model") or {}).get("max_context")
    if plan is not None and then is not None and then != plan.max_context:
        return [f"context limit ({then} then, {plan.max_context} now: give the --max-context it was started with)"]
    return []


def open_owner(o: RunOptions) -> tuple[OwnerClient | None, LoadOwner | None]:
    """For ``--load-share I/N``: this process's client of the run's owner, and for share 0 the owner itself
    (serving at ``--load-owner``). OwnerError where share 0 cannot bind there."""
    if o.load_share is None or o.load_owner is None:
        return None, None
    (index, of), (host, port) = o.load_share, o.load_owner
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
    if index != 0:
        return OwnerClient(url, index, of), None
    try:
        server = LoadOwner(host, port, of)
    except OSError as exc:
        raise OwnerError(f"--load-owner {host}:{port}: share 0 cannot serve there: "
                         f"{(exc.strerror or str(exc)).lower()}") from None
    return OwnerClient(url, 0, of, local=server), server


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
    """The run: its folder, run.json and record, and every engine start in order. ``plan``: the plan made
    before the folder existed (bench/run/plan.py), else the run makes it once the model is resolved."""

    def __init__(self, options: RunOptions, console: Console | None = None, plan: RunPlan | None = None):
        self.o = options
        self.console = console or Console()
        self.carried_plan = plan
        self.environment = environment_info()  # recorded in run.json; a resumed run's is held to it
        self.memory_bandwidth: dict | None = None  # probed when the run starts its cells (the decode bound)
        self.client_limit: dict | None = None  # the client's own limit, probed then too (bench/load/self_probe.py)
        self.checkpoint_bytes: int | None = None
        self.moe: dict | None = None  # a MoE model's routed experts (bench/run/plan.py routed_experts)
        self.run_id = options.run_id or new_run_id(options.workload.name)
        # a share of a run on several machines: the owner's clock and barrier (share 0 serves them), before
        # anything is created (a port in use is refused like a bad flag)
        self.owner, self.owner_server = open_owner(options)
        # one live harness per run folder: a second one (same --run-id, a --resume or --overwrite of a run
        # still running) is refused before it touches anything
        try:
            self.lock = RunFolderLock(options.results_dir / self.run_id)
        except BaseException:
            self.close_owner(wait=False)
            raise
        try:
            self._open(options)
        except BaseException:
            self.lock.release()
            self.close_owner(wait=False)
            raise
        self.nvml = NVML()

    def close_owner(self, wait: bool) -> None:
        """This share has finished: it says so to the owner; the owner's own process (share 0) waits for the
        others to finish theirs (``wait``: not when interrupted), then stops serving."""
        if self.owner is None:
            return
        try:
            if wait:
                self.owner.leave()
        except OwnerError as exc:
            self.console.print(f"[yellow]warning:[/] {exc}", soft_wrap=True)
        if self.owner_server is not None:
            if wait and (staying := self.owner_server.wait_for_the_others()):
                self.console.print(f"[yellow]warning:[/] load shares {staying} did not finish within "
                                   f"{BARRIER_TIMEOUT_S:g} s of this one", soft_wrap=True)
            self.owner_server.close()
        self.owner.close()
        self.owner = self.owner_server = None

    def _open(self, options: RunOptions) -> None:
        """The run's writer, and for a resumed run what it finished and recorded, and its salt."""
        # resuming: the run is held to what it was started with before anything in its folder is written
        self.writer = RunWriter(options.results_dir / self.run_id, mode=options.results_mode,
                                check=lambda info: resumable(info, options, self.carried_plan, self.environment))
        self.record = RunRecord()
        # resuming: the cells that have rows already (any status) are kept, not run again
        self.finished: dict[str, float | None] = {}
        self.ended_before: dict | None = None  # resuming: how the run stood before this invocation
        if options.results_mode == "resume":
            before = load_run_info(self.writer.root)
            self.ended_before = {k: before[k] for k in ("status", "finished_at", "error") if k in before}
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
            self.close_owner(wait=not interrupt.stopping())
            if not interrupt.stopping():  # interrupted: the handlers stay, the process is on its way out
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    def run_info(self) -> dict:
        """run.json as the run starts: who and where, and the options' record (bench/run/options.py)."""
        info = recorded(self.o, self) | {"started_at": datetime.now(timezone.utc).isoformat(), "status": "running",
                                         "environment": self.environment}
        return {k: info[k] for k in RUN_JSON_ORDER if k in info} | info

    def _run(self) -> Path:
        o, w = self.o, self.o.workload
        self.writer.write_run_info(self.run_info())
        self.console.print(f"[bold]kvbench run[/] {self.run_id} -> {self.run_dir}")
        # every way out of here says how the run ended in run.json: never left "running" by a refusal
        status, error = "interrupted", None
        try:
            try:
                model = resolve_model(o, self.console)
                plan = plan_run(o, model, self.carried_plan)
                # the tokenizer read within bounds (a FIFO or a link to /dev/zero is one line, not a hang)
                builder = PromptBuilder(model.hf_dir / "tokenizer.json")
            except (models.ModelError, NothingFits, bounded.InputError) as exc:
                status, error = "failed", str(exc)
                raise models.ModelError(str(exc)) from None
            if plan.skipped:
                self.console.print(f"[yellow]prompt lengths {list(plan.skipped)} skipped: they do not fit the "
                                   f"context limit {plan.max_context} with {w.output_tokens} output tokens[/]")
            record = plan_record(model, plan)
            self.checkpoint_bytes, self.moe = record["model"]["checkpoint_bytes"], record["model"]["moe"]
            # the decode bound's denominator (bench/common/bandwidth.py); a resumed run measures it again
            self.memory_bandwidth = bandwidth.run_probe(self.environment,
                                                        lambda: gpu_bandwidth(self.environment, o.backends))
            self.client_limit = self_probe.run_probe()  # before any engine shares the cores
            self.writer.update_run_info(**record, memory_bandwidth=self.memory_bandwidth, client_limit=self.client_limit)
            prompts = CellPrompts(builder, w, self.salt)
            spec = ServerSpec(model=model, max_context=plan.server_context, max_concurrency=plan.server_concurrency,
                              kv_dtype=o.kv_dtype, kv_pool_sequences=w.kv_pool_sequences,
                              memory_limit_bytes=o.memory_limit_bytes, reset_prefix_cache=o.reset_cache_between_cells)
            with run_progress(self.console) as progress:
                self.run_sessions(plan, spec, prompts, progress, model.geometry)
            status = "finished"
        except ResultsWriteError:
            status = "stopped: results folder not writable"
            raise
        except RunFolderError as exc:  # the engine is not the one the run's cells ran on (bench/run/check.py)
            status, error = "refused", str(exc)
            raise
        except Exception as exc:
            if error is None:
                status, error = "failed", f"{type(exc).__name__}: {exc}"
            raise
        finally:
            if self.writer.failed is None:  # else the first error stands alone, not buried under a second
                ended = {"finished_at": datetime.now(timezone.utc).isoformat()}
                ended |= {"error": error} if error is not None else {}
                if status == "refused" and self.ended_before is not None:
                    # a refused resume ran nothing: the run stays as it was, the invocation says why
                    self.writer.update_run_info(**self.ended_before, invocation={"status": status, **ended})
                else:
                    self.writer.update_run_info(status=status, **ended)
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
                        EngineSession(self, cfg, variant, plan, prompts, progress, bar, repeat, kv_variant=kv).run()

    def schedule(self, repeats: int) -> list[tuple[int | None, list[BackendConfig]]]:
        """Which repeat (None: all of them) each round of engine starts runs, and on which backends in order."""
        if not self.o.interleave:
            return [(None, list(self.o.backends))]
        return [(r, list(self.o.backends) if r % 2 == 0 else list(reversed(self.o.backends))) for r in range(repeats)]
