"""The client's own limit (bench/load/self_probe.py): the probe streams every event it programmed through the
product's client and says what it measured, is off when asked and never fails a run; a cell's columns are its
event rate over the probe's ceiling, and half of it or more is flagged. No speed is asserted: the figures
only have to exist and be consistent (a busy machine changes them, not their meaning)."""
from dataclasses import replace

import pytest

from kvbench.load import self_probe as sp
from kvbench.run.rows import summarize

from tests.run.test_rows_summary import engine_run, measurement, request


def test_the_probe_reads_every_event_it_programmed_and_says_how_late(monkeypatch):
    monkeypatch.setenv(sp.PROBE_SWITCH, "on")
    probe = sp.run_probe()
    ceiling = probe["ceiling"]
    assert ceiling["events"] == sp.CEILING["requests"] * sp.CEILING["events"]  # none lost, none made up
    assert ceiling["events_per_s"] == pytest.approx(ceiling["events"] / ceiling["wall_s"])
    assert ceiling["cpu_s_per_event"] > 0
    assert [o["concurrency"] for o in probe["overhead"]] == list(sp.TIMED["concurrency"])
    for o in probe["overhead"]:
        assert o["requests"] == sp.TIMED["requests"]  # each request matched to the stand-in's own writes
        # reported after written: a first event's lateness is never negative
        assert 0 <= o["ttft_s_p50"] <= o["ttft_s_p99"]
    assert probe["near_limit_share"] == sp.NEAR_LIMIT


def test_the_probe_is_off_when_asked_and_a_failing_one_fails_no_run(monkeypatch):
    monkeypatch.setenv(sp.PROBE_SWITCH, "off")
    assert "switched off" in sp.run_probe()["not_measured"]
    monkeypatch.setenv(sp.PROBE_SWITCH, "on")

    def refused():
        raise OSError("no loopback")
    monkeypatch.setattr(sp, "_ceiling", refused)
    assert sp.run_probe() == {"not_measured": "the client probe failed: OSError: no loopback"}


LIMIT = {"ceiling": {"events_per_s": 100.0}, "overhead": [{"concurrency": 1, "ttft_s_p50": 0.001},
                                                          {"concurrency": 16, "ttft_s_p50": 0.004}]}


def test_a_cells_columns_are_its_rate_over_the_ceiling():
    results = [request(0, 10.0), request(1, 10.1)]  # 4 reads each over the cell's 2 s: 4 events a second
    out = sp.cell_columns(results, 2.0, 1, LIMIT)
    assert out == {"client_events_per_s": 4.0, "client_limit_share": 0.04, "client_ttft_overhead_s": 0.001}
    assert sp.cell_columns(results, 2.0, 8, LIMIT)["client_ttft_overhead_s"] == 0.004  # 8 is nearer 16 than 1
    assert sp.cell_columns(results, 2.0, 1, LIMIT, processes=2)["client_limit_share"] == 0.02  # a ceiling each
    unmeasured = sp.cell_columns(results, 2.0, 1, {"not_measured": "off"})
    assert unmeasured == {"client_events_per_s": 4.0, "client_limit_share": None, "client_ttft_overhead_s": None}
    assert sp.near_limit_flag(0.49) is None and sp.near_limit_flag(None) is None
    assert sp.near_limit_flag(0.5).startswith("client near its limit: the cell read streamed events at 50% ")


def test_a_row_near_the_limit_is_flagged_and_keeps_its_status(tmp_path):
    run = replace(engine_run(tmp_path), client_limit={**LIMIT, "ceiling": {"events_per_s": 6.0}})
    row = summarize(run, measurement([request(0, 10.0), request(1, 10.1)]))
    assert row.client_limit_share == pytest.approx(4 / 6) and row.status == "ok"
    assert any(f.startswith("client near its limit") for f in row.flags)
    calm = summarize(replace(run, client_limit=LIMIT), measurement([request(0, 10.0), request(1, 10.1)]))
    assert not any(f.startswith("client near its limit") for f in calm.flags)
