"""The drafting boundary: where a request's trees come from and where its recycled rows go.

`DraftSource.open` starts one request's `DraftSession`; a session has the shape of one remote
round trip per step: hand over the rows recycled by the last verification plus the new root, get
back the next tree's tokens. Every session keeps a private `AdjacencyMatrix` copy that each
step's rows are applied to first (so the request drafts better at once, and keeps drafting from
what it learned if a remote store fails); `MatrixSession` implements that once, and subclasses
only say where the rows go next (`_step` / `_close`): nowhere (`LocalDraftSource`: the copy *is*
the caller's matrix), an in-process MatrixStore, or the matrix service (services/worker/drafting/).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from ...core.model_spec import ModelSpec
from .history import SuffixHistory
from .matrix import AdjacencyMatrix
from .recycle import RecycledRows
from .tree import CompiledTree

log = logging.getLogger("trserve.engine")

@dataclass(frozen=True)
class DraftInfo:
    """What a draft session reports for stats: which matrix version drafted, and how."""

    matrix_version: int
    mode: str  # "local", "embedded", "remote", "replica", "local-fallback"
    # the tenant's writer epoch that version belongs to (a store's or the matrix service's): an
    # (epoch, version) pair names one content; None where there is none (a private copy) or unknown
    matrix_epoch: int | None = None


class DraftSession(Protocol):
    """Every member the engine and its drafter use (engine/engine.py, engine/drafting/drafter.py), none probed
    for: `MatrixSession` implements them all once, and every source's session derives from it."""

    matrix: AdjacencyMatrix  # the private copy: grown trees draft from it, prompt seeding asks it
    history: SuffixHistory | None  # the tenant's suffix memory (engine/tr/history.py); None = none
    local_drafts: bool  # whether `matrix` holds the tenant's rows, so the engine may grow trees from it

    def step(self, recycled: RecycledRows | None, root: int) -> torch.Tensor:
        """Apply the last verification's rows, then return the next tree's tokens [n] (root first)."""
        ...

    def update(self, recycled: RecycledRows | None) -> None:
        """Apply the last verification's rows without drafting (the engine grows its own tree)."""
        ...

    def known_rows(self, tokens: list[int]) -> list[bool]:
        """Per token: whether the copy holds its row (prompt seeding skips those)."""
        ...

    def remember(self, tokens: list[int]) -> None:
        """A finished request's prompt + output into the tenant's history (called before `close`)."""
        ...

    def close(self, recycled: RecycledRows | None) -> None:
        """Flush the final rows; the session is unusable afterwards."""
        ...

    def info(self) -> DraftInfo: ...


class DraftSource(Protocol):
    def open(self, tree: CompiledTree, spec: ModelSpec) -> DraftSession: ...


class MatrixSession:
    """A DraftSession over a private matrix copy (see the module docstring). Subclasses override
    `_step` (rows onwards, then the next tree; default: draft from the copy) and `_close`."""

    mode = "local"
    local_drafts = True  # its copy holds the tenant's rows, so the engine may grow trees from it (dynamic trees)

    def __init__(self, matrix: AdjacencyMatrix, tree: CompiledTree) -> None:
        self.matrix = matrix
        self.tree = tree
        self.matrix_epoch: int | None = None  # the epoch of `version`, where a store or service gave one
        # the tenant's suffix memory (engine/tr/history.py), set by the source at open; None = none
        self.history: SuffixHistory | None = None

    @property
    def version(self) -> int:
        """The matrix version reported in stats: the copy's here; a store's where rows go to one."""
        return self.matrix.version

    def _apply_rows(self, recycled: RecycledRows | None) -> RecycledRows | None:
        """The rows into the copy, confidences averaged with the copy's (AdjacencyMatrix.blended):
        what the copy and everything onwards store."""
        if recycled is not None:
            recycled = self.matrix.blended(recycled)
            self.matrix.apply(recycled)
        return recycled

    def step(self, recycled: RecycledRows | None, root: int) -> torch.Tensor:
        recycled = self._apply_rows(recycled)
        return self._checked(self._step(recycled, root), root)  # [n]

    def update(self, recycled: RecycledRows | None) -> None:
        """Apply the last verification's rows (to the copy, then onwards) without drafting a static
        tree: for an engine that grows its tree from `matrix` itself (engine/drafting/dynamic.py)."""
        recycled = self._apply_rows(recycled)
        if recycled is not None:
            self._push(recycled)

    def _push(self, recycled: RecycledRows) -> None:
        """Rows onwards (a store, the matrix service) during the request; here nowhere."""

    def _checked(self, drafted: torch.Tensor, root: int) -> torch.Tensor:
        """Where drafts enter the engine: a draft is only a proposal (verification keeps the output
        exact whatever it holds), but it must be safe to feed the model. Not a [n] integer tensor:
        drafted from the private copy instead; ids outside [0, V): token 0; node 0: always `root`
        (the model reads it as the last committed token). No host sync."""
        n = self.tree.n
        if (not isinstance(drafted, torch.Tensor) or tuple(drafted.shape) != (n,) or drafted.dtype.is_floating_point
                or drafted.dtype.is_complex or drafted.dtype == torch.bool):
            log.warning("a %s draft source returned %s for a %d-node tree; drafting from the local copy", self.mode,
                        f"shape {tuple(drafted.shape)} {drafted.dtype}" if isinstance(drafted, torch.Tensor)
                        else type(drafted).__name__, n)
            return self.matrix.draft(root, self.tree)
        drafted = drafted.to(device=self.matrix.rows.device, dtype=torch.long)
        out = torch.where((drafted >= 0) & (drafted < self.matrix.vocab_size), drafted, 0)
        out[0] = root
        return out

    def close(self, recycled: RecycledRows | None) -> None:
        self._close(self._apply_rows(recycled))

    def known_rows(self, tokens: list[int]) -> list[bool]:
        """Per token: whether the copy holds its row with confidences (prompt seeding skips those:
        one more context's row adds nothing measurable, docs/benchmarks.md)."""
        if not tokens:
            return []
        at = torch.tensor(tokens, dtype=torch.long, device=self.matrix.probs.device)
        return (self.matrix.probs.index_select(0, at) > 0).any(1).tolist()

    def info(self) -> DraftInfo:
        epoch = self.matrix_epoch if self.matrix_epoch is not None and self.matrix_epoch >= 0 else None
        return DraftInfo(matrix_version=self.version, mode=self.mode, matrix_epoch=epoch)

    def fall_back(self) -> bool:
        """Draft from the copy only from now on; True the first time (the caller logs and counts it)."""
        first = self.mode != "local-fallback"
        self.mode = "local-fallback"
        return first

    def remember(self, tokens: list[int]) -> None:
        """A finished request's prompt + output into the tenant's history, if the session has one
        (the engine calls this before `close`). Here at once; a source may defer it (embedded)."""
        if self.history is not None:
            self.history.add(tokens)

    def _step(self, recycled: RecycledRows | None, root: int) -> torch.Tensor:
        return self.matrix.draft(root, self.tree)

    def _close(self, recycled: RecycledRows | None) -> None:
        pass


class LocalDraftSource:
    """Drafting from an in-process matrix; the same matrix object, and the same `history` (a
    SuffixHistory, or None for none), carry over between requests."""

    def __init__(self, matrix: AdjacencyMatrix, history: SuffixHistory | None = None) -> None:
        self.matrix = matrix
        self.history = history

    def open(self, tree: CompiledTree, spec: ModelSpec) -> MatrixSession:
        self.matrix.spec.require(spec)
        session = MatrixSession(self.matrix, tree)
        session.history = self.history
        return session
