"""The cells of a run and the prompts of each cell, from a workload (no engine involved).

A cell is one (server variant, prompt length, load point, repeat[, turn]). Prompts are built per cell,
just before it runs, from the seed and a request id that names the rung, load point, repeat and request,
so the same model gives the same prompts on every engine and every run.
"""
from __future__ import annotations

from dataclasses import dataclass

from bench.load import LoadPoint
from workloads import Workload
from workloads.prompts import Prompt, PromptBuilder


@dataclass(frozen=True)
class Cell:
    prompt_tokens: int  # the rung: a prompt's length (multi_turn: new user tokens per turn)
    load: LoadPoint
    repeat: int = 0
    turn: int = 0  # multi_turn: 1..turns
    prefix_caching: bool | None = None  # the server variant the cell runs on

    @property
    def variant(self) -> str:
        parts = []
        if self.prefix_caching is not None:
            parts.append(f"prefix_caching={'on' if self.prefix_caching else 'off'}")
        if self.turn:
            parts.append(f"turn={self.turn}")
        return ",".join(parts)

    def cell_id(self, label: str) -> str:
        parts = [label]
        if self.prefix_caching is not None:
            parts.append("pc1" if self.prefix_caching else "pc0")
        parts += [f"p{self.prompt_tokens}", self.load.slug]
        if self.turn:
            parts.append(f"t{self.turn}")
        parts.append(f"r{self.repeat}")
        return "_".join(parts)

    def describe(self) -> str:
        turn = f" turn {self.turn}" if self.turn else ""
        return f"{self.prompt_tokens} tok{turn} {self.load.slug}" + (f" #{self.repeat + 1}" if self.repeat else "")


def server_variants(workload: Workload) -> list[bool | None]:
    """One engine start per prefix-caching setting the workload asks for ([None]: the engine's default)."""
    return list(workload.prefix_caching) or [None]


def cells_for(workload: Workload, lengths: list[int], points: list[LoadPoint], repeat: int,
              prefix_caching: bool | None) -> list[Cell]:
    """The cells of one repeat on one server variant, in the order they run."""
    turns = range(1, workload.turns + 1) if workload.family == "multi_turn" else [0]
    return [Cell(p, point, repeat, t, prefix_caching) for p in lengths for point in points for t in turns]


class CellPrompts:
    """Builds each cell's prompts from the workload's seed."""

    def __init__(self, builder: PromptBuilder, workload: Workload):
        self.builder, self.w = builder, workload
        self._prefix = (builder.draw(workload.shared_prefix_tokens, workload.seed, "shared-prefix")
                        if workload.shared_prefix_tokens else None)

    def for_cell(self, cell: Cell, n_requests: int) -> list[Prompt]:
        w = self.w
        # the prefix-caching variant is not in the key: both variants send identical prompts
        key = f"p{cell.prompt_tokens}-{cell.load.slug}-r{cell.repeat}"
        if w.family == "multi_turn":
            # A conversation is one long seeded token sequence: user text, a stand-in reply of
            # output_tokens, user text, ... Turn t sends everything up to its own user text, so each turn's
            # prompt extends the previous one (the stand-in replies keep every engine's prompts identical).
            length = w.prompt_tokens_sent(cell.prompt_tokens, cell.turn)
            out = []
            for i in range(n_requests):
                words = self.builder.draw(w.longest_prompt(cell.prompt_tokens), w.seed, f"{key}-conv{i}")
                out.append(self.builder.from_words(words[:length], f"{key}-conv{i}-t{cell.turn}", w.output_tokens))
            return out
        return [self.builder.build(cell.prompt_tokens, w.seed, f"{key}-{i}", w.output_tokens, self._prefix)
                for i in range(n_requests)]

    def warmup(self) -> list[Prompt]:
        return [self.builder.build(self.w.warmup_prompt_tokens, self.w.seed, f"warmup-{i}", 8)
                for i in range(self.w.warmup_requests)]
