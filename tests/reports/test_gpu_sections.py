"""The report's GPU sections (issue 15 items 3-5) from synthetic GPU rows: memory per GPU with the KV per GPU
and the overhead, and the planner's prediction beside the largest load each engine served. A CPU run has
neither section. No GPU figure here is a measurement: every number is made up for the test."""
import json

import pandas as pd

from kvbench.planner import resolve_model
from kvbench.reports import build
from kvbench.reports import gpu as g
from kvbench.reports.tables import aggregate
from kvbench.store.readers import load

from tests.synth import make_run

GiB = 2**30
H100 = 81559 * 2**20


def gpu_run(tmp_path, served_up_to: int, overhead: float | None = 3 * GiB) -> "Path":  # noqa: F821
    """A synthetic deployed vLLM run of Llama-3.1-8B on two H100s (tp 2) at 32K tokens per sequence,
    concurrency 1..64; cells above ``served_up_to`` queued."""
    run = make_run(tmp_path, "gpu", backends=(("vllm", "0.32.0"),), prompts=(32640,),
                   concurrency=(1, 16, 32, 64), repeats=1, n_requests=2)
    rows = [json.loads(line) for line in (run / "cells.jsonl").read_text().splitlines()]
    for r in rows:
        queued = r["concurrency"] > served_up_to
        r.update(model="llama-3.1-8b", output_tokens=128, engine_mode="deployed", gpus_used=2,
                 requests_waiting_peak=float(r["concurrency"] - served_up_to) if queued else 0.0, preemptions=0.0,
                 gpu_devices=[{"index": i, "used_peak_bytes": 70 * GiB, "over_baseline_peak_bytes": 69 * GiB,
                               "process_peak_bytes": 69 * GiB, "total_bytes": H100} for i in range(2)],
                 weights_bytes_engine=16.06e9, kv_in_use_peak_bytes_per_gpu=1.0 * GiB,
                 kv_peak_bytes_per_gpu_predicted=1.0 * GiB, gpu_overhead_bytes_per_gpu=overhead)
    (run / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_memory_per_gpu_section(tmp_path):
    agg = aggregate(load(gpu_run(tmp_path, 64)))
    table = g.gpu_memory_table(agg)
    first = table.iloc[0]
    assert first["mode"] == "deployed" and first["GPUs"] == "2"
    assert first["use over baseline per GPU (peak)"] == "GPU0 70,656.00 MiB, GPU1 70,656.00 MiB"
    assert first["in use / rules"] == "1.0000" and first["overhead per GPU"] == "3,072.00 MiB"


def test_the_planner_beside_the_largest_load_served(tmp_path):
    """Llama-3.1-8B at 32,768 tokens with tp 2: 64 KiB of KV per token per GPU (4 of its 8 KV heads), 8 GB of
    weights and 3 GiB of overhead per GPU within 90 % of an H100: the planner's figure, computed by hand here,
    against what the synthetic engine served."""
    usable = H100 * 0.9 - 16.06e9 / 2 - 3 * GiB
    per_sequence = 32768 * 32 * 4 * 128 * 2 * 2  # 2 GiB per GPU: 2,048 whole blocks of 16 tokens
    null_block = 16 * 32 * 4 * 128 * 2 * 2  # vLLM's pool keeps one
    expected = int((usable - null_block) // per_sequence)
    assert expected == 30  # so 16 served and 32 queued bracket it

    def resolve(name):
        return resolve_model(name)

    for served_up_to, verdict in ((16, "agrees"), (64, "planner pessimistic"), (1, "planner optimistic")):
        agg = aggregate(load(gpu_run(tmp_path / str(served_up_to), served_up_to)))
        row = g.planner_table(agg, resolve).iloc[0]
        assert row["planner's max concurrency"] == str(expected), row.to_dict()
        assert row["largest served (no queue, no preemption)"] == str(served_up_to)
        assert row["verdict"] == verdict and row["planner used"] == "measured overhead"


def test_the_planner_falls_back_to_the_assumption_and_says_so(tmp_path):
    agg = aggregate(load(gpu_run(tmp_path, 16, overhead=None)))
    row = g.planner_table(agg, resolve_model).iloc[0]
    assert row["planner used"] == "assumed 1.5 GiB overhead"
    unreadable = g.planner_table(agg, lambda name: (_ for _ in ()).throw(OSError("offline"))).iloc[0]
    assert unreadable["planner's max concurrency"] == "-" and "model not readable here" in unreadable["planner used"]


def test_verdicts():
    assert g.verdict(16, 32, 20) == "agrees" and g.verdict(16, None, 16) == "agrees"
    assert g.verdict(8, 16, 20) == "planner optimistic" and g.verdict(32, None, 20) == "planner pessimistic"
    assert g.verdict(4, None, 20) == "not reached by the workload" and g.verdict(None, None, 3) == "-"


def test_the_report_has_the_gpu_sections_only_for_gpu_runs(tmp_path):
    report = build([gpu_run(tmp_path / "g", 16)])
    titles = [s.title for s in report.sections]
    at = titles.index("The KV boundary")
    assert titles[at + 1:at + 3] == ["Memory per GPU: weights, KV and overhead", "The planner against the real boundary"]
    cpu = build([make_run(tmp_path / "c", "cpu", repeats=1, n_requests=2)])
    assert not any("GPU" in s.title or "planner" in s.title for s in cpu.sections)
    assert isinstance(report.sections[at + 2].table, pd.DataFrame)
