"""A static tree whose shape an online tuner picks (engine/tuning/online.py): the tuner's plan each
step, verified whole (the budget offers it as it is); the tuner records the outcomes itself
(engine/drafting/step.py:accept_step), so the tenant's node rates learn nothing from it."""

from __future__ import annotations

from .static import StaticTree
from ...sequence import Sequence
from ..step import Draft
from ...tr.accept import Acceptance
from ...tuning.online import StepPlan


class TunedTree(StaticTree):
    name = "tuned"

    def takes(self, live: Sequence) -> bool:
        return live.tuner is not None

    def plan(self, live: Sequence) -> StepPlan:
        return live.tuner.plan()

    def learn(self, live: Sequence, draft: Draft, acc: Acceptance) -> None:
        pass
