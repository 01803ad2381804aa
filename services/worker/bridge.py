"""From the engine thread to the event loop: one request's StepChunks and GenerationResult.

The batching engine (engine/engine.py) calls `emit` on its own thread; items reach the request's
coroutine through an asyncio.Queue. A reader that falls more than `limit` chunks behind, or that
takes nothing for `stall_s` seconds while chunks wait (a stream whose client stopped reading: gRPC's
flow-control window may first absorb thousands of small chunks), gets its request cancelled: the
engine drops it at the next step and goes on with the others. `finish` waits for the engine's final result, so a caller releases
its admission place only once the engine has freed the request's KV row.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable

from ...engine.results import GenerationResult, StepChunk


class EngineStream:
    def __init__(self, loop: asyncio.AbstractEventLoop, cancelled: threading.Event, limit: int,
                 stall_s: float = float("inf"), on_cut: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._loop, self.cancelled, self._limit, self._stall_s, self._clock = loop, cancelled, limit, stall_s, clock
        self._on_cut = on_cut  # called once, on the loop, with "behind" or "stalled", when the reader is cut off
        self._queue: asyncio.Queue[StepChunk | GenerationResult | Exception] = asyncio.Queue()
        self._result: asyncio.Future[GenerationResult] = loop.create_future()
        self._waiting_since: float | None = None  # since when chunks wait and the reader took none
        self.cut_off: str | None = None  # why the reader's request was cancelled: "behind" or "stalled"

    def emit(self, item: StepChunk | GenerationResult | Exception) -> None:
        """Engine thread: hand an item to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._put, item)
        except RuntimeError:  # the loop is closed (server gone): nobody is listening any more
            self.cancelled.set()

    def _put(self, item: StepChunk | GenerationResult | Exception) -> None:
        if isinstance(item, Exception):  # the engine failed this request's step
            if not self._result.done():
                self._result.set_exception(item)
                self._result.exception()  # retrieved: no "never retrieved" warning when nobody waits
        elif isinstance(item, GenerationResult):
            if not self._result.done():
                self._result.set_result(item)
        elif self._queue.qsize() >= self._limit:
            self._stop("behind")  # the reader stopped reading: free the engine's place
            return
        elif self._waiting_since is None:
            self._waiting_since = self._clock()
        elif self._clock() - self._waiting_since > self._stall_s:
            self._stop("stalled")
            return
        self._queue.put_nowait(item)

    def _stop(self, why: str) -> None:
        if self.cut_off is None:
            self.cut_off = why
            if self._on_cut is not None:
                self._on_cut(why)
        self.cancelled.set()

    async def items(self) -> AsyncIterator[StepChunk | GenerationResult]:
        """The request's chunks, then its result."""
        while True:
            item = await self._queue.get()
            self._waiting_since = None if self._queue.empty() else self._clock()  # the reader made progress
            if isinstance(item, Exception):
                raise item
            yield item
            if isinstance(item, GenerationResult):
                return

    async def finish(self) -> GenerationResult | None:
        """Stop the request if it is still running; its result once the engine has let it go (None
        if the engine failed it)."""
        if not self._result.done():
            self.cancelled.set()
        try:
            return await asyncio.shield(self._result)
        except Exception:  # noqa: BLE001 - raised to the caller by items()
            return None
