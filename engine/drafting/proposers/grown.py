"""Trees grown by confidence (engine/drafting/dynamic.py): best-first from the matrix rows of the request's
private copy, with chains from its own context and its tenant's history; a dynamic tree, no tuner."""

from __future__ import annotations

from dataclasses import dataclass

from ..handover import pending
from .base import Offer, Shapes, StepInfo
from ...sequence import Sequence
from ..step import Draft, grown_draft
from ...tr.accept import Acceptance
from ..dynamic import CONTEXT, HISTORY, Chain, Grown, best_first_score, grow
from ..budget.tree import SIZES, TreeBudget
from ..budget.choose import PLAIN, Option

HAND_OVER = 16  # plain steps' rows a sequence growing no tree keeps before handing them to its session
TRUST_PRIOR = 4.0  # drafted tokens a request's trees are assumed to have met before it has verified any
TRUST_CAP = 1.25  # a request that beats its calibration is priced at most this much above it


@dataclass
class Trust:
    """One request's grown trees so far (its `drafting` state, this proposer's only): drafted tokens
    expected (the calibrated scores of the nodes verified) and accepted."""

    predicted: float = 0.0
    realized: float = 0.0

    def value(self) -> float:
        """How far the request's own trees met their calibrated expectation: accepted over expected
        drafted tokens, with a prior of TRUST_PRIOR tokens met in full, at most TRUST_CAP. The tenant's
        calibration averages over all its traffic; one request (a math question in a tenant that mostly
        chats) may accept far less, and its trees are then priced at what it actually accepts.
        Example: 12 tokens expected and 4 accepted over its trees so far -> (4 + 4) / (12 + 4) = 0.5:
        a tree expected to add 1.2 tokens is priced at 0.6."""
        return min((self.realized + TRUST_PRIOR) / (self.predicted + TRUST_PRIOR), TRUST_CAP)


class GrownTrees:
    name = "grown"

    def __init__(self, budget: TreeBudget, shapes: Shapes) -> None:
        self.budget, self.shapes = budget, shapes

    def takes(self, seq: Sequence) -> bool:
        """A dynamic tree, no tuner, and a session whose private copy holds the tenant's rows."""
        drafting = seq.drafting
        return bool(drafting.tree.template.dynamic) and drafting.tuner is None and drafting.session.local_drafts

    def start(self, seq: Sequence) -> Trust:
        return Trust()

    def offer(self, seq: Sequence, step: StepInfo) -> Offer:
        trust = seq.drafting.state.value()
        grown = self._grow(seq, step.floor, trust)
        options = self.budget.price(seq, self.options(grown, trust), step)
        template = seq.drafting.tree.template
        return Offer(options, lambda option: grown_draft(
            grown, option.size, self.shapes.of_parents(template, grown.parent[:option.size]), self.shapes.device))

    @staticmethod
    def options(grown: Grown, trust: float = 1.0) -> list[Option]:
        """Plain decoding, then the grown tree's first w nodes for the sizes up to its whole (expected
        tokens: 1 + the sum of their scores, engine/drafting/dynamic.py, each drafted token's worth
        scaled by `trust`: how far the request's own trees met their scores)."""
        sizes = [w for w in SIZES if w < grown.n] + [grown.n]
        return [PLAIN] + [Option(w, 1 + trust * (grown.expected(w) - 1), w, 0) for w in sizes if w > 1]

    def learn(self, seq: Sequence, draft: Draft, acc: Acceptance, past: int) -> None:
        """The nodes' outcomes into the tenant's calibration; the request's own expected and accepted
        drafted tokens (its Trust)."""
        w = draft.tokens.shape[0]
        self.budget.rates.calibration(seq).record(draft.grown.bins[:w], draft.grown.parent[:w], acc.path)
        seq.drafting.state.predicted += draft.grown.expected(w) - 1
        seq.drafting.state.realized += len(acc.path) - 1

    def _grow(self, seq: Sequence, floor: float, trust: float) -> Grown:
        """This step's grown tree for `seq`, or its root alone when no node can score `floor` (the
        budget's row floor for this batch): the root's matrix row and the chains are checked first,
        and a chain source whose calibrated best is below the floor is not even looked up, so a plain
        step stays nearly as cheap as an AR one. A tree takes the session's pending rows first, so it
        drafts from them at once; plain steps hand them over only every HAND_OVER rows."""
        session = seq.drafting.session
        m, template = session.matrix, seq.drafting.tree.template
        rows, probs = m.host_views()  # [V, K] each
        calib = self.budget.rates.calibration(seq)
        chains = []
        if calib.best_rate(CONTEXT) >= floor:
            chains.append(Chain.of(seq.drafting.lookup.propose(template.lookup), CONTEXT))
        if calib.best_rate(HISTORY) >= floor:
            chains.append(self._history(seq))
        chains = [c for c in chains if c is not None]
        if best_first_score(rows, probs, seq.root, calib, chains) * trust < floor:
            if len(seq.drafting.plain) >= HAND_OVER:
                session.update(pending(seq))
            return Grown([seq.root], [0], [0], [-1], [1.0])
        session.update(pending(seq))
        return grow(rows, probs, seq.root, calib, chains, template.dynamic)

    @staticmethod
    def _history(seq: Sequence) -> Chain | None:
        """A continuation from the tenant's earlier requests (its session's history), if it has one."""
        drafting = seq.drafting
        history = drafting.session.history
        if history is None:
            return None
        return Chain.of(history.propose(drafting.lookup.tail(history.max_ngram), drafting.tree.template.dynamic), HISTORY)
