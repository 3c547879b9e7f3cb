"""Issue 21, items 4 and 5: `kvbench plan` is never silently wrong (a config it did not fully read says so,
--strict exits 3, a remote-code config is read through its own class with --trust-remote-code, a hub id
without network answers from the cache at once, the embedded model plans by name), lists every accepted
value in --help, and refuses bad input in one line with exit 2."""
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench.backends import kv_rules
from kvbench.cli import app
from kvbench.kv.geometry import KV_DTYPE_BYTES
from kvbench.planner import WEIGHT_DTYPES, engines, gpu_catalog

from tests.fakes.hub_server import COMMIT
from tests.helpers import REPO, DATA, plan_lines

runner = CliRunner()
ROOT = REPO  # the repository
CORPUS = DATA / "configs"


def plan(*args, env=None):
    result = runner.invoke(app, ["plan", *args], env={"COLUMNS": "200", **(env or {})})
    return result.exit_code, result.output


# --- never silently wrong ------------------------------------------------------------------------------

# a remote-code hybrid: which layers are full attention is in a list under its own name
HYBRID = {"model_type": "my_hybrid", "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
          "hidden_size": 2048, "intermediate_size": 8192, "vocab_size": 32000, "max_position_embeddings": 32768,
          "attn_type_list": [0, 1, 1, 1, 0, 1, 1, 1],
          "auto_map": {"AutoConfig": "configuration_my_hybrid.MyHybridConfig"}}
HYBRID_CONFIG_PY = '''from transformers import PretrainedConfig


class MyHybridConfig(PretrainedConfig):
    model_type = "my_hybrid"

    def __init__(self, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, hidden_size=2048,
                 head_dim=256, attn_type_list=None, max_position_embeddings=32768, **kwargs):
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.hidden_size = hidden_size
        self.head_dim = head_dim
        self.attn_type_list = attn_type_list
        self.max_position_embeddings = max_position_embeddings
        super().__init__(**kwargs)
'''
CHATGLM3 = {"model_type": "chatglm", "num_layers": 28, "hidden_size": 4096, "ffn_hidden_size": 13696,
            "kv_channels": 128, "num_attention_heads": 32, "multi_query_attention": True, "multi_query_group_num": 2,
            "padded_vocab_size": 65024, "seq_length": 8192, "layernorm_epsilon": 1e-05, "rmsnorm": True,
            "apply_residual_connection_post_layernorm": False, "original_rope": True}  # THUDM/chatglm3-6b


def folder(tmp_path, config, name="model") -> Path:
    f = tmp_path / name
    f.mkdir()
    (f / "config.json").write_text(json.dumps(config))
    return f


def test_a_models_own_layer_list_is_read_and_an_unread_one_refused(tmp_path):
    """attn_type_list (MiniMax's: 0 linear attention, 1 softmax) is read layer by layer: 6 of the 8 layers hold KV.
    A per-layer key kvbench does not read is refused by name, exit 2: planning every layer as full attention
    would be several times off, as confident as any other answer."""
    out = json.loads(plan(str(folder(tmp_path, HYBRID)), "-n", "1000", "--json")[1])
    assert out["layers"] == 6 and out["verified"] is True and out["unread_keys"] == []
    assert out["kv_bytes"] == 1000 * 6 * 2 * 4 * (2048 // 16) * 2
    unknown = {**{k: v for k, v in HYBRID.items() if k != "attn_type_list"}, "global_attn_layers": [3, 7]}
    code, output = plan(str(folder(tmp_path, unknown, "unknown")), "-n", "1000", "--gpu", "L4")
    assert code == 2 and len(output.strip().splitlines()) == 1, output
    assert "global_attn_layers looks per-layer and kvbench does not read it" in output
    assert "no KV is planned" in output


def test_a_remote_code_config_read_in_full_is_verified(tmp_path):
    model = str(folder(tmp_path, CHATGLM3))
    out = json.loads(plan(model, "-n", "1000", "--json")[1])
    assert out["verified"] is True and out["unread_keys"] == []
    assert plan(model, "-n", "1000", "--strict")[0] == 0


def test_trust_remote_code_reads_the_models_own_configuration_module(tmp_path):
    model = folder(tmp_path, HYBRID)
    (model / "configuration_my_hybrid.py").write_text(HYBRID_CONFIG_PY)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}

    def run(*extra):
        out = subprocess.run([sys.executable, "-m", "kvbench.cli", "plan", str(model), "-n", "1000", "--json", *extra],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)
    as_written, remote = run(), run("--trust-remote-code")
    assert as_written["head_dim_k"] == 2048 // 16  # hidden / heads: the file names no head_dim
    assert any("ships configuration_my_hybrid.py: --trust-remote-code reads it" in n for n in as_written["notes"])
    assert remote["head_dim_k"] == 256  # the class's own default: named, the answer not verified
    assert any("read through its own configuration_my_hybrid.py" in n for n in remote["notes"])
    assert remote["verified"] is False and remote["verdict"]["assumed_keys"] == ["head_dim"]
    assert remote["kv_bytes"] == 1000 * 2 * 6 * 4 * 256 * 2  # attn_type_list: 6 softmax layers of 8


def test_the_embedded_model_plans_by_name():
    out = json.loads(plan("smollm2", "--engine", "llamacpp", "--gpu", "L4", "--json")[1])
    assert out["model"] == "smollm2" and out["weights_source"] == "GGUF tensor bytes"
    assert out["kv_bytes_per_token_formula"] == 23_040 and out["verdict"]["word"] == "FITS"


# --- a hub id without network -----------------------------------------------------------------------------

def cached_hub(tmp_path) -> Path:
    """The hub cache's own layout for google/gemma-3-4b-it (refs/main + snapshots/<commit>/config.json)."""
    repo = tmp_path / "cache" / "models--google--gemma-3-4b-it"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    (repo / "snapshots" / COMMIT).mkdir(parents=True)
    (repo / "snapshots" / COMMIT / "config.json").write_bytes((CORPUS / "gemma-3-4b-it.json").read_bytes())
    return tmp_path / "cache"


# the time measured is the network's: transformers' first import (a second or so here, online or not) is done
# before, by reading the same config from the corpus
TIMED = ("import json, sys, time, httpx, huggingface_hub.file_download\n"
         "from kvbench.kv.model_config import geometry_from_hf\n"
         "from kvbench.planner import PlanError, resolve_model\n"
         "geometry_from_hf(sys.argv[2])\n"
         "start = time.monotonic()\n"
         "try:\n    m = resolve_model(sys.argv[1]); answer = m.geometry.describe()\n"
         "except PlanError as exc:\n    answer = 'error: ' + str(exc)\n"
         "print(json.dumps({'seconds': time.monotonic() - start, 'answer': answer}))")


@pytest.mark.parametrize("endpoint", ["http://127.0.0.1:9",  # a closed port: refused at once
                                      "http://10.255.255.1:81",  # an address that never answers
                                      "http://127.0.0.1:{port}"])  # a port that accepts and never answers
def test_a_hub_id_without_network_answers_from_the_cache_within_2_s(tmp_path, endpoint):
    cache = cached_hub(tmp_path)
    silent = socket.socket()  # listens, accepts into its backlog, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    endpoint = endpoint.format(port=silent.getsockname()[1])
    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "0",
           "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_ETAG_TIMEOUT": "10", "HF_HUB_DOWNLOAD_TIMEOUT": "10"}

    def timed(repo):
        out = subprocess.run([sys.executable, "-c", TIMED, repo, str(CORPUS / "gemma-3-4b-it.json")], capture_output=True, text=True, env=env, cwd=ROOT,
                             timeout=120, check=False)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout.splitlines()[-1])
    try:
        found, missing = timed("google/gemma-3-4b-it"), timed("google/not-cached")
    finally:
        silent.close()
    assert found["seconds"] < 2 and found["answer"].startswith("GQA, 34 KV layers, 4 KV heads")
    assert missing["seconds"] < 2
    assert "is not in the local hub cache" in missing["answer"] and "could not be reached" in missing["answer"]
    assert len(missing["answer"].splitlines()) == 1


# --- --help and bad input -----------------------------------------------------------------------------

def test_help_lists_every_accepted_value():
    code, output = plan("--help")
    text = " ".join(output.split())
    assert code == 0
    for engine in engines():
        assert engine in text
    for gpu in gpu_catalog():
        assert gpu in text
    for dtype in KV_DTYPE_BYTES:
        assert dtype in text
    for engine in engines():
        for dtype in kv_rules(engine).dtypes:
            assert dtype in text
    for dtype in WEIGHT_DTYPES:
        assert dtype in text
    for option in ("hybrid_kv_cache", "unified", "--max-model-len", "--weights-bytes", "--strict",
                   "--trust-remote-code", "gpu or cpu"):
        assert option in text


@pytest.mark.parametrize("args, message", [
    (["-n", "abc"], "--context takes a number of tokens such as 32768"),
    (["-n", "0"], "--context must be a whole number of tokens >= 1"),
    (["--max-model-len", "12.5"], "--max-model-len must be a whole number of tokens"),
    (["--batch", "x"], "--batch takes a whole number, not 'x'"),
    (["--batch", "0"], "--batch must be >= 1, not 0"),
    (["--tp", "two"], "--tp takes a whole number"),
    (["--margin", "lots"], "--margin takes a number"),
    (["--weights-bytes", "12XB"], "--weights-bytes takes a size such as 61GiB"),
    (["--weights-dtype", "int3"], "unknown --weights-dtype 'int3'; known: auto, fp32"),
    (["--engine", "vlm"], "no KV rules for engine 'vlm'"),
    (["--engine", "vllm", "--kv-dtype", "q4_0"], "vllm has no KV dtype 'q4_0'; it takes: auto, bf16"),
    (["--gpu", "X100"], "unknown GPU 'X100'; did you mean 'V100-16GB'? known: A100-40GB"),
    (["--device", "tpu"], "--device is gpu or cpu, not 'tpu'"),
    (["-n", "9000", "--max-model-len", "8192"], "is longer than the --max-model-len 8,192"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    code, output = plan("llama-3.1-8b", *args)
    assert code == 2 and message in output, output
    assert len(output.strip().splitlines()) == 1 and "Traceback" not in output


def test_sizes_are_read_as_vllm_reads_them():
    out = json.loads(plan("llama-3.1-8b", "-n", "32k", "--max-model-len", "64K", "--weights-bytes", "15GiB",
                          "--json")[1])
    assert (out["context"], out["max_model_len"], out["weights_bytes"]) == (32000, 65536, 15 * 2**30)
