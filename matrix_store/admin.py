"""Administration of a store's tenants (describe, versions, snapshot now, rollback, fork, delete,
listing) and its health figures: everything off the hot path. Reserved tenants (`_global`,
`_domain.*`) may be named here; callers check the admin credential (services/matrix/servicer.py)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time

import numpy as np

from ..core.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from ..core.tenants import validate_tenant_id
from .config import StoreConfig, validate_fingerprint
from .redis_backend import RedisBackend
from .registry import ModelRegistry
from .restore import read_stored
from .side_state import SideStates
from .snapshotter import Snapshotter, require_backend
from .table import TenantTable
from .tenant import TenantState, TenantSummary
from .tombstones import Tombstones

log = logging.getLogger("trserve.matrix_store")


class StoreAdmin:
    """The admin operations of MatrixStore, over the parts it shares with the hot path."""

    def __init__(self, config: StoreConfig, backend: RedisBackend | None, table: TenantTable,
                 models: ModelRegistry, side: SideStates, tombstones: Tombstones, snapshots: Snapshotter) -> None:
        self._config = config
        self._backend = backend
        self._table = table
        self._models = models
        self._side = side
        self._tombs = tombstones
        self._snapshots = snapshots

    # -- one tenant --------------------------------------------------------------------------
    def describe(self, fingerprint: str, tenant: str) -> dict:
        """The tenant's state; `in_memory` says whether it is loaded (describe reads a tenant only
        in Redis without loading it). `rows_sha256`: sha256 of its rows as int32 little-endian;
        `probs_sha256`: of its probs as uint8 [V, K]; `memory_bytes`: its rows and probs in memory.
        NotFound if neither memory nor Redis has it."""
        was_loaded = self._table.entry(fingerprint, tenant) is not None
        entry = self._table.named(fingerprint, tenant, load=False)  # only in Redis: read, not loaded
        with entry.lock:
            if entry.digests is None or entry.digests[:2] != (entry.epoch, entry.version):
                entry.digests = (entry.epoch, entry.version, _sha256(entry.rows, "<i4"), _sha256(entry.probs, np.uint8))
            return {
                "epoch": entry.epoch,
                "memory_bytes": entry.nbytes if was_loaded else 0,
                "rows_sha256": entry.digests[2],
                "probs_sha256": entry.digests[3],
                "tenant": entry.name,
                "domain": entry.domain,
                "fingerprint": entry.spec.fingerprint,
                "version": entry.version,
                "nonzero_rows": int(np.count_nonzero(entry.rows.any(axis=1))),
                "last_snapshot_version": entry.snap_version,
                "in_memory": was_loaded,
            }

    def versions(self, fingerprint: str, tenant: str) -> list[int]:
        """Snapshot versions kept in Redis, ascending ([] without Redis)."""
        validate_fingerprint(fingerprint)
        validate_tenant_id(tenant, reserved_ok=True)
        return [] if self._backend is None else self._backend.list_versions(fingerprint, tenant)

    def snapshot_now(self, fingerprint: str, tenant: str) -> int:
        """Write a snapshot synchronously; returns its version. Unavailable without Redis."""
        backend = require_backend(self._backend, "snapshot")
        backend.ping()
        entry = self._table.named(fingerprint, tenant)
        if entry.pending_restore:
            self._snapshots.restore_pending(entry)
        return self._snapshots.snapshot(entry)

    def rollback(self, fingerprint: str, tenant: str, version: int) -> int:
        """Make a kept snapshot current (rows, probs and version); newer snapshots are deleted."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise InvalidArgument(f"rollback version must be an int >= 0, got {version!r}")
        backend = require_backend(self._backend, "rollback")
        entry = self._table.named(fingerprint, tenant)
        with entry.io_lock:
            # Take the tenant (a new epoch) before reading and trimming: a store still writing it
            # elsewhere is fenced from here on, so it cannot re-add versions above the target.
            epoch = self._table.take_epoch(fingerprint, tenant)
            stored = read_stored(backend, entry.spec, tenant, only_version=version)
            if stored is None or stored.snapshot is None:
                kept = stored.versions if stored else []
                raise NotFound(f"tenant {tenant!r} has no good snapshot at version {version}; kept: {kept}")
            backend.drop_versions_above(fingerprint, tenant, version)
            with entry.lock:  # epoch, rows, probs and version change together: (epoch, version) names one content
                entry.epoch = epoch
                entry.rows[...] = stored.snapshot.rows  # in place: view() holders see the rollback
                entry.probs[...] = stored.snapshot.probs  # zeros when the snapshot is format 1 (ids only)
                entry.version = entry.snap_version = version
                entry.dirty_since, entry.pending_restore, entry.written, entry.batches = None, False, None, 0
        log.info("tenant %s/%s rolled back to version %d", fingerprint, tenant, version)
        return version

    def fork(self, fingerprint: str, src_tenant: str, dst_tenant: str) -> int:
        """dst := a copy of src (rows, probs and version); snapshotted at once when Redis is configured."""
        validate_tenant_id(dst_tenant, "destination tenant", reserved_ok=True)
        if dst_tenant == src_tenant:
            raise InvalidArgument(f"fork needs two different tenants, got {src_tenant!r} twice")
        src = self._table.named(fingerprint, src_tenant)
        if src.pending_restore:
            self._snapshots.restore_pending(src)
        with self._table.load_lock:  # no first-time load of dst can slip in between check and insert
            if self._table.contains(fingerprint, dst_tenant) or (
                self._backend is not None and self._backend.read_meta(fingerprint, dst_tenant) is not None
            ):
                raise FailedPrecondition(f"tenant {dst_tenant!r} already exists; delete it first or pick another id")
            self._table.require_room(dst_tenant)
            epoch = self._table.take_epoch(fingerprint, dst_tenant)
            with src.lock:
                dst = TenantState(
                    spec=src.spec, name=dst_tenant, domain=src.domain, rows=src.rows.copy(), probs=src.probs.copy(),
                    version=src.version, source="tenant", dirty_since=time.monotonic(), epoch=epoch,
                )
            self._table.insert(dst)
        if self._backend is not None:
            try:
                self._snapshots.snapshot(dst)
            except Unavailable as exc:  # the background thread snapshots it once Redis is back
                log.warning("fork %s -> %s not snapshotted yet: %s", src_tenant, dst_tenant, exc)
        return dst.version

    def delete(self, fingerprint: str, tenant: str) -> None:
        """Remove the tenant from memory and Redis and leave a tombstone (see the store.py docstring)."""
        validate_fingerprint(fingerprint)
        validate_tenant_id(tenant, reserved_ok=True)
        entry = self._table.entry(fingerprint, tenant)
        # Holding io_lock: a snapshot in flight must not re-create the tenant in Redis afterwards.
        with entry.io_lock if entry is not None else contextlib.nullcontext():
            stored = False
            if self._backend is not None:
                stored = self._backend.read_meta(fingerprint, tenant) is not None
                if entry is None and not stored:
                    raise NotFound(f"tenant {tenant!r} does not exist for fingerprint {fingerprint!r}")
                tomb = self._backend.delete_tenant(fingerprint, tenant)
            elif entry is None:
                raise NotFound(f"tenant {tenant!r} does not exist for fingerprint {fingerprint!r}")
            else:
                tomb = self._table.take_epoch(fingerprint, tenant)
            self._tombs.remember(fingerprint, tenant, tomb)
            if entry is not None:
                self._table.remove(entry)
            self._side.drop_tenant(fingerprint, tenant)

    # -- every tenant ------------------------------------------------------------------------
    def tenants(self, fingerprint: str | None = None) -> list[str]:
        """Tenant ids in memory or in Redis (memory only while Redis is unreachable)."""
        names = self._table.names(fingerprint)
        if self._backend is not None:
            try:
                names |= {t for _, t in self._backend.tenants(fingerprint)}
            except Unavailable as exc:
                log.warning("listing tenants from memory only: %s", exc)
        return sorted(names)

    def list_tenants(self, fingerprint: str | None = None) -> list[TenantSummary]:
        """Every tenant in memory or in Redis (of one model, or all), by (fingerprint, tenant);
        loads none of them. While Redis is unreachable: the tenants in memory only."""
        if fingerprint is not None:
            validate_fingerprint(fingerprint)
        stored: dict[tuple[str, str], dict[str, str]] = {}
        if self._backend is not None:
            try:
                stored = self._backend.read_metas(self._backend.tenants(fingerprint))
            except Unavailable as exc:
                log.warning("listing tenants from memory only: %s", exc)
        now = time.time()
        loaded = {(e.spec.fingerprint, e.name): e for e in self._table.entries()
                  if fingerprint is None or e.spec.fingerprint == fingerprint}
        out = [TenantSummary.loaded(e, stored.get(key), now) for key, e in loaded.items()]
        out += [TenantSummary.stored(fp, t, meta, now) for (fp, t), meta in stored.items() if (fp, t) not in loaded]
        return sorted(out, key=lambda s: (s.fingerprint, s.tenant))

    def memory(self) -> list[tuple[str, str, int]]:
        """(fingerprint, tenant, bytes of its rows and probs) of every tenant in memory; never reads Redis."""
        return [(e.spec.fingerprint, e.name, e.nbytes) for e in self._table.entries()]

    # -- health ------------------------------------------------------------------------------
    def health(self) -> dict:
        """health_in_memory() plus Redis' state (one PING)."""
        if self._backend is None:
            redis_state = "disabled"
        else:
            try:
                self._backend.ping()
                redis_state = "ok"
            except Unavailable:
                redis_state = "failing"
        return {"redis": redis_state, **self.health_in_memory()}

    def health_in_memory(self) -> dict:
        """The store's figures from memory alone (never waits on Redis)."""
        entries = self._table.entries()
        return {
            "last_snapshot_error": self._snapshots.last_error,
            "last_snapshot_ok_at": self._snapshots.last_ok_at,
            "tenants_in_memory": len(entries),
            "max_tenants_in_memory": self._config.max_tenants_in_memory,
            "memory_bytes": sum(e.nbytes for e in entries),  # rows and probs
            "side_states": self._side.counts()[0],
            "dirty_tenants": sum(not e.clean for e in entries),
            "models": [m.fingerprint for m in self._models.models()],
        }


def _sha256(array: np.ndarray, dtype) -> str:
    """sha256 of the array's bytes as `dtype`, hashed in place (no copy) where it already is that."""
    flat = np.ascontiguousarray(array, dtype)  # the same array when it is already contiguous `dtype`
    return hashlib.sha256(memoryview(flat).cast("B")).hexdigest()
