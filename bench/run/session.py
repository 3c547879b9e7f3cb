"""One engine start (or attachment) and the cells it runs, as steps in order: install, start or attach
(bench/run/start.py), check (bench/run/check.py), warm up (bench/run/warmup.py), the cells
(bench/run/measure.py), stop and record (bench/run/stop.py).

The session holds what the steps share (its cells and how many have rows, the engine's baseline and log,
its timeout streak, why it stopped); each step reads and sets it. Every planned cell gets a row: failed
ones with the reason when the engine cannot install, start or keep running.
"""
from __future__ import annotations

import traceback
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
from rich.progress import Progress

from kvbench.backends import REGISTRY, kv_rules
from kvbench.backends.base import Backend
from kvbench.backends.types import EngineStartError, ServerSpec
from kvbench.common.hardware import GPUBaseline
from kvbench.load import TimeoutStreak
from kvbench.run import check, measure, start, stop, warmup
from kvbench.run.backend_config import BackendConfig
from kvbench.run.cells import CellPrompts, RunPlan
from kvbench.run.rows import EngineRun, engine_setup, failed_row
from kvbench.store.errors import ResultsWriteError, RunFolderError

if TYPE_CHECKING:
    from kvbench.run.runner import Runner


class EngineSession:
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
                              memory_bandwidth=runner.memory_bandwidth, checkpoint_bytes=runner.checkpoint_bytes, moe=runner.moe,
                              client_limit=runner.client_limit,
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
            backend = start.make_backend(self, cls)
            if backend is not None and not (self.cfg.url or self.cfg.deployment) \
                    and (refusal := backend.start_refusal(self.spec)):
                return self.fail_remaining(f"not run: {refusal}", status="not run")
            if backend is not None:
                backend.auth_headers = self.cfg.auth_headers()
                self.run_steps(backend)
        except (ResultsWriteError, KeyboardInterrupt, RunFolderError):  # RunFolderError: the run's, not the engine's
            raise
        except Exception as exc:  # noqa: BLE001 - whatever goes wrong with one backend fails that backend only
            self.fail_remaining(f"backend failed: {type(exc).__name__}: {exc}", _traceback_tail(exc))
        finally:
            # this start's share of the bar, whatever ran: failed cells, and sweep rates never found
            self.progress.advance(self.bar, max(0, self.expected - self.done))

    def run_steps(self, backend: Backend) -> None:
        """Start or attach, check, warm up (and calibrate), measure the cells, stop and record: an engine
        that fails at any step fails the cells it has not run, with the reason and its log."""
        started = False
        try:
            start.start_or_attach(self, backend)
            started = True
            check.check(self, backend)
            check.check_startup(self, backend, started=True)
            warmup.warm_up(self, backend)
            measure.measure_cells(self, backend)
        except RunFolderError:  # not this engine's failure: the run is refused (bench/run/check.py)
            raise
        except (EngineStartError, ValueError, httpx.HTTPError) as exc:
            self.fail_engine(backend, exc, started)
        except (ResultsWriteError, KeyboardInterrupt):
            raise
        except Exception as exc:  # noqa: BLE001 - a bug or an engine answer the adapter cannot read
            self.stop_reason = f"backend failed: {type(exc).__name__}: {exc}"
            self.fail_remaining(self.stop_reason, _traceback_tail(exc) + "\n" + backend.log_tail())
        finally:
            stop.stop_and_record(self, backend)

    def fail_engine(self, backend: Backend, exc: Exception, started: bool) -> None:
        """The engine failed to start or during the run (an HTTP error here is one of the harness's own
        calls, e.g. a cell's counter reset): the rest of its cells fail with why, and whether it died."""
        detail = f"{type(exc).__name__}: {exc}" if isinstance(exc, httpx.HTTPError) else str(exc)
        if not started:  # its log may hold the engine's refusal, beside the plan's
            check.check_startup(self, backend, started=False)
        died = backend.exit_description(wait_s=measure.ENGINE_EXIT_WAIT_S) if started else ""
        what = f"engine {died} during the run" if died else ("engine failed" if started else "engine failed to start")
        self.stop_reason = f"{what}: {detail}"
        self.fail_remaining(self.stop_reason, (exc.log_tail if isinstance(exc, EngineStartError) else "")
                            or backend.log_tail())

    def fail_remaining(self, error: str, log_tail: str = "", status: str = "failed", only_next: bool = False,
                       quiet: bool = False) -> None:
        """Failed rows for the cells not run (``only_next``: the next one only), said on the console unless ``quiet``."""
        for cell in self.cells[self.done:self.done + 1 if only_next else None]:
            self.r.writer.write_cell(failed_row(self.info, cell, status, error, log_tail))
            self.done += 1  # one row per cell, however many failures follow
            self.progress.advance(self.bar)
        if not quiet:
            self.r.console.print(f"[red]{self.cfg.label}: {error}[/]" + (f"\n{log_tail}" if log_tail else ""))


def _traceback_tail(exc: BaseException, lines: int = 12) -> str:
    """The last lines of an exception's traceback: where a backend failed, for its failed rows."""
    return "\n".join("".join(traceback.format_exception(exc)).rstrip().splitlines()[-lines:])
