"""Fixtures for matrix_store tests: a real Redis, a unique key prefix per test, store factories,
and a TCP proxy in front of Redis that a test can cut and restore to simulate an outage."""

from __future__ import annotations

import socket
import threading
import uuid
from collections.abc import Callable, Iterator

import pytest
import redis

from trserve.core.model_spec import ModelSpec
from trserve.matrix_store import MatrixStore, StoreConfig

REDIS_HOST, REDIS_PORT = "127.0.0.1", 6379
REDIS_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/0"
V, K = 1000, 8


@pytest.fixture(scope="session")
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis(host=REDIS_HOST, port=REDIS_PORT, socket_timeout=2, socket_connect_timeout=2)
    try:
        client.ping()
    except redis.RedisError as exc:
        pytest.fail(
            f"matrix_store tests need a real Redis on {REDIS_HOST}:{REDIS_PORT} ({exc}); "
            "start one, e.g. `redis-server --save '' --port 6379` or `docker run -p 6379:6379 redis:7`",
            pytrace=False,
        )
    yield client
    client.close()


@pytest.fixture
def prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A key prefix no other test uses; every key under it is deleted afterwards."""
    p = f"trtest:{uuid.uuid4().hex}"
    yield p
    keys = list(redis_client.scan_iter(match=f"{p}:*", count=1000))
    if keys:
        redis_client.delete(*keys)


@pytest.fixture
def spec() -> ModelSpec:
    return ModelSpec("test-fp", V, K)


@pytest.fixture
def make_store(prefix: str) -> Iterator[Callable[..., MatrixStore]]:
    """Factory: make_store(**config overrides) -> store on the real Redis under this test's prefix
    (pass redis_url=None for memory only). Every store is closed without a final snapshot."""
    stores: list[MatrixStore] = []

    def make(**overrides: object) -> MatrixStore:
        fields = {"redis_url": REDIS_URL, "key_prefix": prefix, **overrides}
        store = MatrixStore(StoreConfig(**fields))  # type: ignore[arg-type]
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close(final_snapshot=False)


class TcpProxy:
    """Forwards a local port to Redis; `cut()` refuses and drops connections, `restore()` heals."""

    def __init__(self, target: tuple[str, int]) -> None:
        self._target = target
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._up = threading.Event()
        self._up.set()
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if not self._up.is_set():
                client.close()  # the "dead Redis": connection dropped at once
                continue
            upstream = socket.create_connection(self._target)
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def cut(self) -> None:
        self._up.clear()
        with self._lock:
            conns, self._conns = self._conns, []
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def restore(self) -> None:
        self._up.set()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._listener.close()


@pytest.fixture
def proxy(redis_client: redis.Redis) -> Iterator[TcpProxy]:
    p = TcpProxy((REDIS_HOST, REDIS_PORT))
    yield p
    p.close()
