"""What a step costs, as the tree budget prices it: the forward's cost model (the calibration, or a
proxy) corrected online by what this engine's forwards measure, and the host time a step spends
outside its forward. One object owns this state; only its own methods change it (the engine reports
each forward and each sequence's host time)."""

from __future__ import annotations

from collections.abc import Callable


class StepCosts:
    """The corrected forward cost model and the host-time averages of one engine (engine thread only)."""

    def __init__(self, cost: Callable[[int, int], float]) -> None:
        self._cost_fn = cost
        self._costs: dict[tuple[int, int], float] = {}  # (width, kv // 32): the cost model, looked up once
        self.last_width = 1  # the previous forward's total (packed) or padded width
        # per-sequence host seconds of a step outside the forward (drafting, acceptance, recycling,
        # streaming), measured: {True: a tree step, False: a plain one}; the difference is what a tree
        # costs beyond its forward width (engine/drafting/budget/choose.py, `extra`)
        self.host_s = {True: 5e-4, False: 1e-4}
        # measured forward seconds / the cost model's: the host's speed against the calibration's (one
        # EMA over all steps), and per step width that width's own ratio relative to it (EMA; 1.0 until
        # measured). The calibration's cells are each a fastest-of-a-few on a noisy host, and a few
        # percent of error between width 1 and 2 decides whether a small tree pays (measured here:
        # width 2 priced 3% above width 1, took 18% more in the decode loop); and a width never measured
        # must be priced at the host's current speed, not the calibration's, or in a slow spell every
        # wider step looks cheap next to the (measured) usual one
        self._speed = 1.0
        self._cost_ratio: dict[int, float] = {}

    def cost(self, width: int, kv: int) -> float:
        """Seconds of a forward of `width` tokens at KV length `kv` (to 32 tokens): the cost model,
        corrected by what forwards of that width measured in this loop."""
        return self._model_cost(width, kv) * self._speed * self._cost_ratio.get(width, 1.0)

    def _model_cost(self, width: int, kv: int) -> float:
        key = (width, kv // 32)
        c = self._costs.get(key)
        if c is None:
            if len(self._costs) > 65536:
                self._costs.clear()
            c = self._costs[key] = self._cost_fn(width, key[1] * 32)
        return c

    def measured(self, width: int, kv: int, seconds: float) -> None:
        """A forward of `width` tokens at KV length `kv` took `seconds` (it is now the last width): the
        host's speed and the width's own correction move towards it (EMAs, 0.1 per step; one sample's
        ratio clamped to [0.5, 2]: one preempted step must not price a width out)."""
        self.last_width = width
        model = self._model_cost(width, kv)
        if model <= 0:
            return
        r = min(max(seconds / model, 0.5), 2.0)
        self._speed += 0.1 * (r - self._speed)
        prev = self._cost_ratio.get(width, 1.0)
        self._cost_ratio[width] = prev + 0.1 * (r / self._speed - prev)

    def host(self, tree: bool, seconds: float) -> None:
        """One sequence's host seconds outside the forward in a tree (or plain) step."""
        self.host_s[tree] += 0.02 * (seconds - self.host_s[tree])

    @property
    def tree_extra_s(self) -> float:
        """A tree step's host work beyond a plain step's, per sequence."""
        return max(self.host_s[True] - self.host_s[False], 0.0)
