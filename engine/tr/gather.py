"""The drafting gather without torch: fill a static tree from an adjacency matrix, one gather per
depth level. The engine drafts with torch tensors (engine/tr/draft.py), the matrix service with
numpy arrays (services/matrix/sessions.py); both use `fill_levels`, so they index the same way."""

from __future__ import annotations

import numpy as np

from .template import TreeTemplate, tree_layout


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


def host_levels(template: TreeTemplate) -> tuple[tuple[int, int, np.ndarray, np.ndarray], ...]:
    """The template's per-level gather indices as numpy int64 arrays: (start, end, parent [w], rank [w]),
    the same values as `CompiledTree.level_index` (engine/tr/tree.py) holds as tensors."""
    layout = tree_layout(template)
    parent = np.asarray(layout.parent, dtype=np.int64)  # [n]
    rank = np.asarray(layout.rank, dtype=np.int64)  # [n]
    return tuple((s, e, parent[s:e].copy(), rank[s:e].copy()) for s, e in layout.levels)


def draft_host(rows: np.ndarray, root: int, n: int, levels) -> np.ndarray:
    """rows: [V, K] int32 numpy matrix, root: last accepted token -> tokens [n] int64, root first.

    Example, K=2, rows {5: [7, 9], 7: [3, 4]}, paths [[0], [1], [0, 0]]: root 5 -> [5, 7, 9, 3].
    """
    tokens = np.empty(n, np.int64)
    tokens[0] = root
    fill_levels(tokens, rows, levels)
    return tokens
