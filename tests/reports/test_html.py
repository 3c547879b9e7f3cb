"""kvbench report: Markdown, PNG plots and one self-contained HTML page, checked in headless Chromium."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.cli import app

from tests.synth import make_run
from tests.helpers import REPO

PUBLISHED = REPO / "results/published/20261129-143003-cpu-default"
PNG = b"\x89PNG\r\n\x1a\n"
# Appended to a copy of the page: once loaded, write what rendered into the DOM for --dump-dom to show.
PROBE = """<script>
window.addEventListener('load', () => {
  const imgs = [...document.images];
  const tables = [...document.querySelectorAll('table')];
  const out = document.createElement('pre');
  out.id = 'probe';
  out.textContent = JSON.stringify({
    images: imgs.length,
    images_rendered: imgs.filter(i => i.complete && i.naturalWidth > 0 && i.getBoundingClientRect().width > 0).length,
    tables: tables.length,
    tables_rendered: tables.filter(t => t.rows.length > 1 && t.getBoundingClientRect().height > 0).length,
    expected_tables: Number(document.querySelector('meta[name=kvbench-tables]').content),
    expected_images: Number(document.querySelector('meta[name=kvbench-images]').content),
  });
  document.body.appendChild(out);
});
</script>"""


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.fail("headless Chromium is missing: `make browser` (part of `make test`) installs Debian's chromium")
    return exe


def rendered(page: Path, tmp_path: Path) -> dict:
    import json

    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text().replace("</body>", PROBE + "\n</body>"))
    done = subprocess.run([chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                           "--disable-dev-shm-usage", "--user-data-dir=" + str(tmp_path / "profile"),
                           "--virtual-time-budget=10000", "--dump-dom", probe.as_uri()],
                          capture_output=True, text=True, timeout=120)
    found = re.search(r'<pre id="probe">(.*?)</pre>', done.stdout)
    assert found, f"no probe in Chromium's DOM dump: {done.stderr[-2000:]}"
    return json.loads(found.group(1))


@pytest.fixture(scope="module")
def published_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    run = out / PUBLISHED.name
    shutil.copytree(PUBLISHED, run, ignore=shutil.ignore_patterns("*.parquet", "plots", "report.*"))
    result = CliRunner().invoke(app, ["report", str(run), "--raw"])
    assert result.exit_code == 0, result.output
    return run


def test_report_of_the_published_run(published_report):
    run = published_report
    md = (run / "report.md").read_text()
    for title in ("## KV cache: predicted from the config vs reported by the engine", "## Latency and throughput",
                  "## The KV boundary", "## Failed and flagged cells", "## The KV model against the engines' own"):
        assert title in md
    assert "| vllm-0.32.0 | 1024 | 1 | bf16 | 23,040 | 23.88 MiB | 25.31 MiB | 1.0598 | 722.81 MiB |" in md
    assert "| hf-5.24.0 | 8128 | 4 | ok | 99.100 |" in md
    # every table can be quoted alone: its caption names the run, hardware, model and engine versions
    captions = [line for line in md.splitlines() if line.startswith("<sub>run `20261129-143003-cpu-default`")]
    assert len(captions) == 4
    assert all("AMD EPYC, 2 cores" in c and "smollm2" in c and "vllm-0.32.0 (0.32.0)" in c for c in captions)
    for png in ("kv_vs_context", "kv_ratio_vs_context", "throughput_ttft_vs_concurrency", "latency_throughput",
                "latency_cdfs", "kv_boundary", "timeline_vllm-0.32.0_p8128_c4"):
        assert (run / "plots" / f"{png}.png").read_bytes()[:8] == PNG
        assert f"(plots/{png}.png)" in md
    # each plot under the table it illustrates, no "Plots" section at the end
    sections = md.split("\n## ")
    kv = next(s for s in sections if s.startswith("KV cache"))
    perf = next(s for s in sections if s.startswith("Latency and throughput"))
    boundary = next(s for s in sections if s.startswith("The KV boundary"))
    assert "plots/kv_ratio_vs_context.png" in kv and "plots/timeline_hf-5.24.0_p8128_c4.png" in kv
    assert "plots/latency_cdfs.png" in perf and "plots/latency_throughput.png" in perf
    assert "plots/kv_boundary.png" in boundary and "## Plots" not in md
    assert kv.index("| backend |") < kv.index("plots/kv_vs_context.png")
    assert (run / "cells.parquet").exists() and (run / "requests.parquet").exists()


def test_html_is_self_contained(published_report):
    page = (published_report / "report.html").read_text()
    assert not re.search(r"https?://", page), "the page must not reference the network"
    srcs = re.findall(r'\b(?:src|href)\s*=\s*"([^"]*)"', page)
    assert srcs and all(s.startswith("data:image/png;base64,") for s in srcs)
    assert "<script" not in page and "@import" not in page and "url(" not in page


def test_html_renders_every_table_and_image_in_headless_chromium(published_report, tmp_path):
    seen = rendered(published_report / "report.html", tmp_path)
    assert seen["tables"] == seen["expected_tables"] == 4  # KV, latency, boundary, validation (no failures)
    assert seen["tables_rendered"] == seen["tables"]
    assert seen["images"] == seen["expected_images"] == 9
    assert seen["images_rendered"] == seen["images"]


def test_report_of_several_runs_with_repeats_and_a_failure(tmp_path):
    a = make_run(tmp_path, "a", backends=[("vllm", "0.31.0")], prompts=(1024,), repeats=2)
    b = make_run(tmp_path, "b", backends=[("vllm", "0.32.0")], prompts=(1024,), repeats=2,
                 failed={("vllm-0.32.0", 1024, 4)})
    out = tmp_path / "out" / "report.md"
    result = CliRunner().invoke(app, ["report", str(a), str(b), "-o", str(out), "--raw"])
    assert result.exit_code == 0, result.output
    md = out.read_text()
    assert "| run | backend | prompt | conc | rep |" in md  # runs told apart, repeats counted
    assert "| a | vllm-0.31.0 | 1024 | 1 | 2 |" in md
    assert "| b | vllm-0.32.0 | 1024 | 4 | 2 | failed | engine failed to start |" in md
    assert "run `a`" in md and "run `b`" in md
    # with -o the run folders are only read: no Parquet copy is written into them
    assert (tmp_path / "out" / "plots" / "kv_vs_context.png").exists() and not (a / "cells.parquet").exists()
    seen = rendered(out.with_suffix(".html"), tmp_path)
    assert seen["tables_rendered"] == seen["expected_tables"] == 4  # KV, latency, boundary, failures
    assert seen["images_rendered"] == seen["expected_images"] > 0


def test_not_a_run_folder_is_a_usage_error(tmp_path):
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "not a kvbench run folder" in result.output


def test_one_colour_per_engine_and_no_boundary_panel_from_one_point(tmp_path):
    import pandas as pd

    from kvbench.reports import plots

    colours = plots.palette(["vllm-0.32.0", "hf-5.24.0", "vllm-0.32.0"])
    assert colours == {"hf-5.24.0": "tab:blue", "vllm-0.32.0": "tab:orange"}
    assert plots.color("vllm-0.32.0") == "tab:orange" and plots.color("llamacpp-0.3.36") == "tab:green"
    one = pd.DataFrame([dict(label="vllm", kv_pool_tokens_engine=4096.0, concurrency=2, prompt_tokens=1024,
                             output_tokens=16, requests_running_peak=2.0, requests_waiting_peak=0.0,
                             kv_pool_sequences_predicted=4)])
    assert plots.kv_boundary(one, tmp_path / "b.png") is None  # a single point shows no boundary
    two = pd.concat([one, one.assign(concurrency=8, requests_running_peak=4.0, requests_waiting_peak=4.0)])
    assert plots.kv_boundary(two, tmp_path / "b.png") == tmp_path / "b.png"


def test_compare_html_renders_its_forest_plot_and_table_in_headless_chromium(tmp_path):
    base = make_run(tmp_path, "a", backends=[("vllm", "0.31.0")], prompts=(1024,), repeats=3, seed=1)
    cand = make_run(tmp_path, "b", backends=[("vllm", "0.32.0")], prompts=(1024,), repeats=3, seed=2,
                    scale={"vllm-0.32.0": {"latency": 1.2}})
    result = CliRunner().invoke(app, ["compare", str(base), str(cand), "-o", str(tmp_path / "cmp")])
    assert result.exit_code == 1, result.output
    page = tmp_path / "cmp" / "compare.html"
    assert not re.search(r"https?://", page.read_text()) and "<script" not in page.read_text()
    seen = rendered(page, tmp_path)
    assert seen["images_rendered"] == seen["expected_images"] == 1
    assert seen["tables_rendered"] == seen["expected_tables"] == 1
