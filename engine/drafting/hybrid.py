"""Hybrid drafting: graft a prompt-lookup proposal into the matrix-drafted static tree.

The matrix fills the static tree as usual. When the request's own context proposes a
continuation (engine/tr/lookup.py), the proposal is walked down the drafted tree as far as it agrees
with drafted tokens (those nodes are already verified for free) and the rest hangs below that node
as a chain. Each (graft node, chain length) pair is its own static tree compiled once, so the mask
and positions are still built once and verification stays one forward over an ancestor mask.
Losslessness is untouched: acceptance only ever commits tokens equal to the model's own choices.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..tr.tree import CompiledTree, TreeTemplate, get_compiled


@dataclass(frozen=True)
class Graft:
    """Where a proposal went into this step's tree."""

    ngram: int  # size of the suffix match that produced the proposal
    proposal: list[int]  # the proposal as verified (graft overlap + chain)
    at: int  # base node the chain hangs from (0 = the root)
    chain: int  # chain nodes appended after the base nodes


def graft_point(tokens: list[int], children: tuple[tuple[int, ...], ...], proposal: list[int]) -> tuple[int, int]:
    """Deepest drafted node whose root path spells a prefix of the proposal.

    tokens: drafted tokens of the base tree (root first); proposal: the tokens after the root.
    Returns (node, matched) where `matched` proposal tokens are already in the tree.
    Example: tokens [5, 7, 9, 3] with paths [[0], [1], [0, 0]] and proposal [7, 3, 4]:
    7 is node 1, 3 is node 3 (child of 1), 4 is not a child of 3 -> (3, 2).
    """
    node, matched = 0, 0
    for tok in proposal:
        nxt = next((c for c in children[node] if tokens[c] == tok), None)
        if nxt is None:
            break
        node, matched = nxt, matched + 1
    return node, matched


def attach_chain(base: CompiledTree, at: int, length: int) -> CompiledTree:
    """The base tree plus `length` chain nodes below node `at`, compiled once per (tree, at, length)."""
    return _chained(base.template, str(base.parent.device), base.mask.dtype, at, length)


@lru_cache(maxsize=1024)
def _chained(template: TreeTemplate, device: str, dtype: torch.dtype, at: int, length: int) -> CompiledTree:
    base = get_compiled(template, device, dtype)
    n0, n = base.n, base.n + length
    new = torch.arange(n0, n, device=base.parent.device)  # [length]
    parent = torch.cat([base.parent, torch.cat([new.new_tensor([at]), new[:-1]])])  # [n]
    depth = torch.cat([base.depth, base.depth[at] + 1 + torch.arange(length, device=new.device)])  # [n]
    width = max(base.path_nodes.shape[1], int(depth[-1]) + 1)
    path_nodes = torch.full((n, width), -1, dtype=torch.long, device=new.device)  # [n, D+1]
    path_nodes[:n0, : base.path_nodes.shape[1]] = base.path_nodes
    stem = base.path_to(at)
    for j in range(length):
        chain = stem + list(range(n0, n0 + j + 1))
        path_nodes[n0 + j, : len(chain)] = torch.tensor(chain)
    hidden = torch.finfo(dtype).min
    mask = torch.full((n, n), hidden, dtype=dtype, device=new.device)  # [n, n]
    mask[:n0, :n0] = base.mask
    rows = torch.arange(n0, n, device=new.device)
    for j in range(length):
        cols = path_nodes[n0 + j][path_nodes[n0 + j] >= 0]
        mask[rows[j], cols] = 0.0
    children = base.children[:at] + (base.children[at] + (n0,),) + base.children[at + 1:] \
        + tuple((i + 1,) for i in range(n0, n - 1)) + ((),)
    return CompiledTree(template=template, parent=parent, rank=torch.cat([base.rank, new * 0]), depth=depth,
                        levels=base.levels, mask=mask, path_nodes=path_nodes,
                        level_index=base.level_index, children=children)


def graft(tokens: torch.Tensor, base: CompiledTree, proposal: list[int], ngram: int
          ) -> tuple[torch.Tensor, CompiledTree, Graft]:
    """tokens: [n0] drafted base tokens -> ([n0 + chain] tokens, the tree to verify, what was grafted)."""
    at, matched = graft_point(tokens.tolist(), base.children, proposal)
    rest = proposal[matched:]
    info = Graft(ngram=ngram, proposal=proposal, at=at, chain=len(rest))
    if not rest:
        return tokens, base, info
    extra = torch.tensor(rest, dtype=tokens.dtype, device=tokens.device)
    return torch.cat([tokens, extra]), attach_chain(base, at, len(rest)), info


def matched_run(proposal: list[int], committed: list[int]) -> int:
    """How many leading proposal tokens the model confirmed this step (committed includes the bonus)."""
    run = 0
    for p, c in zip(proposal, committed):
        if p != c:
            break
        run += 1
    return run
