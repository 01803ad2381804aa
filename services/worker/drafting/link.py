"""What the remote and replica draft sources share: client config, the fallback counter, one
channel per source with a simple breaker, a watchdog for stream reads, the session base that
degrades to local drafting, and caller errors re-raised by type (remote.py, replica.py)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc

from ....core.errors import FailedPrecondition, FingerprintMismatch, InvalidArgument, ModelNotServed, NotFound, TRServeError
from ....engine.tr.matrix import AdjacencyMatrix
from ....engine.tr.recycle import RecycledRows
from ....engine.tr.source import MatrixSession
from ....engine.tr.tree import CompiledTree
from ...common.errors import domain_error_from
from ...common.matrix_convert import rows_to_pb
from ...common.security import SharedSecret, client_channel
from ....v1 import matrix_pb2 as pb
from ....v1 import matrix_pb2_grpc as pb_grpc

log = logging.getLogger("trserve.matrix.client")

# Statuses that say the request itself is wrong (raised to the caller, never a fallback), with the
# domain error for a status that carries no error type (e.g. from another server).
# What the matrix service answers when it cannot serve this worker's model (not in its --model list,
# too large, max_models taken, or another model under this fingerprint): no caller can fix that, so
# the worker drafts locally (counted as a fallback) instead of failing requests.
SERVICE_FAULTS = (ModelNotServed, FingerprintMismatch)
CALLER_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument,
}


@dataclass(frozen=True)
class DraftClientConfig:
    open_timeout_s: float = 2.0  # connect + open (remote) or checkout (replica); may load from Redis
    step_timeout_s: float = 0.5  # one remote draft round trip; then the session drafts locally
    retry_after_s: float = 5.0  # after a failure, sessions skip the service this long
    push_interval_s: float = 0.05  # rows (replica), finished requests (replica, remote): the most they wait to go
    push_timeout_s: float = 2.0  # replica: one PushRows call
    push_max_rows: int = 4096  # replica: rows per PushRows (the service's max_batch_rows)
    history: bool = True  # replica and remote: draft from the tenant's suffix history on the service, and feed it
    # replica and remote: fetch the tenant's history again (in the background) when older
    history_refresh_s: float = 60.0
    tls_ca_file: str | None = None  # PEM CA to trust: reach the service over TLS; None = plaintext
    secret: SharedSecret | None = None  # sent on every call when the service requires it
    allow_plaintext_secret: bool = False  # send `secret` without TLS to a non-loopback address

    def __post_init__(self) -> None:
        if self.tls_ca_file is not None and not Path(self.tls_ca_file).is_file():
            raise ValueError(f"TLS CA file {self.tls_ca_file!r} does not exist")
        for name in ("open_timeout_s", "step_timeout_s", "retry_after_s", "push_interval_s", "push_timeout_s",
                     "history_refresh_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.push_max_rows < 1:
            raise ValueError(f"push_max_rows must be >= 1, got {self.push_max_rows}")


class FallbackCounter:
    """Sessions that drafted locally because the service failed (export as a metric)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._n = 0

    def inc(self) -> None:
        with self._lock:
            self._n += 1

    @property
    def value(self) -> int:
        return self._n


FALLBACKS = FallbackCounter()  # process-wide, over every source


def fallback_count() -> int:
    return FALLBACKS.value


class Watchdog:
    """Cancels a stream read that outlives its deadline: sync gRPC stream reads have no per-read
    timeout, and one Timer thread per step would cost more than the round trip itself."""

    def __init__(self, tick_s: float) -> None:
        self._tick = tick_s
        self._armed: dict[int, tuple[float, grpc.Future]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="matrix-draft-watchdog", daemon=True)
        self._thread.start()

    def arm(self, call: grpc.Future, timeout_s: float) -> None:
        with self._lock:
            self._armed[id(call)] = (time.monotonic() + timeout_s, call)

    def disarm(self, call: grpc.Future) -> None:
        with self._lock:
            self._armed.pop(id(call), None)

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self._tick):
            now = time.monotonic()
            with self._lock:
                late = [key for key, (deadline, _) in self._armed.items() if deadline <= now]
                calls = [self._armed.pop(key)[1] for key in late]
            for call in calls:
                call.cancel()


class Link:
    """One channel to the service, shared by a source's sessions, with a simple breaker."""

    def __init__(self, addr: str, config: DraftClientConfig) -> None:
        self.addr, self.config = addr, config
        self.channel = client_channel(addr, config.tls_ca_file, config.secret,
                                      allow_plaintext_secret=config.allow_plaintext_secret,
                                      options=[("grpc.max_receive_message_length", 8 << 20),
                                               ("grpc.max_send_message_length", 8 << 20)])
        self.stub = pb_grpc.MatrixServiceStub(self.channel)
        self.watchdog = Watchdog(min(0.05, config.step_timeout_s / 4))
        self.fallbacks = 0
        self._down_until = 0.0

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def fell_back(self, tenant: str, what: str, exc: BaseException | None) -> None:
        self.fallbacks += 1
        FALLBACKS.inc()
        if exc is None:  # skipped: the breaker is open, the failure was logged already
            log.debug("matrix service %s skipped for tenant %s (failed recently); drafting locally", self.addr, tenant)
            return
        self._down_until = time.monotonic() + self.config.retry_after_s
        if isinstance(exc, grpc.RpcError) and exc.code() == grpc.StatusCode.UNAUTHENTICATED:
            log.error("matrix service %s refuses this worker's secret (%s); drafting locally for tenant %s",
                      self.addr, describe(exc), tenant)
            return
        log.warning("matrix service %s: %s failed for tenant %s (%s); drafting locally", self.addr, what, tenant,
                    describe(exc))

    def close(self) -> None:
        self.watchdog.close()
        self.channel.close()


def describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


def raise_caller_error(exc: grpc.RpcError) -> None:
    """Re-raise a status that says the request itself is wrong as its domain error: the type the
    service raised (sent in the trailing metadata, services/common/errors.py), else by status."""
    fallback = CALLER_ERRORS.get(exc.code())
    if fallback is not None:
        error: type[TRServeError] = domain_error_from(exc.trailing_metadata(), fallback)
        if issubclass(error, SERVICE_FAULTS):  # the service's state, not the request: draft locally
            return
        raise error(exc.details()) from None


def rows_pb(recycled: RecycledRows | None) -> pb.RowBatch:
    """Recycled rows as a RowBatch: ids, and their confidences where the engine has them."""
    if recycled is None:
        return pb.RowBatch()
    probs = None if recycled.probs is None else recycled.probs.cpu().numpy()  # [m, K] uint8
    return rows_to_pb(recycled.tokens.cpu().numpy(), recycled.topk.cpu().numpy(), probs)


class TenantHistory(Protocol):
    """Where a split worker's finished requests go (replica_history.py:ReplicaHistory)."""

    def remember(self, tokens: list[int]) -> None: ...


class ServiceSession(MatrixSession):
    """A MatrixSession whose rows go to the matrix service; `fail` degrades it to drafting from its
    private copy, logged and counted once."""

    def __init__(self, link: Link, tenant: str, matrix: AdjacencyMatrix, tree: CompiledTree, version: int) -> None:
        super().__init__(matrix, tree)
        self.link, self.tenant = link, tenant
        self.service_version = version  # the service's, from its replies; kept through a fallback
        self.replica_history: TenantHistory | None = None  # where finished requests go (set at open)

    @property
    def version(self) -> int:
        return self.service_version

    def remember(self, tokens: list[int]) -> None:
        """Queued for the source's pusher thread, which adds it to the tenant's history copy and pushes it."""
        if self.replica_history is not None:
            self.replica_history.remember(tokens)

    def fail(self, what: str, exc: BaseException | None) -> None:
        self._detach()
        if self.fall_back():
            self.link.fell_back(self.tenant, what, exc)

    def _detach(self) -> None:
        """Drop what talks to the service (a stream, pending pushes)."""
