"""The one interface every engine adapter implements, and the process handling they share.

An adapter answers five questions about its engine: how to install it (a recipe), how to start it,
how to stream one request (timestamping every chunk on arrival), how to read its KV pool and the KV
in use, and how to stop it. The runner knows nothing else about engines.
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from bench.envs import Recipe, tail
from bench.kvmodel import KVGeometry, kv_bytes_per_token

LOCALHOST = "127.0.0.1"


@dataclass(frozen=True)
class ModelFiles:
    """One model in every format an engine may want. ``hf_dir`` holds config.json and tokenizer.json."""

    name: str
    hf_dir: Path
    gguf_path: Path | None
    sha256: str  # of the file the user gave (the GGUF for the embedded model)
    geometry: KVGeometry


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
    output_tokens_reported: int | None = None  # what the engine says it generated
    engine_details: dict = field(default_factory=dict)
    error: str | None = None

    def add_chunk(self, t: float, n_tokens: int) -> None:
        if n_tokens:
            self.chunk_times.append(t)
            self.chunk_tokens.append(n_tokens)


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


class EngineStartError(RuntimeError):
    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


class Backend(ABC):
    """Base class of all adapters. Subclasses set ``engine`` and ``default_version``."""

    engine: ClassVar[str]
    default_version: ClassVar[str]
    #: True when prompts go in as token ids (exact); False when the engine only takes text.
    accepts_token_ids: ClassVar[bool] = True
    #: True when the engine can be made to generate exactly the asked number of tokens (ignore_eos);
    #: False: output is normalised by the tokens actually generated and short outputs are flagged.
    forces_output_length: ClassVar[bool] = True
    #: Whether the adapter can switch prefix caching on and off (ServerSpec.prefix_caching).
    supports_prefix_caching: ClassVar[bool] = False

    def __init__(self, version: str, env_path: Path, options: dict | None = None):
        self.version = version
        self.env_path = env_path
        self.options = dict(options or {})
        self.server: ServerProcess | None = None
        self.spec: ServerSpec | None = None
        self.base_url = ""

    # --- install -------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def recipe(cls, version: str) -> Recipe:
        """How to install this engine at this version into an isolated environment."""

    # --- lifecycle -----------------------------------------------------------------------------
    @abstractmethod
    def command(self, spec: ServerSpec) -> tuple[list[str], dict[str, str]]:
        """argv and extra environment variables that start the server for ``spec``."""

    health_path: ClassVar[str] = "/health"

    def start(self, spec: ServerSpec, log_path: Path, timeout_s: float) -> None:
        port = spec.port or free_port(spec.host)
        self.spec = ServerSpec(**{**spec.__dict__, "port": port})
        self.base_url = f"http://{spec.host}:{port}"
        argv, env = self.command(self.spec)
        self.server = ServerProcess(argv, env, log_path)
        self.server.start()
        self.server.wait_http(self.base_url + self.health_path, timeout_s)

    def attach(self, spec: ServerSpec, url: str, timeout_s: float = 30.0) -> None:
        """Benchmark a server that is already running at ``url``: kvbench neither starts nor stops it, and
        what only a local process gives (its memory, its log) is "not measured"."""
        self.spec = spec
        self.base_url = url.rstrip("/")
        self.server = None
        deadline = time.monotonic() + timeout_s
        last = ""
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                try:
                    response = client.get(self.base_url + self.health_path)
                    if response.status_code == 200:
                        return
                    last = f"HTTP {response.status_code} from {self.health_path}"
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                time.sleep(0.5)
        raise EngineStartError(f"no {self.engine} server answering at {self.base_url} ({last})")

    @property
    def attached(self) -> bool:
        return self.server is None and bool(self.base_url)

    def stop(self) -> None:
        if self.server:
            self.server.stop()

    @property
    def pid(self) -> int | None:
        return self.server.pid if self.server else None

    def alive(self) -> bool:
        return bool(self.server and self.server.alive())

    def log_tail(self, lines: int = 40) -> str:
        return self.server.log_tail(lines) if self.server else ""

    def exit_description(self, wait_s: float = 0.0) -> str:
        """How the server process ended, e.g. "killed by SIGKILL"; empty while it runs (after waiting
        up to ``wait_s`` for it to end) and for an attached server, which is not ours to watch."""
        return self.server.exit_description(wait_s) if self.server else ""

    def reported_version(self) -> str:
        """The version the running engine says it is (falls back to the configured one)."""
        return self.version

    # --- measurement ---------------------------------------------------------------------------
    @abstractmethod
    async def stream(self, client, prompt) -> RequestResult:
        """Send one request (through :mod:`backends.streaming` with ``client``), forcing exactly ``prompt.output_tokens`` output tokens where possible."""

    @abstractmethod
    def kv_pool(self) -> KVPool | None:
        """The allocated KV pool, read from the engine; None when it cannot be read."""

    @abstractmethod
    def kv_in_use(self, client: httpx.Client) -> KVInUse | None:
        """KV currently held by live requests, polled during a cell."""

    def kv_peak(self, client: httpx.Client) -> KVInUse | None:
        """The cell's exact KV peak, for engines that track it themselves. None: the runner takes the
        largest polled :meth:`kv_in_use` sample instead."""
        return None

    def kv_bytes_per_token(self) -> float:
        """Bytes per cached token under this engine's KV dtype, from the model's geometry."""
        assert self.spec
        return kv_bytes_per_token(self.spec.model.geometry, self.kv_dtype_name())

    def kv_dtype_name(self) -> str:
        assert self.spec
        return "bf16" if self.spec.kv_dtype == "auto" else self.spec.kv_dtype

    def tokenize(self, client: httpx.Client, text: str) -> list[int] | None:
        """The engine's own token ids for ``text`` (no special tokens added), from its tokenize endpoint;
        None when it has none (then each request's usage report is the only check)."""
        return None

    def reset_cell(self, client: httpx.Client) -> None:
        """Called before each cell, e.g. to reset an engine's peak counters."""

    def queue_state(self, client: httpx.Client) -> dict | None:
        """Requests the engine holds back (``{"waiting": n, "source": ...}``, plus engine-specific keys such as
        ``preemptions``), polled during a cell; None where the engine exposes no queue."""
        return None

    def poll(self, client: httpx.Client) -> EngineState:
        """One poll during a cell: :meth:`kv_in_use` and :meth:`queue_state`. Adapters that read both from
        one page fetch it once instead (:class:`PrometheusPolled`): rendering and parsing it costs the
        engine's server and the client CPU, at 10 Hz through every measured cell."""
        return EngineState(self.kv_in_use(client), self.queue_state(client))


class PrometheusPolled:
    """For adapters that read both KV in use and the queue from one Prometheus page (vLLM, TGI): each
    poll fetches ``/metrics`` once and parses only ``POLLED``. Mixed in before :class:`Backend`; the
    adapter says how to read the two figures from the samples (:meth:`kv_from_samples`,
    :meth:`queue_from_samples`)."""

    POLLED: tuple[str, ...] = ()

    def metrics(self, client: httpx.Client, names=None) -> dict[str, list]:
        """The server's /metrics samples (of ``names`` only, when given)."""
        return metric_samples(client.get(self.base_url + "/metrics").text, names)

    def kv_from_samples(self, samples: dict) -> KVInUse | None:
        raise NotImplementedError

    def queue_from_samples(self, samples: dict) -> dict | None:
        raise NotImplementedError

    def kv_in_use(self, client: httpx.Client) -> KVInUse | None:
        return self.kv_from_samples(self.metrics(client, self.POLLED))

    def queue_state(self, client: httpx.Client) -> dict | None:
        return self.queue_from_samples(self.metrics(client, self.POLLED))

    def poll(self, client: httpx.Client) -> EngineState:
        samples = self.metrics(client, self.POLLED)
        return EngineState(self.kv_from_samples(samples), self.queue_from_samples(samples))


def gauge_sum(samples: dict[str, list], name: str) -> float | None:
    """A sample's values summed over its label sets (engines, models), None when the page lacks it."""
    rows = samples.get(name)
    return sum(v for _, v in rows) if rows else None


def metric_samples(text: str, names=None) -> dict[str, list]:
    """Prometheus text -> {sample name: [(labels, value), ...]}, of the samples in ``names`` only when given.

    Polling passes ``names``: vLLM's /metrics is about 600 lines of histograms that take ~10 ms to parse,
    and a poller parsing them at 10 Hz holds the GIL the load generator's event loop needs."""
    if names is not None:
        wanted = frozenset(names)
        text = "\n".join(line for line in text.splitlines()
                         if line and line[0] != "#" and line.split("{", 1)[0].split(" ", 1)[0] in wanted)
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


# --- process handling shared by every adapter -------------------------------------------------

def free_port(host: str = LOCALHOST) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    os.setsid()  # own process group: Ctrl-C in the terminal reaches the harness only, which cleans up
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: a killed harness does not orphan the server
    except OSError:
        pass


class ServerProcess:
    """A server started in its own process group, logging to a file, stopped with its whole tree."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path):
        self.argv, self.env, self.log_path = argv, env, log_path
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        log.write(("$ " + " ".join(self.argv) + "\n").encode())
        log.flush()
        try:
            self.proc = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env={**os.environ, **self.env}, preexec_fn=_die_with_parent)
        except OSError as exc:
            raise EngineStartError(f"could not start {self.argv[0]}: {exc}") from None
        finally:
            log.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return bool(self.proc and self.proc.poll() is None)

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    def exit_description(self, wait_s: float = 0.0) -> str:
        if self.proc and wait_s > 0:
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                pass
        code = self.proc.poll() if self.proc else None
        if code is None:
            return ""
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    def wait_http(self, url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise EngineStartError(f"server {self.exit_description() or 'not started'} before it was ready",
                                           self.log_tail())
                try:
                    if client.get(url).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                time.sleep(0.25)
        raise EngineStartError(f"server not ready after {timeout_s:.0f} s ({url})", self.log_tail())

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the whole tree, SIGKILL what is left after ``grace_s``."""
        if not self.proc:
            return
        root = None
        try:
            root = psutil.Process(self.proc.pid)
            tree = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in tree:
                try:
                    p.send_signal(sig)
                except psutil.NoSuchProcess:
                    pass
            _, alive = psutil.wait_procs(tree, timeout=grace_s if sig == signal.SIGTERM else 5)
            if not alive:
                break
            tree = alive
        if self.proc.returncode is None and root is not None and root.returncode is not None:
            # psutil reaped the root, so Popen can no longer read how it ended: keep what psutil read
            self.proc.returncode = root.returncode
        self.proc.wait(timeout=5)


def extra_args(options: dict) -> list[str]:
    """The user's ``extra_args`` option (a list, or one string split on spaces) for the server's argv."""
    value = options.get("extra_args", [])
    return value.split() if isinstance(value, str) else [str(a) for a in value]
