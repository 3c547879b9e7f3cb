"""A cell's figures made of its requests alone: the token contract (what each request was sent and asked
for against what the engine says it did: the counts, the status and the flags), the load achieved, and
latency and throughput (bench/common/metrics.py). :func:`kvbench.run.rows.summarize` makes them for a cell
it measured, ``kvbench merge`` (bench/run/merge.py) again from every load process's requests."""
from __future__ import annotations

from kvbench.backends.types import RequestResult
from kvbench.common.metrics import RequestTimes, cell_metrics, percentiles, request_verdict
from kvbench.load import LoadResult
from kvbench.load.common import LOST, is_lost
from kvbench.store.schema import CellRow

MAX_FLAGS = 10  # request-level flags kept per cell; the rest are counted


def request_figures(row: CellRow, load: LoadResult, engine_exit: str = "", log_tail: str = "") -> list[RequestResult]:
    """The row's figures made of its requests alone: how many and how they met the token contract (status,
    flags), the load achieved, and latency and throughput (bench/common/metrics.py, the row's SLO); returns the
    requests that count. (``kvbench merge`` remakes these from the requests of every load process.)"""
    row.n_requests, row.load_processes = len(load.results), load.processes
    _load_achieved(row, load)
    good = _token_contract(row, load.results, engine_exit, log_tail)
    if load.notes:  # e.g. a load share that never reached the start barrier
        row.flags[:0] = load.notes
        row.status = "flagged" if row.status == "ok" else row.status
    for k, v in cell_metrics([RequestTimes.of(r) for r in good], [r.prompt_tokens_sent for r in good],
                             row.slo_ttft_s, row.slo_tpot_s).items():
        setattr(row, k, v)
    return good


def _load_achieved(row: CellRow, load: LoadResult) -> None:
    row.offered_request_rate = load.offered_request_rate
    row.achieved_request_rate = load.achieved_request_rate
    row.max_in_flight = load.max_in_flight
    if load.send_lags:
        row.send_lag_s_p99 = percentiles(load.send_lags, "lag")["lag_p99"]
    row.client_loop_lag_s_max = load.loop_lag_s_max


def request_verdicts(results: list[RequestResult]) -> set[str]:
    """The token-contract verdicts among ``results`` ("failed": an error or no token, then the engine may
    have died; no "ok": the cell's row carries the engine's log tail)."""
    return {_verdict(r) for r in results}


def _verdict(r: RequestResult) -> str:
    return request_verdict(r.error, r.prompt_tokens_sent, r.prompt_tokens_reported, r.output_tokens_requested,
                           r.output_tokens_reported, sum(r.chunk_tokens))


#: The flag of a request that ended at EOS on a server that cannot force the output length.
SHORT_OUTPUT = "short output: the server does not honour ignore_eos"


def _token_contract(row: CellRow, results: list[RequestResult], engine_exit: str, log_tail: str) -> list:
    """Sort the requests by the token contract (what was sent and asked for against what the engine says
    it did), set the counts, status and flags, and return the requests that count."""
    good, flags, counts = [], [], {"failed": 0, "truncated": 0, "short": 0}
    as_generated = "output as generated" in row.token_contract  # no ignore_eos: EOS may end it early
    for r in results:
        verdict = _verdict(r)
        if verdict == "ok":
            good.append(r)
            continue
        counts[verdict] = counts.get(verdict, 0) + 1
        if is_lost(r):  # said once for all of them, below
            continue
        if verdict == "short" and as_generated:  # what the server could do: its timings count, flagged
            good.append(r)
            if len(flags) < MAX_FLAGS:
                flags.append(f"{r.request_id}: {SHORT_OUTPUT} (output {r.output_tokens_requested} asked / "
                             f"{r.output_tokens_reported if r.output_tokens_reported is not None else sum(r.chunk_tokens)} "
                             "generated)")
            continue
        if len(flags) < MAX_FLAGS:
            flags.append(f"{r.request_id}: {verdict}: " + (r.error or
                         f"prompt {r.prompt_tokens_sent} sent / {r.prompt_tokens_reported} read, output "
                         f"{r.output_tokens_requested} asked / {r.output_tokens_reported} reported / "
                         f"{sum(r.chunk_tokens)} received"))
    lost = [r for r in results if is_lost(r)]
    bad = len(results) - len(good) - len(lost)
    if bad > len(flags):
        flags.append(f"... {bad - len(flags)} more requests broke the token contract")
    row.n_lost = len(lost)
    if lost:  # never dropped: counted as failed, and said first
        flags.insert(0, lost_flag(lost))
    row.n_ok, row.n_failed, row.n_truncated, row.n_short = len(good), counts["failed"], counts["truncated"], counts["short"]
    row.status = "failed" if not good else ("flagged" if flags else "ok")
    # a request cut off by a dead engine is put down to the engine
    died = engine_exit if counts["failed"] else ""
    if died:
        flags.insert(0, f"engine {died} during the cell")
    row.flags = flags
    if not good:
        failed = [r for r in results if r.error]
        row.error = failed[0].error if failed else "no request met the token contract"
        if died:
            row.error = f"engine {died} during the cell: {row.error}"
        row.log_tail = log_tail or None
    return good


def lost_flag(lost: list) -> str:
    """The cell's flag for its requests lost with load processes that died."""
    why = sorted({r.error[len(LOST):] for r in lost})
    return f"{len(lost)} requests lost: " + "; ".join(why[:3]) + (f"; ... {len(why) - 3} more" if len(why) > 3 else "")
