"""The run owner of load shares on several machines (bench/load/owner.py) and the clock map (bench/load/clock.py):
offsets measured by pings, the start barrier (one instant for every share; a share that never comes is absent
and not waited for again), the leaving, and a process's readings put on the owner's clock."""
from __future__ import annotations

import threading
import time

import pytest

from kvbench.backends.types import RequestResult
from kvbench.load.clock import ClockMap, best_offset
from kvbench.load.owner import LoadOwner, OwnerClient, OwnerError


def test_the_best_ping_gives_the_offset():
    # owner before, process reading, owner after: the process's clock is 100 s behind; the shortest round trip wins
    assert best_offset([(10.0, -89.0, 12.0), (20.0, -80.0, 20.002)]) == pytest.approx((100.001, 0.002))


def test_a_clock_map_follows_a_drifting_clock():
    clock = ClockMap(t_start=0.0, offset_start=5.0, t_end=10.0, offset_end=5.01)
    assert clock(0.0) == 5.0 and clock(5.0) == pytest.approx(10.005) and clock(10.0) == pytest.approx(15.01)
    assert clock(20.0) == pytest.approx(25.01) and clock(None) is None  # held beyond the end
    r = RequestResult("r", 1, 1, 1.0, [2.0, 3.0], [1, 1], 4.0, 0.5)
    clock.apply(r)
    assert (r.t_sent, *r.chunk_times, r.t_done, r.t_scheduled) == pytest.approx((6.001, 7.002, 8.003, 9.004, 5.5005))
    assert (r.clock_offset_start_s, r.clock_offset_end_s) == (5.0, 5.01)
    assert ClockMap(1.0, 2.0)(3.0) == 5.0  # no end measured: the start's offset holds


def test_the_barrier_starts_every_share_at_once_and_stops_waiting_for_an_absent_one():
    owner = LoadOwner("127.0.0.1", 0, 3, barrier_timeout_s=1.0)
    url = f"http://127.0.0.1:{owner.port}"
    shares = [OwnerClient(url, 0, 3, local=owner), OwnerClient(url, 1, 3), OwnerClient(url, 2, 3)]
    try:
        offset, rtt = shares[1].offset()  # one machine: one clock, measured to within the round trip
        assert abs(offset) <= rtt < 0.05 and shares[0].offset() == (0.0, 0.0)
        got = {}

        def arrive(i, key="cell-a"):
            got[i] = shares[i].arrive(key)

        threads = [threading.Thread(target=arrive, args=(i,)) for i in (0, 1)]  # share 2 never comes
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert 1.0 <= time.perf_counter() - t0 < 3.0  # waited the timeout for share 2
        assert got[0] == got[1] and got[0][1] == [2] and got[0][0] > t0  # one start, share 2 absent
        t0 = time.perf_counter()
        threads = [threading.Thread(target=arrive, args=(i, "cell-b")) for i in (0, 1)]
        got.clear()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert time.perf_counter() - t0 < 0.9 and got[0][1] == []  # absent: not waited for again
        for share in shares[1:]:
            share.leave()
        shares[0].leave()
        assert owner.wait_for_the_others(timeout_s=1.0) == []
    finally:
        owner.close()
    with pytest.raises(OwnerError, match=f"the load owner at {url} did not answer /clock"):
        shares[1].offset()
