"""The core interface every engine adapter implements, and the process handling they share.

An adapter answers five questions about its engine: how to install it (a recipe), how to start it,
how to stream one request (timestamping every chunk on arrival), how to read its KV pool, the KV in use
and its queue, and how to stop it; its KV rules size its KV. What only some engines can do (empty a prefix
cache, return log-probabilities, export Prometheus metrics, say what they serve) is a capability group the
adapter declares (backends/capabilities.py), not a method here.
"""
from __future__ import annotations

import ssl
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import ClassVar

import httpx

import kvbench.backends.streaming as streaming  # the module (its endpoint settings), not the package
from kvbench.common import outside
from kvbench.common.envs import Recipe
from kvbench.common.models import ModelFiles
from kvbench.common.redact import redact_url
from kvbench.kv.geometry import kv_bytes_per_token
from kvbench.kv.rules import KVCheck, KVQuestion, KVRules

from .capabilities import Capabilities
from .options import Option
from .ports import PortHold, PortInUse, hold_port
from .process import ServerProcess, port_taken
from .types import EngineStartError, EngineState, KVInUse, KVPool, RequestResult, ServerSpec
from .untimed import bounded_client

ATTACH_REFUSED_S = 2.0  # an attached server whose port refuses connections this long is not there
PORT_TRIES = 3  # free ports chosen for one start, where another process took the one chosen before the spawn



# A pool past these is no engine's: a server's /metrics of 10^30 blocks crashed the run after its cells (an
# integer past 64 bits in the records) and kept its report from reading the run
POOL_MAX_TOKENS = 2**40
POOL_MAX_BYTES = 2**60


def believable_pool(pool: KVPool | None) -> KVPool | None:
    """The engine's pool as it reported it, or, where a count is past any engine's (or not a whole number),
    a pool of no figures whose source says what the server said."""
    if pool is None:
        return None
    tokens = pool.tokens if pool.tokens is None else outside.count(pool.tokens, POOL_MAX_TOKENS)
    size = pool.bytes if pool.bytes is None else outside.count(pool.bytes, POOL_MAX_BYTES)
    if (tokens is None) == (pool.tokens is None) and (size is None) == (pool.bytes is None):
        return pool
    said = outside.cut(f"{pool.tokens!r} tokens, {pool.bytes!r} bytes", 200)
    return KVPool(bytes=None, tokens=None, source=f"not believed: {pool.source} said {said} (at most "
                                                 f"{POOL_MAX_TOKENS:,} tokens and {POOL_MAX_BYTES:,} bytes)")

class Backend(ABC):
    """Base class of all adapters. Subclasses set ``engine`` and ``default_version``."""

    engine: ClassVar[str]
    default_version: ClassVar[str]
    #: True when prompts go in as token ids (exact); False when the engine only takes text.
    accepts_token_ids: ClassVar[bool] = True
    #: Why the backend cannot start a server of its own (it only attaches: ``url=``), or None when it can;
    #: ``kvbench run`` refuses it without a url before anything is installed or created.
    attach_only: ClassVar[str | None] = None
    #: True when the engine can be made to generate exactly the asked number of tokens (ignore_eos);
    #: False: output is normalised by the tokens actually generated and short outputs are flagged.
    forces_output_length: ClassVar[bool] = True
    #: True when a server kvbench started reports exactly the version it was started as (kvbench's environment
    #: is that version's install): another version answering means the port's answers are another server's,
    #: and the start is refused. False where the version is nominal (the engine on PATH, a container tag).
    reports_started_version: ClassVar[bool] = False
    #: How the engine stores and rounds KV (None: unknown, e.g. any OpenAI-compatible server).
    kv_rules: ClassVar[KVRules | None] = None
    #: The capability groups the engine opts into (prefix cache, KV quantisation, telemetry, served model,
    #: memory wall): backends/capabilities.py. The runner, the reports and the commands ask these.
    capabilities: ClassVar[Capabilities] = Capabilities()

    #: Seconds an untimed call to the engine (version, tokenizer, pool, counters) may take.
    untimed_timeout_s: ClassVar[float] = 10.0
    #: The options this adapter reads (-b ENGINE:KEY=VALUE): checked by BackendConfig.parse, listed by
    #: `kvbench backends`. Each adapter declares its own.
    option_specs: ClassVar[tuple[Option, ...]] = ()
    #: The run's --request-timeout, set before the server is started or attached to: the deadline of a request
    #: the adapter sends itself then (the openai adapter's capability probe). None: the adapter's own.
    request_timeout_s: float | None = None

    @classmethod
    def gpus_used(cls, options: dict) -> int:
        """GPUs one server started with ``options`` spans (tensor parallel, a layer split, a device map)."""
        return 1

    @classmethod
    def parallelism(cls, options: dict) -> dict[str, int]:
        """How one server started with ``options`` splits the model, in the Benchmark Report's terms (``tp``,
        ``pp``, ``dp``, ``ep``; bench/reports/benchmark_report.py): only what its options set. {} where it is
        not split in one of those ways (one GPU, a CPU, or a split those terms do not name: a layer split, a
        device map)."""
        return {}

    def __init__(self, version: str, env_path: Path, options: dict | None = None):
        self.version = version
        self.env_path = env_path
        self.options = dict(options or {})
        self.server: ServerProcess | None = None
        self.spec: ServerSpec | None = None
        self.base_url = ""
        self._http: httpx.Client | None = None
        #: Headers that authenticate every request to an attached server (``Authorization: Bearer`` from
        #: ``api_key_env``, or basic auth from the url's userinfo): set by the runner from
        #: ``BackendConfig.auth_headers()`` before :meth:`attach`. Never logged or written.
        self.auth_headers: dict[str, str] = {}

    @property
    def tls(self) -> ssl.SSLContext:
        """The context that verifies an https server's certificate: against the ``ca_bundle`` option's PEM
        file, else the system's CAs. Shared by :attr:`http` and the streaming client."""
        return streaming.tls_context(self.options.get("ca_bundle") or None)

    def http_client(self, timeout_s: float | None = None) -> httpx.Client:
        """A new client for untimed calls to this engine, with its credentials and TLS settings (for a
        thread that needs its own, e.g. the poller): each call has a deadline and each answer a size cap,
        whatever the server does (:mod:`kvbench.backends.untimed`)."""
        return bounded_client(self.untimed_timeout_s if timeout_s is None else timeout_s, self.auth_headers, self.tls)

    @property
    def http(self) -> httpx.Client:
        """The one client for the harness's untimed calls to the engine (its version, tokenizer, KV pool,
        counters), closed by :meth:`stop`. Timed requests go through :mod:`.streaming`; the poller, which
        runs in a thread of its own, passes its own client to :meth:`poll`."""
        if self._http is None:
            self._http = self.http_client()
        return self._http

    # --- install -------------------------------------------------------------------------------
    @classmethod
    @abstractmethod
    def recipe(cls, version: str) -> Recipe:
        """How to install this engine at this version into an isolated environment."""

    @classmethod
    def recipes(cls, version: str) -> list[Recipe]:
        """Everything `kvbench setup` installs for this engine: its environment, and any tool beside it."""
        return [cls.recipe(version)]

    @classmethod
    def own_install(cls, options: dict) -> str | None:
        """What a server started with ``options`` runs from instead of kvbench's environment (e.g. "python=PATH"),
        where its options name an install of the user's: then nothing is installed for it. None: kvbench's."""
        return None

    # --- lifecycle -----------------------------------------------------------------------------
    @abstractmethod
    def command(self, spec: ServerSpec) -> tuple[list[str], dict[str, str]]:
        """argv and extra environment variables that start the server for ``spec``."""

    health_path: ClassVar[str] = "/health"

    def start(self, spec: ServerSpec, log_path: Path, timeout_s: float) -> None:
        argv, env, hold = self._command_on_free_port(spec)
        try:
            self.server = ServerProcess(argv, env, log_path, memory_limit_bytes=self.spec.memory_limit_bytes)
            self.server.start()
            self.server.wait_http(self.base_url + self.health_path, timeout_s)
        except EngineStartError as exc:
            hint = self.start_failure_hint(str(exc), exc.log_tail)
            if hint:
                raise EngineStartError(f"{exc}: {hint}", exc.log_tail) from None
            raise
        finally:
            hold.release()  # the engine has bound it (it answered), or will not

    def _command_on_free_port(self, spec: ServerSpec) -> tuple[list[str], dict[str, str], PortHold]:
        """The server's argv and environment for ``spec`` on its port (a free one unless ``spec`` names it),
        and the port held (:class:`~kvbench.backends.process.PortHold`) from its choice until the engine
        binds it: nothing else is given it meanwhile, and nothing listens there right before the spawn
        (whatever answered the health path would be benchmarked as the engine)."""
        taken = ""
        for _ in range(1 if spec.port else PORT_TRIES):
            try:
                hold = hold_port(spec.host, spec.port or 0)
            except PortInUse as exc:  # a listener has the port the spec names
                taken = port_taken(exc.port, spec.host) or f"{exc}: another process has it"
                continue
            except OSError as exc:
                raise EngineStartError(f"cannot bind {spec.host}:{spec.port or 0} for the engine: "
                                       f"{(exc.strerror or str(exc)).lower()}") from None
            port = hold.port
            self.spec = ServerSpec(**{**spec.__dict__, "port": port})
            self.base_url = f"http://{spec.host}:{port}"
            try:
                argv, env = self.command(self.spec)
            except BaseException:
                hold.release()
                raise
            if not (taken := port_taken(port, spec.host)):
                return argv, env, hold
            hold.release()
        raise EngineStartError(taken)

    def start_refusal(self, spec: ServerSpec) -> str | None:
        """Why this engine, started here, would refuse ``spec`` before serving it, known without starting it
        (from its own source, e.g. a KV dtype this CPU lacks): its cells are "not run" with this reason and no
        start is spent on them. None where nothing is known."""
        return None

    def start_failure_hint(self, failure: str, log_tail: str) -> str | None:
        """What a start that failed this way means for this engine, and what to try (added to the failed
        row's error); None where the engine knows nothing more than the failure itself."""
        return None

    @classmethod
    def machine_build(cls, version: str) -> str | None:
        """How this engine's build for this machine is configured where that is chosen per machine (CPU
        features left out, say): listed by `kvbench backends`, recorded in run.json for each engine that
        kvbench started. None where nothing is chosen per machine."""
        return None

    def attach(self, spec: ServerSpec, url: str, timeout_s: float = 30.0) -> None:
        """Benchmark a server that is already running at ``url``: kvbench neither starts nor stops it, and
        what only a local process gives (its memory, its log) is "not measured"."""
        self.spec = spec
        self.base_url = url.rstrip("/")
        self.server = None
        # the timed client sends the same credentials, and verifies an https server the same way
        streaming.configure_endpoint(self.base_url, self.auth_headers,
                                     self.tls if self.base_url.startswith("https:") else None)
        self._wait_attached(timeout_s)

    def _wait_attached(self, timeout_s: float, interval_s: float = 0.5) -> None:
        """GET the health path until it answers 200 (with the credentials and TLS settings of every call).
        A certificate that does not verify, or an answer 401/403, fails at once: waiting would not help."""
        where = redact_url(self.base_url)
        start = time.monotonic()
        deadline = start + timeout_s
        last = "no answer"
        while True:
            try:
                status = self.http.get(self.base_url + self.health_path, timeout=2.0).status_code
            except httpx.HTTPError as exc:
                if isinstance(tls_error := _ssl_error(exc), ssl.SSLCertVerificationError):
                    raise EngineStartError(f"TLS with {where}: certificate verify failed ({tls_error.verify_message}); "
                                           f"give ca_bundle=PATH (a PEM file of the CA that signed it)") from None
                if tls_error is not None:
                    raise EngineStartError(f"TLS with {where} failed: {tls_error}; is it an https server?") from None
                last = f"{type(exc).__name__}: {exc}"
                # nothing listens there: say so in seconds, not after the whole timeout
                if isinstance(exc, httpx.ConnectError) and "refused" in str(exc).lower() \
                        and time.monotonic() - start >= ATTACH_REFUSED_S:
                    raise EngineStartError(f"no {self.engine} server at {where}: connection refused for "
                                           f"{ATTACH_REFUSED_S:g} s") from None
            else:
                if status == 200:
                    return
                if status in (401, 403):
                    what = ("refused the credentials given" if self.auth_headers else "wants credentials: "
                            "give api_key_env=NAME (an environment variable holding the API key)")
                    raise EngineStartError(f"{where} answered HTTP {status} to {self.health_path}: it {what}")
                last = f"HTTP {status}"
            if time.monotonic() + interval_s > deadline:
                raise EngineStartError(f"no {self.engine} server answering at {where} ({last} from {self.health_path})")
            time.sleep(interval_s)

    @property
    def attached(self) -> bool:
        return self.server is None and bool(self.base_url)

    def stop(self) -> list[dict]:
        """Stop the server and its whole process tree; the processes that survived (normally none)."""
        if self.attached:
            streaming.forget_endpoint(self.base_url)
        if self._http is not None:
            self._http.close()
            self._http = None
        return self.server.stop() if self.server else []

    @property
    def pid(self) -> int | None:
        return self.server.pid if self.server else None

    def alive(self) -> bool:
        return bool(self.server and self.server.alive())

    def timed_out(self, request_id: str) -> str | None:
        """The request ``request_id`` ran out of its time. A backend that sends its next requests elsewhere (a
        deployment with a replica still in rotation) says where this one went ("replica H:P"): the timeout
        is then that replica's, and does not count toward the runner's wedge rule. None: it counts."""
        return None

    def replica_polls(self, results: list[RequestResult] = ()) -> dict | None:
        """Each replica's KV and queue figures of the cell, for a deployment of several servers (None: one
        server, whose figures are the row itself)."""
        return None

    def log_tail(self, lines: int = 40) -> str:
        return self.server.log_tail(lines) if self.server else ""

    def exit_description(self, wait_s: float = 0.0) -> str:
        """How the server process ended, e.g. "killed by SIGKILL"; empty while it runs (after waiting
        up to ``wait_s`` for it to end) and for an attached server, which is not ours to watch."""
        return self.server.exit_description(wait_s) if self.server else ""

    def reported_version(self) -> str | None:
        """The version the running engine says it is (falls back to the configured one); None where an
        attached server says none (compare then calls it "unknown")."""
        return self.version

    # --- measurement ---------------------------------------------------------------------------
    @abstractmethod
    async def stream(self, client, prompt) -> RequestResult:
        """Send one request (through :mod:`backends.streaming` with ``client``), forcing exactly ``prompt.output_tokens`` output tokens where possible."""

    @abstractmethod
    def kv_pool(self) -> KVPool | None:
        """The allocated KV pool, read from the engine; None when it cannot be read."""

    @classmethod
    def kv_pool_from_log(cls, text: str) -> KVPool | None:
        """The pool as the engine's own log states it (``kvbench report --recompute`` re-derives a published
        run's pool facts from its logs/ with it); None where the log does not say it."""
        return None

    @classmethod
    def startup_figures_from_log(cls, text: str) -> dict | None:
        """The engine's own figures at startup as its log states them, each only where the log says it (keys
        named for what they are, so the plan's figure of the same name is set beside it; every byte figure
        is per GPU): ``kv_budget_bytes`` (the memory the engine gives its KV cache: vLLM's "Available KV cache
        memory"), ``kv_pool_bytes`` (the pool's own buffers: SGLang's K + V sizes, llama.cpp's KV buffer),
        ``pool_tokens``, ``blocks``, ``concurrency`` with ``concurrency_limit`` (the requests of that many
        tokens the pool holds: vLLM's "Maximum concurrency"), ``one_request_bytes`` with ``one_request_limit`` (the KV
        one request at the limit needs: vLLM's refusal), ``weights_bytes``, ``cuda_total_bytes``,
        ``terms`` ({the engine's startup-rule ledger term: bytes}), ``refusal`` (its words), ``device``
        ("gpu"/"cpu"), ``lines`` (the lines read). Every GPU run (and a CPU run whose engine logs its pool) is
        one more check of `kvbench plan` this way (bench/run/startup_checks.py, run.json ``startup_checks``).
        None where the log says none of them."""
        return None

    def startup_settings(self, spec: ServerSpec) -> dict:
        """How kvbench started this server for ``spec``, in `kvbench plan`'s terms, for the plan set beside
        :meth:`startup_figures_from_log`: ``engine_options`` (PlanInput.engine_options: what the engine's
        startup rule reads, e.g. vLLM's max_num_seqs), ``kv_budget_bytes`` (the KV bytes per GPU the server
        was told to take, None where it sizes its pool itself), ``pool_tokens_cap`` (a cap on the pool's
        tokens it was given), ``batch`` (the sequences its cache is allocated for: llama.cpp's slots),
        ``kv_dtype`` (as the rules name it), ``model_file`` (the file it loaded, where not the HF folder) and
        ``device`` ("gpu"/"cpu": what the engine runs on). Empty: the defaults (one sequence, its own sizing,
        the HF folder)."""
        return {}

    @abstractmethod
    def kv_in_use(self, client: httpx.Client) -> KVInUse | None:
        """KV currently held by live requests, polled during a cell."""

    def kv_peak(self) -> KVInUse | None:
        """The cell's exact KV peak, for engines that track it themselves. None: the runner takes the
        largest polled :meth:`kv_in_use` sample instead."""
        return None

    def kv_bytes_per_token(self) -> float:
        """Bytes per cached token as this engine stores the model (its KV rules), windows not applied."""
        assert self.spec
        if self.kv_rules is None:
            return kv_bytes_per_token(self.spec.model.geometry, self.kv_dtype_name())
        return self.kv_rules.bytes_per_token(KVQuestion(self.spec.model.geometry, self.kv_dtype_name()))

    def kv_dtype_name(self) -> str:
        assert self.spec
        return "bf16" if self.spec.kv_dtype == "auto" else self.spec.kv_dtype

    def tokenize(self, text: str) -> list[int] | None:
        """The engine's own token ids for ``text`` (no special tokens added), from its tokenize endpoint;
        None when it has none (then each request's usage report is the only check)."""
        return None

    def reset_cell(self) -> None:
        """Called before each cell, e.g. to reset an engine's peak counters."""

    def queue_state(self, client: httpx.Client) -> dict | None:
        """Requests the engine holds back (``{"waiting": n, "source": ...}``, plus engine-specific keys such as
        ``preemptions``), polled during a cell; None where the engine exposes no queue."""
        return None

    # --- validation of the KV rules: what the engine allocates, measured here --------------------------
    @classmethod
    def pool_at_start(cls, env: Path, spec: ServerSpec, log_path: Path, timeout_s: float,
                      options: dict | None = None) -> KVPool | None:
        """Start the engine for ``spec``, read the KV pool it allocated, stop it: a validation step.
        An EngineStartError says why it did not start (with its log tail)."""
        backend = cls(cls.default_version, env, options)
        try:
            backend.start(spec, log_path, timeout_s)
            return backend.kv_pool()
        finally:
            backend.stop()

    @classmethod
    def validation_refusal(cls) -> str | None:
        """Why ``kvbench validate`` has nothing to check for this engine (None: it checks its rules against
        the engine): no KV rules, or no engine here whose allocation its cases can read."""
        if cls.kv_rules is None:
            return "has no KV rules to check (it attaches to any server and predicts nothing of its own)"
        if cls.kv_checks.__func__ is Backend.kv_checks.__func__ and cls.measure_kv.__func__ is Backend.measure_kv.__func__:
            return "has no validation cases: its engine does not run here, so there is no allocation to check its rules against"
        return None

    @classmethod
    def kv_checks(cls, env: Path, model: ModelFiles, log_dir: Path) -> list[KVCheck]:
        """This engine's own cases on the embedded model (dtypes, sizes, slots): the rules against the engine."""
        return []

    @classmethod
    def measure_kv(cls, env: Path, models: list[ModelFiles], log_dir: Path, python: Path | None = None) -> list[KVCheck]:
        """One check per model (the validation families): the rules' prediction against what the engine
        allocates for it. ``python``: an interpreter with torch and transformers, for engines that need one.
        An engine that cannot load a model says why in its check's note (no observed figure)."""
        return [KVCheck(cls.engine, m.name, "-", None, None, None, 0, "not measured: the adapter has no "
                        "measurement of its KV allocation", family=m.name) for m in models]

    def poll(self, client: httpx.Client) -> EngineState:
        """One poll during a cell: :meth:`kv_in_use` and :meth:`queue_state`. Adapters that read both from
        one page fetch it once instead (:class:`PrometheusPolled`): rendering and parsing it costs the
        engine's server and the client CPU, at 10 Hz through every measured cell."""
        return EngineState(self.kv_in_use(client), self.queue_state(client))


def _ssl_error(exc: BaseException) -> ssl.SSLError | None:
    """The TLS error under an httpx error (a certificate that does not verify, a server that is not TLS)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ssl.SSLError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def extra_args(options: dict) -> list[str]:
    """The user's ``extra_args`` option (a list, or one string split on spaces) for the server's argv."""
    value = options.get("extra_args", [])
    return value.split() if isinstance(value, str) else [str(a) for a in value]
