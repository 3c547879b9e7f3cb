"""A deployment: several replicas of one engine, attached by URL, benchmarked as one backend.

``-b 'vllm:url=http://a:8000,url=http://b:8000'`` attaches one adapter of the engine to each URL and puts
them behind a :class:`Deployment`, which presents the :class:`~kvbench.backends.base.Backend` interface
the runner uses:

- :meth:`Deployment.stream` sends each request to the next replica in turn (round-robin, from the first
  replica at every cell), or, with ``gateway=URL``, every request through the gateway (a load balancer
  or a Kubernetes service: which replica served it is then the gateway's business, not known here);
- :meth:`Deployment.poll` polls every replica through its own adapter (each reads its own ``/metrics`` or
  ``/slots``), keeps each replica's samples (:class:`ReplicaPolls`) and returns the deployment's total:
  KV in use and the queue summed over the replicas at that poll;
- :meth:`Deployment.kv_pool` is the sum of the replicas' pools; each replica's own is kept beside it.

The runner turns the total into the cell's row and :meth:`Deployment.replica_polls` into one row per
replica (bench/run/rows.py ``replica_rows``). A deployment is attached, never started: its replicas'
processes are not kvbench's, so their memory is "not measured", as for any attached server.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from kvbench.common.envs import Recipe
from kvbench.common.redact import host_port

from .base import Backend
from .types import (
    EngineStartError,
    EngineState,
    KVInUse,
    KVPool,
    KVSample,
    QueueSample,
    RequestResult,
    ServerSpec,
    record_poll,
)

GATEWAY = "gateway"  # engine_details["replica"] of a request sent through the gateway


@dataclass
class ReplicaPolls:
    """One replica's figures over one cell: its pool, its polled KV in use and queue, the requests sent to
    it (round-robin; none are known through a gateway) and its engine's version."""

    label: str  # host:port
    url: str
    kv_pool: KVPool | None = None
    kv_samples: list[KVSample] = field(default_factory=list)
    kv_source: str | None = None
    queue_samples: list[QueueSample] = field(default_factory=list)
    queue_source: str | None = None
    poll_errors: int = 0
    version: str | None = None
    request_ids: set[str] | None = field(default_factory=set)  # None: sent through a gateway, not known


class Deployment(Backend):
    """N attached adapters of one engine (and, optionally, one attached to a gateway) as one backend."""

    engine = "deployment"  # set per instance to the replicas' engine
    default_version = ""

    def __init__(self, replicas: list[Backend], urls: list[str], gateway: Backend | None = None,
                 gateway_url: str | None = None, options: dict | None = None):
        if not replicas or len(replicas) != len(urls):
            raise ValueError("a deployment needs one adapter per replica url")
        if len({type(r) for r in replicas}) != 1:
            raise ValueError("a deployment is replicas of one engine")
        # before Backend.__init__, whose auth_headers assignment reaches them
        self.replicas, self.urls, self.gateway, self.gateway_url = list(replicas), list(urls), gateway, gateway_url
        self.labels = [host_port(u) for u in urls]
        super().__init__(replicas[0].version, None, options)
        first = replicas[0]
        self.engine = first.engine
        self.kv_rules = first.kv_rules
        self.accepts_token_ids, self.forces_output_length = first.accepts_token_ids, first.forces_output_length
        self.untimed_timeout_s = first.untimed_timeout_s
        self._next = 0
        self._polls: dict[str, ReplicaPolls] = {}
        self._routed: dict[str, str] = {}  # request id -> replica label, this cell
        self._versions: list[str | None] = [None] * len(self.replicas)
        self._clear()

    @classmethod
    def of(cls, adapter: type[Backend], version: str, options: dict, urls: list[str],
           gateway_url: str | None = None) -> "Deployment":
        """One ``adapter`` per url (and one for the gateway), each with the backend's options."""
        replicas = [adapter(version, None, options) for _ in urls]
        gateway = adapter(version, None, options) if gateway_url else None
        return cls(replicas, urls, gateway, gateway_url, options)

    def _members(self) -> list[Backend]:
        return [*self.replicas, *([self.gateway] if self.gateway else [])]

    @property
    def auth_headers(self) -> dict[str, str]:
        return self._auth_headers

    @auth_headers.setter
    def auth_headers(self, value: dict[str, str]) -> None:
        """The backend's one set of credentials goes to every replica and the gateway."""
        self._auth_headers = dict(value)
        for member in self._members():
            member.auth_headers = dict(value)

    # --- lifecycle: attached only ------------------------------------------------------------------
    @classmethod
    def recipe(cls, version: str) -> Recipe:
        return Recipe("deployment", version, (), venv=False)  # nothing to install: it attaches

    def command(self, spec: ServerSpec):
        raise EngineStartError("a deployment is attached to running replicas (url=...), never started")

    def start(self, spec: ServerSpec, log_path: Path, timeout_s: float) -> None:
        self.command(spec)

    def attach(self, spec: ServerSpec, url: str | None = None, timeout_s: float = 30.0) -> None:
        """Attach every replica to its url (and the gateway adapter to the gateway); ``url`` is ignored.
        A replica that does not answer fails the whole deployment, naming it."""
        self.spec = spec
        for label, member, where in [*zip(self.labels, self.replicas, self.urls),
                                     *([(GATEWAY, self.gateway, self.gateway_url)] if self.gateway else [])]:
            try:
                member.attach(spec, where, timeout_s)
            except EngineStartError as exc:
                raise EngineStartError(f"replica {label}: {exc}" if label != GATEWAY else f"gateway: {exc}",
                                       exc.log_tail) from None
        self.base_url = (self.gateway or self.replicas[0]).base_url

    @property
    def attached(self) -> bool:
        return True

    def stop(self) -> list[dict]:
        survivors = []
        for member in self._members():
            survivors += member.stop()
        if self._http is not None:
            self._http.close()
            self._http = None
        return survivors

    def reported_version(self) -> str | None:
        """The replicas' version; each one's where they differ (a deployment mid-upgrade)."""
        versions = [r.reported_version() for r in self.replicas]
        for label, version in zip(self.labels, versions):
            self._polls[label].version = version
        self._versions = versions
        if len(set(versions)) == 1:
            return versions[0]
        return ", ".join(f"{label} {v or 'unknown'}" for label, v in zip(self.labels, versions))

    def served_models(self) -> list[str] | None:
        """What the replicas serve, once every replica that says agrees (a replica serving another model fails
        the deployment here, before any cell); None where none says."""
        said = [(label, sorted(m)) for label, r in zip(self.labels, self.replicas)
                if (m := r.served_models()) is not None]
        for label, models in said[1:]:
            if models != said[0][1]:
                raise ValueError(f"replica {label} serves {', '.join(models) or 'no model'}, replica {said[0][0]} "
                                 f"{', '.join(said[0][1]) or 'no model'}: the replicas do not serve the same model")
        return said[0][1] if said else None

    def tokenize(self, text: str) -> list[int] | None:
        """The first replica's token ids, once every replica agrees (a replica serving another model or
        tokenizer fails the deployment here, before any cell)."""
        answers = [r.tokenize(text) for r in self.replicas]
        first = answers[0]
        for label, ids in zip(self.labels[1:], answers[1:]):
            if first is not None and ids is not None and list(ids) != list(first):
                raise ValueError(f"replica {label}'s tokenizer disagrees with replica {self.labels[0]}'s: "
                                 f"the replicas do not serve the same model")
        return first

    # --- measurement -------------------------------------------------------------------------------
    async def stream(self, client, prompt) -> RequestResult:
        if self.gateway is not None:
            self._routed[prompt.request_id] = GATEWAY
            result = await self.gateway.stream(client, prompt)
            result.engine_details["replica"] = GATEWAY
            return result
        i = self._next
        self._next = (i + 1) % len(self.replicas)
        label = self.labels[i]
        self._routed[prompt.request_id] = label
        result = await self.replicas[i].stream(client, prompt)
        result.engine_details["replica"] = label
        return result

    def reset_cell(self) -> None:
        """Every cell starts at the first replica, with no samples."""
        for r in self.replicas:
            r.reset_cell()
        self._clear()

    def _clear(self) -> None:
        self._polls = {label: ReplicaPolls(label, url, version=v, request_ids=None if self.gateway else set())
                       for label, url, v in zip(self.labels, self.urls, self._versions)}
        self._routed = {}
        self._next = 0

    def poll(self, client: httpx.Client) -> EngineState:
        """Each replica's KV in use and queue (through its own adapter, each sample timed as it came), and
        the deployment's: the sum over the replicas at this poll (None where a replica's is not known)."""
        states, failures = [], []
        for label, replica in zip(self.labels, self.replicas):
            polls = self._polls[label]
            try:
                state = replica.poll(client)
            except Exception as exc:  # noqa: BLE001 - one replica's failed poll must not hide the others'
                polls.poll_errors += 1
                failures.append(exc)
                states.append(None)
                continue
            record_poll(polls, state, time.perf_counter())
            states.append(state)
        if len(failures) == len(self.replicas):
            raise failures[0]
        return EngineState(self._total_kv(states), self._total_queue(states))

    def _total_kv(self, states: list[EngineState | None]) -> KVInUse | None:
        kvs = [s.kv if s else None for s in states]
        if any(kv is None for kv in kvs):
            return None
        return KVInUse(bytes=_sum(kv.bytes for kv in kvs), tokens=_sum(kv.tokens for kv in kvs),
                       source=f"sum over {len(kvs)} replicas of {kvs[0].source}")

    def _total_queue(self, states: list[EngineState | None]) -> dict | None:
        queues = [s.queue if s else None for s in states]
        if any(not q for q in queues):
            return None
        return {"waiting": _sum(q.get("waiting") for q in queues), "running": _sum(q.get("running") for q in queues),
                "preemptions": _sum(q.get("preemptions") for q in queues),
                "source": f"sum over {len(queues)} replicas of {queues[0].get('source')}"}

    def kv_in_use(self, client: httpx.Client) -> KVInUse | None:
        return self.poll(client).kv

    def queue_state(self, client: httpx.Client) -> dict | None:
        return self.poll(client).queue

    def kv_pool(self) -> KVPool | None:
        """The replicas' pools summed (bytes or tokens None where a replica's is not known); each replica's
        own is kept for its row."""
        pools = []
        for label, replica in zip(self.labels, self.replicas):
            self._polls[label].kv_pool = pool = replica.kv_pool()
            pools.append(pool)
        if all(p is None for p in pools):
            return None
        known = [p for p in pools if p is not None]
        whole = len(known) == len(pools)
        return KVPool(bytes=_sum(p.bytes for p in known) if whole else None,
                      tokens=_sum(p.tokens for p in known) if whole else None,
                      source=f"sum over {len(pools)} replicas of {known[0].source}" if whole else
                      f"not measured: {len(pools) - len(known)} of {len(pools)} replicas report no pool",
                      details={"replicas": {label: (p.details if p else None) for label, p in zip(self.labels, pools)}})

    def kv_peak(self) -> KVInUse | None:
        peaks = [r.kv_peak() for r in self.replicas]
        if any(p is None for p in peaks):
            return None
        return KVInUse(_sum(p.bytes for p in peaks), _sum(p.tokens for p in peaks),
                       f"sum over {len(peaks)} replicas of {peaks[0].source}")

    def kv_bytes_per_token(self) -> float:
        return self.replicas[0].kv_bytes_per_token()

    def kv_dtype_name(self) -> str:
        return self.replicas[0].kv_dtype_name()

    def replica_polls(self, results: list[RequestResult] = ()) -> dict[str, ReplicaPolls]:
        """Each replica's figures of the cell, and the requests of ``results`` it served: every result is
        marked with its replica in ``engine_details["replica"]`` (also one that failed before any answer)."""
        for label, replica in zip(self.labels, self.replicas):
            if self._polls[label].kv_pool is None:
                self._polls[label].kv_pool = replica.kv_pool()
        for r in results:
            # the stamp stream() left (also where it ran in another process), else where it was sent
            label = r.engine_details.get("replica") or self._routed.get(r.request_id)
            if label is None:
                continue
            r.engine_details["replica"] = label
            if label in self._polls and self._polls[label].request_ids is not None:
                self._polls[label].request_ids.add(r.request_id)
        return dict(self._polls)


def _sum(values) -> float | None:
    values = list(values)
    return None if any(v is None for v in values) else sum(values)
