"""Drafting: fill a compiled static tree from the adjacency matrix, one gather per depth level."""

from __future__ import annotations

import torch

from engine.tree import CompiledTree


def draft_tokens(matrix: torch.Tensor, root: int, tree: CompiledTree) -> torch.Tensor:
    """Token of every tree node, root first.

    matrix: [V, K] int32 successor ids; returns tokens: [n] int64 on the matrix's device.
    Node i gets `matrix[tokens[parent[i]], rank[i]]`. Example with K=2, matrix rows
    {5: [7, 9], 7: [3, 4]} and paths [[0], [1], [0, 0]]: root 5 -> tokens [5, 7, 9, 3].
    A cold (all-zero) row drafts token 0 everywhere below it; verification just rejects it.
    """
    tokens = torch.empty(tree.n, dtype=torch.long, device=matrix.device)
    tokens[0] = root
    for (start, end), (parent, rank) in zip(tree.levels, tree.level_index):
        tokens[start:end] = matrix[tokens[parent], rank]
    return tokens
