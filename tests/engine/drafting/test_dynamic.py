"""Trees grown by confidence (engine/drafting/dynamic.py) on tiny matrices, and their compiled form."""

import numpy as np
import pytest
import torch

from trserve.engine.tr.accept import accept_greedy
from trserve.engine.drafting.dynamic import CONTEXT, HISTORY, MATRIX, N_BINS, Calibration, Chain, best_first_score, grow
from trserve.engine.tr.lookup import Proposal
from trserve.engine.tr.tree import compile_parents, load_template

V, K = 16, 2


class Exact(Calibration):
    """A calibration that believes the stored confidences as they are (for worked examples)."""

    def matrix_rates(self):
        return [(b + 0.5) / 16 for b in range(16)], [0.0] * 8

    def rates(self):
        r = [0.9] * N_BINS
        return r


def _matrix(rows: dict[int, list[int]], probs: dict[int, list[float]]):
    ids = np.zeros((V, K), np.int32)
    q = np.zeros((V, K), np.uint8)
    for t, r in rows.items():
        ids[t] = r
        q[t] = np.rint(np.array(probs[t]) * 255)
    return ids, q


def test_worked_example_best_first():
    ids, q = _matrix({5: [7, 9], 7: [3, 4]}, {5: [0.9, 0.05], 7: [0.6, 0.3]})
    g = grow(ids, q, 5, Exact(), [], max_nodes=10)
    # 7 (~0.9), then 3 (~0.9 x 0.6), then 4 (~0.9 x 0.3); 9 (~0.05) is below the floor
    assert g.tokens == [5, 7, 3, 4] and g.parent == [0, 0, 1, 1]
    assert g.source == [0, MATRIX, MATRIX, MATRIX]
    assert g.expected(1) == 1.0
    assert g.expected(3) == pytest.approx(1 + g.score[1] + g.score[2])
    assert g.score[1] >= g.score[2] >= g.score[3]


def test_every_prefix_is_ancestor_closed_and_siblings_differ():
    rng = np.random.default_rng(0)
    ids = np.stack([rng.choice(V, K, replace=False) for _ in range(V)]).astype(np.int32)
    q = rng.integers(1, 256, size=(V, K)).astype(np.uint8)
    chains = [Chain([3, 3, 4, 5], 4, CONTEXT), Chain([3, 6, 7], 3, HISTORY)]
    g = grow(ids, q, 2, Calibration(), chains, max_nodes=24)
    assert g.n <= 24
    for i in range(1, g.n):
        assert g.parent[i] < i  # the parent is in every prefix that holds the child
    for u in range(g.n):
        kids = [g.tokens[i] for i in range(1, g.n) if g.parent[i] == u]
        assert len(kids) == len(set(kids))


def test_chain_carries_on_below_an_equal_matrix_sibling():
    ids, q = _matrix({5: [7, 9], 7: [1, 2], 8: [1, 2]}, {5: [0.99, 0.5], 7: [0.1, 0.1], 8: [0.1, 0.1]})
    g = grow(ids, q, 5, Exact(), [Chain([7, 8], 3, CONTEXT)], max_nodes=6)
    # the chain's 7 equals the matrix's 7: one node; the chain's 8 hangs below it
    assert g.tokens.count(7) == 1
    seven = g.tokens.index(7)
    assert 8 in [g.tokens[i] for i in range(g.n) if g.parent[i] == seven]


def test_cold_rows_draft_nothing_and_the_bound_holds():
    ids, q = _matrix({}, {})
    assert grow(ids, q, 5, Calibration(), [], 8).n == 1
    assert best_first_score(ids, q, 5, Calibration(), []) == 0.0
    ids, q = _matrix({5: [7, 9], 7: [3, 4]}, {5: [0.9, 0.05], 7: [0.6, 0.3]})
    g = grow(ids, q, 5, Calibration(), [Chain.of(Proposal([7, 3], 2), CONTEXT)], 8)
    assert max(g.score[1:]) <= best_first_score(ids, q, 5, Calibration(), [Chain([7, 3], 2, CONTEXT)]) + 1e-12


def test_calibration_learns_from_reached_nodes_only():
    c = Calibration(weight=1.0)
    before = c.rates()[3]
    # nodes: root, a (bin 3, parent root), b (bin 3, parent a); path = root, a: a reached+accepted, b reached
    c.record([-1, 3, 3], [0, 0, 1], [0, 1])
    assert c.reached[3] == 2 and c.accepted[3] == 1
    # a node whose parent was not accepted says nothing
    c.record([-1, 4, 5], [0, 0, 1], [0])
    assert c.reached[4] == 1 and c.reached[5] == 0
    assert c.rates()[3] != before


def test_compiled_grown_tree_accepts_like_a_template():
    parent = [0, 0, 1, 1, 0]
    tree = compile_parents(load_template("dynamic"), parent)
    assert tree.depth.tolist() == [0, 1, 2, 2, 1]
    assert tree.path_to(3) == [0, 1, 3]
    allowed = tree.mask == 0
    assert allowed[3].tolist() == [True, True, False, True, False]
    tokens = torch.tensor([5, 7, 3, 4, 9])
    greedy = torch.tensor([7, 4, 0, 8, 0])  # the model follows 5 -> 7 -> 4, then 8
    acc = accept_greedy(tokens, greedy, tree)
    assert acc.path == [0, 1, 3] and acc.tokens == [7, 4, 8]
