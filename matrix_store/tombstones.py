"""Tombstones of deleted tenants (see store.py: Epochs and tombstones): a session opened before a
delete (its epoch older than the tombstone's) must not write the tenant back. Memory remembers at
most `max_tombstones`, least recently set dropped first; Redis keeps them all."""

from __future__ import annotations

import threading
from collections import OrderedDict

from ..core.errors import FailedPrecondition, Unavailable
from .redis_backend import RedisBackend


class Tombstones:
    def __init__(self, backend: RedisBackend | None, max_in_memory: int) -> None:
        self._backend = backend
        self._max = max_in_memory
        self._tombs: OrderedDict[tuple[str, str], int] = OrderedDict()  # deleted tenant -> tombstone epoch
        self._lock = threading.Lock()

    def check(self, fingerprint: str, tenant: str, since_epoch: int, read_redis: bool) -> None:
        """FailedPrecondition if the tenant was deleted after `since_epoch`. `read_redis`: also ask
        Redis when memory has no tombstone (a Redis failure counts as none)."""
        with self._lock:
            tomb = self._tombs.get((fingerprint, tenant))
        if tomb is None and read_redis and self._backend is not None:
            try:
                tomb = self._backend.tombstone(fingerprint, tenant)
            except Unavailable:
                tomb = None
            if tomb is not None:
                self.remember(fingerprint, tenant, tomb)
        if tomb is not None and since_epoch < tomb:
            raise FailedPrecondition(
                f"tenant {tenant!r} was deleted after this session opened (session epoch {since_epoch}, deleted at "
                f"epoch {tomb}); its rows are not written back: open a new session")

    def remember(self, fingerprint: str, tenant: str, epoch: int) -> None:
        with self._lock:
            self._tombs[(fingerprint, tenant)] = max(epoch, self._tombs.get((fingerprint, tenant), 0))
            self._tombs.move_to_end((fingerprint, tenant))
            while len(self._tombs) > self._max:
                self._tombs.popitem(last=False)
