"""What each tenant's drafts have been worth: per (tenant, base tree) the acceptance records of a
static tree's nodes and chains (engine/drafting/budget/choose.py:NodeRates), and the confidence calibration
of grown trees (engine/drafting/dynamic.py:Calibration). The proposers that drafted them record verified
drafts here (engine/drafting/proposers/); the tree budget prices options with it. One object owns this state (engine thread only)."""

from __future__ import annotations

from ...sequence import Sequence
from ..dynamic import Calibration
from .choose import NodeRates


class TenantRates:
    """Node rates and calibrations per (tenant, base tree), created on first use."""

    def __init__(self) -> None:
        self._rates: dict[tuple, NodeRates] = {}
        self._calib: dict[tuple, Calibration] = {}  # per (tenant, tree): grown trees' calibration

    def calibration(self, seq: Sequence) -> Calibration:
        """The confidence calibration of `seq`'s tenant (created on first use)."""
        calib = self._calib.get(seq.drafting.rates_key)
        if calib is None:
            calib = self._calib[seq.drafting.rates_key] = Calibration()
        return calib

    def node_rates(self, seq: Sequence) -> NodeRates:
        """The acceptance records of `seq`'s tenant and base tree (created on first use)."""
        rates = self._rates.get(seq.drafting.rates_key)
        if rates is None:
            rates = self._rates[seq.drafting.rates_key] = NodeRates(seq.drafting.tree.n)
        return rates
