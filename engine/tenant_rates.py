"""What each tenant's drafts have been worth: per (tenant, base tree) the acceptance records of a
static tree's nodes and chains (engine/tuning/budget.py:NodeRates), and the confidence calibration
of grown trees (engine/tr/dynamic.py:Calibration). Verified drafts feed it (`learn`); the tree budget
prices options with it. One object owns this state (engine thread only)."""

from __future__ import annotations

from trserve.engine.scheduler import Live
from trserve.engine.tr.dynamic import HISTORY, Calibration
from trserve.engine.tuning.budget import NodeRates, chain_kind


class TenantRates:
    """Node rates and calibrations per (tenant, base tree), created on first use."""

    def __init__(self) -> None:
        self._rates: dict[tuple, NodeRates] = {}
        self._calib: dict[tuple, Calibration] = {}  # per (tenant, tree): grown trees' calibration

    def calibration(self, live: Live) -> Calibration:
        """The confidence calibration of `live`'s tenant (created on first use)."""
        calib = self._calib.get(live.rates_key)
        if calib is None:
            calib = self._calib[live.rates_key] = Calibration()
        return calib

    def node_rates(self, live: Live) -> NodeRates:
        """The acceptance records of `live`'s tenant and base tree (created on first use)."""
        rates = self._rates.get(live.rates_key)
        if rates is None:
            rates = self._rates[live.rates_key] = NodeRates(live.tree.n)
        return rates

    def learn(self, live: Live, draft, acc) -> None:
        """A verified draft's outcome into its tenant's node rates (a grown tree's: its calibration, and
        the request's own predicted / realized tokens); a draft the request's grammar changed says
        nothing about the unconstrained trees."""
        if draft.constrained:
            return
        if draft.grown is not None:
            w = draft.tokens.shape[0]
            self.calibration(live).record(draft.grown.bins[:w], draft.grown.parent[:w], acc.path)
            live.predicted += draft.grown.expected(w) - 1
            live.realized += len(acc.path) - 1
            return
        if live.seq.tuner is not None:
            return
        rates = self.node_rates(live)
        n_base = draft.plan.tree.n
        base_path = [i for i in acc.path if i < n_base]
        chain = draft.tokens.shape[0] - n_base
        kind = chain_kind(draft.chain_source == HISTORY, draft.grafted.ngram) if draft.grafted is not None else 0
        rates.record(n_base, base_path, chain, sum(i >= n_base for i in acc.path), kind)  # chain nodes accepted
