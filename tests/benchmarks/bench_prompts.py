"""The prompt builder: one 32K-token prompt from the embedded model's tokenizer (SmolLM2)."""
import pytest

from kvbench.workloads.prompts import PromptBuilder


@pytest.fixture(scope="module")
def builder(smollm2):
    b = PromptBuilder(smollm2.hf_dir / "tokenizer.json")
    b.word_ids  # the one-off vocabulary scan and joining check, outside the measured rounds
    return b


def test_build_32k_prompt(benchmark, builder):
    prompt = benchmark(builder.build, 32_768, 7, "r0", 128)
    assert prompt.prompt_tokens == 32_768 and len(prompt.text.split()) == 32_768
