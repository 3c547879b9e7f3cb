"""Capacity planning: will a deployment fit, and what should change if it does not.

A deployment is a model (:mod:`.resolve`: a config.json, a folder, a GGUF, the embedded model, a catalog
name or a hub id), an engine's KV rules (:mod:`kvbench.kv.rules`, each engine's own, or the plain formula),
the per-request limit the server is started with (``max_model_len``, default the model's, RoPE scaling
included) and the typical request of its traffic (``context``) served ``batch`` at once, on ``tp`` GPUs.
:func:`plan` answers with the verdict first (:mod:`.verdict`), a ledger per GPU with each term's source,
and every lever that applies, each planned (:mod:`.levers`). Pure functions over those; refusals are
:class:`PlanError` lines.
"""
from __future__ import annotations

from dataclasses import replace

from kvbench.kv.geometry import UnknownKVDtype, heads_per_rank, kv_bytes_per_token
from kvbench.kv.rules import KVRuleError

from .deploy import Outcome, PlanInput, Setup, setup
from .levers import levers
from .overhead import Overhead, default_overhead, measured_overhead, rule_of_thumb
from .resolve import WEIGHT_DTYPES, ModelForPlan, resolve_model, served_weights
from .shared import (
    CATALOG_DIR,
    GPU,
    GPUS_FILE,
    NODE_GPUS,
    PLAIN,
    PlanError,
    catalog_names,
    engine_rules,
    engines,
    gpu,
    gpu_catalog,
    gpu_memory,
    gpu_of_device,
    gpu_specs,
    model_names,
    parse_bytes,
    parse_float,
    parse_int,
    parse_tokens,
    similar_model,
)
from .decode import moe_view
from .speculative import check_speculation, speculation_view
from .startup import planned_figures, startup_view
from .verdict import asked_first, kv_scope, ledger, lever_line, limit_label, verdict

__all__ = [
    "CATALOG_DIR",
    "GPU",
    "GPUS_FILE",
    "NODE_GPUS",
    "PLAIN",
    "WEIGHT_DTYPES",
    "ModelForPlan",
    "Outcome",
    "Overhead",
    "PlanError",
    "PlanInput",
    "Setup",
    "catalog_names",
    "default_overhead",
    "engine_rules",
    "engines",
    "gpu",
    "gpu_catalog",
    "gpu_memory",
    "gpu_of_device",
    "gpu_specs",
    "kv_scope",
    "ledger",
    "lever_line",
    "levers",
    "limit_label",
    "measured_overhead",
    "model_names",
    "parse_bytes",
    "parse_float",
    "parse_int",
    "parse_tokens",
    "plan",
    "planned_figures",
    "resolve_model",
    "rule_of_thumb",
    "served_weights",
    "setup",
    "similar_model",
    "verdict",
]


def _formula_per_token(geom, typical, tp: int) -> float:
    """The plain formula's bytes per token; for a KV format of the engine's own (transformers' quanto-int4),
    which the formula has no element size for, the engine's rules' figure."""
    try:
        return kv_bytes_per_token(geom, typical.dtype, tp) * tp
    except UnknownKVDtype:
        return typical.bytes_per_token * tp


def plan(p: PlanInput, with_levers: bool = True) -> dict:
    """The plan of ``p`` as one dict (what ``kvbench plan --json`` prints)."""
    s = setup(p)
    check_speculation(s)
    geom, rules = s.geometry, s.rules
    typical = s.typical()
    deploy = s.kv()
    stored = rules.stored(s.question())
    # every GPU's KV together: the whole model's layers and the whole batch on one tensor-parallel group (the
    # pipeline's stages and the data-parallel ranks hold their parts of it; a replicated latent counts on each rank)
    whole = typical if s.pp == s.dp == 1 else rules.answer(replace(s.question(), geometry=geom, batch=s.batch))
    kv_total = whole.bytes_per_gpu * s.tp
    out = {
        "model": p.model.name, "attention": geom.attention, "geometry": geom.describe(), "layers": geom.num_layers,
        "decoder_layers": len(geom.layers),
        "kv_heads": geom.num_kv_heads, "kv_heads_per_gpu": (stored.num_kv_heads if rules.replicated(stored)
                                                         else heads_per_rank(stored.num_kv_heads, s.tp)),
        "head_dim_k": geom.head_dim_k, "head_dim_v": geom.head_dim_v,
        "sliding_window": geom.sliding_window, "sliding_layers": geom.num_sliding_layers,
        "chunk_size": geom.chunk_size, "chunked_layers": geom.count("chunked"),
        "max_context": geom.max_context, "context": s.context, "batch": s.batch, "kv_dtype": typical.dtype,
        "kv_dtype_source": s.kv_dtype_note(), "tp": s.tp, "pp": s.pp, "dp": s.dp, "gpus": s.gpus,
        "engine": p.engine or "exact", "engine_rule": typical.note,
        "notes": list(geom.notes), "verified": p.model.verified, "unread_keys": list(p.model.unread_keys),
        "max_model_len": s.limit, "max_model_len_source": s.limit_source,
        "serving_dtype": rules.serving_dtype(geom, s.capability),
        "serving_dtype_source": rules.serving_note(geom, s.capability),
        # the batch at its typical length (all GPUs, per GPU), as the engine holds it
        "kv_bytes": kv_total, "kv_bytes_per_gpu": typical.bytes_per_gpu, "kv_pool_extra_bytes": typical.pool_extra_bytes,
        "kv_bytes_per_token": kv_total / (s.batch * s.context),
        "kv_bytes_per_token_formula": _formula_per_token(geom, typical, s.tp),
        "kv_bytes_per_token_stored": whole.bytes_per_token * s.tp,
        "kv_scope": kv_scope(s),
        # what the deployment holds per GPU: one request at the limit and the batch at its typical length
        "deployment_kv_bytes_per_gpu": deploy.bytes_per_gpu + deploy.pool_extra_bytes,
        "deployment_rule": deploy.note, "limit_flag": rules.limit_flag(s.limit, s.batch),
        "weights_bytes": s.weights.bytes, "weights_source": s.weights.source, "weights_exact": s.weights.exact,
    }
    if p.shared_prefix:
        try:
            held, how = rules.shared_prefix_bytes(s.question(), p.shared_prefix)
        except KVRuleError as exc:
            raise PlanError(f"--shared-prefix: {exc}") from None
        # KV in use: the pool and the verdict still plan every request at full length (a pool is sized so)
        out["shared_prefix"] = {"tokens": p.shared_prefix, "kv_bytes_per_gpu": held,
                                "kv_bytes_per_gpu_unshared": typical.bytes_per_gpu, "rule": how}
    o = s.outcome()
    out["ledger"] = ledger(s, o, deploy)
    out["verdict"] = verdict(s, o)
    out["startup"] = startup_view(s)
    out["speculation"] = speculation_view(s)
    out["moe"] = moe_view(s.model)
    out.update(asked_first(s, o, typical, out["startup"]))  # the question asked, answered first
    out["levers"] = []
    if s.gpu is None:
        return out
    out.update({"gpu": s.gpu.name, "gpu_memory_bytes": s.gpu.bytes, "gpu_capability": s.gpu.capability,
                "memory_wall": s.gpu.wall, "margin": s.margin, "usable_bytes": s.usable, "overhead_bytes": s.overhead,
                "overhead_fixed_bytes": s.overhead_fixed, "overhead_per_token_bytes": s.overhead_per_token,
                "overhead_source": s.overhead_source, "overhead_rule_of_thumb_bytes": rule_of_thumb(s.gpu.bytes), "kept_free_bytes": s.kept_free,
                "host_memory_bytes": s.host_bytes(), "weights_bytes_per_gpu": s.weights_per_gpu,
                "needed_bytes_per_gpu": o.needed, "fits": o.fits, "headroom_bytes": o.headroom,
                "max_batch": o.max_concurrency, "max_context_at_batch": o.longest_request})
    if s.startup is not None:  # one planner: the engine's own terms, never the margin model's
        out.update(margin=None, overhead_fixed_bytes=None, overhead_per_token_bytes=None,
                   overhead_rule_of_thumb_bytes=None,
                   overhead_source="the engine's own terms at startup (startup.terms)" if s.overhead_default
                   else s.overhead_source)
    if with_levers:
        out["levers"] = levers(s, o)
    return out
