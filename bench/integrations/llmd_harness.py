"""kvbench as an llm-d-benchmark harness: what its harness pod runs (integrations/llm-d-benchmark/, docs/llm-d-benchmark.md).

``python -m kvbench.integrations.llmd_harness run`` is the harness (``kvbench-llm-d-benchmark.sh`` only calls it);
``... analyze`` is its analyzer (``kvbench-analyze_results.sh``), which llm-d-benchmark's entrypoint runs next.
Both read the environment llm-d-benchmark gives its harness pods (its workload README's "Harness Script
Contract", the pod template and the command its run step builds):

- ``LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR`` (required): the results folder, made here. Everything goes in it:
  ``stdout.log`` and ``stderr.log`` (kvbench's output and the harness's own lines, appended: llm-d-benchmark
  retries a failed harness in the same folder), a copy of the profile, ``run_metadata.yaml``, kvbench's run
  folder under ``kvbench_runs/`` (a retry gets its own, ``<id>_try2``...) and one Benchmark Report per cell,
  ``benchmark_report_v0.2,_<cell>.yaml``, at the top where llm-d-benchmark's analysis globs them.
- ``LLMDBENCH_RUN_EXPERIMENT_HARNESS_WORKLOAD_NAME`` (required): the profile, read from
  ``$LLMDBENCH_RUN_WORKSPACE_DIR/profiles/$LLMDBENCH_HARNESS_NAME/`` (defaults /workspace and kvbench).
- ``LLMDBENCH_HARNESS_STACK_TYPE`` (``vllm-prod``: a vLLM service; ``llm-d``: a gateway) chooses the engine of
  a profile's ``engine: auto``; ``LLMDBENCH_RUN_EXPERIMENT_ID``, ``POD_UID``, ``LLMDBENCH_DESCRIPTION_TEXT``
  and ``LLMDBENCH_DESCRIPTION_KEYWORDS`` become each report's ``run.eid`` (the UUID5 of the experiment id, as
  llm-d-benchmark makes it: the parallel pods of one treatment share it), ``run.pid``, ``run.description`` and
  ``run.keywords``; ``LLMDBENCH_DEPLOY_CURRENT_MODEL``, ``LLMDBENCH_HARNESS_STACK_ENDPOINT_URL`` and
  ``LLMDBENCH_VLLM_COMMON_NAMESPACE`` go to run_metadata.yaml (the profile itself carries the model and
  endpoint, rendered from them); ``LLMDBENCH_VLLM_COMMON_METRICS_SCRAPE_ENABLED=true`` runs llm-d-benchmark's
  ``collect_metrics.sh`` around the load, as its other harnesses do.

The harness exits with ``kvbench run``'s status (0; 1 when every cell failed; 2 a refusal; 130 interrupted),
or 2 when it refuses the environment or the profile itself (one line, in stderr.log when the results folder
is known), or 1 when kvbench succeeded but its reports could not be written. The profile (YAML, rendered by
llm-d-benchmark from ``.yaml.in`` templates; experiments override its keys by dotted path)::

    endpoint: http://...        # the server: -b ENGINE:url=ENDPOINT
    model: org/name             # --model
    engine: auto                # a kvbench engine (kvbench backends), or auto (by the stack type)
    engine_options: {}          # more -b options, KEY: VALUE
    workload: {...}             # a kvbench workload: its name, or its settings (a workload file's keys)
    run: {}                     # more kvbench run flags by their long name: request-timeout: 300
"""
from __future__ import annotations

import datetime as dt
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Union

import yaml
from pydantic import BaseModel, ConfigDict, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from kvbench.common.files import (OutputRefused, PlainNameError, atomic_write_bytes, atomic_write_text,
                                  check_output, check_plain_name)
from kvbench.common.redact import redact_text, redact_url
from kvbench.common.suggest import closest
from kvbench.kv import bounded

HARNESS = "kvbench"
RUNS_FOLDER = "kvbench_runs"  # kvbench's run folders, inside the results folder
WORKLOAD_FILE = "kvbench_workload.toml"  # a profile's workload settings, as kvbench run --workload reads them
METADATA = "run_metadata.yaml"
STDOUT_LOG, STDERR_LOG = "stdout.log", "stderr.log"
METRICS_LOG = "metrics_collection.log"
PROFILE_MAX_BYTES = 1 << 20
#: llm-d-benchmark's stack types -> the engine that reads such an endpoint: a vLLM service (its /metrics
#: there: KV pool and in use), or the inference gateway in front of the pods (an OpenAI-compatible server)
AUTO_ENGINES = {"vllm-prod": "vllm", "llm-d": "openai"}
#: kvbench run's flags the harness gives itself (a profile's run: may not)
HARNESS_FLAGS = ("backend", "url", "model", "workload", "results-dir", "run-id", "resume", "overwrite")
TOKEN = re.compile(r"REPLACE_ENV_\w+")  # an llm-d-benchmark template token left unrendered
SAY = "kvbench-harness: "


class HarnessError(ValueError):
    """A refusal of the environment or the profile: one line, exit 2."""


# --- the environment -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Environment:
    """What llm-d-benchmark tells its harness pod, read from the environment once."""

    results_dir: Path
    workload_name: str
    workspace: Path = Path("/workspace")
    harness_name: str = HARNESS
    model: str = ""
    endpoint: str = ""
    stack_type: str = ""
    experiment_id: str = ""
    pod_uid: str = ""
    description: str = ""
    keywords: tuple[str, ...] = ()
    namespace: str = ""
    scrape_metrics: bool = False

    @classmethod
    def read(cls, environ) -> "Environment":
        results = environ.get("LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR", "").strip()
        if not results:
            raise HarnessError("LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR is not set: llm-d-benchmark's harness pod "
                               "sets it (the folder the results go to)")
        workload = environ.get("LLMDBENCH_RUN_EXPERIMENT_HARNESS_WORKLOAD_NAME", "").strip()
        if not workload:
            raise HarnessError("LLMDBENCH_RUN_EXPERIMENT_HARNESS_WORKLOAD_NAME is not set: the profile to run "
                               "(e.g. sanity_random.yaml)")
        if not workload.endswith(".yaml"):  # llm-d-benchmark's entrypoint names it so too
            workload += ".yaml"
        harness = environ.get("LLMDBENCH_HARNESS_NAME", "").strip() or HARNESS
        try:  # both are joined to folders: a path would read or write outside them
            check_plain_name(workload, "LLMDBENCH_RUN_EXPERIMENT_HARNESS_WORKLOAD_NAME")
            check_plain_name(harness, "LLMDBENCH_HARNESS_NAME")
        except PlainNameError as exc:
            raise HarnessError(str(exc)) from None
        keywords = environ.get("LLMDBENCH_DESCRIPTION_KEYWORDS", "")
        return cls(
            results_dir=Path(results), workload_name=workload,
            workspace=Path(environ.get("LLMDBENCH_RUN_WORKSPACE_DIR", "").strip() or "/workspace"),
            harness_name=harness,
            model=environ.get("LLMDBENCH_DEPLOY_CURRENT_MODEL", "").strip(),
            endpoint=environ.get("LLMDBENCH_HARNESS_STACK_ENDPOINT_URL", "").strip(),
            stack_type=environ.get("LLMDBENCH_HARNESS_STACK_TYPE", "").strip(),
            experiment_id=environ.get("LLMDBENCH_RUN_EXPERIMENT_ID", "").strip(),
            pod_uid=environ.get("POD_UID", "").strip(),
            description=environ.get("LLMDBENCH_DESCRIPTION_TEXT", "").strip(),
            keywords=tuple(k.strip() for k in keywords.split(",") if k.strip()),
            namespace=environ.get("LLMDBENCH_VLLM_COMMON_NAMESPACE", "").strip(),
            scrape_metrics=environ.get("LLMDBENCH_VLLM_COMMON_METRICS_SCRAPE_ENABLED", "").strip().lower() == "true")

    @property
    def profile_path(self) -> Path:
        return self.workspace / "profiles" / self.harness_name / self.workload_name


# --- the profile -----------------------------------------------------------------------------------------

Scalar = Union[StrictBool, StrictInt, StrictFloat, StrictStr]


class Profile(BaseModel):
    """A rendered profile (the module's docstring shows one)."""

    model_config = ConfigDict(extra="forbid")

    endpoint: StrictStr
    model: StrictStr
    engine: StrictStr = "auto"
    engine_options: dict[str, Scalar] = {}
    workload: Union[StrictStr, dict[str, Any]]
    run: dict[str, Union[Scalar, list[Scalar]]] = {}


def read_profile(env: Environment) -> tuple[Profile, bytes]:
    """The profile and its bytes; :class:`HarnessError` naming what is wrong with it."""
    where = f"profile {env.profile_path}"
    try:
        raw = bounded.read_bytes(env.profile_path, PROFILE_MAX_BYTES, what="profile")
    except (bounded.InputError, OSError) as exc:
        raise HarnessError(f"{exc} (llm-d-benchmark mounts the rendered profiles of harness "
                           f"{env.harness_name} there)") from None
    try:
        data = yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise HarnessError(f"{where} is not YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict):
        raise HarnessError(f"{where} is not a mapping of keys (endpoint, model, engine, workload, ...)")
    if bounded.depth(data) > 16:
        raise HarnessError(f"{where} nests deeper than 16 levels")
    try:
        profile = Profile.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'profile'}: {e['msg']}" for e in exc.errors())
        raise HarnessError(f"{where}: {problems}") from None
    for key in ("endpoint", "model"):
        value = getattr(profile, key).strip()
        if not value or TOKEN.search(value):
            raise HarnessError(f"{where}: {key} is {value!r}: llm-d-benchmark did not render it (run the profile "
                               f"through its run step, or give the {key} in the profile)")
    return profile, raw


def engine_of(profile: Profile, env: Environment) -> str:
    if profile.engine != "auto":
        return profile.engine
    if env.stack_type not in AUTO_ENGINES:
        known = ", ".join(f"{k} -> {v}" for k, v in AUTO_ENGINES.items())
        raise HarnessError(f"engine: auto reads LLMDBENCH_HARNESS_STACK_TYPE ({known}), which is "
                           f"{env.stack_type or 'not set'}: give the engine in the profile (engine: vllm)")
    return AUTO_ENGINES[env.stack_type]


def _option_text(value) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def backend_argument(profile: Profile, engine: str) -> str:
    """``-b ENGINE:url=ENDPOINT,KEY=VALUE,...`` (kvbench checks the engine and its options)."""
    parts = [f"{engine}:url={profile.endpoint.strip()}"]
    for key, value in profile.engine_options.items():
        if key == "url":
            raise HarnessError("engine_options.url: the endpoint is the profile's endpoint")
        text = _option_text(value)
        if "," in text or "," in key or "=" in key:
            raise HarnessError(f"engine_options.{key}: a key or value with ',' or a key with '=' cannot be "
                               "passed as a -b option")
        parts.append(f"{key}={text}")
    return ",".join(parts)


def run_flags(run: dict, notes: list[str]) -> list[str]:
    """The profile's ``run:`` as kvbench run flags, each checked against kvbench run's own (bench/run/options.py).
    A value that is an unrendered llm-d-benchmark token (a plan without maxModelLen, say) is left out, and said."""
    from kvbench.run.option_fields import flags
    from kvbench.run.options import RunOptions

    known = {}
    for flag in flags(RunOptions):
        long = next((n for n in flag.names if n.startswith("--")), "--" + flag.param.replace("_", "-"))
        known[long[2:]] = flag
    out: list[str] = []
    for key, value in run.items():
        if key in HARNESS_FLAGS:
            raise HarnessError(f"run.{key}: the harness sets --{key} itself (from the profile's endpoint, model and "
                               "workload, and the results folder)")
        if key not in known:
            hint = closest(key, [k for k in known if k not in HARNESS_FLAGS])
            raise HarnessError(f"run.{key} is not a kvbench run flag" + (f"; did you mean {hint!r}?" if hint else
                               f" (known: {', '.join(sorted(k for k in known if k not in HARNESS_FLAGS))})"))
        flag = known[key]
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str) and TOKEN.fullmatch(item.strip()):
                notes.append(f"run.{key} is {item}, which llm-d-benchmark did not render: left to kvbench's default")
                continue
            if flag.kind is bool:
                if not isinstance(item, bool):
                    raise HarnessError(f"run.{key} is a switch: true or false, not {item!r}")
                if item:
                    out.append(f"--{key}")
                elif flag.default:
                    out.append(f"--no-{key}")
                continue
            if isinstance(item, bool):
                raise HarnessError(f"run.{key} takes a value, not {_option_text(item)}")
            out += [f"--{key}", str(item)]
    return out


def workload_argument(profile: Profile, env: Environment) -> str:
    """``--workload``: the profile's workload name or path, or its settings written as a workload file."""
    if isinstance(profile.workload, str):
        if TOKEN.search(profile.workload):
            raise HarnessError(f"workload is {profile.workload!r}: llm-d-benchmark did not render it")
        return profile.workload
    import tomli_w

    try:
        text = tomli_w.dumps(profile.workload)
    except (TypeError, ValueError) as exc:  # a null, or a value TOML has no form for
        raise HarnessError(f"workload: its settings have no TOML form ({exc}); give numbers, strings, booleans, "
                           "lists of them and the load table") from None
    if TOKEN.search(text):
        raise HarnessError(f"workload: {TOKEN.search(text).group(0)} was not rendered by llm-d-benchmark")
    path = env.results_dir / WORKLOAD_FILE
    atomic_write_text(path, f"# the workload of profile {env.workload_name}, written by kvbench's harness\n{text}")
    return str(path)


def run_id(env: Environment) -> str:
    """kvbench's run id: the results folder's name (llm-d-benchmark's ``<experiment id>_<pod index>``, so each
    parallel pod's reports have their own ``run.uid``), made a plain name."""
    name = re.sub(r"[^A-Za-z0-9._-]", "-", env.results_dir.name).lstrip(".")[:180]
    return name or HARNESS


def run_folder(env: Environment) -> Path:
    """A new run folder: the first try's is the run id's; a retry (llm-d-benchmark retries a failed harness
    in the same results folder) gets ``<id>_try2``, ``<id>_try3``, ..., and the earlier tries stay as they are."""
    runs = env.results_dir / RUNS_FOLDER
    base, n = run_id(env), 1
    while (runs / (base if n == 1 else f"{base}_try{n}")).exists():
        n += 1
    return runs / (base if n == 1 else f"{base}_try{n}")


def kvbench_executable() -> str:
    """The ``kvbench`` beside this Python (the harness image's virtual environment), else on PATH."""
    beside = Path(sys.executable).parent / "kvbench"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("kvbench")
    if not found:
        raise HarnessError(f"no kvbench command beside {sys.executable} or on PATH")
    return found


def kvbench_command(profile: Profile, env: Environment, workload: str, run_dir: Path, notes: list[str]) -> list[str]:
    return [kvbench_executable(), "run", "--backend", backend_argument(profile, engine_of(profile, env)),
            "--model", profile.model.strip(), "--workload", workload, "--results-dir", str(run_dir.parent),
            "--run-id", run_dir.name, *run_flags(profile.run, notes)]


# --- the logs and the process -----------------------------------------------------------------------------

class Logs:
    """stdout.log and stderr.log, appended, each also echoed to the pod's own output (kubectl logs)."""

    def __init__(self, folder: Path, stdout=None, stderr=None):
        self.out = open(folder / STDOUT_LOG, "ab")
        self.err = open(folder / STDERR_LOG, "ab")
        self.console_out = stdout or sys.stdout.buffer
        self.console_err = stderr or sys.stderr.buffer

    def close(self) -> None:
        self.out.close()
        self.err.close()

    @staticmethod
    def _write(data: bytes, *streams) -> None:
        for stream in streams:
            try:
                stream.write(data)
                stream.flush()
            except (OSError, ValueError):  # a closed console must not stop the logs
                pass

    def say(self, line: str) -> None:
        self._write(f"{SAY}{line}\n".encode(), self.console_out, self.out)

    def error(self, line: str) -> None:
        self._write(f"{SAY}error: {line}\n".encode(), self.console_err, self.err)

    def run(self, command: list[str]) -> int:
        """``command`` with its output copied to the logs as it comes; its exit status. SIGTERM and SIGINT
        are passed on to it (a pod being deleted): kvbench stops its run and keeps what it finished."""
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        copies = [threading.Thread(target=self._copy, args=(proc.stdout, self.console_out, self.out), daemon=True),
                  threading.Thread(target=self._copy, args=(proc.stderr, self.console_err, self.err), daemon=True)]
        for t in copies:
            t.start()
        previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, lambda signum, frame: proc.send_signal(signum))
        try:
            rc = proc.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        for t in copies:
            t.join()
        return rc

    def _copy(self, pipe, console, log) -> None:
        while chunk := os.read(pipe.fileno(), 65536):
            self._write(chunk, console, log)
        pipe.close()


@dataclass
class MetricsCollection:
    """llm-d-benchmark's ``collect_metrics.sh`` (in its harness image) around the load, as its harnesses run
    it: ``start`` in the background, then ``stop`` and ``process``; its output to metrics_collection.log."""

    env: Environment
    logs: Logs
    script: str | None = None
    started: subprocess.Popen | None = None
    log_path: Path = field(init=False)

    def __post_init__(self):
        self.log_path = self.env.results_dir / METRICS_LOG
        self.script = shutil.which("collect_metrics.sh")

    def _call(self, action: str, background: bool = False):
        with open(self.log_path, "ab") as log:
            proc = subprocess.Popen([self.script, action], stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT)
        return proc if background else proc.wait()

    def start(self) -> None:
        if not self.script:
            self.logs.error("metrics scraping is enabled but collect_metrics.sh is not on PATH: not collected")
            return
        self.logs.say(f"starting metrics collection ({METRICS_LOG})")
        self.started = self._call("start", background=True)

    def stop(self) -> None:
        if self.started is None:
            return
        self._call("stop")
        try:
            self.started.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.started.kill()
            self.started.wait()
        self._call("process")
        self.logs.say(f"metrics collection done ({METRICS_LOG})")


# --- the outputs -----------------------------------------------------------------------------------------

def identify(report, env: Environment) -> None:
    """What llm-d-benchmark knows of the run on one report: its experiment (``run.eid``, made as the package's
    converters make it), the pod, and the submitter's description and keywords."""
    if env.experiment_id:
        report.run.eid = str(uuid.uuid5(uuid.NAMESPACE_URL, env.experiment_id))
    if env.pod_uid:
        report.run.pid = env.pod_uid
    if env.description:
        report.run.description = env.description
    if env.keywords:
        report.run.keywords = list(env.keywords)


def write_reports(run_dir: Path, env: Environment) -> list[str]:
    """One Benchmark Report per cell of the run at the top of the results folder (kvbench report --format br's
    reports, with :func:`identify`), each read back by the package before any is written; a report an earlier
    try of this harness left there that this run has not made again is removed (the folder describes the last
    try; that try's run folder keeps its own data). Returns the file names."""
    from kvbench.reports import benchmark_report as br

    texts = []
    for name, report in br.cell_reports(run_dir):
        identify(report, env)
        text = br.render(report)
        if br.read_back(text).dump() != report.dump():
            raise ValueError(f"{name}: the report does not read back as written")
        texts.append((env.results_dir / name, text))
    names = {p.name for p, _ in texts}
    stale = [p for p in env.results_dir.glob(f"{br.FILE_PREFIX}*.yaml") if p.name not in names]
    for path in [*(p for p, _ in texts), *stale]:
        check_output(path, br.made_by_kvbench, "Benchmark Report")  # another program's file is refused
    for path in stale:
        path.unlink()
    for path, text in texts:
        atomic_write_text(path, text)
    return sorted(names)


def _iso(unix: float) -> str:
    return dt.datetime.fromtimestamp(unix, dt.timezone.utc).isoformat(timespec="seconds")


def kvbench_version() -> str:
    try:
        return metadata.version("kvbench")
    except metadata.PackageNotFoundError:
        return "unknown"


def write_metadata(env: Environment, start: float, stop: float, command: list[str], rc: int, model: str,
                   endpoint: str, run_dir: Path | None, reports: list[str]) -> None:
    """run_metadata.yaml: the keys llm-d-benchmark's harnesses write (its analysis reads them: the times, the
    arguments, the version, the status, the experiment), strings as theirs are; then kvbench's own two."""
    data = {
        "harness_start": _iso(start), "harness_stop": _iso(stop), "harness_delta": f"PT{stop - start:.3f}S",
        "harness_args": redact_text(shlex.join(command[1:])), "harness_version": kvbench_version(),
        "harness_name": env.harness_name, "harness_workload": env.workload_name, "harness_rc": str(rc),
        "experiment_id": env.experiment_id, "model": model, "endpoint_url": redact_url(endpoint) if endpoint else "",
        "namespace": env.namespace, "description_text": env.description, "description_keywords": ",".join(env.keywords),
        "kvbench_run": str(run_dir.relative_to(env.results_dir)) if run_dir and run_dir.exists() else "",
        "benchmark_reports": reports,
    }
    atomic_write_text(env.results_dir / METADATA, yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def run(environ=None, stdout=None, stderr=None) -> int:
    """The harness: the profile's kvbench run against the endpoint, its reports, logs and metadata; its status."""
    environ = os.environ if environ is None else environ
    try:
        env = Environment.read(environ)
        env.results_dir.mkdir(parents=True, exist_ok=True)
    except HarnessError as exc:
        print(f"{SAY}error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{SAY}error: results folder {environ.get('LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR')}: {exc.strerror}",
              file=sys.stderr)
        return 1
    logs = Logs(env.results_dir, stdout, stderr)
    start = time.time()
    rc, command, run_dir, reports = 2, [], None, []
    model, endpoint = env.model, env.endpoint
    try:
        profile, raw = read_profile(env)
        model, endpoint = profile.model.strip(), profile.endpoint.strip()
        atomic_write_bytes(env.results_dir / env.workload_name, raw)  # the profile beside its results
        notes: list[str] = []
        run_dir = run_folder(env)
        command = kvbench_command(profile, env, workload_argument(profile, env), run_dir, notes)
        for note in notes:
            logs.say(note)
        logs.say(f"running {redact_text(shlex.join(command))}")
        metrics = MetricsCollection(env, logs) if env.scrape_metrics else None
        if metrics:
            metrics.start()
        try:
            rc = logs.run(command)
        finally:
            if metrics:
                metrics.stop()
        logs.say(f"kvbench run exited {rc}")
    except HarnessError as exc:
        logs.error(str(exc))
    except OSError as exc:  # the results folder not writable, kvbench not executable
        logs.error(f"{exc}")
        rc = 1
    if run_dir is not None and (run_dir / "run.json").exists():
        try:
            reports = write_reports(run_dir, env)
            logs.say(f"{len(reports)} Benchmark Report(s) in {env.results_dir}")
        except (OutputRefused, ValueError, OSError) as exc:
            logs.error(f"Benchmark Reports not written: {exc}")
            rc = rc or 1
    try:
        write_metadata(env, start, time.time(), command, rc, model, endpoint, run_dir, reports)
    except OSError as exc:
        logs.error(f"{METADATA} not written: {exc}")
        rc = rc or 1
    logs.close()
    return rc


# --- the analyzer ----------------------------------------------------------------------------------------

def analyze(environ=None) -> int:
    """Every Benchmark Report in the results folder validated by the package (the harness wrote them: nothing
    to convert). 1 when one does not validate, or when kvbench succeeded and there is none; else 0."""
    from kvbench.reports import benchmark_report as br

    environ = os.environ if environ is None else environ
    folder = environ.get("LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR", "").strip()
    if not folder or not Path(folder).is_dir():
        print(f"{SAY}error: LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR is {folder or 'not set'}: no results folder",
              file=sys.stderr)
        return 2
    folder = Path(folder)
    try:
        meta = yaml.safe_load(bounded.read_bytes(folder / METADATA, PROFILE_MAX_BYTES, what=METADATA)) or {}
    except (bounded.InputError, OSError, yaml.YAMLError):
        meta = {}
    bad = 0
    files = sorted(folder.glob(f"{br.FILE_PREFIX}*.yaml"))
    for path in files:
        try:
            report = br.read_back(bounded.read_bytes(path, 64 << 20, what="Benchmark Report").decode())
            print(f"{SAY}{path.name}: valid Benchmark Report v{report.version}")
        except (ValueError, TypeError, KeyError, OSError, yaml.YAMLError) as exc:
            print(f"{SAY}error: {path.name}: {' '.join(str(exc).split())[:500]}", file=sys.stderr)
            bad += 1
    if not files:
        rc = str(meta.get("harness_rc", "")) if isinstance(meta, dict) else ""
        if rc == "0":
            print(f"{SAY}error: kvbench finished (harness_rc 0) but {folder} has no Benchmark Report",
                  file=sys.stderr)
            return 1
        print(f"{SAY}no Benchmark Report in {folder}: the harness failed (harness_rc {rc or 'not recorded'}; "
              f"see {STDERR_LOG})")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["run"]:
        return run()
    if argv == ["analyze"]:
        return analyze()
    print("usage: python -m kvbench.integrations.llmd_harness run|analyze  (llm-d-benchmark's harness pod "
          "environment: docs/llm-d-benchmark.md)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
