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
- ``LLMDBENCH_HARNESS_STACK_TYPE`` (``vllm-prod``: a vLLM service; ``llm-d``: its gateway) picks the engine where
  the profile names one per stack type; ``LLMDBENCH_RUN_EXPERIMENT_ID``, ``POD_UID``, ``LLMDBENCH_DESCRIPTION_TEXT``
  and ``LLMDBENCH_DESCRIPTION_KEYWORDS`` become each report's ``run.eid`` (the UUID5 of the experiment id, as
  llm-d-benchmark makes it: the parallel pods of one treatment share it), ``run.pid``, ``run.description`` and
  ``run.keywords``; ``LLMDBENCH_DEPLOY_CURRENT_MODEL``, ``LLMDBENCH_HARNESS_STACK_ENDPOINT_URL`` and
  ``LLMDBENCH_VLLM_COMMON_NAMESPACE`` go to run_metadata.yaml (the profile itself carries the model and
  endpoint, rendered from them); ``LLMDBENCH_VLLM_COMMON_METRICS_SCRAPE_ENABLED=true`` runs llm-d-benchmark's
  ``collect_metrics.sh`` around the load, as its other harnesses do.

The harness exits with ``kvbench run``'s status (0; 1 when every cell failed; 2 a refusal; 130 interrupted),
or 2 when it refuses the environment or the profile (llmd_profile.py: one line, in stderr.log when the results
folder is known), or 1 when kvbench succeeded but its reports could not be written.
"""
from __future__ import annotations

import datetime as dt
import os
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

import yaml

from kvbench.common.files import OutputRefused, atomic_write_bytes, atomic_write_text, check_output
from kvbench.common.redact import redact_text, redact_url
from kvbench.integrations.llmd_profile import (PROFILE_MAX_BYTES, Environment, HarnessError, kvbench_command,
                                               read_profile, run_folder, workload_argument)
from kvbench.kv import bounded
from kvbench.store.errors import ResultsReadError

METADATA = "run_metadata.yaml"
STDOUT_LOG, STDERR_LOG = "stdout.log", "stderr.log"
METRICS_LOG = "metrics_collection.log"
SAY = "kvbench-harness: "


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
        return 128 - rc if rc < 0 else rc  # killed by a signal: the status a shell gives it (SIGKILL: 137)

    def _copy(self, pipe, console, log) -> None:
        while chunk := os.read(pipe.fileno(), 65536):
            self._write(chunk, console, log)
        pipe.close()


METRICS_DEADLINE_S = 300.0  # each call of collect_metrics.sh (KVBENCH_METRICS_DEADLINE_S sets another)


@dataclass
class MetricsCollection:
    """llm-d-benchmark's ``collect_metrics.sh`` (in its harness image) around the load, as its harnesses run
    it: ``start`` in the background, then ``stop`` and ``process``; its output to metrics_collection.log.
    Each call has a deadline (``deadline_s``): a script that does not return by then is ended with its whole
    process group, said in stderr.log and in run_metadata.yaml (``metrics_collection``), and the harness
    goes on to write what kvbench measured (a script that never returned held the harness for ever)."""

    env: Environment
    logs: Logs
    deadline_s: float = METRICS_DEADLINE_S
    script: str | None = None
    started: subprocess.Popen | None = None
    problems: list[str] = field(default_factory=list)
    log_path: Path = field(init=False)

    def __post_init__(self):
        self.log_path = self.env.results_dir / METRICS_LOG
        self.script = shutil.which("collect_metrics.sh")

    def _spawn(self, action: str) -> subprocess.Popen | None:
        try:
            with open(self.log_path, "ab") as log:  # a session of its own: its whole group can be ended
                return subprocess.Popen([self.script, action], stdin=subprocess.DEVNULL, stdout=log,
                                        stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:
            self._problem(f"collect_metrics.sh {action} could not be run: {exc}")
            return None

    def _problem(self, line: str) -> None:
        self.problems.append(line)
        self.logs.error(line)

    def _end(self, proc: subprocess.Popen, action: str, waited_s: float) -> None:
        """``proc`` given ``waited_s`` seconds: past them its group is ended (SIGTERM, then SIGKILL) and said."""
        try:
            proc.wait(timeout=waited_s)
            return
        except subprocess.TimeoutExpired:
            pass
        for sig, grace in ((signal.SIGTERM, min(5.0, waited_s)), (signal.SIGKILL, None)):
            try:
                os.killpg(proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        self._problem(f"collect_metrics.sh {action} did not return within {waited_s:g} s: ended (its process group "
                      f"killed); the metrics may be incomplete ({METRICS_LOG})")

    def start(self) -> None:
        if not self.script:
            self._problem("metrics scraping is enabled but collect_metrics.sh is not on PATH: not collected")
            return
        self.logs.say(f"starting metrics collection ({METRICS_LOG})")
        self.started = self._spawn("start")

    def stop(self) -> None:
        if self.started is None:
            return
        for action in ("stop", "process"):
            proc = self._spawn(action)
            if proc is not None:
                self._end(proc, action, self.deadline_s)
            if action == "stop":  # the background collector, told to stop, ends within the deadline too
                self._end(self.started, "start (the collector told to stop)", min(60.0, self.deadline_s))
        self.logs.say(f"metrics collection done ({METRICS_LOG})")

    @classmethod
    def deadline_from(cls, environ) -> float:
        """KVBENCH_METRICS_DEADLINE_S, a number of seconds above 0 (else the default, said by the caller)."""
        raw = (environ.get("KVBENCH_METRICS_DEADLINE_S") or "").strip()
        try:
            value = float(raw) if raw else METRICS_DEADLINE_S
        except ValueError:
            raise HarnessError(f"KVBENCH_METRICS_DEADLINE_S is {raw!r}: a number of seconds above 0") from None
        if not (0 < value < float("inf")):
            raise HarnessError(f"KVBENCH_METRICS_DEADLINE_S is {raw!r}: a number of seconds above 0")
        return value


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
                   endpoint: str, run_dir: Path | None, reports: list[str],
                   metrics_problems: list[str] | None = None) -> None:
    """run_metadata.yaml: the keys llm-d-benchmark's harnesses write (its analysis reads them: the times, the
    arguments, the version, the status, the experiment), strings as theirs are; then kvbench's own two (and how the
    metrics collection went, where it was asked for)."""
    data = {
        "harness_start": _iso(start), "harness_stop": _iso(stop), "harness_delta": f"PT{stop - start:.3f}S",
        "harness_args": redact_text(shlex.join(command[1:])), "harness_version": kvbench_version(),
        "harness_name": env.harness_name, "harness_workload": env.workload_name, "harness_rc": str(rc),
        "experiment_id": env.experiment_id, "model": model, "endpoint_url": redact_url(endpoint) if endpoint else "",
        "namespace": env.namespace, "description_text": env.description, "description_keywords": ",".join(env.keywords),
        "kvbench_run": str(run_dir.relative_to(env.results_dir)) if run_dir and run_dir.exists() else "",
        "benchmark_reports": reports,
    }
    if metrics_problems is not None:  # scraping was asked for: how it went
        data["metrics_collection"] = "; ".join(metrics_problems) or "collected"
    atomic_write_text(env.results_dir / METADATA, yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


def run(environ=None, stdout=None, stderr=None) -> int:
    """The harness: the profile's kvbench run against the endpoint, its reports, logs and metadata; its status."""
    environ = os.environ if environ is None else environ
    try:
        env = Environment.read(environ)
        env.results_dir.mkdir(parents=True, exist_ok=True)
        logs = Logs(env.results_dir, stdout, stderr)
    except HarnessError as exc:
        print(f"{SAY}error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a results folder it cannot make or write in: nowhere to put anything
        print(f"{SAY}error: results folder {environ.get('LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR')}: {exc}",
              file=sys.stderr)
        return 1
    start = time.time()
    rc, command, run_dir, reports, metrics = 2, [], None, [], None
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
        if env.scrape_metrics:
            metrics = MetricsCollection(env, logs, MetricsCollection.deadline_from(environ))
            metrics.start()
        try:
            rc = logs.run(command)
        finally:
            if metrics:
                try:
                    metrics.stop()
                except Exception as exc:  # noqa: BLE001 - the metrics never cost what kvbench measured
                    metrics._problem(f"metrics collection failed: {type(exc).__name__}: {exc}")
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
        except (OutputRefused, ResultsReadError, ValueError, OSError) as exc:
            logs.error(f"Benchmark Reports not written: {exc}")
            rc = rc or 1
    try:
        write_metadata(env, start, time.time(), command, rc, model, endpoint, run_dir, reports,
                       metrics.problems if metrics else None)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        logs.error(f"{METADATA} not written: {exc}")
        rc = rc or 1
    logs.close()
    return rc


# --- the analyzer ----------------------------------------------------------------------------------------

def analyze(environ=None) -> int:
    """Every Benchmark Report in the results folder validated by the package (the harness wrote them: nothing
    to convert). 1 when one does not validate, or when kvbench succeeded and there is none; else 0."""
    from llmd_benchmark_report import load_benchmark_report

    from kvbench.reports import benchmark_report as br

    environ = os.environ if environ is None else environ
    folder = environ.get("LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR", "").strip()
    if not folder or not Path(folder).is_dir():
        print(f"{SAY}error: LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR is {folder or 'not set'}: no results folder",
              file=sys.stderr)
        return 2
    folder = Path(folder)
    try:  # bounded YAML (no alias bomb), as the reports below
        meta = bounded.parse_yaml(bounded.read_bytes(folder / METADATA, PROFILE_MAX_BYTES, what=METADATA),
                                  folder / METADATA, METADATA) or {}
    except (bounded.InputError, OSError):
        meta = {}
    bad = 0
    files = sorted(folder.glob(f"{br.FILE_PREFIX}*.yaml"))
    for path in files:
        try:
            data = bounded.parse_yaml(bounded.read_bytes(path, 64 << 20, what="Benchmark Report"), path,
                                      "Benchmark Report")
            report = load_benchmark_report(data)
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
