"""MatrixService servicer: every RPC is `from_pb -> store call -> to_pb`.

Store calls that may read or write Redis (first use of a tenant, admin calls) run in a worker
thread (asyncio.to_thread), and so does opening a draft session (tree compilation); a draft step
runs on the event loop only while its tenant is in memory (else it hops to a thread).

Reserved tenants (`_global`, `_domain.<D>`) are written only by admin RPCs, and only when the
service has an admin secret (which the auth interceptor then required): else PERMISSION_DENIED.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import numpy as np

from ...core.errors import FailedPrecondition, InvalidArgument, PermissionDenied, ResourceExhausted
from ...core.tenants import is_reserved
from ...matrix_store import MatrixStore
from ...matrix_store.store import NotLoaded
from ..common.errors import grpc_errors
from ..common.histories import HistoryBook
from ..common.matrix_convert import (
    documents_from_pb, documents_to_pb,
    rows_from_pb,
    rows_to_pb,
    spec_from_pb,
    summary_to_pb,
    tenant_from_pb,
)
from .sessions import RemoteDraft, plan_for, resolve_tree
from ...v1 import matrix_pb2 as pb
from ...v1 import matrix_pb2_grpc as pb_grpc

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["MatrixService"].full_name
ADMIN_RPCS = ("Describe", "ListVersions", "Snapshot", "Rollback", "Fork", "Delete", "ListTenants")
ADMIN_METHODS = frozenset(f"/{SERVICE_NAME}/{name}" for name in ADMIN_RPCS)


@dataclass(frozen=True)
class ServicerLimits:
    max_tree_nodes: int = 1024  # largest draft tree a session may open
    max_tree_depth: int = 64  # deepest inline tree a session may open
    checkout_chunk_rows: int = 16384  # default rows per Checkout chunk (~720 KB at K=8: ids and probs)
    max_checkout_chunk_rows: int = 65536  # a client may ask for smaller chunks, never larger
    # Bulk calls (Checkout, Describe, Snapshot, Rollback, Fork) read or copy whole matrices: at most
    # this many run at once, at most `max_bulk_waiting` more wait; beyond, RESOURCE_EXHAUSTED.
    max_bulk_calls: int = 2
    max_bulk_waiting: int = 32
    max_history_documents: int = 256  # documents (finished requests) in one PushHistory

    def __post_init__(self) -> None:
        if self.max_bulk_calls < 1 or self.max_bulk_waiting < 0:
            raise ValueError("max_bulk_calls must be >= 1 and max_bulk_waiting >= 0")
        if not 1 <= self.checkout_chunk_rows <= self.max_checkout_chunk_rows:
            raise ValueError(f"checkout_chunk_rows must be in 1..{self.max_checkout_chunk_rows}")
        if self.max_tree_nodes < 2:
            raise ValueError("max_tree_nodes must be >= 2")
        if self.max_tree_depth < 1:
            raise ValueError("max_tree_depth must be >= 1")


class BulkGate:
    """At most `running` bulk calls at once and `waiting` more queued (FIFO, on one event loop);
    a call beyond both gets ResourceExhausted at once rather than holding memory while it waits."""

    def __init__(self, running: int, waiting: int) -> None:
        self._slots = asyncio.Semaphore(running)
        self._running, self._waiting = running, waiting
        self.queued = 0  # calls waiting for a slot now
        self.in_flight = 0  # calls holding a slot now
        self.peak = 0  # most calls ever holding a slot at once

    @contextlib.asynccontextmanager
    async def slot(self, what: str):
        if self._slots.locked() and self.queued >= self._waiting:
            raise ResourceExhausted(f"{what}: {self._running} bulk calls (Checkout, Describe, Snapshot, Rollback, "
                                    f"Fork) are running and {self.queued} waiting on this matrix service; retry later")
        self.queued += 1
        try:
            await self._slots.acquire()
        finally:
            self.queued -= 1
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            yield
        finally:
            self.in_flight -= 1
            self._slots.release()


class MatrixServicer(pb_grpc.MatrixServiceServicer):
    def __init__(self, store: MatrixStore, limits: ServicerLimits = ServicerLimits(), admin_secured: bool = False,
                 histories: HistoryBook | None = None) -> None:
        self._store = store
        self._histories = histories  # the tenants' suffix histories; None = the service keeps none
        self._limits = limits
        self._admin_secured = admin_secured  # an admin secret is configured (the interceptor checks it)
        self.bulk = BulkGate(limits.max_bulk_calls, limits.max_bulk_waiting)

    def _guard_reserved(self, tenant: str, what: str) -> None:
        if is_reserved(tenant) and not self._admin_secured:
            raise PermissionDenied(f"{what} reserved tenant {tenant!r} needs the admin secret, and this service has "
                                   "none configured (--admin-secret-file)")

    # -- remote drafting ---------------------------------------------------------------------
    @grpc_errors
    async def DraftSession(self, requests: AsyncIterator[pb.DraftRequest], context) -> AsyncIterator[pb.DraftReply]:
        stream = requests.__aiter__()
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return
        if first.WhichOneof("kind") != "open":
            raise InvalidArgument("the first DraftRequest must carry `open` (tenant, model, tree)")
        session = await asyncio.to_thread(self._open_session, first.open)  # compiles the tree: off the loop
        version, epoch = await asyncio.to_thread(session.open)
        yield pb.DraftReply(version=version, tree_nodes=session.plan.n, epoch=epoch)
        k = session.spec.k
        async for request in stream:
            if request.WhichOneof("kind") != "step":
                raise InvalidArgument("only the first DraftRequest may carry `open`; later ones carry `step`")
            step = request.step
            tokens, topk, probs = rows_from_pb(step.rows, k)  # [m], [m, K], [m, K] uint8 or None
            if step.final:
                try:
                    applied = session.apply(tokens, topk, probs, only_loaded=True)
                except NotLoaded:
                    applied = await asyncio.to_thread(session.apply, tokens, topk, probs)
                if applied is None:
                    applied = (await asyncio.to_thread(session.open))[0]
                yield pb.DraftReply(version=applied)
                continue
            try:
                version, tree_tokens = session.step(tokens, topk, step.root, probs, only_loaded=True)
            except NotLoaded:  # first write of a new tenant, or evicted mid-session: may wait on Redis
                version, tree_tokens = await asyncio.to_thread(session.step, tokens, topk, step.root, probs)
            yield pb.DraftReply(version=version, tokens=tree_tokens.tolist())

    def _open_session(self, msg: pb.DraftOpen) -> RemoteDraft:
        tenant, domain = tenant_from_pb(msg.tenant, msg.domain)
        spec = spec_from_pb(msg.model)
        if len(msg.tree_paths) + 1 > self._limits.max_tree_nodes:  # before copying any path
            raise InvalidArgument(f"tree has {len(msg.tree_paths) + 1} nodes; this service drafts trees of at most "
                                  f"{self._limits.max_tree_nodes} nodes (max_tree_nodes)")
        template = resolve_tree(msg.tree, [list(p.ranks) for p in msg.tree_paths], self._limits.max_tree_nodes,
                                self._limits.max_tree_depth)
        return RemoteDraft(self._store, spec, tenant, domain, plan_for(template))

    # -- replica drafting --------------------------------------------------------------------
    @grpc_errors
    async def Checkout(self, request: pb.CheckoutRequest, context) -> AsyncIterator[pb.CheckoutChunk]:
        tenant, domain = tenant_from_pb(request.tenant, request.domain)
        spec = spec_from_pb(request.model)
        chunk = request.max_rows_per_chunk or self._limits.checkout_chunk_rows
        if not 1 <= chunk <= self._limits.max_checkout_chunk_rows:
            raise InvalidArgument(f"max_rows_per_chunk must be in 0..{self._limits.max_checkout_chunk_rows} (0 = default)")
        async with self.bulk.slot("Checkout"):
            # one read-only copy shared by concurrent checkouts of a version; scans and chunk encoding
            # run in a thread, so a large matrix never stalls the draft steps on the event loop
            out, nonzero = await asyncio.to_thread(self._checkout, spec, tenant, domain)
            total = int(nonzero.shape[0])
            for start in range(0, max(total, 1), chunk):
                ids = nonzero[start:start + chunk]
                rows = await asyncio.to_thread(rows_to_pb, ids, out.rows[ids], out.probs[ids])
                yield pb.CheckoutChunk(version=out.version, source=out.source, total_rows=total, rows=rows,
                                       epoch=out.epoch)

    def _checkout(self, spec, tenant: str, domain: str | None):
        out = self._store.shared_checkout(spec, tenant, domain)
        return out, np.flatnonzero(out.rows.any(axis=1) | out.probs.any(axis=1))  # [z]: ids or probs learned

    @grpc_errors
    async def PushRows(self, request: pb.PushRowsRequest, context) -> pb.PushRowsReply:
        tenant, domain = tenant_from_pb(request.tenant, request.domain)
        spec = spec_from_pb(request.model)
        tokens, topk, probs = rows_from_pb(request.rows, spec.k)  # [m], [m, K], [m, K] uint8 or None
        since = request.since_epoch if request.HasField("since_epoch") else None
        version, epoch = await asyncio.to_thread(self._store.apply_versioned, spec, tenant, tokens, topk, domain, since,
                                                 probs=probs)
        return pb.PushRowsReply(version=version, epoch=epoch)

    # -- the tenants' suffix histories (replica drafting) --------------------------------------
    @grpc_errors
    async def GetHistory(self, request: pb.HistoryRequest, context) -> pb.HistoryReply:
        tenant, _ = tenant_from_pb(request.tenant)
        spec = spec_from_pb(request.model)
        if self._histories is None:
            return pb.HistoryReply()
        return await asyncio.to_thread(self._history_reply, spec, tenant, request.since_version, request.since_epoch)

    @grpc_errors
    async def PushHistory(self, request: pb.PushHistoryRequest, context) -> pb.PushHistoryReply:
        tenant, _ = tenant_from_pb(request.tenant)
        self._guard_reserved(tenant, "adding history to")
        spec = spec_from_pb(request.model)
        if self._histories is None:
            raise FailedPrecondition("this matrix service keeps no suffix histories (started with --history-mb 0)")
        documents = documents_from_pb(request.documents, spec, self._limits.max_history_documents)
        history = await asyncio.to_thread(self._add_history, spec, tenant, documents)
        return pb.PushHistoryReply(tokens=history.tokens, memory_bytes=history.memory_bytes())

    # in a thread: loading a history from Redis and adding documents (O(L x max_ngram) numpy work each)
    def _history_of(self, spec, tenant: str):
        self._store.register(spec)  # FailedPrecondition for a model this service does not serve
        return self._histories.get(spec.fingerprint, tenant)

    def _history_reply(self, spec, tenant: str, since: int, epoch: int) -> pb.HistoryReply:
        """The documents added after version `since` (> 0) of history `epoch` where it still holds them
        all, else the whole history."""
        history = self._history_of(spec, tenant)
        added = history.documents_since(since, epoch) if since > 0 else None
        if added is not None:
            return pb.HistoryReply(delta=True, added=documents_to_pb(added[0]), version=added[1], epoch=history.epoch,
                                   tokens=history.tokens, documents=history.documents)
        version = history.version  # read first: the blob holds at least what this version had
        return pb.HistoryReply(history=history.to_bytes() if history.documents else b"", version=version,
                               epoch=history.epoch, tokens=history.tokens, documents=history.documents)

    def _add_history(self, spec, tenant: str, documents):
        history = self._history_of(spec, tenant)
        for doc in documents:
            self._histories.add(spec.fingerprint, tenant, history, doc)
        return history

    # -- administration ----------------------------------------------------------------------
    @grpc_errors
    async def Describe(self, request: pb.TenantRef, context) -> pb.DescribeReply:
        async with self.bulk.slot("Describe"):
            info = await asyncio.to_thread(self._store.describe, request.fingerprint, request.tenant)
        health = await asyncio.to_thread(self._store.health)
        last = info["last_snapshot_version"]
        return pb.DescribeReply(
            tenant=info["tenant"], domain=info["domain"] or "", fingerprint=info["fingerprint"],
            version=info["version"], nonzero_rows=info["nonzero_rows"],
            last_snapshot_version=-1 if last is None else last, in_memory=info["in_memory"],
            redis=health["redis"], last_snapshot_error=health["last_snapshot_error"] or "",
            epoch=max(info["epoch"], 0), rows_sha256=info["rows_sha256"], memory_bytes=info["memory_bytes"],
            probs_sha256=info["probs_sha256"],
        )

    @grpc_errors
    async def ListVersions(self, request: pb.TenantRef, context) -> pb.ListVersionsReply:
        versions = await asyncio.to_thread(self._store.versions, request.fingerprint, request.tenant)
        return pb.ListVersionsReply(versions=versions)

    @grpc_errors
    async def Snapshot(self, request: pb.TenantRef, context) -> pb.VersionReply:
        self._guard_reserved(request.tenant, "snapshotting")
        async with self.bulk.slot("Snapshot"):
            version = await asyncio.to_thread(self._store.snapshot_now, request.fingerprint, request.tenant)
        return pb.VersionReply(version=version)

    @grpc_errors
    async def Rollback(self, request: pb.RollbackRequest, context) -> pb.VersionReply:
        ref = request.ref
        self._guard_reserved(ref.tenant, "rolling back")
        async with self.bulk.slot("Rollback"):
            version = await asyncio.to_thread(self._store.rollback, ref.fingerprint, ref.tenant, int(request.version))
        return pb.VersionReply(version=version)

    @grpc_errors
    async def Fork(self, request: pb.ForkRequest, context) -> pb.VersionReply:
        ref = request.ref
        self._guard_reserved(request.to, "forking into")
        async with self.bulk.slot("Fork"):
            version = await asyncio.to_thread(self._store.fork, ref.fingerprint, ref.tenant, request.to)
        return pb.VersionReply(version=version)

    @grpc_errors
    async def Delete(self, request: pb.TenantRef, context) -> pb.DeleteReply:
        self._guard_reserved(request.tenant, "deleting")
        await asyncio.to_thread(self._store.delete, request.fingerprint, request.tenant)
        return pb.DeleteReply()

    @grpc_errors
    async def ListTenants(self, request: pb.ListTenantsRequest, context) -> pb.ListTenantsReply:
        summaries = await asyncio.to_thread(self._store.list_tenants, request.fingerprint or None)
        health = await asyncio.to_thread(self._store.health)
        histories = {(fp, t): n for fp, t, n in (self._histories.memory() if self._histories is not None else [])}
        tenants = [summary_to_pb(s, histories.get((s.fingerprint, s.tenant), 0)) for s in summaries]
        return pb.ListTenantsReply(tenants=tenants, redis=health["redis"], memory_bytes=health["memory_bytes"],
                                   tenants_in_memory=health["tenants_in_memory"],
                                   max_tenants_in_memory=health["max_tenants_in_memory"], models=health["models"],
                                   history_bytes=sum(histories.values()))


def add_to_server(servicer: MatrixServicer, server: grpc.aio.Server) -> None:
    pb_grpc.add_MatrixServiceServicer_to_server(servicer, server)
