"""The client benchmark (selfcheck/client_bench.py) in its quick mode: it runs end to end against the mock and
reports finite figures. No speed or accuracy thresholds here: those are measurements, in the README."""
from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from tests.helpers import REPO

ROOT = REPO  # the repository


def test_client_bench_quick(tmp_path):
    out = tmp_path / "client_bench.json"
    proc = subprocess.run([sys.executable, "-m", "kvbench.selfcheck.client_bench", "--quick", "--concurrency", "1,4",
                           "--ceiling-concurrency", "8", "--ceiling-tokens", "32", "--minimal", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "(a) accuracy" in proc.stdout and "(b) ceiling" in proc.stdout
    data = json.loads(out.read_text())
    # each concurrency: kvbench, then the minimal raw client alternated with it (--minimal)
    assert [(r["client"], r["concurrency"]) for r in data["accuracy"]] == [
        ("kvbench", 1), ("minimal raw client", 1), ("kvbench", 4), ("minimal raw client", 4)]
    for row in data["accuracy"]:
        assert row["failed"] == 0 and row["requests"] > 0
        kvbench_only = ("mock_late_p50_ms", "delivery_p50_ms", "request_path_p50_ms") if row["client"] == "kvbench" else ()
        for key in ("ttft_p50_err_ms", "ttft_p99_err_ms", "itl_p50_err_ms", "itl_p99_err_ms", *kvbench_only):
            assert math.isfinite(row[key]), key
        assert row["ttft_p50_err_ms"] > -1.0  # the client cannot see a token before the mock sends it
    (ceiling,) = data["ceiling"]
    assert ceiling["failed"] == 0 and ceiling["tokens"] == ceiling["requests"] * 32
    assert math.isfinite(ceiling["tokens_per_s"]) and ceiling["tokens_per_s"] > 0
    assert math.isfinite(ceiling["cpu_us_per_token"]) and ceiling["cpu_us_per_token"] > 0
    assert math.isfinite(data["wakeup_floor"]["p50_ms"])


def test_mock_records_pair_with_client_timings():
    """The mock's send times and the client's arrival stamps share one clock: arrivals come after sends."""
    from kvbench.selfcheck.client_bench import make_prompts, mock_backend, run_closed_loop
    from kvbench.selfcheck.common import Mock

    with Mock(10, 2, None) as mock:
        results = run_closed_loop(mock_backend(mock.url), make_prompts(4, 8, 100), 2)
        records = {r["key"]: r for r in mock.records()}
    assert sorted(records) == [100, 101, 102, 103]
    for r in results:
        rec = records[int(r.request_id[1:])]
        assert r.error is None and r.chunk_tokens == [1] * 8 and r.output_tokens_reported == 8
        assert r.prompt_tokens_reported == 4
        assert r.t_sent < rec["t_recv"] < rec["sends"][0]
        assert all(t >= s for t, s in zip(r.chunk_times, rec["sends"]))
        # the mock (a process of its own) sent its first token when due: within 20 ms of its timer (5.05 ms late
        # once, alone, on a fresh clone's loop); another clock would be seconds off
        assert abs(rec["sends"][0] - rec["t_first_due"]) < 0.02
