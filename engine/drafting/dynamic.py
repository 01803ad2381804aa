"""Dynamic draft trees from confidence: each step, the best nodes by expected acceptance.

A static template spends its rows on fixed ranks whatever the matrix knows. Here every candidate
child of a node gets a probability of being accepted given that its parent was, from what the
sources say about it, calibrated against what verification measured for that tenant:

- the matrix: the successor ids of the node's token with the confidence the model gave each when
  the row was recycled (engine/tr/confidence.py), calibrated per confidence bucket (per rank where
  the confidence is unknown: ids-only rows);
- chains: a continuation of the request's own context (engine/tr/lookup.py) or of the tenant's
  earlier requests (engine/tr/history.py), hung below the root, calibrated per source, matched
  n-gram size and position in the chain.

A node's score is the product of its path's probabilities: P(the node is accepted). `grow` takes
nodes best-first (a max-heap over scores), so every prefix of its node list is ancestor-closed (a
child never scores above its parent) and the expected committed tokens of verifying the first w
nodes is 1 + the sum of their scores (accepted nodes form a path: their count is the depth, and the
expectation of a count is the sum of its nodes' probabilities). The batch budget prices those
prefixes against the step's cost (engine/drafting/budget/tree.py); acceptance stays the one greedy rule
(engine/tr/accept.py), so whatever is drafted, the output is the model's own.

Worked example, K=2, the root 5 with row {5: [7, 9]} at confidences [0.9, 0.05], row {7: [3, 4]}
at [0.6, 0.3], calibration = the confidence itself: candidates 7 (0.9), 9 (0.05); take 7; its
children 3 (0.9 x 0.6 = 0.54), 4 (0.27); take 3, then 4, then 9 -> tokens [5, 7, 3, 4, 9],
parents [0, 0, 1, 1, 0], expected tokens of the first 3 nodes: 1 + 0.9 + 0.54 = 2.44.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from dataclasses import dataclass

import numpy as np

from ..tr.lookup import Proposal

MATRIX, CONTEXT, HISTORY, GRAMMAR = 1, 2, 3, 4  # node sources (engine/drafting/step.py:SOURCES; 0 = the root)
_QBINS = 16  # known confidences: bucket q // 16
_RANKS = 8  # unknown confidence (q = 0): one bin per rank, ranks >= 7 share the last
_NGRAM_EDGES = (1, 2, 3, 5, 8)  # chain n-gram size bins: 1, 2, 3-4, 5-7, 8+
_POS_EDGES = (0, 1, 2, 3, 4, 8, 16)  # chain position bins: 0, 1, 2, 3, 4-7, 8-15, 16+
_CHAIN_BINS = len(_NGRAM_EDGES) * len(_POS_EDGES)
FLOOR = 0.08  # candidates scoring below this are never worth a row (one costs >= ~0.15 of a step's tokens)


def _chain_bin(source: int, ngram: int, pos: int) -> int:
    n = bisect_right(_NGRAM_EDGES, ngram) - 1  # per candidate while growing: stdlib, not a numpy call
    p = bisect_right(_POS_EDGES, pos) - 1
    return _QBINS + _RANKS + (source - CONTEXT) * _CHAIN_BINS + max(n, 0) * len(_POS_EDGES) + p


N_BINS = _QBINS + _RANKS + 2 * _CHAIN_BINS


def _priors() -> np.ndarray:
    """[N_BINS] acceptance assumed before any measurement (worth `Calibration.weight` observations)."""
    prior = np.zeros(N_BINS)
    # measured on the bundled Spec-Bench prompts (2 per category, 96 tokens, a matrix warm from them),
    # with confidences averaged over contexts (AdjacencyMatrix.blended): buckets above 0.94 were
    # accepted 61% of the time, 0.6-0.9 about 30-45%; chains of a longer match hit more
    prior[:_QBINS] = 0.6 * ((np.arange(_QBINS) + 0.5) / _QBINS) ** 1.5
    prior[_QBINS: _QBINS + _RANKS] = 0.15 * 0.5 ** np.arange(_RANKS)
    for source, scale in ((CONTEXT, 1.0), (HISTORY, 0.8)):
        for i, n in enumerate(_NGRAM_EDGES):
            for pos in _POS_EDGES:
                prior[_chain_bin(source, n, pos)] = scale * (0.2, 0.35, 0.65, 0.8, 0.9)[i]
    return prior


_PRIOR = _priors()


class Calibration:
    """P(a candidate is accepted | its parent was), per bin, from one tenant's verified drafts:
    (accepted + prior x weight) / (reached + weight). A node is 'reached' when its parent is on the
    accepted path; only those say anything about the node itself."""

    def __init__(self, weight: float = 8.0) -> None:
        self.reached = np.zeros(N_BINS)
        self.accepted = np.zeros(N_BINS)
        self.weight = weight
        self._rates: list[float] | None = None
        self._best: dict[int, float] | None = None
        self._matrix: tuple[list[float], list[float]] | None = None

    def rates(self) -> list[float]:
        if self._rates is None:
            r = (self.accepted + _PRIOR * self.weight) / (self.reached + self.weight)
            self._rates = r.tolist()
        return self._rates

    def best_rate(self, source: int) -> float:
        """The highest calibrated rate of a chain source's bins (CONTEXT or HISTORY): no chain of that
        source can score more at the root, so one below the row floor need not be looked up."""
        if self._best is None:
            r = self.rates()
            start = _QBINS + _RANKS
            self._best = {CONTEXT: max(r[start: start + _CHAIN_BINS]), HISTORY: max(r[start + _CHAIN_BINS:])}
        return self._best[source]

    def matrix_rates(self) -> tuple[list[float], list[float]]:
        """(per confidence bucket q // 16, per rank for unknown confidences); read only."""
        if self._matrix is None:
            r = self.rates()
            self._matrix = (r[:_QBINS], r[_QBINS: _QBINS + _RANKS])
        return self._matrix

    def record(self, bins: list[int], parent: list[int], path: list[int]) -> None:
        """A verified prefix of a grown tree: bins/parent per node (root first), path = accepted nodes."""
        on = set(path)
        for i in range(1, len(bins)):
            if parent[i] in on:
                self.reached[bins[i]] += 1
                if i in on:
                    self.accepted[bins[i]] += 1
        self._rates = self._best = self._matrix = None


@dataclass(frozen=True)
class Chain:
    """A proposed continuation hung below the root: from the request's context or the tenant's history."""

    tokens: list[int]
    ngram: int
    source: int  # CONTEXT or HISTORY

    @classmethod
    def of(cls, proposal: Proposal | None, source: int) -> Chain | None:
        return cls(proposal.tokens, proposal.ngram, source) if proposal is not None and proposal.tokens else None


@dataclass(frozen=True)
class Grown:
    """A tree grown best-first: node 0 is the root; every prefix is ancestor-closed."""

    tokens: list[int]  # [n]
    parent: list[int]  # [n], parent[0] = 0
    source: list[int]  # [n] 0 root, MATRIX, CONTEXT, HISTORY
    bins: list[int]  # [n] calibration bin (-1 for the root)
    score: list[float]  # [n] P(node accepted); 1 for the root

    @property
    def n(self) -> int:
        return len(self.tokens)

    def expected(self, width: int) -> float:
        """Expected committed tokens of verifying the first `width` nodes (the bonus token included)."""
        return 1.0 + float(sum(self.score[1:width]))


def best_first_score(rows: np.ndarray, probs: np.ndarray, root: int, calib: Calibration,
                     chains: list[Chain]) -> float:
    """The best score among the root's candidates: an upper bound of every node's score (cheap: one
    row), so a caller can skip growing when even that is not worth a row."""
    q_rates, rank_rates = calib.matrix_rates()
    best = 0.0
    if any(rows[root].tolist()):  # a cold row (all zeros) drafts nothing (lists: no numpy reduction, run cold)
        best = max(q_rates[q >> 4] if q else rank_rates[min(r, _RANKS - 1)] for r, q in enumerate(probs[root].tolist()))
    rates = calib.rates()
    for c in chains:
        best = max(best, rates[_chain_bin(c.source, c.ngram, 0)])
    return best


def grow(rows: np.ndarray, probs: np.ndarray, root: int, calib: Calibration, chains: list[Chain],
         max_nodes: int) -> Grown:
    """The best `max_nodes` nodes (root included) by score, best first.

    rows: [V, K] successor ids, probs: [V, K] uint8 confidences (numpy views of the matrix);
    chains: proposals hung below the root. Siblings never repeat a token: a candidate equal to an
    existing sibling is dropped, except that a chain carries on below that sibling.
    """
    q_rates, rank_rates = calib.matrix_rates()
    rates = calib.rates()
    tokens, parent, source, bins, score = [root], [0], [0], [-1], [1.0]
    kids: list[dict[int, int]] = [{}]
    heap: list[tuple] = []
    tick = 0

    def push_matrix(u: int) -> None:
        nonlocal tick
        ids = rows[tokens[u]].tolist()
        if not any(ids):  # a cold row (all zeros): nothing known
            return
        for r, (tok, q) in enumerate(zip(ids, probs[tokens[u]].tolist())):
            b = (q >> 4) if q else _QBINS + min(r, _RANKS - 1)
            s = score[u] * (q_rates[b] if q else rank_rates[b - _QBINS])
            if s >= FLOOR:
                tick += 1
                heapq.heappush(heap, (-s, tick, u, tok, MATRIX, b, None, 0))

    def push_chain(u: int, chain: Chain, pos: int) -> None:
        nonlocal tick
        if pos < len(chain.tokens):
            b = _chain_bin(chain.source, chain.ngram, pos)
            s = score[u] * rates[b]
            if s >= FLOOR:
                tick += 1
                heapq.heappush(heap, (-s, tick, u, chain.tokens[pos], chain.source, b, chain, pos))

    push_matrix(0)
    for c in chains:
        push_chain(0, c, 0)
    while heap and len(tokens) < max_nodes:
        neg, _, u, tok, src, b, chain, pos = heapq.heappop(heap)
        have = kids[u].get(tok)
        if have is not None:  # a sibling already holds this token: a chain carries on below it
            if chain is not None:
                push_chain(have, chain, pos + 1)
            continue
        i = len(tokens)
        kids[u][tok] = i
        kids.append({})
        tokens.append(tok), parent.append(u), source.append(src), bins.append(b), score.append(-neg)
        push_matrix(i)
        if chain is not None:
            push_chain(i, chain, pos + 1)
    return Grown(tokens, parent, source, bins, score)
