"""A static tree whose shape an online tuner picks (engine/tuning/online.py): the tuner's plan each
step, verified whole (its one option); what it learns is the tuner's: its exploration steps into the
tuner's log (which re-tunes when due), its other steps into the caller's acceptance log where it
keeps one. The tenant's node rates learn nothing from it."""

from __future__ import annotations

from .static import StaticTree
from ...sequence import Sequence
from ..step import Draft, record_step
from ...tr.accept import Acceptance
from ...tr.lookup import Proposal
from ..budget.choose import Option
from ...tuning.online import StepPlan


class TunedTree(StaticTree):
    name = "tuned"

    def takes(self, seq: Sequence) -> bool:
        return seq.drafting.tuner is not None

    def plan(self, seq: Sequence) -> StepPlan:
        return seq.drafting.tuner.plan()

    def _options(self, seq: Sequence, plan: StepPlan, proposal: Proposal | None, source: int) -> list[Option]:
        """The tuner's plan as it is, with its whole chain: one option, the budget has nothing to choose."""
        chain = len(proposal.tokens) if proposal is not None else 0
        return [Option(plan.tree.n + chain, 1.0, None, chain)]

    def learn(self, seq: Sequence, draft: Draft, acc: Acceptance, past: int) -> None:
        if draft.plan.explore:
            record_step(seq.drafting.tuner.log, draft, acc, past)
            seq.drafting.tuner.recorded()
        elif seq.drafting.log is not None:
            record_step(seq.drafting.log, draft, acc, past)
