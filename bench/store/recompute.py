"""``kvbench report --recompute RUN``: rebuild every cell's latency and throughput figures from the raw
chunk times in requests.jsonl under today's definitions (bench/common/metrics.py), and say what changed.

A run's cells.jsonl holds the figures its kvbench computed when it ran; when a definition changes since
(ITL counting the tokens of one socket read as one chunk, TPOT undefined where ITL is), those figures mean
something other than today's. The raw record (every request's send time and chunk arrival times and
token counts) is unchanged, so the figures can be made again:

- each cell's measured requests (not warm-ups, same ``cell_id`` and ``repeat``) that met the token contract
  (:func:`kvbench.common.metrics.request_verdict`) go through :func:`kvbench.common.metrics.cell_metrics` with the cell's
  SLO; the resulting fields replace the row's (cells that failed keep their row);
- the old cells.jsonl is kept as ``cells.jsonl.bak`` (the first one: a second recompute keeps the
  original), the new one replaces it atomically (written beside it, fsynced, renamed), every row migrated
  to the current schema; run.json gets a ``recomputed`` entry (when, which kvbench, what changed); stale
  Parquet copies are rewritten.
"""
from __future__ import annotations

import datetime as dt
import json
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

import kvbench
from kvbench.common.files import atomic_write_text
from kvbench.common.metrics import RequestTimes, cell_metrics, request_verdict
from kvbench.kv import bounded
from kvbench.store.readers import JSONL_MAX_BYTES, load_run_info
from kvbench.store.schema import OK_STATUSES, SCHEMA_VERSION, CellRow, RequestRow, migrate_row

#: the fields of a cell row that :func:`kvbench.common.metrics.cell_metrics` makes
RECOMPUTED_FIELDS = tuple(cell_metrics([], []))
REL_TOL = 1e-9  # figures closer than this (relative) are the same


@dataclass
class Recompute:
    run_dir: Path
    rows: list[dict]  # the new rows (current schema)
    changes: list[dict] = field(default_factory=list)  # {cell_id, repeat, field, old, new}
    warnings: list[str] = field(default_factory=list)
    cells_recomputed: int = 0

    @property
    def changed_cells(self) -> int:
        return len({(c["cell_id"], c["repeat"]) for c in self.changes})


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    data = bounded.read_bytes(path, JSONL_MAX_BYTES, what="")  # a regular file (kvbench.kv.bounded)
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return math.isclose(float(a), float(b), rel_tol=REL_TOL, abs_tol=0.0)


def recompute(run_dir: str | Path) -> Recompute:
    """The run's cells with their figures rebuilt from requests.jsonl (nothing written)."""
    run_dir = Path(run_dir)
    cells = [migrate_row(r, CellRow) for r in _read(run_dir / "cells.jsonl")]
    requests = [migrate_row(r, RequestRow) for r in _read(run_dir / "requests.jsonl")]
    if not requests:
        raise ValueError(f"{run_dir} has no requests.jsonl: nothing to recompute from")
    by_cell: dict[tuple[str, int], list[dict]] = {}
    for r in requests:
        if not r["warmup"]:
            by_cell.setdefault((r["cell_id"], r["repeat"]), []).append(r)
    result = Recompute(run_dir, [])
    for row in cells:
        new = dict(row)
        key = (row["cell_id"], row["repeat"])
        mine = by_cell.get(key, [])
        if row["status"] in OK_STATUSES:
            if not mine:
                result.warnings.append(f"{row['cell_id']} (repeat {row['repeat']}): no requests in requests.jsonl; "
                                       "figures kept")
            else:
                good = [r for r in mine if request_verdict(
                    r["error"], r["prompt_tokens_sent"], r["prompt_tokens_reported"], r["output_tokens_requested"],
                    r["output_tokens_reported"], sum(r["chunk_tokens"])) == "ok"]
                if len(good) != row["n_ok"]:
                    result.warnings.append(f"{row['cell_id']} (repeat {row['repeat']}): {len(good)} requests meet "
                                           f"the token contract today, the row counted {row['n_ok']}")
                figures = cell_metrics([RequestTimes(r["t_sent"], tuple(r["chunk_times"]), tuple(r["chunk_tokens"]),
                                                     r["t_done"]) for r in good],
                                       [r["prompt_tokens_sent"] for r in good], row["slo_ttft_s"], row["slo_tpot_s"])
                result.cells_recomputed += 1
                for name, value in figures.items():
                    if not _same(row.get(name), value):
                        result.changes.append({"cell_id": row["cell_id"], "repeat": row["repeat"], "field": name,
                                               "old": row.get(name), "new": value})
                    new[name] = value
        result.rows.append(CellRow.model_validate(new).model_dump(mode="json"))
    _pool_sequences(run_dir, result)
    return result


def _geometry(info: dict):
    """The model's geometry as run.json records it (asdict of KVGeometry), or None."""
    from kvbench.kv.geometry import KVGeometry, LayerKV, MLAShape

    g = (info.get("model") or {}).get("geometry")
    if not g:
        return None
    if "layers" not in g and "num_layers" in g:  # schema v1's run.json: uniform layers, some sliding
        sliding = g.get("sliding_layers") or [False] * g["num_layers"]
        return KVGeometry(layers=tuple(LayerKV("sliding" if s else "full", g["num_kv_heads"], g["head_dim_k"],
                                               g["head_dim_v"], g.get("sliding_window") if s else None)
                                       for s in sliding), max_context=g.get("max_context"))
    return KVGeometry(layers=tuple(LayerKV(**layer) for layer in g["layers"]),
                      **{k: g.get(k) for k in ("num_attention_heads", "max_context", "model_type", "dtype", "source",
                                                "vocab_size")
                         if g.get(k) is not None},
                      mla=MLAShape(**g["mla"]) if g.get("mla") else None, flags=tuple(g.get("flags") or ()),
                      notes=tuple(g.get("notes") or ()))


def _pool_sequences(run_dir: Path, result: Recompute) -> None:
    """Each cell's ``kv_pool_sequences_predicted`` under today's engine rules, where the engine's own log
    (logs/<backend>.log) states its pool (``Backend.kv_pool_from_log``): the rule that counted llama.cpp's
    pool tokens without its slots (25 sequences on 4 slots) is corrected in published runs so."""
    from kvbench.backends import REGISTRY, kv_rules

    try:
        geometry = _geometry(load_run_info(run_dir))
    except (OSError, ValueError, TypeError, KeyError):  # ResultsReadError and bounded.InputError too
        return
    pools: dict[str, object] = {}
    for row in result.rows:
        engine, label, tokens = row.get("engine"), row.get("backend"), row.get("kv_pool_tokens_engine")
        if geometry is None or engine not in REGISTRY or tokens is None or row.get("status") not in OK_STATUSES:
            continue
        if label not in pools:
            log = run_dir / "logs" / f"{label}.log"
            pools[label] = REGISTRY[engine].kv_pool_from_log(log.read_text(errors="replace")) if log.exists() else None
        pool = pools[label]
        if pool is None or not pool.details:
            continue
        value = kv_rules(engine).sequences_in_pool(geometry, int(tokens), row["prompt_tokens"] + row["output_tokens"] - 1,
                                                   pool.details)
        if value != row.get("kv_pool_sequences_predicted"):
            result.changes.append({"cell_id": row["cell_id"], "repeat": row["repeat"],
                                   "field": "kv_pool_sequences_predicted",
                                   "old": row.get("kv_pool_sequences_predicted"), "new": value})
            row["kv_pool_sequences_predicted"] = value


def changes_frame(result: Recompute) -> pd.DataFrame:
    """Old against new for every figure that differs (times in s, rates per s)."""
    def fmt(v):
        return "undefined" if v is None else f"{v:.6g}"

    def change(old, new):
        if old is None or new is None or old == 0:
            return "-"
        return f"{(new / old - 1) * 100:+.1f}%"

    return pd.DataFrame([{"cell": c["cell_id"], "rep": c["repeat"], "figure": c["field"], "old": fmt(c["old"]),
                          "new": fmt(c["new"]), "change": change(c["old"], c["new"])} for c in result.changes],
                        columns=["cell", "rep", "figure", "old", "new", "change"])


def write(result: Recompute) -> Path | None:
    """Replace cells.jsonl with the recomputed rows (keeping cells.jsonl.bak) and record the recompute in
    run.json; the backup's path, or None when nothing changed (then nothing is written)."""
    run_dir = result.run_dir
    if not result.changes:
        return None
    backup = run_dir / "cells.jsonl.bak"
    if not backup.exists():  # the first recompute keeps the record as the run wrote it
        shutil.copy2(run_dir / "cells.jsonl", backup)
    atomic_write_text(run_dir / "cells.jsonl", "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in result.rows))
    info_path = run_dir / "run.json"
    info = load_run_info(run_dir)
    from kvbench.common.hardware import environment_info  # the commit of the kvbench that recomputed

    info.setdefault("recomputed", []).append({
        "at": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "kvbench_version": kvbench.__version__, "kvbench_commit": environment_info().get("kvbench_commit"),
        "schema_version": SCHEMA_VERSION, "fields": [*RECOMPUTED_FIELDS, "kv_pool_sequences_predicted"],
        "cells_recomputed": result.cells_recomputed, "cells_changed": result.changed_cells,
        "figures_changed": len(result.changes), "backup": backup.name,
        "why": "figures rebuilt from requests.jsonl under the current definitions (docs/metrics.md); the "
               "sequences a pool holds from the engine's log under today's engine rules"})
    atomic_write_text(info_path, json.dumps(info, indent=2) + "\n")
    if (run_dir / "cells.parquet").exists() or (run_dir / "requests.parquet").exists():
        from kvbench.store.readers import write_parquet

        write_parquet(run_dir)
    return backup


def summary(result: Recompute) -> str:
    """What ``kvbench report --recompute`` prints: how many figures changed, then old against new."""
    from kvbench.common.markdown import md_table

    head = (f"recomputed {result.cells_recomputed} cells of {result.run_dir} from requests.jsonl: "
            + (f"{len(result.changes)} figures in {result.changed_cells} cells changed"
               if result.changes else "every figure matches"))
    out = [head, *[f"warning: {w}" for w in result.warnings]]
    if result.changes:
        out.append(md_table(changes_frame(result), {"rep", "old", "new", "change"}))
    return "\n\n".join(out)


def recompute_runs(run_dirs, echo=print) -> int:
    """``kvbench report --recompute``: recompute and rewrite each run, printing what changed; 0, or 2 when a
    run cannot be recomputed (no requests.jsonl), before any is written."""
    results = []
    for run_dir in run_dirs:
        try:
            results.append(recompute(run_dir))
        except (ValueError, OSError) as exc:
            echo(f"error: cannot recompute {run_dir}: {exc}")
            return 2
    for result in results:
        backup = write(result)
        echo(summary(result) + (f"\n\nold record kept as {backup}; run.json records the recompute" if backup else ""))
    return 0
