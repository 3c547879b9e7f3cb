"""What an engine chooses per CPU, without an engine: llama.cpp's build without AMX on an AMX CPU (its AMX
matmul crashes there), the rebuild on a CPU of other features, a start that crashed classified with what to
try, and vLLM's CPU block for MLA by AMX. The real engines on this machine check the same in the engine tests."""
import json
from pathlib import Path

import pytest

from kvbench.backends.llamacpp import adapter as llama
from kvbench.backends.llamacpp.adapter import NO_AMX_CFLAGS, LlamaCppBackend
from kvbench.backends.types import EngineStartError
from kvbench.backends.vllm.kvrules import VLLMKV
from kvbench.kv.geometry import KVGeometry
from kvbench.kv.model_config import geometry_from_hf_dict
from kvbench.kv.rules import KVQuestion, KVRuleError
from tests.fakes.testkit import spec
from tests.helpers import DATA

SAPPHIRE_RAPIDS = ["avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"]
ICE_LAKE = ["avx2", "avx512f", "avx512_vnni"]
ZEN3 = ["avx2"]


def on_cpu(monkeypatch, flags, machine="x86_64"):
    monkeypatch.setattr(llama, "cpu_flags", lambda: list(flags))
    monkeypatch.setattr(llama.platform, "machine", lambda: machine)
    monkeypatch.setattr(llama, "has_nvidia_gpu", lambda: False)


@pytest.mark.parametrize("flags, cflags", [(SAPPHIRE_RAPIDS, NO_AMX_CFLAGS), (ICE_LAKE, ""), (ZEN3, "")])
def test_llamacpp_builds_natively_without_amx_only_where_the_cpu_has_it(monkeypatch, flags, cflags):
    on_cpu(monkeypatch, flags)
    step = LlamaCppBackend.recipe("0.3.36").steps[0]
    assert dict(step.env) == {"KVBENCH_GGML_NATIVE": "ON", "KVBENCH_GGML_CFLAGS": cflags}
    said = LlamaCppBackend.machine_build("0.3.36")
    assert said.startswith("GGML_NATIVE=ON (-march=native: " + ", ".join(flags))
    assert ("without AMX" in said and "ggml-org/llama.cpp#20824" in said) == bool(cflags)


def test_the_build_script_passes_the_flags_to_both_compilers_and_records_them():
    script = llama.BUILD_SCRIPT.read_text()
    assert '-DCMAKE_C_FLAGS="${KVBENCH_GGML_CFLAGS:-}" -DCMAKE_CXX_FLAGS="${KVBENCH_GGML_CFLAGS:-}"' in script
    assert '>"$prefix/BUILD_FLAGS"' in script


def test_a_cpu_of_other_features_gets_a_build_of_its_own(monkeypatch):
    """-march=native binaries do not move between CPUs; a model name can be as generic as "Intel(R) Xeon(R)
    Processor", so the features key the build too."""
    monkeypatch.setattr(llama, "cpu_model", lambda: "Intel(R) Xeon(R) Processor")
    digests = set()
    for flags in (SAPPHIRE_RAPIDS, ICE_LAKE, ZEN3):
        on_cpu(monkeypatch, flags)
        digests.add(LlamaCppBackend.recipe("0.3.36").digest())
    assert len(digests) == 3


def test_a_portable_build_off_x86(monkeypatch):
    on_cpu(monkeypatch, [], machine="aarch64")
    assert dict(LlamaCppBackend.recipe("0.3.36").steps[0].env)["KVBENCH_GGML_NATIVE"] == "OFF"
    assert LlamaCppBackend.machine_build("0.3.36") == "GGML_NATIVE=OFF (a portable build for aarch64)"


def start_error(tmp_path: Path, log: str, failure: str, monkeypatch) -> str:
    """The error a llama-server start that failed so gives, through the adapter's own start()."""
    backend = LlamaCppBackend("0.3.36", tmp_path, {})

    class Died:
        log_path = tmp_path / "llamacpp.log"

        def __init__(self, *a, **k):
            self.log_path.write_text(log)

        def start(self):
            pass

        def wait_http(self, url, timeout_s):
            raise EngineStartError(failure, log[-200:])

    monkeypatch.setattr(backend, "command", lambda spec: (["llama-server"], {}))
    monkeypatch.setattr("kvbench.backends.base.ServerProcess", Died)
    with pytest.raises(EngineStartError) as exc:
        backend.start(spec(tmp_path), tmp_path / "llamacpp.log", 5)
    return str(exc.value)


AMX_LOG = "load_tensors:          AMX model buffer size =    70.31 MiB\nload_tensors:   CPU_Mapped model buffer size"


def test_a_crash_with_amx_buffers_is_named_with_the_fix(tmp_path, monkeypatch):
    said = start_error(tmp_path, AMX_LOG, "server killed by SIGSEGV before it was ready", monkeypatch)
    assert said.startswith("server killed by SIGSEGV before it was ready: llama.cpp's AMX matmul crash")
    assert "ggml-org/llama.cpp#20824" in said and "--no-repack" in said and NO_AMX_CFLAGS in said


def test_other_crashes_say_where_they_happened_and_what_to_try(tmp_path, monkeypatch):
    loaded = "load_tensors:   CPU_Mapped model buffer size =    98.00 MiB\n"
    assert "first computation" in start_error(tmp_path, loaded, "server killed by SIGABRT before it was ready", monkeypatch)
    assert "while loading" in start_error(tmp_path, "llama_model_load: error", "server killed by SIGSEGV before it was ready", monkeypatch)
    assert "instruction this CPU lacks" in start_error(tmp_path, "", "server killed by SIGILL before it was ready", monkeypatch)
    plain = "server exited with code 1 before it was ready"
    assert start_error(tmp_path, loaded, plain, monkeypatch) == plain  # nothing more to say


DEEPSEEK_V2_LITE = geometry_from_hf_dict(json.loads((DATA / "configs" / "deepseek-v2-lite.json").read_text()))


def test_vllm_cpu_mla_block_follows_amx():
    """vllm/platforms/cpu.py (0.32.0): MLA takes the AMX_MLA backend where AMX tiles are, keeping the CPU's
    128-token blocks; elsewhere the reference CPU MLA kernel, compiled for 16 only. Other layouts: 128."""
    rules = VLLMKV()
    stored = rules.stored(KVQuestion(DEEPSEEK_V2_LITE, device="cpu"))
    assert stored.mla is not None

    def block(geometry, device, flags):
        return rules.block_size(KVQuestion(geometry, device=device, cpu_features=tuple(flags)), rules.stored(
            KVQuestion(geometry, device=device)))
    assert block(DEEPSEEK_V2_LITE, "cpu", SAPPHIRE_RAPIDS) == 128
    assert block(DEEPSEEK_V2_LITE, "cpu", ICE_LAKE) == 16
    assert block(DEEPSEEK_V2_LITE, "gpu", SAPPHIRE_RAPIDS) == 16
    gqa = KVGeometry.uniform(4, 2, 64, max_context=4096)
    assert block(gqa, "cpu", ICE_LAKE) == block(gqa, "cpu", SAPPHIRE_RAPIDS) == 128


def test_vllm_cpu_fp8_kv_needs_avx512_or_amx_and_a_head_size_of_32s():
    """v1/attention/backends/cpu_attn.py _get_attn_isa (0.32.0) fails the engine core's start: fp8 KV on a CPU
    needs AVX-512 or AMX tiles, and a head size that is a multiple of 32 where it is one of 16. The run gives
    such cells "not run" (the engine checked to refuse alike: tests/run/test_kvquant_engines.py)."""
    rules = VLLMKV()
    gqa = KVGeometry.uniform(4, 2, 64, max_context=4096)

    def question(geometry, dtype, flags, device="cpu"):
        return KVQuestion(geometry, dtype, device=device, cpu_features=tuple(flags))
    for flags in (SAPPHIRE_RAPIDS, ICE_LAKE):
        rules.check(question(gqa, "fp8_e4m3", flags))
    with pytest.raises(KVRuleError, match=r"requires x86 with AVX-512 or AMX; this CPU has neither \(flags: avx2\)"):
        rules.check(question(gqa, "fp8", ZEN3))
    rules.check(question(gqa, "bf16", ZEN3))  # a 16-bit cache runs on any x86
    rules.check(question(gqa, "fp8", ZEN3, device="gpu"))  # a GPU's rules are not the CPU's
    rules.check(question(gqa, "fp8", ()))  # an unknown CPU: nothing refused on a guess
    with pytest.raises(KVRuleError, match=r"head_size divisible by 32 on CPU \(head size 80\)"):
        rules.check(question(KVGeometry.uniform(4, 2, 80, max_context=4096), "fp8", SAPPHIRE_RAPIDS))
    rules.check(question(KVGeometry.uniform(4, 2, 80, max_context=4096), "bf16", SAPPHIRE_RAPIDS))
