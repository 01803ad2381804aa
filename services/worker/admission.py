"""The worker's one admission queue: every call is counted from its first line (at most
`max_calls` in flight: beyond it a call is refused before it is converted or tokenized), and of
the Generate calls at most `max_active` (the engine's batch) decode while at most `max_queue` wait;
the rest are refused with an estimate of when a place frees up.

A worker decodes a bounded batch per model, so waiting requests would otherwise pile up without
bound and all miss their deadlines; refusing early with a retry hint lets a caller go elsewhere or
back off. The engine's own queue (engine/scheduler.py) then only holds what the KV budget delays.
Event loop only (not thread-safe).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator

from ...core.errors import ResourceExhausted


class QueueFull(ResourceExhausted):
    """The admission queue is full; `retry_after_s` estimates when a slot frees up."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class TooManyCalls(QueueFull):
    """More calls in flight than the server takes; refused before any work is done for them."""


class Admission:
    """Calls in flight, decode slots and the queue for them (see the module docstring)."""

    def __init__(self, max_active: int, max_queue: int, max_calls: int | None = None) -> None:
        self.max_active, self.max_queue = max_active, max_queue
        self.max_calls = max_calls if max_calls is not None else max_active + max_queue
        self._slots = asyncio.Semaphore(max_active)
        self.calls = 0  # in flight, any RPC
        self.waiting = 0  # Generate calls waiting for a decode slot
        self.active = 0  # Generate calls holding one
        self._mean_service_s = 1.0  # moving average of time a request holds a slot

    def eta_s(self) -> float:
        """Rough time until a newly arriving request would get a slot."""
        ahead = self.waiting + self.active
        return max(0.1, self._mean_service_s * ahead / self.max_active)

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Count a call in flight for the body. Raises TooManyCalls beyond `max_calls`."""
        if self.calls >= self.max_calls:
            wait = self.eta_s()
            raise TooManyCalls(f"server busy: {self.calls} calls in flight (max_concurrent_rpcs={self.max_calls}); "
                               f"retry after ~{wait:.1f} s or use another worker", retry_after_s=wait)
        self.calls += 1
        try:
            yield
        finally:
            self.calls -= 1

    def try_admit(self) -> None:
        """QueueFull when a request arriving now could neither decode nor wait."""
        if self.waiting >= self.max_queue and self.active >= self.max_active:
            wait = self.eta_s()
            raise QueueFull(
                f"server busy: {self.active} request(s) decoding and {self.waiting} queued (max_queue={self.max_queue}); "
                f"retry after ~{wait:.1f} s or use another worker",
                retry_after_s=wait,
            )

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[float]:
        """Hold a decoding slot for the body; yields the seconds spent waiting. Raises QueueFull."""
        self.try_admit()
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
