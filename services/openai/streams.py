"""A streamed answer's choices (`n` > 1) decoded side by side: each choice is its own Generate stream
(the engine batches them), merged into one sequence of (choice index, item) in arrival order.

Back-pressure is kept: the merge holds at most one item per choice, so a client that stops reading
leaves each choice's chunks in its own bounded engine stream, whose reader is then cut off and its
request cancelled as for a single stream (services/worker/bridge.py)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


async def all_or_none(coros: list) -> list:
    """Every coroutine's result (unary choices side by side); where one fails, the others are cancelled
    (their decode slots freed) before its error is raised."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def first_items(streams: list[AsyncIterator]) -> list:
    """Each stream's first item (after its prefill), awaited side by side so every choice is submitted
    at once; a failure closes them all and raises (the caller answers a plain HTTP error)."""
    try:
        return list(await asyncio.gather(*(anext(s) for s in streams)))
    except BaseException:
        for s in streams:
            await s.aclose()
        raise


async def merged(streams: list[AsyncIterator], firsts: list, last) -> AsyncIterator[tuple[int, object]]:
    """(index, item) from every stream, starting with its first item, until each has given an item of
    type `last`; an exception from any stream is raised here (and every stream closed)."""
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(i: int, stream: AsyncIterator, item) -> None:
        try:
            await queue.put((i, item))
            while not isinstance(item, last):
                item = await anext(stream)
                await queue.put((i, item))
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            await queue.put((i, exc))

    tasks = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
    try:
        open_ = len(streams)
        while open_:
            i, item = await queue.get()
            if isinstance(item, Exception):
                raise item
            open_ -= isinstance(item, last)
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        for s in streams:
            await s.aclose()
