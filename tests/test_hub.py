"""Hub ids for `kvbench plan` and `kvbench run`, through huggingface_hub: against a fake hub on 127.0.0.1
(tests/fakes/hub_server.py) and a folder laid out like the hub cache. Nothing here reaches a real hub.
Each case runs the CLI in a process of its own, since huggingface_hub reads HF_ENDPOINT, HF_HUB_CACHE and
HF_HUB_OFFLINE when it is imported, as it does for a user."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .fakes.hub_server import COMMIT, FakeHub

ROOT = Path(__file__).resolve().parent.parent
CORPUS = Path(__file__).parent / "data" / "configs"
TOKEN = "hf_kvbench_test_token_never_written"
CONFIG = (CORPUS / "qwen3-30b-a3b.json").read_bytes()
INDEX = json.dumps({"metadata": {"total_size": 61_064_245_248}, "weight_map": {}}).encode()


@pytest.fixture
def hub():
    fake = FakeHub({"Qwen/Qwen3-30B-A3B": {"config.json": CONFIG, "model.safetensors.index.json": INDEX},
                    "org/single-file": {"config.json": (CORPUS / "llama-3.2-1b.json").read_bytes()},
                    "meta-llama/Llama-3.1-8B-Instruct": {"config.json": (CORPUS / "llama-3.1-8b.json").read_bytes()}},
                   gated={"meta-llama/Llama-3.1-8B-Instruct"})
    yield fake
    fake.close()


def kvbench(args, cache: Path, endpoint: str = "http://127.0.0.1:9", offline: bool = False):
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1" if offline else "0",
           "HF_TOKEN": TOKEN, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1", "HF_HUB_ETAG_TIMEOUT": "5",
           "HF_HUB_DOWNLOAD_TIMEOUT": "5"}
    return subprocess.run([sys.executable, "-m", "kvbench.cli", *args], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


def test_plan_downloads_the_config_and_index_only(hub, tmp_path):
    out = kvbench(["plan", "Qwen/Qwen3-30B-A3B", "--context", "32768", "--json"], tmp_path / "cache", hub.url)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan["model"] == "Qwen/Qwen3-30B-A3B" and plan["kv_bytes"] == 32768 * 2 * 48 * 4 * 128 * 2
    # the exact bytes from the index, no weights downloaded
    assert plan["weights_bytes"] == 61_064_245_248 and plan["weights_source"].startswith("model.safetensors.index")
    assert all("safetensors\"" not in r and not r.endswith(".safetensors") for r in hub.requests)
    assert TOKEN not in out.stdout + out.stderr
    # and then offline, from the cache
    again = kvbench(["plan", "Qwen/Qwen3-30B-A3B", "--context", "32768", "--json"], tmp_path / "cache", offline=True)
    assert again.returncode == 0 and json.loads(again.stdout)["kv_bytes"] == plan["kv_bytes"]


def test_a_single_file_checkpoint_is_estimated_from_its_config(hub, tmp_path):
    out = kvbench(["plan", "org/single-file", "--context", "4096", "--json"], tmp_path / "cache", hub.url)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["weights_source"].startswith("estimate:")


@pytest.mark.parametrize("repo, message", [
    ("meta-llama/Llama-3.1-8B-Instruct", "is gated: accept its licence on the hub with your account, then set HF_TOKEN"),
    ("nobody/no-such-model", "no model nobody/no-such-model on the hub (or it is private: set HF_TOKEN)"),
])
def test_gated_and_missing_repositories_say_what_to_do(hub, tmp_path, repo, message):
    out = kvbench(["plan", repo, "--context", "100"], tmp_path / "cache", hub.url)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert TOKEN not in out.stdout + out.stderr


def test_offline_and_not_cached(tmp_path):
    out = kvbench(["plan", "Qwen/Qwen3-30B-A3B", "--context", "100"], tmp_path / "cache", offline=True)
    assert out.returncode == 2 and "is not in the local hub cache" in out.stderr and "HF_HUB_OFFLINE is set" in out.stderr
    assert "hf download Qwen/Qwen3-30B-A3B" in out.stderr


def test_unreachable_hub(tmp_path):
    out = kvbench(["plan", "Qwen/Qwen3-30B-A3B", "--context", "100"], tmp_path / "cache", "http://127.0.0.1:9")
    assert out.returncode == 2 and "could not be reached" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_a_cache_laid_out_by_hand(tmp_path):
    """The hub cache's own layout (models--org--name/refs/main + snapshots/<commit>/), no server at all."""
    repo = tmp_path / "cache" / "models--google--gemma-3-4b-it"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_bytes((CORPUS / "gemma-3-4b-it.json").read_bytes())
    out = kvbench(["plan", "google/gemma-3-4b-it", "--context", "8192", "--engine", "vllm", "--json"],
                  tmp_path / "cache", offline=True)
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert (plan["kv_heads"], plan["head_dim_k"], plan["sliding_layers"]) == (4, 256, 29)


def test_run_resolves_a_hub_id_to_the_whole_model(hub, tmp_path):
    hub.repos["org/tiny"] = {"config.json": (CORPUS / "smollm2-135m-instruct.json").read_bytes(),
                             "tokenizer.json": b"{}", "model.safetensors": b"\0" * 16, "README.md": b"not fetched"}
    code = ("from kvbench import models; m = models.resolve('org/tiny', None); "
            "print(m.name, sorted(p.name for p in m.hf_dir.iterdir()), m.geometry.num_layers)")
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_XET": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "org/tiny" and "'model.safetensors'" in out.stdout and "README" not in out.stdout
