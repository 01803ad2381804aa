"""Worker-side draft sources backed by the matrix service (the engine's DraftSource protocol).

- `RemoteDraftSource`: one bidi round trip per decoding step (rows of the last verification +
  the new root -> the next tree's tokens). It also applies every row to a local mirror matrix
  (cold at open, ~1.5 MB at V=49152, K=8), so a fallback keeps drafting with what this request
  learned instead of from zeros.
- `ReplicaDraftSource`: checks the tenant's matrix out at open, drafts locally, and a background
  thread pushes the recycled rows back in batches; close() flushes what is left.

Both are synchronous (the engine's decode loop runs in a thread) and never stall decoding on a
dead service: opens and steps have short timeouts; on failure the session keeps drafting locally
(`info().mode == "local-fallback"`), logs a warning and counts it (`fallback_count()`, per source
`.fallbacks`), and the source skips the service for `retry_after_s` before trying it again.
Caller errors at open (INVALID_ARGUMENT, FAILED_PRECONDITION, NOT_FOUND) are raised, not hidden.
"""

from __future__ import annotations

import logging
import queue

import grpc
import torch

from engine.matrix import AdjacencyMatrix, DraftInfo
from engine.recycle import RecycledRows
from engine.tree import CompiledTree
from matrix_store import ModelSpec
from services.matrix.convert import spec_to_pb, tenant_from_pb
from services.matrix.link import (
    FALLBACKS, DraftClientConfig, Link, describe, fallback_count, raise_caller_error, rows_pb,
)
from services.matrix.replica import ReplicaDraftSession, ReplicaDraftSource
from trserve.v1 import matrix_pb2 as pb

__all__ = ["FALLBACKS", "DraftClientConfig", "RemoteDraftSession", "RemoteDraftSource", "ReplicaDraftSession",
           "ReplicaDraftSource", "fallback_count"]
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


# -- remote ------------------------------------------------------------------------------------
class RemoteDraftSource:
    """Drafting by the matrix service, one round trip per step (see the module docstring)."""

    def __init__(self, addr: str, tenant: str, domain: str | None = None,
                 config: DraftClientConfig = DraftClientConfig()) -> None:
        self.tenant, self.domain = tenant_from_pb(tenant, domain or "")
        self._link = Link(addr, config)

    @property
    def fallbacks(self) -> int:
        return self._link.fallbacks

    def open(self, tree: CompiledTree, fingerprint: str, vocab_size: int, k: int) -> RemoteDraftSession:
        mirror = AdjacencyMatrix(vocab_size, k, fingerprint, tree.parent.device)
        session = RemoteDraftSession(self._link, self.tenant, tree, mirror)
        if not self._link.available():
            session.fall_back("open", None)
            return session
        request = pb.DraftRequest(open=pb.DraftOpen(
            tenant=self.tenant, domain=self.domain or "", model=spec_to_pb(ModelSpec(fingerprint, vocab_size, k)),
            tree=tree.template.name, tree_paths=[pb.TreePath(ranks=p) for p in tree.template.paths]))
        stream = _Stream(self._link, request)
        try:
            reply = stream.roundtrip(None, self._link.config.open_timeout_s)
        except (grpc.RpcError, ConnectionError) as exc:
            stream.close()
            if isinstance(exc, grpc.RpcError):
                raise_caller_error(exc)
            session.fall_back("open", exc)
            return session
        session.attach(stream, reply.version)
        return session

    def close(self) -> None:
        self._link.close()


class RemoteDraftSession:
    def __init__(self, link: Link, tenant: str, tree: CompiledTree, mirror: AdjacencyMatrix) -> None:
        self._link, self._tenant, self._tree, self._mirror = link, tenant, tree, mirror
        self._stream: _Stream | None = None
        self._version = 0
        self._mode = "remote"

    def attach(self, stream: _Stream, version: int) -> None:
        self._stream, self._version = stream, version

    def fall_back(self, what: str, exc: BaseException | None) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None
        if self._mode != "local-fallback":
            self._mode = "local-fallback"
            self._link.fell_back(self._tenant, what, exc)

    def step(self, recycled: RecycledRows | None, root: int) -> torch.Tensor:
        if recycled is not None:
            self._mirror.apply(recycled)
        if self._stream is not None:
            request = pb.DraftRequest(step=pb.DraftStep(rows=rows_pb(recycled), root=root))
            try:
                reply = self._stream.roundtrip(request, self._link.config.step_timeout_s)
                if len(reply.tokens) != self._tree.n:
                    raise ConnectionError(f"service drafted {len(reply.tokens)} tokens for a {self._tree.n}-node tree")
                self._version = reply.version
                return torch.tensor(list(reply.tokens), dtype=torch.long, device=self._mirror.rows.device)  # [n]
            except (grpc.RpcError, ConnectionError) as exc:
                self.fall_back("draft step", exc)
        return self._mirror.draft(root, self._tree)

    def close(self, recycled: RecycledRows | None) -> None:
        if recycled is not None:
            self._mirror.apply(recycled)
        if self._stream is None:
            return
        request = pb.DraftRequest(step=pb.DraftStep(rows=rows_pb(recycled), final=True))
        try:
            self._version = self._stream.roundtrip(request, self._link.config.step_timeout_s).version
        except (grpc.RpcError, ConnectionError) as exc:
            log.warning("matrix service %s: the last rows of tenant %s were not flushed (%s)",
                        self._link.addr, self._tenant, describe(exc))
        finally:
            self._stream.close()
            self._stream = None

    def info(self) -> DraftInfo:
        return DraftInfo(matrix_version=self._version, mode=self._mode)
