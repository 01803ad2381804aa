"""A static tree drafted from the request's session (the matrix tree of its template), cut to the size
the budget picks, with a lookup chain grafted on: the request's own context's or its tenant's
history's, whichever matched the longer suffix."""

from __future__ import annotations

import torch

from ..handover import pending
from .base import Shapes, StepInfo
from ...sequence import Sequence
from ..step import Draft, draft_step
from ...tr.accept import Acceptance
from ..dynamic import CONTEXT, HISTORY
from ...tr.history import SuffixHistory
from ...tr.lookup import ContextLookup, Proposal
from ..budget.tree import Option, TreeBudget
from ..budget.choose import chain_kind
from ...tuning.online import StepPlan

Stage = tuple[StepPlan, Proposal | None, int]  # the base plan, its chain's proposal, where the chain came from


class StaticTree:
    name = "static"

    def __init__(self, budget: TreeBudget, shapes: Shapes) -> None:
        self.budget, self.shapes = budget, shapes

    def takes(self, live: Sequence) -> bool:
        return True  # any TR request the methods before it do not take

    def plan(self, live: Sequence) -> StepPlan:
        """The base tree this step: the request's own."""
        return StepPlan(live.tree, None, explore=False)

    def offer(self, live: Sequence, step: StepInfo) -> tuple[Stage, list[Option]]:
        plan = self.plan(live)
        proposal, source = static_chain(live.lookup, live.session.history, plan.tree.template.lookup)
        return (plan, proposal, source), self.budget.options(live, plan, proposal, step.b, step.kv, source == HISTORY)

    def draft(self, live: Sequence, stage: Stage, option: Option) -> Draft:
        """Its base tree cut to the option's size (None: the plan as it is) and the option's chain tokens.
        Only a sequence that verifies a tree drafts (and hands over its pending rows) this step: a plain
        step costs a TR request no more than an AR one."""
        plan, proposal, source = stage
        _, _, size, chain = option
        drafted = live.session.step(pending(live), live.root)  # [n_draft]
        if size is not None and size < plan.tree.n:
            sub = self.shapes.cut(plan.tree, size)
            plan = StepPlan(sub, torch.arange(sub.n, device=self.shapes.device), explore=False)
        if proposal is not None and chain and chain < len(proposal.tokens):
            proposal = Proposal(proposal.tokens[:chain], proposal.ngram)
        return draft_step(live, drafted, plan, proposal, lookup=bool(chain), source=source)

    def learn(self, live: Sequence, draft: Draft, acc: Acceptance) -> None:
        """Which base nodes and chain tokens were accepted, into the tenant's node rates."""
        rates = self.budget.rates.node_rates(live)
        n_base = draft.plan.tree.n
        base_path = [i for i in acc.path if i < n_base]
        chain = draft.tokens.shape[0] - n_base
        kind = chain_kind(draft.chain_source == HISTORY, draft.grafted.ngram) if draft.grafted is not None else 0
        rates.record(n_base, base_path, chain, sum(i >= n_base for i in acc.path), kind)  # chain nodes accepted


def static_chain(lookup: ContextLookup, history: SuffixHistory | None, caps: tuple[int, ...]
                 ) -> tuple[Proposal | None, int]:
    """A static tree's chain (TreeTemplate.lookup: `caps`): the request's own proposal (`lookup`) or its
    tenant's `history`'s, whichever matched the longer suffix (a tie: the request's own), each cut to
    caps[n - 1] for its match size n, with the source it came from (CONTEXT or HISTORY). Sizes past
    the template's longest count as its longest, as the request's own are (the tuner's records too)."""
    own = lookup.propose(caps)
    if history is None or not caps or (own is not None and own.ngram >= len(caps)):  # nothing can match longer
        return own, CONTEXT
    earlier = history.propose(lookup.tail(history.max_ngram), max(caps))
    n = 0 if earlier is None else min(earlier.ngram, len(caps))
    if n == 0 or (own is not None and own.ngram >= n) or caps[n - 1] == 0:
        return own, CONTEXT
    return Proposal(earlier.tokens[:caps[n - 1]], n), HISTORY
