"""The run-time estimate (bench/run/estimate.py): its model, and that a run says it and records it."""
import io

import pytest
from rich.console import Console

from kvbench.run import estimate
from kvbench.run.backend_config import BackendConfig
from kvbench.run.estimate import Calibration, cell_seconds
from kvbench.run.runner import Runner, RunOptions
from kvbench.store.readers import load_cells, load_run_info
from kvbench.workloads import load


def test_two_points_give_the_prefill_line():
    cal = Calibration.from_points((32, 0.05), (1032, 1.05), itl_s=0.02)
    assert cal.prefill_s_per_token == pytest.approx(0.001)
    assert cal.prefill_fixed_s == pytest.approx(0.018)
    assert cal.request_s(1032, 11) == pytest.approx(1.05 + 10 * 0.02)


def test_a_longer_prompt_that_was_faster_never_gives_a_negative_slope():
    cal = Calibration.from_points((32, 0.5), (512, 0.4), itl_s=0.01)
    assert cal.prefill_s_per_token == 0 and cal.prefill_fixed_s == pytest.approx(0.5)


def test_cells_are_priced_as_rounds_of_serial_prefills_and_one_decode():
    cal = Calibration(0.0, 0.001, 0.01)  # 1 ms per prompt token, 10 ms per output token
    # 4 requests at concurrency 2: 2 rounds of (2 x 1 s prefill + 15 x 10 ms decode)
    assert cell_seconds(cal, 1000, 16, 4, 2, None) == pytest.approx(2 * (2.0 + 0.15))
    # an open loop slower than the engine lasts as long as its schedule
    assert cell_seconds(cal, 1000, 16, 4, None, 0.1) == pytest.approx(40.0)
    assert cell_seconds(cal, 1000, 16, 0, 1, None) == 0.0
    assert estimate.describe(30) == "30 s" and estimate.describe(600) == "10 min" and estimate.describe(7200) == "2.0 h"


def test_a_run_says_how_long_its_cells_will_take_and_records_what_they_took(tmp_path, smollm2):
    from tests.fakes.openai_server import FakeOpenAI

    console = io.StringIO()
    with FakeOpenAI(token_delay_s=0.005) as server:
        opts = RunOptions(model="smollm2", workload=load("smoke"), results_dir=tmp_path, run_id="run",
                          backends=[BackendConfig.parse(f"openai:url={server.url}")])
        run_dir = Runner(opts, Console(file=console, width=200)).run()
    assert "about" in console.getvalue() and "for its 4 cells on this machine" in console.getvalue()
    [record] = load_run_info(run_dir)["estimates"].values()
    assert record["cells"] == 4 and record["estimated_s"] > 0 and record["took_s"] > 0
    # the fake's pace is known: 16 tokens at 5 ms per request, 6 requests in 4 cells, some in parallel. The
    # estimate is of the cells' load; took_s also holds the harness's own work between cells (samplers, row
    # and timeline writes), which on a loaded 2-core machine can be most of it for cells this short
    load_s = load_cells(run_dir).wall_s.sum()
    assert record["took_s"] >= load_s > 0
    assert 0.2 < record["estimated_s"] / load_s < 5
