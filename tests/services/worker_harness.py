"""A real worker on port 0, run on its own event loop in a background thread, for synchronous tests."""

from __future__ import annotations

import asyncio
import threading

import grpc

from trserve.services.worker.config import WorkerConfig
from trserve.services.worker.server import Worker, create_server


class BackgroundWorker:
    def __init__(self, config: WorkerConfig, decoder, **kwargs) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-worker-loop", daemon=True)
        self._thread.start()
        self.worker: Worker = self.call(create_server(config, decoder, **kwargs))
        self.addr = f"127.0.0.1:{self.worker.port}"

    def call(self, coro, timeout: float = 120):
        """Run a coroutine on the worker's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def wait_ready(self, timeout: float = 120) -> None:
        async def ready():
            await self.worker.ready
        self.call(ready(), timeout)

    def stop(self, grace_s: float = 1.0) -> None:
        self.call(self.worker.stop(grace_s))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()

    @property
    def metrics(self):
        return self.worker.metrics


def rpc_error(fn, *args, **kwargs) -> grpc.RpcError:
    """The RpcError raised by fn(*args, **kwargs); fails if it succeeds."""
    try:
        fn(*args, **kwargs)
    except grpc.RpcError as e:
        return e
    raise AssertionError("expected the call to fail")


def serving(config: WorkerConfig, decoder, **kwargs):
    """A ready worker for the length of a fixture: `yield from serving(config, decoder)`."""
    w = BackgroundWorker(config, decoder, **kwargs)
    w.wait_ready()
    yield w
    w.stop()
