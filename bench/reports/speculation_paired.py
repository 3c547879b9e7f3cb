"""Did speculation pay off? Each cell of a backend started with a drafter beside the same cell of the run's
backend of the same engine serving the same weights without one: the same prompts (a cell's prompts are
built from the workload's seed, the run's salt and the cell, never the backend: bench/run/cells.py), so
request ``i`` of one is request ``i`` of the other, and their latencies pair up (docs/speculation.md).

Pure functions of a run's records: ``run.json`` (the backends and the weights each served), cells and requests.
"""
from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd

from kvbench.backends.options import SPECULATION_KEYS
from kvbench.common import stats
from kvbench.common.divergence import Divergence, compare_requests
from kvbench.store.schema import OK_STATUSES

from .tables import fmt_int, load_label

TITLE = "Speculation against the same cells without it: did it pay off?"
INTRO = ("Each cell of a backend started with a drafter beside the same cell (same prompts, same seed and salt, "
         "same KV dtype) of the run's backend of the same engine and version that served the same weights "
         "without one. Requests are paired by their place in the cell (request i of both got the same prompt; "
         "repeats pooled); a change is with / without - 1 on each pair, and its interval a paired t-interval "
         "on the log ratio over the pairs (95 %). E2E: a request's whole time; TPOT: its decode time per "
         "output token after the first; TTFT: its first token (the drafter's own prefill is in it). Throughput: "
         "the cells' output tokens/s over their wall time (one value a repeat: an interval only with 2 or more "
         "repeats). Verdict on TPOT, the decode where a drafter acts (TTFT differs between two engine starts "
         "for reasons of their own): paid off where the whole interval is below 0, cost where above, else no "
         "clear change; a gain larger than the target's passes the accepted drafts saved (1 - target passes a "
         "token) is not the drafter's and is said so. KV bytes/token and pool tokens: the engine's own pool, with / without the drafter "
         "(where the drafter's KV shares the target's pool, the pool holds fewer tokens). Output identical: the "
         "share of paired requests whose greedy tokens are all the same with and without the drafter, and the "
         "earliest position where one differs (where the run recorded each request's tokens: a kv_quant run; a "
         "lossless drafter changes none, batched verification may round differently). A cell none of whose "
         "drafts were accepted gets no verdict: the target took every step itself, so a change there is the "
         "two engine starts' (the interval covers the requests' noise, not theirs: --repeats shows it).")
RIGHT = {"prompt", "conc", "pairs", "acceptance", "E2E change", "TPOT change", "TTFT change", "throughput change",
         "KV bytes/token", "pool tokens", "output identical"}
CONFIDENCE = 0.95
# No accepted draft saved the target a step: a change is another engine start's, not the drafter's (the
# interval covers the requests' noise only); on a CPU such a cell read -14 % TPOT, interval below 0.
NOTHING_ACCEPTED = "nothing accepted: a change is not speculation's"
NOT_REPORTED = "acceptance not reported: no verdict"
_REPEAT = re.compile(r"_r\d+$")


def _plain_options(options: dict) -> dict:
    return {k: v for k, v in (options or {}).items() if k not in SPECULATION_KEYS}


def partners(info: dict) -> dict[str, str | None]:
    """{label of a backend of the run started with a drafter: the label of the backend of the same engine and
    version that served the same weights without one (None: the run has none)}. Of several such, the one
    whose other options are the drafter's."""
    backends = [b for b in info.get("backends") or [] if isinstance(b, dict) and b.get("label")]
    served = info.get("served_models") or {}
    out = {}
    for b in backends:
        if str((b.get("options") or {}).get("speculative", "none")) == "none":
            continue
        weights = served.get(b["label"])
        same = [p for p in backends if p is not b and p.get("engine") == b.get("engine")
                and p.get("version") == b.get("version") and weights and served.get(p["label"]) == weights
                and str((p.get("options") or {}).get("speculative", "none")) == "none"]
        same.sort(key=lambda p: _plain_options(p.get("options")) != _plain_options(b.get("options")))
        out[b["label"]] = same[0]["label"] if same else None
    return out


def _cell_key(cell_id: str, label: str) -> str:
    """A cell's id without its backend and repeat: the same for the same cell of every backend of a run."""
    return _REPEAT.sub("", cell_id[len(label):])


def _tpot(r) -> float:
    out = r.output_tokens_received
    if pd.isna(r.e2e_s) or pd.isna(r.ttft_s) or pd.isna(out) or out < 2:
        return math.nan
    return (r.e2e_s - r.ttft_s) / (out - 1)


def paired_requests(requests: pd.DataFrame, with_cells: list[str], without_cells: list[str]) -> pd.DataFrame:
    """The served requests of the cells with a drafter joined to those of the same cells without, by
    (repeat, place in the cell): columns ``<metric>_with`` and ``<metric>_without`` of e2e, ttft, tpot."""
    def side(cell_ids):
        r = requests[requests.cell_id.isin(cell_ids) & ~requests.warmup.astype(bool)]
        r = r[r.error.isna() | (r.error == "")] if "error" in r else r
        return pd.DataFrame({"repeat": r.repeat.values, "ordinal": r.ordinal.values, "e2e": r.e2e_s.values,
                             "ttft": r.ttft_s.values, "tpot": [_tpot(x) for x in r.itertuples()]})
    a, b = side(with_cells), side(without_cells)
    if a.empty or b.empty:
        return pd.DataFrame(columns=["repeat", "ordinal"])
    return a.merge(b, on=["repeat", "ordinal"], suffixes=("_with", "_without")).dropna(subset=["ordinal"])


def paired_change(pairs: pd.DataFrame, metric: str) -> stats.Interval | str:
    """with / without - 1 over the pairs and its paired interval, or why there is none."""
    keep = pairs[[f"{metric}_with", f"{metric}_without"]].astype(float).dropna()
    keep = keep[(keep > 0).all(axis=1)]
    if len(keep) < 2:
        return f"{len(keep)} pair(s): no interval"
    return stats.paired_relative_change(keep[f"{metric}_without"].tolist(), keep[f"{metric}_with"].tolist(),
                                        CONFIDENCE)


def _throughput_change(with_rows: pd.DataFrame, without_rows: pd.DataFrame) -> stats.Interval | str:
    a = with_rows.set_index("repeat").output_tokens_per_s.dropna()
    b = without_rows.set_index("repeat").output_tokens_per_s.dropna()
    both = sorted(set(a.index) & set(b.index))
    if not both or min(a[both].min(), b[both].min()) <= 0:
        return "not measured"
    if len(both) < 2:
        change = float(a[both].iloc[0] / b[both].iloc[0] - 1)
        return stats.Interval(change, math.nan, math.nan, "one repeat", 1, 1, CONFIDENCE)
    return stats.paired_relative_change(b[both].tolist(), a[both].tolist(), CONFIDENCE)


def verdict(tpot: stats.Interval | str, saved: float | None = None) -> str:
    """On the decode time per token: ``saved`` is the share of the target's passes the accepted drafts saved
    (None: not known), the most a drafter can take off it. On 2 cores an n-gram cell with 4.7 % of its drafts
    accepted read E2E -45 % and TTFT -65 % (TPOT +29 %): the two engine starts', which no drafter explains."""
    if isinstance(tpot, str):
        return "no interval"
    if tpot.high < 0:
        if saved is not None and tpot.high < -saved:
            return f"faster than its accepted drafts explain ({saved:.1%} of the target's passes saved): not speculation's"
        return "paid off"
    if tpot.low > 0:
        return "cost"
    return "no clear change"


def _pool(rows: pd.DataFrame) -> tuple[float, float]:
    """(bytes a token of the engine's pool, tokens in the pool), means over repeats; nan where not reported."""
    b, t = rows.kv_pool_bytes_engine.astype(float), rows.kv_pool_tokens_engine.astype(float)
    per = (b / t).where(t > 0)
    return float(per.mean()), float(t.mean())


def output_change(records: dict[str, dict], with_cells: list[str], without_cells: list[str]) -> Divergence | None:
    """The drafted cells' greedy outputs against the same cells' without a drafter, where the run recorded
    each request's tokens (a kv_quant run's logprobs/): a lossless drafter changes none. Cells pair by repeat."""
    mine, theirs = {}, {}
    for a, b in zip(sorted(with_cells, key=_repeat), sorted(without_cells, key=_repeat)):
        if _repeat(a) == _repeat(b) and a in records and b in records:
            mine.update({f"{a}:{k}": v for k, v in records[a].items()})
            theirs.update({f"{a}:{k}": v for k, v in records[b].items()})
    return compare_requests(theirs, mine) if mine else None


def _repeat(cell_id: str) -> str:
    found = _REPEAT.search(cell_id)
    return found.group(0) if found else ""


def rows(infos: list[dict], cells: pd.DataFrame, requests: pd.DataFrame,
         records: dict[str, dict] | None = None) -> list[dict]:
    """One dict per (run, backend with a drafter, cell) whose run has the plain partner: the figures of the
    table, unformatted (intervals as :class:`stats.Interval` or the reason for none). ``records``: {run id:
    its per-request tokens (kvbench.store.readers.load_logprobs)} where the runs recorded them."""
    out = []
    for info in infos:
        run_id = info.get("run_id")
        tokens = (records or {}).get(run_id) or {}
        mine = cells[cells.run_id == run_id] if "run_id" in cells else cells
        theirs = requests[requests.run_id == run_id] if "run_id" in requests else requests
        if "replica" in mine:
            mine = mine[mine.replica.fillna("") == ""]
        for label, partner in partners(info).items():
            spec = mine[mine.backend == label]
            for key, group in spec.groupby(spec.cell_id.map(lambda c: _cell_key(c, label)), sort=False):
                first = group.iloc[0]
                row = {"run_id": run_id, "backend": label, "partner": partner, "variant": first.variant,
                       "prompt_tokens": first.prompt_tokens, "load": load_label(first), "kv_dtype": first.kv_dtype,
                       "spec_method": first.spec_method}
                plain = mine[(mine.backend == partner) & (mine.cell_id.map(lambda c: _cell_key(c, partner)) == key)] \
                    if partner else mine.iloc[0:0]
                ok, plain_ok = group[group.status.isin(OK_STATUSES)], plain[plain.status.isin(OK_STATUSES)]
                if partner is None:
                    row["missing"] = "no backend of the same engine serving the same weights without a drafter"
                elif ok.empty or plain_ok.empty:
                    row["missing"] = "a side failed" if not plain.empty else f"{partner} has no such cell"
                else:
                    pairs = paired_requests(theirs, ok.cell_id.tolist(), plain_ok.cell_id.tolist())
                    row |= {"pairs": len(pairs), "acceptance": ok.spec_acceptance_rate.astype(float).mean(),
                            **{m: paired_change(pairs, m) for m in ("e2e", "tpot", "ttft")},
                            "throughput": _throughput_change(ok, plain_ok),
                            "pool_with": _pool(ok), "pool_without": _pool(plain_ok),
                            "output": output_change(tokens, ok.cell_id.tolist(), plain_ok.cell_id.tolist())}
                    accepted = ok.spec_accepted_tokens.astype(float)
                    passes = ok.spec_steps_per_output_token.astype(float).mean()
                    saved = None if np.isnan(passes) else 1 - passes
                    row["verdict"] = (verdict(row["tpot"], saved) if accepted.notna().any() and accepted.sum() > 0
                                      else NOTHING_ACCEPTED if accepted.notna().any() else NOT_REPORTED)
                out.append(row)
    return out


def _change(x) -> str:
    if isinstance(x, str):
        return x
    if math.isnan(x.low):
        return f"{x.change:+.1%}"
    return f"{x.change:+.1%} [{x.low:+.1%}, {x.high:+.1%}]"


def _both(pair: tuple[float, float], spec: str) -> str:
    a, b = (("-" if math.isnan(v) else format(v, spec)) for v in pair)
    return f"{a} / {b}"


def _identical(d: Divergence | None) -> str:
    if d is None:
        return "not recorded"
    first = "" if d.first_difference_min is None else f", first diff at {d.first_difference_min}"
    return f"{d.identical_share:.0%} of {d.requests}{first}"


def table(data: list[dict]) -> pd.DataFrame | None:
    if not data:
        return None
    many = len({d["run_id"] for d in data}) > 1
    out = []
    for d in data:
        row = {**({"run": d["run_id"]} if many else {}), "backend": d["backend"], "without": d["partner"] or "-",
               "variant": d["variant"] or "", "prompt": fmt_int(d["prompt_tokens"]), "conc": d["load"],
               "KV dtype": d["kv_dtype"] or "-"}
        if "missing" in d:
            row["verdict"] = f"not paired: {d['missing']}"
        else:
            pool_with, pool_without = d["pool_with"], d["pool_without"]
            row |= {"pairs": str(d["pairs"]), "acceptance": "-" if np.isnan(d["acceptance"]) else f"{d['acceptance']:.1%}",
                    "E2E change": _change(d["e2e"]), "TPOT change": _change(d["tpot"]),
                    "TTFT change": _change(d["ttft"]), "throughput change": _change(d["throughput"]),
                    "KV bytes/token": _both((pool_with[0], pool_without[0]), ",.0f"),
                    "pool tokens": _both((pool_with[1], pool_without[1]), ",.0f"),
                    "output identical": _identical(d.get("output")), "verdict": d["verdict"]}
        out.append(row)
    columns = ["run"] * many + ["backend", "without", "variant", "prompt", "conc", "KV dtype", "pairs", "acceptance",
                                "E2E change", "TPOT change", "TTFT change", "throughput change", "KV bytes/token",
                                "pool tokens", "output identical", "verdict"]
    return pd.DataFrame(out, columns=columns, dtype=object).fillna("")


def note(data: list[dict]) -> str:
    """Why there is no table: no backend with a drafter had its plain partner in the run."""
    if data:
        return ""
    return ("No cell to pair: run the same engine without a drafter beside it, serving the same weights "
            "(docs/speculation.md, \"Did it pay off?\").")

