"""Helpers and fixtures for the matrix service tests (imported by tests/services/test_matrix*.py):
a real matrix server on port 0 in a background event-loop thread, stubs, and row batches."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Callable, Iterator

import grpc
import numpy as np
import pytest
import redis

from trserve.matrix_store import MatrixStore, StoreConfig
from trserve.services.common.matrix_convert import rows_to_pb
from trserve.services.matrix.server import MatrixServer, MatrixServiceConfig, create_server
from trserve.v1 import matrix_pb2 as pb
from trserve.v1 import matrix_pb2_grpc as pb_grpc

REDIS_URL = "redis://127.0.0.1:6379/0"
FP, V, K = "test-fp", 1000, 8


class ServerThread:
    """A MatrixServer served by an event loop in a daemon thread, so sync clients can call it."""

    def __init__(self, config: MatrixServiceConfig, store: MatrixStore | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="matrix-test-server", daemon=True).start()
        self.running: MatrixServer = self._call(self._create(config, store))
        self.port = self.running.port
        self.addr = f"127.0.0.1:{self.port}"
        self.stopped = False

    async def _create(self, config: MatrixServiceConfig, store: MatrixStore | None) -> MatrixServer:
        running = create_server(config, store)
        await running.start()
        return running

    def _call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def store(self) -> MatrixStore:
        return self.running.store

    def stop(self, grace_s: float | None = 0, final_snapshot: bool = True) -> None:
        if not self.stopped:
            self.stopped = True
            self._call(self.running.stop(grace_s, final_snapshot))
        self._loop.call_soon_threadsafe(self._loop.stop)


def service_config(prefix: str | None, redis_url: str | None = REDIS_URL, **store: object) -> MatrixServiceConfig:
    fields = {"redis_url": redis_url, "key_prefix": prefix or "trtest-unused", **store}
    return MatrixServiceConfig(host="127.0.0.1", port=0, store=StoreConfig(**fields))  # type: ignore[arg-type]


def model(fingerprint: str = FP, vocab_size: int = V, k: int = K) -> pb.ModelSpec:
    return pb.ModelSpec(fingerprint=fingerprint, vocab_size=vocab_size, k=k)


def random_rows(rng: np.random.Generator, m: int = 16, vocab_size: int = V, k: int = K,
                probs: bool = True) -> pb.RowBatch:
    """m random rows, with random nonzero confidences unless `probs` is False (an ids-only batch)."""
    tokens, topk = rng.integers(0, vocab_size, m), rng.integers(0, vocab_size, (m, k))
    return rows_to_pb(tokens, topk, rng.integers(1, 256, (m, k), np.uint8) if probs else None)


def push(stub, tenant: str, rows: pb.RowBatch, spec: pb.ModelSpec | None = None, domain: str = "") -> int:
    request = pb.PushRowsRequest(tenant=tenant, domain=domain, model=spec or model(), rows=rows)
    return stub.PushRows(request, timeout=10).version


def checkout(stub, tenant: str, spec: pb.ModelSpec | None = None) -> tuple[int, np.ndarray]:
    """(version, rows [V, K]) through the Checkout RPC."""
    version, rows, _ = checkout_probs(stub, tenant, spec)
    return version, rows


def checkout_probs(stub, tenant: str, spec: pb.ModelSpec | None = None) -> tuple[int, np.ndarray, np.ndarray]:
    """(version, rows [V, K] int32, probs [V, K] uint8) through the Checkout RPC."""
    spec = spec or model()
    rows = np.zeros((spec.vocab_size, spec.k), np.int32)
    probs = np.zeros((spec.vocab_size, spec.k), np.uint8)
    version = -1
    for chunk in stub.Checkout(pb.CheckoutRequest(tenant=tenant, model=spec, max_rows_per_chunk=100), timeout=10):
        tokens = np.frombuffer(chunk.rows.tokens, "<i4")
        rows[tokens] = np.frombuffer(chunk.rows.topk, "<i4").reshape(-1, spec.k)
        if chunk.rows.probs:
            probs[tokens] = np.frombuffer(chunk.rows.probs, "u1").reshape(-1, spec.k)
        version = chunk.version
    return version, rows, probs


def ref(tenant: str, fingerprint: str = FP) -> pb.TenantRef:
    return pb.TenantRef(tenant=tenant, fingerprint=fingerprint)


@pytest.fixture
def redis_prefix() -> Iterator[str]:
    """A key prefix no other test uses; every key under it is deleted afterwards."""
    p = f"trtest:{uuid.uuid4().hex}"
    yield p
    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{p}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


@pytest.fixture
def start_server(redis_prefix: str) -> Iterator[Callable[..., ServerThread]]:
    """Factory: start_server(**store overrides) -> a started server on this test's Redis prefix."""
    servers: list[ServerThread] = []

    def start(config: MatrixServiceConfig | None = None, **store: object) -> ServerThread:
        server = ServerThread(config or service_config(redis_prefix, **store))
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop(0, final_snapshot=False)


@pytest.fixture
def channel_to() -> Iterator[Callable[[ServerThread], pb_grpc.MatrixServiceStub]]:
    channels: list[grpc.Channel] = []

    def open_stub(server: ServerThread | str) -> pb_grpc.MatrixServiceStub:
        channel = grpc.insecure_channel(server if isinstance(server, str) else server.addr)
        channels.append(channel)
        return pb_grpc.MatrixServiceStub(channel)

    yield open_stub
    for channel in channels:
        channel.close()
