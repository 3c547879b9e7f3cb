"""`kvbench plan --bandwidth RATE`: the fastest inter-token latency the planned batch allows (bench/common/bandwidth.py).
One decode step on each GPU reads that GPU's weights once and the KV of every request of the batch at its typical
length: those bytes over the GPU's read bandwidth are the floor; at a measured efficiency (`kvbench report`'s
decode-bound table: bound over measured ITL) the ITL to expect."""
from __future__ import annotations

import re

from kvbench.planner.shared import BYTE_UNITS, PlanError

BANDWIDTH = re.compile(r"(?P<n>[0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*(?P<unit>[kmgt]i?b)?(?:/s)?", re.IGNORECASE)
MAX_BANDWIDTH = 1e15  # bytes/s: a memory past 1 PB/s is a typo


def read_bandwidth(flags: dict, earlier: dict) -> float | None:
    """A read bandwidth (3.35TB/s, 900GB/s, 819GiB/s, or bytes per second), above 0 and at most 1 PB/s; ``spec``:
    the specification of the catalogue's card given as --gpu (bench/planner/gpus.toml bandwidth_gb_s)."""
    text = flags["bandwidth"]
    if text is None:
        return None
    if text.strip().lower() == "spec":
        return spec_bandwidth(earlier.get("gpu"))
    m = BANDWIDTH.fullmatch(text.strip())
    if not m:
        raise PlanError(f"--bandwidth {text[:40]!r} is not a rate such as 3.35TB/s or 900GB/s")
    value = float(m["n"]) * BYTE_UNITS[(m["unit"] or "").lower()]
    if not 1e6 <= value <= MAX_BANDWIDTH:
        raise PlanError(f"--bandwidth takes 1MB/s to 1PB/s, not {text[:40]!r}")
    return value


def spec_bandwidth(card: str | None) -> float:
    from kvbench.planner.shared import gpu

    if not card:
        raise PlanError("--bandwidth spec needs --gpu with a card of the catalogue (its specification's bandwidth)")
    rate = gpu(card).bandwidth_bytes_per_s  # a size given has none
    if not rate:
        raise PlanError(f"--bandwidth spec: {card} has no bandwidth in the catalogue (a size given, or no public "
                        "figure): give a rate such as 900GB/s")
    return rate


def read_decode_efficiency(flags: dict, earlier: dict) -> float | None:
    text = flags["decode_efficiency"]
    try:
        value = None if text is None else float(text)
    except ValueError:
        raise PlanError(f"--decode-efficiency takes a number, not {text[:40]!r}") from None
    if value is not None and not 0 < value <= 1:  # NaN too
        raise PlanError(f"--decode-efficiency is above 0 and at most 1, not {flags['decode_efficiency']}")
    if value is not None and earlier.get("bandwidth") is None:
        raise PlanError("--decode-efficiency needs --bandwidth (the bound it is a share of)")
    return value


def moe_view(model) -> dict | None:
    """A MoE model's routed experts as the decode bound needs them (None: dense, or not read): how many, how
    many a token takes, and their share of the weights (counted from the config)."""
    w = model.widths
    if w is None or not w.experts or not w.experts_per_token:
        return None
    share = model.expert_share() if model.expert_share is not None else None
    return {"routed_experts": w.experts, "experts_per_token": w.experts_per_token, "expert_share": share}


def experts_read(moe: dict | None, tokens: int) -> float | None:
    """The share of the routed experts one step of ``tokens`` tokens reads: each token takes k of E experts,
    drawn independently and evenly, so the expected share (exact for one token; a router whose choices
    cluster reads fewer); None for a dense model."""
    if not moe or not moe.get("expert_share"):
        return None
    k, e = moe["experts_per_token"], moe["routed_experts"]
    return 1 - (1 - min(k, e) / e) ** max(1, tokens)


def decode_answer(result: dict, bandwidth: float, efficiency: float | None) -> dict | None:
    """The plan's decode bound (None where the weights' size is unknown). A MoE model's step reads the routed
    experts its batch's tokens take (:func:`experts_read`), the rest of the weights whole."""
    # here, not at the top: its module brings concurrent.futures and logging (its probe's), which a plan without
    # --bandwidth does not need (issue 54 item 4)
    from kvbench.common.bandwidth import decode_bound

    weights = result.get("weights_bytes_per_gpu")
    if weights is None:
        return None
    batch = max(1, int(result["batch"]))
    moe, read = result.get("moe"), None
    if result.get("dp", 1) == 1 and (read := experts_read(moe, batch)) is not None:
        share = moe["expert_share"]  # of each GPU's weights too: the experts split over TP like the rest
        weights = weights * ((1 - share) + share * read)
    bound = decode_bound(weights, result["kv_bytes_per_gpu"] / batch, batch, bandwidth)
    out = {"bandwidth_bytes_per_s": bandwidth, "step_bytes_per_gpu": bound.step_bytes, "weights_read_bytes_per_gpu": weights,
           "experts_read_share": read,
           "kv_bytes_per_gpu": bound.kv_bytes, "kv_share": bound.kv_share, "itl_s_bound": bound.itl_s,
           "efficiency": efficiency, "itl_s_expected": bound.itl_s / efficiency if efficiency else None}
    expected = (f"; at {efficiency:.0%} of it (the efficiency given) {out['itl_s_expected'] * 1000:,.2f} ms, "
                f"{1 / out['itl_s_expected']:,.1f} tokens/s a request" if efficiency else
                "; give --decode-efficiency (a run's, from `kvbench report`) for the ITL to expect")
    out["line"] = (f"Decode at {bandwidth / 1e9:,.0f} GB/s: a step reads {bound.step_bytes / 2**30:,.2f} GiB per GPU "
                   f"(weights {weights / 2**30:,.2f}{_experts_text(moe, read, batch)}, KV of {batch:,} x "
                   f"{result['context']:,} tokens "
                   f"{bound.kv_bytes / 2**30:,.2f}: {bound.kv_share:.0%}), so no ITL is under "
                   f"{bound.itl_s * 1000:,.2f} ms ({1 / bound.itl_s:,.1f} tokens/s a request){expected}")
    return out


def _experts_text(moe: dict | None, read: float | None, batch: int) -> str:
    if read is not None:
        return (f": the routed experts, {moe['expert_share']:.0%} of them, read at {read:.0%} for {batch:,} token{'s' if batch > 1 else ''} "
                f"a step taking {moe['experts_per_token']} of {moe['routed_experts']} each")
    if moe:  # data-parallel attention, or the experts' share unknown
        return ": every routed expert counted"
    return ""
