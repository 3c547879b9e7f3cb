"""llama.cpp's /completion stream events read into a request's result (backends/llamacpp/adapter.py,
CompletionEvents), in the shapes llama-server writes; against a real server: test_adapter_engines.py."""
from kvbench.backends.llamacpp.adapter import CompletionEvents
from kvbench.backends.types import RequestResult


def test_a_held_back_token_is_counted_with_the_next_event():
    """A token held back (its text ends inside a character) goes out with the next event, which names one
    token; an event without ``tokens_predicted`` counts its own tokens."""
    result, read = RequestResult("r", 4, 4, 0.0), CompletionEvents()
    for t, event in enumerate([{"content": "a", "tokens": [1], "stop": False, "tokens_predicted": 1},
                               {"content": "😀", "tokens": [4], "stop": False, "tokens_predicted": 4},
                               {"content": "", "tokens": [], "stop": True, "tokens_predicted": 4,
                                "tokens_evaluated": 4}]):
        read(event, float(t), result)
    assert (result.chunk_tokens, result.chunk_times, result.output_tokens_reported) == ([1, 3], [0.0, 1.0], 4)
    bare = RequestResult("r", 4, 2, 0.0)
    CompletionEvents()({"content": "ab", "tokens": [1, 2]}, 0.5, bare)
    assert bare.chunk_tokens == [2]
