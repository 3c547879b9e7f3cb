"""KV quantisation in a run (a ``kv_quant`` workload; docs/kv-quant.md): the KV dtypes each engine starts
with, what run.json records of them, each cell's per-request record of greedy tokens and log-probabilities,
and the flag of a quantised dtype the engine silently declined. Pure: no I/O (the runner writes)."""
from __future__ import annotations

from kvbench.backends.types import RequestResult
from kvbench.kv.geometry import KVGeometry, UnknownKVDtype, kv_bytes_for_sequence, kv_bytes_per_token
from kvbench.kv.rules import KVQuestion, KVRuleError, KVRules
from kvbench.store.schema import CellRow
from kvbench.workloads import Workload


class KVDtypeError(ValueError):
    """A KV dtype a kv_quant run asks of an engine that does not offer it (refused before any run folder)."""


def kv_quant_dtypes(workload: Workload, rules: KVRules | None, geometry: KVGeometry,
                    asked: list[str] | None = None) -> list[str | None]:
    """The KV dtypes one engine starts with, one start each, baseline first ([None]: not a kv_quant workload,
    the run's --kv-dtype). ``asked`` (``kvbench run --kv-dtypes``) replaces the workload's list; "baseline"
    is the engine's own 16-bit cache (its rules' :meth:`~KVRules.baseline_kv_dtype`), "quantised" every dtype
    below 16 bits it takes (:meth:`~KVRules.quantised_kv_dtypes`). A name the engine does not take raises
    KVDtypeError naming what it takes."""
    if workload.family != "kv_quant":
        return [None]
    if rules is None:
        raise KVDtypeError("a kv_quant run needs the engine's KV rules (its dtypes): this backend has none")
    names = list(asked or workload.kv_dtypes)
    if "baseline" not in names:
        names.insert(0, "baseline")
    out: list[str] = []
    baseline = rules.baseline_kv_dtype(KVQuestion(geometry))
    for name in names:
        if name == "baseline":
            found = [baseline]
        elif name == "quantised":
            found = rules.quantised_kv_dtypes()
        else:
            try:
                found = [rules.resolve_dtype(KVQuestion(geometry, name))]
            except KVRuleError as exc:
                raise KVDtypeError(str(exc)) from None
        out += [d for d in found if d not in out]
    out.remove(baseline)
    return [baseline, *out]


def engine_dtypes(workload: Workload, backends, geometry: KVGeometry, asked: list[str] | None
                  ) -> tuple[dict[str, list[str | None]], dict | None]:
    """Each backend's KV dtypes, one engine start each ([None]: not a kv_quant run), and for a kv_quant run
    its run.json record (:func:`run_record`; None otherwise)."""
    from kvbench.backends import REGISTRY, kv_rules

    dtypes = {b.label: kv_quant_dtypes(workload, kv_rules(b.engine), geometry, asked) for b in backends}
    if workload.family != "kv_quant":
        return dtypes, None

    def quantisation(b):
        return REGISTRY[b.engine].capabilities.kv_quantisation

    return dtypes, run_record(workload, dtypes, {b.label: quantisation(b).top_logprobs_max for b in backends},
                              {b.label: quantisation(b).prompt_logprobs_source for b in backends})


def run_record(workload: Workload, dtypes: dict[str, list], top_logprobs_max: dict[str, int],
               prompt_logprobs: dict[str, str]) -> dict:
    """run.json's ``kv_quant``: per backend label its dtypes (baseline first), the k asked for, how its engine
    returns prompt log-probabilities ("": it does not) and the prompts' text, for the report."""
    return {label: {"dtypes": d, "baseline": d[0], "top_logprobs": min(workload.top_logprobs, top_logprobs_max[label]),
                    "prompt_logprobs": prompt_logprobs[label], "prompt_text": workload.prompt_text}
            for label, d in dtypes.items()}


def logprob_records(results: list[RequestResult], asked_k: int, adapter_k: int) -> list[dict]:
    """A kv_quant cell's per-request record of what the divergence is computed from: the greedy token ids,
    each position's top-k [[id, logprob], ...] and the prompt's log-probabilities (None: not returned), with
    the k asked for (the smaller of the workload's and the adapter's KVQuantisation ``top_logprobs_max``)."""
    k = min(asked_k, adapter_k)
    return [{"request_id": r.request_id, "error": r.error or _incomplete(r), "k": k if _whole_top(r) else 0,
             "tokens": list(r.output_ids),
             "top": [[[t, round(lp, 6)] for t, lp in top.items()] for top in r.top_logprobs] if _whole_top(r) else [],
             "prompt_logprobs": None if r.prompt_logprobs is None else
             [None if lp is None else round(lp, 6) for lp in r.prompt_logprobs]} for r in results]


def _whole_top(r: RequestResult) -> bool:
    """Whether the top-k lists are one per output token: llama-server with a drafter sends none for the
    accepted drafts (2 lists for 32 tokens), and lists out of step with the tokens would compare the wrong
    positions; then the tokens are recorded without them (no KL)."""
    return bool(r.top_logprobs) and len(r.top_logprobs) == len(r.output_ids)


def _incomplete(r: RequestResult) -> str | None:
    """Why a request's token ids are not its whole output, or None: a record with some ids missing would pair
    position i with another output's later token."""
    received = sum(r.chunk_tokens)
    if r.output_ids and len(r.output_ids) != received:
        return f"incomplete: the engine sent the ids of {len(r.output_ids)} of its {received} output tokens"
    return None


def formula_bytes(geometry: KVGeometry, rules: KVRules | None, dtype: str, cached: int, decoded: int
                  ) -> tuple[float | None, float | None]:
    """(bytes per token, bytes of one sequence of ``cached`` tokens) by the plain formula; for a KV format of
    the engine's own that the formula has no element size for (transformers' quanto-int4: packed codes,
    per-group scales, a residual), by the engine's rules, the last ``decoded`` tokens fed one at a time
    (``decoded_tokens``). (None, None) where neither knows the dtype."""
    try:
        return kv_bytes_per_token(geometry, dtype), kv_bytes_for_sequence(geometry, dtype, cached)
    except UnknownKVDtype:
        if rules is None:
            return None, None
    try:
        q = KVQuestion(geometry, dtype, cached, 1, options={"decoded_tokens": decoded})
        return rules.bytes_per_token(q), rules.answer(q).bytes_per_gpu
    except (KVRuleError, UnknownKVDtype):
        return None, None


def declined_dtype(row: CellRow, rules: KVRules, geometry, dtype: str, pool) -> None:
    """A quantised KV dtype the engine silently declined: its pool is the size its 16-bit baseline's would be,
    not the asked dtype's (Ollama's fallback to f16): flagged, the sizes said."""
    try:
        baseline = rules.baseline_kv_dtype(KVQuestion(geometry))
        asked = pool.tokens * rules.pool_bytes_per_token(geometry, dtype, pool.details)
        full = pool.tokens * rules.pool_bytes_per_token(geometry, baseline, pool.details)
    except (KVRuleError, ValueError):
        return
    if dtype == baseline or abs(full - asked) < 1 or abs(pool.bytes - full) >= abs(pool.bytes - asked):
        return
    row.flags.insert(0, f"KV dtype {dtype} declined: the engine's pool of {pool.bytes:,} bytes is the size of a "
                        f"{baseline} pool ({full:,.0f}), not of a {dtype} one ({asked:,.0f})")
    if row.status == "ok":
        row.status = "flagged"
