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

A replica that stops answering is taken out of rotation (round-robin only; through a gateway the
gateway's business): after :data:`OUT_AFTER` of its requests in a row time out or cannot connect, the
requests that were its turn go to the others, and its timeouts do not count toward the runner's wedge rule
(:meth:`Deployment.timed_out`). While it is out it is probed every :data:`PROBE_EVERY_S` (doubling, up to
:data:`PROBE_EVERY_MAX_S`, each time it fails again right after coming back) with a one-token request of
the first 8 tokens of the request being sent when the probe falls due, timed out after
:data:`PROBE_TIMEOUT_S`: a completion, not its health route, because a replica whose scheduler hangs still
answers /health and /v1/models. One that answers (a probe, or a request sent to it before it went out) is
put back on probation: one more failure takes it out again. An out replica is not polled. When every
replica is out, requests go round-robin to all of them and their timeouts count toward the wedge rule (3 in
a row; then each later cell probes the deployment first and fails unsent without an answer). Each outage
(which replica, when, why, for how long) is in :attr:`Deployment.outages` and in the :class:`ReplicaPolls`
of every cell it overlapped, which the runner turns into flags and run.json's ``replica_outages``. Probes
are no request of the cell and in no row (a prefix cache sees their 8 tokens). With several load workers
(``--load-workers``) each worker's copy rotates on its own and only the requests' errors come back.

The runner turns the total into the cell's row and :meth:`Deployment.replica_polls` into one row per
replica (bench/run/rows.py ``replica_rows``). A deployment is attached, never started: its replicas'
processes are not kvbench's, so their memory is "not measured", as for any attached server.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

import httpx

from kvbench.common.envs import Recipe
from kvbench.common.redact import host_port

from .base import Backend, believable_pool
from .capabilities import Capabilities, ServedModel
from .streaming import TRANSPORT_ERRORS
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
OUT_AFTER = 3  # a replica's requests in a row that time out or cannot connect before it is taken out of rotation
PROBE_EVERY_S = 2.0  # how often a replica out of rotation is probed; doubled each time it fails on probation
PROBE_EVERY_MAX_S = 60.0
PROBE_TIMEOUT_S = 2.0  # a probe: 8 prompt tokens, 1 output token
PROBE_PROMPT_TOKENS = 8


@dataclass
class Rotation:
    """One replica's standing in the round-robin: its failures in a row and, while out, its outage."""

    failures: int = 0  # requests in a row that timed out or could not connect
    outage: dict | None = None  # the current outage (an item of Deployment.outages); None: in rotation
    probe_due: float = 0.0  # perf_counter of its next probe
    probe_every_s: float = PROBE_EVERY_S
    probing: bool = False
    probation: bool = False  # put back by a probe: one more failure takes it out again

    @property
    def out(self) -> bool:
        return self.outage is not None


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
    # its outages (Deployment.outages items) that overlapped the cell, each with seconds_in_cell
    outages: list[dict] = field(default_factory=list)


@dataclass(frozen=True)
class ReplicasServedModel(ServedModel):
    def models(self, backend: Deployment) -> list[str] | None:
        """What the replicas serve, once every replica that says agrees (a replica serving another model fails
        the deployment here, before any cell); None where none says."""
        said = [(label, sorted(m)) for label, r in zip(backend.labels, backend.replicas)
                if (m := r.capabilities.served_model.models(r)) is not None]
        for label, models in said[1:]:
            if models != said[0][1]:
                raise ValueError(f"replica {label} serves {', '.join(models) or 'no model'}, replica {said[0][0]} "
                                 f"{', '.join(said[0][1]) or 'no model'}: the replicas do not serve the same model")
        return said[0][1] if said else None


class Deployment(Backend):
    """N attached adapters of one engine (and, optionally, one attached to a gateway) as one backend."""

    engine = "deployment"  # set per instance to the replicas' engine
    default_version = ""
    capabilities = Capabilities(served_model=ReplicasServedModel())

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
        self._rotation = [Rotation() for _ in self.replicas]
        #: every time a replica was out of rotation, this session: replica, when and why it went out, when it
        #: came back (None: still out), seconds out, probes sent, failures while out
        self.outages: list[dict] = []
        self._probes: set[asyncio.Task] = set()
        self._cell_t0 = time.perf_counter()
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
            member.request_timeout_s = self.request_timeout_s
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
        self._start_due_probes(client, prompt)
        i = self._pick()
        label = self.labels[i]
        self._routed[prompt.request_id] = label
        try:
            result = await self.replicas[i].stream(client, prompt)
        except TRANSPORT_ERRORS as exc:
            self._failed(i, f"could not connect ({type(exc).__name__})")
            raise
        except asyncio.CancelledError:  # timed out (timed_out() counts it) or the load was stopped
            raise
        except Exception:  # an answer the adapter cannot read: the replica answers all the same
            self._answered(i)
            raise
        self._answered(i)
        result.engine_details["replica"] = label
        return result

    # --- rotation ----------------------------------------------------------------------------------
    def _pick(self) -> int:
        """The next replica in turn that is in rotation; every one out: the next in turn."""
        n = len(self.replicas)
        i = next((j % n for j in range(self._next, self._next + n) if not self._rotation[j % n].out), self._next)
        self._next = (i + 1) % n
        return i

    def in_rotation(self) -> int:
        """Replicas in rotation now."""
        return sum(not r.out for r in self._rotation)

    def timed_out(self, request_id: str) -> str | None:
        """A request timed out: counted against the replica it was sent to (which may take it out of
        rotation). While another replica is still in rotation, the deployment answers and this timeout
        is the replica's, not the deployment's: says which replica ("replica H:P"); else None."""
        label = self._routed.get(request_id)
        if self.gateway is not None or label not in self.labels:
            return None
        i = self.labels.index(label)
        self._failed(i, "timed out")
        if not self.in_rotation():
            return None
        return f"replica {label}" + (" (out of rotation)" if self._rotation[i].out else "")

    def _failed(self, i: int, what: str) -> None:
        rot = self._rotation[i]
        rot.failures += 1
        if rot.out:
            rot.outage["failures_while_out"] += 1
            return
        if rot.failures < OUT_AFTER and not rot.probation:
            return
        now = time.perf_counter()
        if rot.probation:  # it failed again right after coming back: probe it less often
            rot.probe_every_s = min(2 * rot.probe_every_s, PROBE_EVERY_MAX_S)
        reason = (f"{rot.failures} requests in a row {what}" if not rot.probation else
                  f"{what} again right after a probe put it back")
        # "_t_out"/"_t_back": perf_counter, to place it in cells; never recorded (_public)
        rot.outage = {"replica": self.labels[i], "out_at": _utc_now(), "reason": reason, "back_at": None,
                      "out_s": None, "probes": 0, "failures_while_out": 0, "put_back_by": None, "_t_out": now}
        self.outages.append(rot.outage)
        rot.probe_due, rot.probing, rot.probation = now + rot.probe_every_s, False, False

    def _answered(self, i: int, by: str = "an answer to a request") -> None:
        """Replica ``i`` answered: its failures start again from none; one that was out is put back."""
        rot = self._rotation[i]
        if rot.out:
            self._put_back(i, by)
            return
        rot.failures, rot.probation, rot.probe_every_s = 0, False, PROBE_EVERY_S

    def _put_back(self, i: int, by: str) -> None:
        rot, now = self._rotation[i], time.perf_counter()
        rot.outage.update(back_at=_utc_now(), out_s=round(now - rot.outage["_t_out"], 3), put_back_by=by, _t_back=now)
        rot.outage = None
        rot.failures, rot.probation = OUT_AFTER - 1, True

    def _start_due_probes(self, client, prompt) -> None:
        """Probe (in the background) every replica out of rotation whose probe is due."""
        now = time.perf_counter()
        for i, rot in enumerate(self._rotation):
            if rot.out and not rot.probing and now >= rot.probe_due:
                rot.probing = True
                rot.outage["probes"] += 1
                probe = replace(prompt, request_id=f"probe-{self.labels[i]}-{rot.outage['probes']}",
                                token_ids=prompt.token_ids[:PROBE_PROMPT_TOKENS],
                                text=" ".join(prompt.text.split()[:PROBE_PROMPT_TOKENS]), output_tokens=1,
                                top_logprobs=0, prompt_logprobs=False)
                task = asyncio.ensure_future(self._probe(i, client, probe))
                self._probes.add(task)
                task.add_done_callback(self._probes.discard)

    async def _probe(self, i: int, client, probe) -> None:
        rot = self._rotation[i]
        try:
            result = await asyncio.wait_for(self.replicas[i].stream(client, probe), PROBE_TIMEOUT_S)
            answered = not (result.error or "").startswith("HTTP 5")  # 503: up, but not serving
        except (asyncio.TimeoutError, *TRANSPORT_ERRORS):
            answered = False
        except Exception:  # noqa: BLE001 - an answer the adapter cannot read is an answer
            answered = True
        finally:
            rot.probing = False
        if rot.out and answered:
            self._put_back(i, "a probe")
        elif rot.out:
            rot.probe_due = time.perf_counter() + rot.probe_every_s

    def reset_cell(self) -> None:
        """Every cell starts at the first replica, with no samples; a replica out of rotation stays out, and
        is probed as the cell's first request is sent."""
        for r in self.replicas:
            r.reset_cell()
        for rot in self._rotation:
            rot.probe_due, rot.probing = 0.0, False
        self._probes.clear()  # those of the last cell's event loop, which has ended
        self._clear()

    def _clear(self) -> None:
        self._polls = {label: ReplicaPolls(label, url, version=v, request_ids=None if self.gateway else set())
                       for label, url, v in zip(self.labels, self.urls, self._versions)}
        self._routed = {}
        self._next = 0
        self._cell_t0 = time.perf_counter()

    def poll(self, client: httpx.Client) -> EngineState:
        """Each replica's KV in use and queue (through its own adapter, each sample timed as it came), and
        the deployment's: the sum over the replicas at this poll (None where a replica's is not known, also
        while one is out of rotation)."""
        states, failures = [], []
        for label, replica, rot in zip(self.labels, self.replicas, self._rotation):
            polls = self._polls[label]
            if rot.out:  # not polled: a hung replica would hold every poll of the others for the client's timeout
                states.append(None)
                continue
            try:
                state = replica.poll(client)
            except Exception as exc:  # noqa: BLE001 - one replica's failed poll must not hide the others'
                polls.poll_errors += 1
                failures.append(exc)
                states.append(None)
                continue
            record_poll(polls, state, time.perf_counter())
            states.append(state)
        if failures and len(failures) == self.in_rotation():
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
            self._polls[label].kv_pool = pool = believable_pool(replica.kv_pool())
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
                self._polls[label].kv_pool = believable_pool(replica.kv_pool())
        for r in results:
            # the stamp stream() left (also where it ran in another process), else where it was sent
            label = r.engine_details.get("replica") or self._routed.get(r.request_id)
            if label is None:
                continue
            r.engine_details["replica"] = label
            if label in self._polls and self._polls[label].request_ids is not None:
                self._polls[label].request_ids.add(r.request_id)
        now = time.perf_counter()
        for label, polls in self._polls.items():
            polls.outages = [_public(o) | {"seconds_in_cell": round(min(o.get("_t_back", now), now)
                                                                    - max(o["_t_out"], self._cell_t0), 3)}
                             for o in self.outages if o["replica"] == label and o.get("_t_back", now) >= self._cell_t0]
        return dict(self._polls)


def _public(outage: dict) -> dict:
    return {k: v for k, v in outage.items() if not k.startswith("_")}


def _utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _sum(values) -> float | None:
    values = list(values)
    return None if any(v is None for v in values) else sum(values)
