"""Step "cells" of an engine session: each cell measured in turn (the load, with memory, KV in use and the
engine's queue sampled alongside) and its row written; a dead engine fails the cells left, a wedged one
is probed before each later cell, a saturation sweep's open-loop rates follow the rate its closed loop
found."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

import httpx
import psutil

from kvbench.backends.base import Backend, believable_pool
from kvbench.load import LoadSettings, frozen_heap, run, run_async
from kvbench.load.common import LoadShare
from kvbench.load.open_loop import schedule_seed
from kvbench.run import kvquant
from kvbench.run.cells import Cell
from kvbench.run.progress import CellProgress
from kvbench.run.rows import (
    CellMeasurement,
    replica_rows,
    request_row,
    request_verdicts,
    summarize,
    summary_line,
    timeline_frame,
)
from kvbench.run.samplers import EnginePoller, ProcessTreeMemorySampler, engine_counters, tree_rss
from kvbench.run.telemetry import measure_cell, wall_clock_offset
from kvbench.run.warmup import WARMUP_POINT, update_eta

if TYPE_CHECKING:
    from kvbench.run.session import EngineSession

ENGINE_EXIT_WAIT_S = 2.0  # how long a cell with failed requests waits to learn whether the engine died
REPROBE_TIMEOUT_S = 5.0  # a wedged engine's probe before each later cell (at most half the request timeout)


def measure_cells(s: EngineSession, backend: Backend) -> None:
    """The session's cells not yet run, in order, each into its rows."""
    r, label = s.r, s.cfg.label
    while s.done < len(s.cells):
        s.skip_finished()
        if s.done == len(s.cells):
            break
        cell = s.cells[s.done]
        if died := backend.exit_description():
            s.stop_reason = f"engine {died} during the run"
            return s.fail_remaining(s.stop_reason, backend.log_tail())
        if s.streak.tripped and not answers_again(s, backend):
            # this cell fails unsent; the next one probes the engine again (it may be back by then)
            said = s.stop_reason.startswith("wedged")
            s.stop_reason = f"wedged: {s.streak.describe()}"
            s.fail_remaining(s.stop_reason, backend.log_tail(), only_next=True, quiet=said)
            continue
        s.progress.update(s.bar, description=f"{label}: {cell.describe()}")
        m = measure(s, backend, cell)
        row = summarize(s.info, m)
        parts = replica_rows(s.info, m, row)  # a deployment's rows per replica
        note_stalls(s, row, parts, m)
        for each in (row, *parts):
            r.writer.write_cell(each)
        s.done += 1
        s.progress.advance(s.bar)
        update_eta(s)
        r.console.print(summary_line(row))
        # the cells the load profile adds after this one (a saturation sweep's rates), from its rate
        s.cells[s.done:s.done] = s.plan.cells_after(cell, row.requests_per_s or 0)
        s.stop_reason = "interrupted"  # a cell ran: no longer wedged; "finished" once the loop ends
    if not s.stop_reason.startswith("wedged"):
        s.stop_reason = "finished"


def measure(s: EngineSession, backend: Backend, cell: Cell) -> CellMeasurement:
    """One cell: the load with the samplers running alongside, and the engine's figures around it."""
    r, w = s.r, s.plan.workload
    prompts = s.prompts.for_cell(cell, cell.requests)
    line = CellProgress(s.progress, cell.describe(), len(prompts)) if r.o.load_workers == 1 else None
    settings = load_settings(s, cell, line)  # with --load-share: once every share is at this cell
    backend.reset_cell()
    if r.o.reset_cache_between_cells:
        backend.capabilities.prefix_cache.empty(backend)
    counters_before = engine_counters(backend)  # (prefix cache, speculation, bytes a step)
    memory, rss_baseline = None, None
    if backend.pid:
        rss_baseline = _rss_before(backend.pid)
        memory = ProcessTreeMemorySampler(backend.pid, r.o.memory_hz, r.nvml, baseline=s.gpu_baseline)
    engine = EnginePoller(backend, r.o.kv_poll_hz)
    samplers = [sampler for sampler in (memory, engine) if sampler]
    with frozen_heap():  # no full garbage collection while the client and samplers measure
        t0 = time.perf_counter()
        t0_unix = t0 + wall_clock_offset()  # the cell's start on the wall clock (the BR's time series)
        for sampler in samplers:
            sampler.start()
        try:
            load = run_async(run(backend, prompts, cell.load, settings))
        finally:
            for sampler in samplers:
                sampler.stop()
            if line:
                line.close()
    label = s.cfg.label
    counters, spec, step_bytes = zip(counters_before, engine_counters(backend))  # each (before, after)
    prom = measure_cell(r.o.prometheus, t0, load.t_end, r.run_dir, cell.cell_id(label))
    # a deployment: each replica's polls and the requests it served (each marked with its replica)
    replicas = backend.replica_polls(load.results)
    for result in load.results:
        r.writer.write_request(request_row(r.run_id, cell.cell_id(label), label, result, repeat=cell.repeat))
    if w.family == "kv_quant":  # the greedy tokens and log-probabilities the divergence is computed from
        r.writer.write_logprobs(cell.cell_id(label), kvquant.logprob_records(
            load.results, w.top_logprobs, backend.capabilities.kv_quantisation.top_logprobs_max))
    # A killed engine closes its sockets a moment before its exit can be read: wait for it briefly,
    # so that requests cut off by a dead engine are put down to the engine.
    verdicts = request_verdicts(load.results)
    died = backend.exit_description(wait_s=ENGINE_EXIT_WAIT_S) if "failed" in verdicts else ""
    try:
        kv_peak = backend.kv_peak()
    except httpx.HTTPError:
        kv_peak = None
    m = CellMeasurement(cell, load, t0, backend.kv_dtype_name(), engine_exit=died,
                        log_tail=backend.log_tail() if "ok" not in verdicts else "",
                        kv_pool=believable_pool(backend.kv_pool()), kv_peak=kv_peak,
                        kv_samples=engine.kv_samples, kv_source=engine.kv_source,
                        queue_samples=engine.queue_samples, queue_source=engine.queue_source,
                        memory_samples=memory.samples if memory else None, rss_baseline_bytes=rss_baseline,
                        gpu_baseline_used_bytes=s.gpu_baseline.used_bytes if s.gpu_baseline else None,
                        replicas=replicas, telemetry=prom, prefix_counters=counters, t_cell_start_unix=t0_unix,
                        prefix_seen=s.prefix_seen, spec_counters=spec, step_bytes_counters=step_bytes)
    s.prefix_seen = s.prefix_seen or bool(w.shared_prefix_tokens)
    r.writer.write_timeline(cell.cell_id(label), timeline_frame(t0, m.memory_samples or [], engine.kv_samples,
                                                                engine.queue_samples, replicas))
    return m


def load_settings(s: EngineSession, cell: Cell, line: CellProgress | None) -> LoadSettings:
    """What the cell's load is told: its timeout, duration and schedule seed, the engine's timeout streak, the
    load processes, and with --load-share this process's share and the owner's barrier for the cell, made once
    every share has reached the cell (before its samplers start: the wait is no part of the cell)."""
    r, w = s.r, s.plan.workload
    if r.owner is not None:
        r.owner.arrive(f"{cell.cell_id(s.cfg.label)}:ready")
    share = None if r.owner is None else LoadShare(r.o.load_share[0], r.o.load_share[1], r.owner,
                                                   cell.cell_id(s.cfg.label))
    return LoadSettings(r.o.request_timeout_s, w.load.duration_s,
                        schedule_seed(w.seed, cell.prompt_tokens, cell.repeat, cell.load.slug), s.streak,
                        workers=r.o.load_workers, on_done=line, share=share)


def _rss_before(pid: int) -> int | None:
    """The engine tree's RSS before the cell; None for a server ended since the cell's check (its requests
    then fail and name the engine's end)."""
    try:
        return tree_rss(pid)[0]
    except psutil.NoSuchProcess:
        return None


def answers_again(s: EngineSession, backend: Backend) -> bool:
    """A wedged engine (its timeout streak tripped) is probed before each later cell: one request of 8
    prompt tokens and 1 output token, with a short timeout (a completion: an engine whose scheduler hangs
    still answers its health route). Answered: the cell runs on probation (one more timeout before an
    answer trips the streak again) and its row says the engine had stopped answering."""
    probe = s.prompts.build(8, f"reprobe-{s.done}", 1)
    timeout_s = min(REPROBE_TIMEOUT_S, s.r.o.request_timeout_s / 2)
    result = run_async(run(backend, [probe], WARMUP_POINT, LoadSettings(timeout_s))).results[0]
    s.r.writer.write_request(request_row(s.r.run_id, f"{s.cfg.label}_reprobe", s.cfg.label, result,
                                         warmup=True))
    # an answer the adapter could not read, or a 4xx, is an answer; a timeout, a refused connection or a
    # 5xx is not
    if result.error and not result.error.startswith(("bad response", "HTTP 4")):
        return False
    s.recovered = (f"the engine had stopped answering ({s.streak.describe()}) and answered a probe "
                   f"before this cell")
    s.streak.probation()
    return True


def note_stalls(s: EngineSession, row, parts: list, m: CellMeasurement) -> None:
    """Flag a cell run after its engine was wedged, and a deployment's cell during which a replica was
    out of rotation (its row, the total's, and run.json's ``replica_outages``)."""
    notes = [s.recovered] if s.recovered else []
    s.recovered = ""
    for rp in (m.replicas or {}).values():
        for outage in rp.outages:
            back = (f"back by {outage['put_back_by']} after {outage['out_s']:.1f} s" if outage["back_at"]
                    else "still out at the cell's end")
            note = (f"replica {outage['replica']} out of rotation for {outage['seconds_in_cell']:.1f} s of this "
                    f"cell ({outage['reason']}; {back})")
            notes.append(note)
            for part in parts:
                if part.replica == outage["replica"]:
                    part.flags.insert(0, note)
            s.outages[(outage["replica"], outage["out_at"])] = {k: v for k, v in outage.items()
                                                                if k != "seconds_in_cell"}
    if s.outages:
        s.r.record.replica_outages[s.key] = list(s.outages.values())
        s.r.record.save(s.r.writer)
    for each in (row, *parts) if notes else ():
        if each is row:
            each.flags[:0] = notes
        if each.status == "ok" and each.flags:
            each.status = "flagged"
