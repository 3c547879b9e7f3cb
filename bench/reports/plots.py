"""PNG plots of one or more runs (matplotlib, Agg: no display needed). Each function takes the tidy
cells (repeats averaged by ``tables.aggregate``, with a ``label`` column naming the series) and writes one
PNG, or returns None when the runs hold nothing to plot. :func:`report_figures` makes every plot of a
report and says which section's table each one illustrates; every series keeps one colour
(:func:`palette`) in every plot of the report."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from kvbench.kv.units import MIB  # noqa: E402

from .tables import load_label, sequences_fitting  # noqa: E402

MARKERS = "osd^v<>PX*"
DPI = 110
COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:olive",
          "tab:cyan", "tab:gray")
# the sections a plot can illustrate, by their ids (bench/reports/__init__.py)
KV_SECTION, PERF_SECTION, BOUNDARY_SECTION = "kv", "performance", "boundary"
DECODE_BOUND_SECTION = "decode_bound"  # bench/reports/bandwidth.py's section

_palette: dict[str, str] = {}


def palette(labels) -> dict[str, str]:
    """One colour per series label (an engine and version, e.g. vllm-0.32.0), in sorted order, used by every
    plot made after this call; labels not in it get the next free colours."""
    global _palette
    _palette = {label: COLORS[i % len(COLORS)] for i, label in enumerate(sorted(set(labels)))}
    return dict(_palette)


def color(label: str) -> str:
    if label not in _palette:
        _palette[label] = COLORS[len(_palette) % len(COLORS)]
    return _palette[label]


def _save(fig, out: Path) -> Path:
    # the bounding box grows to hold every title, label and legend: nothing is clipped
    fig.savefig(out, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return out


def kv_vs_context(cells: pd.DataFrame, out: Path) -> Path | None:
    """KV in use at the peak per engine against prompt length, with the formula's prediction."""
    done = cells[cells.kv_in_use_peak_bytes.notna()]
    if done.empty:
        return None
    levels = sorted(done.concurrency.dropna().unique())
    if not levels:
        return None
    fig, axes = plt.subplots(1, len(levels), figsize=(5.5 * len(levels), 4.2), squeeze=False, layout="constrained")
    for ax, c in zip(axes[0], levels):
        part = done[done.concurrency == c]
        predicted = part.drop_duplicates("prompt_tokens").sort_values("prompt_tokens")
        ax.plot(predicted.prompt_tokens, predicted.kv_bytes_peak_predicted / MIB, "k--", lw=1.5,
                label="predicted (formula)")
        for (label, group), marker in zip(part.groupby("label"), MARKERS * 4):
            group = group.sort_values("prompt_tokens")
            ax.plot(group.prompt_tokens, group.kv_in_use_peak_bytes / MIB, marker=marker, ls="", ms=7,
                    color=color(label), label=f"{label}: in use (engine)")
            # the pool the engine allocated up front (what runs out of memory), beside what it used
            pooled = group[group.kv_pool_bytes_engine.notna()]
            if not pooled.empty:
                ax.plot(pooled.prompt_tokens, pooled.kv_pool_bytes_engine / MIB, ls=":", lw=1.5, marker=marker,
                        ms=4, mfc="none", color=color(label), label=f"{label}: pool allocated (engine)")
        ax.set(title=f"concurrency {int(c)}", xlabel="prompt tokens", ylabel="KV (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("KV cache: in use at the peak and the pool allocated (engine) vs predicted in use")
    return _save(fig, out)


def cell_words(cell) -> str:
    """The cell once (its id repeats the backend label): prompt, load and repeat."""
    repeat = cell.get("repeat")
    return f"prompt {int(cell.prompt_tokens)}, {load_label(cell)}" + (f", repeat {int(repeat) + 1}"
                                                                      if pd.notna(repeat) and repeat else "")


def memory_timeline(run_dir: Path, cell: pd.Series, requests: pd.DataFrame, out: Path) -> Path | None:
    """Process-tree memory and the engine's KV in use over one cell on one time axis, with each request's
    span shaded and its start and end marked."""
    cell_id = cell.cell_id
    path = Path(run_dir) / "timelines" / f"{cell_id}.csv"
    if not path.exists():
        return None
    tl = pd.read_csv(path)
    # a deployment's timeline has each replica's KV beside the total (replica "": the total, or one server)
    replica = tl.replica.astype(object).fillna("") if "replica" in tl else pd.Series("", index=tl.index)
    mem, kv = tl[tl.series == "memory"], tl[(tl.series == "kv") & (replica == "")]
    per_replica = tl[(tl.series == "kv") & (replica != "")]
    if mem.empty and kv.empty:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.2), layout="constrained")
    if not mem.empty and mem.rss_bytes.notna().any():
        ax.plot(mem.t_s, mem.rss_bytes / MIB, color="tab:blue", label="engine process tree RSS")
    if "gpu_process_bytes" in mem and mem.gpu_process_bytes.notna().any():
        ax.plot(mem.t_s, mem.gpu_process_bytes / MIB, color="tab:purple", label="engine GPU memory")
    ax.set(xlabel="seconds since the cell started", ylabel="memory (MiB)", title=f"{cell.label}: {cell_words(cell)}")
    ax2 = ax.twinx()
    ax2.plot(kv.t_s, kv.kv_bytes_in_use / MIB, color="tab:red", label="KV in use (engine)")
    for name, part in per_replica.groupby(replica[per_replica.index]):
        ax2.plot(part.t_s, part.kv_bytes_in_use / MIB, linestyle="--", lw=1, label=f"KV in use, replica {name}")
    ax2.set_ylabel("KV in use (MiB)")
    reqs = requests[(requests.cell_id == cell_id) & (requests.run_id == cell.run_id)] if not requests.empty else requests
    if "repeat" in reqs and not reqs.empty:
        reqs = reqs[reqs.repeat == reqs.repeat.min()]
    if not reqs.empty and pd.notna(cell.t_cell_start):  # each request's span, on the cell's time axis
        starts = reqs.t_sent - cell.t_cell_start
        ends = reqs.t_done.fillna(reqs.t_sent) - cell.t_cell_start
        for s, e in zip(starts, ends):
            ax.axvspan(s, e, color="grey", alpha=0.08)
        ax.vlines(starts, 0, 0.06, transform=ax.get_xaxis_transform(), color="tab:green", lw=1.5,
                  label="request start")
        ax.vlines(ends, 0, 0.06, transform=ax.get_xaxis_transform(), color="black", lw=1.5, label="request end")
    lines, labels = ax.get_legend_handles_labels()
    lines2, labels2 = ax2.get_legend_handles_labels()
    ax.legend(lines + lines2, labels + labels2, loc="upper left", fontsize=8)
    return _save(fig, out)


def throughput_ttft_vs_concurrency(cells: pd.DataFrame, out: Path) -> Path | None:
    """Output tokens/s (top) and TTFT p50 (bottom) against concurrency, one column per prompt length,
    one line per engine (closed-loop cells)."""
    # closed-loop cells: the ones without a request rate
    done = cells[cells.request_rate.isna() & cells.output_tokens_per_s.notna() & cells.concurrency.notna()]
    if done.empty:
        return None
    lengths = sorted(done.prompt_tokens.unique())
    fig, axes = plt.subplots(2, len(lengths), figsize=(4.2 * len(lengths), 6.8), squeeze=False, sharex=True,
                             layout="constrained")
    for j, p in enumerate(lengths):
        part = done[done.prompt_tokens == p]
        for (label, group), marker in zip(part.groupby("label"), MARKERS * 4):
            group = group.sort_values("concurrency")
            axes[0][j].plot(group.concurrency, group.output_tokens_per_s, marker=marker, color=color(label),
                            label=label)
            axes[1][j].plot(group.concurrency, group.ttft_s_p50, marker=marker, color=color(label), label=label)
        axes[0][j].set(title=f"prompt {p} tokens", ylabel="output tokens/s" if j == 0 else None)
        axes[1][j].set(xlabel="concurrency", ylabel="TTFT p50 (s)" if j == 0 else None)
        levels = sorted(part.concurrency.unique())
        for row in (0, 1):
            axes[row][j].set_xticks(levels)
            axes[row][j].grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("Throughput and time to first token against concurrency")
    return _save(fig, out)


def kv_boundary(cells: pd.DataFrame, out: Path) -> Path | None:
    """The KV boundary. Where the engine's queue was polled (schema v2): per engine and prompt length,
    requests running at once and waiting (engine peaks) against the concurrency asked, with the
    predicted number of sequences the pool holds as a line. Otherwise: how many sequences fit the pool
    against the context length, and each cell's concurrency on it (filled: within, hollow: beyond)."""
    pooled = cells[cells.kv_pool_tokens_engine.notna() & cells.concurrency.notna()]
    if pooled.empty:
        return None
    if "requests_running_peak" in pooled and pooled.requests_running_peak.notna().any():
        return _kv_boundary_measured(pooled[pooled.requests_running_peak.notna()], out)
    # a panel per engine only where it has more than one cell: one point shows no boundary
    labels = [label for label, n in pooled.groupby("label").size().items() if n > 1]
    if not labels:
        return None
    fig, axes = plt.subplots(1, len(labels), figsize=(5.2 * len(labels), 4.2), squeeze=False, layout="constrained")
    for ax, label in zip(axes[0], labels):
        part = pooled[pooled.label == label]
        pool = part.kv_pool_tokens_engine.max()
        context = part.prompt_tokens + part.output_tokens - 1
        lo, hi = max(1, int(context.min() * 0.5)), int(context.max() * 1.3)
        xs = list(range(lo, hi + 1, max(1, (hi - lo) // 200)))
        ax.plot(xs, [pool / x for x in xs], color="k", label=f"boundary: pool of {int(pool):,} tokens / context")
        # within the pool by the boundary table's rule (the KV model's engine rule where the row has it)
        fits = part.concurrency <= pd.Series([sequences_fitting(r) for r in part.itertuples()], index=part.index,
                                             dtype=float)
        ax.scatter(context[fits], part.concurrency[fits], color=color(label), zorder=3, label="cell within the pool")
        if (~fits).any():
            ax.scatter(context[~fits], part.concurrency[~fits], facecolors="none", edgecolors=color(label), zorder=3,
                       label="cell beyond the pool")
        ax.set(title=label, xlabel="context per sequence (prompt + output - 1 tokens)",
               ylabel="concurrent sequences", yscale="log", xscale="log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("The KV boundary: sequences that fit the engine's KV pool")
    return _save(fig, out)


def _kv_boundary_measured(cells: pd.DataFrame, out: Path) -> Path | None:
    labels = [label for label, part in cells.groupby("label") if part.concurrency.nunique() > 1]
    if not labels:
        return None
    fig, axes = plt.subplots(1, len(labels), figsize=(5.2 * len(labels), 4.2), squeeze=False, layout="constrained")
    for ax, label in zip(axes[0], labels):
        part = cells[cells.label == label]
        for prompt, group in part.groupby("prompt_tokens"):
            if group.concurrency.nunique() < 2:
                continue
            group = group.groupby("concurrency", as_index=False)[
                ["requests_running_peak", "requests_waiting_peak", "kv_pool_sequences_predicted"]].mean()
            one = part.prompt_tokens.nunique() == 1  # the engine's colour, unless prompt lengths need their own
            (line,) = ax.plot(group.concurrency, group.requests_running_peak, marker="o",
                              color=color(label) if one else None, label=f"running at once ({prompt} tok)")
            ax.plot(group.concurrency, group.requests_waiting_peak, marker="x", linestyle="--", color=line.get_color(),
                    alpha=0.6, label=f"waiting ({prompt} tok)")
            predicted = group.kv_pool_sequences_predicted.dropna()
            if not predicted.empty:
                ax.axhline(predicted.iloc[0], color=line.get_color(), linewidth=1.5, alpha=0.5,
                           label=f"pool holds {int(predicted.iloc[0])} of {prompt} tok (KV model)")
        top = max(part.concurrency.max(), part.requests_running_peak.max(), part.requests_waiting_peak.fillna(0).max(),
                  part.kv_pool_sequences_predicted.fillna(0).max())
        ax.plot([0, top], [0, top], color="grey", linewidth=0.6, linestyle=":", label="running = concurrency")
        ax.set(title=label, xlabel="concurrency asked (client)", ylabel="requests (engine's peak, 10 Hz polls)",
               xlim=(0, top + 0.5), ylim=(0, top + 0.5))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("The KV boundary: what the engine ran and queued against what its KV pool holds")
    return _save(fig, out)


def kv_ratio_vs_context(cells: pd.DataFrame, out: Path) -> Path | None:
    """KV in use / predicted per engine against the context per sequence: the engine's own rounding (vLLM's
    whole blocks: about 6 % more at 1K tokens, nothing at 8K) that the bytes plot cannot show."""
    done = cells[cells.kv_measured_over_predicted.notna() & cells.prompt_tokens.notna()]
    if done.empty:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.2), layout="constrained")
    ax.axhline(1.0, color="k", ls="--", lw=1.2, label="predicted (formula) = 1")
    for label, part in done.groupby("label"):
        for (conc, group), marker in zip(part.groupby("concurrency", dropna=False), MARKERS * 4):
            group = group.sort_values("prompt_tokens")
            context = group.prompt_tokens + group.output_tokens - 1
            ax.plot(context, group.kv_measured_over_predicted, marker=marker, ms=7, color=color(label),
                    label=f"{label}, concurrency {'-' if pd.isna(conc) else int(conc)}")
    ax.set_xscale("log", base=2)
    ax.set(xlabel="context per sequence (prompt + output - 1 tokens)", ylabel="KV in use / predicted",
           title="KV in use against the formula's prediction, per engine")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    return _save(fig, out)


def latency_throughput(cells: pd.DataFrame, out: Path) -> Path | None:
    """TTFT p50 and E2E p50 against output tokens/s over the load points (concurrency or request rate) of
    each engine and prompt length: where more load stops buying throughput and only adds latency."""
    done = cells[cells.output_tokens_per_s.notna() & cells.ttft_s_p50.notna()]
    load = done.concurrency.fillna(0).astype(float) + done.request_rate.fillna(0).astype(float)
    done = done.assign(_load=load)
    series = [(k, g) for k, g in done.groupby(["label", "prompt_tokens"]) if g._load.nunique() > 1]
    if not series:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), squeeze=False, layout="constrained")
    styles = {p: ls for p, ls in zip(sorted(done.prompt_tokens.unique()), ["-", "--", ":", "-."] * 8)}
    for (label, prompt), group in series:
        group = group.sort_values("_load")
        for ax, metric in zip(axes[0], ("ttft_s_p50", "e2e_s_p50")):
            ax.plot(group.output_tokens_per_s, group[metric], marker="o", ls=styles[prompt], color=color(label),
                    label=f"{label}, prompt {int(prompt)}")
            for x, y, n in zip(group.output_tokens_per_s, group[metric], group._load):
                ax.annotate(f"{n:g}", (x, y), textcoords="offset points", xytext=(4, 3), fontsize=6)
    axes[0][0].set(xlabel="output tokens/s", ylabel="TTFT p50 (s)", yscale="log", title="TTFT against throughput")
    axes[0][1].set(xlabel="output tokens/s", ylabel="E2E p50 (s)", yscale="log", title="E2E against throughput")
    for ax in axes[0]:
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Latency against throughput over the load points (numbers: concurrency or request rate)")
    return _save(fig, out)


def latency_cdfs(requests: pd.DataFrame, out: Path) -> Path | None:
    """The distribution (CDF) of TTFT and of ITL per engine, over every measured request that met the token
    contract (all cells of the engine pooled; ITL per gap, as bench/common/metrics.py defines it)."""
    import numpy as np

    from kvbench.common.metrics import RequestTimes

    if requests.empty or "label" not in requests:
        return None
    mine = requests[requests.ok.astype(bool) & requests.counted.astype(bool)]
    if mine.empty:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), squeeze=False, layout="constrained")
    for label, part in mine.groupby("label"):
        ttft = np.sort(part.ttft_s.dropna().to_numpy(dtype=float))
        itl = np.sort([g for t, k in zip(part.chunk_times, part.chunk_tokens)
                       for g in RequestTimes(0.0, tuple(t), tuple(k)).itl_samples()])
        for ax, values in zip(axes[0], (ttft, itl)):
            if len(values):
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", color=color(label),
                        label=f"{label} ({len(values):,})")
    for ax, what in zip(axes[0], ("TTFT (s)", "ITL, per gap (s)")):
        ax.set(xscale="log", xlabel=what, ylabel="fraction of samples at or below", ylim=(0, 1.02),
               title=f"{what.split(' ')[0].rstrip(',')} distribution per engine")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="lower right")
    return _save(fig, out)


def itl_against_context(cells: pd.DataFrame, out: Path) -> Path | None:
    """Per load point a panel: each engine's median ITL against the prompt's length (solid) and its decode bound
    (dashed, the same colour; bench/reports/bandwidth.py)."""
    from .tables import OK_STATUSES

    ok = cells[cells.status.isin(OK_STATUSES) & cells.itl_s_bound.notna() & cells.itl_s_p50.notna()]
    if ok.empty:
        return None
    ok = ok.assign(load=[load_label(r) for r in ok.itertuples()])
    loads = list(dict.fromkeys(ok.sort_values("concurrency", na_position="last").load))
    fig, axes = plt.subplots(1, len(loads), figsize=(5.2 * len(loads), 4.2), squeeze=False, layout="constrained")
    for ax, load in zip(axes[0], loads):
        for label, g in ok[ok.load == load].groupby("label", sort=False):
            g = g.sort_values("prompt_tokens")
            ax.plot(g.prompt_tokens, g.itl_s_p50 * 1000, "o-", color=color(label), label=f"{label} measured")
            ax.plot(g.prompt_tokens, g.itl_s_bound * 1000, "--", color=color(label), label=f"{label} bound")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set(title=load, xlabel="prompt tokens", ylabel="ITL p50 (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Inter-token latency against context, with the memory-bandwidth bound under it")
    return _save(fig, out)


def _draw(plot, path: Path, *args) -> bool:
    return bool(plot(*args, path))


def report_figures(run_dirs, agg: pd.DataFrame, requests: pd.DataFrame, folder: Path,
                   draw=_draw) -> list[tuple[str, str, Path]]:
    """Every plot of a report as (section it illustrates, title, PNG), in the order they should appear under
    their section's table (the section is one of :data:`KV_SECTION`, :data:`PERF_SECTION`,
    :data:`BOUNDARY_SECTION`). Sets the palette from ``agg.label`` first: one colour per series.
    ``draw(plot, path, *args)`` makes one plot (``plot(*args, path)``) and says whether it was drawn (the
    report passes one that writes to a temporary file and renames it into place)."""
    from .tables import OK_STATUSES

    folder.mkdir(parents=True, exist_ok=True)
    palette(agg.label)
    figures = []

    def add(section, title, name, plot, *args):
        if draw(plot, folder / name, *args):
            figures.append((section, title, folder / name))

    add(KV_SECTION, "KV in use vs prompt length", "kv_vs_context.png", kv_vs_context, agg)
    add(KV_SECTION, "KV in use / predicted vs context, per engine", "kv_ratio_vs_context.png", kv_ratio_vs_context,
        agg)
    if not requests.empty:
        requests = requests[requests.counted.astype(bool)]
        requests = requests.assign(label=requests.backend if agg.run_id.nunique() == 1
                                   else requests.run_id + ": " + requests.backend)
    ok = agg[agg.status.isin(OK_STATUSES)]
    # the largest cell of each series: the longest prompt at the highest load
    largest = ok.sort_values(["prompt_tokens", "concurrency"]).groupby("label").tail(1)
    for _, cell in largest.iterrows():
        name = f"timeline_{cell.run_id}_{cell.cell_id}.png" if len(run_dirs) > 1 else f"timeline_{cell.cell_id}.png"
        add(KV_SECTION, f"memory and KV over {cell.label}: {cell_words(cell)}", name, memory_timeline,
            Path(cell.run_dir), cell, requests)
    add(PERF_SECTION, "Throughput and TTFT vs concurrency", "throughput_ttft_vs_concurrency.png",
        throughput_ttft_vs_concurrency, agg)
    add(PERF_SECTION, "Latency against throughput over the load points", "latency_throughput.png",
        latency_throughput, agg)
    add(PERF_SECTION, "TTFT and ITL distributions per engine", "latency_cdfs.png", latency_cdfs, requests)
    add(BOUNDARY_SECTION, "The KV boundary", "kv_boundary.png", kv_boundary, agg)
    if "itl_s_bound" in agg:
        add(DECODE_BOUND_SECTION, "ITL against context, with the memory-bandwidth bound", "itl_bound_vs_context.png",
            itl_against_context, agg)
    return figures


VERDICT_COLORS = {"regression": "#d62728", "improvement": "#2ca02c", "unchanged": "#1f77b4",
                  "inconclusive": "#ff7f0e"}


#: the forest plot's axis ends, candidate / baseline: a change past -99 % or +9,900 % is drawn at the end
FOREST_END = 100.0


def forest(result: dict, out: Path, where=lambda key: str(key)) -> Path | None:
    """``kvbench compare``'s forest plot: per cell and metric, the change (candidate / baseline, log axis)
    with its confidence interval, over the metric's tolerance band, coloured by verdict. ``where`` names a
    cell from its key (kvbench.compare.runs passes its own)."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    import math

    def at(change: float) -> float:  # a change's place on the log axis, a change past its ends drawn at the end
        return min(FOREST_END, max(1 / FOREST_END, 1 + change)) if not math.isnan(change) else math.nan

    rows = [(f"{where(c['key'])} · {m['metric']}" + (" (lower is worse)" if m["worse"] == "lower" else ""), m)
            for c in result["cells"] for m in c["metrics"]
            if m["ci_low"] is not None and not any(math.isnan(m[k]) for k in ("ci_low", "ci_high", "change"))]
    if not rows:
        return None
    n = len(rows)
    fig, ax = plt.subplots(figsize=(9.5, 1.6 + 0.26 * n))
    lo = min(at(min(m["ci_low"], -m["tolerance"])) for _, m in rows)
    hi = max(at(max(m["ci_high"], m["tolerance"])) for _, m in rows)
    for y, (_, m) in enumerate(reversed(rows)):
        tol = m["tolerance"]
        ax.add_patch(plt.Rectangle((1 - tol, y - 0.4), 2 * tol, 0.8, color="#dddddd", lw=0, zorder=0))
        color = VERDICT_COLORS.get(m["verdict"], "#7f7f7f")
        ax.plot([at(m["ci_low"]), at(m["ci_high"])], [y, y], color=color, lw=2, zorder=2)
        past = at(m["change"]) in (FOREST_END, 1 / FOREST_END)  # past the axis: an arrowhead at its end
        marker = "o" if not past else (">" if at(m["change"]) == FOREST_END else "<")
        ax.plot([at(m["change"])], [y], marker, color=color, ms=5, zorder=3)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlim(lo / 1.05, hi * 1.05)
    ticks = [1 + p / 100 for p in (-99, -95, -90, -75, -50, -25, -10, -5, 0, 5, 10, 25, 50, 100, 200, 400, 900, 1900,
                                   9900) if lo / 1.05 <= 1 + p / 100 <= hi * 1.05]

    gap = math.log(hi / lo) / 10  # ticks at least a tenth of the axis apart, working out from 0
    kept = [1.0]
    for t in sorted((t for t in ticks if t > 1)):
        if math.log(t / kept[-1]) >= gap:
            kept.append(t)
    for t in sorted((t for t in ticks if t < 1), reverse=True):
        if math.log(min(kept) / t) >= gap:
            kept.insert(0, t)
    ax.set_xticks(sorted(kept))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{(x - 1) * 100:+.0f}%" if abs(x - 1) > 1e-9 else "0"))
    ax.xaxis.set_minor_formatter(FuncFormatter(lambda x, _: ""))
    ax.tick_params(axis="x", labelsize=7)
    ax.set_yticks(range(n), [label for label, _ in reversed(rows)], fontsize=7)
    ax.set_ylim(-0.8, n - 0.2)
    ax.set_xlabel(f"change, candidate vs baseline (log scale), with its {result['confidence']:.0%} interval")
    ax.grid(axis="x", alpha=0.3, which="both")
    handles = [Line2D([], [], color=c, lw=2, marker="o", label=v) for v, c in VERDICT_COLORS.items()]
    handles.append(plt.Rectangle((0, 0), 1, 1, color="#dddddd", label="tolerance band"))
    ax.legend(handles=handles, fontsize=7, loc="lower right" if n > 4 else "best")
    ax.set_title(f"kvbench compare: {result['verdict']}", fontsize=11)
    fig.savefig(out, dpi=DPI, bbox_inches="tight")  # long cell labels: the box grows to hold them
    plt.close(fig)
    return out
