"""Regenerate every published run's outputs and print their digests, to show a change leaves them as they were.

    python -m kvbench.selfcheck.regenerate_published OUT_DIR > manifest.txt

Each run under results/published/ and results/gpu/ that has a ``requests.jsonl`` is copied to OUT_DIR without
its derived files (Parquet, reports, plots, comparisons, Benchmark Reports), then ``kvbench report`` writes its
Markdown, HTML, PNG plots, Parquet and (``--format br``) its llm-d Benchmark Reports again and, where the run
was published with a comparison, ``kvbench compare`` writes that again with the command recorded in
results/published/README.md. The manifest is one line per file:
sha256 and path. Run it at two commits in the same environment, into the same OUT_DIR (emptied between: the
comparison names its run folders' paths), and diff the manifests; the PNG files carry matplotlib's version, so
manifests from different environments differ for that reason alone.
"""
from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "results"
DERIVED = ("cells.parquet", "requests.parquet", "report.md", "report.html", "plots", "compare.md", "compare.json",
           "compare.html", "compare_forest.png", "benchmark_report_v0.2,_*.yaml")
# The comparisons published with their runs: folder -> kvbench compare's arguments after the run folder.
COMPARISONS = {"20261129-vllm-upgrade-cpu": ["--baseline-backend", "vllm-0.31.0", "--candidate-backend", "vllm-0.32.0"]}


def published_runs() -> list[Path]:
    return sorted(p.parent for folder in ("published", "gpu") for p in (RESULTS / folder).glob("*/requests.jsonl"))


def regenerate(run: Path, out_dir: Path) -> Path:
    copy = out_dir / run.name
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns(*DERIVED))
    kvbench = [sys.executable, "-m", "kvbench.cli"]
    subprocess.run([*kvbench, "report", str(copy), "--raw"], check=True, stdout=subprocess.DEVNULL)
    # the llm-d Benchmark Reports beside the report, one per cell
    subprocess.run([*kvbench, "report", str(copy), "--format", "br"], check=True, stdout=subprocess.DEVNULL)
    if run.name in COMPARISONS:
        # every verdict writes its outputs: 0 unchanged, 1 regression, 3 inconclusive, 4 improvement
        done = subprocess.run([*kvbench, "compare", str(copy), *COMPARISONS[run.name], "-o", str(copy)],
                              stdout=subprocess.DEVNULL)
        if done.returncode not in (0, 1, 3, 4):
            raise SystemExit(f"kvbench compare {copy} exited {done.returncode}")
    return copy


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    out_dir = Path(args[0])
    if out_dir.exists() and any(out_dir.iterdir()):
        print(f"error: {out_dir} is not empty", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    for run in published_runs():
        print(f"regenerating {run.relative_to(REPO)}", file=sys.stderr)
        regenerate(run, out_dir)
    for path in sorted(p for p in out_dir.rglob("*") if p.is_file()):
        print(hashlib.sha256(path.read_bytes()).hexdigest(), path.relative_to(out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
