"""Replica drafting: check the tenant's matrix (ids and confidences) out at open, draft locally,
push the recycled rows and their confidences back in batches from a background thread; close()
flushes what is left. Failures degrade the session to local drafting, as in remote.py. The tenant's
suffix history comes from the service too, and finished requests go back to it (replica_history.py)."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import torch

from ....core.errors import InvalidArgument
from ....core.model_spec import ModelSpec
from ....engine.tr.matrix import AdjacencyMatrix
from ....engine.tr.recycle import RecycledRows
from ....engine.tr.tree import CompiledTree
from ....matrix_store.tenant import validate_batch
from ...common.matrix_convert import rows_from_pb, rows_to_pb, spec_to_pb, tenant_from_pb
from .link import DraftClientConfig, Link, ServiceSession, raise_caller_error
from .replica_history import ReplicaHistory
from ....v1 import matrix_pb2 as pb


class Pusher:
    """A background thread that flushes every open replica session, then the source's history (replica
    and remote sources), each `interval_s`."""

    def __init__(self, interval_s: float, history: ReplicaHistory | None = None) -> None:
        self._interval = interval_s
        self._history = history  # its finished requests are pushed on this thread too
        self._sessions: set[ReplicaDraftSession] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="matrix-row-pusher", daemon=True)
        self._thread.start()

    def add(self, session: ReplicaDraftSession) -> None:
        with self._lock:
            self._sessions.add(session)

    def remove(self, session: ReplicaDraftSession) -> None:
        with self._lock:
            self._sessions.discard(session)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        if self._history is not None:
            self._history.flush(refresh=False)  # the last pushes; no fetch for a source being closed

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                sessions = list(self._sessions)
            for session in sessions:
                session.flush()
            if self._history is not None:
                self._history.flush()


class ReplicaDraftSource:
    """Checkout at open, local drafting, asynchronous row pushes (see the module docstring)."""

    def __init__(self, addr: str, tenant: str, domain: str | None = None,
                 config: DraftClientConfig = DraftClientConfig()) -> None:
        self.tenant, self.domain = tenant_from_pb(tenant, domain or "")
        self._link = Link(addr, config)
        self.history = ReplicaHistory(self._link, self.tenant, config.history_refresh_s) if config.history else None
        self._pusher = Pusher(config.push_interval_s, self.history)

    @property
    def fallbacks(self) -> int:
        return self._link.fallbacks

    def open(self, tree: CompiledTree, spec: ModelSpec) -> ReplicaDraftSession:
        failure: BaseException | None = None
        version, rows, probs, epoch = 0, None, None, None
        if self._link.available():
            try:
                version, rows, probs, epoch = self._checkout(spec)
            except (grpc.RpcError, ConnectionError) as exc:  # ConnectionError: a malformed reply
                if isinstance(exc, grpc.RpcError):
                    raise_caller_error(exc)
                failure = exc
        matrix = AdjacencyMatrix(spec, tree.parent.device, None if rows is None else torch.from_numpy(rows), version,
                                 None if probs is None else torch.from_numpy(probs))
        session = ReplicaDraftSession(self._link, self._pusher, self.tenant, self.domain, spec, tree, matrix, epoch)
        if self.history is not None:  # this tenant's own: the service never hands out another tenant's
            session.history, session.replica_history = self.history.current(spec), self.history
        if rows is None:
            session.fail("checkout", failure)
        else:
            self._pusher.add(session)
        return session

    def _checkout(self, spec: ModelSpec) -> tuple[int, np.ndarray, np.ndarray, int | None]:
        """(version, rows [V, K] int32, probs [V, K] uint8, epoch) of the tenant, assembled from the
        nonzero-row chunks (a chunk without probs: zeros, unknown). Nothing is kept from a reply that
        fails: the caller drafts from zeros."""
        rows, probs = np.zeros(spec.shape, np.int32), np.zeros(spec.shape, np.uint8)  # [V, K], [V, K]
        version, epoch = 0, None
        request = pb.CheckoutRequest(tenant=self.tenant, domain=self.domain or "", model=spec_to_pb(spec))
        for chunk in self._link.stub.Checkout(request, timeout=self._link.config.open_timeout_s):
            tokens, topk, chunk_probs = _checked_rows(chunk.rows, spec)  # [m], [m, K], [m, K] uint8
            rows[tokens] = topk
            probs[tokens] = chunk_probs
            version, epoch = chunk.version, chunk.epoch
        return version, rows, probs, epoch

    def close(self) -> None:
        self._pusher.close()
        self._link.close()


def _checked_rows(batch: pb.RowBatch, spec: ModelSpec) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A checkout chunk's (tokens [m], topk [m, K], probs [m, K] uint8; zeros when it has none), or
    ConnectionError when the service sent what it must not (rows of another width, ids outside the
    vocabulary, probs of another length): the session then drafts locally, as for a service that
    is down; the caller's request is not at fault."""
    try:
        tokens, topk, probs = rows_from_pb(batch, spec.k)  # [m], [m, K], [m, K] or None
        if tokens.size:  # (probs of an empty chunk must be empty: rows_from_pb checks m * K bytes)
            validate_batch(spec, tokens, topk, spec.vocab_size, probs)
    except InvalidArgument as exc:
        raise ConnectionError(f"malformed checkout reply: {exc}") from None
    return tokens, topk, np.zeros(topk.shape, np.uint8) if probs is None else probs


class ReplicaDraftSession(ServiceSession):
    mode = "replica"

    def __init__(self, link: Link, pusher: Pusher, tenant: str, domain: str | None, spec: ModelSpec,
                 tree: CompiledTree, matrix: AdjacencyMatrix, epoch: int | None = None) -> None:
        super().__init__(link, tenant, matrix, tree, version=matrix.version)  # checkout, then each push's ack
        self._epoch = epoch  # of the checkout: a tenant deleted since is not resurrected by our pushes
        self.matrix_epoch = epoch  # then each push's
        self._pusher, self._domain, self._spec = pusher, domain, spec
        # (tokens [m], topk [m, K], probs [m, K] uint8; zeros where the engine had none), oldest first
        self._pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._lock = threading.Lock()  # guards _pending
        self._push_lock = threading.Lock()  # one push at a time, in order

    def _detach(self) -> None:
        with self._lock:
            self._pending.clear()
        self._pusher.remove(self)

    def _step(self, recycled: RecycledRows | None, root: int) -> torch.Tensor:
        self._queue(recycled)
        return super()._step(recycled, root)

    def _push(self, recycled: RecycledRows) -> None:
        self._queue(recycled)

    def _close(self, recycled: RecycledRows | None) -> None:
        self._queue(recycled)
        self._pusher.remove(self)
        self.flush()

    def _queue(self, recycled: RecycledRows | None) -> None:
        if recycled is None or self.mode == "local-fallback":
            return
        topk = recycled.topk.cpu().numpy()  # [m, K]
        probs = np.zeros(topk.shape, np.uint8) if recycled.probs is None else recycled.probs.cpu().numpy()  # [m, K]
        with self._lock:
            self._pending.append((recycled.tokens.cpu().numpy(), topk, probs))

    def flush(self) -> None:
        """Push the pending rows, oldest first, concatenated into batches of <= push_max_rows
        (a token in several steps: the later row wins, as it does locally)."""
        with self._push_lock:
            while True:
                batch = self._take()
                if batch is None:
                    return
                request = pb.PushRowsRequest(tenant=self.tenant, domain=self._domain or "",
                                             model=spec_to_pb(self._spec), rows=rows_to_pb(*batch),
                                             since_epoch=self._epoch)
                try:
                    reply = self.link.stub.PushRows(request, timeout=self.link.config.push_timeout_s)
                    self.service_version, self.matrix_epoch = reply.version, reply.epoch
                except grpc.RpcError as exc:
                    self.fail("row push", exc)
                    return

    def _take(self) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        with self._lock:
            taken, rows = 0, 0
            limit = self.link.config.push_max_rows
            while taken < len(self._pending) and (taken == 0 or rows + len(self._pending[taken][0]) <= limit):
                rows += len(self._pending[taken][0])
                taken += 1
            items, self._pending = self._pending[:taken], self._pending[taken:]
        if not items:
            return None
        return tuple(np.concatenate([item[i] for item in items]) for i in range(3))  # [m], [m, K], [m, K]
