"""Token-exact prompts from the embedded model's tokenizer."""
import json
import os

import pytest

from kvbench.workloads import WorkloadError, load, prompts
from kvbench.workloads.prompts import PromptBuilder


@pytest.fixture(scope="module")
def builder(smollm2):
    return PromptBuilder(smollm2.hf_dir / "tokenizer.json")


@pytest.mark.parametrize("n", [1, 17, 1024, 8128])
def test_exact_length_and_round_trip(builder, n):
    p = builder.build(n, seed=1, request_id="a", output_tokens=8)
    assert p.prompt_tokens == n
    assert builder.tokenizer.encode(p.text, add_special_tokens=False).ids == list(p.token_ids)


def test_deterministic_in_seed_and_request_id(builder):
    a = builder.build(256, seed=1, request_id="x", output_tokens=8)
    assert a == builder.build(256, seed=1, request_id="x", output_tokens=8)
    assert a.token_ids != builder.build(256, seed=2, request_id="x", output_tokens=8).token_ids
    assert a.token_ids != builder.build(256, seed=1, request_id="y", output_tokens=8).token_ids


def test_no_special_tokens(builder):
    special = {t for t in builder.tokenizer.get_added_tokens_decoder()}
    p = builder.build(4000, seed=3, request_id="s", output_tokens=8)
    assert not special & set(p.token_ids)


@pytest.fixture
def words_found(tmp_path, monkeypatch):
    """A builder of a small BPE tokenizer's prompts (130 plain words: finding SmolLM2's took 0.7 s a time) as a
    new process makes it (no words found in this one yet), KVBENCH_HOME in tmp_path, and the list of times it
    found the words itself."""
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path / "home"))
    found, find = [], PromptBuilder._find_words
    monkeypatch.setattr(PromptBuilder, "_find_words", lambda self: found.append(1) or find(self))
    tokenizer = merging_tokenizer(tmp_path / "tokenizer.json", merge_across=False)

    def new_process_builder() -> PromptBuilder:
        monkeypatch.setattr(prompts, "_WORDS_BY_TOKENIZER", {})
        return PromptBuilder(tokenizer)

    return new_process_builder, found


def test_the_words_found_are_kept_for_the_next_process(words_found):
    new_process_builder, found = words_found
    first = new_process_builder()
    prompt = first.build(3000, seed=1, request_id="a", output_tokens=8)
    assert found == [1] and first._words_file.is_file()
    second = new_process_builder()
    assert second.build(3000, seed=1, request_id="a", output_tokens=8) == prompt
    assert found == [1] and (second.word_ids == first.word_ids).all()


@pytest.mark.parametrize("damage", ["two words swapped", "another tokenizers library", "not json", "a fifo"])
def test_kept_words_that_are_not_true_are_found_again(words_found, damage):
    new_process_builder, found = words_found
    first = new_process_builder()
    prompt, path = first.build(3000, seed=1, request_id="a", output_tokens=8), first._words_file
    kept, true = json.loads(path.read_text()), path.read_text()
    if damage == "two words swapped":
        kept["texts"][0], kept["texts"][1] = kept["texts"][1], kept["texts"][0]
        path.write_text(json.dumps(kept))
    elif damage == "another tokenizers library":
        path.write_text(json.dumps({**kept, "tokenizers": "0.0.1"}))
    elif damage == "not json":
        path.write_bytes(b"\x00" * 100)
    else:
        path.unlink()
        os.mkfifo(path)  # never opened for reading (it would block), never written through
    again = new_process_builder()
    assert again.build(3000, seed=1, request_id="a", output_tokens=8) == prompt and found == [1, 1]
    if damage != "a fifo":
        assert path.read_text() == true  # put right
        new_process_builder().word_ids  # noqa: B018
        assert found == [1, 1]


def test_a_home_that_cannot_keep_the_words_costs_only_time(words_found, tmp_path, monkeypatch):
    new_process_builder, found = words_found
    monkeypatch.setenv("KVBENCH_HOME", str(tmp_path / "a-file"))
    (tmp_path / "a-file").write_text("not a folder")
    prompt = new_process_builder().build(100, seed=1, request_id="a", output_tokens=8)
    assert prompt.prompt_tokens == 100 and new_process_builder().word_ids.size and found == [1, 1]


def test_ladder_resolves_max_against_context():
    wl = load("long_context_ladder")
    assert wl.prompt_lengths(8192) == [1024, 2048, 4096, 8192 - wl.output_tokens]
    assert wl.prompt_lengths(2048) == [1024, 2048 - wl.output_tokens]


def test_workload_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x"\nseed = 1\nprompt_tokens = [0]\noutput_tokens = 4\nconcurrency = [1]\n')
    with pytest.raises(WorkloadError, match="prompt_tokens"):
        load(str(bad))
    bad.write_text('name = "x"\nseed = 1\nprompt_tokens = [8]\noutput_tokens = 4\nconcurrency = [1]\nspeed = 3\n')
    with pytest.raises(WorkloadError, match="speed"):
        load(str(bad))
    with pytest.raises(WorkloadError, match="long_context_ladder"):
        load("no_such_workload")


def merging_tokenizer(path, merge_across: bool):
    """A character BPE (tokenizers' own classes, no pre-tokenizer) whose 2-letter words " ab" ... are each one
    token; with ``merge_across`` its first merge joins an "s" to the space after it, as a tokenizer that does
    not split at spaces may: then " as" alone is one token, and " as" before another word is not."""
    from tokenizers import Tokenizer, models

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {c: i for i, c in enumerate(" " + letters)}
    merges = [("s", " ")] if merge_across else []
    vocab.update({"s ": len(vocab)} if merge_across else {})
    for a in letters[:5]:
        vocab[" " + a] = len(vocab)
        merges.append((" ", a))
    for a in letters[:5]:
        for b in letters:
            vocab[" " + a + b] = len(vocab)
            merges.append((" " + a, b))
    Tokenizer(models.BPE(vocab, merges)).save(str(path))
    return path


@pytest.mark.parametrize("merge_across", [False, True], ids=["splits-at-spaces", "merges-across-words"])
def test_a_tokenizer_that_merges_across_words_is_refused(tmp_path, merge_across):
    builder = PromptBuilder(merging_tokenizer(tmp_path / "tokenizer.json", merge_across))
    if not merge_across:
        assert len(builder.word_ids) == 130  # " aa" ... " ez"
        p = builder.build(5000, seed=1, request_id="a", output_tokens=8)  # more words than one checked piece
        assert builder.tokenizer.encode(p.text, add_special_tokens=False).ids == list(p.token_ids)
        return
    with pytest.raises(ValueError, match="merges across plain words"):
        builder.word_ids
