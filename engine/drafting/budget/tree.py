"""How much each running sequence verifies this step: the engine's tree-size policy and its state.

Per step the proposer drafting each TR sequence offers options (plain decoding, or a base subtree of
some size with or without its lookup chain; each with the tokens it is expected to commit, from that
tenant's measured rates), `price` says which of them the sequence may take this step (one entry point
for every proposer), and `choose` picks one per sequence for the whole batch under the forward's cost
model (engine/drafting/budget/choose.py). The cost model is the calibration (or a proxy) corrected online
by what this loop's forwards measure (engine/drafting/budget/step_costs.py); the rates are the tenant's
(engine/drafting/budget/tenant_rates.py). Now and then one sequence (in turn) verifies its whole tree, within a time
credit, so rates never measured stay measured.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property

from ...scheduler import EngineConfig
from ...sequence import Sequence
from .step_costs import StepCosts
from .tenant_rates import TenantRates
from .choose import Option, choose_options, choose_packed

SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # subtree sizes (root included) a step may pick


class TreeBudget:
    """The tree-size policy of one engine (engine thread only). What a step costs is `costs`'s and what
    each tenant's drafts were worth is `rates`'s (each owns its state); this object owns the choice:
    the exploration turn and credit, and the share of steps that verify trees."""

    def __init__(self, config: EngineConfig, cost: Callable[[int, int], float], packed: bool) -> None:
        self.config = config
        self.packed = packed  # rows packed without pads (the native forward): a step costs its summed width
        self.costs = StepCosts(cost)
        self.rates = TenantRates()
        self.explorer: Sequence | None = None  # the sequence verifying its whole tree this step
        self._explore_credit = 0.0  # seconds of step time exploration may still spend
        self._explored = 0  # explorations so far (whose turn is next)
        # share of the TR sequences' steps that verified a tree (EMA over steps): what a TR request's own
        # extra work buys is drafts, worth something only while the batch verifies trees, so prompt
        # seeding (LM-head rows over the prompt's last positions) and exploration scale with it; under
        # a load where the budget verifies only plain steps a TR request then costs what an AR one does
        self.tree_share = 1.0

    def cost(self, width: int, kv: int) -> float:
        """The corrected cost model's seconds for a forward of `width` tokens at KV length `kv`."""
        return self.costs.cost(width, kv)

    def trees_verified(self, tr: int, trees: int) -> None:
        """This step `trees` of the `tr` TR sequences verified a tree."""
        if tr:
            self.tree_share += 0.05 * (trees / tr - self.tree_share)

    # ---- per step ---------------------------------------------------------------------------------
    def begin_step(self, running: list[Sequence], steps: int, kv: int) -> None:
        """The sequence (in turn) that may verify its whole base tree (and lookup chain) this step, or
        None. Exploring keeps every node's rate measured; it is offered at most every explore_every * B
        steps, and `options` takes it only while the credit (explore_budget x the time of the steps so
        far, x the share of steps that verify trees, at least a quarter) pays its extra width, priced
        there with the chain it would verify."""
        self.explorer = None
        b = len(running)
        last = self.cost(self.costs.last_width, kv)
        budget = self.config.explore_budget * max(self.tree_share, 0.25)  # a quarter of it while no tree pays
        self._explore_credit = min(self._explore_credit + budget * last, 1.0)
        if steps % (self.config.explore_every * b):
            return
        self.explorer = running[self._explored % b]  # a sequence offering one option explores nothing
        self._explored += 1

    def _explore_price(self, width: int, b: int, kv: int) -> float:
        """Seconds an exploration of `width` tokens adds to this step (against the step's usual width)."""
        last_width = self.costs.last_width
        last = self.cost(last_width, kv)
        if self.packed:  # only the explorer's own extra nodes
            wider = last_width + width - 1
        else:  # padded: every row to the explorer's width
            wider = b * max(last_width // b, width)
        return max(self.cost(wider, kv) - last, 0.0)

    def price(self, seq: Sequence, options: list[Option], step: StepInfo) -> list[Option]:
        """The options `seq` may take this step, of those its proposer offers (ascending width: plain
        decoding first where offered, its whole draft last). One option (a tuner's plan): that one.
        Batch-unaware: the whole draft. The explorer (begin_step): its whole draft now and then, so every
        node's rate and the chains' worth stay measured (a worth measured low on a cold matrix would
        otherwise never be looked at again), within the exploration credit; priced with its chain (up
        to 16 tokens: most of its cost). Otherwise all of them, for `choose`."""
        if len(options) == 1:
            return options
        whole = options[-1]
        if not self.config.batch_aware:
            return [whole]
        if seq is self.explorer:
            price = self._explore_price(whole.width, step.b, step.kv)
            if price <= self._explore_credit:
                self._explore_credit -= price
                return [whole]
            self.explorer = None
        return options

    def row_floor(self, kv: int, b: int = 1) -> float:
        """The least score (P(accepted)) a node needs for some tree to pay in a step of `b` sequences:
        a tree of w - 1 nodes all scoring p, beside b plain rows, beats the plain step's tokens per
        second under the cost model, with a tree step's host time and the margin, for some w in 2..16.
        A grown tree's best node scores at most its root's best candidate, so a root whose candidates
        are all below this verifies plain. Example, cost(n) = 7.5, 9.3, 12.5 ms at 1, 2, 4 rows, b = 1,
        no host time or margin: w = 2 needs p > 9.3 / 7.5 - 1 = 0.24, w = 4 needs (12.5 / 7.5 - 1) / 3
        = 0.22 -> 0.22."""
        extra = self.costs.tree_extra_s
        plain = b / self.cost(b, kv) * (1 + self.config.tree_margin)  # tokens per second to beat
        floor = 1.0
        for w in (2, 4, 8, 16):
            total = b + w - 1 if self.packed else b * w  # padded: every row to the tree's width
            floor = min(floor, ((self.cost(total, kv) + extra) * plain - b) / (w - 1))
        return max(floor, 0.0)

    def choose(self, options: list[list[Option]], kv: int) -> list[int]:
        """The option index per sequence for this step."""
        if all(len(o) == 1 for o in options):  # nothing to choose (most steps of a busy batch: ~0.2 ms at B = 8)
            return [0] * len(options)
        extra = self.costs.tree_extra_s  # a tree's host work beyond a plain step's
        if self.packed:
            return choose_packed(options, lambda n: self.cost(n, kv), extra, self.config.tree_margin)
        return choose_options(options, lambda w: self.cost(w, kv), extra, self.config.tree_margin)


class StepInfo:
    """The batch the proposers draft in this step: its size, its mean KV length, and (computed when a
    proposer first asks) the least score a drafted node needs to pay in it."""

    def __init__(self, budget: TreeBudget, b: int, kv: int) -> None:
        self.budget, self.b, self.kv = budget, b, kv

    @cached_property
    def floor(self) -> float:
        """0 with whole trees (batch_aware off): any node a grower takes (TreeBudget.row_floor)."""
        return self.budget.row_floor(self.kv, self.b) if self.budget.config.batch_aware else 0.0
