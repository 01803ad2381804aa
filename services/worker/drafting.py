"""Embedded drafting: per-tenant matrices from an in-process MatrixStore (hot start without a network hop).

A session checks out the tenant's matrix when a request starts, drafts from that private copy, and
writes every step's recycled rows both to the copy (this request drafts better at once) and to the
store (the tenant's next request starts warm). Tenants never share rows: each request reads and
writes only its own tenant's matrix. If the store fails mid-request, the request goes on drafting
from its copy and reports draft mode "local-fallback" (output is unaffected: drafts are verified).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine.errors import FingerprintMismatch, InvalidArgument
from engine.matrix import AdjacencyMatrix, DraftInfo, DraftSource
from engine.recycle import RecycledRows
from engine.tree import CompiledTree
from matrix_store import MatrixStore, ModelSpec

log = logging.getLogger("trserve.worker")

# (tenant, domain) -> the DraftSource for one request of that tenant.
DraftSourceFactory = Callable[[str, str | None], DraftSource]


class StoreDraftSource:
    """A DraftSource for one tenant backed by `store`."""

    def __init__(self, store: MatrixStore, spec: ModelSpec, tenant: str, domain: str | None,
                 device: torch.device | str = "cpu") -> None:
        self.store, self.spec, self.tenant, self.domain, self.device = store, spec, tenant, domain, device

    def open(self, tree: CompiledTree, fingerprint: str, vocab_size: int, k: int) -> StoreDraftSession:
        if (fingerprint, vocab_size, k) != (self.spec.fingerprint, self.spec.vocab_size, self.spec.k):
            raise FingerprintMismatch(
                f"draft source is for model {self.spec.fingerprint!r} (V={self.spec.vocab_size}, K={self.spec.k}) "
                f"but the decoder is {fingerprint!r} (V={vocab_size}, K={k}); build the factory from this decoder"
            )
        try:
            checkout = self.store.checkout(self.spec, self.tenant, self.domain)
            rows, version, healthy = torch.from_numpy(checkout.rows), checkout.version, True  # [V, K] int32
        except InvalidArgument:
            raise
        except Exception:  # noqa: BLE001 - a failing store must not fail the request
            log.exception("matrix checkout failed for tenant %s; drafting from a cold matrix", self.tenant)
            rows, version, healthy = None, 0, False
        matrix = AdjacencyMatrix(vocab_size, k, fingerprint, self.device, rows, version)
        return StoreDraftSession(self, matrix, tree, healthy)


class StoreDraftSession:
    def __init__(self, source: StoreDraftSource, matrix: AdjacencyMatrix, tree: CompiledTree, healthy: bool) -> None:
        self.source = source
        self.matrix = matrix
        self.tree = tree
        self.healthy = healthy  # False once the store failed: rows then stay in the private copy
        self.version = matrix.version

    def step(self, recycled: RecycledRows | None, root: int) -> torch.Tensor:
        if recycled is not None:
            self._push(recycled)
        return self.matrix.draft(root, self.tree)  # [n]

    def close(self, recycled: RecycledRows | None) -> None:
        if recycled is not None:
            self._push(recycled)

    def info(self) -> DraftInfo:
        return DraftInfo(matrix_version=self.version, mode="embedded" if self.healthy else "local-fallback")

    def _push(self, rows: RecycledRows) -> None:
        local_version = self.matrix.apply(rows)
        if not self.healthy:
            self.version = local_version
            return
        s = self.source
        try:
            self.version = s.store.apply(s.spec, s.tenant, rows.tokens.cpu().numpy(), rows.topk.cpu().numpy(), s.domain)
        except Exception:  # noqa: BLE001
            log.exception("matrix store apply failed for tenant %s; continuing with the local copy", s.tenant)
            self.healthy = False
            self.version = local_version


def embedded_factory(store: MatrixStore, spec: ModelSpec, device: torch.device | str = "cpu") -> DraftSourceFactory:
    """The worker's default factory: every tenant's matrix lives in `store`."""

    def factory(tenant: str, domain: str | None) -> DraftSource:
        return StoreDraftSource(store, spec, tenant, domain, device)

    return factory
