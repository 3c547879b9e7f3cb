"""The report's decode-bound section and plot (bench/reports/bandwidth.py) from synthetic rows: every figure here
is made up for the test."""
import json

from kvbench.reports import bandwidth, build
from kvbench.reports.tables import aggregate
from kvbench.store.readers import load

from tests.synth import make_run

MIB = 2**20


def bound_run(tmp_path, with_bound=True):
    run = make_run(tmp_path, "bw", backends=(("llamacpp", "0.3.36"),), prompts=(1024, 4096), concurrency=(1, 4),
                   repeats=1, n_requests=2)
    rows = [json.loads(line) for line in (run / "cells.jsonl").read_text().splitlines()]
    for r in rows:
        if with_bound:
            kv = r["concurrency"] * r["prompt_tokens"] * 23040.0
            step = 256 * MIB + kv
            r.update(decode_step_bytes=step, decode_kv_share=kv / step, itl_s_bound=step / 30e9, itl_s_p50=0.02,
                     decode_efficiency=step / 30e9 / 0.02, decode_bound_source="weights ...")
        else:
            r.update(decode_bound_source="not measured: the probe was switched off (KVBENCH_BANDWIDTH_PROBE=off)")
    (run / "cells.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_each_cell_shows_its_bytes_bound_and_efficiency(tmp_path):
    agg = aggregate(load(bound_run(tmp_path)))
    table = bandwidth.bound_table(agg)
    [row] = [r for _, r in table.iterrows() if (str(r["prompt"]), str(r["conc"])) == ("4096", "4")]
    kv = 4 * 4096 * 23040
    assert row["weights MiB"] == "256.0" and row["KV read MiB"] == f"{kv / MIB:,.1f}"
    assert row["ITL bound ms"] == f"{(256 * MIB + kv) / 30e9 * 1000:,.2f}" and row["ITL p50 ms"] == "20.00"
    assert row["efficiency"] == f"{(256 * MIB + kv) / 30e9 / 0.02:.0%}"
    assert row["KV share"] == f"{kv / (256 * MIB + kv):.1%}"


def test_the_report_has_the_section_and_the_plot_with_the_bound(tmp_path):
    report = build([bound_run(tmp_path)], tmp_path / "plots")
    [section] = [s for s in report.sections if s.id == bandwidth.SECTION]
    assert section.table is not None and len(section.table) == 4
    ids = [s.id for s in report.sections]
    assert ids.index(bandwidth.SECTION) == ids.index("performance") + 1
    [figure] = [f for f in report.figures if f.section == bandwidth.SECTION]
    assert figure.path.stat().st_size > 10_000


def test_a_run_without_a_bound_says_why_and_draws_nothing(tmp_path):
    report = build([bound_run(tmp_path, with_bound=False)], tmp_path / "plots")
    [section] = [s for s in report.sections if s.id == bandwidth.SECTION]
    assert section.table is None and "switched off" in section.note
    assert not [f for f in report.figures if f.section == bandwidth.SECTION]
