"""The capability groups an engine adapter opts into, beside the core hooks every adapter implements
(backends/base.py: install, start, stream one request, read its KV pool, KV in use and queue, stop, size its KV).

An adapter declares its groups once, on its class: ``capabilities = Capabilities(prefix_cache=..., ...)``.
Each group is a small frozen object: its facts are read without a server (`kvbench backends`, the checks before
a run), its hooks take the running adapter (``backend.capabilities.prefix_cache.empty(backend)``). A group left
out keeps its default, which does nothing and says so: the runner, the reports and the commands ask the group,
never the engine's name.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from kvbench.kv.rules import parse_version

from .types import EngineStartError, PrefixCacheCounters, SpeculationCounters, StepBytesCounters

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
class Speculation:
    """Speculative decoding (docs/speculation.md): the drafters the engine has, the server flags that start one,
    and how it says what was drafted and accepted. The default has none: the speculation options are refused
    for the engine (backends/options.py) and its rows' speculation figures are "not reported". An engine that
    has it subclasses this for :meth:`server_args` (and :meth:`counters`, :meth:`draft_problem`) and declares
    the options with ``speculation_options`` (backends/options.py) among its ``option_specs``."""

    #: The drafters, in one spelling across engines ("ngram": n-gram lookup in the request's own tokens,
    #: "draft": a draft model, "eagle"/"mtp" where the engine has them), each with how the engine does it.
    methods: Mapping[str, str] = field(default_factory=dict)
    #: How the engine reports one request's drafted and accepted tokens (set in ``stream`` as
    #: ``RequestResult.spec_draft_tokens``/``spec_accepted_tokens``); "": it does not, the cell's counters only.
    per_request: str = ""
    #: Where :meth:`counters` reads the cumulative counters; "": the engine keeps none kvbench reads.
    counters_source: str = ""
    #: Methods that need a ``draft_model`` because the engine has no default drafter for them.
    needs_draft_model: tuple[str, ...] = ()

    def server_args(self, backend: Backend, method: str, tokens: int | None, draft: str | None) -> list[str]:
        """The server's command-line arguments that start it speculating with ``method`` ("none": none),
        ``tokens`` proposed a step (None: the engine's default) and the drafter ``draft`` (a path; None: the
        adapter's default where it has one)."""
        if method in ("", "none"):
            return []
        raise EngineStartError(f"the {backend.engine} adapter has no speculative decoding")

    def draft_problem(self, path: Path) -> str | None:
        """What makes ``path`` no drafter this engine loads (None: none found), checked before a run starts."""
        return None if path.exists() else "no such file or folder"

    def check(self, engine: str, options: dict) -> None:
        """The speculation options together (each alone is checked by its declaration): one-line ValueError
        for tokens or a draft model without a drafter, a draft model the method does not take, or one the
        engine cannot load; before anything starts."""
        method = str(options.get("speculative", "none"))
        draft = options.get("draft_model")
        if method == "none":
            given = [k for k in ("speculative_tokens", "draft_model") if k in options]
            if given:
                raise ValueError(f"{engine}: {', '.join(given)} without a drafter: give speculative="
                                 f"{'|'.join(self.methods)} too")
            return
        if draft is not None and method not in ("draft", "eagle"):
            raise ValueError(f"{engine}: draft_model is the drafter of speculative=draft or eagle, not of "
                             f"speculative={method}")
        if draft is None and method in self.needs_draft_model:
            raise ValueError(f"{engine}: speculative={method} needs draft_model=PATH (kvbench has no default "
                             f"{method} drafter for it)")
        if draft is not None and (problem := self.draft_problem(Path(str(draft)).expanduser())):
            raise ValueError(f"{engine}: draft_model={str(draft)[:200]}: {problem}")

    def counters(self, backend: Backend, client: httpx.Client) -> SpeculationCounters | None:
        """The engine's cumulative drafted/accepted counters, read before and after each cell (None: it
        keeps none, or its requests' own counts are all it says)."""
        return None


@dataclass(frozen=True)
class StepBytes:
    """The engine's own estimate of the bytes a forward pass reads, beside kvbench's decode bound
    (docs/metrics.md, "Decode bound"). The default has none: the row's engine figure is "not reported". An
    engine that keeps one subclasses this for :meth:`server_args` (what switches it on) and :meth:`counters`."""

    #: Where :meth:`counters` reads them; "": the engine keeps no such estimate
    source: str = ""

    def server_args(self, backend: Backend) -> list[str]:
        """The server's command-line arguments that switch the estimate on ([]: none needed, or none kept)."""
        return []

    def counters(self, backend: Backend, client: httpx.Client) -> StepBytesCounters | None:
        """The cumulative bytes read and written and the steps, read before and after each cell (None: none)."""
        return None


@dataclass(frozen=True)
class MetricsStepBytes(StepBytes):
    """An estimate kept as /metrics counters behind a server flag from some version on (vLLM's and SGLang's
    --enable-mfu-metrics): the flag where the adapter's version is ``since`` or later, the counters ``read`` from
    the page's samples of ``names``."""

    flag: str = ""
    since: tuple[int, ...] = ()
    names: tuple[str, ...] = ()
    read: Callable[[dict[str, list]], StepBytesCounters | None] | None = None

    def server_args(self, backend: Backend) -> list[str]:
        return [self.flag] if parse_version(backend.version)[:len(self.since)] >= self.since else []

    def counters(self, backend: Backend, client: httpx.Client) -> StepBytesCounters | None:
        return self.read(backend.metrics(client, self.names))


@dataclass(frozen=True)
class DeviceBandwidth:
    """How the engine's own environment measures its GPU's memory bandwidth at a run's start, the decode bound's
    denominator on a GPU (docs/metrics.md, "Decode bound"). The default measures nothing: a run on a GPU then
    divides by the card's specification (bench/planner/gpus.toml) and says so."""

    #: A script the environment's Python runs as ``SCRIPT bandwidth --device DEVICE``: one JSON line with
    #: ``read_bytes_per_s`` and ``copy_bytes_per_s``. None: the engine's environment measures none.
    script: Path | None = None

    def measure(self, python: Path, device: str = "cuda", timeout_s: float = 120.0) -> dict:
        """The script's figures, or ``{"not_measured": why}`` (no script, a failure, a time-out)."""
        import json
        import subprocess

        if self.script is None:
            return {"not_measured": "the engine's environment measures no device bandwidth"}
        try:
            out = subprocess.run([str(python), str(self.script), "bandwidth", "--device", device], capture_output=True,
                                 text=True, timeout=timeout_s, cwd=self.script.parent)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return {"not_measured": f"the device read did not finish: {type(exc).__name__}"}
        lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
        try:
            figures = json.loads(lines[-1]) if out.returncode == 0 and lines else None
        except json.JSONDecodeError:
            figures = None
        if not isinstance(figures, dict) or not (figures.get("read_bytes_per_s") or 0) > 0:
            tail = (out.stderr.strip().splitlines() or ["no output"])[-1][:200]
            return {"not_measured": f"the device read failed (exit {out.returncode}): {tail}"}
        figures.pop("event", None)
        return figures


@dataclass(frozen=True)
class Capabilities:
    """Every group an adapter may declare; each left out is the group's default."""

    prefix_cache: PrefixCache = PrefixCache()
    kv_quantisation: KVQuantisation = KVQuantisation()
    telemetry: Telemetry = Telemetry()
    served_model: ServedModel = ServedModel()
    memory_wall: MemoryWall = MemoryWall()
    speculation: Speculation = Speculation()
    step_bytes: StepBytes = StepBytes()
    device_bandwidth: DeviceBandwidth = DeviceBandwidth()
