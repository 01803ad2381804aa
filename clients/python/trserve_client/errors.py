"""Typed errors: each gRPC status a caller acts on differently is a class of its own. They are
grpc.RpcError too (`code()`, `details()`, `trailing_metadata()` as grpc's), so code written against
raw gRPC errors keeps working."""

from __future__ import annotations

import grpc


class TRServeError(grpc.RpcError):
    """A failed call: `code` (grpc.StatusCode), `message` (the server's), `request_id` (its echo)."""

    def __init__(self, code: grpc.StatusCode, message: str, trailers=(), request_id: str | None = None) -> None:
        super().__init__(f"{code.name}: {message}")
        self._code, self.message, self._trailers, self.request_id = code, message, tuple(trailers or ()), request_id

    @property
    def status(self) -> grpc.StatusCode:
        return self._code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self.message

    def trailing_metadata(self):
        return self._trailers


class InvalidArgument(TRServeError):
    """The request is wrong (INVALID_ARGUMENT, FAILED_PRECONDITION, OUT_OF_RANGE): fix it, do not retry."""


class Unauthenticated(TRServeError):
    """No or an unknown tenant token."""


class PermissionDenied(TRServeError):
    """The token's tenant may not do this (another tenant, a domain not granted)."""


class NotFound(TRServeError):
    """What the request names does not exist (a tree, a model)."""


class Busy(TRServeError):
    """RESOURCE_EXHAUSTED: the worker's queue is full. `retry_after_s`: the server's hint, or None."""

    @property
    def retry_after_s(self) -> float | None:
        for key, value in self._trailers:
            if key in ("retry-after-ms", "grpc-retry-pushback-ms"):
                try:
                    return int(value) / 1000
                except ValueError:
                    return None
        return None


class DeadlineExceeded(TRServeError):
    """The call's deadline passed before an answer (a unary call near its deadline answers partially,
    finish_reason "time_limit", instead)."""


class Unavailable(TRServeError):
    """The worker is unreachable or shutting down: retry, elsewhere if you can."""


class Cancelled(TRServeError):
    """The call was cancelled (by this client)."""


class ServerError(TRServeError):
    """INTERNAL or another status: the server's fault; its log has the details."""


_BY_CODE = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument, grpc.StatusCode.FAILED_PRECONDITION: InvalidArgument,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgument, grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied, grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Busy, grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAVAILABLE: Unavailable, grpc.StatusCode.CANCELLED: Cancelled,
}


def typed(error: grpc.RpcError) -> TRServeError:
    """The typed error of a grpc.RpcError (sync or asyncio)."""
    if isinstance(error, TRServeError):
        return error
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    trailers = error.trailing_metadata() if callable(getattr(error, "trailing_metadata", None)) else ()
    trailers = tuple(trailers or ())
    request_id = next((v for k, v in trailers if k == "x-request-id"), None)
    return _BY_CODE.get(code, ServerError)(code, details or "", trailers, request_id)
