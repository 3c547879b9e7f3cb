"""The runtime overhead a plan counts beside the weights and the KV: measured where a run measured it.

- ``--overhead-from RUN``: the largest overhead per GPU a GPU run's cells measured (:func:`measured_overhead`);
- else the table shipped with kvbench (``overheads.toml``), per device kind and engine, calibrated from a
  published run (:func:`overheads_from_trials` on a memory-wall ladder's trials) and checked against it by
  a test;
- else an assumption (1.5 GiB per GPU), saying which run would measure it.

An overhead is a fixed part and, for an engine whose cache and activations grow with the batch (static
batching, ``KVRules.pool_at_start`` false), a part per token in flight (batch x tokens). The seeds' rule of
thumb, 2 GB + 5 % of the device, is set beside it (:func:`rule_of_thumb`).
"""
from __future__ import annotations

import functools
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvbench.kv.units import GIB

from .shared import PlanError

OVERHEADS_FILE = Path(__file__).with_name("overheads.toml")
ASSUMED_GIB = 1.5  # per GPU, where nothing was measured: CUDA context, activations, graphs


@dataclass(frozen=True)
class Overhead:
    """What a plan counts as overhead: ``fixed_bytes`` + ``per_token_bytes`` x tokens in flight."""

    fixed_bytes: float
    per_token_bytes: float = 0.0
    source: str = "assumed"
    measured: bool = False
    model: str = ""  # the model the run measured it on (its activations scale with the model)

    def for_model(self, name: str) -> str:
        """The source, saying so where the planned model is not the one measured."""
        if not self.measured or not self.model or name == self.model:
            return self.source
        return (f"{self.source}; measured on {self.model}, not {name}: its activations and buffers may differ "
                f"(a run of {name} measures them: --overhead-from RUN)")

    def at(self, tokens_in_flight: float) -> float:
        return self.fixed_bytes + self.per_token_bytes * tokens_in_flight


def rule_of_thumb(device_bytes: float) -> float:
    """The seeds' "2 GB + 5 %" of the device, set beside the overhead a plan counts."""
    return 2e9 + 0.05 * device_bytes


def assumed(engine: str | None, device: str) -> Overhead:
    who = engine or "an engine"
    run = f"kvbench run -b {engine}" if engine else "kvbench run -b ENGINE"
    return Overhead(ASSUMED_GIB * GIB, 0.0, f"assumed: {ASSUMED_GIB:g} GiB; no published run measured {who} on a "
                                            f"{device.upper()} ({run} on one measures it: then --overhead-from RUN)")


def shipped_overheads(path: Path = OVERHEADS_FILE) -> dict[tuple[str, str], Overhead]:
    """{(device, engine): Overhead} from the shipped table (read once: every plan and lever asks it)."""
    return dict(_read_overheads(path))


@functools.lru_cache(maxsize=2)
def _read_overheads(path: Path) -> dict[tuple[str, str], Overhead]:
    out = {}
    for device, per_engine in tomllib.loads(path.read_text()).items():
        for engine, e in per_engine.items():
            out[(device, engine)] = Overhead(float(e["fixed_bytes"]), float(e.get("per_token_bytes", 0.0)),
                                             f"measured: {e['source']}", True, e.get("model", ""))
    return out


def default_overhead(engine: str | None, device: str) -> Overhead:
    """The shipped measurement for ``engine`` on ``device`` ("gpu" or "cpu"), else the assumption."""
    found = shipped_overheads().get((device, engine or ""))
    return found if found is not None else assumed(engine, device)


# --- calibration ---------------------------------------------------------------------------------------

def fit(points: list[tuple[float, float]], per_token: bool) -> tuple[float, float]:
    """(fixed, per token) over (tokens in flight, overhead) points: the least-squares slope (>= 0, where
    ``per_token`` and the points have two token counts), and the fixed part that covers every point (an
    upper envelope: a plan must hold at each load measured)."""
    import numpy as np

    tokens = np.array([t for t, _ in points], dtype=float)
    over = np.array([o for _, o in points], dtype=float)
    slope = 0.0
    if per_token and len(set(tokens)) >= 2:
        slope = max(0.0, float(np.polyfit(tokens, over, 1)[0]))
    return float(np.max(over - slope * tokens)), slope


def overheads_from_trials(trials: list[dict], pool_at_start: dict[str, bool], label: str,
                          model: str = "") -> dict[str, Overhead]:
    """Each engine's overhead from a memory-wall ladder's trials, at the engine's smallest wall, over every
    setting that ran clear of the wall (peak below it: nothing reclaimed yet), fitted by :func:`fit`:

    - an engine that allocates its pool at start: the memory it cannot give back after serving (anonymous
      and shared, ``unreclaimable_bytes``) less the KV and the weights, never below 0. Its peak would count
      file pages (libraries, mmapped weights) that the kernel reclaims at a wall instead of killing;
    - an engine whose cache and activations grow with the batch: the peak less the KV and the weights (its
      activations are freed after the batch, so only the peak saw them), per token in flight.

    The larger walls are left out, so that the ladder checks the plan there on figures it was not fitted on."""
    out = {}
    for engine in dict.fromkeys(t["engine"] for t in trials):
        mine = [t for t in trials if t["engine"] == engine]
        at_start = pool_at_start.get(engine, True)
        first = min(t["wall_bytes"] for t in mine)
        measure = "unreclaimable_bytes" if at_start else "peak_bytes"
        clear = [t for t in mine if t["wall_bytes"] == first and t["verdict"] == "ran" and not t["at_the_wall"]
                 and t.get(measure) and t["weights_bytes"] and t["kv_bytes"] is not None]
        if not clear:
            continue
        points = [(t["tokens_in_flight"], max(0.0, t[measure] - t["weights_bytes"] - t["kv_bytes"])) for t in clear]
        fixed, slope = fit(points, not at_start)
        settings = ", ".join(t["setting"] for t in clear)
        what = ("unreclaimable memory after serving" if at_start else "peak in the wall")
        out[engine] = Overhead(fixed, slope, f"{label}: {what} - weights - KV at {settings} under "
                                             f"{first / GIB:.1f} GiB", True, model)
    return out


def measured_overhead(run_dir: str | Path, engine: str | None = None, model: str | None = None) -> Overhead:
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
    return Overhead(float(top.gpu_overhead_bytes_per_gpu), 0.0,
                    f"measured: {path.name}, {top.backend}{mode}, {top.model}, cell {top.cell_id} "
                    f"(largest of {len(measured)} cells)", True, str(top.model))
