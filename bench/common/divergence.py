"""How far a quantised KV cache moves an engine's output from its 16-bit cache's, on the same prompts (pure).

Inputs are what the engines return per generated token: the greedy token id and the top-k log-probabilities
of the next-token distribution (natural logs, normalised over the whole vocabulary, as llama.cpp's
``n_probs`` and vLLM's ``logprobs`` give them), and, where an engine returns them, the log-probabilities of
the prompt's own tokens (teacher forcing).

- **Greedy match**: per request, whether the two greedy sequences are identical and the first position
  (0-based) where they differ (None: identical).
- **KL divergence** KL(baseline || quantised) of the next-token distributions, per position, over the
  positions whose contexts are identical (every position up to and including the first that differs: after
  it the two runs condition on different tokens and their distributions are no longer comparable). With only
  the top k of each distribution, the ids in *both* top-k lists keep their own probabilities and every other
  id is pooled into one "rest" bucket on each side (1 minus the shared ids' mass). Pooling can only lower a
  KL divergence (the data-processing inequality), so the figure is a lower bound on the full-vocabulary KL,
  exact when the rest bucket holds no mass; identical inputs give exactly 0.
- **Perplexity** exp(-mean log p) of the prompt's tokens under teacher forcing (the first token has no
  prediction and is left out by the engines).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

#: A probability below this counts as zero in a rest bucket (float round-off of 1 - sum).
REST_FLOOR = 1e-12

TopK = dict[int, float]  # token id -> natural-log probability


def _rest(mass: float) -> float:
    return max(0.0, 1.0 - mass)


def topk_kl(baseline: TopK, other: TopK) -> float:
    """KL(baseline || other) in nats over the ids in both top-k lists plus one pooled "rest" bucket each side
    (a lower bound on the full-vocabulary KL; 0.0 exactly when the two lists are equal)."""
    if baseline == other:
        return 0.0
    shared = baseline.keys() & other.keys()
    kl, p_mass, q_mass = 0.0, 0.0, 0.0
    for token in shared:
        lp, lq = baseline[token], other[token]
        p = math.exp(lp)
        p_mass += p
        q_mass += math.exp(lq)
        kl += p * (lp - lq)
    p_rest, q_rest = _rest(p_mass), _rest(q_mass)
    if p_rest > REST_FLOOR:
        # baseline mass outside the shared ids that the other side gives (next to) none: the KL is unbounded
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, REST_FLOOR)))
    return max(0.0, kl)


@dataclass(frozen=True)
class GreedyMatch:
    identical: bool
    first_difference: int | None  # 0-based position of the first differing token; None: identical
    compared: int  # positions compared (the shorter sequence)

    @property
    def matched_share(self) -> float:
        """Share of the compared positions before the first difference."""
        if not self.compared:
            return 1.0
        return 1.0 if self.first_difference is None else self.first_difference / self.compared


def greedy_match(baseline: Sequence[int], other: Sequence[int]) -> GreedyMatch:
    """The two greedy sequences compared token by token (a length difference counts as a difference)."""
    n = min(len(baseline), len(other))
    first = next((i for i in range(n) if baseline[i] != other[i]), None)
    if first is None and len(baseline) != len(other):
        first = n
    return GreedyMatch(first is None, first, n)


def comparable_positions(match: GreedyMatch) -> int:
    """Positions whose contexts are identical on both sides: up to and including the first difference."""
    return match.compared if match.first_difference is None else min(match.compared, match.first_difference + 1)


def sequence_kl(baseline: Sequence[TopK], other: Sequence[TopK], match: GreedyMatch) -> list[float]:
    """Per-position KL over the comparable positions (:func:`comparable_positions`)."""
    n = min(comparable_positions(match), len(baseline), len(other))
    return [topk_kl(baseline[i], other[i]) for i in range(n)]


def perplexity(logprobs: Iterable[float | None]) -> float | None:
    """exp(-mean) of the known log-probabilities (None entries, e.g. the first prompt token, left out)."""
    known = [lp for lp in logprobs if lp is not None]
    if not known:
        return None
    return math.exp(-sum(known) / len(known))


@dataclass(frozen=True)
class Divergence:
    """One quantised cell's requests against the baseline cell's same requests."""

    requests: int  # request pairs compared
    identical_share: float  # share of requests whose greedy outputs are identical
    matched_share_mean: float  # mean share of positions before the first difference
    first_difference_min: int | None  # the earliest first difference over the requests (None: all identical)
    kl_mean: float | None  # nats, mean over every comparable position of every request (None: no logprobs)
    kl_max: float | None
    kl_positions: int
    top_k: int  # the k of the engines' top-k lists (0: none returned)
    ppl_baseline: float | None = None  # teacher-forced prompt perplexity (None: no prompt logprobs)
    ppl_other: float | None = None


def compare_requests(baseline: dict[str, dict], other: dict[str, dict]) -> Divergence | None:
    """The divergence of ``other`` from ``baseline``, each {request key: {"tokens": [...], "top": [TopK, ...],
    "prompt_logprobs": [...] or None, "k": int}}, over the keys both hold (None: none in common)."""
    keys = sorted(baseline.keys() & other.keys())
    if not keys:
        return None
    matches, kls, k = [], [], 0
    ppl_b, ppl_o = [], []
    for key in keys:
        b, o = baseline[key], other[key]
        m = greedy_match(b["tokens"], o["tokens"])
        matches.append(m)
        if b.get("top") and o.get("top"):
            kls += sequence_kl(b["top"], o["top"], m)
            k = max(k, int(b.get("k") or 0))
        if b.get("prompt_logprobs") and o.get("prompt_logprobs"):
            ppl_b += [x for x in b["prompt_logprobs"] if x is not None]
            ppl_o += [x for x in o["prompt_logprobs"] if x is not None]
    firsts = [m.first_difference for m in matches if m.first_difference is not None]
    return Divergence(len(keys), sum(m.identical for m in matches) / len(keys),
                      sum(m.matched_share for m in matches) / len(keys), min(firsts) if firsts else None,
                      sum(kls) / len(kls) if kls else None, max(kls) if kls else None, len(kls), k,
                      perplexity(ppl_b), perplexity(ppl_o))
