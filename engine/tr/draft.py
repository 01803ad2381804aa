"""Drafting: fill a static tree from the adjacency matrix, one gather per depth level."""

from __future__ import annotations

import torch

from engine.tr.tree import CompiledTree


def fill_levels(tokens, matrix, levels) -> None:
    """The drafting gather, for torch tensors and numpy arrays alike (the matrix service drafts
    with numpy, the engine with torch; both index the same way).

    tokens: [n] with tokens[0] = root, filled in place; matrix: [V, K] successor ids;
    levels: per depth level (start, end, parent [w], rank [w]): node i of the level gets
    `matrix[tokens[parent[i]], rank[i]]`. A cold (all-zero) row drafts token 0 below it;
    verification just rejects it.
    """
    for start, end, parent, rank in levels:
        tokens[start:end] = matrix[tokens[parent], rank]


def draft_tokens(matrix: torch.Tensor, root: int, tree: CompiledTree) -> torch.Tensor:
    """Token of every tree node, root first.

    matrix: [V, K] int32 successor ids; returns tokens: [n] int64 on the matrix's device.
    Example with K=2, matrix rows {5: [7, 9], 7: [3, 4]} and paths [[0], [1], [0, 0]]:
    root 5 -> tokens [5, 7, 9, 3].
    """
    tokens = torch.empty(tree.n, dtype=torch.long, device=matrix.device)
    tokens[0] = root
    fill_levels(tokens, matrix, tree.level_index)
    return tokens
