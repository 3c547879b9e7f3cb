"""The cells of a run and the prompts of each cell, from a workload (no engine involved).

A cell is one (server variant, prompt length, load point, repeat[, turn]). Each request's prompt is built
when the load takes it (:class:`CellPromptList`: a cell of 10^6 requests holds none up front), from the
seed, the run's prompt salt and a request id that names the rung, load point, repeat and request, so the
same model gives the same prompts on every engine of a run. The salt keeps two
runs from sharing a prefix (a server kvbench attaches to has cached the last run's prompts): each run draws
its own, unless it is pinned (``--prompt-salt TEXT``) or switched off (``--prompt-salt none``: the prompts
of every earlier unsalted run, token for token).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from kvbench.load import LoadPoint, profile_class
from kvbench.run.prompt_salt import UNSALTED, PromptSalt
from kvbench.workloads import Workload
from kvbench.workloads.prompts import Prompt, PromptBuilder


@dataclass(frozen=True)
class Cell:
    prompt_tokens: int  # the rung: a prompt's length (multi_turn: new user tokens per turn)
    load: LoadPoint
    repeat: int = 0
    turn: int = 0  # multi_turn: 1..turns
    prefix_caching: bool | None = None  # the server variant the cell runs on
    kv_dtype: str | None = None  # kv_quant: the KV dtype of the engine start the cell runs on
    requests: int = field(kw_only=True)  # prompts the cell sends, set where the cell is planned
    kind: str = field(default="", kw_only=True)  # speculation: the prompt kind ("copy", "free"; "": the one)

    @property
    def variant(self) -> str:
        parts = []
        if self.prefix_caching is not None:
            parts.append(f"prefix_caching={'on' if self.prefix_caching else 'off'}")
        if self.kv_dtype is not None:
            parts.append(f"kv_dtype={self.kv_dtype}")
        if self.turn:
            parts.append(f"turn={self.turn}")
        if self.kind:
            parts.append(f"prompt={self.kind}")
        return ",".join(parts)

    def cell_id(self, label: str) -> str:
        parts = [label]
        if self.prefix_caching is not None:
            parts.append("pc1" if self.prefix_caching else "pc0")
        if self.kv_dtype is not None:
            parts.append(f"kv-{self.kv_dtype}")
        parts += [f"p{self.prompt_tokens}", self.load.slug]
        if self.turn:
            parts.append(f"t{self.turn}")
        if self.kind:
            parts.append(self.kind)
        parts.append(f"r{self.repeat}")
        return "_".join(parts)

    def describe(self) -> str:
        """For the progress bar: ``1024 tok x4``, ``512 tok turn 2 poisson 2/s, <=8 #2``."""
        turn = f" turn {self.turn}" if self.turn else f" {self.kind}" if self.kind else ""
        return (f"{self.prompt_tokens} tok{turn} "
                f"{load_label(self.load.profile, self.load.concurrency, self.load.request_rate)}"
                + (f" #{self.repeat + 1}" if self.repeat else ""))


def load_label(profile: str, concurrency: int | None, request_rate: float | None) -> str:
    """How a cell's load is written for people, everywhere (console, reports, compare): ``x4`` for a closed
    loop of 4, ``poisson 2.5/s, <=8`` for an open loop at 2.5 requests/s capped at 8 in flight."""
    return profile_class(profile).label(concurrency, request_rate)


def server_variants(workload: Workload) -> list[bool | None]:
    """One engine start per prefix-caching setting the workload asks for ([None]: the engine's default)."""
    return list(workload.prefix_caching) or [None]


def cells_for(workload: Workload, lengths: list[int], points: list[LoadPoint], repeat: int,
              prefix_caching: bool | None, kv_dtype: str | None = None) -> list[Cell]:
    """The cells of one repeat on one server variant, in the order they run."""
    turns = range(1, workload.turns + 1) if workload.family == "multi_turn" else [0]
    return [Cell(p, point, repeat, t, prefix_caching, kv_dtype,
                 requests=workload.load.requests_per_cell(point), kind=kind)
            for p in lengths for point in points for t in turns for kind in workload.kinds()]


class NothingFits(ValueError):
    pass


def fitting_lengths(workload: Workload, max_context: int) -> list[int]:
    """The workload's prompt lengths that fit ``max_context``; NothingFits where none does."""
    lengths = workload.prompt_lengths(max_context)
    if not lengths:
        raise NothingFits(f"no prompt length of {workload.name} fits the context limit {max_context}")
    return lengths


@dataclass(frozen=True)
class RunPlan:
    """What a run will do, worked out before any engine starts: the prompt lengths that fit the context,
    the load points known up front, the repeats, and the room every engine start needs."""

    workload: Workload
    max_context: int  # the model's limit, capped by --max-context
    lengths: tuple[int, ...]
    skipped: tuple[int, ...]  # the workload's lengths that do not fit
    points: tuple[LoadPoint, ...]
    repeats: int

    @classmethod
    def make(cls, workload: Workload, model_max_context: int | None, cap: int | None = None,
             repeats: int | None = None) -> "RunPlan":
        max_context = min(model_max_context or 2048, cap or 10**9)
        lengths = fitting_lengths(workload, max_context)
        skipped = [n for n in workload.prompt_tokens if n != "max" and n not in lengths]
        return cls(workload, max_context, tuple(lengths), tuple(skipped), tuple(workload.load.points()),
                   repeats or workload.repeats)

    @property
    def variants(self) -> list[bool | None]:
        return server_variants(self.workload)

    @property
    def server_context(self) -> int:
        """Tokens one sequence may hold: the longest prompt plus the output."""
        return self.workload.longest_prompt(max(self.lengths)) + self.workload.output_tokens

    @property
    def server_concurrency(self) -> int:
        return self.workload.load.max_in_flight()

    def cells(self, prefix_caching: bool | None, kv_dtype: str | None = None) -> list[Cell]:
        """Every cell of one engine start (all repeats), in the order they run; a profile that finds its
        points by measuring (a saturation sweep) adds them as its cells run (:meth:`cells_after`)."""
        return [c for r in range(self.repeats)
                for c in cells_for(self.workload, list(self.lengths), list(self.points), r, prefix_caching, kv_dtype)]

    def cells_after(self, ran: Cell, achieved_rate: float) -> list[Cell]:
        """The cells the load profile adds after ``ran``, which achieved ``achieved_rate`` requests/s (a
        saturation sweep's rates after its closed loop; none for most profiles)."""
        return [replace(ran, load=p, requests=self.workload.load.requests_per_cell(p))
                for p in self.workload.load.points_after(ran.load, achieved_rate)]

    @property
    def cells_per_start(self) -> int:
        """Cells one engine start runs, the points found later included (for the progress bar)."""
        turns = self.workload.turns if self.workload.family == "multi_turn" else len(self.workload.kinds())
        later = self.workload.load.points_found_later()
        return len(self.cells(None)) + self.repeats * len(self.lengths) * later * turns


class CellPrompts:
    """Builds each cell's prompts from the workload's seed and the run's salt."""

    def __init__(self, builder: PromptBuilder, workload: Workload, salt: PromptSalt = UNSALTED):
        self.builder, self.w, self.salt = builder, workload, salt
        self._prefix = (builder.draw(workload.shared_prefix_tokens, workload.seed, "shared-prefix", self._token_salt)
                        if workload.shared_prefix_tokens else None)

    @property
    def _token_salt(self) -> str | None:
        return self.salt.value if self.salt.in_tokens else None

    def _salted(self, prompt: Prompt) -> Prompt:
        if self.salt.value and not self.salt.in_tokens:
            return replace(prompt, cache_salt=self.salt.value)
        return prompt

    def build(self, n_tokens: int, key: str, output_tokens: int) -> Prompt:
        """One prompt of the run outside the cells (a calibration or tokenizer probe), salted like them."""
        return self._salted(self.builder.build(n_tokens, self.w.seed, key, output_tokens, salt=self._token_salt))

    def for_cell(self, cell: Cell, n_requests: int) -> "CellPromptList":
        """The cell's ``n_requests`` prompts, each built when the load asks for it (:class:`CellPromptList`)."""
        if self.w.family == "kv_quant" and self.w.prompt_text == "kjv":
            from kvbench.workloads.texts import kjv_genesis

            kjv_genesis()  # read (and checked) now: a missing text fails the cell before its first request
        prompts = CellPromptList(self, cell, n_requests)
        if n_requests:
            prompts[0]  # noqa: B018 - a cell that cannot have its prompts fails here, before any is sent
        return prompts

    def prompt(self, cell: Cell, i: int) -> Prompt:
        """Request ``i`` of ``cell`` (its ordinal): deterministic in (seed, salt, cell, i), so built alone, in
        any order."""
        return replace(self._salted(self._prompt(cell, i)), ordinal=i)

    def _prompt(self, cell: Cell, i: int) -> Prompt:
        w = self.w
        # the prefix-caching variant is not in the key: both variants send identical prompts
        key, salt = f"p{cell.prompt_tokens}-{cell.load.slug}-r{cell.repeat}", self._token_salt
        if w.family == "multi_turn":
            # A conversation is one long seeded token sequence: user text, a stand-in reply of
            # output_tokens, user text, ... Turn t sends everything up to its own user text, so each turn's
            # prompt extends the previous one (the stand-in replies keep every engine's prompts identical).
            length = w.prompt_tokens_sent(cell.prompt_tokens, cell.turn)
            words = self.builder.draw(w.longest_prompt(cell.prompt_tokens), w.seed, f"{key}-conv{i}", salt)
            return self.builder.from_words(words[:length], f"{key}-conv{i}-t{cell.turn}", w.output_tokens)
        if w.family == "kv_quant":  # the same prompts on every KV dtype: the dtype is not in the key
            natural = w.prompt_text == "kjv"
            if natural:
                from kvbench.workloads.texts import kjv_genesis

                prompt = self.builder.from_text(kjv_genesis(), cell.prompt_tokens, w.seed, f"{key}-{i}",
                                                w.output_tokens)
            else:
                prompt = self.builder.build(cell.prompt_tokens, w.seed, f"{key}-{i}", w.output_tokens, None, salt)
            return replace(prompt, top_logprobs=w.top_logprobs, prompt_logprobs=natural)
        if cell.kind == "copy":  # a passage given twice: what follows is the passage again
            passage = self.builder.draw((cell.prompt_tokens + 1) // 2, w.seed, f"{key}-copy-{i}", salt)
            words = np.concatenate([passage, passage])[:cell.prompt_tokens]
            return self.builder.from_words(words, f"{key}-copy-{i}", w.output_tokens)
        if cell.kind == "free":  # its own key: the copy cell's prompts are not these
            return self.builder.build(cell.prompt_tokens, w.seed, f"{key}-free-{i}", w.output_tokens, None, salt)
        return self.builder.build(cell.prompt_tokens, w.seed, f"{key}-{i}", w.output_tokens, self._prefix, salt)

    def warmup(self) -> list[Prompt]:
        return [self.build(self.w.warmup_prompt_tokens, f"warmup-{i}", 8) for i in range(self.w.warmup_requests)]


class CellPromptList(Sequence):
    """A cell's prompts as a sequence whose items are built when asked for (indexing, iterating) and not
    kept: a cell of 10^6 requests holds none up front (building them all first took 40 s and 2.2 GB), and
    prompt i is the same however often and in whatever order it is built. Equal to any sequence of the
    same prompts."""

    def __init__(self, source: CellPrompts, cell: Cell, n_requests: int):
        self.source, self.cell, self.n = source, cell, n_requests

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self.source.prompt(self.cell, i) for i in range(*index.indices(self.n))]
        i = index + self.n if index < 0 else index
        if not 0 <= i < self.n:
            raise IndexError(f"prompt {index} of a cell of {self.n}")
        return self.source.prompt(self.cell, i)

    def __iter__(self) -> Iterator[Prompt]:
        return (self.source.prompt(self.cell, i) for i in range(self.n))

    def __eq__(self, other) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other))

    __hash__ = None  # equal to lists, which have none

    def __repr__(self) -> str:
        return f"CellPromptList({self.cell.describe()!r}, {self.n} prompts)"
