"""Running the engine's blocking generator in a decode thread and consuming it from asyncio.

The Decoder is synchronous and serial (one forward stream per model), so each request's
`Decoder.stream` runs in the worker's decode executor; its items are handed to the event loop
through an asyncio.Queue. If the consumer goes away (client cancel, deadline, error), the
`cancelled` event tells the engine to stop at its next step, and the consumer waits for the
thread to finish so the next request never overlaps a half-finished one.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import Executor
from typing import Any

_DONE = object()


class _Failed:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


async def iterate_in_thread(executor: Executor, make_iter: Callable[[], Iterator[Any]],
                            cancelled: threading.Event) -> AsyncIterator[Any]:
    """Yield the items of `make_iter()` (called and iterated in `executor`) on the event loop."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()

    def put(item: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed (server gone): nobody is listening any more
            cancelled.set()

    def pump() -> None:
        try:
            for item in make_iter():
                put(item)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, who maps it
            put(_Failed(exc))
        finally:
            put(_DONE)

    future = loop.run_in_executor(executor, pump)
    try:
        while (item := await queue.get()) is not _DONE:
            if isinstance(item, _Failed):
                raise item.exc
            yield item
    finally:
        cancelled.set()  # a no-op once the engine has finished; otherwise it stops at the next step
        await asyncio.shield(future)
