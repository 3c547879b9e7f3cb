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

from tests.fakes.hub_server import COMMIT, FakeHub
from tests.helpers import REPO, DATA

ROOT = REPO  # the repository
CORPUS = DATA / "configs"
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
    code = ("from kvbench.common import models; m = models.resolve('org/tiny', None); "
            "print(m.name, sorted(p.name for p in m.hf_dir.iterdir()), m.geometry.num_layers)")
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_XET": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "org/tiny" and "'model.safetensors'" in out.stdout and "README" not in out.stdout


def test_a_run_against_attached_servers_downloads_no_weights(hub, tmp_path):
    """Every engine attached (a server already serving the model, as in an llm-d-benchmark harness pod): the
    hub id's config, index and tokenizer are downloaded, its safetensors are not; an engine kvbench starts
    needs them, and then they come too."""
    from kvbench.run.backend_config import BackendConfig
    from kvbench.run.options import RunOptions
    from kvbench.workloads import load

    hub.repos["org/tiny"] = {"config.json": (CORPUS / "smollm2-135m-instruct.json").read_bytes(),
                             "tokenizer.json": b"{}", "model.safetensors.index.json": INDEX,
                             "model-00001-of-00001.safetensors": b"\0" * 16}
    code = ("import sys; from kvbench.common import models; "
            "print(sorted(p.name for p in models.locate('org/tiny', weights=sys.argv[1] == 'weights').iterdir()))")
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_XET": "1"}
    attached = subprocess.run([sys.executable, "-c", code, "attached"], capture_output=True, text=True, env=env,
                              cwd=ROOT, timeout=120)
    assert attached.returncode == 0, attached.stderr
    assert attached.stdout.strip() == "['config.json', 'model.safetensors.index.json', 'tokenizer.json']"
    assert not any(r.endswith(".safetensors") for r in hub.requests)
    started = subprocess.run([sys.executable, "-c", code, "weights"], capture_output=True, text=True, env=env,
                             cwd=ROOT, timeout=120)
    assert started.returncode == 0 and "'model-00001-of-00001.safetensors'" in started.stdout, started.stderr
    # which a run asks for: weights unless every engine is attached
    smoke, attach = load("smoke"), BackendConfig.parse("vllm:url=http://127.0.0.1:9")
    assert not RunOptions(workload=smoke, backends=[attach]).needs_weights
    assert RunOptions(workload=smoke, backends=[attach, BackendConfig.parse("hf")]).needs_weights


# --- issue 15 item 1: a hub model on every engine, the GPU default -------------------------------------

# Qwen/Qwen2.5-7B-Instruct's config.json (the architecture fields; the Instruct model's context is 32K)
QWEN25_7B_INSTRUCT = json.dumps({
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
    "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "max_position_embeddings": 32768,
    "max_window_layers": 28, "sliding_window": 131072, "use_sliding_window": False, "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06, "vocab_size": 152064, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "hidden_act": "silu", "bos_token_id": 151643, "eos_token_id": 151645})

def test_llamacpp_makes_the_gguf_of_a_hub_model_once_with_llamas_converter(tmp_path, monkeypatch):
    """An HF folder (what a hub id resolves to) has no GGUF: llama.cpp's adapter converts it once with
    llama.cpp's own converter (gguf_from_hf, stubbed here), caches it by the folder's hash, and serves it;
    -b llamacpp:gguf=FILE serves the user's file instead."""
    from kvbench.backends.llamacpp.adapter import LlamaCppBackend
    from kvbench.backends.types import ServerSpec
    from kvbench.common.models import ModelFiles
    from kvbench.kv.model_config import geometry_from_hf

    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path / "home"))
    # the interpreter with transformers comes from the registry (the hf environment): not installed here
    monkeypatch.setattr("kvbench.backends.hf_tools_python", lambda log=print: tmp_path / "hf-env" / "bin" / "python")
    calls = []

    def convert(cls, python, pairs, log=print, version=None, outtype="f16"):
        calls.append((str(python), [(str(a), str(b)) for a, b in pairs], outtype))
        for _, out in pairs:
            Path(out).write_bytes(b"GGUF")
        return ["ok"] * len(pairs)

    monkeypatch.setattr(LlamaCppBackend, "gguf_from_hf", classmethod(convert))
    folder = tmp_path / "snapshot"
    folder.mkdir()
    (folder / "config.json").write_text(QWEN25_7B_INSTRUCT)
    model = ModelFiles("Qwen/Qwen2.5-7B-Instruct", folder, None, "ab" * 32, geometry_from_hf(folder))
    spec = ServerSpec(model=model, max_context=1024, max_concurrency=1, kv_dtype="auto", port=8000)
    backend = LlamaCppBackend("0.3.36", tmp_path / "llama-env", {})
    argv, _ = backend.command(spec)
    gguf = tmp_path / "home" / "models" / ("ab" * 8) / "Qwen2.5-7B-Instruct.gguf"
    assert argv[argv.index("-m") + 1] == str(gguf) and gguf.read_bytes() == b"GGUF"
    assert calls == [(str(tmp_path / "hf-env" / "bin" / "python"), [(str(folder), str(gguf) + ".partial")], "auto")]
    backend.command(spec)
    assert len(calls) == 1  # cached: converted once
    mine = tmp_path / "mine.gguf"
    argv, _ = LlamaCppBackend("0.3.36", tmp_path / "llama-env", {"gguf": str(mine)}).command(spec)
    assert argv[argv.index("-m") + 1] == str(mine)


def test_the_gpu_default_is_a_real_ungated_model_sized_from_the_hub(hub, tmp_path):
    """On a GPU machine `make bench` runs Qwen2.5-7B-Instruct (bench/run/default_bench.py GPU_MODEL; the
    Makefile names the same); its ladder is sized from the hub's config and safetensors index, with a token
    in the environment that is sent but written nowhere."""
    from kvbench.run import default_bench

    makefile = (ROOT / "Makefile").read_text()
    assert f"GPU_MODEL := {default_bench.GPU_MODEL}" in makefile
    config = QWEN25_7B_INSTRUCT.encode()
    index = json.dumps({"metadata": {"total_size": 15_231_233_024}, "weight_map": {}}).encode()
    hub.repos[default_bench.GPU_MODEL] = {"config.json": config, "model.safetensors.index.json": index}
    code = ("from kvbench.run import default_bench as d; from kvbench.common.hardware import GPUInfo; import os; "
            "os.environ['KVBENCH_GPU'] = '1'; assert d.default_model() == d.GPU_MODEL; "
            "p = d.gpu_default_bench(d.default_model(), [GPUInfo('NVIDIA H100 80GB HBM3', 81559 * 2**20)]); "
            "print(p.max_context, p.workload); print(p.note)")
    env = {**os.environ, "HF_ENDPOINT": hub.url, "HF_HUB_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_XET": "1", "HF_TOKEN": TOKEN, "KVBENCH_HOME": str(tmp_path / "home")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    first, note = out.stdout.splitlines()[:2]
    # vLLM's startup rule on the H100 (0.9 of CUDA's 79.22 GiB less 14.19 GiB of weights, its profile peak,
    # non-torch memory and CUDA-graph estimate) leaves 16 sequences x 57,344 B/token the model's whole 32K context
    # (about 64K tokens would)
    assert first == "None gpu_long_context" and "weights 14.19 GiB" in note and "57,344 B/token" in note
    assert "vLLM 0.32.0's startup rule" in note and "32,768-token context fits" in note
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and not any(TOKEN.encode() in p.read_bytes() for p in written)
    assert default_bench.default_model() in (default_bench.GPU_MODEL, default_bench.CPU_MODEL)
