"""``kvbench report``: one or more runs as Markdown tables, PNG plots and one self-contained HTML page.

``build`` loads the runs (``kvbench.store.readers.load``), makes the tables (``tables.py``: one pandas frame per
question) and the plots (``plots.py``), and returns a :class:`Report`; ``markdown.py`` and ``html.py``
lay it out. Each table carries a caption with the run id, hardware, model and engine versions, so it can
be quoted alone.
"""
from __future__ import annotations

import os
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd

from kvbench.common.files import (NEW_FILE_MODE, OutputRefused, atomic_write_text, check_output, check_output_folder,
                                  kvbench_html, kvbench_markdown, kvbench_png)
from kvbench.common.markdown import md_text
from kvbench.reports import bandwidth, findings, prefix_cache, speculation, tables
from kvbench.store.errors import DamagedLinesWarning, ResultsReadError, ResultsWarning, ResultsWriteError
from kvbench.store.readers import load, load_logprobs, load_run_info, read_jsonl_rows
from kvbench.store.writer import run_status


@dataclass
class Section:
    id: str  # what the code finds it by ("kv", "boundary", ...): titles are for people and may change
    title: str
    intro: str
    table: pd.DataFrame | None = None
    right: set[str] = field(default_factory=set)
    caption: str = ""
    note: str = ""  # shown instead of (or after) the table
    code_blocks: list[tuple[str, str]] = field(default_factory=list)  # (title, text), e.g. log tails


@dataclass
class Figure:
    title: str
    path: Path  # the PNG on disk
    section: str = ""  # the id of the section whose table it illustrates ("": none)


@dataclass
class Report:
    title: str
    headers: list[list[tuple[str, str]]]  # per run: (label, value) lines
    sections: list[Section]
    figures: list[Figure]
    notes: list[str] = field(default_factory=list)  # damaged records worked around, e.g. a torn last line


def run_header(info: dict) -> list[tuple[str, str]]:
    model = info.get("model", {})
    wl = info.get("workload", {})
    return [
        ("Run", f"`{info['run_id']}` ({run_status(info)}), started {info.get('started_at', '?')}"),
        ("Command", f"`{info.get('command', '?')}`"),
        ("Hardware", hardware(info)),
        ("Model", f"{model.get('name', '?')} (sha256 `{str(model.get('sha256', '?'))[:16]}…`), "
                  f"context limit {model.get('max_context', '?')}"),
        ("Engines", engines(info)),
        *([("Served models", served)] if (served := served_models(info)) else []),
        ("Workload", f"{wl.get('name', '?')}: {wl.get('description', '')} (seed {wl.get('seed', '?')})"),
    ]


def served_models(info: dict) -> str:
    """What each server said it serves (run.json's served_models; the KV predicted is --model's), and what an
    attached server was found to support; "" where nothing was read."""
    served = {k: v for k, v in (info.get("served_models") or {}).items() if v is not None}
    caps = info.get("capabilities") or {}
    parts = []
    for label, models in served.items():
        found = ", ".join(f"{name} {'yes' if ok else 'no'}" for name, ok in (caps.get(label) or {}).items())
        parts.append(f"{label}: {', '.join(map(md_text, models)) or 'none listed'}"  # a server's words: only text
                     + (f" (asked: {md_text(found)})" if found else ""))
    return "; ".join(parts)


def hardware(info: dict) -> str:
    from kvbench.common.hardware import hardware_line

    return hardware_line(info.get("environment", {}))


def engines(info: dict) -> str:
    """Each engine's version, and the threads it computed on where the run measured them."""
    versions = info.get("engine_versions") or {b["label"]: b["version"] for b in info.get("backends", [])}
    threads = {key.split(" ")[0]: t for key, t in (info.get("engine_threads") or {}).items()}
    return ", ".join(f"{k} ({md_text(v)}"  # the version a server reported: only text, never Markdown
                     + (f", {threads[k]['busy_threads']} busy threads" if k in threads else "") + ")"
                     for k, v in versions.items()) or "-"


def caption(infos: list[dict]) -> str:
    """One line that lets a table be quoted alone: run, hardware, model, engine versions (per run)."""
    parts = []
    for info in infos:
        model = info.get("model", {})
        parts.append(f"run `{info['run_id']}` · {hardware(info)} · model {model.get('name', '?')} "
                     f"(sha256 `{str(model.get('sha256', '?'))[:12]}…`) · engines {engines(info)}")
    return "; ".join(parts)


KV_INTRO = ("Predicted = the plain formula from the model's config: per layer 2 x KV heads x head_dim x dtype "
            "bytes (MLA: the latent) for each of prompt + output - 1 tokens (the last sampled token is never fed "
            "back; a sliding-window layer holds at most its window), times the sequences held at once. \"In use\" is each "
            "engine's own figure at the cell's peak: transformers' cache tensors (exact), vLLM's "
            "kv_cache_usage_perc x blocks (block-rounded), llama.cpp's /slots cached tokens x bytes/token. "
            "The pool is what the engine allocated up front (vLLM: its KV budget; llama.cpp: its log line).")
PERF_INTRO = ("TTFT, ITL, TPOT and E2E as defined in docs/metrics.md (client-side, per streamed chunk), over the "
              "requests that met the token contract; throughput over the cell's wall time. Client lag: how late "
              "the client's event loop ran at worst in the cell, a bound on its own error in TTFT and ITL.")
BOUNDARY_INTRO = ("The KV boundary: how many sequences of the cell's length the engine's KV pool holds by the KV "
                  "model's rule for that engine (predicted), against how many the engine ran at once and how many "
                  "waited or were preempted (its own counters, polled at 10 Hz; schema v2 runs). Past the "
                  "boundary an engine must queue requests or preempt running ones. The `kv_boundary` workload "
                  "sizes the pool below the concurrency on purpose; llama.cpp runs at most one sequence per slot.")
DEPLOYMENT_INTRO = ("A deployment (several replicas of one engine as one backend: `-b 'ENGINE:url=A,url=B'`) has "
                    "a total row (\"total (N replicas)\": every request; KV in use and the queue summed over the "
                    "replicas at each poll; the pool and the sequences it holds summed) and a row per replica "
                    "(its own pool, KV and queue, and the requests it served; through a gateway, its KV and queue "
                    "only). Which replica queued first: the first poll that found requests waiting on it.")
REPEATS_NOTE = " Cells run several times (rep > 1) show the mean over their repeats."


def _validation(run_dirs: list[Path], infos: list[dict]) -> list[Section]:
    out = []
    for run_dir, info in zip(run_dirs, infos):
        path = run_dir / "kv_validation.jsonl"
        if not path.exists():
            continue
        rows, damaged = read_jsonl_rows(path)  # a torn line is skipped and said, as in the run's records
        if damaged:
            warnings.warn(DamagedLinesWarning(path, damaged), stacklevel=2)
        title = "The KV model against the engines' own allocations"
        out.append(Section("validation", title + (f" ({info['run_id']})" if len(run_dirs) > 1 else ""),
                           "Predicted by each engine's KV rules (its adapter in `backends/`, `kvbench plan --engine ...`); "
                           "engine-reported from the engine's log or metrics; measured from transformers' cache "
                           "tensors. `kvbench validate` made this table.",
                           tables.validation_table(rows), tables.VALIDATION_RIGHT, caption([info])))
    return out


def _plot(draw, path: Path, *args) -> bool:
    """``draw(*args, temp_path)`` into a new temp file beside ``path``, then renamed over it: a full disk
    leaves the old PNG (or none), never a truncated one. The temp file is made new (O_EXCL): a link or FIFO
    planted under a temp name is never written through. True when the plot was drawn."""
    fd, name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=f".tmp{path.suffix}", dir=path.parent)
    os.close(fd)  # the suffix tells matplotlib the format
    temp = Path(name)
    try:
        drawn = draw(*args, temp)
        if drawn:
            os.chmod(temp, NEW_FILE_MODE)  # mkstemp makes 0600; a plot is as readable as its report
            os.replace(temp, path)
        return bool(drawn)
    finally:
        temp.unlink(missing_ok=True)


def make_plots(run_dirs: list[Path], agg: pd.DataFrame, folder: Path, requests: pd.DataFrame) -> list[Figure]:
    """Every plot (kvbench.reports.plots.report_figures, each written through :func:`_plot`), each placed
    under the table it illustrates; ``requests``: the runs' request rows."""
    from kvbench.reports import plots  # matplotlib: 0.2-0.7 s of import, for the reports that plot

    return [Figure(title, path, section)
            for section, title, path in plots.report_figures(run_dirs, agg, requests, folder, draw=_plot)]


def _run_info(run_dir: Path) -> dict:
    """run.json, or a stand-in that says why it could not be read (the cells may still be intact)."""
    try:
        return load_run_info(run_dir)
    except ResultsReadError as exc:
        return {"run_id": run_dir.name, "status": f"unknown: {exc}"}


def build(run_dirs: list[str | Path], plots_dir: Path | None = None) -> Report:
    """The report of one or more runs; plots are written into ``plots_dir`` (None: no plots). Damaged
    records the loaders worked around (:class:`kvbench.store.errors.ResultsWarning`, e.g. a torn last line)
    are named in the run's header and in ``notes``, and warned again for the caller."""
    run_dirs = [Path(d) for d in run_dirs]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = _build(run_dirs, plots_dir)
    found: dict[str, ResultsWarning] = {}
    for w in caught:
        if isinstance(w.message, ResultsWarning):
            found.setdefault(str(w.message), w.message)
        else:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    for header, run_dir in zip(result.headers, run_dirs):
        details = [n.detail for n in found.values() if n.path.parent == run_dir]
        if details:
            header.append(("Damaged records", "; ".join(details)))
    result.notes = list(found)
    for note in found.values():
        warnings.warn(note, stacklevel=2)
    return result


def _build(run_dirs: list[Path], plots_dir: Path | None) -> Report:
    infos = [_run_info(d) for d in run_dirs]
    title = "kvbench run " + ", ".join(i["run_id"] for i in infos) if len(infos) == 1 else \
        "kvbench runs " + ", ".join(i["run_id"] for i in infos)
    headers = [run_header(i) for i in infos]
    cells = load(run_dirs, what="cells")
    if cells.empty:
        return Report(title, headers, [Section("none", "No cells", "", note="(no cells finished)")], [])
    agg = tables.aggregate(cells)
    agg["label"] = agg.backend if len(infos) == 1 else agg.run_id + ": " + agg.backend
    cap = caption(infos)
    repeats = REPEATS_NOTE if (agg.repeats > 1).any() else ""
    problems = tables.problems_table(agg)
    sections = [
        Section("findings", findings.TITLE, findings.INTRO, note=findings.note(agg)),  # first: what the run found
        Section("kv", "KV cache: predicted from the config vs reported by the engine", KV_INTRO + repeats,
                tables.kv_table(agg), tables.KV_RIGHT, cap, note=tables.kv_source_notes(agg)),
        Section("performance", "Latency and throughput", PERF_INTRO + repeats, tables.performance_table(agg), tables.PERF_RIGHT, cap),
        Section("prefix_cache", prefix_cache.TITLE, prefix_cache.INTRO,
                prefix_cache.prefix_cache_table(agg) if prefix_cache.recorded(agg) else None, prefix_cache.RIGHT,
                cap if prefix_cache.recorded(agg) else "",
                note="" if prefix_cache.recorded(agg) else prefix_cache.NOT_RECORDED),
        Section("boundary", "The KV boundary", BOUNDARY_INTRO, tables.boundary_table(agg), tables.BOUNDARY_RIGHT, cap),
        Section("problems", "Failed and flagged cells", "Cells whose engine failed, or whose requests broke the token contract "
                "(the reason is the error, then the flags).",
                problems if not problems.empty else None, tables.LEAD_RIGHT, cap if not problems.empty else "",
                note="" if not problems.empty else
                "No failed or flagged cells: every request's prompt and output token counts matched the engine's.",
                code_blocks=[(f"log tail of {cid}", tail) for cid, tail in tables.log_tails(agg)]),
        *_validation(run_dirs, infos),
    ]
    speculated = speculation.speculated(agg)
    # the request rows, read once for what needs them: the plots and the paired speculation table
    requests = load(run_dirs, what="requests") if plots_dir is not None or speculated else None
    if speculated:  # a run with a drafter: after the prefix cache
        sections.insert(_after(sections, "prefix_cache"), Section(
            "speculation", speculation.TITLE, speculation.INTRO, speculation.speculation_table(agg), speculation.RIGHT, cap))
        _paid_off_section(run_dirs, infos, cells, requests, sections, cap)
    sections.insert(_after(sections, "performance"), Section(  # decode against the bandwidth limit
        bandwidth.SECTION, bandwidth.TITLE, bandwidth.INTRO, bandwidth.bound_table(agg) if bandwidth.measured(agg)
        else None, bandwidth.RIGHT, cap if bandwidth.measured(agg) else "",
        note="" if bandwidth.measured(agg) else bandwidth.not_measured_note(agg)))
    _gpu_sections(sections, agg, cap)  # GPU runs only: memory per GPU, the planner against the boundary
    _startup_section(sections, infos, cap)  # the engines' own startup figures beside the plan's (run.json)
    if tables.deployments(agg):  # after the boundary: which replica of a deployment queued first
        lines = tables.queued_first_lines(agg)
        note = "\n".join(f"- {line}" for line in lines) or "(no finished deployment cells)"
        sections.insert(_after(sections, "boundary"),
                        Section("deployments", "Deployments: which replica queued first", DEPLOYMENT_INTRO, note=note))
    # the plots draw whole backends: a deployment's total, not its replicas beside it
    figures = make_plots(run_dirs, tables.totals(agg), plots_dir, requests) if plots_dir is not None else []
    _kv_quant_sections(run_dirs, infos, cells, sections, figures, plots_dir)
    return Report(title, headers, sections, figures)


def _paid_off_section(run_dirs: list[Path], infos: list[dict], cells: pd.DataFrame, requests: pd.DataFrame,
                      sections: list[Section], cap: str) -> None:
    """After the speculation section: each drafted cell against the same cell without a drafter."""
    from . import speculation_paired as paired

    records = {i["run_id"]: load_logprobs(d) for d, i in zip(run_dirs, infos) if (d / "logprobs").is_dir()}
    data = paired.rows(infos, cells, requests, records)
    table = paired.table(data)
    sections.insert(_after(sections, "speculation"), Section(
        "speculation_paid_off", paired.TITLE, paired.INTRO, table, paired.RIGHT, cap if table is not None else "",
        note=paired.note(data)))


def _kv_quant_sections(run_dirs: list[Path], infos: list[dict], cells: pd.DataFrame, sections: list[Section],
                       figures: list[Figure], plots_dir: Path | None) -> None:
    """A kv_quant run's section (bench/reports/kvquant.py), after the KV table, and its plot."""
    from . import kvquant

    at = _after(sections, "kv")
    for run_dir, info in zip(run_dirs, infos):
        quant = info.get("kv_quant")
        if not quant:
            continue
        mine = cells[cells.run_id == info["run_id"]] if "run_id" in cells else cells
        data = kvquant.rows(run_dir, mine, {label: q["baseline"] for label, q in quant.items()})
        notes = {label: ("not measured: synthetic prompts (the perplexity of random words means nothing)"
                         if q.get("prompt_text") != "kjv" else
                         "not measured: the engine returns no prompt log-probabilities") for label, q in quant.items()
                 if q.get("prompt_text") != "kjv" or not q.get("prompt_logprobs")}
        suffix = f" ({info['run_id']})" if len(run_dirs) > 1 else ""
        sections.insert(at, Section("kv_quant", "KV quantisation: bytes saved against output change" + suffix,
                                    kvquant.INTRO, kvquant.table(data, notes), kvquant.RIGHT, caption([info])))
        at += 1
        if plots_dir is not None:
            path = plots_dir / (f"kv_quant_{info['run_id']}.png" if len(run_dirs) > 1 else "kv_quant.png")
            plots_dir.mkdir(parents=True, exist_ok=True)
            if _plot(kvquant.plot, path, data):
                figures.append(Figure("KV quantisation: bytes saved against output change" + suffix, path, "kv_quant"))


def _after(sections: list[Section], section_id: str) -> int:
    """Where a section goes that follows the one with ``section_id`` (at the end where there is none)."""
    return next((i + 1 for i, s in enumerate(sections) if s.id == section_id), len(sections))


def _gpu_sections(sections: list[Section], agg: pd.DataFrame, cap: str) -> None:
    """After the KV boundary: memory per GPU and the planner's prediction beside the largest load served
    (bench/reports/gpu.py; rows measured on a GPU only)."""
    from . import gpu

    at = _after(sections, "boundary")
    memory = gpu.gpu_memory_table(agg)
    if memory is not None:
        sections.insert(at, Section("gpu_memory", "Memory per GPU: weights, KV and overhead", gpu.GPU_MEMORY_INTRO, memory,
                                    gpu.GPU_MEMORY_RIGHT, cap))
        planner = gpu.planner_table(agg)
        sections.insert(at + 1, Section("gpu_planner", "The planner against the real boundary",
                                        gpu.PLANNER_INTRO.format(margin=gpu.MARGIN), planner, gpu.PLANNER_RIGHT, cap))


def _startup_section(sections: list[Section], infos: list[dict], cap: str) -> None:
    """After the GPU sections (or the boundary): each checked engine start's figures beside the plan's
    (bench/reports/startup.py; run.json startup_checks), where the runs recorded any."""
    from . import startup

    if startup.recorded(infos):
        at = max(_after(sections, "boundary"), _after(sections, "gpu_planner") if any(
            s.id == "gpu_planner" for s in sections) else 0)
        sections.insert(at, Section("startup", startup.TITLE, startup.INTRO, startup.table(infos), startup.RIGHT, cap))


def write(run_dirs: list[Path], output: Path | None = None, html_file: Path | None = None,
          plots: bool = True) -> tuple[Path, Path, str]:
    """Write the Markdown report, its plots and the HTML page; returns (markdown path, HTML path, text).
    Default place: RUN_DIR/report.md for one run, results/reports/<ids>/report.md for several
    (:func:`output_paths`); the plots in :func:`plots_folder`."""
    return write_report(run_dirs, output, html_file, plots)[:3]


def plots_folder(output: Path) -> Path:
    """Where a report's plots go: each report its own folder beside it, ``plots/`` for ``report.md`` (a run
    folder's), ``<stem>_plots/`` for any other name, so that two reports in one folder never share one."""
    return output.parent / ("plots" if output.name == "report.md" else f"{output.stem}_plots")


def output_paths(run_dirs: list[Path], output: Path | None = None, html_file: Path | None = None,
                 plots: bool = True) -> tuple[Path, Path, Path | None]:
    """(Markdown, HTML, plots folder or None) of a report. Default place: RUN_DIR/report.md for one run,
    results/reports/<ids>/report.md for several; the HTML beside the Markdown."""
    run_dirs = [Path(d) for d in run_dirs]
    if output is None:
        folder = run_dirs[0] if len(run_dirs) == 1 else Path("results/reports") / "+".join(d.name for d in run_dirs)
        output = folder / "report.md"
    output = Path(output)
    return output, Path(html_file) if html_file else output.with_suffix(".html"), plots_folder(output) if plots else None


def check_outputs(output: Path, target_html: Path, plots_dir: Path | None) -> None:
    """Refuse (:class:`kvbench.common.files.OutputRefused`) before anything is written, when the report
    would go through a symbolic link, onto a FIFO, device or socket, or over a file kvbench did not write:
    the Markdown, the HTML page, their folders, the plots folder and the PNGs already in it."""
    if output.resolve() == target_html.resolve():
        raise OutputRefused(f"report {output}: the Markdown and the HTML page would be one file (give -o a .md name)")
    for folder in dict.fromkeys([output.parent, target_html.parent]):
        check_output_folder(folder, "report folder")
    check_output(output, kvbench_markdown, "report")
    check_output(target_html, kvbench_html, "HTML page")
    if plots_dir is not None:
        pngs = {p.name: kvbench_png for p in plots_dir.glob("*.png")} if plots_dir.is_dir() else {}
        check_output_folder(plots_dir, "plots folder", pngs)


def write_report(run_dirs: list[Path], output: Path | None = None, html_file: Path | None = None,
                 plots: bool = True) -> tuple[Path, Path, str, Report]:
    """:func:`write`, and the report itself (for the terminal: bench/reports/terminal.py). Refused
    (:class:`~kvbench.common.files.OutputRefused`, nothing written) where :func:`check_outputs` says so."""
    from kvbench.reports import html, markdown

    run_dirs = [Path(d) for d in run_dirs]
    output, target_html, plots_dir = output_paths(run_dirs, output, html_file, plots)
    check_outputs(output, target_html, plots_dir)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        result = build(run_dirs, plots_dir)
        text = markdown.render(result, output.parent)
        # replaced whole: a full disk leaves the previous report, never a truncated one
        atomic_write_text(output, text)
        target_html.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(target_html, html.render(result))
    except ResultsWriteError:
        raise
    except OSError as exc:
        raise ResultsWriteError(output.parent, "writing the report", exc, intact=False, what="report folder") from exc
    return output, target_html, text, result
