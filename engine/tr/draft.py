"""Drafting: fill a static tree from the adjacency matrix, one gather per depth level.

The gather itself (`fill_levels`, torch and numpy alike) lives in engine/tr/gather.py, without
torch, and is re-exported here."""

from __future__ import annotations

import torch

from .gather import fill_levels
from .tree import CompiledTree


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
