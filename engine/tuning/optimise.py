"""Tree optimiser: the (subtree, lookup chain lengths) with the most expected tokens per second.

Inputs are *measured*: step records from decoding with a large "universe" tree and full-length
lookup chains (engine/tuning/records.py), and the device's forward cost curve (engine/tuning/calibrate.py).
For any subtree T of the universe and chain caps L[n] (per suffix-match size n) the tokens the
same step would have committed are exact, not modelled:

    d_T      = accepted base depth within T = nodes of the accepted universe path inside T
    chain    = min(plen, L[n]) proposal tokens, of which overlap_T are already nodes of T
    tokens   = 1 + max(d_T, min(run, chain))                 (bonus token included)
    seconds  = cost(|T| + 1 + max(chain - overlap_T, 0), kv)

and the objective is sum(tokens) / sum(seconds), measured tokens per second of verification.
Like Sequoia's hardware-aware tree search, candidate trees are the best subtree of each size
(accepted paths are prefix-closed, so the top-s nodes by acceptance rate are ancestor-closed and
maximise expected depth among s-node subtrees), scored with the device's cost of that width.
The chain caps are chosen per match size by Dinkelbach's method for ratio objectives: for a
fixed rate lambda, maximise sum(tokens - lambda * seconds) per group independently, update lambda.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..tr.tree import MAX_NGRAM, TreeTemplate, grow_tree
from .calibrate import CostModel

CHAIN_OPTIONS = (0, 2, 3, 4, 6, 8, 10, 12, 16)


@dataclass(frozen=True)
class TuneResult:
    template: TreeTemplate
    tokens_per_s: float  # predicted verification throughput on the recorded steps
    mat: float  # predicted mean tokens per step
    baseline: dict[str, float] = field(default_factory=dict)  # predicted tok/s of reference trees
    by_size: list[tuple[TreeTemplate, float, float]] = field(default_factory=list)  # best (tree, tok/s, MAT) per size

    def finalists(self, bands: tuple[int, ...] = (4, 8, 16, 32)) -> list[TreeTemplate]:
        """The best predicted tree in each size band (1..4, 5..8, ...): replay from the universe's
        records flatters small trees (they recycle fewer rows), so larger ones get a hearing too."""
        out, low = [], 1
        for high in bands:
            band = [row for row in self.by_size if low <= row[0].size <= high]
            if band:
                out.append(max(band, key=lambda row: row[1])[0])
            low = high + 1
        return out


def _inside(path_nodes: np.ndarray, member: np.ndarray, node: np.ndarray) -> np.ndarray:
    """Nodes of each step's root path (excluding the root) that are members: [steps]."""
    member_pad = np.append(member, False)  # index -1 (padding) -> False
    return member_pad[path_nodes[node]].sum(axis=1) - 1


def evaluate(rec: dict[str, np.ndarray], path_nodes: np.ndarray, member: np.ndarray, chains: tuple[int, ...],
             cost: CostModel) -> tuple[float, float]:
    """Predicted (tokens/s, MAT) of subtree `member` ([n] bool, root included) with chain caps `chains`."""
    tokens, seconds = _per_step(rec, path_nodes, member, chains, cost)
    return float(tokens.sum() / seconds.sum()), float(tokens.mean())


def _per_step(rec, path_nodes, member, chains, cost):
    d_t = _inside(path_nodes, member, rec["node"])  # [steps]
    overlap = _inside(path_nodes, member, rec["graft"])  # [steps]
    caps = np.zeros(MAX_NGRAM + 1, dtype=np.int64)
    caps[1: len(chains) + 1] = chains
    cap = caps[rec["ngram"]]  # [steps]
    chain = np.minimum(rec["plen"], cap)
    tokens = 1 + np.maximum(d_t, np.minimum(rec["run"], chain))
    width = int(member.sum()) + np.maximum(chain - overlap, 0)
    return tokens, cost.costs(width, rec["kv"])


def best_chains(rec, path_nodes, member, cost: CostModel, max_ngram: int,
                options: tuple[int, ...] = CHAIN_OPTIONS, iters: int = 8) -> tuple[int, ...]:
    """Chain cap per match size 1..max_ngram maximising tokens/s for this subtree (Dinkelbach)."""
    chains = [0] * max_ngram
    rate = evaluate(rec, path_nodes, member, tuple(chains), cost)[0]
    for _ in range(iters):
        for n in range(1, max_ngram + 1):
            group = rec["ngram"] == n
            if not group.any():
                continue
            sub = {k: v[group] for k, v in rec.items()}
            scores = []
            for opt in options:
                trial = tuple(chains[: n - 1]) + (opt,) + tuple(chains[n:])
                tok, sec = _per_step(sub, path_nodes, member, trial, cost)
                scores.append(tok.sum() - rate * sec.sum())
            chains[n - 1] = options[int(np.argmax(scores))]
        new_rate = evaluate(rec, path_nodes, member, tuple(chains), cost)[0]
        if new_rate <= rate + 1e-12:
            break
        rate = new_rate
    return tuple(chains)


def tune(rec: dict[str, np.ndarray], universe: TreeTemplate, path_nodes: np.ndarray, cost: CostModel,
         name: str = "tuned", max_nodes: int | None = None, max_ngram: int = 0,
         baselines: dict[str, TreeTemplate] | None = None) -> TuneResult:
    """Search subtree sizes 1..max_nodes of `universe` (paths in compile order = path_nodes rows 1..)."""
    if rec["node"].size == 0:
        raise ValueError("no step records to tune from; decode some prompts with the universe tree first")
    rates = _node_rates(rec["node"], path_nodes)
    scores = {p: float(rates[i]) for i, p in enumerate(universe.paths, start=1)}
    index = {p: i for i, p in enumerate(universe.paths, start=1)}
    best, by_size = None, []
    for size in range(1, min(max_nodes or universe.size, universe.size) + 1):
        sub = grow_tree(f"{name}", scores, size)
        member = _membership(sub, index, path_nodes.shape[0])
        chains = best_chains(rec, path_nodes, member, cost, max_ngram) if max_ngram else ()
        tps, mat = evaluate(rec, path_nodes, member, chains, cost)
        by_size.append((TreeTemplate.from_paths(name, sub.paths, lookup=chains), tps, mat))
        if best is None or tps > best[0]:
            best = (tps, mat, sub, chains)
    tps, mat, sub, chains = best
    base = {}
    for label, template in (baselines or {}).items():
        if all(p in index for p in template.paths):
            base[label] = evaluate(rec, path_nodes, _membership(template, index, path_nodes.shape[0]),
                                   template.lookup[:max_ngram], cost)[0]
    template = TreeTemplate.from_paths(name, sub.paths, lookup=chains)
    return TuneResult(template=template, tokens_per_s=tps, mat=mat, baseline=base, by_size=by_size)


def _node_rates(node: np.ndarray, path_nodes: np.ndarray) -> np.ndarray:
    n = path_nodes.shape[0]
    hits = np.zeros(n + 1, dtype=np.int64)
    np.add.at(hits, path_nodes[node].reshape(-1), 1)
    return hits[:n] / node.size


def _membership(template: TreeTemplate, index: dict, n: int) -> np.ndarray:
    member = np.zeros(n, dtype=bool)
    member[0] = True
    member[[index[p] for p in template.paths]] = True
    return member
