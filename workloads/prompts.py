"""Token-exact prompts.

A prompt is a list of token ids drawn, with a fixed seed, from the model's "plain word" tokens: vocab
entries that decode to a space followed by letters and that encode back to themselves alone. Because the
tokenizer's pre-tokenizer splits text at those spaces, the text (the words joined) re-encodes to exactly
the same ids, so an engine that only accepts text sees the same tokens as one that accepts ids.

That property is checked once per tokenizer on a long sample that uses every plain word, and the words found
are kept in ``$KVBENCH_HOME/prompt_words/`` (finding them took 0.7 s of CPU at each run's start for SmolLM2's
49K vocabulary, reading them back 0.03 s); after that a prompt is only drawn and joined (100 prompts of 32K
tokens take well under a second), and every request's prompt length is checked again against what the engine
reports it read.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
import tokenizers
from tokenizers import Tokenizer

from kvbench.common.envs import kvbench_home
from kvbench.common.files import atomic_write_text
from kvbench.kv import bounded

_PLAIN_WORD = re.compile(r"^ [A-Za-z]{2,12}$")
JOIN_CHECK_WORDS = 2048  # words per piece of the joining check
MIN_PLAIN_WORDS = 100  # fewer: the tokenizer cannot give varied token-exact prompts


@dataclass(frozen=True)
class Prompt:
    request_id: str
    token_ids: tuple[int, ...]
    text: str
    output_tokens: int
    # sent in the engine's cache-isolation field (vLLM's cache_salt) where it has one: the run's prompt salt
    # when the tokens themselves are not salted (kvbench.run.cells.PromptSalt)
    cache_salt: str | None = None
    # a KV-quantisation workload: ask for the top-k log-probabilities of every generated token (0: none) and
    # for the prompt tokens' own log-probabilities (teacher forcing), where the adapter can (Backend hooks)
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    # its place in its cell's schedule (0..n-1; None outside a cell: warm-ups, probes): the request's ordinal,
    # bookkeeping beside what is sent (two prompts of the same tokens are equal whatever their places)
    ordinal: int | None = field(default=None, compare=False)

    @property
    def prompt_tokens(self) -> int:
        return len(self.token_ids)


# the plain words of each tokenizer read in this process, by its file's sha256: a process that runs several
# times (a test session, a notebook) finds and checks them once (0.9 s for SmolLM2's 49K vocabulary)
_WORDS_BY_TOKENIZER: dict[str, tuple[np.ndarray, np.ndarray]] = {}
# what a kept word list says it is: another rule for plain words or another tokenizers library may find others
# (a change to what _find_words keeps changes "format": every kept list is then found again)
WORDS_FILE_FORMAT = {"format": 1, "rule": _PLAIN_WORD.pattern, "tokenizers": tokenizers.__version__}


class PromptBuilder:
    def __init__(self, tokenizer_file: str | Path):
        # a regular file within bounds: a FIFO or a link to /dev/zero is refused (InputError), never read
        raw = bounded.read_bytes(tokenizer_file, bounded.TOKENIZER_MAX_BYTES, "tokenizer")
        try:
            self.tokenizer = Tokenizer.from_str(raw.decode())
        except Exception as exc:  # noqa: BLE001 - tokenizers raises its own Exception for a file it cannot read
            why = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
            raise bounded.InputError(f"tokenizer {tokenizer_file}: not a tokenizer.json the tokenizers library "
                                     f"reads ({why})") from None
        self._tokenizer_sha256 = hashlib.sha256(raw).hexdigest()

    @cached_property
    def _words(self) -> tuple[np.ndarray, np.ndarray]:
        if self._tokenizer_sha256 not in _WORDS_BY_TOKENIZER:
            words = self._kept_words()
            if words is None:
                words = self._find_words()
                self._keep_words(*words)
            _WORDS_BY_TOKENIZER[self._tokenizer_sha256] = words
        return _WORDS_BY_TOKENIZER[self._tokenizer_sha256]

    @property
    def _words_file(self) -> Path:
        return kvbench_home() / "prompt_words" / f"{self._tokenizer_sha256}.json"

    def _kept_words(self) -> tuple[np.ndarray, np.ndarray] | None:
        """The words found for this tokenizer before, if kept and still true: every id decodes alone to its word
        (0.03 s for 31K words). Anything else (no file, another format or library, a damaged or foreign file)
        is None: the words are found again."""
        try:
            kept = json.loads(bounded.read_bytes(self._words_file, bounded.TOKENIZER_MAX_BYTES, "prompt words"))
            ids, texts, digest = kept.pop("ids"), kept.pop("texts"), kept.pop("sha256", None)
            if kept != WORDS_FILE_FORMAT or len(ids) != len(texts) or len(ids) < MIN_PLAIN_WORDS:
                return None
            # a list edited by hand (a word taken out, two swapped, one added) is still plain words that decode,
            # but other prompts for the same seed and salt: the digest it was kept with says so, and the ids are
            # in the vocabulary's order as found
            if digest != self._words_digest(ids, texts) or any(a >= b for a, b in zip(ids, ids[1:])):
                return None
            if not all(type(i) is int and type(t) is str and _PLAIN_WORD.match(t) and self.tokenizer.decode([i]) == t
                       for i, t in zip(ids, texts)):
                return None
        except Exception:  # noqa: BLE001 - a kept list is only a shortcut: whatever is wrong with it, find again
            return None
        return np.array(ids, dtype=np.int64), np.array(texts, dtype=object)

    def _words_digest(self, ids: list, texts: list) -> str:
        """What a kept list is checked by: the tokenizer's file, the format and the words, hashed together."""
        body = json.dumps([self._tokenizer_sha256, WORDS_FILE_FORMAT, ids, texts], separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()

    def _keep_words(self, ids: np.ndarray, texts: np.ndarray) -> None:
        """Keep the words for the next process; a home that cannot be written only costs the next one the time."""
        try:
            self._words_file.parent.mkdir(parents=True, exist_ok=True)
            ids, texts = ids.tolist(), texts.tolist()
            atomic_write_text(self._words_file, json.dumps({**WORDS_FILE_FORMAT, "ids": ids, "texts": texts,
                                                            "sha256": self._words_digest(ids, texts)}))
        except (OSError, ValueError):
            pass

    def _find_words(self) -> tuple[np.ndarray, np.ndarray]:
        special = {t.content for t in self.tokenizer.get_added_tokens_decoder().values()}
        candidates = []
        for token, token_id in sorted(self.tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
            if token in special:
                continue
            text = self.tokenizer.decode([token_id])
            if _PLAIN_WORD.match(text):
                candidates.append((token_id, text))
        # one batch: a call per word took 0.5 s of a run's start for a 49K vocabulary
        encoded = self.tokenizer.encode_batch([text for _, text in candidates], add_special_tokens=False)
        kept = [(token_id, text) for (token_id, text), enc in zip(candidates, encoded) if enc.ids == [token_id]]
        ids, texts = [token_id for token_id, _ in kept], [text for _, text in kept]
        if len(ids) < MIN_PLAIN_WORDS:
            raise ValueError(f"tokenizer has only {len(ids)} plain-word tokens; cannot build token-exact prompts")
        words = np.array(ids, dtype=np.int64), np.array(texts, dtype=object)
        self._check_joining(*words)
        return words

    def _check_joining(self, ids: np.ndarray, texts: np.ndarray) -> None:
        """Every plain word, in a shuffled sequence, must re-encode to the same ids when joined."""
        order = np.random.default_rng(0).permutation(len(ids))
        sample = np.concatenate([order, order[::-1]])
        # in pieces of JOIN_CHECK_WORDS, encoded as one batch: one long text took 0.35 s of CPU for SmolLM2's
        # 31K words, the batch 0.22 s (0.13 s of wall on 2 cores); a piece's first word was checked alone
        pieces = ["".join(texts[sample[i:i + JOIN_CHECK_WORDS]]) for i in range(0, len(sample), JOIN_CHECK_WORDS)]
        encoded = self.tokenizer.encode_batch(pieces, add_special_tokens=False)
        if [i for enc in encoded for i in enc.ids] != ids[sample].tolist():
            raise ValueError("this tokenizer merges across plain words: joined text does not re-encode to the "
                             "same ids, so text-only engines cannot get token-exact prompts")

    @property
    def word_ids(self) -> np.ndarray:
        return self._words[0]

    def draw(self, n_tokens: int, seed: int, key: str, salt: str | None = None) -> np.ndarray:
        """``n_tokens`` indices into the plain words, deterministic in (seed, salt, key); no salt: the draw
        of every unsalted run."""
        where = f"{seed}:{key}" if salt is None else f"{seed}:{salt}:{key}"
        digest = int.from_bytes(hashlib.sha256(where.encode()).digest()[:8], "little")
        return np.random.default_rng(digest).integers(0, len(self.word_ids), size=n_tokens)

    def from_words(self, words: np.ndarray, request_id: str, output_tokens: int) -> Prompt:
        ids, texts = self._words
        return Prompt(request_id=request_id, token_ids=tuple(ids[words].tolist()), text="".join(texts[words]),
                      output_tokens=output_tokens)

    def build(self, n_tokens: int, seed: int, request_id: str, output_tokens: int,
              shared_prefix: np.ndarray | None = None, salt: str | None = None) -> Prompt:
        """``n_tokens`` tokens, deterministic in (seed, salt, request_id); with ``shared_prefix`` (from
        :meth:`draw`) the prompt starts with those tokens and the rest is its own."""
        if shared_prefix is None:
            return self.from_words(self.draw(n_tokens, seed, request_id, salt), request_id, output_tokens)
        if len(shared_prefix) >= n_tokens:
            raise ValueError(f"shared prefix of {len(shared_prefix)} tokens leaves nothing of a {n_tokens}-token prompt")
        rest = self.draw(n_tokens - len(shared_prefix), seed, request_id, salt)
        return self.from_words(np.concatenate([shared_prefix, rest]), request_id, output_tokens)

    def from_text(self, text: str, n_tokens: int, seed: int, request_id: str, output_tokens: int) -> Prompt:
        """``n_tokens`` consecutive tokens of natural ``text`` (its own tokenisation, no special tokens), from an
        offset deterministic in (seed, request_id). Sent as token ids: engines that take text only may
        tokenise the decoded text differently, which each request's usage report shows."""
        ids = self._text_ids(text)
        if len(ids) <= n_tokens:
            raise ValueError(f"the natural text has {len(ids)} tokens: too few for a {n_tokens}-token prompt")
        digest = int.from_bytes(hashlib.sha256(f"{seed}:{request_id}".encode()).digest()[:8], "little")
        start = digest % (len(ids) - n_tokens)
        window = tuple(ids[start:start + n_tokens])
        return Prompt(request_id=request_id, token_ids=window, text=self.tokenizer.decode(list(window)),
                      output_tokens=output_tokens)

    def _text_ids(self, text: str) -> list[int]:
        cache = self.__dict__.setdefault("_text_cache", {})
        key = hashlib.sha256(text.encode()).hexdigest()
        if key not in cache:
            cache[key] = self.tokenizer.encode(text, add_special_tokens=False).ids
        return cache[key]

    def verify(self, prompt: Prompt) -> None:
        """Full decode/encode round trip of one prompt (the builder's check, repeated on a real prompt)."""
        if self.tokenizer.encode(prompt.text, add_special_tokens=False).ids != list(prompt.token_ids):
            raise ValueError(f"prompt {prompt.request_id}: text does not re-encode to the same "
                             f"{prompt.prompt_tokens} tokens")

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
