"""How much each running sequence verifies this step: the engine's tree-size policy and its state.

Per step every TR sequence offers options (plain decoding, or a base subtree of some size with or
without its lookup chain; each with the tokens it is expected to commit, from that tenant's
measured node rates); `choose` picks one per sequence for the whole batch under the forward's cost
model (engine/drafting/budget/choose.py). The cost model is the calibration (or a proxy) corrected online
by what this loop's forwards measure (engine/drafting/budget/step_costs.py); the rates are the tenant's
(engine/drafting/budget/tenant_rates.py). Now and then one sequence (in turn) verifies its whole tree, within a time
credit, so rates never measured stay measured.
"""

from __future__ import annotations

from collections.abc import Callable

from ...scheduler import EngineConfig
from ...sequence import Sequence
from .step_costs import StepCosts
from .tenant_rates import TenantRates
from ..dynamic import Grown
from .choose import PLAIN, chain_kind, choose_options, choose_packed
from ...tuning.online import StepPlan

SIZES = (2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)  # subtree sizes (root included) a step may pick
Option = tuple[int, float, int | None, int]  # (width, expected tokens, base nodes or None = the plan, chain)


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
        live = running[self._explored % b]
        self._explored += 1
        if live.session is not None and live.tuner is None:
            self.explorer = live

    def _explore_price(self, width: int, b: int, kv: int) -> float:
        """Seconds an exploration of `width` tokens adds to this step (against the step's usual width)."""
        last_width = self.costs.last_width
        last = self.cost(last_width, kv)
        if self.packed:  # only the explorer's own extra nodes
            wider = last_width + width - 1
        else:  # padded: every row to the explorer's width
            wider = b * max(last_width // b, width)
        return max(self.cost(wider, kv) - last, 0.0)

    def options(self, live: Sequence, plan: StepPlan, proposal, b: int, kv: int, history: bool = False) -> list[Option]:
        """(width, expected tokens, base nodes or None = the plan as it is, chain tokens) per option; the
        first is plain decoding. The chain (`proposal`) is priced at its kind's rates: its source (the
        request's own context, or with `history` the tenant's history) and its suffix match's size."""
        chain = len(proposal.tokens) if proposal is not None else 0
        if live.tuner is not None or not self.config.batch_aware:  # the tuner's (or the full) plan, always
            return [(plan.tree.n + chain, 1.0, None, chain)]
        if live is self.explorer:  # its whole base tree (and lookup chain) now and then, so every node's
            # rate and the chains' worth stay measured: a worth measured low on a cold matrix would
            # otherwise never be looked at again; priced with its chain (up to 16 tokens: most of its cost)
            price = self._explore_price(plan.tree.n + chain, b, kv)
            if price <= self._explore_credit:
                self._explore_credit -= price
                return [(plan.tree.n + chain, 1.0, None, chain)]
            self.explorer = None
        rates = self.rates.node_rates(live)
        kind = chain_kind(history, proposal.ngram) if proposal is not None else 0
        return rates.options([s for s in SIZES if s < plan.tree.n] + [plan.tree.n], chain, kind)

    def grown_options(self, live: Sequence, grown: Grown, b: int, kv: int, trust: float = 1.0) -> list[Option]:
        """Options of a tree grown by confidence: plain decoding, then its first w nodes for the sizes
        up to its whole (expected tokens: 1 + the sum of their scores, engine/drafting/dynamic.py, each
        drafted token's worth scaled by `trust`: how far the request's own trees met their scores)."""
        if grown.n == 1:
            return [PLAIN]
        whole: Option = (grown.n, 1 + trust * (grown.expected(grown.n) - 1), grown.n, 0)
        if live is self.explorer:  # its whole grown tree now and then: bins the budget never picks stay measured
            price = self._explore_price(grown.n, b, kv)
            if price <= self._explore_credit:
                self._explore_credit -= price
                return [whole]
            self.explorer = None
        if not self.config.batch_aware:
            return [whole]
        return [PLAIN] + [(w, 1 + trust * (grown.expected(w) - 1), w, 0) for w in SIZES if w < grown.n] + [whole]

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
        opts = [[(w, t) for w, t, _, _ in o] for o in options]
        extra = self.costs.tree_extra_s  # a tree's host work beyond a plain step's
        if self.packed:
            return choose_packed(opts, lambda n: self.cost(n, kv), extra, self.config.tree_margin)
        return choose_options(opts, lambda w: self.cost(w, kv), extra, self.config.tree_margin)
