"""Writing tenants to Redis: snapshots (on demand, when due, to make room, on close), delayed
restores of tenants first used while Redis was unreachable, and the background thread doing both
(see store.py for the rules). The blob format itself is snapshot.py."""

from __future__ import annotations

import logging
import threading
import time

from ..core.errors import FailedPrecondition, FingerprintMismatch, NotFound, Unavailable
from .config import StoreConfig
from .redis_backend import Fenced, RedisBackend
from .restore import read_stored
from .snapshot import encode_snapshot
from .table import TenantTable
from .tenant import TenantState
from .tombstones import Tombstones

log = logging.getLogger("trserve.matrix_store")


def require_backend(backend: RedisBackend | None, what: str) -> RedisBackend:
    if backend is None:
        raise Unavailable(f"cannot {what}: snapshots need Redis and no redis_url is configured")
    return backend


class Snapshotter:
    """Snapshots and delayed restores of one store's tenants, and the thread running them.
    `last_error` / `last_ok_at` (unix seconds) report the latest outcome for health()."""

    def __init__(self, config: StoreConfig, backend: RedisBackend | None, table: TenantTable,
                 tombstones: Tombstones) -> None:
        self._config = config
        self._backend = backend
        self._table = table
        self._tombs = tombstones
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None
        self.last_ok_at: float | None = None  # unix seconds

    # -- the background thread ---------------------------------------------------------------
    def start(self) -> None:
        """Start the background snapshot thread (idempotent; without Redis there is nothing to do)."""
        if self._backend is None or (self._thread is not None and self._thread.is_alive()):
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="matrix-store-snapshots", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and wait for it (its pass in flight finishes first)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        tick = min(0.25, self._config.snapshot_every_s / 2)
        while not self._stop.wait(tick):
            self.maintain()

    def maintain(self, force: bool = False) -> None:
        """One background pass: reconcile pending tenants, snapshot due (or, forced, all dirty)
        ones, evict. Stops at the first Redis failure; the backend's breaker spaces retries."""
        now = time.monotonic()
        for entry in self._table.entries():
            try:
                if entry.pending_restore:
                    self.restore_pending(entry)
                if entry.dirty_since is not None and (force or self._due(entry, now)):
                    self.snapshot(entry)
            except Unavailable as exc:
                self.last_error = str(exc)
                log.warning("snapshots paused, serving from memory: %s", exc)
                break
            except (NotFound, FailedPrecondition):
                continue  # deleted or fenced meanwhile
            except Exception:  # keep the thread alive whatever one tenant does
                log.exception("snapshot of tenant %s failed", entry.name)
        self._table.evict()

    def _due(self, entry: TenantState, now: float) -> bool:
        with entry.lock:
            if entry.dirty_since is None or entry.pending_restore or entry.conflict or entry.gone:
                return False
            behind, waited = entry.version - (entry.snap_version or 0), now - entry.dirty_since
        return behind >= self._config.snapshot_every_versions or waited >= self._config.snapshot_every_s

    def make_room(self) -> bool:
        """The table is full: evict clean tenants; with Redis, snapshot the least recently used
        dirty ones first so they can go (a few per call). False when nothing could be done.
        Never holds load_lock (lock order)."""
        self._table.evict()
        if not self._table.full:
            return True
        if self._backend is None:
            return False
        acted = False
        for entry in self._table.entries()[:4]:
            if entry.dirty_since is None or entry.pending_restore or entry.conflict or entry.gone:
                continue
            try:
                self.snapshot(entry)
                acted = True
            except Unavailable as exc:
                log.warning("could not snapshot tenant %s to make room: %s", entry.name, exc)
                return False
            except (FailedPrecondition, NotFound):
                acted = True  # fenced or deleted: it left the table
            self._table.evict()
            if not self._table.full:
                return True
        return acted or not self._table.full

    # -- one tenant --------------------------------------------------------------------------
    def snapshot(self, entry: TenantState) -> int:
        """Write the tenant's current rows and probs; returns the version written. The copy is
        taken under the tenant lock; encoding and the Redis write happen outside it."""
        backend = require_backend(self._backend, "snapshot")
        with entry.io_lock:
            with entry.lock:
                if entry.gone:
                    raise NotFound(f"tenant {entry.name!r} was deleted or evicted; look it up again")
                if entry.pending_restore or entry.conflict:
                    raise Unavailable(f"tenant {entry.name!r} is not reconciled with Redis yet")
                rows, probs = entry.rows.copy(), entry.probs.copy()  # [V, K] int32, [V, K] uint8
                version, taken = entry.version, time.monotonic()
                epoch = entry.epoch
            fp = entry.spec.fingerprint
            if epoch <= 0:  # loaded read-only (an inheritance parent): take the tenant before writing it
                epoch = self._table.take_epoch(fp, entry.name)
                with entry.lock:
                    entry.epoch = epoch
            blob = encode_snapshot(fp, entry.name, version, rows, epoch=epoch, probs=probs)
            meta = {"fingerprint": fp, "vocab_size": str(entry.spec.vocab_size), "k": str(entry.spec.k),
                    "domain": entry.domain or ""}
            try:
                backend.write_snapshot(fp, entry.name, meta, version, blob, self._config.keep_snapshots, epoch)
            except Unavailable as exc:
                self.last_error = str(exc)
                raise
            except Fenced as exc:
                # Another store (or a restart of this one) took the tenant, or it was deleted: never
                # overwrite it. Drop ours; the next use reloads it (at a newer epoch) or stays deleted.
                if exc.deleted:
                    self._tombs.remember(fp, entry.name, exc.epoch)
                self._table.remove(entry)
                log.warning("snapshot of %s/%s@%d refused, tenant dropped from memory: %s", fp, entry.name,
                            version, exc)
                raise FailedPrecondition(f"snapshot refused: {exc}") from None
            self.last_error, self.last_ok_at = None, time.time()
            with entry.lock:
                entry.snap_version = version
                # Batches applied while writing stay dirty, counted from when the copy was taken.
                entry.dirty_since = None if entry.version == version else taken
        log.debug("snapshot %s/%s@%d: %d bytes", fp, entry.name, version, len(blob))
        return version

    def restore_pending(self, entry: TenantState) -> None:
        """Merge what Redis holds under a tenant first used while Redis was unreachable (see the
        store.py docstring). Raises Unavailable while Redis still fails."""
        backend = require_backend(self._backend, "restore")
        with entry.io_lock:
            if not entry.pending_restore or entry.gone:
                return
            epoch = backend.take_epoch(entry.spec.fingerprint, entry.name)  # before reading: fences older writers
            try:
                stored = read_stored(backend, entry.spec, entry.name)
            except FingerprintMismatch as exc:
                with entry.lock:
                    entry.conflict = str(exc)
                self.last_error = f"tenant {entry.name!r} not reconciled: {exc}"
                log.error("tenant %s is kept in memory only: %s", entry.name, exc)
                return
            if stored is not None and stored.snapshot is not None:
                base, base_probs = stored.snapshot.rows, stored.snapshot.probs  # [V, K] int32, [V, K] uint8
                base_version = stored.snapshot.version
                snap_version: int | None = base_version
            else:
                base, base_probs, _ = self._table.inherit(entry.spec, entry.name, entry.domain)  # [V, K] x 2
                base_version, snap_version = (stored.next_version_floor if stored else 0), None
            with entry.lock:
                base[entry.written] = entry.rows[entry.written]  # memory's rows are newer
                base_probs[entry.written] = entry.probs[entry.written]  # and their confidences with them
                entry.rows[...] = base  # in place: view() holders keep a live array
                entry.probs[...] = base_probs
                entry.version = base_version + entry.batches
                entry.snap_version = snap_version
                if entry.batches == 0:
                    entry.dirty_since = None
                elif entry.dirty_since is None:
                    entry.dirty_since = time.monotonic()
                entry.pending_restore, entry.written, entry.batches = False, None, 0
                entry.epoch = epoch
        log.info("tenant %s/%s reconciled with Redis at version %d", entry.spec.fingerprint, entry.name, entry.version)
