"""The table from the trials: pure functions of run.json's description and trials.jsonl's records, the planner's
answer for each measured configuration beside it, and the articles' own scenario planned.

Per ``capacity`` configuration: **held at once** = the largest batch of requests of N tokens that ran (every
request whole, the engine's own count of requests running reaching the batch where it says one), with the
smallest batch that did not beside it; **longest request** = the longest single request that ran in a trial
that held a batch (one request of as many tokens as the batch held, or the slot's limit where each slot
reserves one); throughput, TTFT and ITL of the largest batch that ran; **output change**: that batch's greedy
outputs against the same requests on the engine's 16-bit configuration. ``arrivals`` and ``speculation``
columns set one configuration against its baseline under the same requests.

The planner is asked, through its Python API (``kvbench plan --memory WALL --engine E --kv-dtype D
--engine-option ...``), the same question at the same wall: requests of N tokens at once, and the longest
request alone; the ratio is measured / planned.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from kvbench.common.memory_wall import format_bytes

MIB = 2**20


@lru_cache(maxsize=8)
def _model(name: str, weights_dtype: str = "auto"):
    from kvbench.planner import resolve_model

    return resolve_model(name, weights_dtype)


def planned(config: dict, scale: dict, wall_bytes: int) -> dict:
    """The planner's answer for ``config`` (run.json's form), asked twice:

    - ``held`` and ``longest``: for the run's budget above the planner's own idle footprint (its weights, its
      fixed overhead and host caches: what it counts before any request), requests of N tokens at once and one
      request alone (the model's limit the most): how far its per-request accounting (KV, activations,
      rounding, a shared prefix) carries the same budget; the ratio is set against these;
    - ``held_at_wall``: at the trial's wall itself (``kvbench plan --memory WALL``), where the planner's idle
      footprint and the measured one (``idle``) differ by what each counts (llama.cpp's mmapped weights).

    Its own overheads (bench/planner/overheads.toml), no margin, as the memory-wall runs ask. With one wall for
    every engine (no budget), both are asked at the wall."""
    from kvbench.planner import PlanInput, plan

    n = scale["request_tokens"]
    common = dict(model=_model(scale["model"]), engine=config["engine"], kv_dtype=config["kv_dtype"], device="cpu",
                  margin=0.0, engine_options=dict(config["plan_options"]))
    reserve = config.get("reserve")
    batch = dict(context=n, batch=1, max_model_len=reserve or n, shared_prefix=config.get("prefix_tokens") or None)
    at_wall = plan(PlanInput(memory=float(wall_bytes), **batch, **common), with_levers=False)
    idle = at_wall["weights_bytes_per_gpu"] + at_wall["overhead_fixed_bytes"] + (at_wall["host_memory_bytes"] or 0)
    memory = float(idle + scale["budget_bytes"]) if scale.get("budget_bytes") else float(wall_bytes)
    held = plan(PlanInput(memory=memory, **batch, **common), with_levers=False)
    alone = plan(PlanInput(memory=memory, batch=1, max_model_len=reserve, **common), with_levers=False)
    count = int(held["max_batch"])
    if batch["shared_prefix"] and count:
        count = _shared_count(PlanInput(memory=memory, **batch, **common), count)
    return {"held": count, "longest": int(alone["max_context_at_batch"]),
            "held_at_wall": int(at_wall["max_batch"]), "idle": idle, "overhead": held["overhead_source"],
            "kv_bytes_per_token": held["kv_bytes_per_token"]}


def _shared_count(p, unshared: int) -> int:
    """Requests that start alike held at once. The planner sizes a pool, and answers its count, with every
    request at full length; what a shared prefix saves it gives as the KV in use (``plan --shared-prefix``): the
    most requests whose shared KV, with everything else the plan counts (weights, overheads, host caches, the
    pool's extra blocks), fits the memory it plans in."""
    from dataclasses import replace

    from kvbench.planner import plan

    def fits(batch: int) -> bool:
        r = plan(replace(p, batch=batch), with_levers=False)
        needed = (r["weights_bytes_per_gpu"] + r["overhead_fixed_bytes"] + (r["host_memory_bytes"] or 0)
                  + r["overhead_per_token_bytes"] * batch * r["context"] + r["kv_pool_extra_bytes"]
                  + r["shared_prefix"]["kv_bytes_per_gpu"])
        return needed <= r["usable_bytes"]

    count = unshared
    while count < 100 * unshared and fits(count + 1):
        count += 1
    return count


@dataclass
class Cell:
    """One configuration's figures in one column."""

    column: str
    config: dict
    wall_bytes: int | None = None
    held: int | None = None  # the largest batch that ran
    not_held: int | None = None  # the smallest batch tried that did not (killed, queued, failed)
    not_held_verdict: str = ""
    longest: int | None = None
    longest_not: int | None = None
    metrics: dict = field(default_factory=dict)  # of the largest batch that ran
    pool_bytes: int | None = None  # the KV pool the engine allocated for the largest batch that ran (None: no pool)
    at_the_wall: bool = False  # that batch ran with the wall full: the kernel took back file pages to keep it under
    trials: list[str] = field(default_factory=list)  # the trial ids behind the cell
    plan: dict | None = None
    output_change: dict | None = None  # greedy match against the 16-bit configuration
    compared: dict | None = None  # arrivals / speculation: {"config": metrics, "baseline": metrics, ...}
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.held is None or not self.plan or not self.plan["held"]:
            return None
        return self.held / self.plan["held"]


def capacity_cell(column: str, config: dict, trials: list[dict]) -> Cell:
    """A capacity configuration's cell from its rung trials (trials.jsonl's records)."""
    mine = sorted((t for t in trials if t["config"] == config["key"] and t["purpose"] == "rung"),
                  key=lambda t: t["rung"])
    cell = Cell(column, config, trials=[t["trial"] for t in mine])
    if not mine:
        cell.note = "not run"
        return cell
    cell.wall_bytes = mine[0]["wall_bytes"]
    ran = [t for t in mine if t["verdict"] == "ran"]
    if ran:
        best = ran[-1]
        cell.held, cell.metrics = best["rung"], best.get("metrics") or {}
        cell.pool_bytes, cell.at_the_wall = best.get("kv_pool_bytes"), bool(best.get("at_the_wall"))
    above = [t for t in mine if t["verdict"] != "ran" and (cell.held is None or t["rung"] > cell.held)]
    if above:
        cell.not_held, cell.not_held_verdict = above[0]["rung"], above[0]["verdict"]
    longs = [(t["longest_tokens"], t["longest_verdict"]) for t in mine if t.get("longest_verdict")]
    ok = [n for n, v in longs if v == "ran"]
    bad = [n for n, v in longs if v != "ran" and (not ok or n > max(ok))]
    cell.longest = max(ok) if ok else None
    cell.longest_not = min(bad) if bad else None
    return cell


def output_change(cell: Cell, baseline: Cell | None, requests: dict[str, list[dict]]) -> dict | None:
    """The greedy outputs of ``cell``'s largest batch against the same requests on ``baseline`` (the engine's
    16-bit configuration's largest batch); ``requests``: trial id -> its request records."""
    from .trials import greedy_match

    if baseline is None or cell.held is None or baseline.held is None:
        return None
    mine, theirs = _best_trial(cell), _best_trial(baseline)
    if mine is None or theirs is None:
        return None
    batch = lambda tid: [r for r in requests.get(tid, []) if r["phase"] == "batch"]  # noqa: E731
    match = greedy_match(batch(theirs), batch(mine))
    if match is not None:
        match.update(batch=cell.held, baseline_batch=baseline.held)
    return match


def noise_floor(baseline: Cell, requests: dict[str, list[dict]], trials: list[dict]) -> dict | None:
    """The 16-bit configuration against itself: its largest batch's outputs against another of its batches that
    ran (a batch of another size: what batching alone changes in the greedy outputs)."""
    from .trials import greedy_match

    ran = [t["trial"] for t in trials if t["config"] == baseline.config["key"] and t["purpose"] == "rung"
           and t["verdict"] == "ran"]
    if len(ran) < 2:
        return None
    batch = lambda tid: [r for r in requests.get(tid, []) if r["phase"] == "batch"]  # noqa: E731
    return greedy_match(batch(ran[-2]), batch(ran[-1]))


def _best_trial(cell: Cell) -> str | None:
    return next((tid for tid in reversed(cell.trials) if tid.endswith(f"-b{cell.held}")), None)


def compared_cell(column: str, config: dict, baseline: dict, trials: list[dict]) -> Cell:
    """An arrivals or speculation configuration against its baseline: each side's metrics over the same requests."""
    cell = Cell(column, config)
    sides = {}
    for name, c in (("config", config), ("baseline", baseline)):
        t = next((t for t in trials if t["config"] == c["key"] and t["purpose"] in ("arrivals", "speculation")), None)
        if t is None:
            continue
        cell.trials.append(t["trial"])
        cell.wall_bytes = t["wall_bytes"]
        sides[name] = {"verdict": t["verdict"], "metrics": t.get("metrics") or {},
                       "running_peak": t.get("running_peak"), "spec": t.get("spec") or {}}
    cell.compared = sides
    return cell


def assemble(run: dict, trials: list[dict], requests: dict[str, list[dict]] | None = None,
             with_plan: bool = True) -> list[list[Cell]]:
    """Every column's cells, in the columns' order (run.json's ``columns``), the planner's answer beside each
    capacity cell (``with_plan``) and the output change where the KV is quantised (given ``requests``)."""
    scale, out = run["scale"], []
    sixteen: dict[str, Cell] = {}
    for column in run["columns"]:
        cells = []
        for config in column["configs"]:
            if column["kind"] == "capacity":
                cell = capacity_cell(column["key"], config, trials)
                if with_plan and cell.wall_bytes:
                    cell.plan = planned(config, scale, cell.wall_bytes)
                if config["kv_dtype"] == "auto" and config["engine"] not in sixteen and not config.get("reserve"):
                    sixteen[config["engine"]] = cell
                elif requests is not None and config["kv_dtype"] != "auto" and not config.get("prefix_tokens"):
                    # a shared prefix changes the prompts themselves: nothing of the same requests to compare
                    base = sixteen.get(config["engine"])
                    cell.output_change = output_change(cell, base, requests)
                    if cell.output_change is not None and base is not None:
                        cell.output_change["noise_floor"] = noise_floor(base, requests, trials)
            else:
                cell = compared_cell(column["key"], config, column["baselines"][config["key"]], trials)
            cells.append(cell)
        out.append(cells)
    return out


# --- the articles' own scenario, planned ----------------------------------------------------------

#: The articles' estimates ("estimated, not measured"): a 70B model at 4 bits on one 80 GB card, by request length
#: and column. Their conclusion: "weights quantised + KV quantised + paged + continuous batching: without any one
#: of the four, 128K hits the memory wall".
ARTICLES = {8192: {"static": "0-1", "paged": "3-4", "kv8": "6-8", "continuous": "more again"},
            131072: {"static": "impossible", "paged": "impossible (the KV not quantised)", "kv8": "feasible"}}

#: The configurations kvbench plans for it: (column, label, engine, KV dtype, rule options, limit, judged).
#: ``limit`` None: the model's own (131,072: a server that takes any request the model does); "request": the
#: request's length. ``judged``: the configuration the articles' estimate for that column is set against (what
#: they describe: no optimisation = a room per request at the model's limit, PagedAttention = vLLM's blocks);
#: the others show what another engine's rule makes of the same column.
SCENARIO = (
    ("static", "llama.cpp, a slot per request reserving the model's limit", "llamacpp", "auto", {}, None, True),
    ("static", "transformers, static batch (one request at the limit must fit)", "hf", "auto", {}, None, False),
    ("paged", "vLLM, paged blocks, limit = the request", "vllm", "auto", {}, "request", True),
    ("paged", "vLLM, paged blocks, the model's limit", "vllm", "auto", {}, None, False),
    ("paged", "llama.cpp, unified cache, the model's limit", "llamacpp", "auto", {"unified": True}, None, False),
    ("kv8", "vLLM fp8, limit = the request", "vllm", "fp8", {}, "request", True),
    ("kv8", "llama.cpp q8_0, unified, the model's limit", "llamacpp", "q8_0", {"unified": True}, None, False),
    ("kv4", "llama.cpp q4_0, unified, the model's limit", "llamacpp", "q4_0", {"unified": True}, None, False),
)


def scenario(model: str = "llama-3.1-70b", weights_dtype: str = "int4", gpu: str = "H100-80GB",
             lengths: tuple[int, ...] = (8192, 131072)) -> list[dict]:
    """kvbench's plan of the articles' scenario: each configuration of :data:`SCENARIO` at each request length,
    requests of that length at once on one GPU (``kvbench plan MODEL --weights-dtype int4 --gpu H100-80GB -n LEN
    --engine E --kv-dtype D``), with the articles' estimate and the verdict on the judged row."""
    from kvbench.planner import PlanInput, plan

    m = _model(model, weights_dtype)
    out = []
    for n in lengths:
        for column, label, engine, dtype, options, limit, judged in SCENARIO:
            r = plan(PlanInput(model=m, engine=engine, kv_dtype=dtype, gpu=gpu, context=n, batch=1,
                               max_model_len=n if limit == "request" else None, engine_options=dict(options)),
                     with_levers=False)
            estimate = ARTICLES.get(n, {}).get(column) if judged else None
            out.append({"tokens": n, "column": column, "label": label, "engine": engine, "kv_dtype": r["kv_dtype"],
                        "held": int(r["max_batch"]), "max_model_len": r["max_model_len"], "judged": judged,
                        "weights_gib": r["weights_bytes"] / 2**30, "kv_gib_per_request": r["kv_bytes_per_gpu"] / 2**30,
                        "articles": estimate, "verdict": verdict_on(estimate, int(r["max_batch"])) if estimate else ""})
    return out


def verdict_on(estimate: str, held: int) -> str:
    """The articles' estimate for a column against kvbench's planned count for the configuration it describes."""
    words = estimate.split("-")
    if all(w.isdigit() for w in words):
        low, high = int(words[0]), int(words[-1])
        if held > high:
            return f"too low: kvbench plans {held} ({held / high:.1f}x their upper figure)"
        if held < low:
            return f"too high: kvbench plans {held}"
        return "right"
    if estimate.startswith("impossible"):
        return "right: none fits" if held == 0 else f"wrong: {held} fit(s)"
    if estimate.startswith("feasible"):
        return f"right: {held} fit(s)" if held >= 1 else "wrong: none fits"
    return "not a memory figure: batching changes when requests run, not what each holds"


# --- Markdown ---------------------------------------------------------------------------------------

def _mib(v) -> str:
    return "-" if not v else f"{v / MIB:.1f} MiB"


def _n(v) -> str:
    return "-" if v is None else f"{v:,}"


def _s(v, scale: float = 1.0, unit: str = "s", digits: int = 2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f} {unit}"


def engine_name(config: dict) -> str:
    return config["label"].split(":")[0]


def display_names(run: dict) -> dict[str, str]:
    """Each engine of the run as its configurations' labels name it (llamacpp: "llama.cpp")."""
    out: dict[str, str] = {}
    for column in run["columns"]:
        for config in column["configs"]:
            out.setdefault(config["engine"], engine_name(config))
    return out


def held_text(c: Cell) -> str:
    if c.held is None and c.not_held is None:
        return c.note or "not run"
    got = _n(c.held) if c.held is not None else "0"
    if c.not_held is not None:
        got += f" ({c.not_held} {c.not_held_verdict})"
    elif c.held is not None:
        got += " (or more: the ladder's last rung ran)"
    if c.plan:
        got += f"; plan {c.plan['held']}" + (f", {c.ratio:.2f}x" if c.ratio is not None else "")
    return got


def longest_text(c: Cell) -> str:
    if c.longest is None:
        return "-" if c.longest_not is None else f"< {c.longest_not:,}"
    got = f"{c.longest:,}"
    if c.longest_not is not None:
        got += f" ({c.longest_not:,} did not)"
    if c.plan:
        got += f"; plan {c.plan['longest']:,}"
    return got


def change_text(c: Cell) -> str:
    m = c.output_change
    if c.config["kv_dtype"] == "auto":
        return "baseline (16-bit)"
    if c.config.get("prefix_tokens"):
        return "not compared (the shared prefix makes other prompts)"
    if not m:
        return "not measured"
    first = m["first_difference_median"]
    text = f"{m['identical']}/{m['requests']} identical" + (f", first change at token {first:.0f} (median)"
                                                             if first is not None else "")
    if m.get("batch") and m.get("baseline_batch") and m["batch"] != m["baseline_batch"]:
        text += f" (batches of {m['batch']} and {m['baseline_batch']})"
    floor = m.get("noise_floor")
    if floor:
        text += f" (16-bit vs 16-bit at another batch: {floor['identical']}/{floor['requests']})"
    return text


def perf_text(metrics: dict) -> str:
    if not metrics:
        return "-"
    return (f"{metrics.get('output_tokens_per_s') or 0:.1f} tok/s, TTFT p50 {_s(metrics.get('ttft_s_p50'))}, "
            f"ITL p50 {_s(metrics.get('itl_s_p50'), 1000, 'ms', 0)}")


def compared_text(c: Cell, baseline_word: str) -> str:
    sides = c.compared or {}
    if "config" not in sides or "baseline" not in sides:
        return "not run"
    a, b = sides["config"], sides["baseline"]
    if a["verdict"] != "ran" or b["verdict"] != "ran":
        return f"{a['verdict']} / {baseline_word} {b['verdict']}"
    ta, tb = a["metrics"].get("output_tokens_per_s"), b["metrics"].get("output_tokens_per_s")
    gain = f" ({ta / tb:.2f}x)" if ta and tb else ""
    spec = a.get("spec") or {}
    drafts = (f", {spec['accepted']:,} of {spec['drafted']:,} drafted tokens accepted" if spec.get("drafted") else "")
    return f"{perf_text(a['metrics'])}{gain}{drafts}; {baseline_word}: {perf_text(b['metrics'])}"


def summary_table(run: dict, columns: list[list[Cell]]) -> str:
    """The articles' table, measured: one column per optimisation, one line per engine configuration in a cell."""
    scale = run["scale"]
    heads = [c["title"] for c in run["columns"]]
    rows = {"held": f"requests of {scale['request_tokens']:,} tokens held at once (plan, measured / plan)",
            "longest": "longest single request that ran (plan)", "perf": "at that concurrency: output tok/s, TTFT, ITL",
            "change": "output change (greedy, against 16-bit KV)"}
    lines = ["| | " + " | ".join(heads) + " |", "|---|" + "---|" * len(heads)]
    before_held: dict[str, str] = {}
    names = display_names(run)
    for row, title in rows.items():
        out = []
        for desc, cells in zip(run["columns"], columns):
            parts = []
            for c in cells:
                name = engine_name(c.config)
                if desc["kind"] == "capacity":
                    text = {"held": held_text, "longest": longest_text, "change": change_text,
                            "perf": lambda x: perf_text(x.metrics)}[row](c)
                    if row == "held":
                        before_held[c.config["engine"]] = desc["key"]
                elif row == "perf":
                    text = compared_text(c, "static" if desc["kind"] == "arrivals" else "no drafter")
                elif row == "held":
                    text = f"as {before_held.get(c.config['engine'], 'before')} (memory unchanged)"
                else:
                    text = "-"
                parts.append(f"{name}: {text}")
            for engine, why in desc.get("skipped", {}).items():
                if row == "held":
                    parts.append(f"{names.get(engine, engine)}: {why}")
            out.append("<br>".join(parts) or "-")
        lines.append(f"| {title} | " + " | ".join(out) + " |")
    return "\n".join(lines)


def details_table(run: dict, columns: list[list[Cell]]) -> str:
    """One line per measured configuration: its wall, the ladder's boundary, the planner beside it (for the
    budget above its own idle footprint, and at the wall itself), the trials behind it."""
    lines = ["| column | configuration | KV | wall | held at once | its KV pool | plan | measured / plan | "
             "plan at the wall | longest request (plan) | trials |", "|---|---|---|---|---:|---:|---:|---:|---:|---|---|"]
    for desc, cells in zip(run["columns"], columns):
        for c in cells:
            if desc["kind"] != "capacity":
                continue
            bound = (f" ({c.not_held} {c.not_held_verdict})" if c.not_held is not None else
                     " (the last rung)" if c.held is not None else "")
            lines.append(f"| {desc['key']} | {c.config['label']} | {c.config['kv_dtype']} | "
                         f"{format_bytes(c.wall_bytes) if c.wall_bytes else '-'} | {_n(c.held)}{bound} | "
                         f"{_mib(c.pool_bytes)}{' (at the wall)' if c.at_the_wall else ''} | "
                         f"{c.plan['held'] if c.plan else '-'} | {f'{c.ratio:.2f}' if c.ratio is not None else '-'} | "
                         f"{c.plan['held_at_wall'] if c.plan else '-'} | {longest_text(c)} | {', '.join(c.trials)} |")
    return "\n".join(lines)


def scenario_table(rows: list[dict]) -> str:
    """kvbench's plan of the articles' scenario beside their estimates."""
    lines = ["| request | column | configuration | KV dtype | server limit | KV per request | planned at once | "
             "the articles | verdict |", "|---:|---|---|---|---:|---:|---:|---|---|"]
    for r in rows:
        lines.append(f"| {r['tokens']:,} | {r['column']} | {r['label']} | {r['kv_dtype']} | {r['max_model_len']:,} | "
                     f"{r['kv_gib_per_request']:.2f} GiB | {r['held']} | {r['articles'] or ''} | {r['verdict']} |")
    for n, estimates in ARTICLES.items():
        for column, estimate in estimates.items():
            if not any(r["tokens"] == n and r["column"] == column and r["judged"] for r in rows):
                lines.append(f"| {n:,} | {column} | (no memory figure to plan) | | | | | {estimate} | "
                             f"{verdict_on(estimate, 0)} |")
    return "\n".join(lines)


def walls_text(run: dict) -> str:
    lines = ["| engine | idle (measured) | wall = idle + budget | calibration trial |", "|---|---:|---:|---|"]
    for engine, w in run["walls"].items():
        lines.append(f"| {engine} | {w['idle_bytes'] / MIB:.1f} MiB | {format_bytes(w['wall_bytes'])} | "
                     f"{w['trial']} |")
    return "\n".join(lines)
