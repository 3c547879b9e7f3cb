"""docs/development.md's "Where to change what", checked: for a load profile, a report table, a results column,
a run option and an engine, a copy of the product gets each change in exactly the files the doc names (the
five touch disjoint files, so one copy holds them all), and runs from that copy, not installed
(selfcheck/uninstalled.py), against a fake OpenAI server on 127.0.0.1: one run on the planted engine with the
planted load profile, option and column. Each test asserts its change shows where the doc promises; the last
runs tests/test_structure.py's checks on the copy, and on one with an upward import, which they must catch.

The doc's lines in docs/ (results-schema.md, metrics.md) are not planted: docs/ is not part of the product.
A planted change that needs a file the doc does not name fails here (its edit finds nothing to change, or
the run does not show it): then the doc or the extension point is wrong.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest

from tests.fakes.openai_server import FakeOpenAI
from tests.helpers import REPO

PRODUCT = ("bench", "backends", "workloads", "selfcheck", "pyproject.toml")  # what pyproject.toml installs
WORKLOAD = """name = "tiny"
seed = 3
prompt_tokens = [32]
output_tokens = 4
warmup_requests = 0

[load]
"""


@pytest.fixture(scope="module")
def server():
    with FakeOpenAI() as fake:
        yield fake


def product_copy(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    for name in PRODUCT:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(source, tree / name)
    return tree


def edit(tree: Path, path: str, old: str, new: str) -> None:
    """Replace the one ``old`` in ``tree/path``: a file whose text moved fails here, not as a puzzling run."""
    file = tree / path
    text = file.read_text()
    assert text.count(old) == 1, f"{path}: {old!r} found {text.count(old)} times"
    file.write_text(text.replace(old, new))


def write(tree: Path, path: str, text: str) -> None:
    (tree / path).parent.mkdir(parents=True, exist_ok=True)
    (tree / path).write_text(text)


def kvbench(tree: Path, *args, cwd: Path) -> subprocess.CompletedProcess:
    """``kvbench ARGS`` run from ``tree`` as it is, not installed."""
    return subprocess.run([sys.executable, str(tree / "selfcheck" / "uninstalled.py"), "kvbench.cli", *map(str, args)],
                          capture_output=True, text=True, timeout=180, cwd=cwd,
                          env={**os.environ, "COLUMNS": "200", "HF_HUB_OFFLINE": "1"})


def run(tree: Path, tmp_path: Path, load: str, *args) -> Path:
    """A run of the tiny workload with ``load`` as its [load] section (``-b`` given in ``args``); its folder."""
    (tmp_path / "tiny.toml").write_text(WORKLOAD + load)
    done = kvbench(tree, "run", "--workload", tmp_path / "tiny.toml", "--results-dir", tmp_path / "runs",
                   "--run-id", "r", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return tmp_path / "runs" / "r"


def cells(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "cells.jsonl").read_text().splitlines()]


# --- the five changes, each as the doc says it --------------------------------------------------------------

BURST = '''"""Bursts: ``burst_size`` requests sent at once, a burst every 1/``bursts_per_s`` seconds, at most one
burst's requests in flight."""
from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
from pydantic import Field

from .common import LoadResult, LoadSettings
from .open_loop import send_on_schedule
from .profile import LoadPoint, LoadProfile


class Burst(LoadProfile):
    summary: ClassVar[str] = "open loop: requests sent in bursts"

    profile: Literal["burst"] = "burst"
    burst_sizes: list[int] = Field(min_length=1)  # requests per burst, one point each
    bursts_per_s: float = Field(gt=0)

    def points(self) -> list[LoadPoint]:
        return [LoadPoint(self.name, size, self.bursts_per_s * size) for size in self.burst_sizes]

    def max_in_flight(self) -> int:
        return max(self.burst_sizes)

    def requests_per_cell(self, point: LoadPoint) -> int:
        return self.requests or point.concurrency

    @classmethod
    def from_flat(cls, flat: dict) -> dict | None:
        if flat.get("load_profile") != cls.name:
            return None
        return {"profile": cls.name, "burst_sizes": flat["concurrency"], "bursts_per_s": flat["request_rates"][0],
                **{k: flat[k] for k in ("requests", "duration_s") if k in flat}}

    def flat(self) -> dict:
        return {"load_profile": self.name, "concurrency": list(self.burst_sizes), "request_rates": [self.bursts_per_s],
                "requests": self.requests, "duration_s": self.duration_s}

    @classmethod
    def check_point(cls, point: LoadPoint) -> None:
        if not (point.concurrency and point.request_rate):
            raise ValueError("a burst load needs a burst size and a request rate")

    @classmethod
    def slug(cls, point: LoadPoint) -> str:
        return f"burst{point.concurrency}-r{point.request_rate:g}".replace(".", "_")

    @classmethod
    def label(cls, concurrency: int | None, request_rate: float | None) -> str:
        if request_rate is None:
            return f"x{concurrency}"
        return f"bursts of {int(concurrency)}, {request_rate / concurrency:g}/s"

    @classmethod
    def arrival_offsets(cls, n: int, point: LoadPoint) -> np.ndarray:
        size = point.concurrency
        return (np.arange(n) // size) * size / point.request_rate

    @classmethod
    async def run(cls, backend, prompts: list, point: LoadPoint, settings: LoadSettings) -> LoadResult:
        return await send_on_schedule(backend, prompts, cls.arrival_offsets(len(prompts), point), point, settings)
'''


def plant_load_profile(tree: Path) -> None:
    write(tree, "bench/load/burst.py", BURST)
    edit(tree, "bench/load/registry.py", "from .sweep import Sweep  # noqa: F401\n",
         "from .sweep import Sweep  # noqa: F401\nfrom .burst import Burst  # noqa: F401\n")


REQUESTS_TABLE = '''

def requests_table(agg: pd.DataFrame) -> pd.DataFrame:
    """Each cell's requests: sent, and those that met the token contract."""
    out = _lead(agg)
    out["requests sent"] = agg.n_requests.map(fmt_int)
    out["requests ok"] = agg.n_ok.map(fmt_int)
    return out


REQUESTS_RIGHT = LEAD_RIGHT | {"requests sent", "requests ok"}
'''


def plant_report_table(tree: Path) -> None:
    (tree / "bench/reports/tables.py").write_text((tree / "bench/reports/tables.py").read_text() + REQUESTS_TABLE)
    edit(tree, "bench/reports/__init__.py", '        Section("boundary", ',
         '        Section("requests", "Requests per cell", "What each cell sent, and what met the token contract.",\n'
         '                tables.requests_table(agg), tables.REQUESTS_RIGHT, cap),\n'
         '        Section("boundary", ')


def plant_results_column(tree: Path) -> None:
    edit(tree, "bench/common/metrics.py", '    out.update(percentiles([r.ttft for r in requests], "ttft_s"))\n',
         '    out.update(percentiles([r.ttft for r in requests], "ttft_s"))\n'
         '    out["ttft_s_max"] = max((r.ttft for r in requests if r.ttft is not None), default=None)\n')
    edit(tree, "bench/store/schema.py", "SCHEMA_VERSION = 12\n", "SCHEMA_VERSION = 13\n")
    edit(tree, "bench/store/schema.py", "    ttft_s_p99: float | None = None\n",
         "    ttft_s_p99: float | None = None\n    ttft_s_max: float | None = None\n")
    edit(tree, "bench/store/schema.py", "    None (not read: earlier runs did not ask the engine).\n",
         "    None (not read: earlier runs did not ask the engine).\n"
         '    v12 -> v13: ``ttft_s_max`` None (not measured).\n')


def plant_run_option(tree: Path) -> None:
    edit(tree, "bench/run/options.py", "    # set in code only\n",
         '    note: str | None = option(Flag("note", str, None, "A line kept in run.json: why this run was made."),\n'
         '                              record="note")\n'
         "    # set in code only\n")


ADAPTER = '''"""Attach only: an OpenAI-style /v1/completions stream, the model its first of /v1/models."""
from __future__ import annotations

from kvbench.common.envs import Recipe

from ..base import Backend
from ..shared.openai_chunks import read_completion_chunk
from ..streaming import stream_sse
from ..types import EngineStartError, KVInUse, KVPool, RequestResult, ServerSpec

NEEDS_URL = "this engine only attaches: give it a url (-b ENGINE:url=http://host:port)"


class PlantedBackend(Backend):
    engine = "planted"
    default_version = "1"
    attach_only = NEEDS_URL
    health_path = "/v1/models"

    @classmethod
    def recipe(cls, version: str) -> Recipe:
        return Recipe(cls.engine, version, (), venv=False)  # nothing to install

    def command(self, spec: ServerSpec):
        raise EngineStartError(NEEDS_URL)

    async def stream(self, client, prompt) -> RequestResult:
        model = self.http.get(self.base_url + "/v1/models").json()["data"][0]["id"]
        n = prompt.output_tokens
        body = {"model": model, "prompt": list(prompt.token_ids), "max_tokens": n, "min_tokens": n,
                "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        return await stream_sse(client, self.base_url + "/v1/completions", body, prompt,
                                lambda event, now, result: read_completion_chunk(event, now, result))

    def kv_pool(self) -> KVPool | None:
        return None

    def kv_in_use(self, client) -> KVInUse | None:
        return None
'''


def plant_engine(tree: Path) -> None:
    write(tree, "backends/planted/__init__.py", '"""An engine planted by tests/test_extension_paths.py."""\n')
    write(tree, "backends/planted/adapter.py", ADAPTER)
    edit(tree, "backends/__init__.py", '    "openai": ("OpenAIBackend", None),\n',
         '    "openai": ("OpenAIBackend", None),\n    "planted": ("PlantedBackend", None),\n')
    edit(tree, "pyproject.toml", '"kvbench.backends.shared",', '"kvbench.backends.shared", "kvbench.backends.planted",')


# --- the five planted in one copy, and one run that shows four of them --------------------------------------

PLANTS = (plant_load_profile, plant_report_table, plant_results_column, plant_run_option, plant_engine)
BURSTS = 'profile = "burst"\nburst_sizes = [3]\nbursts_per_s = 20\nrequests = 6\n'


@pytest.fixture(scope="module")
def planted(tmp_path_factory) -> Path:
    """A copy of the product with the five changes planted (they touch disjoint files: each one's edit finds
    its text as the doc describes it, or fails here)."""
    tree = product_copy(tmp_path_factory.mktemp("planted"))
    for plant in PLANTS:
        plant(tree)
    return tree


@pytest.fixture(scope="module")
def planted_run(planted, server, tmp_path_factory) -> Path:
    """One run from the planted copy: the planted engine, the burst profile, the new option, the new column."""
    return run(planted, tmp_path_factory.mktemp("run"), BURSTS, "-b", f"planted:url={server.url}", "--note", "planted")


def test_a_load_profile_is_its_module_and_one_registry_line(planted_run):
    [cell] = cells(planted_run)
    assert (cell["load_profile"], cell["concurrency"], cell["request_rate"], cell["n_ok"]) == ("burst", 3, 60.0, 6)
    requests = [json.loads(line) for line in (planted_run / "requests.jsonl").read_text().splitlines()]
    due = sorted(r["t_scheduled"] for r in requests if r["cell_id"] == cell["cell_id"] and not r["warmup"])
    assert len(due) == 6 and due[0] == due[2] and due[3] == due[5]  # two bursts of three, sent at once
    assert due[3] - due[0] == pytest.approx(1 / 20)
    info = json.loads((planted_run / "run.json").read_text())
    assert (info["workload"]["load_profile"], info["workload"]["concurrency"]) == ("burst", [3])  # the flat record
    assert "bursts of 3, 20/s" in (planted_run / "report.md").read_text()


def test_a_report_table_is_a_function_and_a_section(planted, tmp_path):
    published = REPO / "results" / "published" / "20261129-143003-cpu-default"  # read only: -o writes elsewhere
    done = kvbench(planted, "report", published, "--no-plots", "-o", tmp_path / "report.md", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    section = (tmp_path / "report.md").read_text().split("## Requests per cell", 1)[1].split("\n## ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("|")]
    assert "requests sent" in table[0] and "requests ok" in table[0]
    assert len(table) == 2 + len(cells(published))  # header, rule, a row per cell
    assert "Requests per cell" in (tmp_path / "report.html").read_text()


def test_a_results_column_is_a_metric_key_a_field_and_a_schema_version(planted_run):
    [cell] = cells(planted_run)
    requests = [json.loads(line) for line in (planted_run / "requests.jsonl").read_text().splitlines()]
    ttfts = [r["ttft_s"] for r in requests if r["cell_id"] == cell["cell_id"] and not r["warmup"]]
    assert cell["schema_version"] == 13 and cell["ttft_s_max"] == pytest.approx(max(ttfts))
    parquet = pq.read_table(planted_run / "cells.parquet")
    assert parquet.schema.metadata[b"kvbench_schema_version"] == b"13"
    assert pd.Series(parquet.column("ttft_s_max").to_pylist()).tolist() == [cell["ttft_s_max"]]


def test_a_run_option_is_one_field(planted, planted_run, tmp_path):
    helped = kvbench(planted, "run", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and "--note" in helped.stdout
    assert "A line kept in run.json: why this run was made." in " ".join(helped.stdout.split())
    assert json.loads((planted_run / "run.json").read_text())["note"] == "planted"


def test_an_engine_is_its_folder_and_one_registry_line(planted, planted_run, tmp_path):
    listed = kvbench(planted, "backends", cwd=tmp_path)
    assert listed.returncode == 0 and "planted" in listed.stdout, listed.stdout + listed.stderr
    [cell] = cells(planted_run)
    assert (cell["engine"], cell["status"], cell["n_ok"]) == ("planted", "ok", 6)


STRUCTURE_CHECKS = ("not would_be_found and not editable_install and not starts_an_engine "
                    "and not importing_the_planner")  # those read the checkout or plant their own input


def structure(tree: Path, checks: str) -> subprocess.CompletedProcess:
    """tests/test_structure.py's ``checks`` (a -k expression) of the product tree, on ``tree`` under its own
    kvbench (no conftest, no plugins: they read nothing of the tree, and cost a second)."""
    return subprocess.run([sys.executable, str(tree / "selfcheck" / "uninstalled.py"), "pytest", "-q", "-vv",
                           "--noconftest", "-p", "no:cacheprovider", "-o", "addopts=", str(REPO / "tests" / "test_structure.py"),
                           "-k", checks], capture_output=True, text=True, timeout=180, cwd=REPO,
                          env={**os.environ, "KVBENCH_TREE": str(tree), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})


def test_the_five_changes_keep_the_structure_and_a_broken_layer_is_caught(planted, tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(planted, tree)  # the upward import below is planted in a copy of its own
    kept = structure(tree, STRUCTURE_CHECKS)
    assert kept.returncode == 0 and " 17 passed" in kept.stdout, kept.stdout[-3000:]
    # and the checks read the copy: an upward import planted there fails them
    edit(tree, "bench/load/burst.py", "from .common import", "from kvbench.run.cells import RunPlan\nfrom .common import")
    broken = structure(tree, "layers_import_only_downwards")
    assert broken.returncode == 1 and "'kvbench.load.burst -> kvbench.run.cells'" in broken.stdout
