"""Batch-aware tree budgets: how big each running sequence's tree is this step.

A step's forward costs about cost(total width) (memory-bound CPUs: weights are read once per
forward, whatever the width; calibrated by engine/tuning/calibrate.py). Each sequence b can verify
one of a few nested trees: option 0 is plain decoding (width 1, 1 token), option j > 0 a larger
subtree of its tree with expected committed tokens E_b[j] = 1 + the sum of its nodes' measured
acceptance rates (siblings are exclusive, so the expected accepted depth is the sum of the
nodes' probabilities). `choose_options` picks one option per sequence to maximise the step's
expected tokens per second, sum_b E_b / cost(sum_b width_b): start from plain decoding for all
(never worse than batched plain decoding under the cost model), then repeatedly take the single
upgrade (one sequence, one option up) that raises the ratio most, until none does.

Worked example, cost(w) = 10 + w ms, two sequences with options [(1, 1.0), (3, 2.0)]:
  AR for both: 2 tokens / 12 ms = 0.167; upgrade one: 3 / 14 = 0.214; both: 4 / 16 = 0.25 -> both.
With cost(w) = 2 w ms (compute-bound, e.g. a large batch on llama.cpp-like kernels): AR 2 / 4 =
0.5; one upgrade 3 / 8 = 0.375 -> plain decoding for both: trees shrink as the batch grows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

Option = tuple[int, float]  # (width, expected committed tokens)


def choose_options(options: Sequence[Sequence[Option]], cost: Callable[[int], float]) -> list[int]:
    """options[b]: ascending widths, options[b][0] = plain decoding -> the chosen index per sequence."""
    chosen = [0] * len(options)
    width = sum(o[0][0] for o in options)
    tokens = sum(o[0][1] for o in options)
    best = tokens / cost(width)
    while True:
        pick, pick_rate = None, best
        for b, opts in enumerate(options):
            j = chosen[b]
            for k in range(j + 1, len(opts)):  # any larger option of b (rates need not be concave)
                w = width - opts[j][0] + opts[k][0]
                t = tokens - opts[j][1] + opts[k][1]
                rate = t / cost(w)
                if rate > pick_rate * (1 + 1e-9):
                    pick, pick_rate = (b, k), rate
        if pick is None:
            return chosen
        b, k = pick
        width += options[b][k][0] - options[b][chosen[b]][0]
        tokens += options[b][k][1] - options[b][chosen[b]][1]
        chosen[b], best = k, pick_rate


class NodeRates:
    """Acceptance rate of each node of one base tree, from the steps that verified it:
    P(node on the accepted path | the node was verified), with a prior of `prior` per node worth
    `weight` observations. Verified subtrees are ancestor-closed, so this is unbiased per node."""

    def __init__(self, n_nodes: int, prior: float = 0.5, weight: float = 4.0) -> None:
        self.verified = np.zeros(n_nodes)  # [n] root included (index 0, always accepted)
        self.accepted = np.zeros(n_nodes)
        self.prior, self.weight = prior, weight
        self.chain_tokens = 0.0  # lookup-chain tokens verified
        self.chain_hits = 0.0  # ... and committed beyond the base tree's accepted depth

    def record(self, verified: int, path: list[int], chain: int = 0, chain_hits: int = 0) -> None:
        """A step verified nodes 0..verified-1 (a BFS prefix); `path` = accepted base nodes."""
        self.verified[:verified] += 1
        self.accepted[path] += 1
        self.chain_tokens += chain
        self.chain_hits += chain_hits

    def rates(self) -> np.ndarray:
        return (self.accepted + self.prior * self.weight) / (self.verified + self.weight)  # [n]

    def chain_rate(self) -> float:
        return (self.chain_hits + self.prior * self.weight) / (self.chain_tokens + self.weight)

    def options(self, sizes: Sequence[int], chain: int) -> list[Option]:
        """(width, expected tokens) of plain decoding, then of the BFS prefixes of `sizes` nodes (root
        included) plus a lookup chain of `chain` tokens where one is proposed."""
        r = self.rates()
        out: list[Option] = [(1, 1.0)]
        for s in sizes:
            if s > 1:
                out.append((s + chain, 1.0 + float(r[1:s].sum()) + chain * self.chain_rate()))
        return out
