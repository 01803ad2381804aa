"""Trees grown by confidence (engine/tr/dynamic.py): best-first from the matrix rows of the request's
private copy, with chains from its own context and its tenant's history; a dynamic tree, no tuner."""

from __future__ import annotations

from trserve.engine.handover import pending
from trserve.engine.proposers.base import Shapes, StepInfo
from trserve.engine.scheduler import Live
from trserve.engine.step import Draft, grown_draft
from trserve.engine.tr.accept import Acceptance
from trserve.engine.tr.dynamic import CONTEXT, HISTORY, Chain, Grown, best_first_score, grow
from trserve.engine.tree_budget import Option, TreeBudget

HAND_OVER = 16  # plain steps' rows a sequence growing no tree keeps before handing them to its session


class GrownTrees:
    name = "grown"

    def __init__(self, budget: TreeBudget, shapes: Shapes) -> None:
        self.budget, self.shapes = budget, shapes

    def takes(self, live: Live) -> bool:
        """A dynamic tree, no tuner, and a session whose private copy holds the tenant's rows."""
        return bool(live.tree.template.dynamic) and live.seq.tuner is None and live.session.local_drafts

    def offer(self, live: Live, step: StepInfo) -> tuple[Grown, list[Option]]:
        grown = self._grow(live, step.floor)
        return grown, self.budget.grown_options(live, grown, step.b, step.kv)

    def draft(self, live: Live, stage: Grown, option: Option) -> Draft:
        size = option[2]
        return grown_draft(stage, size, self.shapes.of_parents(live.tree.template, stage.parent[:size]),
                           self.shapes.device)

    def learn(self, live: Live, draft: Draft, acc: Acceptance) -> None:
        """The nodes' outcomes into the tenant's calibration; the request's own expected and accepted
        drafted tokens (its trust, TreeBudget.trust)."""
        w = draft.tokens.shape[0]
        self.budget.rates.calibration(live).record(draft.grown.bins[:w], draft.grown.parent[:w], acc.path)
        live.predicted += draft.grown.expected(w) - 1
        live.realized += len(acc.path) - 1

    def _grow(self, live: Live, floor: float) -> Grown:
        """This step's grown tree for `live`, or its root alone when no node can score `floor` (the
        budget's row floor for this batch): the root's matrix row and the chains are checked first,
        and a chain source whose calibrated best is below the floor is not even looked up, so a plain
        step stays nearly as cheap as an AR one. A tree takes the session's pending rows first, so it
        drafts from them at once; plain steps hand them over only every HAND_OVER rows."""
        session, seq = live.session, live.seq
        m, template = session.matrix, live.tree.template
        rows, probs = m.host_views()  # [V, K] each
        calib = self.budget.rates.calibration(live)
        chains = []
        if calib.best_rate(CONTEXT) >= floor:
            chains.append(Chain.of(seq.lookup.propose(template.lookup), CONTEXT))
        if calib.best_rate(HISTORY) >= floor:
            chains.append(self._history(live))
        chains = [c for c in chains if c is not None]
        if best_first_score(rows, probs, live.root, calib, chains) * self.budget.trust(live) < floor:
            if len(live.plain) >= HAND_OVER:
                session.update(pending(live))
            return Grown([live.root], [0], [0], [-1], [1.0])
        session.update(pending(live))
        return grow(rows, probs, live.root, calib, chains, template.dynamic)

    @staticmethod
    def _history(live: Live) -> Chain | None:
        """A continuation from the tenant's earlier requests (its session's history), if it has one."""
        history = live.session.history
        if history is None:
            return None
        return Chain.of(history.propose(live.seq.lookup.tail(history.max_ngram), live.tree.template.dynamic), HISTORY)
