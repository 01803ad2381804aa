"""Bounded admission: at most `max_active` requests (the engine's batch) decode, at most `max_queue`
wait, the rest are refused.

A worker decodes a bounded batch per model, so waiting requests would otherwise pile up without bound and all
miss their deadlines; refusing early with a retry hint lets a caller go elsewhere or back off.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

from core.errors import ResourceExhausted


class QueueFull(ResourceExhausted):
    """The admission queue is full; `retry_after_s` estimates when a slot frees up."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Admission:
    """Async admission control for one decoder. Not thread-safe: use it from the event loop only."""

    def __init__(self, max_active: int, max_queue: int) -> None:
        self.max_active = max_active
        self.max_queue = max_queue
        self._slots = asyncio.Semaphore(max_active)
        self.waiting = 0
        self.active = 0
        self._mean_service_s = 1.0  # moving average of time a request holds a slot

    def retry_after_s(self) -> float:
        """Rough time until a newly arriving request would get a slot."""
        ahead = self.waiting + self.active
        return max(0.1, self._mean_service_s * ahead / self.max_active)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        """Hold a decoding slot for the body; yields the seconds spent waiting. Raises QueueFull."""
        if self.waiting >= self.max_queue and self.active >= self.max_active:
            wait = self.retry_after_s()
            raise QueueFull(
                f"server busy: {self.active} request(s) decoding and {self.waiting} queued (max_queue={self.max_queue}); "
                f"retry after ~{wait:.1f} s or use another worker",
                retry_after_s=wait,
            )
        t0 = time.monotonic()
        self.waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self.waiting -= 1
        self.active += 1
        started = time.monotonic()
        try:
            yield started - t0
        finally:
            self.active -= 1
            self._slots.release()
            self._mean_service_s = 0.8 * self._mean_service_s + 0.2 * (time.monotonic() - started)


class TooManyCalls(QueueFull):
    """More calls in flight than the server takes; refused before any work is done for them."""


class CallGate:
    """At most `limit` calls in flight (Generate, GenerateStream, Tokenize), counted from their
    first line: beyond it a call is refused at once, before it is converted or tokenized. Event
    loop only."""

    def __init__(self, limit: int, admission: Admission) -> None:
        self.limit, self.admission, self.active = limit, admission, 0

    @contextlib.contextmanager
    def enter(self):
        if self.active >= self.limit:
            wait = self.admission.retry_after_s()
            raise TooManyCalls(f"server busy: {self.active} calls in flight (max_concurrent_rpcs={self.limit}); "
                               f"retry after ~{wait:.1f} s or use another worker", retry_after_s=wait)
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
