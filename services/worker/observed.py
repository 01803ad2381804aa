"""`observed`: what every Generate-service RPC gets around it (inside @grpc_errors): a count per final
status, a full queue refused with the retry-after trailers gRPC's retry policy reads, and the call's
request id taken from its metadata (or made), set as its log context and echoed."""

from __future__ import annotations

import asyncio
import functools
import inspect

import grpc

from ..common.errors import status_for
from ..common.logcontext import HEADER, REQUEST_ID, request_id
from .admission import QueueFull


def _retry_trailers(retry_after_s: float) -> tuple[tuple[str, str], ...]:
    """A busy worker's hint, twice: `grpc-retry-pushback-ms` is the standard one that gRPC's own retry
    policy (clients/python/trserve_client/service_config.json) waits for in any language;
    `retry-after-ms` is ours."""
    ms = str(max(int(retry_after_s * 1000), 1))
    return (("grpc-retry-pushback-ms", ms), ("retry-after-ms", ms))


def _request_id_of(context) -> tuple[tuple[str, str], ...]:
    """The call's id: the caller's `x-request-id` metadata (a plain token) or a new one, set as the log
    context of what this call logs (services/common/logcontext.py); returned as the metadata that
    echoes it. It goes out with the reply (initial metadata) or the error (trailing metadata), never
    before: a call whose headers have been sent is committed, and gRPC would no longer retry it
    elsewhere when this worker is busy."""
    given = next((value for key, value in context.invocation_metadata() or () if key == HEADER), None)
    rid = request_id(given if isinstance(given, str) else None)
    REQUEST_ID.set(rid)  # this RPC's own task: the value ends with it
    return ((HEADER, rid),)


def observed(method):
    """Count each RPC by final status code; refuse a full queue with a retry-after trailer; echo the
    call's request id.

    Sits inside @grpc_errors, so it sees the domain exception before it becomes a status.
    """
    name = method.__name__

    async def on_error(self, exc: BaseException, context, echo) -> str:
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            return "CANCELLED"
        if isinstance(exc, QueueFull):
            self.metrics.requests.labels(name, "RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc),
                                trailing_metadata=_retry_trailers(exc.retry_after_s) + echo)
        # other errors: @grpc_errors aborts with the id (services/common/errors.py:abort_with)
        return "ABORTED" if isinstance(exc, grpc.aio.AbortError) else status_for(exc).name

    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
            echo, sent = _request_id_of(context), False
            try:
                async for item in method(self, request, context):
                    if not sent:
                        await context.send_initial_metadata(echo)
                        sent = True
                    yield item
            except BaseException as exc:
                self.metrics.requests.labels(name, await on_error(self, exc, context, echo)).inc()
                raise
            self.metrics.requests.labels(name, "OK").inc()
        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        echo = _request_id_of(context)
        try:
            response = await method(self, request, context)
        except BaseException as exc:
            self.metrics.requests.labels(name, await on_error(self, exc, context, echo)).inc()
            raise
        await context.send_initial_metadata(echo)
        self.metrics.requests.labels(name, "OK").inc()
        return response
    return unary
