"""The prefix cache of every cell: whether it was meant cold or warm, what an ideal cache would have served
(bench/run/prefix_cache.py), what the engine says it served and from where, TTFT beside the same cell with
prefix caching off, and, for a shared prefix, the KV in use against the rules' prediction with the prefix
held once (`kvbench plan --shared-prefix`)."""
from __future__ import annotations

import pandas as pd

from kvbench.store.schema import OK_STATUSES

from .tables import LEAD_RIGHT, _lead, _missing, fmt_bytes, fmt_num, with_failures

INTRO = ("Meant cold: the cell's prompts share nothing with anything sent before (each run salts its prompts, "
         "`--prompt-salt`); a cold cell of which more than 1 % of the prompt tokens came from the cache is "
         "flagged. Meant warm: a shared prefix, or a later turn of a conversation, with prefix caching on. "
         "Ideal: the share of prompt tokens a cache reusing whole units of the engine's granularity (vLLM's "
         "block, llama.cpp's token) would serve, once the prefix has been computed. Measured: what the engine "
         "says, per request (vLLM's usage.prompt_tokens_details.cached_tokens, llama.cpp's timings.cache_n, "
         "SGLang's meta_info.cached_tokens) or from its counters. \"not recorded\": a run from before kvbench "
         "recorded it. TTFT off: the same cell on the server variant with prefix caching off. KV "
         "predicted (warm cells): the engine's rules at the cell's load, a shared prefix held once where the "
         "engine shares it (vLLM's blocks; `kvbench plan --shared-prefix`), against its own KV-in-use peak.")


def _pct(x) -> str:
    return "-" if _missing(x) else f"{x:.1%}"


def _cold_twin(agg: pd.DataFrame, r) -> pd.Series | None:
    """The same cell (run, backend, prompt, load, turn) on the variant with prefix caching off."""
    if not isinstance(r.variant, str) or "prefix_caching=on" not in r.variant:
        return None
    twin = agg[(agg.run_id == r.run_id) & (agg.backend == r.backend) & (agg.prompt_tokens == r.prompt_tokens)
               & (agg.concurrency.fillna(-1) == (-1 if _missing(r.concurrency) else r.concurrency))
               & (agg.variant == r.variant.replace("prefix_caching=on", "prefix_caching=off"))]
    return twin.iloc[0] if not twin.empty else None


def prefix_cache_table(agg: pd.DataFrame) -> pd.DataFrame:
    out = _lead(agg)
    columns = {k: [] for k in ("meant", "hit rate (ideal)", "hit rate (engine)", "tokens hit / looked up",
                               "TTFT p50 (s)", "TTFT p50, caching off (s)", "KV in use (engine)",
                               "KV predicted (rules)", "source")}
    for r in agg.itertuples():
        failed = r.status not in OK_STATUSES
        expected = getattr(r, "prefix_cache_expected", "") or ""
        columns["meant"].append(expected or "not recorded")
        columns["hit rate (ideal)"].append(_pct(getattr(r, "prefix_cache_expected_hit_rate", None)))
        columns["hit rate (engine)"].append("" if failed else _pct(getattr(r, "prefix_cache_hit_rate", None)))
        hit, looked = getattr(r, "prefix_cache_hit_tokens", None), getattr(r, "prefix_cache_query_tokens", None)
        columns["tokens hit / looked up"].append("-" if failed or _missing(hit) else f"{int(hit):,} / {int(looked):,}")
        columns["TTFT p50 (s)"].append("" if failed else fmt_num(r.ttft_s_p50))
        twin = _cold_twin(agg, r)
        columns["TTFT p50, caching off (s)"].append("-" if twin is None else fmt_num(twin.ttft_s_p50))
        columns["KV in use (engine)"].append("" if failed else fmt_bytes(r.kv_in_use_peak_bytes))
        predicted = r.kv_peak_bytes_per_gpu_predicted
        columns["KV predicted (rules)"].append(
            "-" if expected != "warm" or _missing(predicted) else fmt_bytes(predicted * max(1, int(r.gpus_used or 1))))
        source = getattr(r, "prefix_cache_source", None)
        columns["source"].append(source if isinstance(source, str) else "not recorded")
    for k, v in columns.items():
        out[k] = v
    return with_failures(out, agg, ~agg.status.isin(OK_STATUSES), "meant")


TITLE = "Prefix cache: meant cold or warm, and what the engine served"
NOT_RECORDED = ("Not recorded: the run is from before kvbench recorded the prefix cache (results schema v7); its "
                "prompts were unsalted.")


def recorded(agg: pd.DataFrame) -> bool:
    """Whether any row recorded its prefix cache (rows of runs before schema v7 read "not recorded")."""
    return "prefix_cache_source" in agg and bool(
        agg.prefix_cache_source.map(lambda x: isinstance(x, str) and x != "not recorded").any())


RIGHT = LEAD_RIGHT | {"hit rate (ideal)", "hit rate (engine)", "tokens hit / looked up", "TTFT p50 (s)",
                      "TTFT p50, caching off (s)", "KV in use (engine)", "KV predicted (rules)"}
