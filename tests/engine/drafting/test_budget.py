"""Batch-aware tree budgets on tiny numbers: the docstring's worked example, and node rates."""

import numpy as np

from trserve.engine.drafting.budget.choose import NodeRates, Option, chain_kind, choose_options, choose_packed


def _opts(rows: list[list[tuple[int, float]]]) -> list[list[Option]]:
    """Per sequence, its (width, expected tokens) pairs as options."""
    return [[Option(w, t) for w, t in row] for row in rows]


TWO = _opts([[(1, 1.0), (3, 2.0)], [(1, 1.0), (3, 2.0)]])


def test_worked_example_memory_bound_takes_both_trees():
    assert choose_options(TWO, lambda w: 10 + w) == [1, 1]


def test_worked_example_compute_bound_keeps_plain_decoding():
    assert choose_options(TWO, lambda w: 2 * w) == [0, 0]


def test_padding_decides_a_common_width_cap():
    options = _opts([[(1, 1.0)], [(1, 1.0), (2, 1.1), (8, 3.0)], [(1, 1.0), (2, 1.9)]])
    # three rows, cost 10 + total: cap 1: 3 / 13; cap 2: 4.0 / 16; cap 8: 5.9 / 34 -> cap 2 for all
    assert choose_options(options, lambda w: 10 + w) == [0, 1, 1]
    # a forced wide option (a tuner's plan) pads every row anyway: the others widen for free
    forced = _opts([[(8, 2.0)], [(1, 1.0), (2, 1.1), (8, 3.0)], [(1, 1.0), (2, 1.9)]])
    assert choose_options(forced, lambda w: 10 + w) == [0, 2, 1]


PACKED = _opts([[(1, 1.0), (5, 2.5)], [(1, 1.0), (5, 1.2)]])


def test_packed_worked_example_gives_the_tree_to_the_sequence_it_pays_for():
    assert choose_packed(PACKED, lambda n: 10 + n) == [1, 0]  # 3.5 / 16 beats 2 / 12 and 3.7 / 20


def test_packed_extremes_plain_when_compute_bound_all_trees_when_width_is_free():
    assert choose_packed(PACKED, lambda n: 2 * n) == [0, 0]
    assert choose_packed(PACKED, lambda n: 100 + n) == [1, 1]


def test_packed_never_worse_than_plain_and_forced_options_are_kept():
    rng = np.random.default_rng(0)
    for _ in range(50):
        opts = _opts([[(1, 1.0)] + sorted((int(w), 1.0 + float(rng.random()) * w / 4) for w in rng.integers(2, 30, 3))
                      for _ in range(rng.integers(1, 9))])
        cost = (lambda a, b: (lambda n: a + b * n))(float(rng.random() * 20), float(rng.random() * 2))
        picks = choose_packed(opts, cost)
        rate = sum(o[j].gain for o, j in zip(opts, picks)) / cost(sum(o[j].width for o, j in zip(opts, picks)))
        assert rate >= len(opts) / cost(len(opts)) * (1 - 1e-9)  # batched plain decoding is a candidate
    assert choose_packed(_opts([[(9, 1.0)], [(1, 1.0), (5, 1.2)]]), lambda n: 2 * n) == [0, 0]


def test_node_rates_learn_from_verified_prefixes_only():
    rates = NodeRates(4, prior=0.5, weight=2.0)
    for _ in range(8):
        rates.record(verified=2, path=[0, 1])  # node 1 always accepted; nodes 2, 3 never verified
    r = rates.rates()
    assert r[1] == (8 + 1) / (8 + 2) and r[2] == r[3] == 0.5
    opts = rates.options([2, 4], chain=0)
    assert opts[0] == Option(1, 1.0, 1, 0) and opts[1] == Option(2, 1.0 + r[1], 2, 0)
    assert np.isclose(opts[2].gain, 1.0 + r[1:].sum()) and len(opts) == 3


def test_chain_rates_per_position_and_cut_options():
    rates = NodeRates(2, weight=2.0, chain_prior=0.5)
    q = rates.chain_rates()
    assert np.isclose(q[0], 0.5) and np.isclose(q[1], 0.5 * 0.85)  # the prior, decaying along the chain
    for _ in range(10):  # chains of 6: the first 2 tokens always hit, never the 3rd
        rates.record(verified=2, path=[0], chain=6, chain_hits=2)
    q = rates.chain_rates()
    assert np.isclose(q[0], 11 / 12) and np.isclose(q[1], 10.85 / 12) and np.isclose(q[2], 0.5 * 0.85 ** 2 / 6)
    assert rates.chain_steps == 10
    assert np.isclose(rates.chain_worth(2), (11 + 10.85) / 12) and rates.chain_worth(9) == float(q[:9].sum())
    opts = rates.options([2], chain=6)  # cuts 1, 2, 4 and the whole 6
    assert [(o.width, o.chain) for o in opts] == [(1, 0), (2, 0), (3, 1), (4, 2), (6, 4), (8, 6)]
    base = 1.0 + rates.rates()[1]
    assert np.isclose(opts[3].gain, base + q[:2].sum()) and np.isclose(opts[5].gain, base + q[:6].sum())


def test_each_chain_kind_is_priced_at_its_own_rates():
    """Chains are measured per source and suffix-match size: history chains that miss do not shorten
    the context's, nor short matches' misses long matches' chains."""
    assert [chain_kind(False, n) for n in (1, 2, 3, 4, 5, 12)] == [0, 1, 2, 2, 3, 3]
    assert [chain_kind(True, n) for n in (1, 2, 3, 5)] == [4, 5, 6, 7]
    rates = NodeRates(2, weight=2.0, chain_prior=0.5)
    long_own, short_own, long_history = chain_kind(False, 8), chain_kind(False, 1), chain_kind(True, 8)
    for _ in range(10):
        rates.record(verified=2, path=[0], chain=4, chain_hits=4, kind=long_own)  # long own matches always hit
        rates.record(verified=2, path=[0], chain=4, chain_hits=0, kind=short_own)  # short ones never
        rates.record(verified=2, path=[0], chain=4, chain_hits=0, kind=long_history)  # nor the history's
    assert np.isclose(rates.chain_rates(long_own)[0], 11 / 12) and np.isclose(rates.chain_rates(short_own)[0], 1 / 12)
    assert rates.chain_steps == 30 and rates.chain_worth(4, long_history) < 0.5 < 3 < rates.chain_worth(4, long_own)
    untried = chain_kind(False, 3)  # still at its prior
    assert np.isclose(rates.chain_worth(1, untried), 0.5)
    sure, unsure = rates.options([2], chain=4, kind=long_own), rates.options([2], chain=4, kind=long_history)
    assert [(o.width, o.chain) for o in sure] == [(o.width, o.chain) for o in unsure]  # the same cuts
    assert sure[-1].gain > unsure[-1].gain + 2.5  # worth: what each kind's chains were accepted


def test_host_time_per_tree_moves_marginal_trees_to_plain():
    """A tree's host work (extra seconds per sequence verifying more than one token) counts in the
    step's time: a tree that pays under the forward's cost alone can lose to plain decoding."""
    one = _opts([[(1, 1.0), (2, 1.15)]])
    cost = {1: 8.2, 2: 9.0}.get
    assert choose_packed(one, cost) == [1]  # 1.15 / 9.0 > 1 / 8.2
    assert choose_packed(one, cost, extra=0.6) == [0]  # 1.15 / 9.6 < 1 / 8.2
    assert choose_options(one, cost, extra=0.6) == [0] and choose_options(one, cost) == [1]
    two = _opts([[(1, 1.0), (5, 2.5)], [(1, 1.0), (5, 1.2)]])
    assert choose_packed(two, lambda n: 10 + n, extra=0.0) == [1, 0]
    assert choose_packed(two, lambda n: 10 + n, extra=5.0) == [0, 0]  # 3.5 / 21 < 2 / 12
    assert choose_packed(two, lambda n: 100 + n, extra=1.0) == [1, 1]  # width nearly free: trees still pay


def test_margin_keeps_plain_decoding_when_a_tree_only_ties_it():
    one = _opts([[(1, 1.0), (3, 1.26)]])
    cost = {1: 8.0, 3: 9.8}.get  # 1.26 / 9.8 = 0.1286 vs 1 / 8 = 0.125: +3%
    assert choose_packed(one, cost) == [1] and choose_packed(one, cost, margin=0.05) == [0]
    assert choose_options(one, cost, margin=0.05) == [0]
    chain = _opts([[(1, 1.0), (6, 2.1)]])  # a lookup chain worth 2.1 tokens at 1.5x the cost: +40%
    assert choose_packed(chain, {1: 8.0, 6: 12.0}.get, margin=0.05) == [1]
    two = _opts([[(1, 1.0), (5, 2.5)], [(1, 1.0), (5, 1.2)]])
    assert choose_packed(two, lambda n: 10 + n, margin=0.05) == [1, 0]  # 0.219 / 1.05 still beats 0.167


def test_an_unmeasured_fallback_path_drafts_nothing():
    """Issue 55, item 5: priced as if each row cost a forward, no tree beats plain decoding, even a
    chain whose every draft would be accepted (w tokens for width w)."""
    from trserve.engine.tuning.cost import unmeasured_cost

    opts = _opts([[(1, 1.0), (4, 4.0), (16, 9.0)], [(1, 1.0), (8, 8.0)]])
    assert choose_options(opts, lambda w: unmeasured_cost(w, 512)) == [0, 0]
    assert choose_packed(opts, lambda n: unmeasured_cost(n, 512)) == [0, 0]
