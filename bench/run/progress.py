"""What the run shows while it runs: the cells bar with an ETA from the calibrated estimate as soon as there
is one (rich's own needs finished cells inside its 30 s window: with cells of minutes it showed -:--:--
until half the run was done), and a line inside each cell (requests done of N, tokens per second, elapsed).
"""
from __future__ import annotations

import time
from datetime import timedelta

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from kvbench.backends.types import RequestResult


class EstimatedRemainingColumn(TimeRemainingColumn):
    """The time left: from the task's ``eta_at`` (a monotonic deadline the runner sets from the calibrated
    estimate, marked "~") when it has one, else rich's figure from the speed so far."""

    def render(self, task: Task) -> Text:
        eta_at = task.fields.get("eta_at")
        if eta_at is None or task.finished:
            return super().render(task)
        left = max(0, int(eta_at - time.monotonic()))
        return Text(f"~{timedelta(seconds=left)}", style="progress.remaining")


class UnitColumn(ProgressColumn):
    """What the task counts ("cells", "requests")."""

    def render(self, task: Task) -> Text:
        return Text(str(task.fields.get("unit", "")))


def run_progress(console) -> Progress:
    """The run's live display: one task for the cells, one per cell running for its requests."""
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), UnitColumn(),
                    TimeElapsedColumn(), TextColumn("ETA"), EstimatedRemainingColumn(), console=console)


def remaining_s(cell_estimates: list[float], done: int, taken_s: float, others: int) -> float:
    """Seconds left: this engine's remaining cells at their estimates, scaled by how the finished ones
    compared with theirs (``taken_s`` for the first ``done``), and ``others`` cells of engines not calibrated
    yet at this engine's mean per cell (a guess, refined when they calibrate)."""
    if not cell_estimates:
        return 0.0
    estimated_done = sum(cell_estimates[:done])
    scale = taken_s / estimated_done if done and estimated_done > 0 else 1.0
    mean = sum(cell_estimates) / len(cell_estimates)
    return (sum(cell_estimates[done:]) + others * mean) * scale


def set_eta(progress: Progress, bar: TaskID, cell_estimates: list[float], estimate_from: tuple[int, float],
            done: int, cells: int) -> None:
    """Set the bar's ``eta_at`` from an engine session's estimates (of its cells from ``estimate_from``'s
    index on, made at its monotonic time), ``done`` of its ``cells`` finished; the bar's other cells belong
    to engines not calibrated yet. Nothing before an estimate."""
    if not cell_estimates:
        return
    first, since = estimate_from
    task = progress.tasks[bar]
    others = max(0, int(task.total or 0) - int(task.completed) - (cells - done))
    left = remaining_s(cell_estimates, done - first, time.monotonic() - since, others)
    progress.update(bar, eta_at=time.monotonic() + left)


class CellProgress:
    """The line inside one cell: requests done of N, output tokens per second so far, elapsed (rich's
    column). Called by the load generator as each request ends (``LoadSettings.on_done``)."""

    def __init__(self, progress: Progress, label: str, n_requests: int):
        self.progress, self.label, self.t0, self.tokens = progress, label, time.perf_counter(), 0
        self.task: TaskID = progress.add_task(f"  {label}", total=n_requests, unit="requests")

    def __call__(self, result: RequestResult) -> None:
        self.tokens += sum(result.chunk_tokens)
        rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
        self.progress.update(self.task, advance=1, description=f"  {self.label}: {rate:,.1f} tok/s")

    def close(self) -> None:
        self.progress.remove_task(self.task)
