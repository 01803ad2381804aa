"""A replica worker's copy of one tenant's suffix history (engine/tr/history.py), kept on the
matrix service (GetHistory, PushHistory) so that every worker drafts from what the tenant wrote
through any of them.

A session opening takes the copy as it is: never a wait on the service. Finished requests are queued
on the engine thread; the source's pusher thread adds them to the copy (this worker's next request
sees them at once) and pushes them to the service in batches, and, once a session found the copy
older than `refresh_s`, fetches what the service's history gained since the copy last caught up
(GetHistory's `since_version`) and adds it, this worker's own documents skipped. The first time, and
where the service no longer holds all of it, it fetches the whole history and swaps it in for later
sessions (rebuilding a full history's index takes ~0.1-0.5 s of CPU on these hosts: hence in the
background). A tenant's first request on a worker drafts without its history.
A failing service costs only the history's drafts: the copy is kept, pushes are dropped and logged
(throttled), requests never fail. A service that keeps no histories (FAILED_PRECONDITION on a push)
is not asked again.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Sequence

import grpc
import numpy as np

from ....core.errors import TRServeError
from ....core.model_spec import ModelSpec
from ....engine.tr.history import SuffixHistory
from ...common.matrix_convert import documents_from_pb, documents_to_pb, spec_to_pb
from .link import Link, describe
from ...common.throttle import Throttle
from ....v1 import matrix_pb2 as pb

log = logging.getLogger("trserve.matrix.client")
_THROTTLE = Throttle()
MAX_PENDING = 1024  # finished requests waiting for a push; beyond, the oldest are not pushed
PUSH_DOCUMENTS = 64  # documents per PushHistory (the service takes at most 256)


class ReplicaHistory:
    """One tenant's history on a replica worker (see the module docstring); thread-safe."""

    def __init__(self, link: Link, tenant: str, refresh_s: float = 60.0,
                 clock=time.monotonic) -> None:
        self.link, self.tenant, self.refresh_s, self._clock = link, tenant, refresh_s, clock
        self.history: SuffixHistory | None = None
        self._spec: ModelSpec | None = None
        self._fetched_at = float("-inf")
        self._refresh_due = False  # a session found the copy stale: the pusher thread fetches
        self._pending: list[np.ndarray] = []  # [L] int32 each, oldest first
        self._lock = threading.Lock()
        self._push_lock = threading.Lock()
        self.kept_by_service = True  # False once the service says it keeps no histories
        self.pushed = 0  # documents the service took
        self._seen = (0, 0)  # the service history's (version, epoch) the copy last caught up with (0: whole)
        self._mine: dict[bytes, int] = {}  # digests of documents this worker added since: a delta skips them
        self.fetches = {"whole": 0, "delta": 0}

    def current(self, spec: ModelSpec) -> SuffixHistory:
        """The copy for a session opening now (on the caller's thread, without waiting); a stale one
        is fetched again by the pusher thread."""
        self._spec = spec
        if self.kept_by_service and self._clock() - self._fetched_at >= self.refresh_s:
            self._refresh_due = True
        if self.history is None:
            self.history = SuffixHistory()  # until the service answers: this worker's own requests
        return self.history

    def _refresh(self) -> None:
        """The service's history in place of the copy (the pusher thread, after its pushes)."""
        if not (self._refresh_due and self.kept_by_service and self._spec is not None and self.link.available()):
            return
        self._refresh_due, self._fetched_at = False, self._clock()
        self._fetch(self._spec)

    def _fetch(self, spec: ModelSpec) -> None:
        """The documents the service's history gained since the copy last caught up, added to the copy
        (those this worker added itself skipped); the whole history in place of the copy where the
        service no longer holds them all (or on the first fetch): a full history's index rebuild took
        ~0.1-0.5 s, where a delta costs ~1 ms a document."""
        request = pb.HistoryRequest(tenant=self.tenant, model=spec_to_pb(spec), since_version=self._seen[0],
                                    since_epoch=self._seen[1])
        try:
            reply = self.link.stub.GetHistory(request, timeout=self.link.config.open_timeout_s)
            if reply.delta and self._seen[0] and self.history is not None:
                for doc in documents_from_pb(reply.added, spec, len(reply.added)):
                    key = _digest(doc)
                    if self._mine.get(key):
                        self._mine[key] -= 1  # this worker's own, already in the copy
                        continue
                    self.history.add(doc)
                self.fetches["delta"] += 1
            else:
                self.history = SuffixHistory.from_bytes(reply.history) if reply.history else SuffixHistory()
                self._mine.clear()
                self.fetches["whole"] += 1
            self._seen = (reply.version, reply.epoch)
            self._mine = {k: c for k, c in self._mine.items() if c}
        except (grpc.RpcError, ValueError, TRServeError) as exc:  # ValueError: not an intact history blob
            _THROTTLE.failed("history fetch", self.tenant, _Described(exc), "drafting from the copy it has")

    def remember(self, tokens: Sequence[int]) -> None:
        """A finished request (prompt + output): queued, O(1) for the engine thread."""
        doc = np.asarray(tokens, np.int32)
        with self._lock:
            self._pending.append(doc)
            del self._pending[:-MAX_PENDING]

    def flush(self, refresh: bool = True) -> None:
        """Add the queued requests to the copy and push them to the service, then (with `refresh`)
        fetch the service's history if a session found the copy stale (the pusher's thread)."""
        with self._push_lock:
            with self._lock:
                docs, self._pending = self._pending, []
            for doc in docs:  # (a session opened, so the copy exists, before any request finished)
                self.history.add(doc)
                if self._seen[0] and len(self._mine) < 4 * MAX_PENDING:  # a later delta brings it back: skipped
                    key = _digest(doc)
                    self._mine[key] = self._mine.get(key, 0) + 1
            if docs and self.kept_by_service and self._spec is not None:
                for start in range(0, len(docs), PUSH_DOCUMENTS):
                    if not self._push(docs[start:start + PUSH_DOCUMENTS]):
                        break
            if refresh:
                self._refresh()

    def _push(self, docs: list[np.ndarray]) -> bool:
        request = pb.PushHistoryRequest(tenant=self.tenant, model=spec_to_pb(self._spec),
                                        documents=documents_to_pb(docs))
        try:
            self.link.stub.PushHistory(request, timeout=self.link.config.push_timeout_s)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # no histories kept, or not this model
                self.kept_by_service = False
                log.info("matrix service %s takes no history (%s): tenant %s's history stays on this worker",
                         self.link.addr, describe(exc), self.tenant)
            else:
                _THROTTLE.failed("history push", self.tenant, _Described(exc), f"{len(docs)} requests not pushed")
            return False
        self.pushed += len(docs)
        return True


def _digest(doc: np.ndarray) -> bytes:
    """A document's identity in `_mine`: 16 bytes, whatever its length."""
    return hashlib.blake2b(doc.tobytes(), digest_size=16).digest()


class _Described(TRServeError):
    """`describe(exc)` (a status and its details) as an expected failure: logged without a traceback."""

    def __init__(self, exc: BaseException) -> None:
        super().__init__(describe(exc))
