"""The Protocol every draft method implements, and what the drafter shares with them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ...sequence import Sequence
from ..step import Draft
from ...tr.accept import Acceptance
from ...tr.tree import CompiledTree, TreeTemplate, compile_parents, get_compiled
from ..budget.choose import PLAIN, Option
from ..budget.tree import StepInfo

MAX_SHAPES = 4096  # grown tree shapes kept compiled (the cache starts over when full)


@dataclass(frozen=True)
class Offer:
    """What a proposer offers one sequence this step: its options, as the budget priced them
    (TreeBudget.price), and how to draft the one the budget chooses (never plain decoding's)."""

    options: list[Option]  # ascending width; the first plain decoding where the proposer offers it
    draft: Callable[[Option], Draft]  # the chosen option (width > 1) -> its draft


PLAIN_OFFER = Offer([PLAIN], lambda option: None)  # a sequence no proposer drafts: plain decoding


class Shapes:
    """Compiled trees the proposers share: grown shapes by their parents (they recur: a chain, a root
    with two children; compiling one took ~0.13 ms of a ~9 ms step) and static trees cut to a size.
    Read only once built."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.device, self.dtype = device, dtype
        self._grown: dict[tuple, CompiledTree] = {}
        self._cut: dict[tuple[TreeTemplate, int], CompiledTree] = {}

    def of_parents(self, template: TreeTemplate, parent: list[int]) -> CompiledTree:
        key = (template, tuple(parent))
        tree = self._grown.get(key)
        if tree is None:
            if len(self._grown) >= MAX_SHAPES:
                self._grown.clear()
            tree = self._grown[key] = compile_parents(template, parent, self.device, self.dtype)
        return tree

    def cut(self, tree: CompiledTree, size: int) -> CompiledTree:
        """The first `size` nodes of `tree` (root included), compiled once (a prefix of a checked tree)."""
        key = (tree.template, size)
        if key not in self._cut:
            t = tree.template
            sub = TreeTemplate.from_paths(f"{t.name}/{size}", t.paths[: size - 1], t.description, t.lookup)
            self._cut[key] = get_compiled(sub, self.device, self.dtype)
        return self._cut[key]


class Proposer(Protocol):
    """One draft method (engine/drafting/proposers/__init__.py). The drafter asks each running TR
    request's first proposer that `takes` it; when that proposer starts drafting the request, `start`
    gives the request's state it keeps for it (Sequence.drafting, read and written by it alone). Per
    step `offer` prices what the request could verify as options through TreeBudget.price (the first
    plain decoding, PLAIN) and says how to draft each; TreeBudget.choose picks one option per request
    for the whole batch. After verification `learn` takes the outcome, all of the proposer's own
    bookkeeping (not for drafts a grammar changed)."""

    name: str

    def takes(self, seq: Sequence) -> bool:
        """Whether this method drafts for `seq` (a TR request) this step."""
        ...

    def start(self, seq: Sequence) -> object:
        """Its state for `seq` (None: it keeps none), kept in seq.drafting.state while it drafts `seq`."""
        ...

    def offer(self, seq: Sequence, step: StepInfo) -> Offer:
        """The options it offers `seq` this step, priced by the budget, and their drafts."""
        ...

    def learn(self, seq: Sequence, draft: Draft, acc: Acceptance, past: int) -> None:
        """A verified draft's outcome (`past`: the KV length the step verified it after)."""
        ...
