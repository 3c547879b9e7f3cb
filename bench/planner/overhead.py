"""The runtime overhead per GPU a GPU run measured, for ``kvbench plan --overhead-from RUN``."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .shared import PlanError


@dataclass(frozen=True)
class MeasuredOverhead:
    bytes: float  # per GPU
    source: str  # which run, engine, model and cell it came from
    cells: int  # cells that measured it


def measured_overhead(run_dir: str | Path, engine: str | None = None, model: str | None = None) -> MeasuredOverhead:
    """The largest runtime overhead per GPU a run measured (``gpu_overhead_bytes_per_gpu``: NVML's device use
    over the idle baseline on the fullest GPU, minus the weights and the KV pool the engine reported), over
    its ok cells of ``engine`` (and ``model``) where given: the largest, since a plan must hold at every load
    the run measured. A run with no such cell is a PlanError saying why."""
    from kvbench.store.readers import load_cells
    from kvbench.store.schema import OK_STATUSES

    path = Path(run_dir).expanduser()
    if not (path / "cells.jsonl").exists():
        raise PlanError(f"--overhead-from {run_dir}: not a run folder (no cells.jsonl)")
    cells = load_cells(path)
    if cells.empty or "gpu_overhead_bytes_per_gpu" not in cells:
        raise PlanError(f"--overhead-from {run_dir}: the run has no cells")
    measured = cells[cells.status.isin(OK_STATUSES) & cells.gpu_overhead_bytes_per_gpu.notna()]
    if engine:
        measured = measured[measured.engine == engine.lower()]
    if model:
        same = measured[measured.model == model]
        measured = same if not same.empty else measured  # the run's model may be named differently
    if measured.empty:
        raise PlanError(f"--overhead-from {run_dir}: no ok cell{' of ' + engine if engine else ''} measured the "
                        "overhead (a GPU run whose engine reported its weights; CPU runs have none)")
    top = measured.loc[measured.gpu_overhead_bytes_per_gpu.idxmax()]
    mode = f", {top.engine_mode}" if top.get("engine_mode") else ""
    return MeasuredOverhead(float(top.gpu_overhead_bytes_per_gpu),
                            f"measured: {path.name}, {top.backend}{mode}, {top.model}, cell {top.cell_id} "
                            f"(largest of {len(measured)} cells)", len(measured))
