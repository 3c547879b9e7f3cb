"""The plot a reader would rather see than read: requests held at once per column, each engine's bar side by
side, the planner's answer marked on each bar."""
from __future__ import annotations

from pathlib import Path

from .table import Cell, engine_name

COLOURS = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3")


def bars(run: dict, columns: list[list[Cell]]) -> list[dict]:
    """One bar per capacity configuration: the column, the engine, held at once, the plan (None: not asked);
    the columns that change no memory carry their engine's last bar, marked ``carried``."""
    out, last = [], {}
    for desc, cells in zip(run["columns"], columns):
        for c in cells:
            engine = c.config["engine"]
            if desc["kind"] == "capacity":
                last[engine] = {"column": desc["key"], "title": desc["title"], "engine": engine,
                                "name": engine_name(c.config), "held": c.held or 0,
                                "plan": c.plan["held"] if c.plan else None, "carried": False,
                                "open": c.held is not None and c.not_held is None}
                out.append(last[engine])
            elif engine in last:
                out.append({**last[engine], "column": desc["key"], "title": desc["title"], "carried": True})
    return out


def plot(run: dict, columns: list[list[Cell]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.patches import Patch

    data = bars(run, columns)
    titles = list(dict.fromkeys(d["title"] for d in data))
    engines = list(dict.fromkeys(d["name"] for d in data))
    width = 0.8 / max(1, len(engines))
    fig, ax = plt.subplots(figsize=(10, 4.8), constrained_layout=True)
    handles = []
    for j, name in enumerate(engines):
        colour = COLOURS[j % len(COLOURS)]
        handles.append(Patch(facecolor=colour, label=name))
        for d in (d for d in data if d["name"] == name):
            x = titles.index(d["title"]) + (j - (len(engines) - 1) / 2) * width
            if d["carried"]:
                ax.bar([x], [d["held"]], width, color="white", edgecolor=colour, hatch="//", linewidth=0.8)
            else:
                ax.bar([x], [d["held"]], width, color=colour, edgecolor="white")
            ax.annotate(f"{d['held']}{'+' if d['open'] else ''}", (x, d["held"]), ha="center", va="bottom",
                        fontsize=8)
            if d["plan"] is not None and not d["carried"]:
                ax.plot([x - width / 2, x + width / 2], [d["plan"], d["plan"]], color="black", linewidth=1.4)
    handles += [plt.Line2D([], [], color="black", linewidth=1.4, label="the planner's answer for the same budget"),
                Patch(facecolor="white", edgecolor="grey", hatch="//", label="memory as the column before"),
                Patch(facecolor="white", edgecolor="white", label="N+: the ladder's last rung ran")]
    s = run["scale"]
    ax.set_xticks(range(len(titles)), [t.replace(", ", ",\n") for t in titles], fontsize=8)
    ax.set_ylabel(f"requests of {s['request_tokens']:,} tokens held at once")
    ax.set_title(f"{s['model']}: what each optimisation buys under one budget "
                 f"({s['budget_bytes'] / 2**20:.0f} MiB above each engine's idle footprint)", fontsize=10)
    ax.legend(handles=handles, fontsize=8, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
