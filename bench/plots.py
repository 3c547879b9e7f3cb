"""PNG plots of a run (matplotlib, no display needed)."""
from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

MIB = 2**20


def kv_vs_context(cells: pd.DataFrame, out: Path) -> Path | None:
    """KV in use at the peak per engine against prompt length, with the formula's prediction."""
    done = cells[cells.kv_in_use_peak_bytes.notna()]
    if done.empty:
        return None
    levels = sorted(done.concurrency.unique())
    fig, axes = plt.subplots(1, len(levels), figsize=(5.5 * len(levels), 4.2), squeeze=False)
    for ax, c in zip(axes[0], levels):
        part = done[done.concurrency == c]
        predicted = part.drop_duplicates("prompt_tokens").sort_values("prompt_tokens")
        ax.plot(predicted.prompt_tokens, predicted.kv_bytes_peak_predicted / MIB, "k--", lw=1.5,
                label="predicted (formula)")
        for (backend, group), marker in zip(part.groupby("backend"), "osd^v<>"):
            group = group.sort_values("prompt_tokens")
            ax.plot(group.prompt_tokens, group.kv_in_use_peak_bytes / MIB, marker=marker, ls="", ms=7,
                    label=f"{backend} (engine)")
        ax.set(title=f"concurrency {c}", xlabel="prompt tokens", ylabel="KV in use at peak (MiB)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("KV cache: engine-reported peak vs predicted")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def memory_timeline(run_dir: Path, cell: pd.Series, requests: pd.DataFrame, out: Path) -> Path | None:
    """Process-tree RSS and the engine's KV in use over one cell, with request starts and ends."""
    cell_id = cell.cell_id
    path = run_dir / "timelines" / f"{cell_id}.csv"
    if not path.exists():
        return None
    tl = pd.read_csv(path)
    mem, kv = tl[tl.series == "memory"], tl[tl.series == "kv"]
    if mem.empty:
        return None
    fig, ax = plt.subplots(figsize=(9, 4.2))
    ax.plot(mem.t_s, mem.rss_bytes / MIB, color="tab:blue", label="engine process tree RSS")
    ax.set(xlabel="seconds since the cell started", ylabel="RSS (MiB)", title=cell_id)
    ax2 = ax.twinx()
    ax2.plot(kv.t_s, kv.kv_bytes_in_use / MIB, color="tab:red", label="KV in use (engine)")
    ax2.set_ylabel("KV in use (MiB)")
    reqs = requests[requests.cell_id == cell_id]
    if not reqs.empty and pd.notna(cell.t_cell_start):  # each request's span, on the cell's time axis
        for r in reqs.itertuples():
            ax.axvspan(r.t_sent - cell.t_cell_start, (r.t_done or r.t_sent) - cell.t_cell_start,
                       color="grey", alpha=0.08)
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
