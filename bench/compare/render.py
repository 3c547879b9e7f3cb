"""A comparison as people and CI read it: the table, the verdict line, Markdown, JSON and an HTML page with
the forest plot."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from kvbench.common import stats
from kvbench.kv.units import fmt_bytes
from kvbench.run.cells import load_label

# --- as a table ------------------------------------------------------------------------------------------

def _fmt_value(v, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "B":
        return fmt_bytes(v)
    if unit == "s":
        return f"{v:,.4f} s"
    if unit == "share":
        return f"{v:.1%}"
    return f"{v:,.3f}/s"


def _pct(x) -> str:
    return "-" if x is None else f"{x * 100:+.1f}%"


def _where(key: dict) -> str:
    parts = [f"{key.get('engine', '')}"]
    if key.get("variant"):
        parts.append(key["variant"])
    if "prompt_tokens" in key:
        parts.append(f"p{key['prompt_tokens']}")
    parts.append(load_label(key.get("load_profile", "concurrent"), key.get("concurrency"), key.get("request_rate")))
    return " ".join(str(p) for p in parts if p != "")


def results_frame(result: dict) -> pd.DataFrame:
    """One row per (cell, metric): the table ``kvbench compare`` prints."""
    rows = []
    for c in result["cells"]:
        for m in c["metrics"]:
            rows.append({
                "cell": _where(c["key"]),
                "backends": f"{c['baseline_backend']} -> {c['candidate_backend']}",
                "metric": m["metric"], "baseline": _fmt_value(m["baseline"], m["unit"]),
                "candidate": _fmt_value(m["candidate"], m["unit"]), "change": _pct(m["change"]),
                f"{result['confidence']:.0%} CI": "-" if m["ci_low"] is None else
                f"[{_pct(m['ci_low'])}, {_pct(m['ci_high'])}]",
                "tolerance": _tol(m["tolerance"]),
                "verdict": m["verdict"].upper() if m["verdict"] == "regression" else m["verdict"],
                "how": m["method"] or m["note"]})
    return pd.DataFrame(rows)


def _tol(t: float) -> str:
    return f"{t:.0%}" if t * 100 == round(t * 100) else f"{t:.1%}"


def verdict_line(result: dict) -> str:
    """The verdict, its exit code and summary, and for an inconclusive one how many repeats would settle it."""
    s = result["summary"]
    line = (f"**{result['verdict']}** (exit {result['exit_code']}): {s['regression']} regressions, "
            f"{s['improvement']} improvements, {s['inconclusive']} inconclusive, {s['unchanged']} unchanged, "
            f"{s['not_compared']} not compared (metrics over {s['compared_cells']} cells compared); "
            f"{s['failed_on_candidate']} cells failed on the candidate only, {s.get('failed_on_baseline', 0)} on the "
            f"baseline or both; {s['only_in_baseline']} only in the baseline, {s['only_in_candidate']} only in the "
            f"candidate, {s['contract_mismatch']} with different token contracts"
            + (f", {s['cache_mismatch']} warm against cold (prefix cache)" if s.get("cache_mismatch") else "") + ".")
    settle = result.get("settle") or {}
    if settle.get("inconclusive"):
        line += " " + settle_sentence(settle)
    if result["verdict"] in ("inconclusive", "improvement") and result["exit_code"] == 0:
        line += " Passed as asked: no evidence of a regression (--pass-unless-regression)."
    return line


def settle_sentence(settle: dict) -> str:
    """ "Settling the 40 inconclusive metrics needs about N repeats per side at the noise seen ..." """
    how = "pairs" if settle["paired"] else "repeats per side"
    parts = []
    if settle["median"] is not None:
        most = (f", {settle['most']} for all of them" if settle["most"] != settle["median"] and not settle["beyond"]
                else "")
        parts.append(f"settling the {settle['inconclusive']} inconclusive metrics needs about {settle['median']} "
                     f"{how} for half of them{most} at the noise these repeats saw, were the changes to stay "
                     f"(this run has {settle['repeats_now']})")
    if settle["beyond"]:
        parts.append(f"{settle['beyond']} would need more than 1000 (a change close to its tolerance)")
    if settle["no_noise"]:
        parts.append(f"{settle['no_noise']} had one repeat per side: no run-to-run noise to size from (--repeats 3 or more)")
    text = "; ".join(parts)
    return text[0].upper() + text[1:] + "."


def repeats_lines(result: dict) -> list[str]:
    """ "5 % on TTFT p50 needs about N repeats here" per metric, from the noise of the repeats."""
    out = []
    for r in result.get("repeats_needed", []):
        how = "pairs" if r["paired"] else "repeats per side"
        if r["median"] is None:
            out.append(f"{_tol(r['tolerance'])} on {r['metric']} needs more than 1000 {how} at the noise seen here")
            continue
        worst = (f", {r['worst']} in the noisiest of its {r['cells']} cells" if r["worst"] not in (None, r["median"])
                 else "" if r["worst"] is not None else ", more than 1000 in the noisiest cell")
        out.append(f"{_tol(r['tolerance'])} on {r['metric']} needs about {r['median']} {how} here{worst} "
                   f"(this run has {r['repeats_now']})")
    return out


def _contracts(contracts: list[str]) -> str:
    return "; ".join(c or "not recorded" for c in contracts) or "not recorded"


def failed(f: dict) -> str:
    return f"{_where(f['key'])}: failed on the {f['failed_on']}" + (f" ({f['errors'][0]})" if f["errors"] else "")


def markdown(result: dict) -> str:
    """The verdict and its summary first, then any warning, then the table and the lists."""
    from kvbench.common.markdown import md_table

    ci = f"{result['confidence']:.0%} CI"
    out = [f"# kvbench compare: {', '.join(result['baseline']['runs'])}"
           + (f" [{result['baseline']['backend']}]" if result['baseline']['backend'] else "")
           + f" -> {', '.join(result['candidate']['runs'])}"
           + (f" [{result['candidate']['backend']}]" if result['candidate']['backend'] else ""),
           verdict_line(result)]
    for w in result.get("warnings", []):
        out.append(f"> **WARNING** {w}")
    frame = results_frame(result)
    methods = {m["method"] or "" for c in result["cells"] for m in c["metrics"]}
    notes = [f"Cells matched on: {', '.join(result['match_on'])}. Change = candidate / baseline - 1 (ratio of "
             f"geometric means); intervals on the log of the ratio; a regression only when the whole {ci} lies "
             f"beyond the tolerance on the worse side. Repeats: {result.get('pairing', '')}."]
    if any(m.startswith(stats.SINGLE_RUN) for m in methods):
        notes.append(f"Intervals marked \"{stats.SINGLE_RUN}\" come from the requests of one run per side: they "
                     "show how requests vary, not how a repeated run would, and are narrower than the truth when "
                     "runs differ; run with --repeats 3 or more for a verdict on runs.")
    needed = repeats_lines(result)
    if needed:
        notes.append("Repeats needed for the interval to be as narrow as the tolerance, at the noise of these "
                     "repeats:\n\n" + "\n".join(f"- {line}" for line in needed))
    out += notes
    if not frame.empty:
        out.append(md_table(frame, {"baseline", "candidate", "change", ci, "tolerance"}))
    for title, items, fmt in (
            ("Failed on the candidate only (counted as regressions)",
             [f for f in result["failed"] if f["failed_on"] == "candidate"], failed),
            ("Failed on the baseline or on both (not compared)",
             [f for f in result["failed"] if f["failed_on"] != "candidate"], failed),
            ("Different token contracts (not compared)", result["contract_mismatch"],
             lambda f: f"{_where(f['key'])}: baseline {_contracts(f['baseline_contract'])}, "
                       f"candidate {_contracts(f['candidate_contract'])}"),
            ("Served from the prefix cache on one side only" + (
                "" if all(f.get("compared") for f in result.get("cache_mismatch", [])) else " (not compared)"),
             result.get("cache_mismatch", []),
             lambda f: f"{_where(f['key'])}: baseline {f['baseline_cache']}, candidate {f['candidate_cache']}"
                       + (" (compared: --allow-cache-mismatch)" if f.get("compared") else
                          "; compare with --allow-cache-mismatch")),
            ("Only in the baseline (not compared)", result["only_in_baseline"],
             lambda f: f"{_where(f['key'])} ({f['baseline_backend']})"),
            ("Only in the candidate (not compared)", result["only_in_candidate"],
             lambda f: f"{_where(f['key'])} ({f['candidate_backend']})")):
        if items:
            out.append(f"## {title}\n\n" + "\n".join(f"- {fmt(i)}" for i in items))
    return "\n\n".join(out) + "\n"


# --- files: Markdown, JSON and an HTML page with the forest plot ----------------------------------------

def write_html(result: dict, path: Path, plot: Path | None = None) -> Path:
    """compare.html: the verdict, warnings, the forest plot (embedded) and the table, self-contained."""
    from kvbench.reports import html, plots

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    plot = plot or path.with_name(path.stem + "_forest.png")
    made = plots.forest(result, plot, _where)
    path.write_text(html.render_compare(result, results_frame(result), made, repeats_lines(result),
                                        verdict_line(result)))
    return path


def write_outputs(result: dict, text: str, folder: Path) -> list[Path]:
    """compare.md, compare.json, compare_forest.png and compare.html in ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "compare.md").write_text(text)
    (folder / "compare.json").write_text(json.dumps(result, indent=2) + "\n")
    write_html(result, folder / "compare.html", folder / "compare_forest.png")
    return [folder / n for n in ("compare.md", "compare.json", "compare.html", "compare_forest.png")]
