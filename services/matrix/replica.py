"""Replica drafting: check the tenant's matrix out at open, draft locally, push the recycled rows
back in batches from a background thread; close() flushes what is left (see client.py)."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import torch

from engine.matrix import AdjacencyMatrix, DraftInfo
from engine.recycle import RecycledRows
from engine.tree import CompiledTree
from matrix_store import ModelSpec
from services.matrix.convert import rows_from_pb, rows_to_pb, spec_to_pb, tenant_from_pb
from services.matrix.link import DraftClientConfig, Link, raise_caller_error
from trserve.v1 import matrix_pb2 as pb


class _Pusher:
    """A background thread that flushes every open replica session each `interval_s`."""

    def __init__(self, interval_s: float) -> None:
        self._interval = interval_s
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

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                sessions = list(self._sessions)
            for session in sessions:
                session.flush()


class ReplicaDraftSource:
    """Checkout at open, local drafting, asynchronous row pushes (see the module docstring)."""

    def __init__(self, addr: str, tenant: str, domain: str | None = None,
                 config: DraftClientConfig = DraftClientConfig()) -> None:
        self.tenant, self.domain = tenant_from_pb(tenant, domain or "")
        self._link = Link(addr, config)
        self._pusher = _Pusher(config.push_interval_s)

    @property
    def fallbacks(self) -> int:
        return self._link.fallbacks

    def open(self, tree: CompiledTree, fingerprint: str, vocab_size: int, k: int) -> ReplicaDraftSession:
        spec = ModelSpec(fingerprint, vocab_size, k)
        device = tree.parent.device
        failure: BaseException | None = None
        version, rows = 0, None
        if self._link.available():
            try:
                version, rows = self._checkout(spec)
            except grpc.RpcError as exc:
                raise_caller_error(exc)
                failure = exc
        matrix = AdjacencyMatrix(vocab_size, k, fingerprint, device,
                                 None if rows is None else torch.from_numpy(rows), version)
        session = ReplicaDraftSession(self._link, self._pusher, self.tenant, self.domain, spec, tree, matrix)
        if rows is None:
            session.fall_back("checkout", failure)
        else:
            self._pusher.add(session)
        return session

    def _checkout(self, spec: ModelSpec) -> tuple[int, np.ndarray]:
        """(version, rows [V, K] int32) of the tenant, assembled from the nonzero-row chunks."""
        rows = np.zeros(spec.shape, np.int32)  # [V, K]
        version = 0
        request = pb.CheckoutRequest(tenant=self.tenant, domain=self.domain or "", model=spec_to_pb(spec))
        for chunk in self._link.stub.Checkout(request, timeout=self._link.config.open_timeout_s):
            tokens, topk = rows_from_pb(chunk.rows, spec.k)  # [m], [m, K]
            rows[tokens] = topk
            version = chunk.version
        return version, rows

    def close(self) -> None:
        self._pusher.close()
        self._link.close()


class ReplicaDraftSession:
    def __init__(self, link: Link, pusher: _Pusher, tenant: str, domain: str | None, spec: ModelSpec,
                 tree: CompiledTree, matrix: AdjacencyMatrix) -> None:
        self._link, self._pusher, self._tenant, self._domain = link, pusher, tenant, domain
        self._spec, self._tree, self.matrix = spec, tree, matrix
        self._version = matrix.version  # the service's version: checkout, then each push's ack
        self._mode = "replica"
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []  # (tokens [m], topk [m, K]), oldest first
        self._lock = threading.Lock()  # guards _pending
        self._push_lock = threading.Lock()  # one push at a time, in order

    def fall_back(self, what: str, exc: BaseException | None) -> None:
        with self._lock:
            self._pending.clear()
        self._pusher.remove(self)
        if self._mode != "local-fallback":
            self._mode = "local-fallback"
            self._link.fell_back(self._tenant, what, exc)

    def step(self, recycled: RecycledRows | None, root: int) -> torch.Tensor:
        if recycled is not None:
            self.matrix.apply(recycled)
            self._queue(recycled)
        return self.matrix.draft(root, self._tree)

    def _queue(self, recycled: RecycledRows) -> None:
        if self._mode == "local-fallback":
            return
        with self._lock:
            self._pending.append((recycled.tokens.cpu().numpy(), recycled.topk.cpu().numpy()))

    def flush(self) -> None:
        """Push the pending rows, oldest first, concatenated into batches of <= push_max_rows
        (a token in several steps: the later row wins, as it does locally)."""
        with self._push_lock:
            while True:
                batch = self._take()
                if batch is None:
                    return
                request = pb.PushRowsRequest(tenant=self._tenant, domain=self._domain or "",
                                             model=spec_to_pb(self._spec), rows=rows_to_pb(*batch))
                try:
                    self._version = self._link.stub.PushRows(request, timeout=self._link.config.push_timeout_s).version
                except grpc.RpcError as exc:
                    self.fall_back("row push", exc)
                    return

    def _take(self) -> tuple[np.ndarray, np.ndarray] | None:
        with self._lock:
            taken, rows = 0, 0
            while taken < len(self._pending) and (taken == 0 or rows + len(self._pending[taken][0]) <= self._link.config.push_max_rows):
                rows += len(self._pending[taken][0])
                taken += 1
            items, self._pending = self._pending[:taken], self._pending[taken:]
        if not items:
            return None
        return np.concatenate([t for t, _ in items]), np.concatenate([r for _, r in items])

    def close(self, recycled: RecycledRows | None) -> None:
        if recycled is not None:
            self.matrix.apply(recycled)
            self._queue(recycled)
        self._pusher.remove(self)
        self.flush()

    def info(self) -> DraftInfo:
        return DraftInfo(matrix_version=self._version, mode=self._mode)
