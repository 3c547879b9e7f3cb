"""llama.cpp's /completion stream read from a real llama-server: a token whose text ends inside a UTF-8
character is held back and goes out with the next event, which names one token; the adapter counts the
engine's running ``tokens_predicted`` instead (backends/llamacpp/adapter.py, CompletionEvents; the event
shapes alone: test_adapter.py)."""
import asyncio

import pytest

from kvbench.backends.llamacpp.adapter import LlamaCppBackend
from kvbench.backends.streaming import open_client
from kvbench.backends.types import ServerSpec
from kvbench.workloads.prompts import Prompt

from tests.helpers import engine_env

pytestmark = pytest.mark.engine

# SmolLM2 continues a run of emoji with emoji: 4-byte characters of 2-3 byte-level tokens each
EMOJI = "😀😃😄😁😆😅😂🤣😊😇🙂🙃😉😌😍🥰😘"


def test_an_output_of_multibyte_characters_is_counted_token_for_token(tmp_path, smollm2):
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(smollm2.hf_dir / "tokenizer.json")).encode(EMOJI, add_special_tokens=False).ids
    prompt = Prompt(request_id="emoji", token_ids=tuple(ids), text=EMOJI, output_tokens=32)
    server = LlamaCppBackend(LlamaCppBackend.default_version, engine_env("llamacpp"))
    server.start(ServerSpec(model=smollm2, max_context=1024, max_concurrency=1, kv_dtype="auto"),
                 tmp_path / "llama.log", 120)
    try:
        async def stream():
            async with open_client(1, 60) as client:
                return await server.stream(client, prompt)

        result = asyncio.run(stream())
    finally:
        server.stop()
    assert result.error is None and result.output_tokens_reported == 32
    # the engine held tokens back: some events carried several; every token was counted, once
    assert max(result.chunk_tokens) > 1 and sum(result.chunk_tokens) == 32, result.chunk_tokens
    assert result.chunk_times == sorted(result.chunk_times)

