"""Per-tenant side state (the online tree tuner's acceptance records): opaque blobs kept in an LRU
bounded by count and bytes, written through to Redis (which keeps every blob). Side state is an
optimisation: Redis failures are logged, never raised."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

from ..core.errors import Unavailable
from ..core.tenants import validate_tenant_id
from .config import StoreConfig, validate_fingerprint
from .redis_backend import RedisBackend

log = logging.getLogger("trserve.matrix_store")


class SideStates:
    def __init__(self, config: StoreConfig, backend: RedisBackend | None) -> None:
        self._config = config
        self._backend = backend
        # (name, fingerprint, tenant) -> blob, least recently used first; bounded (config)
        self._side: OrderedDict[tuple[str, str, str], bytes] = OrderedDict()
        self._side_bytes = 0
        self._lock = threading.Lock()

    def get(self, name: str, fingerprint: str, tenant: str) -> bytes | None:
        """The last blob saved for this tenant (memory, else its Redis copy); None when there is none
        or Redis cannot be read (the caller starts fresh: side state is an optimisation)."""
        key = (name, validate_fingerprint(fingerprint), validate_tenant_id(tenant))
        with self._lock:
            blob = self._side.get(key)
            if blob is not None:
                self._side.move_to_end(key)
        if blob is None and self._backend is not None:
            try:
                blob = self._backend.read_side(fingerprint, tenant, name)
            except Unavailable as e:
                log.warning("side state %s of tenant %s not read: %s", name, tenant, e)
        return blob

    def save(self, name: str, fingerprint: str, tenant: str, blob: bytes) -> None:
        """Keep `blob` for this tenant and write it through to Redis (best effort, never raises for Redis).
        Memory keeps at most max_side_states blobs of max_side_bytes in all, least recently used
        dropped first (their Redis copy stays; without Redis they are gone: side state is an
        optimisation). A blob larger than max_side_bytes is not kept in memory."""
        key = (name, validate_fingerprint(fingerprint), validate_tenant_id(tenant))
        with self._lock:
            old = self._side.pop(key, None)
            self._side_bytes -= len(old) if old is not None else 0
            if len(blob) <= self._config.max_side_bytes:
                self._side[key] = blob
                self._side_bytes += len(blob)
            while self._side and (len(self._side) > self._config.max_side_states
                                  or self._side_bytes > self._config.max_side_bytes):
                dropped_key, dropped = self._side.popitem(last=False)
                self._side_bytes -= len(dropped)
                log.info("side state %s of tenant %s dropped from memory (bound)", dropped_key[0], dropped_key[2])
        if self._backend is not None:
            try:
                self._backend.write_side(fingerprint, tenant, name, blob)
            except Unavailable as e:
                log.warning("side state %s of tenant %s kept in memory only: %s", name, tenant, e)

    def counts(self) -> tuple[int, int]:
        """(blobs, bytes) of side state in memory."""
        with self._lock:
            return len(self._side), self._side_bytes

    def drop_tenant(self, fingerprint: str, tenant: str) -> None:
        """Forget every blob of a deleted tenant (memory only: deleting the tenant in Redis drops its copies)."""
        with self._lock:
            for key in [k for k in self._side if k[1:] == (fingerprint, tenant)]:
                self._side_bytes -= len(self._side.pop(key))
