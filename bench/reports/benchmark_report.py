"""``kvbench report RUN --format br``: each cell of a run as an llm-d Benchmark Report (BR v0.2.1).

One report per cell (a stage, in the order the cells ran), built as the ``llmd_benchmark_report`` package's own
pydantic models (``BenchmarkReportV02``) and validated by them, then read back from the YAML text by the
package's loader before it is written. The file name is the one llm-d-benchmark's analysis globs,
``benchmark_report_v0.2,_<cell id>.yaml``. What kvbench did not measure is left out, never filled in:

- ``run``: ``uid`` a UUID5 of the run and cell (the same file every time it is made), ``eid`` the UUID5 of the
  run id (as the package makes it of an experiment id: the stages of one run share it), the cell's own start
  and end (its start in Unix time to its last request's end; left out where the start was not recorded), and
  a description naming the run and the cell.
- ``scenario.stack``: one ``inference_engine`` for the cell's backend (a deployment: its replicas), the
  engine's version as it reported it, the accelerator (the GPU by name, or "none" and count 0 on a CPU), the
  split the engine declares (``Backend.parallelism``), and kvbench's options for it under ``native.args``.
- ``scenario.load``: tool ``kvbench``, its version, the load processes (the cell's ``load_processes``: local
  workers, or the shares ``kvbench merge`` joined), fixed input and output lengths (the
  token contract forces both), the shared prefix, the turns, the concurrency or the rate.
- ``results.request_performance``: the requests that met the token contract, every percentile recomputed
  from requests.jsonl under bench/common/metrics.py's definitions; throughput over the cell's wall time. A
  time series where the cell's start in Unix time was recorded (``t_cell_start_unix``: every cell since
  results schema v8; before, only with --prometheus).
- ``results.observability``: per component, the engine's KV cache usage (fraction of its pool), prefix
  cache hit rate, process memory, running and waiting requests and preemptions, from the cell's timeline;
  and kvbench's own result under the extra key ``kvbench_kv`` (:data:`KV_KEY`): the KV bytes predicted by the
  formula, in use at the peak by the engine's own figure, the pool, and their ratio.
- ``results.component_health``: whether the cell's engine served it (a failed cell: not healthy).
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import shlex
import uuid
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from kvbench.common.files import atomic_write_text, check_output, check_output_folder
from kvbench.common.metrics import RequestTimes, request_verdict
from kvbench.load.common import LOST
from kvbench.store.readers import load_run_info, read_jsonl_rows
from kvbench.store.schema import OK_STATUSES, CellRow, RequestRow, migrate_row

FILE_PREFIX = "benchmark_report_v0.2,_"  # llm-d-benchmark's analysis globs benchmark_report_v0.2,_*.yaml
HEADER = "# kvbench Benchmark Report"  # first line of every file: how kvbench knows its own (outputs it may replace)
KV_KEY = "kvbench_kv"  # results.observability's extra key: kvbench's KV figures (docs/reports.md)
TOOL = "kvbench"
#: The percentiles of a BR Statistics, as its keys name them (p0p1 = 0.1 %).
PERCENTILE_KEYS = {"p0p1": 0.1, "p1": 1, "p5": 5, "p10": 10, "p25": 25, "p50": 50, "p75": 75, "p90": 90, "p95": 95,
                   "p99": 99, "p99p9": 99.9}
NAMESPACE = uuid.uuid5(uuid.NAMESPACE_URL, "kvbench")


def file_name(cell_id: str, repeat: int = 0, repeated: bool = False) -> str:
    """The file of one cell's report (a repeat of a cell whose id names no repeat gets its own)."""
    return f"{FILE_PREFIX}{cell_id}{f'_rep{repeat}' if repeated else ''}.yaml"


def made_by_kvbench(head: bytes) -> bool:
    return head.startswith(HEADER.encode())


def statistics(values, units: str) -> dict | None:
    """A BR ``Statistics`` of ``values`` (None and NaN left out): mean, stddev, min, max and every percentile
    key the schema has (numpy's linear interpolation, as bench/common/metrics.py); None when empty."""
    arr = np.asarray([v for v in values if v is not None and not pd.isna(v)], dtype=float)
    if not arr.size:
        return None
    out = {"units": units, "mean": float(arr.mean()), "stddev": float(arr.std()), "min": float(arr.min()),
           "max": float(arr.max())}
    out.update({key: float(np.percentile(arr, q)) for key, q in PERCENTILE_KEYS.items()})
    return out


def _mean_only(value, units: str) -> dict | None:
    return None if value is None or pd.isna(value) else {"units": units, "mean": float(value)}


def _iso(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, dt.timezone.utc).isoformat()


def config_hash(config) -> str:
    """The package's cfg_id: sha256 of the configuration as canonical JSON (native_to_br0_2.config_hash)."""
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()


def load_processes(info: dict) -> int:
    """The run's load generator processes: run.json's ``load_workers`` where recorded, else the command's
    ``--load-workers`` (absent: the flag's default, 1, which is what every run before the flag had)."""
    if info.get("load_workers"):
        return int(info["load_workers"])
    try:
        words = shlex.split(str(info.get("command") or ""))
    except ValueError:
        words = []
    for i, word in enumerate(words):
        if word == "--load-workers" and i + 1 < len(words) and words[i + 1].isdigit():
            return int(words[i + 1])
        if word.startswith("--load-workers=") and word.split("=", 1)[1].isdigit():
            return int(word.split("=", 1)[1])
    return 1


# --- the sections ----------------------------------------------------------------------------------------

def _backend_entry(info: dict, label: str) -> dict:
    return next((b for b in info.get("backends") or [] if b.get("label") == label), {})


def _stack(info: dict, row: dict) -> tuple[list[dict], str]:
    """scenario.stack: the cell's engine as one inference_engine component; returns it and its label."""
    from kvbench.backends import ENGINES, REGISTRY

    backend = _backend_entry(info, row["backend"])
    options = dict(backend.get("options") or {})
    parallelism = REGISTRY[row["engine"]].parallelism(options) if row["engine"] in ENGINES else {}
    env = info.get("environment") or {}
    gpus = [g for g in env.get("gpus") or [] if isinstance(g, dict) and g.get("name")]
    if gpus and row.get("gpus_used"):
        accelerator = {"model": str(gpus[0]["name"]), "count": int(row["gpus_used"])}
    else:  # the engine ran on the CPU: no accelerator, said as such
        accelerator = {"model": f"none (CPU: {env.get('cpu') or 'not recorded'})", "count": 0}
    accelerator["parallelism"] = parallelism
    native_args = {**options, "kv_dtype": row["kv_dtype"]}
    if row.get("engine_mode"):
        native_args["engine_mode"] = row["engine_mode"]
    if row.get("variant"):
        native_args["variant"] = row["variant"]
    urls = backend.get("urls") or ([backend["url"]] if backend.get("url") else [])
    if urls:
        native_args["urls"] = urls
    label = row["backend"]
    version = row.get("engine_version_reported") or row["engine_version"]
    component = {
        "metadata": {"label": label, "cfg_id": config_hash({"args": native_args}),
                     "description": f"{row['engine']} {version}" + (" (attached)" if row.get("attached") else "")},
        "standardized": {"kind": "inference_engine", "tool": row["engine"], "tool_version": str(version),
                         "role": "replica", "replicas": int(row.get("replicas") or 1),
                         "model": {"name": row["model"]}, "accelerator": accelerator},
        "native": {"args": native_args},
    }
    return [component], label


def _load(info: dict, row: dict, stage: int) -> dict:
    """scenario.load: the workload as the cell ran it."""
    wl = info.get("workload") or {}
    env = info.get("environment") or {}
    version = str(env.get("kvbench_version") or "not recorded")
    if env.get("kvbench_commit"):
        version += f" ({str(env['kvbench_commit'])[:12]})"
    standardized: dict = {
        "tool": TOOL, "tool_version": version,
        "parallelism": int(row["load_processes"]) if _known(row.get("load_processes")) else load_processes(info),
        # synthetic prompts are token ids drawn at random; "prompt_text" workloads sample a real text
        "source": "sampled" if wl.get("prompt_text") else "random",
        "stage": stage,
        "input_seq_len": {"distribution": "fixed", "value": int(row["prompt_tokens"])},
        "output_seq_len": {"distribution": "fixed", "value": int(row["output_tokens"])},
    }
    if wl.get("shared_prefix_tokens"):
        # one prefix shared by every request of the cell
        standardized["prefix"] = {"prefix_len": {"distribution": "fixed", "value": int(wl["shared_prefix_tokens"])},
                                  "num_groups": 1, "num_users_per_group": int(row.get("concurrency") or 1),
                                  "num_prefixes": 1}
    if wl.get("family") == "multi_turn" and wl.get("turns"):
        standardized["multi_turn"] = {"enabled": True,
                                      "max_turns": {"distribution": "fixed", "value": int(wl["turns"])}}
    if row.get("request_rate"):
        standardized["rate_qps"] = float(row["request_rate"])
    elif row.get("concurrency"):
        standardized["concurrency"] = int(row["concurrency"])
    native_config = {"workload": wl, "load_profile": row.get("load_profile"), "concurrency": row.get("concurrency"),
                     "request_rate": row.get("request_rate"), "token_contract": row.get("token_contract"),
                     "prompt_salt": info.get("prompt_salt")}
    return {"metadata": {"cfg_id": config_hash(native_config),
                         "description": f"{wl.get('name', '?')}: {wl.get('description', '')}".strip()},
            "standardized": standardized,
            "native": {"args": {"command": info.get("command")}, "config": native_config}}


def _request_times(requests: list[dict]) -> list[RequestTimes]:
    return [RequestTimes(r["t_sent"], tuple(r["chunk_times"]), tuple(r["chunk_tokens"]), r["t_done"]) for r in requests]


def _good(requests: list[dict]) -> list[dict]:
    """The requests that met the token contract: the only ones in the figures (bench/common/metrics.py)."""
    return [r for r in requests if request_verdict(r["error"], r["prompt_tokens_sent"], r["prompt_tokens_reported"],
                                                   r["output_tokens_requested"], r["output_tokens_reported"],
                                                   sum(r["chunk_tokens"])) == "ok"]


def _known(value) -> bool:
    return value is not None and not pd.isna(value)


def cell_time(row: dict, requests: list[dict]) -> dict:
    """The BR's ``run.time`` of one cell (a stage): from the cell's start to its last request's end, on the
    wall clock; {} where the cell's start in Unix time was not recorded (runs of results schema v7 and
    earlier without --prometheus): the run's own start and end would not be the cell's."""
    to_unix = _unix(row)
    if to_unix is None:
        return {}
    ends = [r["t_done"] if _known(r["t_done"]) else (r["chunk_times"][-1] if len(r["chunk_times"]) else r["t_sent"])
            for r in requests if not (r["error"] or "").startswith(LOST)]
    start = float(row["t_cell_start_unix"])
    end = to_unix(max(ends)) if ends else start
    return {"start": _iso(start), "end": _iso(end), "duration": f"PT{max(0.0, end - start):.3f}S"}


def _unix(row: dict):
    """perf_counter seconds -> Unix seconds for this cell, or None where its start in Unix time is unknown."""
    start, start_unix = row.get("t_cell_start"), row.get("t_cell_start_unix")
    if start is None or start_unix is None or pd.isna(start) or pd.isna(start_unix):
        return None
    return lambda t: start_unix + (t - start)


def _request_performance(row: dict, requests: list[dict]) -> dict:
    good = _good(requests)
    times = _request_times(good)
    aggregate: dict = {"requests": {"total": int(row.get("n_requests") or 0),
                                    "failures": int(row.get("n_failed") or 0),
                                    # answered, but not as asked: fewer prompt tokens read or output tokens made
                                    "incomplete": int(row.get("n_truncated") or 0) + int(row.get("n_short") or 0)}}
    if good:
        aggregate["requests"]["input_length"] = statistics([r["prompt_tokens_sent"] for r in good], "count")
        aggregate["requests"]["output_length"] = statistics([sum(r["chunk_tokens"]) for r in good], "count")
        latency = {"time_to_first_token": statistics([t.ttft for t in times], "s"),
                   "time_per_output_token": statistics([t.tpot for t in times], "s/token"),
                   "inter_token_latency": statistics([s for t in times for s in t.itl_samples()], "s/token"),
                   "request_latency": statistics([t.e2e for t in times], "s")}
        aggregate["latency"] = {k: v for k, v in latency.items() if v is not None}
    output, total, rps = row.get("output_tokens_per_s"), row.get("total_tokens_per_s"), row.get("requests_per_s")
    throughput = {"output_token_rate": _mean_only(output, "tokens/s"),
                  "total_token_rate": _mean_only(total, "tokens/s"),
                  "input_token_rate": _mean_only(None if output is None or total is None else total - output,
                                                 "tokens/s"),
                  "request_rate": _mean_only(rps, "queries/s")}
    if any(throughput.values()):
        aggregate["throughput"] = {k: v for k, v in throughput.items() if v is not None}
    out: dict = {"aggregate": aggregate}
    to_unix = _unix(row)
    if to_unix is not None and good:
        out["time_series"] = _request_series(times, to_unix)
    return out


def _request_series(times: list[RequestTimes], to_unix) -> dict:
    """Each request's TTFT at its first token and its E2E at its end; output tokens per second in 1 s bins."""
    done = [t for t in times if t.chunk_times]
    ttft = [{"ts": _iso(to_unix(t.chunk_times[0])), "value": t.ttft}
            for t in sorted(done, key=lambda t: t.chunk_times[0])]
    e2e = [{"ts": _iso(to_unix(t.t_sent + t.e2e)), "value": t.e2e}
           for t in sorted(done, key=lambda t: t.t_sent + t.e2e)]
    arrivals = [(c, k) for t in done for c, k in zip(t.chunk_times, t.chunk_tokens)]
    first = min(c for c, _ in arrivals)
    bins: dict[int, int] = {}
    for c, k in arrivals:
        bins[int(c - first)] = bins.get(int(c - first), 0) + k
    rate = [{"ts": _iso(to_unix(first + b)), "value": float(bins.get(b, 0))} for b in range(max(bins) + 1)]
    return {"latency": {"time_to_first_token": {"units": "s", "series": ttft},
                        "request_latency": {"units": "s", "series": e2e}},
            "throughput": {"output_token_rate": {"units": "tokens/s", "series": rate}}}


def _timeline(run_dir: Path, cell_id: str) -> pd.DataFrame | None:
    path = run_dir / "timelines" / f"{cell_id}.csv"
    if not path.exists():
        return None
    tl = pd.read_csv(path)
    if "replica" in tl:  # a deployment's totals (replica ""), not each replica's own samples
        tl = tl[tl.replica.astype(object).fillna("") == ""]
    return tl


def _component_observability(run_dir: Path, row: dict, label: str) -> dict:
    """The engine's own figures over the cell (its timeline's polls), as ResourceMetrics (and time series)."""
    tl = _timeline(run_dir, row["cell_id"])
    aggregate: dict = {}
    series: dict = {}
    to_unix = _unix(row)
    pool = row.get("kv_pool_bytes_engine")

    def add(key: str, frame: pd.DataFrame, values: pd.Series, units: str, series_key: str | None = None):
        stats = statistics(values, units)
        if stats is None:
            return
        aggregate[key] = stats
        if to_unix is not None and series_key:
            points = [{"ts": _iso(to_unix(row["t_cell_start"] + t)), "value": float(v)}
                      for t, v in zip(frame.t_s, values) if not pd.isna(v)]
            series[series_key] = {"units": units, "series": points}

    if tl is not None:
        kv = tl[tl.series == "kv"]
        if pool and not pd.isna(pool) and not kv.empty:
            add("kv_cache_usage", kv, kv.kv_bytes_in_use / float(pool), "fraction", "kv_cache_usage")
        queue = tl[tl.series == "queue"]
        if not queue.empty:
            add("running_requests", queue, queue.requests_running, "count", "num_requests_running")
            add("waiting_requests", queue, queue.requests_waiting, "count", "num_requests_waiting")
        memory = tl[tl.series == "memory"]
        if not memory.empty:
            add("cpu_memory_usage", memory, memory.rss_bytes, "bytes", "cpu_memory_usage")
            if "gpu_device_used_bytes" in memory:
                add("gpu_memory_usage", memory, memory.gpu_device_used_bytes, "bytes", "gpu_memory_usage")
    if row.get("preemptions") is not None and not pd.isna(row["preemptions"]):
        aggregate["preemptions"] = {"units": "count", "mean": float(row["preemptions"]),
                                    "max": float(row["preemptions"])}  # during the cell: one counter difference
    if row.get("prefix_cache_hit_rate") is not None and not pd.isna(row["prefix_cache_hit_rate"]):
        aggregate["cache_hit_rate"] = {"units": "fraction", "mean": float(row["prefix_cache_hit_rate"])}
    out: dict = {"component_label": label}
    if aggregate:
        out["aggregate"] = aggregate
    if series:
        out["time_series"] = series
    if tl is not None:
        out["raw_data_path"] = f"timelines/{row['cell_id']}.csv"
    return out


def kv_figures(row: dict) -> dict:
    """kvbench's own result, under results.observability's extra key :data:`KV_KEY`: bytes are bytes."""
    fields = {"bytes_per_token_predicted": "kv_bytes_per_token_predicted",
              "peak_bytes_predicted": "kv_bytes_peak_predicted", "peak_tokens_predicted": "kv_tokens_peak_predicted",
              "peak_bytes_in_use": "kv_in_use_peak_bytes", "peak_tokens_in_use": "kv_in_use_peak_tokens",
              "in_use_over_predicted": "kv_measured_over_predicted", "in_use_source": "kv_in_use_source",
              "pool_bytes": "kv_pool_bytes_engine", "pool_tokens": "kv_pool_tokens_engine",
              "pool_bytes_predicted": "kv_pool_bytes_predicted", "pool_source": "kv_pool_source",
              "pool_sequences_predicted": "kv_pool_sequences_predicted", "running_peak": "requests_running_peak",
              "waiting_peak": "requests_waiting_peak", "kv_dtype": "kv_dtype"}
    out = {"units": "bytes"}
    for key, column in fields.items():
        value = row.get(column)
        if value is not None and not (isinstance(value, float) and pd.isna(value)):
            out[key] = value.item() if hasattr(value, "item") else value
    return out


def _health(row: dict, replicas: list[dict], label: str, logs: Path) -> dict:
    """Whether the engine served the cell: a failed cell is a failed component; a deployment, per replica."""
    if replicas:
        health = [{"replica_id": r["replica"], "healthy": r["status"] != "failed"} for r in replicas]
    else:
        health = [{"replica_id": label, "healthy": row["status"] != "failed"}]
    if logs.exists():
        for h in health:
            h["logs"] = f"logs/{logs.name}"
    return {"component_label": label, "failed_replicas": sum(not h["healthy"] for h in health),
            "replica_health": health}


# --- a run's reports ---------------------------------------------------------------------------------------

def _rows(path: Path, model) -> list[dict]:
    rows, _ = read_jsonl_rows(path) if path.exists() else ([], [])
    return [migrate_row(r, model) for r in rows]


def cell_reports(run_dir: str | Path):
    """Every cell of one run (a deployment's total, its replicas folded in) as (file name, BenchmarkReportV02),
    in the order the cells ran. Cells that never ran ("not run") have no report."""
    from llmd_benchmark_report import BenchmarkReportV02

    run_dir = Path(run_dir)
    info = load_run_info(run_dir)
    cells = _rows(run_dir / "cells.jsonl", CellRow)
    requests: dict[tuple[str, int], list[dict]] = {}
    for r in _rows(run_dir / "requests.jsonl", RequestRow):
        if not r["warmup"]:
            requests.setdefault((r["cell_id"], r["repeat"]), []).append(r)
    totals = [c for c in cells if not c.get("replica") and c["status"] != "not run"]
    ids = [c["cell_id"] for c in totals]
    out = []
    for stage, row in enumerate(totals):
        stack, label = _stack(info, row)
        replicas = [c for c in cells if c.get("replica") and c["cell_id"].startswith(row["cell_id"] + "@")
                    and c["repeat"] == row["repeat"]]
        name = file_name(row["cell_id"], row["repeat"], ids.count(row["cell_id"]) > 1)
        uid = uuid.uuid5(NAMESPACE, f"{info['run_id']}/{row['cell_id']}/{row['repeat']}")
        observability = {"components": [_component_observability(run_dir, row, label)], KV_KEY: kv_figures(row)}
        time = cell_time(row, requests.get((row["cell_id"], row["repeat"]), []))
        data = {
            "run": {"uid": str(uid), "eid": str(uuid.uuid5(uuid.NAMESPACE_URL, info["run_id"])),
                    "description": f"kvbench {info['run_id']} [{row['cell_id']}" +
                                   (f", repeat {row['repeat']}]" if ids.count(row["cell_id"]) > 1 else "]"),
                    **({"time": time} if time else {})},
            "scenario": {"stack": stack, "load": _load(info, row, stage)},
            "results": {"observability": observability,
                        "component_health": [_health(row, replicas, label, run_dir / "logs" / f"{label}.log")]},
        }
        if row["status"] in OK_STATUSES or row.get("n_requests"):
            data["results"]["request_performance"] = _request_performance(
                row, requests.get((row["cell_id"], row["repeat"]), []))
        out.append((name, BenchmarkReportV02.model_validate(data)))
    return out


# PyYAML's libyaml classes where the wheel has them: the package's YAML byte for byte (every published run's
# reports, tests/reports/test_benchmark_report.py), at a third of the time to write and a quarter to read
# (a 1,152-token boundary run's ten reports took 17 s of CPU in pure Python)
DUMPER = getattr(yaml, "CDumper", yaml.Dumper)
SAFE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def render(report) -> str:
    """The file's text: kvbench's header line, then the package's own YAML of the report (its
    ``get_yaml_str``: ``yaml.dump(report.dump(), indent=2)``, emitted by libyaml)."""
    return f"{HEADER} v{report.version} (llmd-benchmark-report), made by kvbench report --format br\n" + \
        yaml.dump(report.dump(), indent=2, Dumper=DUMPER)


def read_back(text: str):
    """The report a file holds, loaded and validated by the package (its version detected from the file)."""
    from llmd_benchmark_report import load_benchmark_report

    return load_benchmark_report(yaml.load(text, Loader=SAFE_LOADER))


def output_folder(run_dir: Path, output: Path | None, many: bool) -> Path:
    """Where a run's reports go: the run folder, or ``output`` (for several runs, one folder per run in it)."""
    if output is None:
        return run_dir
    return output / run_dir.name if many else output


def check_outputs(run_dirs: list[Path], output: Path | None) -> None:
    """Refuse (:class:`kvbench.common.files.OutputRefused`) before anything is written where a report would go through a link or
    over a file kvbench did not write."""
    for run_dir in run_dirs:
        folder = output_folder(run_dir, output, len(run_dirs) > 1)
        existing = {p.name: made_by_kvbench for p in folder.glob(f"{FILE_PREFIX}*.yaml")} if folder.is_dir() else {}
        check_output_folder(folder, "Benchmark Report folder", existing)
        for name in existing:
            check_output(folder / name, made_by_kvbench, "Benchmark Report")


def write(run_dirs: list[Path], output: Path | None = None) -> list[Path]:
    """Every run's reports, each validated (built by the package's models, then its text read back by the
    package's loader) before it is written atomically; returns the files written. Nothing is written for a
    run whose report does not validate (the package's error propagates, a ValueError)."""
    check_outputs(run_dirs, output)
    written = []
    for run_dir in run_dirs:
        folder = output_folder(run_dir, output, len(run_dirs) > 1)
        texts = []
        for name, report in cell_reports(run_dir):
            text = render(report)
            if read_back(text).dump() != report.dump():
                raise ValueError(f"{name}: the report does not read back as written")
            texts.append((folder / name, text))
        folder.mkdir(parents=True, exist_ok=True)
        for path, text in texts:
            check_output(path, made_by_kvbench, "Benchmark Report")
            atomic_write_text(path, text)
            written.append(path)
    return written


__all__ = ["FILE_PREFIX", "KV_KEY", "cell_reports", "check_outputs", "file_name", "read_back",
           "render", "statistics", "write"]
