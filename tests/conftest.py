import contextlib
import fcntl
import os
import signal
import sys
from pathlib import Path

import pytest

from kvbench.backends import gguf_converter
from kvbench.common import models

# pytest rewrites the asserts of every test module it imports and caches the result as bytecode, unless
# bytecode writing is off (PYTHONDONTWRITEBYTECODE, set on the machines this project runs on): then each
# worker redid it every session, 13 s of a 17 s collection. The cache goes to tests/**/__pycache__ (ignored).
sys.dont_write_bytecode = False

# numpy's OpenBLAS starts a thread per core when it loads, and they spin: 0.1 s of CPU in each of the suite's
# Python processes on 2 cores (kvbench commands, load workers, stand-in servers: about 250 in the developer's
# loop). No test multiplies matrices. Set before anything here imports numpy; a user's own setting is kept.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# Each run's memory-bandwidth probe (bench/common/bandwidth.py) reads 256 MiB or more for about 0.3 s: off for
# the suite's many short runs; tests/run/test_decode_bound.py switches it on where it is what is tested.
os.environ.setdefault("KVBENCH_BANDWIDTH_PROBE", "off")
# Each run's client probe (bench/load/self_probe.py) streams about 16K events from a stand-in for about 1 s:
# off likewise; tests/load/test_self_probe.py runs it.
os.environ.setdefault("KVBENCH_CLIENT_PROBE", "off")

# pytest-timeout: every test has pyproject.toml's default (300 s); one marked `engine` starts a real engine
# (a module's engine fixture runs inside its first test) and gets this instead. A test's own
# @pytest.mark.timeout(...) wins over both.
ENGINE_TIMEOUT_S = 1200
# Under pytest-xdist (`make test` runs two workers; a bare `pytest` runs `-n auto`, a worker per core) the
# modules of tests that start a real engine, named *_engines.py, are one unit of work: one worker runs them
# one after another, as alone as before (two engines at once on 2 cores would each measure the other, and the
# tests that look for an engine's processes left behind would find the other's); the other workers take the
# rest, a module at a time, so module fixtures are made once. (xdist's own loadgroup marks do not group under
# pytest 9.2: it renames items through an attribute pytest no longer reads.)
ENGINE_MODULES = "_engines.py"
# Tests whose verdicts rest on wall-clock time (a 10 % slower mock engine caught by `kvbench compare`, load
# workers ended within seconds, an open loop's sends within 20 ms of schedule (84 ms late once beside other
# tests), the client bench's mock sending within 5 ms of its schedule (14 ms late beside eight test workers),
# TTFTs of a split load set against one process's, a salted run's TTFTs set
# against a cold one's, the smoke runs' KV read from /metrics in time: beside other tests vLLM's API server
# answered too late and its KV read 0 in use; two vLLM replicas' KV peaks through a real Prometheus: beside
# other tests Prometheus scraped nothing for 4.5 s of a 5 s decode, its DCGM scrape taking 4.4 s) run
# alone: each holds a lock that no other test runs beside (pytest_runtest_protocol), and their unit is
# handed out last (under another worker's load the planted regression once read as inconclusive). A module's
# path names all its tests (a module fixture measures, as test_merge's does), module::test one test and its
# parameters; the rest of that module runs beside others.
QUIET_TESTS = (
    "tests/compare/test_planted.py::test_compare_catches_a_planted_regression_and_passes_an_unchanged_engine",
    "tests/load/test_workers.py::test_a_load_on_two_workers_is_the_load_of_one_process",
    "tests/load/test_workers.py::test_a_cancelled_load_ends_its_workers_at_once",
    "tests/load/test_workers.py::test_a_killed_harness_takes_its_load_workers_with_it",
    "tests/faults/test_load_workers.py::test_a_stopped_load_worker_loses_only_its_own_requests_and_the_run_says_which",
    "tests/load/test_profiles.py::test_open_loop_sends_on_schedule_when_the_engine_keeps_up",
    "tests/selfcheck/test_client_bench.py::test_mock_records_pair_with_client_timings",
    "tests/run/test_merge.py", "tests/run/test_prefix_cache_engines.py", "tests/backends/test_smoke_engines.py",
    "tests/run/test_telemetry_engines.py::test_a_deployment_of_two_vllm_replicas_with_prometheus_and_dcgm",
)
ENGINES, QUIET = "engines", "quiet"


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def is_quiet(nodeid: str) -> bool:
    test = nodeid.split("[", 1)[0]
    return any(test == quiet or test.startswith(quiet + "::") for quiet in QUIET_TESTS)


def pytest_xdist_auto_num_workers(config):
    """`-n auto` (pyproject.toml's addopts): three workers per core. Much of the suite waits (stand-in
    servers' timers, stalls, processes that must die, a guard's 5 s grace), and with four workers on 2 cores
    the cores went half idle whenever those modules ran together. On a quiet 2-core machine `pytest -m "not
    engine"` took 3 min 12 s with six workers against 3 min 18 s with four (6 min 20 s with two, an older
    suite); beside a process keeping one core busy, six took 3 min 25-37 s, four 3 min 38-40 s, and eight 3 min
    36 s with two timing tests failing (the quiet tests alone in each)."""
    return 3 * (os.cpu_count() or 1)


def scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to: the engine modules together, the quiet tests together, else its
    module."""
    module = module_of(nodeid)
    return ENGINES if module.endswith(ENGINE_MODULES) else QUIET if is_quiet(nodeid) else module


# Each test's seconds (setup, call and teardown) in the last session that ran it, in pytest's cache
# (.pytest_cache/): the scheduler hands out the longest units first. xdist's own order, the most tests first,
# handed a module that mostly waits (a 10 s stall, a guard's grace) out late, and the quiet tests, which run
# when every other test has ended, waited for it alone.
TEST_SECONDS_KEY = "kvbench/test_seconds"
UNKNOWN_TEST_S = 1.0  # a test not in the cache (new, or a first session) counts as this long
TEST_SECONDS: dict[str, float] = {}  # this session's, summed over the phases


def unit_seconds(tests, known: dict[str, float]) -> float:
    return sum(known.get(test, UNKNOWN_TEST_S) for test in tests)


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    known = config.cache.get(TEST_SECONDS_KEY, {}) if getattr(config, "cache", None) else {}

    class EnginesTogetherLongestFirstQuietLast(LoadScopeScheduling):
        ordered = False

        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

        def _assign_work_unit(self, node) -> None:
            if known and not self.ordered:
                self.ordered = True
                units = sorted(self.workqueue.items(), key=lambda unit: -unit_seconds(unit[1], known))
                self.workqueue.clear()
                self.workqueue.update(units)
            if QUIET in self.workqueue and len(self.workqueue) > 1:
                self.workqueue.move_to_end(QUIET)
            super()._assign_work_unit(node)

        def _reschedule(self, node) -> None:
            # xdist ends a worker as soon as nothing is left to hand out, while the quiet tests still run: its
            # session's teardown and its interpreter's exit were load beside them (once the planted regression's
            # TTFT read as inconclusive). Every worker now waits for the last test, then all end.
            if self.workqueue or node.shutting_down:
                return super()._reschedule(node)
            if not any(self._pending_of(work) for work in self.assigned_work.values()):
                for each in self.nodes:
                    if not each.shutting_down:
                        each.shutdown()

    return EnginesTogetherLongestFirstQuietLast(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Every test holds the session's lock from its setup to its teardown (the engines that fixtures of any
    scope start and stop inside them too), shared, and a quiet test (QUIET_TESTS) alone: it
    waits for the tests running beside it to end, and the other workers wait for it. A lock held per module,
    by an autouse fixture, left out the session fixtures (shared engine servers), which started beside a
    quiet test."""
    alone = is_quiet(item.nodeid)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with _session_lock(item.config._tmp_path_factory, fcntl.LOCK_EX if alone else fcntl.LOCK_SH):
        yield
    # a command run in-process that was interrupted ignores both signals from then on (as kvbench does while
    # it winds down): left so, every later process this worker started inherited the ignored SIGTERM
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


@contextlib.contextmanager
def _session_lock(tmp_path_factory, how: int):
    """One lock file per session, beside the workers' temporary folders."""
    base = tmp_path_factory.getbasetemp()
    folder = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # pytest-N/, shared by the workers
    with open(folder / "quiet.lock", "a") as f:
        fcntl.flock(f, how)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def pytest_addoption(parser):
    parser.addoption("--expected-skips", metavar="FILE", default=None,
                     help="fail the session when a test skips unless FILE lists it with its reason "
                          "(.ci/run passes tests/expected_skips.txt)")


def pytest_configure(config):
    # Tests never reach a model hub.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = config.getoption("--expected-skips")
    config._kvbench_expected_skips = (path, read_expected_skips(path)) if path else None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("engine") and not item.get_closest_marker("timeout"):
            item.add_marker(pytest.mark.timeout(ENGINE_TIMEOUT_S))
    # the quiet tests last (every worker sorts alike, so xdist's collections still agree): the order of a
    # run without workers
    items.sort(key=lambda item: is_quiet(item.nodeid))


# --- skips: each one is recorded with its reason; with --expected-skips, an unlisted one fails the session ---

def _skip_reason(report) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


SKIPS: list[tuple[str, str]] = []  # (node id, reason) of every skip of this session


def pytest_runtest_logreport(report):
    if report.skipped and not hasattr(report, "wasxfail"):
        SKIPS.append((report.nodeid, _skip_reason(report)))
    TEST_SECONDS[report.nodeid] = TEST_SECONDS.get(report.nodeid, 0.0) + report.duration


def pytest_collectreport(report):
    if report.skipped:
        SKIPS.append((report.nodeid, _skip_reason(report)))


def read_expected_skips(path: Path) -> list[tuple[str, str]]:
    """(node id, reason) per line ``NODE_ID | REASON``; blank lines and ``#`` comments are left out. A skip
    is expected when its node id is listed and its reason contains the listed reason."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise pytest.UsageError(f"--expected-skips: {exc}") from None
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        node, sep, reason = (part.strip() for part in line.partition(" | "))
        if not sep or not node or not reason:
            raise pytest.UsageError(f"{path}:{n}: expected 'NODE_ID | REASON', not {line!r}")
        out.append((node, reason))
    return out


def unexpected_skips(skips: list[tuple[str, str]], expected: list[tuple[str, str]]) -> list[tuple[str, str]]:
    return [(node, reason) for node, reason in skips
            if not any(node == e_node and e_reason in reason for e_node, e_reason in expected)]


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if TEST_SECONDS and getattr(config, "cache", None) and not hasattr(config, "workerinput"):  # the controller
        config.cache.set(TEST_SECONDS_KEY, {**config.cache.get(TEST_SECONDS_KEY, {}),
                                            **{test: round(s, 3) for test, s in TEST_SECONDS.items()}})
    if session.config._kvbench_expected_skips is None:
        return
    path, expected = session.config._kvbench_expected_skips
    bad = unexpected_skips(SKIPS, expected)
    session.config._kvbench_unexpected = (path, bad)
    if bad and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    path, bad = getattr(config, "_kvbench_unexpected", (None, []))
    if bad:
        terminalreporter.section("unexpected skips", sep="=", red=True, bold=True)
        for node, reason in bad:
            terminalreporter.line(f"{node} | {reason}", red=True)
        terminalreporter.line(f"{len(bad)} skip(s) not listed in {path}: give the test what it needs, or list the "
                              "skip there with its reason", red=True)


@pytest.fixture(autouse=True)
def held_secrets_end_with_their_test():
    """A kvbench process masks every credential it was given until it ends (bench/common/redact.py); a test
    worker runs many commands in-process, and one test's API key ("wrong") masked the word in the errors of
    every later test on that worker. What a test holds is let go after it."""
    from kvbench.common import redact

    with redact.held_within():
        yield


@pytest.fixture(scope="session")
def smollm2():
    """The embedded model, prepared by `make test` (kvbench setup) before pytest runs."""
    return models.resolve("smollm2", gguf_converter())
