"""Speculative decoding in every cell of a run that speculated: the drafter, what it proposed and what the
target accepted (bench/run/speculation.py, docs/speculation.md), beside the cell's decode speed. Shown only
when some cell drafted or was started with a drafter."""
from __future__ import annotations

import pandas as pd

from kvbench.store.schema import OK_STATUSES

from .tables import LEAD_RIGHT, _lead, _missing, fmt_num, with_failures

TITLE = "Speculative decoding: what was drafted and accepted"
INTRO = ("The drafter the engine was started with (`-b ENGINE:speculative=ngram|draft`), the draft tokens it "
         "proposed over the cell and those the target accepted, as the engine reports them: per request "
         "(llama.cpp's timings.draft_n / draft_n_accepted) or from its counters' rise over the cell (vLLM's "
         "vllm:spec_decode_num_draft_tokens / accepted_tokens / drafts). Acceptance: accepted / drafted. Tokens "
         "a step: 1 + accepted / drafts, what one verification step of the target yields (where the engine "
         "counts its drafts). Target passes a token: (output tokens - accepted) / output tokens; 1.00 without "
         "speculation, lower is better. \"not reported\": the engine said nothing of its drafts for the cell.")


def _pct(x) -> str:
    return "-" if _missing(x) else f"{x:.1%}"


def _count(x) -> str:
    return "-" if _missing(x) else f"{int(round(x)):,}"


def speculated(agg: pd.DataFrame) -> bool:
    """Whether any cell was started with a drafter or reports drafts (the section shows only then)."""
    if "spec_method" not in agg:
        return False
    started = agg.spec_method.map(lambda m: isinstance(m, str) and m != "")
    return bool(started.any() or agg.spec_draft_tokens.notna().any())


def speculation_table(agg: pd.DataFrame) -> pd.DataFrame:
    out = _lead(agg)
    columns = {k: [] for k in ("drafter", "drafted", "accepted", "acceptance", "drafts", "tokens a step",
                               "target passes a token", "decode tok/s", "source")}
    for r in agg.itertuples():
        failed = r.status not in OK_STATUSES
        method = r.spec_method if isinstance(r.spec_method, str) and r.spec_method else "none (or not known)"
        columns["drafter"].append(method)
        columns["drafted"].append("" if failed else _count(r.spec_draft_tokens))
        columns["accepted"].append("" if failed else _count(r.spec_accepted_tokens))
        columns["acceptance"].append("" if failed else _pct(r.spec_acceptance_rate))
        columns["drafts"].append("" if failed else _count(r.spec_drafts))
        columns["tokens a step"].append("" if failed else fmt_num(r.spec_tokens_per_step, digits=2))
        columns["target passes a token"].append("" if failed else fmt_num(r.spec_steps_per_output_token, digits=2))
        columns["decode tok/s"].append("" if failed else fmt_num(r.output_tokens_per_s, digits=1))
        source = r.spec_source
        columns["source"].append(source if isinstance(source, str) else "-")
    for k, v in columns.items():
        out[k] = v
    return with_failures(out, agg, ~agg.status.isin(OK_STATUSES), "drafter")


RIGHT = LEAD_RIGHT | {"drafted", "accepted", "acceptance", "drafts", "tokens a step", "target passes a token",
                      "decode tok/s"}
