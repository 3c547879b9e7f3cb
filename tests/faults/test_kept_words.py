"""The fourth fault matrix, B: the prompt words kept in $KVBENCH_HOME/prompt_words/ (workloads/prompts.py), edited
by hand so that every word still decodes to itself: the same seed and salt gave other prompts. A kept list is now
checked against the digest it was kept with and found again (docs/fault-matrix.md, "The fourth matrix, B")."""
from __future__ import annotations

import json

import pytest

from kvbench.workloads import prompts
from kvbench.workloads.prompts import PromptBuilder
from tests.workloads.test_prompts import merging_tokenizer


@pytest.fixture
def builders(tmp_path, monkeypatch):
    """New-process builders of a 130-word tokenizer's prompts, KVBENCH_HOME in tmp_path; the times the words
    were found rather than read."""
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path / "home"))
    found, find = [], PromptBuilder._find_words
    monkeypatch.setattr(PromptBuilder, "_find_words", lambda self: found.append(1) or find(self))
    tokenizer = merging_tokenizer(tmp_path / "tokenizer.json", merge_across=False)

    def new_process_builder() -> PromptBuilder:
        monkeypatch.setattr(prompts, "_WORDS_BY_TOKENIZER", {})
        return PromptBuilder(tokenizer)

    return new_process_builder, found


def _drop_one(kept):
    del kept["ids"][5], kept["texts"][5]


def _swap_pairs(kept):
    for key in ("ids", "texts"):
        kept[key][0], kept[key][1] = kept[key][1], kept[key][0]


def _digest_recomputed_over_a_reordering(kept):  # the ids no longer in the vocabulary's order
    _swap_pairs(kept)
    kept.pop("sha256")


@pytest.mark.parametrize("edit", [_drop_one, _swap_pairs, _digest_recomputed_over_a_reordering],
                         ids=["a word taken out", "two id-word pairs swapped", "no digest"])
def test_a_hand_edited_kept_words_file_is_found_again_and_the_prompts_stay(builders, edit):
    new_process_builder, found = builders
    first = new_process_builder()
    prompt, path = first.build(2000, seed=1, request_id="a", output_tokens=8), first._words_file
    true = path.read_text()
    kept = json.loads(true)
    edit(kept)
    path.write_text(json.dumps(kept))
    again = new_process_builder()
    assert again.build(2000, seed=1, request_id="a", output_tokens=8) == prompt and found == [1, 1]
    assert path.read_text() == true  # rebuilt as it was
