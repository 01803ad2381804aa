"""A split-deployment worker's drafts (`trserve worker`): per tenant a remote or replica source on
the matrix service, which fall back to local drafting when the service is down."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

import grpc

from ....engine.tr.source import DraftSource
from ...common.security import check_plaintext_secret, client_channel
from .link import DraftClientConfig
from .remote import RemoteDraftSource
from .replica import ReplicaDraftSource

DRAFT_MODES = ("remote", "replica")
log = logging.getLogger("trserve.matrix.client")


@dataclass(frozen=True)
class SplitConfig:
    """Where a split-deployment worker (`trserve worker`) gets its drafts."""

    matrix_addr: str  # host:port of `trserve matrix`
    # "replica" (default): checkout, draft locally, push rows; "remote": one round trip per request per step,
    # which a batch of requests would make in series
    draft_mode: str = "replica"
    client: DraftClientConfig = DraftClientConfig()  # timeouts, breaker and push batching of each tenant's link
    # Tenants whose source (a channel + watchdog thread, and a pusher thread for replica) stays open,
    # LRU. Must exceed the worker's max_batch so a source in use is never the one evicted.
    max_sources: int = 64

    def __post_init__(self) -> None:
        host, sep, port = self.matrix_addr.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) <= 65535:
            raise ValueError(f"matrix address must be HOST:PORT, e.g. 127.0.0.1:50052, got {self.matrix_addr!r}")
        if self.draft_mode not in DRAFT_MODES:
            raise ValueError(f"draft mode must be one of {DRAFT_MODES}, got {self.draft_mode!r}")
        if self.max_sources < 2:
            raise ValueError(f"max_sources must be >= 2, got {self.max_sources}")
        check_plaintext_secret(self.matrix_addr, self.client.tls_ca_file, self.client.secret,
                               self.client.allow_plaintext_secret)


class MatrixServiceSources:
    """The split worker's DraftSourceFactory: per tenant a Remote/ReplicaDraftSource on the matrix
    service. Sources are kept (LRU, `max_sources`) because each owns a channel, threads and a
    failure breaker that should outlive one request; evicted ones are closed. Falling back to local
    drafting is the sources' job; it shows in each request's stats (draft_mode "local-fallback")
    and in the worker's trserve_draft_fallbacks metric."""

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

    def probe(self, timeout_s: float = 2.0) -> str:
        """"ok", "unauthenticated" (the service refuses our secret) or "unreachable". One PushRows
        the service refuses after authentication (an empty model: INVALID_ARGUMENT, nothing written)."""
        c = self.config.client
        with client_channel(self.config.matrix_addr, c.tls_ca_file, c.secret,
                            allow_plaintext_secret=c.allow_plaintext_secret) as channel:
            from ....v1 import matrix_pb2 as pb
            from ....v1 import matrix_pb2_grpc as pb_grpc

            try:
                pb_grpc.MatrixServiceStub(channel).PushRows(pb.PushRowsRequest(tenant="probe"), timeout=timeout_s)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.UNAUTHENTICATED:
                    return "unauthenticated"
                if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                    return "ok"
                return "unreachable"
        return "ok"


async def watch_matrix_auth(sources: MatrixServiceSources, set_serving, every_s: float = 5.0) -> None:
    """Keep a split worker's health honest: NOT_SERVING (and an ERROR log line) while the matrix
    service answers UNAUTHENTICATED (a wrong secret would otherwise leave it drafting locally
    forever while saying SERVING); SERVING again once it authenticates. An unreachable service
    changes nothing (local drafting is the designed fallback). `set_serving(bool)` is awaited."""
    failing = False
    while True:
        state = await asyncio.to_thread(sources.probe)
        if state == "unauthenticated" and not failing:
            log.error("matrix service %s refuses this worker's secret (UNAUTHENTICATED): health is NOT_SERVING "
                      "until it accepts it; check --matrix-secret-file", sources.config.matrix_addr)
            failing = True
            await set_serving(False)
        elif state == "ok" and failing:
            log.info("matrix service %s accepts this worker's secret again", sources.config.matrix_addr)
            failing = False
            await set_serving(True)
        await asyncio.sleep(every_s)
