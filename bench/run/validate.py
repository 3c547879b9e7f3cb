"""The engines' KV rules checked against what the real engines allocate, to the byte where they report bytes.

Two sets of checks, both asked of the engines' adapters (the rules and their measurement are the engine's):

- the embedded model, each engine's own cases (``kv_checks``): llama.cpp's KV buffer for several cache types,
  context sizes and slot counts; vLLM's bytes per block for two dtypes; transformers' cache tensors;
- the validation families (``kv_families.toml``): one small random-weight model per attention family (GQA,
  MQA, MHA, windows on every layer or on a pattern, sinks, chunks, MLA, MoE), built here with transformers,
  converted with llama.cpp's own converter, and measured in every engine that can load it (``measure_kv``):
  one row per family and engine, equal to the engine's allocation within its own rounding, or why not.

Each check is a row: predicted, engine-reported, measured, error %, within the engine's rounding.
"""
from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from kvbench.backends import GGUF_TOOLS_ENGINE, HF_TOOLS_ENGINE, REGISTRY
from kvbench.backends.types import EngineStartError
from kvbench.common.envs import EnvInstallError, ensure_env, env_python, kvbench_home
from kvbench.common.models import HF_FOLDER, ModelFiles
from kvbench.kv import bounded
from kvbench.kv.model_config import ConfigError, geometry_from_hf
from kvbench.kv.rules import KVCheck

FAMILIES_FILE = Path(__file__).with_name("kv_families.toml")


@dataclass(frozen=True)
class Family:
    name: str
    family: str  # the attention family, for people
    shrunk_from: str  # the public model whose config gave the layout
    config: dict


def families(names: list[str] | None = None) -> list[Family]:
    table = tomllib.loads(FAMILIES_FILE.read_text())
    unknown = sorted(set(names or ()) - set(table))
    if unknown:
        raise ValueError(f"unknown validation families {', '.join(unknown)}; known: {', '.join(table)}")
    return [Family(name, t["family"], t["shrunk_from"], t["config"]) for name, t in table.items()
            if not names or name in names]


def _digest(family: Family, tokenizer: bytes) -> str:
    h = hashlib.sha256(json.dumps(family.config, sort_keys=True).encode())
    h.update(tokenizer)
    h.update(REGISTRY[HF_TOOLS_ENGINE].BUILDER.read_bytes())
    return h.hexdigest()[:16]


def prepare(chosen: list[Family], tokenizer_dir: Path, log=print) -> tuple[list[ModelFiles], dict[str, str]]:
    """Build the families' models (once: cached under $KVBENCH_HOME/families/) and their GGUF copies.
    Returns the models (gguf_path None where conversion failed) and, per family, why it could not be built."""
    try:  # a regular file within bounds (a FIFO, a link to /dev/zero: every family says so, nothing hangs)
        tokenizer = bounded.read_bytes(tokenizer_dir / "tokenizer.json", bounded.TOKENIZER_MAX_BYTES, "tokenizer")
    except (bounded.InputError, FileNotFoundError) as exc:
        return [], {f.name: f"not built: {exc}" for f in chosen}
    hf_python = env_python(_env(HF_TOOLS_ENGINE, log))
    root = kvbench_home() / "families"
    folders = {f.name: root / f"{f.name}-{_digest(f, tokenizer)}" / HF_FOLDER for f in chosen}
    errors: dict[str, str] = {}
    missing = [f for f in chosen if not (folders[f.name] / "config.json").exists()]
    if missing:
        log(f"building {len(missing)} validation models ({', '.join(f.name for f in missing)})")
        for folder in folders.values():
            folder.parent.mkdir(parents=True, exist_ok=True)
        results = REGISTRY[HF_TOOLS_ENGINE].build_models(hf_python, tokenizer_dir,
                                         [{"config": f.config, "out": str(folders[f.name])} for f in missing])
        errors |= {f.name: f"not built: {r['error']}" for f, r in zip(missing, results) if "error" in r}
    ggufs = {name: folder.parent / f"{name}.f16.gguf" for name, folder in folders.items()}
    to_convert = [f for f in chosen if f.name not in errors and not ggufs[f.name].exists()]
    convert_errors: dict[str, str] = {}
    if to_convert:
        log(f"converting {len(to_convert)} validation models to GGUF with llama.cpp's converter")
        outcome = REGISTRY[GGUF_TOOLS_ENGINE].gguf_from_hf(hf_python, [(folders[f.name], ggufs[f.name]) for f in to_convert], log)
        convert_errors = {f.name: r for f, r in zip(to_convert, outcome) if r != "ok"}
    models = []
    for f in chosen:
        if f.name in errors:
            continue
        try:
            geometry = geometry_from_hf(folders[f.name])
        except ConfigError as exc:
            errors[f.name] = f"config not read: {exc}"
            continue
        gguf = ggufs[f.name] if ggufs[f.name].exists() and f.name not in convert_errors else None
        models.append(ModelFiles(f.name, folders[f.name], gguf, "", geometry))
        if f.name in convert_errors:
            errors[f.name] = f"no GGUF: llama.cpp's converter said {convert_errors[f.name]}"
    return models, errors


def _env(engine: str, log) -> Path:
    cls = REGISTRY[engine]
    return ensure_env(cls.recipe(cls.default_version), log=log)


def measure_families(envs: dict[str, Path], chosen: list[Family], tokenizer_dir: Path, log_dir: Path,
                     log=print) -> list[dict]:
    """One row per family and engine: the engine's rules against what the engine allocates."""
    log_dir.mkdir(parents=True, exist_ok=True)
    models, errors = prepare(chosen, tokenizer_dir, log)
    by_name = {f.name: f for f in chosen}
    rows = []
    for engine, env in envs.items():
        log(f"measuring {len(models)} validation models in {engine}")
        try:
            checks = REGISTRY[engine].measure_kv(env, models, log_dir)
        except (EngineStartError, RuntimeError, OSError) as exc:
            checks = [KVCheck(engine, "-", "-", None, None, None, 0, f"failed: {exc}", family=m.name) for m in models]
        measured = {c.family for c in checks}
        checks += [KVCheck(engine, "-", "-", None, None, None, 0, errors.get(f.name, "not measured"), family=f.name)
                   for f in chosen if f.name not in measured]
        for c in checks:
            if c.observed is None and c.family in errors and errors[c.family] not in c.note:
                c.note = f"{c.note}; {errors[c.family]}"  # why the engine had nothing to load
            f = by_name[c.family]
            rows.append({**c.row(), "attention": f.family, "shrunk_from": f.shrunk_from})
    order = {f.name: i for i, f in enumerate(chosen)}
    return sorted(rows, key=lambda r: (order[r["family"]], r["engine"]))


def run_all(envs: dict[str, Path], model: ModelFiles, log_dir: Path, log=print) -> list[dict]:
    """Every engine's own cases on the embedded model; an engine that fails becomes one failed row."""
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for engine, env in envs.items():
        log(f"validating the KV rules against {engine}")
        try:
            rows += [c.row() for c in REGISTRY[engine].kv_checks(env, model, log_dir)]
        except (EngineStartError, RuntimeError, OSError, EnvInstallError) as exc:
            rows.append(KVCheck(engine, "all", "-", None, None, None, 0, f"failed: {exc}").row())
    return rows


def _fmt(x) -> str:
    return "-" if x is None else f"{x:,.0f}"


def verdict(row: dict) -> str:
    if row["ok"]:
        return "equal" + (" (within the log's 0.01 MiB)" if row["tolerance"] else "")
    if row["predicted"] is not None and (row["measured"] is not None or row["engine_reported"] is not None):
        return "DIFFERS"
    return "not measured"


def markdown(checks: list[dict]) -> str:
    lines = ["| engine | case | quantity | predicted | engine-reported | measured | error % | within engine rounding |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for c in checks:
        err = "-" if c["error_pct"] is None else f"{c['error_pct']:+.4f}"
        lines.append(f"| {c['engine']} | {c['case']} | {c['quantity']} | {_fmt(c['predicted'])} "
                     f"| {_fmt(c['engine_reported'])} | {_fmt(c['measured'])} | {err} "
                     f"| {'yes' if c['ok'] else 'NO'} {('(' + c['note'] + ')') if c['note'] else ''} |")
    return "\n".join(lines)


def family_markdown(rows: list[dict]) -> str:
    """The family x engine table: one row per family and engine."""
    lines = ["| family | attention | engine | what is compared | plain formula (B) | engine's rules (B) "
             "| engine's own (B) | verdict | note |",
             "|---|---|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        observed = r["measured"] if r["measured"] is not None else r["engine_reported"]
        what = f"{r['quantity']}: {r['case']}" if r["quantity"] != "-" else "-"
        note = str(r["note"]).replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['family']} | {r['attention']} | {r['engine']} | {what} | {_fmt(r.get('formula'))} "
                     f"| {_fmt(r['predicted'])} | {_fmt(observed)} | {verdict(r)} | {note} |")
    return "\n".join(lines)


# --- speculative decoding: a drafter's KV against the engines' (kvbench validate --speculative) ------------------
#: The deployment checked: requests of SPEC_LIMIT tokens; a budget engine gets SPEC_BLOCKS of its blocks with the
#: drafter and half a block more (its floor matters); an engine that allocates for its slots gets SPEC_SLOTS.
SPEC_LIMIT, SPEC_BLOCKS, SPEC_SLOTS = 300, 57, 3


def speculative_engines(engines: list[str]) -> list[str]:
    """Of ``engines``, those whose rules plan a draft model (KVRules.speculative_flag)."""
    from kvbench.kv.speculative import Speculation
    from kvbench.planner import engine_rules

    return [e for e in engines if engine_rules(e).speculative_flag(Speculation("draft")) is not None]


def _spec_plan(engine: str, model: ModelFiles, speculative: str | None, budget: float | None = None):
    """The deployment as ``kvbench plan`` asks it: the embedded model drafting for itself (its HF folder for an
    engine serving folders, its own GGUF for one serving GGUFs), weights and overheads 0, on a GPU of exactly the
    KV budget the engine is given."""
    from kvbench.kv.units import GIB
    from kvbench.planner import PlanInput, engine_rules, resolve_model

    rules = engine_rules(engine)
    path = str(model.gguf_path if rules.model_format == "gguf" else model.hf_dir)
    target = resolve_model(str(model.hf_dir), weights_bytes=0)
    draft = resolve_model(path, weights_bytes=0) if speculative else None
    size = {"gpu": f"{budget / GIB!r}GiB"} if budget is not None else {}
    return PlanInput(target, overhead_gib=0, overhead_source="none", margin=0, engine=engine, device="cpu",
                     kv_dtype="auto" if rules.model_format == "gguf" else "bf16", max_model_len=SPEC_LIMIT,
                     batch=1 if rules.pool_from_budget else SPEC_SLOTS, speculative=speculative, draft_model=draft,
                     draft_label=path if draft else "", **size)


def _started(engine: str, env: Path, options: dict, model: ModelFiles, slots: int, kv_dtype: str, log: Path):
    """The pool the engine reports once started, and its log's text; the server stopped after."""
    from kvbench.backends.types import ServerSpec

    cls = REGISTRY[engine]
    backend = cls(cls.default_version, env, options)
    try:
        backend.start(ServerSpec(model=model, max_context=SPEC_LIMIT, max_concurrency=slots, kv_dtype=kv_dtype),
                      log, 300)
        return backend.kv_pool(), log.read_text(errors="replace")
    finally:
        backend.stop()


def speculative_checks(engine: str, env: Path, model: ModelFiles, log_dir: Path, without: bool = True) -> list[KVCheck]:
    """The drafter's KV as the engine allocates it, the embedded model drafting for itself: an engine that sizes a
    pool from a budget (its rules' pool_from_budget) by the pool's tokens with the drafter (and, ``without``,
    without it) on the same budget; one that allocates for its slots by the draft context's logged KV buffer
    (llama-server's llama_kv_cache lines: the target's caches, then the draft's)."""
    from kvbench.backends.shared.llama_log import parse_kv_log
    from kvbench.planner import setup
    from kvbench.planner.capacity import capacity

    log_dir.mkdir(parents=True, exist_ok=True)
    p = _spec_plan(engine, model, "draft")
    s = setup(p)
    rows = []
    if s.rules.pool_from_budget:
        per_block = s.bytes_per_block(s.question(context=SPEC_LIMIT, batch=1))
        budget = int(SPEC_BLOCKS * per_block + per_block // 2)
        for spec in ("draft", None) if without else ("draft",):
            planned = capacity(setup(_spec_plan(engine, model, spec, budget)))
            options = {"kv_cache_memory_bytes": budget, "single_process": True, "speculative": spec or "none"}
            pool, _ = _started(engine, env, options, model, 1, "bf16", log_dir / f"{engine}-{spec or 'none'}.log")
            rows.append(KVCheck(engine, f"{'with a draft (the model itself)' if spec else 'without a drafter'}, "
                                f"KV budget {budget:,} B, limit {SPEC_LIMIT}", "pool tokens", planned.pool_tokens,
                                pool.tokens if pool else None, None, 0,
                                "" if pool else "no pool reported"))
        return rows
    d = s.draft(context=SPEC_LIMIT, batch=SPEC_SLOTS, limit=SPEC_LIMIT)
    _, text = _started(engine, env, {"speculative": "draft"}, model, SPEC_SLOTS, "f16", log_dir / f"{engine}-draft.log")
    caches = parse_kv_log(text)
    windowed = any(layer.kind != "full" for layer in s.rules.stored(s.question()).kv_layers)
    drafted = caches[-(2 if windowed else 1):] if len(caches) >= 2 else []
    logged = sum(c["mib"] for c in drafted) * 2**20 if drafted else None
    rows.append(KVCheck(engine, f"draft context (the model's own GGUF), {SPEC_SLOTS} slots x {SPEC_LIMIT}",
                        "draft KV buffer bytes", d.bytes_per_gpu, logged, None, 0.01 * 2**20 * max(1, len(drafted)),
                        "" if drafted else f"no draft llama_kv_cache line ({len(caches)} cache lines)"))
    return rows
