"""Embedded drafting (`trserve serve`): every tenant's matrix lives in an in-process MatrixStore.

A session checks out the tenant's matrix when a request starts, drafts from that private copy, and
writes every step's recycled rows both to the copy (this request drafts better at once) and to the
store (the tenant's next request starts warm). Tenants never share rows: each request reads and
writes only its own tenant's matrix. If the store fails mid-request, the request goes on drafting
from its copy and reports draft mode "local-fallback" (output is unaffected: drafts are verified).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ....core.errors import InvalidArgument
from ....core.model_spec import ModelSpec
from ....engine.tr.matrix import AdjacencyMatrix
from ....engine.tr.recycle import RecycledRows
from ....engine.tr.source import DraftSource, MatrixSession
from ....engine.tr.tree import CompiledTree
from ....matrix_store import MatrixStore
from ...common.throttle import Throttle

if TYPE_CHECKING:
    from ...common.histories import HistoryBook

log = logging.getLogger("trserve.worker")

# (tenant, domain) -> the DraftSource for one request of that tenant.
DraftSourceFactory = Callable[[str, str | None], DraftSource]
_THROTTLE = Throttle()


class StoreDraftSource:
    """A DraftSource for one tenant backed by `store`; `histories` (a services/common/histories.py
    HistoryBook, or None) gives its sessions the tenant's suffix history."""

    def __init__(self, store: MatrixStore, spec: ModelSpec, tenant: str, domain: str | None,
                 device: torch.device | str = "cpu", histories: HistoryBook | None = None) -> None:
        self.store, self.spec, self.tenant, self.domain, self.device = store, spec, tenant, domain, device
        self.histories = histories

    def open(self, tree: CompiledTree, spec: ModelSpec) -> StoreDraftSession:
        self.spec.require(spec, "draft source")
        try:
            checkout = self.store.checkout(self.spec, self.tenant, self.domain)
            rows, version, healthy = torch.from_numpy(checkout.rows), checkout.version, True  # [V, K] int32
            probs = torch.from_numpy(checkout.probs)  # [V, K] uint8
            epoch: int | None = checkout.epoch
        except InvalidArgument:
            raise
        except Exception as exc:  # noqa: BLE001 - a failing store must not fail the request
            _THROTTLE.failed("checkout", self.tenant, exc)
            rows, probs, version, healthy, epoch = None, None, 0, False, None
        session = StoreDraftSession(self, AdjacencyMatrix(spec, self.device, rows, version, probs), tree)
        session.epoch = session.matrix_epoch = epoch
        if self.histories is not None:  # this tenant's own: never another tenant's
            session.history = self.histories.get(self.spec.fingerprint, self.tenant)
        if not healthy:
            session.fall_back()
        return session


class StoreDraftSession(MatrixSession):
    mode = "embedded"

    def __init__(self, source: StoreDraftSource, matrix: AdjacencyMatrix, tree: CompiledTree) -> None:
        super().__init__(matrix, tree)
        self.source = source
        self.store_version = matrix.version  # the checkout's, then each apply's
        self.epoch: int | None = None  # the checkout's: a tenant deleted since is not resurrected

    @property
    def version(self) -> int:
        """The store's version; after a store failure the private copy's (where the rows went)."""
        return self.matrix.version if self.mode == "local-fallback" else self.store_version

    def fall_back(self) -> bool:
        self.matrix_epoch = None  # from now on the private copy's version is reported: it has no epoch
        return super().fall_back()

    def _step(self, recycled: RecycledRows | None, root: int) -> torch.Tensor:
        self._close(recycled)
        return super()._step(recycled, root)

    def _push(self, recycled: RecycledRows) -> None:
        self._close(recycled)

    def remember(self, tokens: list[int]) -> None:
        """Queued to the history book (added and saved off the engine thread)."""
        s = self.source
        if self.history is not None and s.histories is not None:
            s.histories.remember(s.spec.fingerprint, s.tenant, self.history, tokens)

    def _close(self, recycled: RecycledRows | None) -> None:
        if recycled is None or self.mode == "local-fallback":
            return  # after a store failure the rows stay in the private copy (its version is reported)
        s = self.source
        try:
            probs = None if recycled.probs is None else recycled.probs.cpu().numpy()  # [m, K] uint8
            self.store_version, self.matrix_epoch = s.store.apply_versioned(
                s.spec, s.tenant, recycled.tokens.cpu().numpy(), recycled.topk.cpu().numpy(), s.domain,
                since_epoch=self.epoch, probs=probs)
        except Exception as exc:  # noqa: BLE001
            _THROTTLE.failed("store apply", s.tenant, exc)
            self.fall_back()


def embedded_factory(store: MatrixStore, spec: ModelSpec, device: torch.device | str = "cpu",
                     histories: HistoryBook | None = None) -> DraftSourceFactory:
    """The worker's default factory: every tenant's matrix lives in `store`; with `histories`,
    every tenant's suffix history in that book."""

    def factory(tenant: str, domain: str | None) -> DraftSource:
        return StoreDraftSource(store, spec, tenant, domain, device, histories)

    return factory
