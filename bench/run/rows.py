"""A cell's row from what the runner measured: pure functions, no I/O.

The runner drives the engine and the samplers and hands back a :class:`CellMeasurement` (the raw record
of one cell); :func:`summarize` turns it into the cell's :class:`~kvbench.store.schema.CellRow`: the token
contract, latency and throughput (bench/common/metrics.py), the KV prediction, the engine's KV and queue peaks,
and the memory peaks. :func:`failed_row` is the row of a cell that could not run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from kvbench.backends.types import (KVInUse, KVPool, PrefixCacheCounters, RequestResult, SpeculationCounters,
                                    StepBytesCounters)
from kvbench.common.metrics import RequestTimes
from kvbench.run.contract import (  # noqa: F401 - what the run's steps take from here
    SHORT_OUTPUT,
    lost_flag,
    request_figures,
    request_verdicts,
)
from kvbench.common.models import ModelFiles
from kvbench.kv.rules import KVQuestion, KVRules
from kvbench.kv.units import fmt_bytes
from kvbench.load import LoadResult, self_probe
from kvbench.run.cells import Cell, load_label
from kvbench.run.decode_bound import decode_bound_columns, engine_step_bytes_columns
from kvbench.run.kvquant import declined_dtype, formula_bytes
from kvbench.run.prefix_cache import meant_warm, prefix_cache_columns
from kvbench.run.samplers import KVSample, MemorySample, QueueSample
from kvbench.run.speculation import speculation_columns
from kvbench.store.schema import CellRow, RequestRow
from kvbench.workloads import Workload

CLIENT_LAG_WARN_S = 0.05  # docs/metrics.md, "Client lag"
# docs/metrics.md, "Memory": a pause in the memory samples this long (and 5 of the usual gaps) is flagged
MEMORY_GAP_FLAG_S = 0.25


@dataclass(frozen=True)
class EngineRun:
    """What every cell of one engine start shares: who ran, on what, under which token contract."""

    run_id: str
    label: str  # the backend's label, e.g. "vllm-0.32.0"
    engine: str
    engine_version: str  # as configured
    model: ModelFiles
    workload: Workload
    kv_dtype: str  # as asked ("auto": the engine's default)
    attached: bool
    engine_version_reported: str | None = None
    token_contract: str = ""
    rules: KVRules | None = None  # how the engine sizes its KV (None: unknown)
    engine_mode: str = ""  # "sized" or "deployed" (:func:`engine_setup`); "": not recorded
    gpus_used: int = 1  # GPUs the engine is split over
    speculative: str = ""  # the drafter it was started with ("": none, or not known: an attached server)
    can_speculate: bool = False  # its adapter has speculative decoding (a row then says what it reported)
    memory_bandwidth: dict | None = None  # run.json's probe (bench/common/bandwidth.py run_probe); None: none
    client_limit: dict | None = None  # run.json's client probe (bench/load/self_probe.py run_probe); None: none
    checkpoint_bytes: int | None = None  # the HF checkpoint's tensors: the weights where the engine reports none
    moe: dict | None = None  # a MoE model's routed experts (run.json model.moe); None: dense


def engine_setup(cls, options: dict, attached: bool = False) -> dict:
    """EngineRun's ``engine_mode`` and ``gpus_used`` for an engine started with ``options``, as its adapter
    declares them: the ``engine_mode`` option (given, else the adapter's default; "" for an adapter without
    one, and for an attached server, whose settings are its operator's) and the GPUs its own
    ``gpus_used(options)`` counts."""
    from kvbench.backends.options import specs_of

    spec = specs_of(cls).get("engine_mode")
    mode = str(options.get("engine_mode", spec.default)) if spec is not None and not attached else ""
    can_speculate = bool(cls.capabilities.speculation.methods)
    drafter = str(options.get("speculative", "none")) if can_speculate and not attached else ""
    drafter = "" if drafter == "none" else drafter  # "": no drafter, as in every run before speculation
    return {"engine_mode": mode, "gpus_used": int(cls.gpus_used(options)), "speculative": drafter,
            "can_speculate": can_speculate}


@dataclass
class CellMeasurement:
    """The raw record of one cell: the load's requests, the engine's own figures read around it, and the
    samplers' timelines. Times are ``time.perf_counter()`` seconds."""

    cell: Cell
    load: LoadResult
    t_cell_start: float
    kv_dtype: str  # the engine's KV dtype name (its default resolved)
    engine_exit: str = ""  # how the engine ended during the cell ("" while it runs)
    log_tail: str = ""  # the engine's log tail, read when no request met the token contract
    kv_pool: KVPool | None = None
    kv_peak: KVInUse | None = None  # the engine's own exact peak, where it tracks one
    kv_samples: list[KVSample] = field(default_factory=list)
    kv_source: str | None = None
    queue_samples: list[QueueSample] = field(default_factory=list)
    queue_source: str | None = None
    memory_samples: list[MemorySample] | None = None  # None: not measured (an attached server)
    rss_baseline_bytes: int | None = None
    gpu_baseline_used_bytes: int | None = None
    # a deployment (backends/deployment.py): each replica's own pool, polls and requests, by host:port; the
    # fields above are then the deployment's totals (KV and queue summed over the replicas at each poll)
    replicas: dict | None = None
    telemetry: dict | None = None  # t_cell_start_unix and the prom_* figures (--prometheus; bench/run/telemetry.py)
    t_cell_start_unix: float | None = None  # t_cell_start in Unix seconds (this machine's wall clock)
    # the engine's prefix-cache counters before and after the cell (None: it keeps none), and whether an
    # earlier cell of this engine start sent the workload's shared prefix (what an ideal cache can reuse)
    prefix_counters: tuple[PrefixCacheCounters | None, PrefixCacheCounters | None] = (None, None)
    prefix_seen: bool = False
    # the engine's speculative-decoding counters before and after the cell (None: it keeps none)
    spec_counters: tuple[SpeculationCounters | None, SpeculationCounters | None] = (None, None)
    # the engine's own bytes-a-step estimate before and after the cell (None: it keeps none)
    step_bytes_counters: tuple[StepBytesCounters | None, StepBytesCounters | None] = (None, None)


def failed_row(run: EngineRun, cell: Cell, status: str, error: str | None, log_tail: str | None) -> CellRow:
    """The row of a cell with no figures: failed, or not run (and why)."""
    w = run.workload
    # a drafter is part of what the cell measured: compare matches its cells with the same drafter's only
    variant = ",".join(filter(None, [cell.variant, run.speculative and f"speculative={run.speculative}"]))
    return CellRow(run_id=run.run_id, cell_id=cell.cell_id(run.label), backend=run.label, engine=run.engine,
                   engine_version=run.engine_version, model=run.model.name, workload=w.name, variant=variant,
                   prompt_tokens=w.prompt_tokens_sent(cell.prompt_tokens, cell.turn), output_tokens=w.output_tokens,
                   load_profile=cell.load.profile, concurrency=cell.load.concurrency,
                   request_rate=cell.load.request_rate, repeat=cell.repeat, kv_dtype=run.kv_dtype,
                   attached=run.attached, engine_mode=run.engine_mode, gpus_used=run.gpus_used,
                   status=status, error=error,
                   log_tail=log_tail or None, slo_ttft_s=w.slo_ttft_s, slo_tpot_s=w.slo_tpot_s)


def summarize(run: EngineRun, m: CellMeasurement) -> CellRow:
    """The cell's row from its measurement."""
    w = run.workload
    row = failed_row(run, m.cell, "ok", None, None)
    row.engine_version_reported, row.token_contract = run.engine_version_reported, run.token_contract
    results = m.load.results
    row.t_cell_start = m.t_cell_start
    row.requests_planned = m.cell.requests
    request_figures(row, m.load, m.engine_exit, m.log_tail)
    windows, n_served = request_windows(results), served(results)
    _kv(row, run, m, windows, n_served)
    if m.queue_samples:  # the engine's queue: the KV boundary shows as requests waiting or preempted
        (row.requests_waiting_peak, row.requests_running_peak, row.preemptions,
         row.queue_source) = queue_peaks(m.queue_samples, windows, m.queue_source, n_served)
    _memory(row, m)
    _per_gpu(row, run, m)
    _queued_first(row, m)
    prefix_cache_columns(row, w, m.cell, results, run.rules, run.model.geometry, m.kv_dtype, m.kv_pool,
                         m.prefix_counters, m.prefix_seen)
    speculation_columns(row, run.speculative, run.can_speculate, results, m.spec_counters)
    decode_bound_columns(row, run.model.geometry, run.memory_bandwidth, run.checkpoint_bytes, w.output_tokens, run.moe)
    engine_step_bytes_columns(row, *m.step_bytes_counters)
    client = self_probe.cell_columns(results, m.load.t_end - m.load.t_start, row.concurrency, run.client_limit,
                                     m.load.processes)
    for k, v in client.items():
        setattr(row, k, v)
    if flag := self_probe.near_limit_flag(row.client_limit_share):
        row.flags.append(flag)
    row.t_cell_start_unix = m.t_cell_start_unix
    for k, v in (m.telemetry or {}).items():  # the cluster's own monitoring, as read from Prometheus
        setattr(row, k, v)
    return row


def _queued_first(row: CellRow, m: CellMeasurement) -> None:
    """When requests first waited in the engine's queue; for a deployment, the replica that queued first."""
    row.queued_first_s = first_waiting(m.queue_samples, m.t_cell_start)
    if m.replicas:
        row.replicas = len(m.replicas)
        firsts = [(t, label) for label, rp in m.replicas.items()
                  if (t := first_waiting(rp.queue_samples, m.t_cell_start)) is not None]
        if firsts:
            row.queued_first_s, row.queued_first_replica = min(firsts)


def first_waiting(samples: list[QueueSample], t0: float) -> float | None:
    """Seconds from ``t0`` to the first poll that found requests waiting (None: none did)."""
    return next((q.t - t0 for q in samples if q.waiting), None)


def replica_rows(run: EngineRun, m: CellMeasurement, total: CellRow) -> list[CellRow]:
    """A deployment's rows per replica, beside the total row ``total`` (none for a single server). Each is
    the replica's own pool, KV in use and queue, and, round-robin, the requests it served (their latency,
    throughput and token contract); through a gateway which replica served a request is not known, so a
    replica's row has its KV and queue only (request figures "not measured")."""
    rows = []
    for label, rp in (m.replicas or {}).items():
        mine = [r for r in m.load.results if rp.request_ids is not None and r.request_id in rp.request_ids]
        load = LoadResult(mine, m.load.t_start, m.load.t_end, max_in_flight=max_overlap(request_windows(mine)),
                          loop_lag_s_max=m.load.loop_lag_s_max, processes=m.load.processes)
        part = CellMeasurement(m.cell, load, m.t_cell_start, m.kv_dtype, kv_pool=rp.kv_pool,
                               kv_samples=rp.kv_samples, kv_source=rp.kv_source, queue_samples=rp.queue_samples,
                               queue_source=rp.queue_source)
        row = summarize(run, part)
        row.cell_id, row.replica, row.replicas = f"{total.cell_id}@{label}", label, len(m.replicas)
        row.engine_version_reported = rp.version or total.engine_version_reported
        if not mine:  # through a gateway (which replica served a request is not known), or it served none
            row.status, row.error, row.flags, row.log_tail = total.status, None, [], None
            row.n_requests = row.n_ok = 0
            for name in ("max_in_flight", "kv_tokens_peak_predicted", "kv_bytes_peak_predicted",
                         "kv_measured_over_predicted", "client_loop_lag_s_max"):
                setattr(row, name, None)
        rows.append(row)
    return rows


def max_overlap(windows: list[tuple[float, float]]) -> int:
    """The most windows (start, end) open at once."""
    events = sorted([(start, 1) for start, _ in windows] + [(end, -1) for _, end in windows],
                    key=lambda e: (e[0], e[1]))
    most = now = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def _kv(row: CellRow, run: EngineRun, m: CellMeasurement, windows, n_served: int) -> None:
    """KV predicted from the config, the engine's pool, and the peak in use."""
    w = run.workload
    row.kv_dtype = m.kv_dtype
    geometry, rules = run.model.geometry, run.rules
    # The last sampled token is never fed back, so its K/V never exist: prompt + output - 1 per sequence.
    cached = row.prompt_tokens + w.output_tokens - 1
    row.kv_bytes_per_token_predicted, per_sequence = formula_bytes(geometry, rules, m.kv_dtype, cached,
                                                                   w.output_tokens - 1)
    pool = m.kv_pool
    if pool:
        row.kv_pool_bytes_engine, row.kv_pool_tokens_engine, row.kv_pool_source = pool.bytes, pool.tokens, pool.source
        if m.replicas and pool.tokens and rules:  # a deployment: each replica's pool by the rules, summed
            _deployment_pool(row, rules, geometry, m, row.prompt_tokens + w.output_tokens)
        elif pool.tokens and rules:  # the engine's rules: how a pool of that many tokens is laid out
            row.kv_pool_bytes_predicted = pool.tokens * rules.pool_bytes_per_token(geometry, m.kv_dtype, pool.details)
            row.kv_pool_sequences_predicted = rules.sequences_in_pool(
                geometry, pool.tokens, row.prompt_tokens + w.output_tokens, pool.details)
    # Sequences held at once: as many as were in flight, unless the pool holds fewer (the KV boundary).
    held = max(1, min(row.max_in_flight or 1, row.kv_pool_sequences_predicted or 10**9))
    row.kv_tokens_peak_predicted = held * cached
    # the model's own need by the plain formula (windows applied); an engine's rounding shows in the ratio
    row.kv_bytes_peak_predicted = held * per_sequence if per_sequence is not None else None
    peak = m.kv_peak
    if peak is None and m.kv_samples:
        best, row.kv_in_use_source = polled_kv_peak(m.kv_samples, windows, m.kv_source, n_served)
        if best is not None:
            row.kv_in_use_peak_bytes, row.kv_in_use_peak_tokens = best.kv_bytes_in_use, best.kv_tokens_in_use
    elif peak is not None:
        row.kv_in_use_peak_bytes, row.kv_in_use_peak_tokens, row.kv_in_use_source = peak.bytes, peak.tokens, peak.source
        row.kv_allocator_bytes_peak = peak.details.get("allocator_bytes")
        row.kv_allocator_generate_peak_bytes = peak.details.get("allocator_generate_peak_bytes")
        row.kv_allocator_reserved_delta_bytes = peak.details.get("allocator_reserved_delta_bytes")
    elif m.kv_source:  # no poll read a figure: the poller says why (e.g. every poll failed)
        row.kv_in_use_source = m.kv_source
    if row.kv_in_use_peak_bytes and row.kv_bytes_peak_predicted:
        row.kv_measured_over_predicted = row.kv_in_use_peak_bytes / row.kv_bytes_peak_predicted
    if pool and pool.bytes and pool.tokens and rules and not m.replicas:
        declined_dtype(row, rules, geometry, m.kv_dtype, pool)


def _deployment_pool(row: CellRow, rules: KVRules, geometry, m: CellMeasurement, context: int) -> None:
    """A deployment's pool: each replica's predicted bytes and sequences (its own pool, by the engine's
    rules) summed; the deployment holds as many sequences at once as its replicas together."""
    pools = [rp.kv_pool for rp in m.replicas.values()]
    if any(p is None or not p.tokens for p in pools):
        return
    row.kv_pool_bytes_predicted = sum(p.tokens * rules.pool_bytes_per_token(geometry, m.kv_dtype, p.details)
                                      for p in pools)
    fits = [rules.sequences_in_pool(geometry, p.tokens, context, p.details) for p in pools]
    row.kv_pool_sequences_predicted = None if any(f is None for f in fits) else sum(fits)


def _memory(row: CellRow, m: CellMeasurement) -> None:
    """Peaks of the process tree's memory timeline (not measured for an attached server: not our processes)."""
    row.rss_baseline_bytes = m.rss_baseline_bytes
    samples = m.memory_samples or []
    row.memory_samples = len(samples)
    if not samples:
        return
    row.rss_peak_bytes = max(s.rss_bytes for s in samples)
    span = samples[-1].t - samples[0].t
    row.memory_sample_hz = (len(samples) - 1) / span if span > 0 else None
    row.flags.extend(memory_gap_flag(samples))
    row.gpu_process_peak_bytes = _max_known(s.gpu_process_bytes for s in samples)
    row.gpu_device_peak_bytes = _max_known(s.gpu_device_used_bytes for s in samples)
    row.gpu_device_over_baseline_peak_bytes = _max_known(s.gpu_device_over_baseline_bytes for s in samples)
    row.gpu_device_total_bytes = samples[-1].gpu_device_total_bytes
    row.gpu_device_reserved_bytes = samples[-1].gpu_device_reserved_bytes
    row.gpu_baseline_used_bytes = m.gpu_baseline_used_bytes
    row.gpu_devices = device_peaks(samples)


def device_peaks(samples: list[MemorySample]) -> list[dict]:
    """Per GPU (NVML's index order): the peaks of its used memory, of its use over the idle baseline and of
    the engine's processes on it, and its size; [] without per-device samples."""
    per = [s.gpu_per_device for s in samples if s.gpu_per_device]
    if not per:
        return []
    out = []
    for i in range(max(len(p) for p in per)):
        at = [p[i] for p in per if i < len(p)]
        out.append({"index": at[-1].get("index", i), "used_peak_bytes": _max_known(d.get("used_bytes") for d in at),
                    "over_baseline_peak_bytes": _max_known(d.get("over_baseline_bytes") for d in at),
                    "process_peak_bytes": _max_known(d.get("process_bytes") for d in at),
                    "total_bytes": at[-1].get("total_bytes")})
    return out


def engaged_devices(devices: list[dict], gpus_used: int) -> list[dict]:
    """The devices the engine ran on: the ``gpus_used`` with the most memory over the baseline (NVML lists
    every GPU of the machine; CUDA_VISIBLE_DEVICES may have given the engine any of them)."""
    def grown(d):
        return d.get("over_baseline_peak_bytes") if d.get("over_baseline_peak_bytes") is not None \
            else d.get("process_peak_bytes") or 0
    return sorted(devices, key=grown, reverse=True)[:max(1, gpus_used)]


def memory_gap_flag(samples: list[MemorySample]) -> list[str]:
    """A flag for the widest pause in the memory samples when it is long: the sampler's thread got no CPU
    (the engine or another process had the cores), so a peak within it may be missed, and the cell's
    sample rate is low; [] when the samples kept their pace."""
    gaps = sorted(b.t - a.t for a, b in zip(samples, samples[1:]))
    if not gaps or gaps[-1] <= max(MEMORY_GAP_FLAG_S, 5 * gaps[len(gaps) // 2]):
        return []
    return [f"memory not sampled for {gaps[-1]:.2f} s of this cell (the harness got no CPU: the engine or "
            f"another process had the cores): a peak in that time may be missed"]


def _per_gpu(row: CellRow, run: EngineRun, m: CellMeasurement) -> None:
    """KV per GPU (in use, and the engine's rules for one GPU at this load) and memory besides KV per GPU:
    the engine's weights, and the rest (device use over the idle baseline on the fullest GPU, minus the
    weights' share and the KV pool on it)."""
    gpus = max(1, row.gpus_used)
    pool, peak = m.kv_pool, m.kv_peak
    details = {**(pool.details if pool else {})}
    per_gpu_in_use = (peak.details or {}).get("bytes_per_gpu") if peak is not None else None
    if per_gpu_in_use is None and row.kv_in_use_peak_bytes is not None:
        per_gpu_in_use = row.kv_in_use_peak_bytes / gpus
    row.kv_in_use_peak_bytes_per_gpu = per_gpu_in_use
    # where the rules' answer for a load is what the engine's in-use figure counts (vLLM's blocks held,
    # transformers' cache); llama.cpp's answer is its whole allocation, checked by kvbench validate instead
    if run.rules is not None and run.rules.answer_is_in_use and row.kv_tokens_peak_predicted:

        held = row.kv_tokens_peak_predicted // max(1, row.prompt_tokens + run.workload.output_tokens - 1)
        q = KVQuestion(run.model.geometry, m.kv_dtype, row.prompt_tokens + run.workload.output_tokens - 1,
                       max(1, held), gpus, details.get("block_size"), details.get("device", "gpu"),
                       details.get("version"), {"decoded_tokens": run.workload.output_tokens - 1})
        w = run.workload
        try:
            if w.shared_prefix_tokens and meant_warm(w, m.cell):  # the prefix held once where the engine shares
                row.kv_peak_bytes_per_gpu_predicted = run.rules.shared_prefix_bytes(q, w.shared_prefix_tokens)[0]
            else:
                row.kv_peak_bytes_per_gpu_predicted = run.rules.answer(q).bytes_per_gpu
        except Exception:  # a split the rules refuse (e.g. heads not divisible): not predicted
            row.kv_peak_bytes_per_gpu_predicted = None
    weights = details.get("weights_bytes")
    row.weights_bytes_engine, row.weights_source = weights, details.get("weights_source")
    engaged = engaged_devices(row.gpu_devices, gpus) if row.gpu_devices else []
    fullest = max((d.get("over_baseline_peak_bytes") for d in engaged
                   if d.get("over_baseline_peak_bytes") is not None), default=None)
    kv_per_gpu = details.get("bytes_per_gpu")
    if kv_per_gpu is None and pool is not None and pool.bytes is not None:
        kv_per_gpu = pool.bytes / gpus
    if kv_per_gpu is None:  # no pool (transformers): the cache in use is the KV
        kv_per_gpu = row.kv_allocator_bytes_peak / gpus if row.kv_allocator_bytes_peak else per_gpu_in_use
    if fullest is not None and weights is not None and kv_per_gpu is not None:
        weights_per_gpu = details.get("weights_bytes_per_gpu") or weights / gpus
        row.gpu_overhead_bytes_per_gpu = fullest - weights_per_gpu - kv_per_gpu


def _max_known(values):
    known = [v for v in values if v is not None]
    return max(known) if known else None


def request_windows(results: list[RequestResult]) -> list[tuple[float, float]]:
    """Each request's time in flight: sent to done (its last chunk, or its send, when it never ended)."""
    return [(r.t_sent, r.t_done or (r.chunk_times[-1] if r.chunk_times else r.t_sent)) for r in results]


def polls_during(samples, windows: list[tuple[float, float]]) -> int:
    """How many polls (anything with a ``t``) fell inside a request's window (sent to done)."""
    return sum(1 for s in samples if any(start <= s.t <= end for start, end in windows))


def served(results: list[RequestResult]) -> int:
    """How many of the cell's requests got output tokens: each held KV in the engine while it ran."""
    return sum(1 for r in results if r.chunk_times)


def _blind_spot(samples, windows: list[tuple[float, float]], n_served: int, source: str | None, missed: str):
    """Why polls that read nothing are no measurement, or None when their zero stands: none of them fell
    while a request was in flight, or the engine served requests (so it held them, and their KV) and no
    poll saw it: a gauge behind the engine, a starved poller, or requests shorter than the poll period."""
    if not polls_during(samples, windows):
        return f"not measured: none of {len(samples)} polls of {source} fell while a request was in flight"
    if n_served:
        return (f"not measured: none of {len(samples)} polls of {source} {missed} (a gauge behind the engine, "
                "a starved poller, or requests shorter than the poll period)")
    return None


def queue_peaks(samples: list[QueueSample], windows: list[tuple[float, float]], source: str | None,
                n_served: int = 0):
    """(waiting peak, running peak, preemptions, how found) of a cell from the engine's queue polls.
    Peaks of zero that are the polls' blind spot (see _blind_spot) are "not measured"; the preemption
    counter is cumulative, so it stays right whenever the polls bracket the cell."""
    waiting = [q.waiting for q in samples if q.waiting is not None]
    running = [q.running for q in samples if q.running is not None]
    preempted = [q.preemptions for q in samples if q.preemptions is not None]
    preemptions = preempted[-1] - preempted[0] if preempted else None
    blind = (_blind_spot(samples, windows, n_served, source, f"saw the cell's {n_served} served requests")
             if windows and not any(running) and not any(waiting) else None)
    if blind:
        return None, None, preemptions, blind
    return (max(waiting) if waiting else None, max(running) if running else None, preemptions,
            f"max of {len(samples)} polls of {source}")


def polled_kv_peak(samples: list[KVSample], windows: list[tuple[float, float]], source: str | None,
                   n_served: int = 0):
    """The largest polled "KV in use" of a cell and how it was found, or None when every poll read nothing
    and that zero is the polls' blind spot (see _blind_spot), not a measurement."""
    best = max(samples, key=lambda s: s.kv_bytes_in_use or 0)
    blind = (_blind_spot(samples, windows, n_served, source,
                         f"read the KV of the cell's {n_served} served requests")
             if not best.kv_bytes_in_use and windows else None)
    if blind:
        return None, blind
    return best, f"max of {len(samples)} polls of {source}"


def request_row(run_id: str, cell_id: str, label: str, r: RequestResult, warmup: bool = False,
                repeat: int = 0) -> RequestRow:
    times = RequestTimes.of(r)
    return RequestRow(run_id=run_id, cell_id=cell_id, backend=label, request_id=r.request_id, warmup=warmup,
                      prompt_tokens_sent=r.prompt_tokens_sent, prompt_tokens_reported=r.prompt_tokens_reported,
                      prompt_tokens_cached=r.prompt_tokens_cached, spec_draft_tokens=r.spec_draft_tokens,
                      spec_accepted_tokens=r.spec_accepted_tokens, output_tokens_requested=r.output_tokens_requested, output_tokens_received=times.output_tokens,
                      output_tokens_reported=r.output_tokens_reported, t_sent=r.t_sent, t_done=r.t_done,
                      chunk_times=r.chunk_times, chunk_tokens=r.chunk_tokens, ttft_s=times.ttft, e2e_s=times.e2e,
                      error=r.error, engine_details=r.engine_details, t_scheduled=r.t_scheduled,
                      repeat=repeat, ordinal=r.ordinal, load_process=r.load_process,
                      clock_offset_start_s=r.clock_offset_start_s, clock_offset_end_s=r.clock_offset_end_s)


def summary_line(row: CellRow) -> str:
    """The console's line for a finished cell (rich markup)."""
    head = (f"{row.backend:<18} prompt {row.prompt_tokens:>6} "
            f"{load_label(row.load_profile, row.concurrency, row.request_rate):<8}"
            + (f" {row.variant}" if row.variant else ""))
    if row.status == "failed":
        return f"{head} [red]failed[/]: {row.error}"
    color = "green" if row.status == "ok" else "yellow"
    ratio = f" (x{row.kv_measured_over_predicted:.3f} of predicted)" if row.kv_measured_over_predicted else ""
    queue = f", waiting peak {row.requests_waiting_peak:g}" if row.requests_waiting_peak else ""
    lag = row.client_loop_lag_s_max
    lagged = (f"\n  [yellow]warning[/]: the client's event loop ran up to {lag * 1000:.0f} ms late: its TTFT/ITL "
              "may be late by as much (a CPU shared with the engine or another process)"
              if lag is not None and lag > CLIENT_LAG_WARN_S else "")
    itl = "undefined" if row.itl_s_p50 is None else f"{row.itl_s_p50 * 1000:.1f} ms"  # no gap measured: not 0
    hits = "" if row.prefix_cache_hit_rate is None else f", prefix cache hits {row.prefix_cache_hit_rate:.1%}"
    hits += "" if row.spec_acceptance_rate is None else f", drafts accepted {row.spec_acceptance_rate:.1%}"
    warned = "".join(f"\n  [yellow]warning[/]: {f}" for f in row.flags
                     if f.startswith(("prefix cache hit", "memory not sampled", "client near its limit",
                                   "decode bytes disagree")))
    return (f"{head} [{color}]{row.status}[/] TTFT p50 {row.ttft_s_p50:.3f} s, ITL p50 "
            f"{itl}, {row.output_tokens_per_s or 0:.1f} out tok/s, "
            f"KV peak {fmt_bytes(row.kv_in_use_peak_bytes)}{ratio}, RSS peak {fmt_bytes(row.rss_peak_bytes)}"
            f"{queue}{hits}{lagged}{warned}")


def timeline_frame(t0: float, memory, kv, queue=(), replicas: dict | None = None) -> pd.DataFrame:
    """Memory, KV and queue samples on one time axis (seconds since the cell started). A deployment's
    ``replicas`` add each replica's own KV and queue samples, their ``replica`` its host:port (the
    deployment's totals have replica "")."""
    rows = [{"t_s": s.t - t0, "series": "memory", "rss_bytes": s.rss_bytes, "n_processes": s.n_processes,
             "gpu_process_bytes": s.gpu_process_bytes, "gpu_device_used_bytes": s.gpu_device_used_bytes,
             "gpu_device_reserved_bytes": s.gpu_device_reserved_bytes,
             "gpu_device_over_baseline_bytes": s.gpu_device_over_baseline_bytes} for s in memory]
    rows += [{"t_s": s.t - t0, "series": "kv", "kv_bytes_in_use": s.kv_bytes_in_use,
              "kv_tokens_in_use": s.kv_tokens_in_use} for s in kv]
    rows += [{"t_s": s.t - t0, "series": "queue", "requests_waiting": s.waiting, "requests_running": s.running,
              "preemptions": s.preemptions} for s in queue]
    for label, rp in (replicas or {}).items():
        rows += [{"t_s": s.t - t0, "series": "kv", "kv_bytes_in_use": s.kv_bytes_in_use,
                  "kv_tokens_in_use": s.kv_tokens_in_use, "replica": label} for s in rp.kv_samples]
        rows += [{"t_s": s.t - t0, "series": "queue", "requests_waiting": s.waiting, "requests_running": s.running,
                  "preemptions": s.preemptions, "replica": label} for s in rp.queue_samples]
    frame = pd.DataFrame(rows, columns=TIMELINE_COLUMNS)
    frame["replica"] = frame.replica.astype(object).fillna("")
    return frame.sort_values("t_s", kind="stable")


TIMELINE_COLUMNS = ["t_s", "series", "rss_bytes", "n_processes", "gpu_process_bytes", "gpu_device_used_bytes",
                    "gpu_device_reserved_bytes", "gpu_device_over_baseline_bytes", "kv_bytes_in_use",
                    "kv_tokens_in_use", "requests_waiting", "requests_running", "preemptions", "replica"]
