"""The OpenAI API's errors: a bad field names itself (OpenAI's error.param); each domain error becomes
an HTTP status and OpenAI's error body (`error_body`), as its gRPC status would say it. And a call's
deadline from its `X-Request-Timeout` header (`HttpDeadline`)."""

from __future__ import annotations

import logging
import math
import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from ...core.errors import InvalidArgument, TRServeError
from ..common.errors import status_for
from ..worker.admission import QueueFull
from ..worker.checks import InvalidField

log = logging.getLogger("trserve.openai")


class BadParam(InvalidArgument):
    """An invalid request field; `param` names it (OpenAI's error.param)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ModelNotFound(BadParam):
    status = "NOT_FOUND"


# gRPC status name -> (HTTP status, OpenAI error type)
ERRORS = {
    "INVALID_ARGUMENT": (400, "invalid_request_error"), "FAILED_PRECONDITION": (400, "invalid_request_error"),
    "OUT_OF_RANGE": (400, "invalid_request_error"), "NOT_FOUND": (404, "invalid_request_error"),
    "UNAUTHENTICATED": (401, "authentication_error"), "PERMISSION_DENIED": (403, "permission_error"),
    "RESOURCE_EXHAUSTED": (429, "rate_limit_error"), "UNAVAILABLE": (503, "service_unavailable"),
    "DEADLINE_EXCEEDED": (504, "timeout"), "UNIMPLEMENTED": (501, "not_implemented"),
    "CANCELLED": (499, "client_closed_request"),  # nobody reads it: the client is gone
}
# the front door's field names (services/worker/checks.py:InvalidField) as this API names them (error.param)
PARAMS = {"tenant": "X-Tenant", "max_new_tokens": "max_tokens"}


class Unauthenticated(TRServeError):
    status = "UNAUTHENTICATED"


class ClientGone(TRServeError):
    """The HTTP client closed its connection (mid-body, or while its generation ran): nothing to answer."""

    status = "CANCELLED"


class TooLarge(TRServeError):
    """HTTP 413: the caller's error (counted as INVALID_ARGUMENT), not the server refusing load."""

    status = "INVALID_ARGUMENT"


class HttpDeadline:
    """A call's deadline from its `X-Request-Timeout: <seconds>` header, as a gRPC deadline works:
    decoding stops in time to return a partial answer, or 504 when too little is left to start.
    Without the header a call runs until done (or the client goes away)."""

    def __init__(self, request: Request) -> None:
        value = request.headers.get("x-request-timeout")
        if value is None:
            self.end = None
            return
        try:
            seconds = float(value)
        except ValueError:
            seconds = float("nan")
        if not 0 < seconds < 1e6:
            raise BadParam(f"X-Request-Timeout must be seconds in (0, 1e6), got {value!r}", "X-Request-Timeout")
        self.end = time.monotonic() + seconds

    def time_remaining(self) -> float | None:
        return None if self.end is None else self.end - time.monotonic()


def error_body(exc: BaseException) -> tuple[int, dict, dict[str, str]]:
    """(HTTP status, OpenAI error body, headers) for an exception, as its gRPC status would say it."""
    code = status_for(exc).name
    status, kind = ERRORS.get(code, (500, "server_error"))
    message = str(exc) or type(exc).__name__
    headers: dict[str, str] = {}
    error_code = code.lower()
    if isinstance(exc, ModelNotFound):
        error_code = "model_not_found"
    elif isinstance(exc, TooLarge):
        status, kind, error_code = 413, "invalid_request_error", "request_too_large"
    elif isinstance(exc, QueueFull):
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s))),
                   "retry-after-ms": str(int(exc.retry_after_s * 1000))}
        error_code = "rate_limit_exceeded"
    if isinstance(exc, ClientGone):  # routine: no traceback, not an error
        log.info("OpenAI API: %s", exc)
    elif status == 500:
        log.exception("OpenAI API call failed", exc_info=exc)
        message = f"internal error ({type(exc).__name__}); see the server log"
    else:  # the message may quote the request (user text): only at DEBUG
        log.info("OpenAI API -> %d (%s)", status, type(exc).__name__)
        log.debug("OpenAI API -> %d: %s", status, exc)
    param = exc.param if isinstance(exc, BadParam) else PARAMS.get(exc.field) if isinstance(exc, InvalidField) else None
    return status, {"error": {"message": message, "type": kind, "param": param, "code": error_code}}, headers


def error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = error_body(exc)
    return JSONResponse(body, status_code=status, headers=headers)
