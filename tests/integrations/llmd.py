"""What the llm-d-benchmark harness tests share: the integration's files, its templates rendered as
llm-d-benchmark's run step renders them, experiment overrides applied as its treatments apply them, and the
environment its harness pod gives the harness script (all read from llm-d-benchmark's source; written here)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

from tests.helpers import REPO

INTEGRATION = REPO / "integrations" / "llm-d-benchmark"
HARNESS_SCRIPT = INTEGRATION / "workload" / "harnesses" / "kvbench-llm-d-benchmark.sh"
ANALYZER_SCRIPT = INTEGRATION / "llmdbenchmark" / "analysis" / "scripts" / "kvbench-analyze_results.sh"
PROFILES = INTEGRATION / "workload" / "profiles" / "kvbench"
TEMPLATES = sorted(PROFILES.glob("*.yaml.in"))
EXPERIMENT_ID = "kvbench-1786000000-k7b2x9"  # <harness>-<unix time>-<random>, as llm-d-benchmark makes them
POD_UID = "0c6f1a8e-4f7e-4c9b-9d55-1a2b3c4d5e6f"


def render(template: str, values: dict[str, str]) -> str:
    """A ``.yaml.in`` profile as llm-d-benchmark renders it: each ``REPLACE_ENV_<KEY>`` whose key has a
    non-empty value becomes the value, any other token stays as it is (plain text substitution, no Jinja)."""
    return re.sub(r"REPLACE_ENV_(\w+)", lambda m: values.get(m.group(1)) or m.group(0), template)


def override(profile_text: str, overrides: dict) -> str:
    """A treatment's ``dotted.key: value`` overrides set in a rendered profile, as llm-d-benchmark applies them:
    each path walks mappings by key and lists by index; the last part is set (a new key where a mapping lacks
    it); then the YAML is written again."""
    data = yaml.safe_load(profile_text)
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = data
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[int(leaf) if isinstance(node, list) else leaf] = value
    return yaml.dump(data, default_flow_style=False, sort_keys=False)


def workspace_with(tmp: Path, template: str, values: dict[str, str], overrides: dict | None = None,
                   name: str | None = None) -> tuple[Path, str]:
    """A harness pod's /workspace: the rendered profile in profiles/kvbench/; returns it and the profile's name
    (the template's without .in, as llm-d-benchmark passes it)."""
    text = render((PROFILES / template).read_text(), values)
    if overrides:
        text = override(text, overrides)
    name = name or template.removesuffix(".in")
    folder = tmp / "workspace" / "profiles" / "kvbench"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(text)
    return tmp / "workspace", name


def pod_environment(results: Path, workspace: Path, workload: str, **extra: str) -> dict[str, str]:
    """The environment llm-d-benchmark's harness pod gives the script (its pod template and run step), with this
    test's Python as the harness image's kvbench."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMDBENCH_")}
    env.update({
        "TZ": "UTC", "LLMDBENCH_RUN_EXPERIMENT_LAUNCHER": "1", "LLMDBENCH_MAGIC_ENVAR": "harness_pod",
        "LLMDBENCH_RUN_WORKSPACE_DIR": str(workspace), "LLMDBENCH_CONTROL_WORK_DIR": str(results),
        "LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR": str(results), "LLMDBENCH_RUN_EXPERIMENT_HARNESS_WORKLOAD_NAME": workload,
        "LLMDBENCH_RUN_EXPERIMENT_HARNESS": "kvbench-llm-d-benchmark.sh",
        "LLMDBENCH_RUN_EXPERIMENT_ANALYZER": "kvbench-analyze_results.sh",
        "LLMDBENCH_HARNESS_NAME": "kvbench", "LLMDBENCH_HARNESS_STACK_TYPE": "vllm-prod",
        "LLMDBENCH_HARNESS_STACK_NAME": "smollm2", "LLMDBENCH_DEPLOY_METHODS": "standalone",
        "LLMDBENCH_RUN_EXPERIMENT_ID": EXPERIMENT_ID, "POD_UID": POD_UID, "POD_NAME": "kvbench-abcdefgh",
        "LLMDBENCH_DESCRIPTION_TEXT": "kvbench on the embedded model", "LLMDBENCH_DESCRIPTION_KEYWORDS": "kvbench,ci",
        "LLMDBENCH_VLLM_COMMON_NAMESPACE": "llmdbench", "LLMDBENCH_RUN_EXPERIMENT_RESULTS_DIR_PREFIX": str(results.parent),
        "KVBENCH_PYTHON": sys.executable,
    })
    env.update(extra)
    return env


def run_script(script: Path, env: dict[str, str], timeout: float = 600, **popen) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=timeout, **popen)


def metadata(results: Path) -> dict:
    return yaml.safe_load((results / "run_metadata.yaml").read_text())


def report_files(results: Path) -> list[Path]:
    """The files llm-d-benchmark's analysis finds: benchmark_report_v0.2,_*.yaml at the top of the folder."""
    return sorted(results.glob("benchmark_report_v0.2,_*.yaml"))
