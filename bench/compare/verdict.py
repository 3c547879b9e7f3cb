"""A comparison's verdict from its metrics' verdicts, its exit code, and how many repeats would settle what
is inconclusive: pure functions of ``kvbench compare``'s result dict."""
from __future__ import annotations

from kvbench.common import stats

#: The verdict of a comparison and its exit code (2 is bad input, as for every kvbench verb).
EXIT_CODES = {"unchanged": 0, "REGRESSION": 1, "nothing to compare": 2, "inconclusive": 3, "improvement": 4}


def overall_verdict(summary: dict) -> str:
    """REGRESSION over inconclusive over improvement over unchanged: one regression (or a cell failed on
    the candidate only) is a regression; any metric whose interval is wider than its tolerance (or that
    had too few repeats for one) leaves the whole inconclusive, since it is no evidence either way."""
    if summary["regression"] or summary["failed_on_candidate"]:
        return "REGRESSION"
    if not summary["compared_cells"]:
        return "nothing to compare"
    if summary["inconclusive"] or not (summary["unchanged"] or summary["improvement"]):
        return "inconclusive"
    return "improvement" if summary["improvement"] else "unchanged"


def settle_summary(result: dict, confidence: float) -> dict:
    """How many repeats per side (pairs when paired) would settle the inconclusive metrics at the noise
    their repeats showed, were their changes to stay (:func:`kvbench.common.stats.repeats_to_settle`):
    the median metric's and the one that needs most; metrics with one repeat have no noise to size from."""
    inconclusive = [m for c in result["cells"] for m in c["metrics"] if m["verdict"] == "inconclusive"]
    sized = [m for m in inconclusive if m["noise_log_sd"] is not None and m["change"] is not None]
    needed = [stats.repeats_to_settle(m["noise_log_sd"], m["change"], m["tolerance"], confidence, m["paired"])
              for m in sized]
    for m, n in zip(sized, needed):
        m["repeats_to_settle"] = n
    known = sorted(n for n in needed if n is not None)
    return {"inconclusive": len(inconclusive), "sized": len(sized), "no_noise": len(inconclusive) - len(sized),
            "beyond": len(needed) - len(known), "median": known[len(known) // 2] if known else None,
            "most": known[-1] if known else None, "paired": bool(sized) and all(m["paired"] for m in sized),
            "repeats_now": min((min(m["n_baseline"], m["n_candidate"]) for m in inconclusive), default=None)}
