"""The adjacency matrix: for every token, the top-K successors the model last predicted for it."""

from __future__ import annotations

import logging
import threading

import numpy as np
import torch

from ...core.errors import InvalidArgument
from ...core.model_spec import ModelSpec
from .draft import draft_tokens
from .recycle import RecycledRows
from .tree import CompiledTree

log = logging.getLogger("trserve.engine")

class AdjacencyMatrix:
    """`rows[v]` = top-K successor ids of token v as last predicted by the model (int32 [V, K]);
    `probs[v]` = the probabilities the model gave them then (uint8 buckets [V, K], 0 = unknown:
    engine/tr/confidence.py).

    Carries the fingerprint of the model/tokenizer it was built with; using it with another
    model is refused. `version` counts applied row batches. Thread-safe for concurrent requests.
    """

    def __init__(self, spec: ModelSpec, device: torch.device | str = "cpu", rows: torch.Tensor | None = None,
                 version: int = 0, probs: torch.Tensor | None = None) -> None:
        if rows is None:
            rows = torch.zeros(spec.shape, dtype=torch.int32)
        if tuple(rows.shape) != spec.shape:
            raise InvalidArgument(f"matrix rows have shape {tuple(rows.shape)}, expected {spec.shape}")
        if rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
            raise InvalidArgument(f"matrix rows must be integer token ids, got {rows.dtype}")
        self.spec = spec
        self.rows = rows.to(device=device, dtype=torch.int32).contiguous()  # [V, K]
        bad = (self.rows < 0) | (self.rows >= spec.vocab_size)  # rows from elsewhere (a store, the matrix service)
        if bool(bad.any()):  # would index outside the matrix and the embedding: drafts of token 0 instead
            log.warning("matrix rows hold %d ids outside [0, %d); drafting token 0 there", int(bad.sum()),
                        spec.vocab_size)
            self.rows[bad] = 0
        if probs is None:
            probs = torch.zeros(spec.shape, dtype=torch.uint8)
        if tuple(probs.shape) != spec.shape or probs.dtype != torch.uint8:
            raise InvalidArgument(f"matrix probs have shape {tuple(probs.shape)} {probs.dtype}, expected "
                                  f"{spec.shape} uint8")
        self.probs = probs.to(device=device).contiguous()  # [V, K] uint8
        self.version = version
        self._lock = threading.Lock()
        self._views: tuple | None = None  # (rows, probs, their numpy views): see host_views

    @property
    def fingerprint(self) -> str:
        return self.spec.fingerprint

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def k(self) -> int:
        return self.spec.k

    def host_views(self) -> tuple[np.ndarray, np.ndarray]:
        """(rows, probs) as numpy arrays [V, K] for reading row by row (dynamic trees): views of a
        CPU matrix's own memory, made once (two conversions cost ~8 us a request a step, right after a
        forward); a device matrix's are copies, made at each call."""
        views = self._views
        if views is None or views[0] is not self.rows or views[1] is not self.probs:
            views = (self.rows, self.probs, self.rows.cpu().numpy(), self.probs.cpu().numpy())
            if self.rows.device.type == "cpu" and self.probs.device.type == "cpu":
                self._views = views
        return views[2], views[3]

    def apply(self, rows: RecycledRows) -> int:
        """Write `rows[tokens[i]] = topk[i]` and its confidences (zeros where the batch has none: the
        old ones belong to other ids); tokens are unique, so the write is deterministic. Returns the
        new version."""
        with self._lock:
            at = rows.tokens.to(self.rows.device, torch.long)
            self.rows.index_copy_(0, at, rows.topk.to(self.rows.device, torch.int32))
            if rows.probs is not None:
                self.probs.index_copy_(0, at, rows.probs.to(self.probs.device, torch.uint8))
            else:
                self.probs.index_fill_(0, at, 0)
            self.version += 1
            return self.version

    def blended(self, rows: RecycledRows, keep: float = 0.5) -> RecycledRows:
        """`rows` with each confidence averaged with what this matrix held for the same successor of
        the same token (0 where it was not among them), so a stored confidence is a moving average
        over the contexts the token was verified in (`keep` = the old value's weight): what predicts
        acceptance in the next context, where one context's probability overstates it (measured: a
        successor at p > 0.94 was accepted 39% of the time). Rows with no confidences yet (cold or
        ids-only) take the new ones as they are.
        Example, keep 0.5: old row [7, 9] at [200, 40], new [9, 3] at [180, 60] -> [110, 30]."""
        if rows.probs is None:
            return rows
        # plain Python over the few rows: right after a forward the caches are cold, and there numpy's
        # dozen small calls on [m, K, K] measured 2.6x slower (~100 against ~40 us a call, engine steps)
        tokens = rows.tokens.tolist()
        if self.rows.device.type == "cpu":
            held, conf = self.host_views()  # [V, K] each
            old = [(held[t].tolist(), conf[t].tolist()) for t in tokens]
        else:
            at = rows.tokens.to(self.rows.device, torch.long)
            old = list(zip(self.rows.index_select(0, at).tolist(), self.probs.index_select(0, at).tolist()))
        out = []
        for (old_ids, old_p), ids, new_p in zip(old, rows.topk.tolist(), rows.probs.tolist()):
            if not any(old_p):
                out.append(new_p)
                continue
            prev: dict[int, int] = {}  # the old confidence of each id (summed, should a row repeat one)
            for i, q in zip(old_ids, old_p):
                prev[i] = prev.get(i, 0) + q
            out.append([min(255, round((1 - keep) * q + keep * prev.get(i, 0))) for i, q in zip(ids, new_p)])
        probs = torch.tensor(out, dtype=torch.uint8).reshape(rows.probs.shape).to(rows.probs.device)
        return RecycledRows(rows.tokens, rows.topk, probs)

    def draft(self, root: int, tree: CompiledTree) -> torch.Tensor:
        return draft_tokens(self.rows, root, tree)

    def nonzero_rows(self) -> int:
        return int(self.rows.any(dim=1).sum())

    def __repr__(self) -> str:
        return (f"AdjacencyMatrix(shape={tuple(self.rows.shape)}, fingerprint={self.fingerprint!r}, "
                f"version={self.version}, device={self.rows.device})")
