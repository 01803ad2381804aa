"""A static tree drafted from the request's session (the matrix tree of its template), cut to the size
the budget picks, with a lookup chain grafted on: the request's own context's or its tenant's
history's, whichever matched the longer suffix."""

from __future__ import annotations

import torch

from ..handover import pending
from .base import Offer, Shapes, StepInfo
from ...sequence import Sequence
from ..step import Draft, draft_step, record_step
from ...tr.accept import Acceptance
from ..dynamic import CONTEXT, HISTORY
from ...tr.history import SuffixHistory
from ...tr.lookup import ContextLookup, Proposal
from ..budget.tree import SIZES, TreeBudget
from ..budget.choose import Option, chain_kind
from ...tuning.online import StepPlan


class StaticTree:
    name = "static"

    def __init__(self, budget: TreeBudget, shapes: Shapes) -> None:
        self.budget, self.shapes = budget, shapes

    def takes(self, seq: Sequence) -> bool:
        return True  # any TR request the methods before it do not take

    def start(self, seq: Sequence) -> None:
        return None  # what it learns is the tenant's (its node rates), not the request's

    def plan(self, seq: Sequence) -> StepPlan:
        """The base tree this step: the request's own."""
        return StepPlan(seq.drafting.tree, None, explore=False)

    def offer(self, seq: Sequence, step: StepInfo) -> Offer:
        """Plain decoding, and its base tree's BFS prefixes of SIZES nodes up to the whole, each with cuts
        of its chain, priced at the tenant's node and chain rates (the chain's kind: its source, the
        request's own context or with HISTORY its tenant's history, and its suffix match's size)."""
        plan = self.plan(seq)
        proposal, source = static_chain(seq.drafting.lookup, seq.drafting.session.history, plan.tree.template.lookup)
        options = self._options(seq, plan, proposal, source)
        return Offer(self.budget.price(seq, options, step), lambda option: self._draft(seq, plan, proposal, source, option))

    def _options(self, seq: Sequence, plan: StepPlan, proposal: Proposal | None, source: int) -> list[Option]:
        """Plain decoding and the plan's priced cuts, the whole plan with its whole chain last."""
        chain = len(proposal.tokens) if proposal is not None else 0
        kind = chain_kind(source == HISTORY, proposal.ngram) if proposal is not None else 0
        n = plan.tree.n
        return self.budget.rates.node_rates(seq).options([s for s in SIZES if s < n] + [n], chain, kind)

    def _draft(self, seq: Sequence, plan: StepPlan, proposal: Proposal | None, source: int, option: Option) -> Draft:
        """Its base tree cut to the option's size (None: the plan as it is) and the option's chain tokens.
        Only a sequence that verifies a tree drafts (and hands over its pending rows) this step: a plain
        step costs a TR request no more than an AR one."""
        drafted = seq.drafting.session.step(pending(seq), seq.root)  # [n_draft]
        if option.size is not None and option.size < plan.tree.n:
            sub = self.shapes.cut(plan.tree, option.size)
            plan = StepPlan(sub, torch.arange(sub.n, device=self.shapes.device), explore=False)
        chain = option.chain
        if proposal is not None and chain and chain < len(proposal.tokens):
            proposal = Proposal(proposal.tokens[:chain], proposal.ngram)
        return draft_step(seq, drafted, plan, proposal, lookup=bool(chain), source=source)

    def learn(self, seq: Sequence, draft: Draft, acc: Acceptance, past: int) -> None:
        """Which base nodes and chain tokens were accepted, into the tenant's node rates; the step into
        the caller's acceptance log where it keeps one (its tree optimiser's records)."""
        rates = self.budget.rates.node_rates(seq)
        n_base = draft.plan.tree.n
        base_path = [i for i in acc.path if i < n_base]
        chain = draft.tokens.shape[0] - n_base
        kind = chain_kind(draft.chain_source == HISTORY, draft.grafted.ngram) if draft.grafted is not None else 0
        rates.record(n_base, base_path, chain, sum(i >= n_base for i in acc.path), kind)  # chain nodes accepted
        if seq.drafting.log is not None:
            record_step(seq.drafting.log, draft, acc, past)


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
