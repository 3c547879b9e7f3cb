"""The capability groups an engine adapter opts into, beside the core hooks every adapter implements
(backends/base.py: install, start, stream one request, read its KV pool, KV in use and queue, stop, size its KV).

An adapter declares its groups once, on its class: ``capabilities = Capabilities(prefix_cache=..., ...)``.
Each group is a small frozen object: its facts are read without a server (`kvbench backends`, the checks before
a run), its hooks take the running adapter (``backend.capabilities.prefix_cache.empty(backend)``). A group left
out keeps its default, which does nothing and says so: the runner, the reports and the commands ask the group,
never the engine's name.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .types import EngineStartError, PrefixCacheCounters

if TYPE_CHECKING:
    import httpx

    from .base import Backend


@dataclass(frozen=True)
class PrefixCache:
    """How kvbench drives and reads the engine's prefix cache. An engine that can empty it or keeps counters
    subclasses this and overrides :meth:`empty` / :meth:`counters`."""

    #: Whether the adapter can switch prefix caching on and off (ServerSpec.prefix_caching).
    switchable: bool = False
    #: The request field that keeps a request's prefix-cache entries apart from every other salt's (vLLM's
    #: ``cache_salt``): a run's prompts then need no salt in their tokens. "": the engine has none.
    isolation_field: str = ""
    #: How :meth:`empty` empties the cache (for `kvbench backends` and the docs); "": it cannot, and
    #: ``--reset-cache-between-cells`` is refused for the engine.
    reset: str = ""
    #: How the engine says which prompt tokens came from its prefix cache, per request or by counters (for
    #: the docs and the rows' source): "": it does not say, and a row's hit rate is "not reported".
    report: str = ""

    def empty(self, backend: Backend) -> None:
        """Empty the running engine's prefix cache (``--reset-cache-between-cells``). Raises EngineStartError
        with the reason where the server does not allow it."""
        raise EngineStartError(f"the {backend.engine} adapter cannot reset a prefix cache")

    def counters(self, backend: Backend, client: httpx.Client) -> PrefixCacheCounters | None:
        """The engine's cumulative prefix-cache counters, read before and after each cell (None: it keeps
        none, or the requests' own cached-token counts are all it says)."""
        return None


@dataclass(frozen=True)
class KVQuantisation:
    """What a KV-quantisation run can compare for this engine beyond its greedy tokens."""

    #: The most top-k log-probabilities per generated token the adapter asks its engine for when a prompt
    #: wants them (``Prompt.top_logprobs``; llama.cpp's ``n_probs``, vLLM's ``logprobs``), each normalised over
    #: the whole vocabulary, filled into ``RequestResult.output_ids``/``top_logprobs``. 0: the adapter returns
    #: none, and a KV-quantisation run compares its greedy tokens only (no KL divergence).
    top_logprobs_max: int = 0
    #: How the engine returns the log-probabilities of a prompt's own tokens (teacher forcing; filled into
    #: ``RequestResult.prompt_logprobs`` when ``Prompt.prompt_logprobs``), for the docs and reports; "": it
    #: returns none, and a KV-quantisation run's perplexity is "not measured" for it.
    prompt_logprobs_source: str = ""


@dataclass(frozen=True)
class Telemetry:
    """What a cluster's Prometheus holds of the engine (``kvbench run --prometheus``)."""

    #: The engine's own Prometheus metrics on /metrics, by what each says ("kv_usage", "requests_running",
    #: "requests_waiting", "preemptions").
    prometheus_metrics: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class ServedModel:
    """What the running server says it serves and was found to support, recorded in run.json."""

    def models(self, backend: Backend) -> list[str] | None:
        """The models the running server says it serves (e.g. the ids of its /v1/models), checked against
        ``--model`` for an attached server; None where the adapter does not read them."""
        return None

    def support(self, backend: Backend) -> dict[str, bool | str]:
        """What an attached server was asked and found to support (token ids, ignore_eos, usage in the
        stream); empty where nothing is asked."""
        return {}


@dataclass(frozen=True)
class MemoryWall:
    """The memory wall (a memory-limited cgroup, kvbench.common.memory_wall) the engine's process tree ran
    in, as the server process kvbench started records it (backends/process.py)."""

    def record(self, backend: Backend) -> dict | None:
        """The wall's limit, peak and OOM kills, for the run's record; None where it ran without one (or
        kvbench did not start it)."""
        return backend.server.wall_record() if backend.server else None

    def guard_restarts(self, backend: Backend) -> list[dict]:
        """The guards of the engine's tree that died while it ran, each replaced at once (normally none):
        ``{"at", "guard_pid", "guard_exit"}``, for the run's record."""
        return list(backend.server.guard_restarts) if backend.server else []


@dataclass(frozen=True)
class Capabilities:
    """Every group an adapter may declare; each left out is the group's default."""

    prefix_cache: PrefixCache = PrefixCache()
    kv_quantisation: KVQuantisation = KVQuantisation()
    telemetry: Telemetry = Telemetry()
    served_model: ServedModel = ServedModel()
    memory_wall: MemoryWall = MemoryWall()
