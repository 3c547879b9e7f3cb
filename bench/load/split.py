"""Splitting one cell over several load processes (bench/load/workers.py): counts and prompts."""
from __future__ import annotations


def split_count(total: int, parts: int) -> list[int]:
    """``total`` split over ``parts`` as evenly as possible, larger shares first: 5 over 2 -> [3, 2]."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def deal(items: list, weights: list[int]) -> list[list]:
    """``items`` dealt out in order, worker w taking ``weights[w]`` of every ``sum(weights)``: weights
    [3, 2] deal 0, 1, 0, 1, 0, 0, 1, 0, 1, 0, ... (interleaved, so every worker gets early and late items)."""
    order = []
    left = list(weights)
    while any(left):
        for w in range(len(left)):
            if left[w]:
                order.append(w)
                left[w] -= 1
    out: list[list] = [[] for _ in weights]
    for i, item in enumerate(items):
        out[order[i % len(order)]].append(item)
    return out
