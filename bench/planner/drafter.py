"""Speculative decoding in a deployment: the drafter beside the model (:class:`Drafter`, which
:class:`kvbench.planner.deploy.Setup` extends). Where the drafter's KV lives is the engine's
(:meth:`kvbench.kv.rules.KVRules.draft_kv`); this module asks it and never switches on an engine's name."""
from __future__ import annotations

import functools
from dataclasses import replace

from kvbench.kv.rules import KVQuestion, KVRuleError

from .resolve import build_speculation
from .shared import PlanError


class Drafter:
    """The drafter's part of a deployment (a mixin of Setup: its fields ``spec_method``, ``draft_model``,
    ``spec_tokens``, ``draft_label`` and the deployment's rules, split and questions)."""

    # --- speculative decoding: the drafter beside the model (KVRules.draft_kv says where its KV lives) ------------
    @functools.cached_property
    def speculation(self):
        """The drafter (a :class:`kvbench.kv.speculative.Speculation`), its weights as this engine serves them."""
        if not self.spec_method or self.spec_method == "none":
            return None
        return build_speculation(self.model, self.rules, self.capability, self.spec_method, self.draft_model,
                                 self.spec_tokens, self.draft_label)

    def draft(self, context: int | None = None, batch: int | None = None, limit: int | None = None):
        """Where the engine keeps the drafter's KV for the deployment and what it costs one GPU (a DraftKV); None
        without speculation or where the engine has none of this method."""
        spec = self.speculation
        if spec is None:
            return None
        try:
            return self.rules.draft_kv(self.question(context, batch), spec, limit or self.limit)
        except KVRuleError as exc:
            raise PlanError(f"--speculative {spec.method}: {exc}") from None

    @functools.cached_property
    def draft_terms(self) -> tuple[tuple[str, float, str], ...]:
        """Per GPU, what the drafter adds beside its KV: its weights (beyond the target's) and the engine's own
        terms for it (llama.cpp's draft compute buffer)."""
        spec = self.speculation
        d = self.draft(context=self.limit)
        if spec is None or d is None:
            return ()
        weights = (spec.weights_bytes or 0.0) / (self.tp * self.pp)
        return (("draft weights", weights, spec.weights_source), *d.terms)

    @property
    def spec_fixed(self) -> float:
        return sum(b for _, b, _ in self.draft_terms)

    def bytes_per_block(self, q: KVQuestion) -> float:
        """A pool block's bytes (engines that size a pool from a budget), the drafter's pages at the price the
        engine's pool gives them included."""
        per = self.rules.bytes_per_block(q)
        spec = self.speculation
        d = self.rules.draft_kv(q, spec, q.context) if spec is not None else None
        if d is None:
            return per
        return per + d.pool_price * self.rules.answer(replace(q, context=1, batch=1)).tokens_full

