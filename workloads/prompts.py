"""Token-exact prompts.

A prompt is a list of token ids drawn, with a fixed seed, from the model's "plain word" tokens: vocab
entries that decode to a space followed by letters and that encode back to themselves alone. Because the
tokenizer's pre-tokenizer splits text at those spaces, the decoded text re-encodes to exactly the same
ids, so an engine that only accepts text sees the same tokens as one that accepts ids. Every prompt is
checked by a round trip; a tokenizer for which that fails is reported, never silently accepted.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

_PLAIN_WORD = re.compile(r"^ [A-Za-z]{2,12}$")


@dataclass(frozen=True)
class Prompt:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    output_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)


class PromptBuilder:
    def __init__(self, tokenizer_file: str | Path):
        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))

    @cached_property
    def word_ids(self) -> np.ndarray:
        special = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()}
        ids = []
        for token, token_id in self.tokenizer.get_vocab().items():
            if token in special:
                continue
            text = self.tokenizer.decode([token_id])
            if _PLAIN_WORD.match(text) and self.tokenizer.encode(text, add_special_tokens=False).ids == [token_id]:
                ids.append(token_id)
        if len(ids) < 100:
            raise ValueError(f"tokenizer has only {len(ids)} plain-word tokens; cannot build token-exact prompts")
        return np.array(sorted(ids), dtype=np.int64)

    def build(self, n_tokens: int, seed: int, request_id: str, output_tokens: int) -> Prompt:
        """``n_tokens`` ids, deterministic in (seed, request_id), verified by a decode/encode round trip."""
        key = int.from_bytes(hashlib.sha256(f"{seed}:{request_id}".encode()).digest()[:8], "little")
        rng = np.random.default_rng(key)
        ids = self.word_ids[rng.integers(0, len(self.word_ids), size=n_tokens)].tolist()
        text = self.tokenizer.decode(ids)
        if self.tokenizer.encode(text, add_special_tokens=False).ids != ids:
            raise ValueError(f"prompt {request_id}: text does not re-encode to the same {n_tokens} tokens")
        return Prompt(request_id=request_id, token_ids=tuple(ids), text=text, output_tokens=output_tokens)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
