"""Where a worker's drafts come from: a DraftSourceFactory maps (tenant, domain) to a DraftSource.

Embedded (`trserve serve`, `embedded_factory`): per-tenant matrices in an in-process MatrixStore,
hot start without a network hop. A session checks out the tenant's matrix when a request starts,
drafts from that private copy, and writes every step's recycled rows both to the copy (this request
drafts better at once) and to the store (the tenant's next request starts warm). Tenants never
share rows: each request reads and writes only its own tenant's matrix. If the store fails
mid-request, the request goes on drafting from its copy and reports draft mode "local-fallback"
(output is unaffected: drafts are verified).

Split (`trserve worker`, `MatrixServiceSources`): the matrix service's remote or replica sources,
which fall back to local drafting the same way when the service is down.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.errors import FingerprintMismatch, InvalidArgument
from engine.matrix import AdjacencyMatrix, DraftInfo, DraftSource
from engine.recycle import RecycledRows
from engine.tree import CompiledTree
from matrix_store import MatrixStore, ModelSpec
from services.matrix.client import DraftClientConfig, RemoteDraftSource, ReplicaDraftSource

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


# -- split deployment: drafts from the matrix service ----------------------------------------------
DRAFT_MODES = ("remote", "replica")


@dataclass(frozen=True)
class SplitConfig:
    """Where a split-deployment worker (`trserve worker`) gets its drafts."""

    matrix_addr: str  # host:port of `trserve matrix`
    draft_mode: str = "remote"  # "remote": one round trip per step; "replica": checkout, draft locally, push rows
    client: DraftClientConfig = DraftClientConfig()  # timeouts, breaker and push batching of each tenant's link
    # Tenants whose source (a channel + watchdog thread, and a pusher thread for replica) stays open,
    # LRU. Must exceed the worker's max_active so a source in use is never the one evicted.
    max_sources: int = 64

    def __post_init__(self) -> None:
        host, sep, port = self.matrix_addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"matrix address must be HOST:PORT, e.g. 127.0.0.1:50052, got {self.matrix_addr!r}")
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"draft mode must be one of {DRAFT_MODES}, got {self.draft_mode!r}")
        if self.max_sources < 2:
            raise ValueError(f"max_sources must be >= 2, got {self.max_sources}")


class MatrixServiceSources:
    """The split worker's DraftSourceFactory: per tenant a Remote/ReplicaDraftSource on the matrix
    service. Sources are kept (LRU, `max_sources`) because each owns a channel, threads and a
    failure breaker that should outlive one request; evicted ones are closed. Falling back to local
    drafting is the sources' job (see services/matrix/client.py); it shows in each request's stats
    (draft_mode "local-fallback") and in the worker's trserve_draft_fallbacks metric."""

    def __init__(self, config: SplitConfig) -> None:
        self.config = config
        self._cls = RemoteDraftSource if config.draft_mode == "remote" else ReplicaDraftSource
        self._sources: OrderedDict[tuple[str, str | None], RemoteDraftSource | ReplicaDraftSource] = OrderedDict()
        self._lock = threading.Lock()  # called from every decode thread

    def __call__(self, tenant: str, domain: str | None) -> DraftSource:
        key = (tenant, domain)
        with self._lock:
            source = self._sources.get(key)
            if source is not None:
                self._sources.move_to_end(key)
                return source
            source = self._sources[key] = self._cls(self.config.matrix_addr, tenant, domain, self.config.client)
            evicted = self._sources.popitem(last=False)[1] if len(self._sources) > self.config.max_sources else None
        if evicted is not None:
            evicted.close()
        return source

    def close(self) -> None:
        with self._lock:
            sources, self._sources = list(self._sources.values()), OrderedDict()
        for source in sources:
            source.close()
