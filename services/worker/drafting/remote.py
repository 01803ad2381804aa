"""Remote drafting: the matrix service drafts, one bidi round trip per decoding step (the rows of
the last verification with their confidences + the new root -> the next tree's tokens). Every row
is also applied to the session's private copy (cold at open, ~1.9 MiB of ids and confidences at
V=49152, K=8), so a fallback keeps drafting with what this request learned instead of from zeros.

Synchronous (the engine's decode loop runs in a thread), and it never stalls decoding on a dead
service: opens and steps have short timeouts; on failure the session keeps drafting locally
(`info().mode == "local-fallback"`), logs a warning and counts it (`fallback_count()`, per source
`.fallbacks`), and the source skips the service for `retry_after_s` before trying it again.
Caller errors at open (INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND) are raised, not hidden.

The tenant's suffix history comes from the service as a replica's does (replica_history.py: a copy
caught up in the background, finished requests pushed back by the source's pusher thread); the
engine grafts its continuations into the service's static trees as chains (engine/drafting/drafter.py).
"""

from __future__ import annotations

import logging
import queue

import grpc
import torch

from ....core.model_spec import ModelSpec
from ....engine.tr.matrix import AdjacencyMatrix
from ....engine.tr.recycle import RecycledRows
from ....engine.tr.tree import CompiledTree
from ...common.matrix_convert import spec_to_pb, tenant_from_pb
from .link import DraftClientConfig, Link, ServiceSession, describe, raise_caller_error, rows_pb
from .replica import Pusher
from .replica_history import ReplicaHistory
from ....v1 import matrix_pb2 as pb

log = logging.getLogger("trserve.matrix.client")


class _Stream:
    """A DraftSession bidi call driven synchronously: put a request, read its reply."""

    def __init__(self, link: Link, first: pb.DraftRequest) -> None:
        self._link = link
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._requests.put(first)
        self._call = link.stub.DraftSession(iter(self._requests.get, None))

    def roundtrip(self, request: pb.DraftRequest | None, timeout_s: float) -> pb.DraftReply:
        if request is not None:
            self._requests.put(request)
        self._link.watchdog.arm(self._call, timeout_s)
        try:
            return next(self._call)
        except StopIteration:
            raise ConnectionError("the service ended the draft stream") from None
        finally:
            self._link.watchdog.disarm(self._call)

    def close(self) -> None:
        self._requests.put(None)  # ends the request iterator (half-close)
        self._call.cancel()


class RemoteDraftSource:
    """Drafting by the matrix service, one round trip per step (see the module docstring)."""

    def __init__(self, addr: str, tenant: str, domain: str | None = None,
                 config: DraftClientConfig = DraftClientConfig()) -> None:
        self.tenant, self.domain = tenant_from_pb(tenant, domain or "")
        self._link = Link(addr, config)
        self.history = ReplicaHistory(self._link, self.tenant, config.history_refresh_s) if config.history else None
        self._pusher = Pusher(config.push_interval_s, self.history) if self.history is not None else None

    @property
    def fallbacks(self) -> int:
        return self._link.fallbacks

    def open(self, tree: CompiledTree, spec: ModelSpec) -> RemoteDraftSession:
        session = RemoteDraftSession(self._link, self.tenant, AdjacencyMatrix(spec, tree.parent.device), tree)
        if self.history is not None:  # this tenant's own: the service never hands out another tenant's
            session.history, session.replica_history = self.history.current(spec), self.history
        if not self._link.available():
            session.fail("open", None)
            return session
        request = pb.DraftRequest(open=pb.DraftOpen(
            tenant=self.tenant, domain=self.domain or "", model=spec_to_pb(spec),
            tree=tree.template.name, tree_paths=[pb.TreePath(ranks=p) for p in tree.template.paths]))
        stream = _Stream(self._link, request)
        try:
            reply = stream.roundtrip(None, self._link.config.open_timeout_s)
        except (grpc.RpcError, ConnectionError) as exc:
            stream.close()
            if isinstance(exc, grpc.RpcError):
                raise_caller_error(exc)
            session.fail("open", exc)
            return session
        session.attach(stream, reply.version, reply.epoch)
        return session

    def close(self) -> None:
        if self._pusher is not None:
            self._pusher.close()  # its last history pushes first
        self._link.close()


class RemoteDraftSession(ServiceSession):
    mode = "remote"

    local_drafts = False  # the service drafts; the mirror starts cold (static trees only)

    def __init__(self, link: Link, tenant: str, mirror: AdjacencyMatrix, tree: CompiledTree) -> None:
        super().__init__(link, tenant, mirror, tree, version=0)
        self._stream: _Stream | None = None

    def attach(self, stream: _Stream, version: int, epoch: int) -> None:
        self._stream, self.service_version, self.matrix_epoch = stream, version, epoch

    def _detach(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def _step(self, recycled: RecycledRows | None, root: int) -> torch.Tensor:
        if self._stream is not None:
            request = pb.DraftRequest(step=pb.DraftStep(rows=rows_pb(recycled), root=root))
            try:
                reply = self._stream.roundtrip(request, self.link.config.step_timeout_s)
                if len(reply.tokens) != self.tree.n:
                    raise ConnectionError(f"service drafted {len(reply.tokens)} tokens for a {self.tree.n}-node tree")
                self.service_version = reply.version
                return torch.tensor(list(reply.tokens), dtype=torch.long, device=self.matrix.rows.device)  # [n]
            except (grpc.RpcError, ConnectionError) as exc:
                self.fail("draft step", exc)
        return super()._step(recycled, root)

    def _close(self, recycled: RecycledRows | None) -> None:
        if self._stream is None:
            return
        request = pb.DraftRequest(step=pb.DraftStep(rows=rows_pb(recycled), final=True))
        try:
            self.service_version = self._stream.roundtrip(request, self.link.config.step_timeout_s).version
        except (grpc.RpcError, ConnectionError) as exc:
            log.warning("matrix service %s: the last rows of tenant %s were not flushed (%s)",
                        self.link.addr, self.tenant, describe(exc))
        finally:
            self._detach()
