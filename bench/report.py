"""A run as Markdown: a header that lets the table be quoted alone, then one table per question."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from bench.results import load_cells, load_run_info

NOT_MEASURED = "not measured"


def _fmt_bytes(x) -> str:
    if x is None or pd.isna(x):
        return NOT_MEASURED
    return f"{x / 2**20:,.2f} MiB"


def _fmt_s(x, scale=1.0, digits=3) -> str:
    return "-" if x is None or pd.isna(x) else f"{x * scale:,.{digits}f}"


def _fmt_ratio(x) -> str:
    return "-" if x is None or pd.isna(x) else f"{x:.4f}"


def header(info: dict) -> str:
    env = info.get("environment", {})
    model = info.get("model", {})
    gpus = ", ".join(g["name"] for g in env.get("gpus", [])) or "none"
    versions = info.get("engine_versions", {})
    engines = ", ".join(f"{k} ({v})" for k, v in versions.items()) or "-"
    wl = info.get("workload", {})
    return "\n".join([
        f"**Run** `{info['run_id']}` ({info.get('status')}), started {info.get('started_at', '?')}  ",
        f"**Command** `{info.get('command', '?')}`  ",
        f"**Hardware** {env.get('cpu', '?')}, {env.get('cpu_count', '?')} cores, "
        f"{env.get('memory_bytes', 0) / 2**30:.0f} GiB RAM, GPU: {gpus}  ",
        f"**Model** {model.get('name', '?')} (sha256 `{str(model.get('sha256', '?'))[:16]}…`), "
        f"context limit {model.get('max_context', '?')}  ",
        f"**Engines** {engines}  ",
        f"**Workload** {wl.get('name', '?')}: {wl.get('description', '')} (seed {wl.get('seed', '?')})",
    ])


def performance_table(cells: pd.DataFrame) -> str:
    lines = ["| backend | prompt | conc | status | TTFT p50 (s) | TTFT p99 (s) | ITL p50 (ms) | ITL p99 (ms) "
             "| TPOT p50 (ms) | E2E p50 (s) | out tok/s | ok/sent |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in cells.itertuples():
        lines.append(f"| {r.backend} | {r.prompt_tokens} | {r.concurrency} | {r.status} | {_fmt_s(r.ttft_s_p50)} "
                     f"| {_fmt_s(r.ttft_s_p99)} | {_fmt_s(r.itl_s_p50, 1000, 2)} | {_fmt_s(r.itl_s_p99, 1000, 2)} "
                     f"| {_fmt_s(r.tpot_s_p50, 1000, 2)} | {_fmt_s(r.e2e_s_p50)} | {_fmt_s(r.output_tokens_per_s, 1, 1)} "
                     f"| {r.n_ok}/{r.n_requests} |")
    return "\n".join(lines)


def kv_table(cells: pd.DataFrame) -> str:
    lines = ["| backend | prompt | conc | KV dtype | bytes/token (formula) | KV peak predicted | KV peak in use (engine) "
             "| in use / predicted | KV pool (engine) | pool tokens | RSS peak | source of \"in use\" |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in cells.itertuples():
        if r.status in ("failed", "not run"):
            lines.append(f"| {r.backend} | {r.prompt_tokens} | {r.concurrency} | {r.kv_dtype} | {r.status} "
                         "| | | | | | | |")
            continue
        per_token = "-" if pd.isna(r.kv_bytes_per_token_predicted) else f"{r.kv_bytes_per_token_predicted:,.0f}"
        pool_tokens = "-" if pd.isna(r.kv_pool_tokens_engine) else f"{int(r.kv_pool_tokens_engine):,}"
        if not pd.isna(r.kv_pool_bytes_engine):
            pool = _fmt_bytes(r.kv_pool_bytes_engine)
        else:  # the adapter says why (e.g. static batching has no pool), or nothing was reported
            pool = r.kv_pool_source if isinstance(r.kv_pool_source, str) else "not reported"
        lines.append(f"| {r.backend} | {r.prompt_tokens} | {r.concurrency} | {r.kv_dtype} | {per_token} "
                     f"| {_fmt_bytes(r.kv_bytes_peak_predicted)} | {_fmt_bytes(r.kv_in_use_peak_bytes)} "
                     f"| {_fmt_ratio(r.kv_measured_over_predicted)} | {pool} | {pool_tokens} "
                     f"| {_fmt_bytes(r.rss_peak_bytes)} | {r.kv_in_use_source or NOT_MEASURED} |")
    return "\n".join(lines)


def problems(cells: pd.DataFrame) -> str:
    bad = cells[cells.status.isin(["failed", "flagged", "not run"])]
    if bad.empty:
        return "No failed or flagged cells: every request's prompt and output token counts matched the engine's."
    out = []
    for r in bad.itertuples():
        out.append(f"- **{r.cell_id}** {r.status}: {r.error or ''} {'; '.join(r.flags or [])}".rstrip())
        if isinstance(r.log_tail, str) and r.log_tail:
            tail = "\n".join(r.log_tail.splitlines()[-8:])
            out.append("  ```\n  " + tail.replace("\n", "\n  ") + "\n  ```")
    return "\n".join(out)


def validation_section(run_dir: Path) -> list[str]:
    path = run_dir / "kv_validation.jsonl"
    if not path.exists():
        return []
    from bench.validate import markdown

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return ["## The KV model against the engines' own allocations",
            "Predicted by `bench/kvmodel.py` under each engine's rules (`kvbench plan --engine ...`); "
            "engine-reported from the engine's log or metrics; measured from transformers' cache tensors. "
            "`kvbench validate` made this table.", markdown(rows)]


def plots_section(run_dir: Path, cells: pd.DataFrame) -> list[str]:
    """Write the run's PNG plots into RUN_DIR/plots/ and link them (paths relative to report.md)."""
    from bench import plots

    folder = run_dir / "plots"
    folder.mkdir(exist_ok=True)
    out = ["## Plots"]
    if plots.kv_vs_context(cells, folder / "kv_vs_context.png"):
        out.append("![KV in use vs prompt length](plots/kv_vs_context.png)")
    requests_file = run_dir / "requests.jsonl"
    requests = pd.read_json(requests_file, lines=True) if requests_file.exists() else pd.DataFrame()
    if not requests.empty:
        requests = requests[~requests.warmup]
    ok = cells[cells.status.isin(["ok", "flagged"])]
    for _, cell in ok.sort_values(["prompt_tokens", "concurrency"]).groupby("backend").tail(1).iterrows():
        if plots.memory_timeline(run_dir, cell, requests, folder / f"timeline_{cell.cell_id}.png"):
            out.append(f"![memory and KV over {cell.cell_id}](plots/timeline_{cell.cell_id}.png)")
    return out if len(out) > 1 else []


def render(run_dir: str | Path, with_plots: bool = True) -> str:
    run_dir = Path(run_dir)
    info = load_run_info(run_dir)
    cells = load_cells(run_dir)
    if cells.empty:
        return header(info) + "\n\n(no cells finished)\n"
    cells = cells.sort_values(["backend", "prompt_tokens", "concurrency"])
    return "\n\n".join([
        f"# kvbench run {info['run_id']}", header(info),
        "## KV cache: predicted from the config vs reported by the engine",
        "Predicted = 2 x layers x KV heads x head_dim x dtype bytes per token, times concurrency x "
        "(prompt + output - 1) tokens (the last sampled token is never fed back). \"In use\" is each "
        "engine's own figure at the cell's peak: transformers' cache tensors (exact), vLLM's "
        "kv_cache_usage_perc x blocks (block-rounded), llama.cpp's /slots cached tokens x bytes/token. "
        "The pool is what the engine allocated up front (vLLM: its KV budget; llama.cpp: its log line).",
        kv_table(cells),
        "## Latency and throughput",
        "TTFT, ITL, TPOT and E2E as defined in docs/metrics.md (client-side, per streamed chunk).",
        performance_table(cells),
        "## Failed and flagged cells",
        problems(cells),
        *validation_section(run_dir),
        *(plots_section(run_dir, cells) if with_plots else []),
    ]) + "\n"
