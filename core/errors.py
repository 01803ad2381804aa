"""Domain errors shared by engine/, matrix_store/ and services/.

Each class names the gRPC status the service layer maps it to (services never map by message).
They subclass the builtin a Python caller would expect, so engine users can still
`except ValueError` without knowing about trserve.
"""

from __future__ import annotations


class TRServeError(Exception):
    """Base of all trserve domain errors; `status` is the gRPC status name it maps to."""

    status = "INTERNAL"


class InvalidArgument(TRServeError, ValueError):
    """The caller sent something malformed or out of range; retrying unchanged cannot help."""

    status = "INVALID_ARGUMENT"


class OutputStuck(InvalidArgument):
    """A request's own output rules cannot go on while it decodes: its grammar hit a limit of the grammar
    engine, or its rules (grammar, min_tokens, stop ids) leave no token allowed. That request alone
    ends with this; the same request would end the same way again. `why`: the cause alone."""

    def __init__(self, message: str, why: str = "") -> None:
        super().__init__(message)
        self.why = why or message


class NotFound(TRServeError, LookupError):
    """A named thing (tenant, version, tree template) does not exist."""

    status = "NOT_FOUND"


class FailedPrecondition(TRServeError, ValueError):
    """The request is well formed but the state refuses it (e.g. a matrix built for another model)."""

    status = "FAILED_PRECONDITION"


class FingerprintMismatch(FailedPrecondition):
    """A matrix was built with another tokenizer/vocabulary than the one it is used with."""


class ModelNotServed(FailedPrecondition):
    """A matrix store does not serve this model (its configured list, size bound or model count)."""


class PermissionDenied(TRServeError):
    """The caller is known but may not do this (another tenant's domain, a reserved tenant)."""

    status = "PERMISSION_DENIED"


class ResourceExhausted(TRServeError):
    """A bound (queue, memory, size) is hit; the caller may retry later."""

    status = "RESOURCE_EXHAUSTED"


class Unavailable(TRServeError):
    """A dependency (matrix service, Redis) cannot be reached right now."""

    status = "UNAVAILABLE"


