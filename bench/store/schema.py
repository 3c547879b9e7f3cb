"""The results schema: one row per cell (:class:`CellRow`) and per request (:class:`RequestRow`), its version,
and how a stored row of any earlier version reads as one of the current schema (:func:`migrate_row`).

The version changes with every column; docs/results-schema.md says what each version added.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

OK_STATUSES = ("ok", "flagged")  # cell statuses whose figures count (flagged: some requests broke the contract)
SCHEMA_VERSION = 12
#: The fields that say what a cell *is*; two cells with equal values measure the same thing
#: (``kvbench compare`` matches on these, repeats aside).
CELL_CONFIG_FIELDS = ("engine", "engine_version", "model", "workload", "variant", "prompt_tokens", "output_tokens",
                      "load_profile", "concurrency", "request_rate", "kv_dtype")


class CellRow(BaseModel):
    """One cell's summary. Every size is in bytes, every time in seconds; None means "not measured"."""

    schema_version: int = SCHEMA_VERSION
    run_id: str
    cell_id: str
    backend: str  # label, e.g. "vllm-0.32.0"
    engine: str
    engine_version: str  # as configured (the environment's version)
    engine_version_reported: str | None = None  # as the running engine reports it
    model: str
    workload: str
    variant: str = ""  # a workload's setting beyond length and load, e.g. "prefix_caching=on", "turn=3"
    prompt_tokens: int
    output_tokens: int
    # load: a closed loop of `concurrency` workers ("concurrent"), or an open loop ("poisson", "constant") at
    # `request_rate` requests/s with at most `concurrency` in flight (None: no cap)
    load_profile: str = "concurrent"  # a name in kvbench.load.registry
    concurrency: int | None
    request_rate: float | None = None
    repeat: int = 0  # 0-based index of the repeated run of this cell
    kv_dtype: str
    # how output length was forced and prompts checked, e.g. "token ids, ignore_eos" (compare refuses to
    # compare cells whose contracts differ)
    token_contract: str = ""
    attached: bool = False  # benchmarked a server kvbench did not start: no process memory
    # "sized": the KV pool sized by kvbench for the workload; "deployed": the engine's own defaults
    # (vLLM's memory utilisation and CUDA graphs, llama.cpp's context, TGI's auto batch tokens); "": not recorded
    engine_mode: str = ""
    gpus_used: int = 1  # GPUs the engine was split over (vLLM/TGI tensor parallel, llama.cpp layers, device_map)
    status: Literal["ok", "flagged", "failed", "not run"]
    flags: list[str] = Field(default_factory=list)
    error: str | None = None
    log_tail: str | None = None
    n_requests: int = 0
    n_ok: int = 0  # requests that met the token contract: the only ones in the headline figures
    n_failed: int = 0
    n_truncated: int = 0  # the engine read fewer prompt tokens than were sent
    n_short: int = 0  # fewer output tokens than asked
    # load actually achieved (open loop: offered vs achieved shows coordinated omission)
    offered_request_rate: float | None = None
    achieved_request_rate: float | None = None
    send_lag_s_p99: float | None = None  # how late requests left against their schedule
    client_loop_lag_s_max: float | None = None  # the client's event loop at its latest: bounds its own timing error
    # the client against its own limit, probed at the run's start (bench/load/self_probe.py): the streamed
    # events the cell read a second, that over the probe's ceiling, and the probe's TTFT lateness at the
    # nearest concurrency it probed (what the client alone adds to a TTFT there)
    client_events_per_s: float | None = None
    client_limit_share: float | None = None
    client_ttft_overhead_s: float | None = None
    max_in_flight: int | None = None
    # latency / throughput (bench/common/metrics.py defines each)
    ttft_s_mean: float | None = None
    ttft_s_p50: float | None = None
    ttft_s_p90: float | None = None
    ttft_s_p99: float | None = None
    itl_s_mean: float | None = None
    itl_s_p50: float | None = None
    itl_s_p90: float | None = None
    itl_s_p99: float | None = None
    tpot_s_mean: float | None = None
    tpot_s_p50: float | None = None
    tpot_s_p90: float | None = None
    tpot_s_p99: float | None = None
    e2e_s_mean: float | None = None
    e2e_s_p50: float | None = None
    e2e_s_p90: float | None = None
    e2e_s_p99: float | None = None
    wall_s: float | None = None
    output_tokens_per_s: float | None = None
    total_tokens_per_s: float | None = None
    requests_per_s: float | None = None
    goodput_requests_per_s: float | None = None  # requests within the SLO per second
    slo_ttft_s: float | None = None
    slo_tpot_s: float | None = None
    # queueing (the KV boundary): the engine's own counters during the cell
    requests_waiting_peak: float | None = None
    requests_running_peak: float | None = None
    preemptions: float | None = None  # during the cell (counter difference)
    queue_source: str | None = None
    # sequences of prompt_tokens + output_tokens that the engine's KV pool holds at once, by the KV model
    # (kvbench.kv.geometry's engine rule applied to the pool the engine reported); the KV boundary compares
    # this with requests_running_peak
    kv_pool_sequences_predicted: int | None = None
    # KV: predicted from the config, allocated by the engine, and in use at the peak
    kv_bytes_per_token_predicted: float | None = None
    kv_tokens_peak_predicted: int | None = None  # concurrency x (prompt + output - 1)
    kv_bytes_peak_predicted: float | None = None
    kv_pool_bytes_engine: int | None = None
    kv_pool_tokens_engine: int | None = None
    kv_pool_bytes_predicted: float | None = None
    kv_pool_source: str | None = None
    kv_in_use_peak_bytes: float | None = None
    kv_in_use_peak_tokens: float | None = None
    kv_in_use_source: str | None = None
    kv_measured_over_predicted: float | None = None
    kv_allocator_bytes_peak: int | None = None  # CUDA allocator delta (transformers on a GPU)
    kv_allocator_generate_peak_bytes: int | None = None  # allocator peak during generate, over its start
    kv_allocator_reserved_delta_bytes: int | None = None  # the caching allocator's reserved growth
    # memory of the engine's process tree
    rss_baseline_bytes: int | None = None
    rss_peak_bytes: int | None = None
    gpu_process_peak_bytes: int | None = None
    gpu_device_peak_bytes: int | None = None
    gpu_device_over_baseline_peak_bytes: int | None = None  # device used minus the idle baseline
    gpu_baseline_used_bytes: int | None = None  # device used before the engine started
    gpu_device_total_bytes: int | None = None
    gpu_device_reserved_bytes: int | None = None
    # per GPU (NVML), one dict per device in index order: index, used_peak_bytes, over_baseline_peak_bytes,
    # process_peak_bytes, total_bytes (a list, not columns per device: the number of GPUs differs by machine)
    gpu_devices: list[dict] = Field(default_factory=list)
    # KV per GPU: the engine's in-use peak on its fullest GPU, and what its rules give for one GPU at the
    # same load (`kvbench plan --tp N`'s per-GPU figure; a warm shared-prefix cell: `--shared-prefix`'s, the
    # prefix held once where the engine shares it)
    kv_in_use_peak_bytes_per_gpu: float | None = None
    kv_peak_bytes_per_gpu_predicted: float | None = None
    # memory besides KV, per GPU: the weights as the engine reports them, and the rest measured (device
    # used over the idle baseline, minus weights and KV pool): CUDA context, graphs, activations, slack
    weights_bytes_engine: float | None = None
    weights_source: str | None = None
    gpu_overhead_bytes_per_gpu: float | None = None
    memory_samples: int = 0
    memory_sample_hz: float | None = None
    t_cell_start: float | None = None  # perf_counter at the cell's start: timelines count from here
    t_cell_start_unix: float | None = None  # the same instant in Unix seconds (telemetry/<cell_id>.csv's clock)
    # the cluster's own monitoring, read from Prometheus after the cell (`--prometheus`; bench/run/telemetry.py):
    # DCGM exporter's framebuffer used per GPU at its peak (one dict per device: device (UUID), gpu, hostname,
    # model, used_peak_bytes) and on the fullest GPU; per engine instance its KV usage (0-1) and queue peaks;
    # preemptions during the cell summed over engines; how many samples and from where (or why not measured)
    prom_gpu_used_peak_bytes: float | None = None
    prom_gpu_devices: list[dict] = Field(default_factory=list)
    prom_kv_usage_peak: float | None = None
    prom_requests_running_peak: float | None = None
    prom_requests_waiting_peak: float | None = None
    prom_preemptions: float | None = None
    prom_engines: list[dict] = Field(default_factory=list)
    prom_samples: int = 0
    prom_source: str | None = None
    # a deployment of several replicas (backends/deployment.py): each cell has the deployment's total row
    # (replica "", its figures over every request, KV and queue summed over the replicas at each poll, the
    # pool's sequences summed) and one row per replica (replica = its host:port, cell_id the total's +
    # "@host:port": its own pool, KV and queue, and the requests it served). Compare and the plots read the
    # rows with replica "" only.
    replica: str = ""  # "": a single server, or a deployment's total
    replicas: int | None = None  # the replicas of the deployment (None: a single server)
    queued_first_s: float | None = None  # first poll with requests waiting > 0, seconds since the cell started
    queued_first_replica: str | None = None  # a deployment's total row: the replica that queued first
    # the prefix cache: whether the cell is meant to hit it ("cold": its prompts share nothing with anything
    # sent before; "warm": a shared prefix, a later turn; "": not recorded), the share of its prompt tokens an
    # ideal cache at the engine's reuse unit serves (bench/run/cells.py expected_hit_tokens), and what the
    # engine says it served: prompt tokens looked up and found, from its per-request counts or counters
    # (the source says which, or "not reported" where the engine says nothing)
    prefix_cache_expected: Literal["", "cold", "warm"] = ""
    prefix_cache_expected_hit_rate: float | None = None
    prefix_cache_hit_rate: float | None = None
    prefix_cache_hit_tokens: int | None = None
    prefix_cache_query_tokens: int | None = None
    prefix_cache_source: str | None = None
    # the load processes that sent the cell (kvbench run --load-workers, or the runs `kvbench merge` joined;
    # None: not recorded), the requests the cell planned over all of them, and how many of those were lost
    # with a load process that died before handing them back (counted in n_requests and n_failed too)
    load_processes: int | None = None
    requests_planned: int | None = None
    n_lost: int = 0
    # speculative decoding (bench/run/speculation.py, docs/speculation.md): the drafter the engine was started
    # with ("ngram", "draft", ...; "": none, or not known: an attached server), the draft tokens it
    # proposed and the target accepted over the cell, the drafts (verification steps) where the engine counts
    # them, accepted / drafted, 1 + accepted / drafts (tokens a step yields), the target's passes per output
    # token ((output - accepted) / output), and where the figures were read ("not reported": it said nothing)
    spec_method: str = ""
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    spec_drafts: int | None = None
    spec_acceptance_rate: float | None = None
    spec_tokens_per_step: float | None = None
    spec_steps_per_output_token: float | None = None
    spec_source: str | None = None
    # decode against the memory-bandwidth limit (bench/common/bandwidth.py; docs/metrics.md, "Decode bound"): the
    # bytes one decode step reads by kvbench's model (the weights once, the K/V every running sequence attends to
    # at the cell's mean decode position), the KV's share of them, those bytes over the run's measured read
    # bandwidth (the fastest an ITL can be), that bound over the median ITL measured, and what each came from
    decode_step_bytes: float | None = None
    decode_kv_share: float | None = None
    itl_s_bound: float | None = None
    decode_efficiency: float | None = None
    decode_bound_source: str | None = None
    # the engine's own estimate beside kvbench's (vLLM --enable-mfu-metrics): the bytes its forward passes read
    # and wrote over the cell over the steps it took (prefill steps among them), and where they were read
    engine_step_read_bytes: float | None = None
    engine_step_write_bytes: float | None = None
    engine_step_bytes_source: str | None = None


class RequestRow(BaseModel):
    schema_version: int = SCHEMA_VERSION
    run_id: str
    cell_id: str
    backend: str
    request_id: str
    warmup: bool = False
    prompt_tokens_sent: int
    prompt_tokens_reported: int | None
    prompt_tokens_cached: int | None = None  # of those, what the engine says its prefix cache served
    # speculative decoding: the tokens drafted for this request and those accepted, as the engine reports them
    # per request (llama.cpp's timings); None: not reported (vLLM counts per cell only)
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    output_tokens_requested: int
    output_tokens_received: int
    output_tokens_reported: int | None
    t_sent: float
    t_done: float | None
    chunk_times: list[float]
    chunk_tokens: list[int]
    t_scheduled: float | None = None  # open loop: when the schedule wanted it sent (t_sent - this = lag)
    repeat: int = 0
    ttft_s: float | None
    e2e_s: float | None
    error: str | None
    engine_details: dict = Field(default_factory=dict)
    # the request's place in its cell's schedule (0..requests_planned-1, whichever load process sent it), that
    # process (host:pid), and that process's clock offset to the run's owner measured at the cell's start and
    # end: the times above are on the owner's clock (the process's own reading + the offset, interpolated
    # between the two); None: not recorded (earlier runs), or not measured
    ordinal: int | None = None
    load_process: str = ""
    clock_offset_start_s: float | None = None
    clock_offset_end_s: float | None = None




#: What every v1 row's requests were (not recorded then): every backend of schema v1 sent token ids and
#: forced the output length (hf, vllm and llamacpp up to eb535a0, which added the field), as the
#: runner's contract of today says it for those backends; so a v1 run compares with a later one.
V1_TOKEN_CONTRACT = "token ids, output forced"


def migrate_row(row: dict, model: type[BaseModel]) -> dict:
    """One stored row (any schema version) as a row of the current schema.

    v1 -> v2: the fields v2 added take their defaults (``repeat`` 0, ``load_profile`` "concurrent",
    ``request_rate`` None, ``variant`` "", ``attached`` False, the queueing and goodput fields None): a v1
    run was one closed-loop repeat of each cell; ``token_contract`` :data:`V1_TOKEN_CONTRACT`, what every v1
    backend did.
    v2 -> v3: ``client_loop_lag_s_max`` None where the row lacks it (not measured). A stored cell's TPOT and
    goodput keep the figures its run wrote (a v2 TPOT may be 0.0 where v3 says undefined): ``kvbench report
    --recompute RUN`` rebuilds them from requests.jsonl under the current definitions.
    v3 -> v4: ``engine_mode`` "" (not recorded: every earlier run sized the pool itself, as "sized" does
    now, and started vLLM with --enforce-eager), ``gpus_used`` 1, ``gpu_devices`` [], and the per-GPU KV,
    weights and overhead fields None (not measured).
    v4 -> v5: ``replica`` "" (every earlier row is a single server's), ``replicas``, ``queued_first_s`` and
    ``queued_first_replica`` None (not measured: earlier runs did not record when requests first waited).
    v5 -> v6: ``t_cell_start_unix`` and the ``prom_*`` figures None (``prom_gpu_devices`` and ``prom_engines``
    [], ``prom_samples`` 0): not measured, no Prometheus was read.
    v6 -> v7: the ``prefix_cache_*`` figures None, ``prefix_cache_expected`` "" and ``prefix_cache_source``
    "not recorded" (earlier runs recorded no hit rate; their prompts were unsalted), a request's
    ``prompt_tokens_cached`` None.
    v7 -> v8: a cell's ``load_processes`` and ``requests_planned`` None (not recorded), ``n_lost`` 0 (no
    request was lost: earlier runs failed a cell whose load worker died); a request's ``ordinal`` and clock
    offsets None, ``load_process`` "" (not recorded; its times are on the one clock of the run's process).
    v8 -> v9: a cell's ``spec_method`` "" (not recorded: no earlier run speculated) and its other ``spec_*``
    figures None; a request's ``spec_draft_tokens`` and ``spec_accepted_tokens`` None.
    v9 -> v10: a cell's ``decode_*`` and ``itl_s_bound`` None (not measured: earlier runs probed no bandwidth).
    v10 -> v11: a cell's ``client_events_per_s``, ``client_limit_share`` and ``client_ttft_overhead_s`` None
    (not measured: earlier runs did not probe their client).
    v11 -> v12: a cell's ``engine_step_read_bytes``, ``engine_step_write_bytes`` and ``engine_step_bytes_source``
    None (not read: earlier runs did not ask the engine).
    """
    version = int(row.get("schema_version", 1))
    if version > SCHEMA_VERSION:
        raise ValueError(f"row has schema version {version}, newer than this kvbench's {SCHEMA_VERSION}: upgrade kvbench")
    if version < 2 and model is CellRow and not row.get("token_contract"):
        row = {**row, "token_contract": V1_TOKEN_CONTRACT}
    out = model.model_validate(row).model_dump()
    if version < 7 and "prefix_cache_source" in out:
        out["prefix_cache_source"] = "not recorded"
    out["schema_version"] = SCHEMA_VERSION
    return out
