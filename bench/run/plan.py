"""Step "plan" of a run: its :class:`~kvbench.run.cells.RunPlan`, made once and carried to the engines.

The plan needs the model's context limit. Where that is known without converting the model (an HF folder,
or a GGUF an earlier run converted), ``kvbench run`` makes the plan before a run folder exists and hands it
to the runner; else the runner makes it once the model is resolved.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from kvbench.common.models import ModelFiles, max_context_known
from kvbench.run.cells import RunPlan, fitting_lengths
from kvbench.run.options import RunOptions


def plan_early(options: RunOptions, model_path: Path) -> RunPlan | None:
    """The plan where the located model's limit is known now; None where it is known only once the model is
    resolved. NothingFits where no prompt length fits (under --max-context, when that is all that is known)."""
    limit = max_context_known(model_path)
    if limit is None:
        if options.max_context:  # nothing fits under the cap: nothing fits under the model's limit either
            fitting_lengths(options.workload, options.max_context)
        return None
    return RunPlan.make(options.workload, limit, options.max_context, options.repeats)


def plan_run(options: RunOptions, model: ModelFiles, carried: RunPlan | None) -> RunPlan:
    """The run's plan: the one made before the run folder, else made now from the resolved model."""
    return carried or RunPlan.make(options.workload, model.geometry.max_context, options.max_context, options.repeats)


def checkpoint_bytes(folder) -> int | None:
    """The HF checkpoint's tensor bytes (its safetensors headers): the weights an engine that loads them as
    stored reads each decode step, where it does not report its own (None: not safetensors)."""
    from kvbench.kv import bounded
    from kvbench.kv.weights import safetensors_bytes
    try:
        return safetensors_bytes(folder) or None
    except (OSError, ValueError, bounded.InputError):
        return None


def routed_experts(folder) -> dict | None:
    """A MoE checkpoint's routed experts as the decode bound reads them (kvbench.planner.decode.moe_view of its
    config: how many, how many a token takes, their share of the weights); None for a dense model, or a config
    the planner cannot read."""
    from kvbench.planner import PlanError, resolve_model
    from kvbench.planner.decode import moe_view
    try:
        return moe_view(resolve_model(str(folder)))
    except (PlanError, OSError, ValueError):
        return None


def plan_record(model: ModelFiles, plan: RunPlan) -> dict:
    """What run.json records of the model and the plan."""
    return dict(model={"name": model.name, "sha256": model.sha256,
                       "gguf": str(model.gguf_path) if model.gguf_path else None,
                       "hf_dir": str(model.hf_dir), "geometry": asdict(model.geometry),
                       "checkpoint_bytes": checkpoint_bytes(model.hf_dir), "moe": routed_experts(model.hf_dir),
                       "max_context": plan.max_context},
                skipped_prompt_lengths=list(plan.skipped), prompt_lengths=list(plan.lengths),
                load_points=[asdict(p) for p in plan.points])


def recorded_model_path(record: dict) -> str | None:
    """The model file or folder a run's record (:func:`plan_record`'s ``model``) names: its GGUF, else its HF folder."""
    return record.get("gguf") or record.get("hf_dir")
