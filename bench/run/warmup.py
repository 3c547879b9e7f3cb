"""Step "warm up" of an engine session: the workload's warm-up requests, then a short and a long
calibration request from which the session's cells are estimated (bench/run/estimate.py) and the progress
bar's ETA set."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvbench.backends.base import Backend
from kvbench.common.metrics import RequestTimes
from kvbench.load import ONE_AT_A_TIME, LoadSettings, run, run_async
from kvbench.run import estimate
from kvbench.run.progress import set_eta
from kvbench.run.rows import request_row

if TYPE_CHECKING:
    from kvbench.run.session import EngineSession

WARMUP_POINT = ONE_AT_A_TIME  # warm-up requests go one at a time


def warm_up(s: EngineSession, backend: Backend) -> None:
    """The workload's warm-up requests, then (for the estimate, once the engine is warm) a short and a
    long calibration request; all are recorded as warm-up requests and count in no figure."""
    w = s.plan.workload
    warmup = s.prompts.warmup()
    longest = max((w.prompt_tokens_sent(c.prompt_tokens, c.turn) for c in s.cells[s.done:]), default=0)
    calibration = [s.prompts.build(n, f"calibration-{n}", 8)
                   for n in sorted({min(32, longest), longest})] if s.r.o.estimate and longest else []
    prompts = warmup + calibration
    if not prompts:
        return
    s.progress.update(s.bar, description=f"{s.cfg.label}: warm-up")
    load = run_async(run(backend, prompts, WARMUP_POINT, LoadSettings(s.r.o.request_timeout_s,
                                                                      streak=s.streak)))
    for result in load.results:
        s.r.writer.write_request(request_row(s.r.run_id, f"{s.cfg.label}_warmup", s.cfg.label, result,
                                             warmup=True))
    measured = [r for r in load.results[len(warmup):] if not r.error]
    if calibration and measured:
        estimate_cells(s, [RequestTimes.of(r) for r in measured], [r.prompt_tokens_sent for r in measured])


def estimate_cells(s: EngineSession, times: list[RequestTimes], prompt_tokens: list[int]) -> None:
    """Say how long this engine's cells will take here (bench/run/estimate.py), and record it."""
    points = [(p, t.ttft) for p, t in zip(prompt_tokens, times) if t.ttft is not None]
    itls = sorted(x for t in times for x in t.itl_samples())
    if not points or not itls:
        return
    cal = estimate.Calibration.from_points(min(points), max(points), itls[len(itls) // 2])
    w, cells = s.plan.workload, s.cells[s.done:]
    s.cell_estimates = [estimate.cell_seconds(
        cal, w.prompt_tokens_sent(c.prompt_tokens, c.turn), w.output_tokens, c.requests,
        c.load.concurrency, c.load.request_rate) for c in cells]
    seconds, s.estimate_from = sum(s.cell_estimates), (s.done, time.monotonic())
    update_eta(s)
    s.estimated = {"estimated_s": round(seconds, 1), "cells": len(cells), "started": time.monotonic(),
                   "prefill_tokens_per_s": round(1 / cal.prefill_s_per_token) if cal.prefill_s_per_token else None,
                   "decode_tokens_per_s": round(1 / cal.decode_s_per_token) if cal.decode_s_per_token else None}
    s.r.console.print(f"{s.cfg.label}: about {estimate.describe(seconds)} for its {len(cells)} cells on "
                      f"this machine (from its {min(points)[0]}- and {max(points)[0]}-token calibration "
                      f"prompts; rough, see bench/run/estimate.py)")


def update_eta(s: EngineSession) -> None:
    """The bar's ETA from the calibrated estimate, at once and after each cell."""
    set_eta(s.progress, s.bar, s.cell_estimates, s.estimate_from, s.done, len(s.cells))
