"""The Protocol every draft method implements, and what the drafter shares with them."""

from __future__ import annotations

from functools import cached_property
from typing import Protocol

import torch

from ...sequence import Sequence
from ..step import Draft
from ...tr.accept import Acceptance
from ...tr.tree import CompiledTree, TreeTemplate, compile_parents, get_compiled
from ..budget.tree import Option, TreeBudget

MAX_SHAPES = 4096  # grown tree shapes kept compiled (the cache starts over when full)


class StepInfo:
    """The batch a proposer drafts in this step: its size, its mean KV length, and (computed when a
    proposer first asks) the least score a drafted node needs to pay in it."""

    def __init__(self, budget: TreeBudget, b: int, kv: int) -> None:
        self.budget, self.b, self.kv = budget, b, kv

    @cached_property
    def floor(self) -> float:
        """0 with whole trees (batch_aware off): any node a grower takes (TreeBudget.row_floor)."""
        return self.budget.row_floor(self.kv, self.b) if self.budget.config.batch_aware else 0.0


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
    """One draft method (engine/drafting/proposers/__init__.py). Per step, for each running request it takes:
    `offer` stages what the request could verify and prices it as options (the first plain decoding,
    (1, 1.0, 1, 0); TreeBudget.choose picks one option per request for the whole batch); `draft` builds
    the chosen option's draft (never called for plain decoding); after verification `learn` takes the
    outcome (not for drafts a grammar changed)."""

    name: str

    def takes(self, live: Sequence) -> bool:
        """Whether this method drafts for `live` (a TR request) this step."""
        ...

    def offer(self, live: Sequence, step: StepInfo) -> tuple[object, list[Option]]:
        """(a stage for `draft`, the options with their widths and expected tokens)."""
        ...

    def draft(self, live: Sequence, stage: object, option: Option) -> Draft:
        """The draft of `option` (width > 1) from `stage`."""
        ...

    def learn(self, live: Sequence, draft: Draft, acc: Acceptance) -> None:
        """A verified draft's outcome."""
        ...
