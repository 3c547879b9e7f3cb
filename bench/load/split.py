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


#: The most load processes of one run: ``--load-share I/N``'s N (the owner keeps a set of the N shares,
#: ``kvbench merge`` a list per share; a count of 20 digits once grew one process to all the machine's
#: memory) and ``--load-workers`` (processes spawned on one machine).
MAX_SHARES = 1024
MAX_WORKERS = 256


def processes_used(load, processes: int) -> int:
    """The most of ``processes`` load processes any cell of ``load`` (a workload's load profile, its points
    known up front) gives requests to: the profiles split a cell over at most its requests, its closed-loop
    streams or its open-loop cap. A process beyond it would send nothing in every cell."""
    used = 0
    for point in load.points():
        n = min(load.requests_per_cell(point), processes)  # the split's width needs no more prompts than this
        used = max(used, len(point.driver.shares(list(range(n)), point, 0, processes)) if n else 0)
    return used
