"""The data an adapter and the harness exchange: what a server is asked for, one streamed request, the
KV pool and KV in use an engine reports, one poll of its state, and the error a failed start raises."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvbench.common.models import ModelFiles

LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class ServerSpec:
    """What the runner needs from an engine for one run: room for ``max_concurrency`` sequences of
    ``max_context`` tokens each."""

    model: ModelFiles
    max_context: int
    max_concurrency: int
    kv_dtype: str  # "auto" = the engine's default for the model's dtype
    host: str = LOCALHOST
    port: int = 0
    # size the KV pool for this many sequences of max_context (None: max_concurrency); fewer than the
    # concurrency makes the engine queue or preempt: the KV boundary workload does that on purpose
    kv_pool_sequences: int | None = None
    prefix_caching: bool | None = None  # None: the engine's default
    # start the server so that kvbench can empty its prefix cache between cells (its PrefixCache capability's empty)
    reset_prefix_cache: bool = False
    # run the engine's whole process tree inside a memory wall of this many bytes (a memory-limited cgroup,
    # the CPU stand-in for a GPU's memory; kvbench.common.memory_wall); None: no wall
    memory_limit_bytes: int | None = None

    @property
    def pool_sequences(self) -> int:
        return self.kv_pool_sequences or self.max_concurrency


@dataclass
class RequestResult:
    """One streamed request, timestamped on the client (time.perf_counter seconds)."""

    request_id: str
    prompt_tokens_sent: int
    output_tokens_requested: int
    t_sent: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk that carried tokens
    chunk_tokens: list[int] = field(default_factory=list)  # output tokens in that chunk
    t_done: float | None = None
    t_scheduled: float | None = None  # open-loop load: when the schedule wanted it sent
    prompt_tokens_reported: int | None = None  # what the engine says it read
    prompt_tokens_cached: int | None = None  # of those, what it says came from its prefix cache (None: not said)
    output_tokens_reported: int | None = None  # what the engine says it generated
    # speculative decoding: the tokens the drafter proposed for this request and those the target accepted, as
    # the engine reports them per request (llama.cpp's timings.draft_n / draft_n_accepted); None: not reported
    spec_draft_tokens: int | None = None
    spec_accepted_tokens: int | None = None
    engine_details: dict = field(default_factory=dict)
    error: str | None = None
    # asked with Prompt.top_logprobs / prompt_logprobs (a KV-quantisation workload): the generated token ids,
    # each position's top-k {token id: natural-log probability}, and the prompt tokens' log-probabilities
    output_ids: list[int] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None
    # where the load put it (bench/load): its place in the cell's schedule, the load process that sent it
    # (host:pid), and that process's clock offset to the run's owner at the cell's start and end (its times
    # above are on the owner's clock once the load hands it back)
    ordinal: int | None = None
    load_process: str = ""
    clock_offset_start_s: float | None = None
    clock_offset_end_s: float | None = None

    def add_chunk(self, t: float, n_tokens: int) -> None:
        if n_tokens:
            self.chunk_times.append(t)
            self.chunk_tokens.append(n_tokens)

    def drop_bad_counts(self) -> str | None:
        """The engine's token counts that are no count (a string, a float, a bool, a negative number, one
        beyond 64 bits) set to None, and what they were, or None when every count is sound. The caller fails
        this request with it; its timings stay, and the cell's other requests keep their rows."""
        bad = []
        for name, what in _REPORTED_COUNTS:
            value = getattr(self, name)
            if value is not None and (type(value) is not int or not 0 <= value <= _INT64_MAX):
                bad.append(f"{what} {value!r} ({type(value).__name__})"[:120])
                setattr(self, name, None)
        return f"the engine's {', '.join(bad)}: not a token count" if bad else None


_INT64_MAX = 2**63 - 1
_REPORTED_COUNTS = (("prompt_tokens_reported", "prompt token count"),
                    ("output_tokens_reported", "output token count"),
                    ("prompt_tokens_cached", "cached prompt token count"),
                    ("spec_draft_tokens", "drafted token count"),
                    ("spec_accepted_tokens", "accepted draft token count"))


@dataclass
class KVPool:
    """The KV pool the engine allocated. ``bytes`` is None where the engine reports no byte figure."""

    bytes: int | None
    tokens: int | None
    source: str  # where the figure was read, for the report
    details: dict = field(default_factory=dict)


@dataclass
class KVInUse:
    bytes: float | None
    tokens: float | None
    source: str
    details: dict = field(default_factory=dict)


@dataclass
class EngineState:
    """What one poll of a running engine read: KV in use and its queue (None where not readable)."""

    kv: KVInUse | None
    queue: dict | None


@dataclass(frozen=True)
class PrefixCacheCounters:
    """An engine's cumulative prefix-cache counters (prompt tokens looked up, and found), read before and
    after a cell: the difference is the cell's (and any other client's: an attached server's counters
    count every request it serves)."""

    queried_tokens: float
    hit_tokens: float
    source: str


@dataclass(frozen=True)
class SpeculationCounters:
    """An engine's cumulative speculative-decoding counters, read before and after a cell (the difference is
    the cell's, and any other client's on an attached server): draft tokens proposed, those the target accepted,
    and the drafts (verification steps) they came in; None where the engine does not count that figure."""

    draft_tokens: float
    accepted_tokens: float
    drafts: float | None
    source: str


@dataclass(frozen=True)
class StepBytesCounters:
    """An engine's own cumulative estimate of the bytes its forward passes read and wrote, and the passes
    (steps) they came in, read before and after a cell (vLLM's --enable-mfu-metrics counters)."""

    read_bytes: float
    write_bytes: float
    steps: float | None  # None: the engine counts no steps beside the bytes
    source: str


class EngineStartError(RuntimeError):
    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


@dataclass
class KVSample:
    """One poll of the engine's KV in use (kvbench.run.samplers.EnginePoller; a deployment's replicas)."""

    t: float  # time.perf_counter()
    kv_bytes_in_use: float | None
    kv_tokens_in_use: float | None


@dataclass
class QueueSample:
    """One poll of the engine's queue."""

    t: float
    waiting: float | None
    running: float | None
    preemptions: float | None  # the engine's cumulative counter


def record_poll(target, state: EngineState, t: float) -> None:
    """Append one poll's KV and queue samples, stamped ``t``, to ``target``'s ``kv_samples`` and
    ``queue_samples`` and note their sources (the engine poller's and each replica's of a deployment)."""
    if state.kv is not None:
        target.kv_source = state.kv.source
        target.kv_samples.append(KVSample(t, state.kv.bytes, state.kv.tokens))
    if state.queue:
        target.queue_source = state.queue.get("source")
        target.queue_samples.append(QueueSample(t, state.queue.get("waiting"), state.queue.get("running"),
                                                state.queue.get("preemptions")))
