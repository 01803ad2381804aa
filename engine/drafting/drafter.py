"""What each running sequence verifies this step: each TR request's draft from the proposer that takes
it (engine/drafting/proposers/: trees grown by confidence, a tuner's plan, a static tree with a lookup chain),
sized for the whole batch by the tree budget, then shaped by the request's grammar where it has one."""

from __future__ import annotations

import time

import torch

from .constrained import constrained_draft
from ..model.runner import RowInput
from .proposers import PROPOSERS, Proposer, Shapes, StepInfo
from ..sequence import Sequence, alone
from .step import Draft
from ..tr.accept import Acceptance
from .budget.tree import TreeBudget
from .budget.choose import PLAIN


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
        staged, options = [], []
        for live in running:
            stage, opts = None, [PLAIN]
            with alone(live):  # a request whose drafting fails ends alone (a plain row until it retires)
                live.proposer = None if live.session is None else next(p for p in self.proposers if p.takes(live))
                if live.proposer is not None:
                    stage, opts = live.proposer.offer(live, step)
            staged.append(stage)
            options.append(opts)
        chosen = budget.choose(options, kv)
        drafts, inputs, spent = [], [], []
        for live, stage, opts, j in zip(running, staged, options, chosen):
            t0, draft = time.perf_counter(), None
            if live.error is None:
                with alone(live):  # where it fails, draft stays None: a plain row until it retires
                    draft = self._draft(live, stage, opts[j])
            drafts.append(draft)
            inputs.append(self._plain_input(live.root) if draft is None
                          else RowInput(draft.tokens, draft.tree.depth, draft.tree.mask))
            spent.append(time.perf_counter() - t0)
        widths = [r.tokens.shape[0] for r in inputs]
        self.width = sum(widths) if self.packed else len(widths) * max(widths)
        return drafts, inputs, spent

    def _draft(self, live: Sequence, stage, option) -> Draft | None:
        """`live`'s draft at the chosen option, shaped by its grammar where it has one (None: plain)."""
        draft = None if live.proposer is None or option[2] == 1 else live.proposer.draft(live, stage, option)
        if live.proposer is not None and live.grammar is not None and self.budget.config.grammar_drafting:
            template = live.tree.template
            draft = constrained_draft(draft, live.grammar, live.root, template.max_width - 1,
                                      lambda parent: self.shapes.of_parents(template, parent))
        return draft

    @staticmethod
    def learn(live: Sequence, draft: Draft, acc: Acceptance) -> None:
        """A verified draft's outcome to the proposer that drafted it; a draft the request's grammar
        changed says nothing about the unconstrained drafts."""
        if not draft.constrained:
            live.proposer.learn(live, draft, acc)

    def _plain_input(self, root: int) -> RowInput:
        """One token at depth 0 seeing itself: the depth and mask are the same every step (read only)."""
        if self._plain is None:
            dev = self.device
            self._plain = (torch.zeros(1, dtype=torch.long, device=dev), torch.zeros(1, 1, dtype=self.dtype, device=dev))
        return RowInput(torch.tensor([root], device=self.device), *self._plain)
