"""One place that maps domain errors to gRPC status codes (used by every servicer).

Domain errors carry the status name they map to (core/errors.py); builtin ValueErrors are
INVALID_ARGUMENT; anything else is logged with its traceback and returned as INTERNAL without
leaking internals to the caller.
"""

from __future__ import annotations

import functools
import inspect
import logging

import grpc

from ...core import errors as domain
from ...core.errors import TRServeError
from .logcontext import HEADER, REQUEST_ID

log = logging.getLogger("trserve.services")

# Trailing metadata key naming the domain error a status came from, so a Python client (the
# worker's draft sources) re-raises the same type instead of guessing from the message.
ERROR_TYPE_KEY = "trserve-error-type"


def status_for(exc: BaseException) -> grpc.StatusCode:
    if isinstance(exc, TRServeError):
        return getattr(grpc.StatusCode, exc.status, grpc.StatusCode.INTERNAL)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    return grpc.StatusCode.INTERNAL


def _details(exc: BaseException, code: grpc.StatusCode) -> str:
    if code == grpc.StatusCode.INTERNAL:
        return f"internal error ({type(exc).__name__}); see the server log"
    return str(exc) or type(exc).__name__


def domain_error_from(metadata, default: type[TRServeError]) -> type[TRServeError]:
    """The domain error class named in a status's trailing metadata, else `default`."""
    name = dict(metadata or ()).get(ERROR_TYPE_KEY)
    error = getattr(domain, name, None) if name else None
    return error if isinstance(error, type) and issubclass(error, TRServeError) else default


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    code = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("%s failed", method, exc_info=exc)
    else:  # the message may quote the request (user text): only at DEBUG
        log.info("%s -> %s (%s)", method, code.name, type(exc).__name__)
        log.debug("%s -> %s: %s", method, code.name, exc)
    typed = ((ERROR_TYPE_KEY, type(exc).__name__),) if isinstance(exc, TRServeError) else ()
    rid = REQUEST_ID.get()  # the call's id (services/worker/servicer.py:observed), echoed with its error
    await context.abort(code, _details(exc, code), trailing_metadata=typed + (((HEADER, rid),) if rid else ()))


def grpc_errors(method):
    """Decorator for async servicer methods (unary or server-streaming): domain errors -> status codes."""
    name = method.__qualname__
    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def stream_wrapper(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except (grpc.aio.AbortError, GeneratorExit):
                raise
            except Exception as exc:  # noqa: BLE001 - every other failure is mapped, never dropped
                await abort_with(context, exc, name)

        return stream_wrapper

    @functools.wraps(method)
    async def unary_wrapper(self, request, context):
        try:
            return await method(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:  # noqa: BLE001
            await abort_with(context, exc, name)

    return unary_wrapper
