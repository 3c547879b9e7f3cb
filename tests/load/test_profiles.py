"""Load profiles, against an in-process fake engine whose requests take a programmed time."""
import asyncio
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from kvbench.backends.base import Backend
from kvbench.backends.types import RequestResult
from kvbench.load import LoadPoint, LoadSettings, open_loop, profile, run, run_async
from kvbench.load.concurrent import Concurrent
from kvbench.load.constant import Constant
from kvbench.load.poisson import Poisson
from kvbench.workloads import Workload


class SleepyBackend(Backend):
    """Each request: TTFT then one token every ITL; records how many were in flight at once."""
    engine, default_version = "fake", "0"

    def __init__(self, ttft=0.05, itl=0.01, tokens=3):
        super().__init__("0", None)
        self.ttft, self.itl, self.tokens = ttft, itl, tokens
        self.now = self.peak = 0

    @classmethod
    def recipe(cls, version):
        raise NotImplementedError

    def command(self, spec):
        raise NotImplementedError

    def kv_pool(self):
        return None

    def kv_in_use(self, client):
        return None

    async def stream(self, client, prompt):
        r = RequestResult(prompt.request_id, prompt.prompt_tokens, prompt.output_tokens, time.perf_counter())
        self.now += 1
        self.peak = max(self.peak, self.now)
        await asyncio.sleep(self.ttft)
        for _ in range(self.tokens):
            r.add_chunk(time.perf_counter(), 1)
            await asyncio.sleep(self.itl)
        self.now -= 1
        r.t_done = time.perf_counter()
        return r


def drive(backend, prompts, point: LoadPoint, timeout_s: float, duration_s: float | None = None):
    """The profile that drives ``point``, as the runner drives it."""
    return run_async(run(backend, prompts, point, LoadSettings(timeout_s, duration_s)))


class P:
    def __init__(self, i):
        self.request_id, self.prompt_tokens, self.output_tokens, self.ordinal = f"r{i}", 10, 3, i


def test_constant_arrivals_are_evenly_spaced():
    assert Constant.arrival_offsets(4, 2.0).tolist() == [0.0, 0.5, 1.0, 1.5]


def test_poisson_arrivals_have_the_asked_mean_and_are_seeded():
    a = Poisson.arrival_offsets(20000, 5.0, 1)
    assert a[0] == 0.0 and np.all(np.diff(a) >= 0)
    assert np.mean(np.diff(a)) == pytest.approx(0.2, rel=0.03)
    assert np.array_equal(a, Poisson.arrival_offsets(20000, 5.0, 1))
    assert not np.array_equal(a, Poisson.arrival_offsets(20000, 5.0, 2))



def test_an_unknown_profile_is_refused_with_the_allowed_ones():
    with pytest.raises(ValueError, match="allowed: concurrent, constant, poisson, sweep"):
        LoadPoint("bursty", 1, 1.0)
    with pytest.raises(ValueError, match="(?s)load_profile.*allowed: concurrent, constant, poisson, sweep"):
        _workload(load_profile="bursty", concurrency=[1])
    with pytest.raises(ValueError, match="(?s)profile.*'bursty'.*allowed: concurrent"):
        _workload(load={"profile": "bursty", "concurrency": [1]})
    with pytest.raises(ValueError, match="drives none itself"):
        LoadPoint("sweep", 4)


def test_poisson_schedule_seed_is_the_same_in_every_process():
    code = "from kvbench.load import open_loop; print(open_loop.schedule_seed(20261129, 1024, 0, 'poisson-r1-cap8'))"
    seeds = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "PYTHONHASHSEED": str(h)}).stdout for h in (1, 2)}
    assert seeds == {f"{open_loop.schedule_seed(20261129, 1024, 0, 'poisson-r1-cap8')}\n"}
    assert (open_loop.schedule_seed(20261129, 1024, 1, "poisson-r1-cap8")
            != open_loop.schedule_seed(20261129, 1024, 0, "poisson-r1-cap8"))


def test_closed_loop_keeps_exactly_concurrency_in_flight():
    backend = SleepyBackend()
    load = drive(backend, [P(i) for i in range(9)], LoadPoint("concurrent", 3), 5)
    assert len(load.results) == 9 and all(r.error is None for r in load.results)
    assert backend.peak == 3 and load.max_in_flight == 3
    assert load.offered_request_rate is None and load.send_lags == []


def test_closed_loop_duration_stops_new_requests():
    load = drive(SleepyBackend(ttft=0.1, itl=0.0, tokens=1), [P(i) for i in range(50)], LoadPoint("concurrent", 2),
                 5, duration_s=0.25)
    assert 4 <= len(load.results) <= 8  # 2 workers x ~0.1 s per request for 0.25 s, in-flight ones finish


def test_open_loop_sends_on_schedule_when_the_engine_keeps_up():
    load = drive(SleepyBackend(ttft=0.01, itl=0.0, tokens=1), [P(i) for i in range(8)],
                 LoadPoint("constant", None, 20.0), 5)
    assert load.offered_request_rate == 20.0
    assert load.achieved_request_rate == pytest.approx(20.0, rel=0.1)
    assert max(load.send_lags) < 0.02
    assert all(r.t_scheduled is not None for r in load.results)


def test_open_loop_with_a_cap_records_the_lag_it_causes():
    # 10 requests/s offered, but each takes 0.2 s and only one may be in flight: the engine is offered
    # 5/s in fact, and the lag behind the schedule grows with every request (coordinated omission shows).
    backend = SleepyBackend(ttft=0.2, itl=0.0, tokens=1)
    load = drive(backend, [P(i) for i in range(6)], LoadPoint("constant", 1, 10.0), 5)
    assert backend.peak == 1 and load.max_in_flight == 1
    assert load.achieved_request_rate == pytest.approx(5.0, rel=0.15)
    assert load.send_lags[-1] > 0.45 and load.send_lags == sorted(load.send_lags)


def test_failed_request_is_a_result_not_an_exception():
    class Broken(SleepyBackend):
        async def stream(self, client, prompt):
            raise ValueError("not JSON")
    load = drive(Broken(), [P(0)], LoadPoint("concurrent", 1), 5)
    assert load.results[0].error == "bad response: not JSON"


def test_timeout_becomes_a_failed_request():
    load = drive(SleepyBackend(ttft=2.0), [P(0)], LoadPoint("concurrent", 1), 0.1)
    assert "timed out" in load.results[0].error


def test_load_point_validation_and_slug():
    assert LoadPoint("concurrent", 4).slug == "c4"
    assert LoadPoint("poisson", 8, 2.5).slug == "poisson-r2_5-cap8"
    assert LoadPoint("constant", None, 1.0).slug == "constant-r1"
    with pytest.raises(ValueError, match="request_rate"):
        LoadPoint("poisson", 4)
    with pytest.raises(ValueError, match="concurrency"):
        LoadPoint("concurrent", 0)
    with pytest.raises(ValueError, match="no request_rate"):
        LoadPoint("concurrent", 4, 2.0)


def _workload(**kw):
    base = dict(name="w", seed=1, prompt_tokens=[16], output_tokens=4)
    return Workload.model_validate(base | kw)


def test_sweep_points():
    assert [p.slug for p in _workload(concurrency=[1, 4]).load.points()] == ["c1", "c4"]
    w = _workload(load_profile="poisson", request_rates=[1, 2], concurrency=[8], requests=5)
    assert [p.slug for p in w.load.points()] == ["poisson-r1-cap8", "poisson-r2-cap8"]
    sat = _workload(load_profile="constant", request_rates="saturation", concurrency=[4], requests=5).load
    (finder,) = sat.points()
    assert finder.slug == "c4"  # the closed loop that finds the rate
    later = sat.points_after(finder, 2.0)
    assert [p.request_rate for p in later] == [0.5, 1.0, 1.5, 2.0] and {p.slug for p in later} >= {"constant-r2-cap4"}
    assert sat.points_after(finder, 0) == [] and sat.points_after(later[0], 2.0) == []
    assert sat.points_found_later() == 4 and sat.max_in_flight() == 4 and sat.requests_per_cell(finder) == 5


# every repository file's load, flat (as run.json records it) and as its [load] section
FLAT_AND_SECTION = [
    ({"concurrency": [1, 2], "rounds": 2}, {"profile": "concurrent", "concurrency": [1, 2], "rounds": 2}),
    ({"load_profile": "concurrent", "concurrency": [1], "requests": 3},
     {"profile": "concurrent", "concurrency": [1], "requests": 3}),
    ({"load_profile": "poisson", "request_rates": [0.5, 2], "concurrency": [8], "duration_s": 10},
     {"profile": "poisson", "request_rates": [0.5, 2], "max_concurrency": 8, "duration_s": 10}),
    ({"load_profile": "constant", "request_rates": [1], "requests": 4},
     {"profile": "constant", "request_rates": [1], "requests": 4}),
    ({"load_profile": "poisson", "request_rates": "saturation", "saturation_steps": 3, "concurrency": [8],
      "requests": 16}, {"profile": "sweep", "arrivals": "poisson", "concurrency": 8, "steps": 3, "requests": 16}),
]


@pytest.mark.parametrize("flat, section", FLAT_AND_SECTION)
def test_a_flat_workload_means_what_its_section_means(flat, section):
    old, new = _workload(**flat), _workload(load=section)
    assert old == new and type(old.load).name == section["profile"]
    assert old.load.points() == new.load.points()
    dumped = old.model_dump()
    assert list(dumped)[:9] == ["name", "description", "family", "seed", "prompt_tokens", "output_tokens",
                                "load_profile", "concurrency", "request_rates"]
    assert Workload.model_validate(dumped) == old  # run.json's record reads back (a resumed run)


def test_the_flat_record_has_every_key_of_the_flat_model():
    """run.json records the workload as the flat model did: every load key, with its old default."""
    dumped = _workload(load_profile="poisson", request_rates=[1], requests=4).model_dump()
    assert {k: dumped[k] for k in ("load_profile", "concurrency", "request_rates", "saturation_steps", "requests",
                                   "rounds", "duration_s")} == {
        "load_profile": "poisson", "concurrency": [], "request_rates": [1.0], "saturation_steps": 4, "requests": 4,
        "rounds": 1, "duration_s": None}


def test_a_section_takes_only_its_profiles_keys():
    with pytest.raises(ValueError, match="rounds"):
        _workload(load={"profile": "poisson", "request_rates": [1], "requests": 4, "rounds": 2})
    with pytest.raises(ValueError, match="not an open-loop profile"):
        _workload(load={"profile": "sweep", "arrivals": "concurrent", "concurrency": 4, "requests": 4})
    with pytest.raises(ValueError, match="give the load once"):
        _workload(load={"profile": "concurrent", "concurrency": [1]}, rounds=2)


def test_a_copy_with_flat_keys_updates_the_load():
    w = _workload(concurrency=[1], rounds=1)
    assert w.model_copy(update={"concurrency": [2], "rounds": 3}).load == Concurrent(concurrency=[2], rounds=3)


def test_run_async_records_how_late_the_client_loop_ran():
    """A load whose event loop is blocked (here by a synchronous sleep in the backend, as a starved client
    would be) reports that lag; an idle one reports little."""

    class Blocking(SleepyBackend):
        async def stream(self, client, prompt):
            time.sleep(0.12)  # holds the loop: nothing else can be read meanwhile
            return await super().stream(client, prompt)

    quiet = drive(SleepyBackend(ttft=0.05, itl=0.0, tokens=1), [P(0), P(1)], LoadPoint("concurrent", 1), 5)
    assert quiet.loop_lag_s_max is not None and quiet.loop_lag_s_max < 0.05
    blocked = drive(Blocking(ttft=0.05, itl=0.0, tokens=1), [P(0), P(1)], LoadPoint("concurrent", 1), 5)
    assert blocked.loop_lag_s_max >= 0.1


def test_run_async_keeps_a_full_garbage_collection_out_of_the_load():
    """A big heap of tracked objects (a full collection over it takes ~0.3 s of CPU here) is frozen for the
    load (frozen_heap), so the collections that the load's own allocations trigger do not stop the client.
    Each collection is timed in CPU of its thread (gc.callbacks): on busy cores the event loop's wall-clock
    lag also counts the time the process waited for a core (0.29 s once in CI, beside a 0.58 s collection)."""
    import gc
    import threading

    heap = [[i] for i in range(1_500_000)]  # noqa: F841 - kept alive on purpose
    gc.collect()
    started = time.thread_time()
    gc.collect()
    full = time.thread_time() - started
    assert full > 0.05  # the walk that must not happen inside the load

    class Allocating(SleepyBackend):
        async def stream(self, client, prompt):
            junk = [[j] for j in range(200_000)]  # enough young objects to trigger collections
            del junk
            return await super().stream(client, prompt)

    local, pauses = threading.local(), []

    def timed(phase, info):
        if phase == "start":
            local.started = time.thread_time()
        else:
            pauses.append(time.thread_time() - local.started)

    gc.callbacks.append(timed)
    try:
        drive(Allocating(ttft=0.01, itl=0.0, tokens=1), [P(i) for i in range(10)], LoadPoint("concurrent", 1), 5)
    finally:
        gc.callbacks.remove(timed)
    assert pauses and max(pauses) < full / 2, (max(pauses, default=None), full)
    assert gc.get_freeze_count() == 0  # unfrozen again afterwards


def test_frozen_heap_nests_and_thaws_once():
    import gc

    from kvbench.load import frozen_heap

    with frozen_heap():
        outer = gc.get_freeze_count()
        assert outer > 0
        with frozen_heap():
            [[i] for i in range(1000)]
        assert gc.get_freeze_count() == outer  # the inner block neither thawed nor refroze
    assert gc.get_freeze_count() == 0



def test_a_profile_is_one_class(monkeypatch):
    """What a newcomer adds: a LoadProfile subclass in its own module; workload sections, load points and the
    dispatch then know its name (here a closed loop that always runs one at a time)."""
    from typing import Literal

    monkeypatch.setattr(profile, "_REGISTERED", dict(profile._REGISTERED))  # the class is forgotten afterwards

    class OneAtATime(Concurrent):
        profile: Literal["one_at_a_time"] = "one_at_a_time"

        @classmethod
        async def run(cls, backend, prompts, point, settings):
            return await super().run(backend, prompts, LoadPoint(cls.name, 1), settings)

    w = _workload(load={"profile": "one_at_a_time", "concurrency": [3]})
    (point,) = w.load.points()
    assert (point.profile, point.slug, point.driver) == ("one_at_a_time", "c3", OneAtATime)
    load = drive(SleepyBackend(ttft=0.01, itl=0.0, tokens=1), [P(0), P(1)], point, 5)
    assert len(load.results) == 2 and load.max_in_flight == 1


class CountedPrompts:
    """A sequence of prompts that counts how many were built (indexing or iterating), as a cell's
    CellPromptList builds each prompt when the load takes it."""

    def __init__(self, n):
        self.n, self.built = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.built += 1
        return P(i)

    def __iter__(self):
        return (self[i] for i in range(self.n))


@pytest.mark.parametrize("point", [LoadPoint("concurrent", 4), LoadPoint("poisson", 4, 200.0)],
                         ids=["closed", "open-with-duration"])
def test_a_load_builds_only_the_prompts_it_sends(point):
    """A cell of 10^6 requests cut short by duration_s builds the prompts it sends, not 10^6 first (the
    closed loop used to queue every prompt before the first request)."""
    prompts = CountedPrompts(10**6)
    result = drive(SleepyBackend(ttft=0.01, itl=0.0, tokens=1), prompts, point, timeout_s=5, duration_s=0.3)
    assert 0 < len(result.results) <= prompts.built <= len(result.results) + 4
