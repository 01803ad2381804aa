"""Server-side remote drafting: tree plans and one draft session per bidi stream. No torch: trees
come from engine/tr/template.py and drafting is the engine's gather on numpy (engine/tr/gather.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from ...core.errors import InvalidArgument, NotFound
from ...core.model_spec import ModelSpec
from ...engine.tr.gather import draft_host, host_levels
from ...engine.tr.template import TreeTemplate, builtin_trees, load_template
from ...matrix_store import MatrixStore
from ..common.matrix_convert import check_root


@dataclass(frozen=True, repr=False)
class TreePlan:
    """The numpy form of a compiled tree: per depth level, the node slice and its gather indices.

    Drafts with the engine's own gather (`trserve.engine.tr.gather.fill_levels`), on numpy arrays: no torch.
    """

    name: str
    n: int  # nodes including the root
    max_rank: int
    levels: tuple[tuple[int, int, np.ndarray, np.ndarray], ...]  # (start, end, parent [w], rank [w])

    def draft(self, rows: np.ndarray, root: int) -> np.ndarray:
        """rows: [V, K] int32, root: last accepted token -> tokens [n] int64, root first.

        Example, K=2, rows {5: [7, 9], 7: [3, 4]}, paths [[0], [1], [0, 0]]: root 5 -> [5, 7, 9, 3].
        """
        return draft_host(rows, root, self.n, self.levels)

    def __repr__(self) -> str:
        return f"TreePlan(name={self.name!r}, n={self.n}, depth={len(self.levels)})"


@lru_cache(maxsize=64)
def plan_for(template: TreeTemplate) -> TreePlan:
    return TreePlan(template.name, template.size + 1, template.max_rank, host_levels(template))


def resolve_tree(name: str, paths: list[list[int]], max_nodes: int, max_depth: int = 64) -> TreeTemplate:
    """An inline template (when `paths` is given; `name` is its label) or a builtin by name.
    Only builtin names are accepted: the service never reads a client-named file. Inline
    templates are capped in nodes and depth (checked before anything is built)."""
    if paths:
        if len(paths) + 1 > max_nodes:
            raise InvalidArgument(f"tree has {len(paths) + 1} nodes; this service drafts trees of at most {max_nodes} "
                                  "nodes (max_tree_nodes)")
        depth = max(len(p) for p in paths)
        if depth > max_depth:
            raise InvalidArgument(f"tree is {depth} levels deep; this service drafts trees of at most {max_depth} "
                                  "levels (max_tree_depth)")
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
    from the tenant's live matrix. The servicer runs a step on the event loop only while the
    tenant is in memory (`only_loaded=True`: in-memory locks only); a tenant not (or no longer)
    loaded raises NotLoaded and the step is retried in a thread, where loading may wait on Redis."""

    def __init__(self, store: MatrixStore, spec: ModelSpec, tenant: str, domain: str | None, plan: TreePlan) -> None:
        if plan.max_rank >= spec.k:
            raise InvalidArgument(
                f"tree {plan.name!r} uses successor rank {plan.max_rank} but the matrix keeps only K={spec.k} "
                f"per token; use a tree with ranks < {spec.k}"
            )
        self.store, self.spec, self.tenant, self.domain, self.plan = store, spec, tenant, domain, plan
        self.epoch: int | None = None  # set by open()

    def open(self) -> tuple[int, int]:
        """(version, epoch) of the tenant (not created by opening). May read Redis: call off the loop."""
        version, self.epoch = self.store.head(self.spec, self.tenant, self.domain)
        return version, self.epoch

    def apply(self, tokens: np.ndarray, topk: np.ndarray, probs: np.ndarray | None = None,
              only_loaded: bool = False) -> int | None:
        """Apply a non-empty batch (probs [m, K] uint8, None = unknown); returns the new version
        (None for an empty batch). A tenant deleted after `open` is not resurrected
        (FailedPrecondition). `only_loaded`: raise matrix_store.store.NotLoaded instead of loading
        (the caller then retries in a thread)."""
        if tokens.shape[0] == 0:  # its probs are empty too: rows_from_pb checks m * K bytes
            return None
        return self.store.apply(self.spec, self.tenant, tokens, topk, self.domain,
                                since_epoch=self.epoch, only_loaded=only_loaded, probs=probs)

    def step(self, tokens: np.ndarray, topk: np.ndarray, root: int, probs: np.ndarray | None = None,
             only_loaded: bool = False) -> tuple[int, np.ndarray]:
        """tokens [m], topk [m, K], root, probs [m, K] uint8 or None -> (version drafted from, tree tokens [n])."""
        check_root(root, self.spec.vocab_size)
        self.apply(tokens, topk, probs, only_loaded)
        version, rows = self.store.view(self.spec, self.tenant, self.domain, only_loaded=only_loaded)  # [V, K]
        return version, self.plan.draft(rows, root)
