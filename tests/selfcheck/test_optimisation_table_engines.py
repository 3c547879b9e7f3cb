"""The optimisation table's smallest column pair on a real engine: llama.cpp with a slot per request reserving the
per-request limit (static, contiguous) against its unified cache (paged-like), each started in its wall
(``python -m kvbench.selfcheck.optimisation_table``). With 64 MiB above its idle footprint, a slot of 2,048 tokens
(45 MiB of f16 KV) fits once, 128-token requests from the shared pool (2.8 MiB each) several times (its start and
its slots take some of the budget beside the pool: 3 of them were killed in 16 MiB, 6 in 32 MiB): the unified
cache must hold more of them at once, and every figure must come from the trials it wrote."""
from __future__ import annotations

import json

import pytest

from kvbench.common.memory_wall import MemoryWallError, detect
from kvbench.selfcheck.optimisation_table import main, read_folder

from tests.helpers import engine_env

pytestmark = pytest.mark.engine


@pytest.mark.timeout(300)
def test_a_contiguous_slot_against_the_unified_cache(tmp_path, capsys):
    try:
        detect()
    except MemoryWallError as exc:  # an engine test must run where the engines are: say why it cannot
        pytest.fail(f"no memory wall on this machine: {exc}")
    engine_env("llamacpp")
    out = tmp_path / "table"
    code = main(["--engines", "llamacpp", "--columns", "static,paged", "--budget", "64M", "--request-tokens", "128",
                 "--limit", "2048", "--max-rungs", "5", "--out", str(out), "--log-dir", str(tmp_path / "logs")])
    assert code == 0  # no process of any start survived its stop
    run, trials, requests = read_folder(out)
    by_id = {t["trial"]: t for t in trials}
    assert by_id["calibrate-llamacpp"]["verdict"] == "ran"
    wall = run["walls"]["llamacpp"]
    assert wall["wall_bytes"] >= wall["idle_bytes"] + 64 * 2**20
    rungs = {t["config"]: [] for t in trials if t["purpose"] == "rung"}
    for t in trials:
        if t["purpose"] == "rung":
            rungs[t["config"]].append(t)
            assert t["wall_bytes"] == wall["wall_bytes"] and t["peak_bytes"] <= t["wall_bytes"]
            assert t["verdict"] in ("ran", "killed", "failed", "queued")
            if t["verdict"] == "ran":  # every request whole, all held at once by the engine's own count
                assert t["requests_ok"] == t["rung"] and t["running_peak"] == t["rung"]
                assert len([r for r in requests[t["trial"]] if r["phase"] == "batch" and r["whole"]]) == t["rung"]
    held = {config: max((t["rung"] for t in ts if t["verdict"] == "ran"), default=0) for config, ts in rungs.items()}
    assert held["llamacpp-unified"] > held["llamacpp-slots"], held
    assert held["llamacpp-unified"] >= 2
    text = (out / "table.md").read_text()
    assert text == capsys.readouterr().out
    assert "| requests of 128 tokens held at once" in text
    assert f"llama.cpp: {held['llamacpp-unified']}" in text
    assert (out / "held.png").stat().st_size > 10_000
    command = json.loads((out / "run.json").read_text())["command"]
    assert command.startswith("python -m kvbench.selfcheck.optimisation_table")
