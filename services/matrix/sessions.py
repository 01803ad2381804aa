"""Server-side remote drafting: tree plans and one draft session per bidi stream."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from core.errors import InvalidArgument, NotFound
from core.model_spec import ModelSpec
from engine.tr.draft import fill_levels
from engine.tr.tree import TreeTemplate, builtin_trees, compile_tree, load_template
from matrix_store import MatrixStore
from services.matrix.convert import check_root


@dataclass(frozen=True, repr=False)
class TreePlan:
    """The numpy form of a compiled tree: per depth level, the node slice and its gather indices.

    Drafts with the engine's own gather (`engine.tr.draft.fill_levels`), on numpy arrays: no torch per step.
    """

    name: str
    n: int  # nodes including the root
    max_rank: int
    levels: tuple[tuple[int, int, np.ndarray, np.ndarray], ...]  # (start, end, parent [w], rank [w])

    def draft(self, rows: np.ndarray, root: int) -> np.ndarray:
        """rows: [V, K] int32, root: last accepted token -> tokens [n] int64, root first.

        Example, K=2, rows {5: [7, 9], 7: [3, 4]}, paths [[0], [1], [0, 0]]: root 5 -> [5, 7, 9, 3].
        """
        tokens = np.empty(self.n, np.int64)
        tokens[0] = root
        fill_levels(tokens, rows, self.levels)
        return tokens

    def __repr__(self) -> str:
        return f"TreePlan(name={self.name!r}, n={self.n}, depth={len(self.levels)})"


@lru_cache(maxsize=64)
def plan_for(template: TreeTemplate) -> TreePlan:
    compiled = compile_tree(template, "cpu")
    levels = tuple((s, e, p.numpy().copy(), r.numpy().copy()) for s, e, p, r in compiled.level_index)
    return TreePlan(template.name, compiled.n, template.max_rank, levels)


def resolve_tree(name: str, paths: list[list[int]], max_nodes: int) -> TreeTemplate:
    """An inline template (when `paths` is given; `name` is its label) or a builtin by name.
    Only builtin names are accepted: the service never reads a client-named file."""
    if paths:
        if len(paths) + 1 > max_nodes:
            raise InvalidArgument(f"tree has {len(paths) + 1} nodes; this service drafts trees of at most {max_nodes}")
        return TreeTemplate.from_paths(name or "inline", paths)
    if not name:
        raise InvalidArgument(f"open.tree is empty: name a builtin tree {builtin_trees()} or send tree_paths")
    if name not in builtin_trees():
        raise InvalidArgument(f"unknown tree {name!r}: use one of {builtin_trees()} or send the template as tree_paths")
    try:
        return load_template(name)
    except NotFound as exc:  # removed between the check and the load
        raise InvalidArgument(str(exc)) from None


class RemoteDraft:
    """One remote-drafting stream: applies each step's rows to the tenant, drafts the next tree
    from the tenant's live matrix. Once `open` loaded the tenant, store calls here take only
    in-memory locks (see matrix_store/store.py), so steps run on the event loop without a thread
    hop. (A tenant in use stays most recently used, so LRU eviction, which would make the next
    step reload it from Redis on the loop, only reaches it beyond max_tenants_in_memory busier ones.)"""

    def __init__(self, store: MatrixStore, spec: ModelSpec, tenant: str, domain: str | None, plan: TreePlan) -> None:
        if plan.max_rank >= spec.k:
            raise InvalidArgument(
                f"tree {plan.name!r} uses successor rank {plan.max_rank} but the matrix keeps only K={spec.k} "
                f"per token; use a tree with ranks < {spec.k}"
            )
        self.store, self.spec, self.tenant, self.domain, self.plan = store, spec, tenant, domain, plan

    def open(self) -> int:
        """Load (or create) the tenant; returns its version. May read Redis: call off the loop."""
        version, _ = self.store.view(self.spec, self.tenant, self.domain)
        return version

    def apply(self, tokens: np.ndarray, topk: np.ndarray) -> int | None:
        """Apply a non-empty batch; returns the new version (None for an empty batch)."""
        if tokens.shape[0] == 0:
            return None
        return self.store.apply(self.spec, self.tenant, tokens, topk, self.domain)

    def step(self, tokens: np.ndarray, topk: np.ndarray, root: int) -> tuple[int, np.ndarray]:
        """tokens [m], topk [m, K], root -> (version drafted from, tree tokens [n])."""
        check_root(root, self.spec.vocab_size)
        self.apply(tokens, topk)
        version, rows = self.store.view(self.spec, self.tenant, self.domain)  # rows: [V, K], live
        return version, self.plan.draft(rows, root)
