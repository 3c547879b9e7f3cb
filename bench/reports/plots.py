"""PNG plots of one or more runs (matplotlib, Agg: no display needed). Each function takes the tidy
cells (repeats averaged by ``tables.aggregate``, with a ``label`` column naming the series) and writes one
PNG, or returns None when the runs hold nothing to plot."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from kvbench.units import MIB  # noqa: E402

from .tables import sequences_fitting  # noqa: E402

MARKERS = "osd^v<>PX*"
DPI = 110


def _save(fig, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=DPI)
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
    fig, axes = plt.subplots(1, len(levels), figsize=(5.5 * len(levels), 4.2), squeeze=False)
    for ax, c in zip(axes[0], levels):
        part = done[done.concurrency == c]
        predicted = part.drop_duplicates("prompt_tokens").sort_values("prompt_tokens")
        ax.plot(predicted.prompt_tokens, predicted.kv_bytes_peak_predicted / MIB, "k--", lw=1.5,
                label="predicted (formula)")
        for (label, group), marker in zip(part.groupby("label"), MARKERS * 4):
            group = group.sort_values("prompt_tokens")
            ax.plot(group.prompt_tokens, group.kv_in_use_peak_bytes / MIB, marker=marker, ls="", ms=7,
                    label=f"{label} (engine)")
        ax.set(title=f"concurrency {int(c)}", xlabel="prompt tokens", ylabel="KV in use at peak (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("KV cache: engine-reported peak vs predicted")
    return _save(fig, out)


def memory_timeline(run_dir: Path, cell: pd.Series, requests: pd.DataFrame, out: Path) -> Path | None:
    """Process-tree memory and the engine's KV in use over one cell on one time axis, with each request's
    span shaded and its start and end marked."""
    cell_id = cell.cell_id
    path = Path(run_dir) / "timelines" / f"{cell_id}.csv"
    if not path.exists():
        return None
    tl = pd.read_csv(path)
    mem, kv = tl[tl.series == "memory"], tl[tl.series == "kv"]
    if mem.empty and kv.empty:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.2))
    if not mem.empty and mem.rss_bytes.notna().any():
        ax.plot(mem.t_s, mem.rss_bytes / MIB, color="tab:blue", label="engine process tree RSS")
    if "gpu_process_bytes" in mem and mem.gpu_process_bytes.notna().any():
        ax.plot(mem.t_s, mem.gpu_process_bytes / MIB, color="tab:purple", label="engine GPU memory")
    ax.set(xlabel="seconds since the cell started", ylabel="memory (MiB)", title=f"{cell.label}: {cell_id}")
    ax2 = ax.twinx()
    ax2.plot(kv.t_s, kv.kv_bytes_in_use / MIB, color="tab:red", label="KV in use (engine)")
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
    done = cells[(cells.load_profile == "concurrent") & cells.output_tokens_per_s.notna() & cells.concurrency.notna()]
    if done.empty:
        return None
    lengths = sorted(done.prompt_tokens.unique())
    fig, axes = plt.subplots(2, len(lengths), figsize=(4.2 * len(lengths), 6.8), squeeze=False, sharex=True)
    for j, p in enumerate(lengths):
        part = done[done.prompt_tokens == p]
        for (label, group), marker in zip(part.groupby("label"), MARKERS * 4):
            group = group.sort_values("concurrency")
            axes[0][j].plot(group.concurrency, group.output_tokens_per_s, marker=marker, label=label)
            axes[1][j].plot(group.concurrency, group.ttft_s_p50, marker=marker, label=label)
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
    labels = sorted(pooled.label.unique())
    fig, axes = plt.subplots(1, len(labels), figsize=(5.2 * len(labels), 4.2), squeeze=False)
    for ax, label in zip(axes[0], labels):
        part = pooled[pooled.label == label]
        pool = part.kv_pool_tokens_engine.max()
        context = part.prompt_tokens + part.output_tokens - 1
        lo, hi = max(1, int(context.min() * 0.5)), int(context.max() * 1.3)
        xs = list(range(lo, hi + 1, max(1, (hi - lo) // 200)))
        ax.plot(xs, [pool / x for x in xs], color="tab:red", label=f"boundary: pool of {int(pool):,} tokens / context")
        # within the pool by the boundary table's rule (the KV model's engine rule where the row has it)
        fits = part.concurrency <= pd.Series([sequences_fitting(r) for r in part.itertuples()], index=part.index,
                                             dtype=float)
        ax.scatter(context[fits], part.concurrency[fits], color="tab:blue", zorder=3, label="cell within the pool")
        if (~fits).any():
            ax.scatter(context[~fits], part.concurrency[~fits], facecolors="none", edgecolors="tab:blue", zorder=3,
                       label="cell beyond the pool")
        ax.set(title=label, xlabel="context per sequence (prompt + output - 1 tokens)",
               ylabel="concurrent sequences", yscale="log", xscale="log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.suptitle("The KV boundary: sequences that fit the engine's KV pool")
    return _save(fig, out)


def _kv_boundary_measured(cells: pd.DataFrame, out: Path) -> Path | None:
    labels = sorted(cells.label.unique())
    fig, axes = plt.subplots(1, len(labels), figsize=(5.2 * len(labels), 4.2), squeeze=False)
    for ax, label in zip(axes[0], labels):
        part = cells[cells.label == label]
        for prompt, group in part.groupby("prompt_tokens"):
            group = group.groupby("concurrency", as_index=False)[
                ["requests_running_peak", "requests_waiting_peak", "kv_pool_sequences_predicted"]].mean()
            (line,) = ax.plot(group.concurrency, group.requests_running_peak, marker="o",
                              label=f"running at once ({prompt} tok)")
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


VERDICT_COLORS = {"regression": "#d62728", "improvement": "#2ca02c", "unchanged": "#1f77b4",
                  "inconclusive": "#ff7f0e"}


def forest(result: dict, out: Path) -> Path | None:
    """``kvbench compare``'s forest plot: per cell and metric, the change (candidate / baseline, log axis)
    with its confidence interval, over the metric's tolerance band, coloured by verdict."""
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter

    from kvbench.compare import _where

    rows = [(f"{_where(c['key'])} · {m['metric']}" + (" (lower is worse)" if m["worse"] == "lower" else ""), m)
            for c in result["cells"] for m in c["metrics"] if m["ci_low"] is not None]
    if not rows:
        return None
    n = len(rows)
    fig, ax = plt.subplots(figsize=(9.5, 1.6 + 0.26 * n))
    lo = min(1 + min(m["ci_low"], -m["tolerance"]) for _, m in rows)
    hi = max(1 + max(m["ci_high"], m["tolerance"]) for _, m in rows)
    for y, (_, m) in enumerate(reversed(rows)):
        tol = m["tolerance"]
        ax.add_patch(plt.Rectangle((1 - tol, y - 0.4), 2 * tol, 0.8, color="#dddddd", lw=0, zorder=0))
        color = VERDICT_COLORS.get(m["verdict"], "#7f7f7f")
        ax.plot([1 + m["ci_low"], 1 + m["ci_high"]], [y, y], color=color, lw=2, zorder=2)
        ax.plot([1 + m["change"]], [y], "o", color=color, ms=5, zorder=3)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlim(lo / 1.05, hi * 1.05)
    ticks = [1 + p / 100 for p in (-95, -90, -75, -50, -25, -10, -5, 0, 5, 10, 25, 50, 100, 200, 400, 900, 1900)
             if lo / 1.05 <= 1 + p / 100 <= hi * 1.05]
    import math

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
