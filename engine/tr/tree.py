"""Static draft trees compiled once into index tensors (torch).

The templates themselves (`TreeTemplate`, `load_template`, `builtin_trees`, `grow_tree`) live in
engine/tr/template.py, without torch, and are re-exported here. Compiling takes the template's
breadth-first layout (`tree_layout`: each depth level one contiguous slice, index 0 the root) and
adds the attention mask and per-node paths the verification forward needs.

Worked example, paths [[0], [1], [0, 0]] compile to (n = 4 with the root):
    parent = [0, 0, 0, 1]   # root's parent is itself (never used)
    rank   = [0, 0, 1, 0]
    depth  = [0, 1, 1, 2]
    levels = [(1, 3), (3, 4)]
    ancestor mask rows: root sees {0}; [0] sees {0,1}; [1] sees {0,2}; [0,0] sees {0,1,3}
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import numpy as np
import torch

from .template import (
    BUILTIN_DIR,
    MAX_CHAIN,
    MAX_NGRAM,
    MAX_RANK,
    TreeTemplate,
    builtin_trees,
    grow_tree,
    load_template,
    tree_layout,
)

# The templates live in engine/tr/template.py (no torch); re-exported so that
# `from trserve.engine.tr.tree import TreeTemplate, load_template` keeps working.
__all__ = [
    "BUILTIN_DIR", "MAX_CHAIN", "MAX_NGRAM", "MAX_RANK", "CompiledTree", "TreeTemplate", "builtin_trees",
    "compile_parents", "compile_tree", "get_compiled", "grow_tree", "load_template",
]


@dataclass(frozen=True, repr=False)
class CompiledTree:
    """Index tensors of one template, built once; every decoding step only indexes into them."""

    template: TreeTemplate
    parent: torch.Tensor  # [n] int64, parent[0] = 0
    rank: torch.Tensor  # [n] int64, rank[0] = 0
    depth: torch.Tensor  # [n] int64, depth[0] = 0 (= position offset from the root)
    levels: tuple[tuple[int, int], ...]  # per depth 1..D: [start, end) node slice
    mask: torch.Tensor  # [n, n] float, 0 where column is an ancestor-or-self of row, else dtype min
    path_nodes: torch.Tensor  # [n, D+1] int64, root..node indices, padded with -1
    children: tuple[tuple[int, ...], ...] = ()  # children[u] = nodes whose parent is u, in rank order
    # per depth level (start, end, parent [w], rank [w]): what drafting gathers (engine/tr/draft.py)
    level_index: tuple[tuple[int, int, torch.Tensor, torch.Tensor], ...] = field(default=())

    @property
    def n(self) -> int:
        """Nodes including the root: the width of the verification forward."""
        return int(self.parent.shape[0])

    @property
    def max_depth(self) -> int:
        return len(self.levels)

    @cached_property
    def host_paths(self) -> tuple[tuple[int, ...], ...]:
        """Per node, root..node indices as Python ints (path_nodes without pads), read once per tree."""
        return tuple(tuple(i for i in row if i >= 0) for row in self.path_nodes.tolist())

    @cached_property
    def host_parent(self) -> tuple[int, ...]:
        return tuple(self.parent.tolist())

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, both included."""
        return list(self.host_paths[node])

    def __repr__(self) -> str:
        return (
            f"CompiledTree(name={self.template.name!r}, n={self.n}, depth={self.max_depth}, "
            f"mask={tuple(self.mask.shape)}, device={self.parent.device})"
        )


def compile_tree(template: TreeTemplate, device: torch.device | str = "cpu", dtype=torch.float32) -> CompiledTree:
    layout = tree_layout(template)
    index, parent, rank, depth, levels = layout.index, layout.parent, layout.rank, layout.depth, layout.levels
    n, max_d = layout.n, template.max_depth
    path_nodes = torch.full((n, max_d + 1), -1, dtype=torch.long)
    allowed = torch.zeros(n, n, dtype=torch.bool)
    for p, i in index.items():
        chain = [index[p[:k]] for k in range(len(p) + 1)]
        path_nodes[i, : len(chain)] = torch.tensor(chain)
        allowed[i, chain] = True
    mask = torch.full((n, n), torch.finfo(dtype).min, dtype=dtype)
    mask[allowed] = 0.0
    kids: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        kids[parent[i]].append(i)
    dev = torch.device(device)
    parent_t = torch.tensor(parent, device=dev)
    rank_t = torch.tensor(rank, device=dev)
    level_tensors = tuple((s, e, parent_t[s:e], rank_t[s:e]) for s, e in levels)
    return CompiledTree(
        template=template,
        parent=parent_t,
        rank=rank_t,
        depth=torch.tensor(depth, device=dev),
        levels=tuple(levels),
        mask=mask.to(dev),
        path_nodes=path_nodes.to(dev),
        level_index=level_tensors,
        children=tuple(tuple(k) for k in kids),
    )


@lru_cache(maxsize=32)
def _compiled(template: TreeTemplate, device: str, dtype: torch.dtype) -> CompiledTree:
    return compile_tree(template, device, dtype)


def get_compiled(template: TreeTemplate, device: torch.device | str, dtype: torch.dtype) -> CompiledTree:
    """Compile once per (template, device, dtype) in this process."""
    return _compiled(template, str(device), dtype)


def compile_parents(template: TreeTemplate, parent: list[int], device: torch.device | str = "cpu",
                    dtype=torch.float32) -> CompiledTree:
    """A tree given as parents (parent[0] = 0, every parent before its child: a grown tree,
    engine/drafting/dynamic.py) -> the index tensors verification and acceptance read. Built per step, so
    on host lists and numpy. Example: parent [0, 0, 1, 1, 0] -> depth [0, 1, 2, 2, 1]."""
    n = len(parent)
    paths: list[tuple[int, ...]] = [(0,)]
    for i in range(1, n):
        paths.append(paths[parent[i]] + (i,))
    depth = [len(p) - 1 for p in paths]
    width = max(depth) + 1
    path_nodes = np.full((n, width), -1, dtype=np.int64)  # [n, D+1]
    allowed = np.zeros((n, n), dtype=bool)  # [n, n]
    for i, p in enumerate(paths):
        path_nodes[i, : len(p)] = p
        allowed[i, list(p)] = True
    mask = np.where(allowed, 0.0, torch.finfo(dtype).min)
    kids: list[list[int]] = [[] for _ in range(n)]
    for i in range(1, n):
        kids[parent[i]].append(i)
    dev = torch.device(device)
    tree = CompiledTree(template=template, parent=torch.tensor(parent, device=dev), rank=torch.zeros(n, dtype=torch.long, device=dev),
                        depth=torch.tensor(depth, device=dev), levels=(), mask=torch.from_numpy(mask).to(dev, dtype),
                        path_nodes=torch.from_numpy(path_nodes).to(dev), children=tuple(tuple(k) for k in kids))
    object.__setattr__(tree, "host_paths", tuple(paths))  # cached_property's slot, filled now
    object.__setattr__(tree, "host_parent", tuple(parent))
    return tree
