"""Batch-aware tree budgets: how big each running sequence's tree is this step.

A batch step pads every row to the widest one (engine/model/runner.py), so a step of B rows
whose widest tree has W nodes costs about cost(B * W): the calibrated cost of a forward of that
many tokens (engine/tuning/calibrate.py; memory-bound CPUs read the weights once per forward, so
narrow forwards cost about the same). Each sequence b can verify one of a few nested trees:
option 0 is plain decoding (width 1, 1 token), option j > 0 a larger subtree of its tree with
expected committed tokens E_b[j] = 1 + the sum of its nodes' measured acceptance rates (siblings
are exclusive, so the expected accepted depth is the sum of the nodes' probabilities).
`choose_options` maximises the step's expected tokens per second, sum_b E_b / cost(B * W): for
each candidate width cap W (every option width in the batch), each sequence takes its best option
no wider than W; the cap with the highest ratio wins, ties to the narrower one. Cap 1 is batched
plain decoding, so under the cost model a step is never slower than that.

Worked example, cost(w) = 10 + w ms, two sequences with options [(1, 1.0), (3, 2.0)]:
  cap 1: 2 tokens / cost(2) = 2 / 12 = 0.167 tok/ms; cap 3: 4 / cost(6) = 4 / 16 = 0.25 -> trees.
With cost(w) = 2 w ms (compute-bound): cap 1: 2 / 4 = 0.5; cap 3: 4 / 12 = 0.33 -> plain decoding.
So under light load each request gets its tree, under heavy load trees shrink to one-token steps.

A tree step also costs host time the forward's calibration does not see: drafting, acceptance and
recycling (~0.5 ms per sequence on these CPUs, against a ~8 ms one-token forward). Both choosers take
it as `extra` seconds per sequence that verifies more than one token (the engine measures it while
serving). Example, one sequence, cost(1) = 8.2 ms, cost(3) = 10.3 ms, a 3-node tree worth 1.2 tokens:
without it 1.2 / 10.3 = 0.117 < 1 / 8.2 = 0.122 already says plain; a 2-node tree worth 1.15 at
cost(2) = 9.0 ms gives 0.128 (tree) without the host time but 1.15 / 9.6 = 0.120 (plain wins) with
0.6 ms of it, which is what decoding measures.
And a pick with trees must beat the others by `margin` (the engine's `tree_margin`, 5%): the cost model
is measured on a shared host (5-10% noise) and interpolated between widths, so a tree that only ties
plain decoding under it is as likely to lose as to win; verifying it would only add the risk.

The native forward (engine/model/native.py) packs the rows without pads: a step of total width
N = sum_b w_b costs about cost(N). `choose_packed` then maximises sum_b E_b / cost(sum_b w_b): for a
price mu (tokens per unit of width) each sequence independently takes the option maximising
E_b[j] - mu * w_b[j]; mu is swept from 0 (every sequence its best tree) to effectively infinite
(plain decoding for all), and the pick with the highest ratio wins. Worked example, cost(N) = 10 + N
ms, sequence a with options [(1, 1.0), (5, 2.5)], sequence b with [(1, 1.0), (5, 1.2)]:
  mu large: both plain, 2 / 12 = 0.167 tok/ms; mu = 0.1: a takes its tree (2.5 - 0.5 > 1 - 0.1),
  b stays plain (1.2 - 0.5 < 0.9): 3.5 / 16 = 0.219; mu = 0: both trees, 3.7 / 20 = 0.185 -> a's
  tree only. Under a padded forward, b would have paid for a's width anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, order=True, slots=True)
class Option:
    """One draft a sequence could verify this step, as a proposer offers it and the budget prices it."""

    width: int  # tokens verified: base nodes and chain tokens (1: plain decoding)
    gain: float  # expected committed tokens
    size: int | None = None  # base nodes (root included); None: the proposer's plan as it is
    chain: int = 0  # lookup-chain tokens grafted on


PLAIN = Option(1, 1.0, 1, 0)  # plain decoding: the root alone, one token


def choose_options(options: Sequence[Sequence[Option]], cost: Callable[[int], float], extra: float = 0.0,
                   margin: float = 0.0) -> list[int]:
    """options[b]: ascending widths (a sequence with one option must take it) -> the chosen index per
    sequence. `cost(total)`: seconds of a forward of `total` tokens (rows x padded width); `extra`:
    seconds each sequence verifying a tree (width > 1) adds on the host (drafting, acceptance, recycling);
    `margin`: a pick with trees must beat the others by this share of its rate."""
    floor = max(opts[0].width for opts in options)  # every sequence's narrowest option must fit
    best, best_rate = None, -1.0
    for cap in sorted({o.width for opts in options for o in opts if o.width >= floor}):
        picks = [max((j for j, o in enumerate(opts) if o.width <= cap), key=lambda j, o=opts: o[j].gain)
                 for opts in options]
        width = max(opts[j].width for opts, j in zip(options, picks))
        trees = sum(opts[j].width > 1 for opts, j in zip(options, picks))
        rate = sum(opts[j].gain for opts, j in zip(options, picks)) / (cost(len(options) * width) + extra * trees)
        rate /= 1 + margin if trees else 1.0
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = picks, rate
    return best


_PRICES = (0.0, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.45, 0.65, 1.0, 1e9)


def choose_packed(options: Sequence[Sequence[Option]], cost: Callable[[int], float], extra: float = 0.0,
                  margin: float = 0.0) -> list[int]:
    """options[b]: ascending widths -> the chosen index per sequence, for a forward whose cost is
    `cost(total)` of the summed widths (no pads), plus `extra` seconds of host work per sequence
    that verifies a tree (width > 1); a pick with trees must beat the others by `margin` (a share of
    its rate) to be taken. See the module docstring."""
    if len(options) == 1:  # one sequence: its option with the most tokens per second (ties: narrower)
        opts = options[0]
        rates = [o.gain / (cost(o.width) + (extra if o.width > 1 else 0.0)) / (1 + margin if o.width > 1 else 1.0)
                 for o in opts]
        return [max(range(len(opts)), key=lambda i: (rates[i], -opts[i].width))]
    # only the sequences with a choice take part (on lists: a busy batch has one or two, and numpy's calls
    # on [M, B, J] cost more than the loop right after a forward, with cold caches)
    free = [i for i, opts in enumerate(options) if len(opts) > 1]
    fixed = [options[i][0] for i, opts in enumerate(options) if len(opts) == 1]
    fixed_w, fixed_t = sum(o.width for o in fixed), sum(o.gain for o in fixed)
    fixed_trees = sum(o.width > 1 for o in fixed)
    best, best_key, seen = None, None, set()
    for price in _PRICES:  # each sequence's option maximising t - price * w (the first of equal ones)
        p = tuple(max(range(len(options[i])), key=lambda j, o=options[i]: o[j].gain - price * o[j].width) for i in free)
        if p in seen:
            continue
        seen.add(p)
        chosen = [options[i][j] for i, j in zip(free, p)]
        total = fixed_w + sum(o.width for o in chosen)
        trees = fixed_trees + sum(o.width > 1 for o in chosen)
        rate = (fixed_t + sum(o.gain for o in chosen)) / (cost(total) + extra * trees) / (1 + margin if trees else 1.0)
        key = (rate, -total)
        if best_key is None or key[0] > best_key[0] * (1 + 1e-9) or (
                abs(key[0] - best_key[0]) <= best_key[0] * 1e-9 and key[1] > best_key[1]):
            best, best_key = p, key
    picks = [0] * len(options)
    for i, j in zip(free, best):
        picks[i] = j
    return picks


CHAIN_SOURCES = ("context", "history")  # where a static tree's chain comes from
NGRAM_GROUPS = (1, 2, 4)  # a chain's suffix match of n tokens: group 0 (n = 1), 1 (2), 2 (3-4), 3 (5 and more)


def chain_kind(history: bool, ngram: int) -> int:
    """The kind of chain NodeRates measures apart: its source (the request's own context or the tenant's
    history) and the size of the suffix match it continues (a long match is far surer than a 1-2 token
    one: priced together, a cold start's short misses kept every chain out, measured in remote mode)."""
    group = next((g for g, top in enumerate(NGRAM_GROUPS) if ngram <= top), len(NGRAM_GROUPS))
    return int(history) * (len(NGRAM_GROUPS) + 1) + group


CHAIN_KINDS = len(CHAIN_SOURCES) * (len(NGRAM_GROUPS) + 1)


class NodeRates:
    """Acceptance rate of each node of one base tree, from the steps that verified it:
    P(node on the accepted path | the node was verified), with a prior of `prior` per node worth
    `weight` observations. Verified subtrees are ancestor-closed, so this is unbiased per node.
    A lookup chain is measured the same way, per position: P(its j-th token is accepted | a chain of
    at least j tokens was verified), with a prior of `chain_prior` x 0.85^j. A chain of c tokens is
    worth the sum of its first c positions' rates, so short chains (cheap: c extra width) are tried,
    measured and kept where their first tokens hit, and longer ones only where the deeper positions
    keep hitting. Chains are measured per kind (`chain_kind`: their source and the size of the suffix
    match they continue), whose acceptance differs: one kind's misses must not shorten another's chains."""

    MAX_CHAIN = 64

    def __init__(self, n_nodes: int, prior: float = 0.4, weight: float = 4.0, chain_prior: float = 0.5) -> None:
        self.verified = np.zeros(n_nodes)  # [n] root included (index 0, always accepted)
        self.accepted = np.zeros(n_nodes)
        self.prior, self.weight = prior, weight
        self.chain_verified = np.zeros((CHAIN_KINDS, self.MAX_CHAIN))  # [kinds, C] per kind and position
        self.chain_accepted = np.zeros((CHAIN_KINDS, self.MAX_CHAIN))
        self.chain_prior = chain_prior * 0.85 ** np.arange(self.MAX_CHAIN)  # [C]
        self._cache: dict[str, np.ndarray] = {}  # rates, chain rates and chain worth until the next record

    @property
    def chain_steps(self) -> float:
        """Steps that verified a chain (of any kind)."""
        return float(self.chain_verified[:, 0].sum())

    def record(self, verified: int, path: list[int], chain: int = 0, chain_hits: int = 0, kind: int = 0) -> None:
        """A step verified nodes 0..verified-1 (a BFS prefix) and a chain of `chain` tokens of `kind`
        (`chain_kind`), of which the first `chain_hits` were accepted; `path` = accepted base nodes."""
        self._cache.clear()
        self.verified[:verified] += 1
        self.accepted[path] += 1
        chain = min(chain, self.MAX_CHAIN)
        self.chain_verified[kind, :chain] += 1
        self.chain_accepted[kind, : min(chain_hits, chain)] += 1

    def rates(self) -> np.ndarray:
        r = self._cache.get("rates")
        if r is None:
            r = self._cache["rates"] = (self.accepted + self.prior * self.weight) / (self.verified + self.weight)  # [n]
        return r

    def chain_rates(self, kind: int = 0) -> np.ndarray:
        r = self._cache.get(f"chain{kind}")
        if r is None:
            r = self._cache[f"chain{kind}"] = (self.chain_accepted[kind] + self.chain_prior * self.weight) / (
                self.chain_verified[kind] + self.weight)  # [C]
        return r

    def _worth(self, kind: int = 0) -> np.ndarray:
        """[C + 1] expected tokens of the first c chain tokens, c = 0 .. C."""
        w = self._cache.get(f"worth{kind}")
        if w is None:
            w = self._cache[f"worth{kind}"] = np.concatenate([[0.0], np.cumsum(self.chain_rates(kind))])
        return w

    def _base_tokens(self) -> np.ndarray:
        """[n + 1] expected tokens of the BFS prefix of s nodes (root included), s = 0 .. n."""
        t = self._cache.get("base")
        if t is None:
            t = self._cache["base"] = 1.0 + np.concatenate([[0.0, 0.0], np.cumsum(self.rates()[1:])])
        return t

    def chain_worth(self, chain: int, kind: int = 0) -> float:
        """Expected tokens the first `chain` tokens of a chain of `kind` add."""
        return float(self.chain_rates(kind)[: min(chain, self.MAX_CHAIN)].sum())

    def options(self, sizes: Sequence[int], chain: int, kind: int = 0) -> list[Option]:
        """Plain decoding, then the BFS prefixes of `sizes` nodes (root included), each also with the
        first 1, 2, 4, 8 ... tokens of a chain of `chain` tokens of `kind` where one is proposed
        (chain > 0); sorted by width (the widest: the largest size with the whole chain)."""
        base, worth = self._base_tokens(), self._worth(kind)  # [n + 1], [C + 1]
        cuts = sorted({c for c in (1, 2, 4, 8, 16, 32) if c < chain} | ({min(chain, self.MAX_CHAIN)} if chain else set()))
        out = [PLAIN]
        for s in sizes:
            tokens = float(base[s])
            if s > 1:
                out.append(Option(s, tokens, s, 0))
            out.extend(Option(s + c, tokens + float(worth[c]), s, c) for c in cuts)  # a one-node tree: its chain
        return sorted(out)
