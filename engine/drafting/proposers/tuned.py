"""A static tree whose shape an online tuner picks (engine/tuning/online.py): the tuner's plan each
step, verified whole (its one option); what it learns is the tuner's: its exploration steps into the
tuner's log (which re-tunes when due), its other steps into the caller's acceptance log where it
keeps one. The tenant's node rates learn nothing from it."""

from __future__ import annotations

from .base import Offer, StepInfo
from .static import StaticTree, static_chain
from ...sequence import Sequence
from ..step import Draft, record_step
from ...tr.accept import Acceptance
from ..budget.choose import Option
from ...tuning.online import StepPlan


class TunedTree(StaticTree):
    name = "tuned"

    def takes(self, seq: Sequence) -> bool:
        return seq.drafting.tuner is not None

    def plan(self, seq: Sequence) -> StepPlan:
        return seq.drafting.tuner.plan()

    def offer(self, seq: Sequence, step: StepInfo) -> Offer:
        """The tuner's plan as it is, with its whole chain: one option, the budget has nothing to choose."""
        plan = self.plan(seq)
        proposal, source = static_chain(seq.drafting.lookup, seq.drafting.session.history, plan.tree.template.lookup)
        chain = len(proposal.tokens) if proposal is not None else 0
        options = self.budget.price(seq, [Option(plan.tree.n + chain, 1.0, None, chain)], step)
        return Offer(options, lambda option: self._draft(seq, plan, proposal, source, option))

    def learn(self, seq: Sequence, draft: Draft, acc: Acceptance, past: int) -> None:
        if draft.plan.explore:
            record_step(seq.drafting.tuner.log, draft, acc, past)
            seq.drafting.tuner.recorded()
        elif seq.drafting.log is not None:
            record_step(seq.drafting.log, draft, acc, past)
