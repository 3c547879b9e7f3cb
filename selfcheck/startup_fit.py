"""The engines' fitted startup constants, fitted on the public startup logs and checked where they were not fitted.

    python -m kvbench.selfcheck.startup_fit            # each constant: shipped, fitted, range, sources; accuracy
    python -m kvbench.selfcheck.startup_fit --write    # rewrite each engine's fitted.toml from the corpus

A constant no engine source states (an engine module's ``FITTED``, declared in its ``FITS`` with the logged figure
that measures it, :class:`kvbench.kv.startup.FittedConstant`) is read back from every log that measures it: the
value that makes the planned figure equal the logged one, all else as shipped. Its fit is the median over its
sources (each source's logs count once, as their median), its range the sources' lowest and highest.

Leave one source out: each source's logs are planned with every constant fitted on the other sources only, the
answer a user whose deployment kvbench never saw gets. :func:`accuracy` gives the mean absolute error and the
worst case per engine and per class of that answer; docs/plan.md shows them and
tests/planner/test_startup_fit.py fails when either grows past bench/planner/startup_accuracy.toml.
"""
from __future__ import annotations

import contextlib
import statistics
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from kvbench.selfcheck import startup_logs as sl

ROUND = 4  # significant digits a fit is written with
ACCURACY_FILE = sl.ROOT / "bench" / "planner" / "startup_accuracy.toml"  # read by the planner's verdict line


@dataclass(frozen=True)
class Fit:
    engine: str
    key: str
    unit: str
    value: float | None  # None: no log measures it
    low: float | None
    high: float | None
    sources: tuple[str, ...]
    deployments: int  # distinct (source, GPU, model) among the logs that measure it

    def as_toml(self) -> dict:
        out = {"value": self.value, "unit": self.unit, "sources": list(self.sources), "deployments": self.deployments}
        if self.low is not None:
            out.update(low=self.low, high=self.high)
        return {k: v for k, v in out.items() if v is not None}


def engines_with_constants() -> dict[str, object]:
    """{engine: its startup-rule module} for every engine whose rule declares fitted constants."""
    from kvbench.planner import engines
    from kvbench.selfcheck.engines import startup_rule_module
    out = {}
    for engine in engines():
        module = startup_rule_module(engine)
        if module is not None and getattr(module, "FITS", ()) and module not in out.values():
            out[engine] = module  # Ollama runs llama.cpp's rule: its constants are llama.cpp's
    return out


@contextlib.contextmanager
def patched(values: dict[tuple[str, str], float]):
    """The engines' FITTED constants replaced by ``values`` ({(engine, key): value}) for the block."""
    modules = engines_with_constants()
    saved = {}
    try:
        for (engine, key), value in values.items():
            fitted = modules[engine].FITTED
            saved[(engine, key)] = fitted[key]
            fitted[key] = value
        yield
    finally:
        for (engine, key), value in saved.items():
            modules[engine].FITTED[key] = value


def _figure(entry: dict, key: str) -> float | None:
    value = sl.figures(entry).get(key)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def implied(entry: dict, engine: str, fc, current: float) -> float | None:
    """The value of the constant ``fc`` that makes this log's planned figure equal its logged one (everything
    else as in force), or None where the log does not measure it (no such figure, or the figure does not move with
    the constant). Two secant steps: the figures are affine in each constant, or the larger of two affine terms."""
    logged = entry.get("logged", {})
    key = next((k for k in fc.logged if k in logged), None)
    if key is None and fc.from_pool and "pool" in entry["checks"] and "kv_gib" in logged:
        key = "kv_gib"
    if key is None or entry["engine"] != engine:
        return None
    target = float(logged[key])
    v0, v1 = current, (current * 1.25 if current else 1.0)
    for _ in range(3):
        with patched({(engine, fc.key): v0}):
            f0 = _figure(entry, key)
        with patched({(engine, fc.key): v1}):
            f1 = _figure(entry, key)
        if f0 is None or f1 is None or abs(f1 - f0) < 1e-9:
            return None
        step = (target - f0) * (v1 - v0) / (f1 - f0)
        if abs(step) <= 1e-6 * max(1.0, abs(v0)):
            return v0
        v0, v1 = v0 + step, v0
    return v0


def measurements(entries: list[dict]) -> dict[tuple[str, str], list[tuple[dict, float]]]:
    """{(engine, key): [(entry, implied value)]} for every log that measures a constant. A log whose pool is the
    only figure measures the first ``from_pool`` constant it moves (the engine's FITS order), not all of them."""
    out: dict[tuple[str, str], list[tuple[dict, float]]] = defaultdict(list)
    for engine, module in engines_with_constants().items():
        for entry in (e for e in entries if e["engine"] == engine):
            pool_taken = False
            for fc in module.FITS:
                direct = any(k in entry.get("logged", {}) for k in fc.logged)
                if not direct and (pool_taken or not fc.from_pool):
                    continue
                value = implied(entry, engine, fc, module.FITTED[fc.key])
                if value is not None:
                    out[(engine, fc.key)].append((entry, value))
                    pool_taken = pool_taken or not direct
    return out


def _round(x: float) -> float:
    return float(f"{x:.{ROUND}g}")


def fit(measured: dict, leave_out: str | None = None) -> dict[tuple[str, str], Fit]:
    """Each constant fitted on its measurements (less the source ``leave_out``): the median of its sources'
    medians. A constant no other source measures keeps no value (None)."""
    modules = engines_with_constants()
    out = {}
    for engine, module in modules.items():
        for fc in module.FITS:
            rows = [(e, v) for e, v in measured.get((engine, fc.key), []) if e["source_id"] != leave_out]
            by_source: dict[str, list[float]] = defaultdict(list)
            for e, v in rows:
                by_source[e["source_id"]].append(v)
            medians = [statistics.median(vs) for vs in by_source.values()]
            deployments = len({(e["source_id"], e.get("gpu"), e.get("model")) for e, _ in rows})
            value = _round(statistics.median(medians)) if medians else None
            out[(engine, fc.key)] = Fit(engine, fc.key, fc.unit, value, _round(min(medians)) if medians else None,
                                        _round(max(medians)) if medians else None, tuple(sorted(by_source)),
                                        deployments)
    return out


class _Reads(dict):
    """An engine's FITTED that remembers the keys read (which constants a plan used)."""

    def __init__(self, values: dict):
        super().__init__(values)
        self.read: set[str] = set()

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)


@contextlib.contextmanager
def reading():
    """The engines' FITTED swapped for :class:`_Reads` for the block: {engine: the keys read}."""
    modules = engines_with_constants()
    saved = {engine: module.FITTED for engine, module in modules.items()}
    reads = {engine: _Reads(fitted) for engine, fitted in saved.items()}
    try:
        for engine, module in modules.items():
            module.FITTED = reads[engine]
        yield reads
    finally:
        for engine, module in modules.items():
            module.FITTED = saved[engine]


def loso_figures(entries: list[dict]) -> dict[str, dict]:
    """{file: its figures planned with each constant fitted without the log's own source}. A log whose plan reads
    a constant that only its own source measures has no such figures: {"only_its_own_source": [the constants]}
    (the shipped value would be its own source's, a fit on itself)."""
    measured = measurements(entries)
    everywhere = fit(measured)
    out = {}
    for source in sorted({e["source_id"] for e in entries}):
        fits = fit(measured, leave_out=source)
        values = {k: f.value for k, f in fits.items() if f.value is not None}
        alone = {k for k, f in fits.items() if f.value is None and everywhere[k].value is not None}
        with reading() as reads, patched(values):
            for e in (e for e in entries if e["source_id"] == source):
                for r in reads.values():
                    r.read.clear()
                figures = sl.figures(e)
                used = sorted(key for engine, key in alone if key in reads[engine].read)
                out[e["file"]] = {"only_its_own_source": used} if used else figures
    return out


def all_rows(folder: Path = sl.CORPUS) -> list[sl.Row]:
    """Every check of the corpus, each log's left-out column planned with every constant fitted without its source."""
    entries = sl.corpus(folder)
    held = loso_figures(entries)
    return [r for e in entries for r in sl.rows_for(e, held.get(e["file"]))]


def write(entries: list[dict], rounds: int = 6) -> list[Path]:
    """Refit every constant on ``entries`` and rewrite each engine's fitted.toml (beside its startup rule), until
    the fit no longer moves (each constant is read back with the others as fitted)."""
    import tomli_w
    modules = engines_with_constants()
    for _ in range(rounds):
        fits = fit(measurements(entries))
        moved = False
        for (engine, key), f in fits.items():
            record = modules[engine].FIT_RECORDS
            old = record.get(key, {})
            if f.value is None:  # measured by no log: kept as it was, said so
                record[key] = {**old, "sources": [], "deployments": 0, "unit": f.unit}
                record[key].pop("low", None), record[key].pop("high", None)
            else:
                moved = moved or old.get("value") != f.value
                record[key] = f.as_toml()
                modules[engine].FITTED[key] = f.value
        if not moved:
            break
    written = []
    head = ("# Written by `python -m kvbench.selfcheck.startup_fit --write` from tests/data/startup_logs/: each constant "
            "the\n# median over the sources whose logs measure it, its range the sources' lowest and highest; a "
            "constant\n# no log measures keeps its value with no source. Do not edit by hand.\n")
    for module in modules.values():
        path = Path(module.__file__).with_name("fitted.toml")
        path.write_text(head + tomli_w.dumps(dict(sorted(module.FIT_RECORDS.items()))))
        written.append(path)
    acc = accuracy(all_rows())
    ACCURACY_FILE.write_text("# The leave-one-source-out accuracy of the startup rules on this corpus, written by `python -m "
                             "kvbench.selfcheck.startup_fit --write`:\n# tests/planner/test_startup_fit.py fails when a "
                             "group's mean or worst error grows past it, or fewer verdicts are right.\n"
                             + tomli_w.dumps({k: {f: v for f, v in a.items() if v is not None} for k, a in acc.items()}))
    written.append(ACCURACY_FILE)
    return written


# --- accuracy ----------------------------------------------------------------------------------------------------

#: The checks of an engine that allocates what it needs (llama.cpp): its buffers, not a pool from a budget
BUFFERS = ("KV cache", "compute buffer", "free at load")


def accuracy(rows: list[sl.Row], loso: bool = True) -> dict[str, dict]:
    """Mean absolute error and worst case of the planned KV pool (GiB, and % of the logged), per engine and per
    class, with each source left out of the fit (``loso``) or as shipped; verdicts (refusals, requests at the
    limit) counted right."""
    groups: dict[str, list[sl.Row]] = defaultdict(list)
    for r in rows:
        if r.check in ("KV pool", "requests at the limit", "refusal", "pool tokens") + BUFFERS:
            groups[f"engine {r.engine}"].append(r)
            for c in r.classes:
                groups[f"class {c}"].append(r)
            if r.klass:
                groups[f"rule {r.klass}"].append(r)
    out = {}
    for name, rs in sorted(groups.items()):
        pools = [(r, r.error(loso)) for r in rs if r.check == "KV pool" and r.error(loso) is not None]
        pct = [abs(err) / max(abs(float(r.logged)), 1.0) * 100 for r, err in pools]
        buffers = [r for r in rs if r.check in BUFFERS and (r.ok_loso if loso else r.ok) is not None]
        rs = [r for r in rs if r.check not in BUFFERS]
        verdicts = [r for r in rs if r.check != "KV pool" and (r.ok_loso if loso else r.ok) is not None]
        worst = max(pools, key=lambda p: abs(p[1]), default=None)
        blind = [r for r in rs if r.check == "KV pool" and r.error(loso) is None and r.error(False) is not None]
        out[name] = {"pools": len(pools), "sources": len({r.source_id for r, _ in pools}),
                     "pools_own_source_only": len(blind),
                     "mae_gib": round(statistics.fmean(abs(e) for _, e in pools), 3) if pools else None,
                     "mape_pct": round(statistics.fmean(pct), 1) if pct else None,
                     "worst_gib": round(abs(worst[1]), 3) if worst else None,
                     "worst_log": worst[0].log.removesuffix(".toml") if worst else None,
                     "within_tolerance": sum(bool(r.ok_loso if loso else r.ok) for r, _ in pools),
                     "verdicts": len(verdicts),
                     "verdicts_right": sum(bool(r.ok_loso if loso else r.ok) for r in verdicts),
                     "buffers": len(buffers), "buffers_logs": len({r.log for r in buffers}),
                     "buffers_within": sum(bool(r.ok_loso if loso else r.ok) for r in buffers)}
    return out


def accuracy_table(acc: dict[str, dict]) -> str:
    lines = ["| engine / class | pools | not planned | mean abs. error | mean abs. % | worst | worst log | "
             "within 5 % or 0.5 GiB | verdicts right | buffers within |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, a in acc.items():
        fmt = lambda v, u="": "" if v is None else f"{v}{u}"  # noqa: E731
        lines.append(f"| {name} | {a['pools']} | {a.get('pools_own_source_only', 0) or ''} | "
                     f"{fmt(a['mae_gib'], ' GiB')} | {fmt(a['mape_pct'], ' %')} | "
                     f"{fmt(a['worst_gib'], ' GiB')} | {a['worst_log'] or ''} | {a['within_tolerance']}/{a['pools']} | "
                     f"{a['verdicts_right']}/{a['verdicts']} | {a.get('buffers_within', 0)}/{a.get('buffers', 0)} |")
    return "\n".join(lines)


def fits_table(fits: dict[tuple[str, str], Fit]) -> str:
    modules = engines_with_constants()
    lines = ["| engine | constant | shipped | fitted | range | sources | deployments |", "|---|---|---|---|---|---|---|"]
    for (engine, key), f in sorted(fits.items()):
        shipped = modules[engine].FITTED[key]
        rng = "" if f.low is None else f"{f.low:g}-{f.high:g}"
        lines.append(f"| {engine} | {key} | {shipped:g} | {'' if f.value is None else f'{f.value:g}'} {f.unit} | "
                     f"{rng} | {len(f.sources)} | {f.deployments} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    entries = sl.corpus()
    if "--write" in argv:
        for path in write(entries):
            print(f"wrote {path}")
        return 0
    fits = fit(measurements(entries))
    print(fits_table(fits))
    print()
    rows = all_rows()
    print(sl.table(rows))
    print()
    print(sl.summary(rows))
    print("\nEach source left out of the fit:\n")
    print(accuracy_table(accuracy(rows)))
    print("\nAs shipped (fitted on every source):\n")
    print(accuracy_table(accuracy(rows, loso=False)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
