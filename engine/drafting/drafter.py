"""What each running sequence verifies this step: each TR request's draft from the proposer that takes
it (engine/drafting/proposers/: trees grown by confidence, a tuner's plan, a static tree with a lookup chain),
sized for the whole batch by the tree budget, then shaped by the request's grammar where it has one."""

from __future__ import annotations

import time

import torch

from .constrained import constrained_draft
from ..model.runner import RowInput
from .proposers import PROPOSERS, Proposer, Shapes, StepInfo
from .proposers.base import PLAIN_OFFER, Offer
from ..sequence import Sequence, alone
from .step import Draft
from ..tr.accept import Acceptance
from .budget.choose import Option
from .budget.tree import TreeBudget


class Drafter:
    """The drafting half of an engine step (engine thread only)."""

    def __init__(self, budget: TreeBudget, device: torch.device, dtype: torch.dtype, packed: bool,
                 proposers: tuple = PROPOSERS) -> None:
        self.budget, self.device, self.dtype = budget, device, dtype
        self.packed = packed  # rows packed without pads (the native forward): a step costs its summed width
        self.shapes = Shapes(device, dtype)
        self.proposers: list[Proposer] = [make(budget, self.shapes) for make in proposers]
        self._plain: tuple[torch.Tensor, torch.Tensor] | None = None  # a plain row's depth [1] and mask [1, 1]
        self.width = 1  # this step's forward width: summed (packed) or padded (the engine reports its time)

    def drafts(self, running: list[Sequence], steps: int, kv: int) -> tuple[list, list[RowInput], list[float]]:
        """Each running sequence's draft (None = plain decoding this step), its row input and the
        seconds its drafting took, with tree sizes chosen for the whole batch (engine/drafting/budget/tree.py)."""
        budget = self.budget
        budget.begin_step(running, steps, kv)
        step = StepInfo(budget, len(running), kv)
        offers = [self._offer(seq, step) for seq in running]
        chosen = budget.choose([offer.options for offer in offers], kv)
        drafts, inputs, spent = [], [], []
        for seq, offer, j in zip(running, offers, chosen):
            t0, draft = time.perf_counter(), None
            if seq.error is None:
                with alone(seq):  # where it fails, draft stays None: a plain row until it retires
                    draft = self._draft(seq, offer, offer.options[j])
            drafts.append(draft)
            inputs.append(self._plain_input(seq.root) if draft is None
                          else RowInput(draft.tokens, draft.tree.depth, draft.tree.mask))
            spent.append(time.perf_counter() - t0)
        widths = [r.tokens.shape[0] for r in inputs]
        self.width = sum(widths) if self.packed else len(widths) * max(widths)
        return drafts, inputs, spent

    def _offer(self, seq: Sequence, step: StepInfo) -> Offer:
        """What the proposer that takes `seq` offers it (plain decoding alone: AR, or no proposer). A
        proposer starting on `seq` gives it its state first (Proposer.start)."""
        offer = PLAIN_OFFER
        with alone(seq):  # a request whose drafting fails ends alone (a plain row until it retires)
            proposer = None if seq.drafting.session is None else next(p for p in self.proposers if p.takes(seq))
            if proposer is not seq.drafting.proposer:
                seq.drafting.proposer, seq.drafting.state = proposer, None if proposer is None else proposer.start(seq)
            if proposer is not None:
                offer = proposer.offer(seq, step)
        return offer

    def _draft(self, seq: Sequence, offer: Offer, option: Option) -> Draft | None:
        """`seq`'s draft at the chosen option, shaped by its grammar where it has one (None: plain)."""
        draft = None if option.width == 1 else offer.draft(option)
        if seq.drafting.proposer is not None and seq.grammar is not None and self.budget.config.grammar_drafting:
            template = seq.drafting.tree.template
            draft = constrained_draft(draft, seq.grammar, seq.root, template.max_width - 1,
                                      lambda parent: self.shapes.of_parents(template, parent))
        return draft

    @staticmethod
    def learn(seq: Sequence, draft: Draft, acc: Acceptance, past: int) -> None:
        """A verified draft's outcome (`past`: the KV length before the step) to the proposer that
        drafted it; a draft the request's grammar changed says nothing about its unconstrained drafts."""
        if not draft.constrained:
            seq.drafting.proposer.learn(seq, draft, acc, past)

    def _plain_input(self, root: int) -> RowInput:
        """One token at depth 0 seeing itself: the depth and mask are the same every step (read only)."""
        if self._plain is None:
            dev = self.device
            self._plain = (torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(1, 1, dtype=self.dtype, device=dev))
        return RowInput(torch.tensor([root], device=self.device), *self._plain)
