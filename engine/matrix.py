"""The adjacency matrix and the drafting boundary.

`DraftSource` is the seam between the verifier and wherever the matrix lives: the in-process
`LocalDraftSource` here, or a client of the matrix service (services/). Its session has the shape
of one remote round trip per step: send the rows recycled by the last verification plus the new
root, get back the next tree's tokens.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.draft import draft_tokens
from engine.errors import FingerprintMismatch, InvalidArgument
from engine.recycle import RecycledRows, apply_rows
from engine.tree import CompiledTree


class AdjacencyMatrix:
    """`rows[v]` = top-K successor ids of token v as last predicted by the model (int32 [V, K]).

    Carries the fingerprint of the model/tokenizer it was built with; using it with another
    model is refused. `version` counts applied row batches. Thread-safe for concurrent requests.
    """

    def __init__(self, vocab_size: int, k: int, fingerprint: str, device: torch.device | str = "cpu",
                 rows: torch.Tensor | None = None, version: int = 0) -> None:
        if vocab_size <= 0 or not 1 <= k <= 64:
            raise InvalidArgument(f"matrix shape must be vocab_size > 0 and 1 <= k <= 64, got ({vocab_size}, {k})")
        if rows is None:
            rows = torch.zeros(vocab_size, k, dtype=torch.int32)
        if tuple(rows.shape) != (vocab_size, k):
            raise InvalidArgument(f"matrix rows have shape {tuple(rows.shape)}, expected ({vocab_size}, {k})")
        self.rows = rows.to(device=device, dtype=torch.int32).contiguous()  # [V, K]
        self.fingerprint = fingerprint
        self.version = version
        self._lock = threading.Lock()

    @property
    def vocab_size(self) -> int:
        return int(self.rows.shape[0])

    @property
    def k(self) -> int:
        return int(self.rows.shape[1])

    def check_compatible(self, fingerprint: str, vocab_size: int) -> None:
        if fingerprint != self.fingerprint:
            raise FingerprintMismatch(
                f"matrix was built for model fingerprint {self.fingerprint!r} but the model is {fingerprint!r}; "
                "use a fresh matrix (Decoder.new_matrix()) for this model"
            )
        if vocab_size != self.vocab_size:
            raise InvalidArgument(f"matrix has {self.vocab_size} rows but the model's vocabulary has {vocab_size}")

    def apply(self, rows: RecycledRows) -> int:
        with self._lock:
            apply_rows(self.rows, rows)
            self.version += 1
            return self.version

    def draft(self, root: int, tree: CompiledTree) -> torch.Tensor:
        return draft_tokens(self.rows, root, tree)

    def nonzero_rows(self) -> int:
        return int(self.rows.any(dim=1).sum())

    def clone(self) -> AdjacencyMatrix:
        return AdjacencyMatrix(self.vocab_size, self.k, self.fingerprint, self.rows.device, self.rows.clone(), self.version)

    def __repr__(self) -> str:
        return (f"AdjacencyMatrix(shape={tuple(self.rows.shape)}, fingerprint={self.fingerprint!r}, "
                f"version={self.version}, device={self.rows.device})")


@dataclass(frozen=True)
class DraftInfo:
    """What a draft session reports for stats: which matrix version drafted, and how."""

    matrix_version: int
    mode: str  # "local", "embedded", "remote", "replica", "local-fallback"


class DraftSession(Protocol):
    def step(self, recycled: RecycledRows | None, root: int) -> torch.Tensor:
        """Apply the last verification's rows, then return the next tree's tokens [n] (root first)."""
        ...

    def close(self, recycled: RecycledRows | None) -> None:
        """Flush the final rows; the session is unusable afterwards."""
        ...

    def info(self) -> DraftInfo: ...


class DraftSource(Protocol):
    def open(self, tree: CompiledTree, fingerprint: str, vocab_size: int, k: int) -> DraftSession: ...


class LocalDraftSource:
    """Drafting from an in-process matrix; the same matrix object carries over between requests."""

    def __init__(self, matrix: AdjacencyMatrix) -> None:
        self.matrix = matrix

    def open(self, tree: CompiledTree, fingerprint: str, vocab_size: int, k: int) -> LocalDraftSession:
        self.matrix.check_compatible(fingerprint, vocab_size)
        if k != self.matrix.k:
            raise InvalidArgument(f"matrix has K={self.matrix.k} successors per token but the decoder uses K={k}")
        return LocalDraftSession(self.matrix, tree)


class LocalDraftSession:
    def __init__(self, matrix: AdjacencyMatrix, tree: CompiledTree) -> None:
        self.matrix = matrix
        self.tree = tree

    def step(self, recycled: RecycledRows | None, root: int) -> torch.Tensor:
        if recycled is not None:
            self.matrix.apply(recycled)
        return self.matrix.draft(root, self.tree)

    def close(self, recycled: RecycledRows | None) -> None:
        if recycled is not None:
            self.matrix.apply(recycled)

    def info(self) -> DraftInfo:
        return DraftInfo(matrix_version=self.matrix.version, mode="local")
