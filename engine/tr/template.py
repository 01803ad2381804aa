"""Static draft tree templates as data, without torch (the matrix service drafts from them too).

A template is a list of *rank paths*: the node `[0, 2]` is "the 3rd-ranked successor of the
1st-ranked successor of the root". The root (the last accepted token) is implicit. Templates live
as JSON files in `engine/tr/trees/` (`{"name", "description", "paths": [[0], [1], [0, 0], ...]}`)
or anywhere on disk; `load_template` takes a builtin name or a path.

`tree_layout` numbers the nodes breadth-first (depth, then rank path), so each depth level is one
contiguous slice and drafting is one gather per level; index 0 is always the root. The torch form
(`CompiledTree`, engine/tr/tree.py) and the numpy form (engine/tr/gather.py) are both built from it.

Worked example, paths [[0], [1], [0, 0]] lay out as (n = 4 with the root):
    parent = [0, 0, 0, 1]   # root's parent is itself (never used)
    rank   = [0, 0, 1, 0]
    depth  = [0, 1, 1, 2]
    levels = [(1, 3), (3, 4)]
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ...core.errors import InvalidArgument, NotFound

BUILTIN_DIR = Path(__file__).parent / "trees"
MAX_RANK = 64
MAX_NGRAM = 8
MAX_CHAIN = 32
MAX_DYNAMIC = 128


@dataclass(frozen=True)
class TreeTemplate:
    """A validated static tree: `paths` sorted breadth-first, ancestor-closed."""

    name: str
    paths: tuple[tuple[int, ...], ...]
    description: str = ""
    # Hybrid drafting: lookup[n-1] = most prompt-lookup chain nodes grafted when the longest
    # suffix match has n tokens (0 = ignore such matches); () = matrix drafting only.
    lookup: tuple[int, ...] = ()
    # Dynamic trees (engine/drafting/dynamic.py): > 0 = each step grow up to this many nodes (root included)
    # by confidence instead of filling `paths`; the paths are then what a session that cannot grow
    # trees (drafting by the matrix service) verifies. 0 = static.
    dynamic: int = 0

    def __post_init__(self) -> None:
        if not self.paths:
            raise InvalidArgument(f"tree {self.name!r} has no nodes; give at least one path like [0]")
        seen = set()
        for p in self.paths:
            if not p or any((not isinstance(r, int)) or r < 0 or r >= MAX_RANK for r in p):
                raise InvalidArgument(
                    f"tree {self.name!r}: path {list(p)} must be a non-empty list of ranks in [0, {MAX_RANK})"
                )
            if p in seen:
                raise InvalidArgument(f"tree {self.name!r}: path {list(p)} appears twice")
            seen.add(p)
        if len(self.lookup) > MAX_NGRAM or any(not isinstance(c, int) or not 0 <= c <= MAX_CHAIN for c in self.lookup):
            raise InvalidArgument(
                f"tree {self.name!r}: lookup must list at most {MAX_NGRAM} chain lengths in [0, {MAX_CHAIN}] "
                f"(one per suffix-match size 1, 2, ...), got {list(self.lookup)}"
            )
        if isinstance(self.dynamic, bool) or not isinstance(self.dynamic, int) or not (
                self.dynamic == 0 or 2 <= self.dynamic <= MAX_DYNAMIC):
            raise InvalidArgument(f"tree {self.name!r}: dynamic must be 0 (static) or a node count in "
                                  f"[2, {MAX_DYNAMIC}], got {self.dynamic!r}")
        for p in self.paths:
            if len(p) > 1 and p[:-1] not in seen:
                raise InvalidArgument(
                    f"tree {self.name!r}: path {list(p)} has no parent {list(p[:-1])}; every prefix of a path must be a node"
                )

    @classmethod
    def from_paths(cls, name: str, paths, description: str = "", lookup=(), dynamic: int = 0) -> TreeTemplate:
        try:
            tuples = [tuple(int(r) if not isinstance(r, bool) else None for r in p) for p in paths]
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"tree {name!r}: paths must be lists of integer ranks ({e})") from None
        if any(None in t for t in tuples):
            raise InvalidArgument(f"tree {name!r}: ranks must be integers, not booleans")
        ordered = sorted(tuples, key=lambda p: (len(p), p))
        try:
            chains = tuple(int(c) if not isinstance(c, bool) else -1 for c in lookup)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"tree {name!r}: lookup must be a list of integer chain lengths ({e})") from None
        return cls(name=name, paths=tuple(ordered), description=description, lookup=chains, dynamic=dynamic)

    @property
    def size(self) -> int:
        """Non-root nodes."""
        return len(self.paths)

    @property
    def max_depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def max_rank(self) -> int:
        return max(max(p) for p in self.paths)

    @property
    def max_chain(self) -> int:
        return max(self.lookup, default=0)

    @property
    def max_width(self) -> int:
        """Widest verification forward: root + nodes + the longest lookup chain, or a grown tree."""
        return max(self.size + 1 + self.max_chain, self.dynamic)

    def to_json(self) -> str:
        doc = {"name": self.name, "description": self.description, "paths": [list(p) for p in self.paths]}
        if self.lookup:
            doc["lookup"] = list(self.lookup)
        if self.dynamic:
            doc["dynamic"] = self.dynamic
        return json.dumps(doc)


def builtin_trees() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.json"))


def load_template(name_or_path: str) -> TreeTemplate:
    """A builtin tree by name (see `builtin_trees()`) or a JSON template file by path."""
    path = Path(name_or_path)
    if path.suffix != ".json" or not path.exists():
        builtin = BUILTIN_DIR / f"{name_or_path}.json"
        if not builtin.exists():
            raise NotFound(
                f"unknown tree {name_or_path!r}: use one of {builtin_trees()} or a path to a JSON file "
                '{"paths": [[0], [1], [0, 0], ...]}'
            )
        path = builtin
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise InvalidArgument(f"tree file {str(path)!r} is not valid JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("paths"), list):
        raise InvalidArgument(f'tree file {str(path)!r} must be an object with a "paths" list of rank lists')
    if not all(isinstance(p, list) for p in doc["paths"]):
        raise InvalidArgument(f"tree file {str(path)!r}: every entry of \"paths\" must be a list of ranks")
    lookup = doc.get("lookup", [])
    if not isinstance(lookup, list):
        raise InvalidArgument(f'tree file {str(path)!r}: "lookup" must be a list of chain lengths, e.g. [0, 4, 8]')
    return TreeTemplate.from_paths(str(doc.get("name") or path.stem), doc["paths"], str(doc.get("description", "")),
                                   lookup, doc.get("dynamic", 0))


def grow_tree(name: str, node_scores: dict[tuple[int, ...], float], size: int, description: str = "") -> TreeTemplate:
    """The `size` highest-scoring paths, closed under prefixes.

    `node_scores` maps rank paths to an estimate of how often that node is accepted (e.g. measured
    per-node acceptance rates). A child is accepted only if its parent is, so measured rates are
    monotone along paths and the top-`size` set is ancestor-closed; ties break towards shallower,
    lower-ranked paths. Example: scores {(0,): .6, (1,): .1, (0, 0): .4} with size 2 -> [[0], [0, 0]].
    """
    if size < 1:
        raise InvalidArgument(f"tree size must be >= 1, got {size}")
    order = sorted(node_scores, key=lambda p: (-node_scores[p], len(p), p))
    chosen: list[tuple[int, ...]] = []
    chosen_set: set[tuple[int, ...]] = set()
    for p in order:
        if len(chosen) >= size:
            break
        if len(p) == 1 or p[:-1] in chosen_set:
            chosen.append(p)
            chosen_set.add(p)
    return TreeTemplate.from_paths(name, chosen, description)


@dataclass(frozen=True)
class TreeLayout:
    """A template's nodes numbered breadth-first, root = 0 (see the module docstring)."""

    index: dict[tuple[int, ...], int]  # rank path -> node index; () is the root
    parent: tuple[int, ...]  # [n], parent[0] = 0
    rank: tuple[int, ...]  # [n], rank[0] = 0
    depth: tuple[int, ...]  # [n], depth[0] = 0
    levels: tuple[tuple[int, int], ...]  # per depth 1..D: [start, end) node slice

    @property
    def n(self) -> int:
        """Nodes including the root."""
        return len(self.parent)


def tree_layout(template: TreeTemplate) -> TreeLayout:
    index = {(): 0}
    for i, p in enumerate(template.paths, start=1):
        index[p] = i
    n = len(index)
    parent = [0] * n
    rank = [0] * n
    depth = [0] * n
    for p, i in index.items():
        if p:
            parent[i], rank[i], depth[i] = index[p[:-1]], p[-1], len(p)
    levels = []
    for d in range(1, template.max_depth + 1):
        members = [i for i in range(n) if depth[i] == d]
        levels.append((members[0], members[-1] + 1))
    return TreeLayout(index, tuple(parent), tuple(rank), tuple(depth), tuple(levels))
