"""MatrixStore: versioned [V, K] adjacency matrices per (model fingerprint, tenant).

Locks, in the only order they are ever nested: TenantState.io_lock -> TenantTable.load_lock ->
TenantTable.lock -> TenantState.lock. The last two guard the table and one tenant's rows and are
never held during Redis I/O, so apply()/view() on a loaded tenant never wait on Redis.

Inheritance: a tenant with no matrix yet (none in memory, none in Redis) starts from a copy of
its domain's matrix, else of the `_global` tenant's, else zeros, at version 0. The domain is
recorded when the tenant is created; a different domain passed later is ignored.

Delayed restore (Redis unreachable when a tenant is first used): the tenant is created from what
memory has (inheritance as above) and marked pending; it records which rows it writes and how
many batches it applies. Once Redis answers, the background thread loads the newest good stored
snapshot (or, without one, inherits again with Redis available), re-applies the rows written in
memory on top (they are newer), and sets version = stored version + batches applied in memory.
A pending tenant is never snapshotted, so a zero-started matrix never overwrites a stored one.
If every stored snapshot of a tenant is unreadable, it restarts from inheritance at the highest
stored version, so its next snapshots still sort above the refused ones.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import numpy as np

from core.errors import FailedPrecondition, FingerprintMismatch, InvalidArgument, NotFound, Unavailable
from core.model_spec import ModelSpec
from matrix_store.config import StoreConfig, validate_fingerprint, validate_tenant_id
from matrix_store.redis_backend import RedisBackend
from matrix_store.restore import read_stored
from matrix_store.snapshot import encode_snapshot
from matrix_store.table import TenantTable
from matrix_store.tenant import Checkout, TenantState, TenantSummary, apply_rows, validate_batch

log = logging.getLogger("trserve.matrix_store")


class MatrixStore:
    """Thread-safe store of tenant matrices, snapshotting to Redis in a background thread."""

    def __init__(self, config: StoreConfig) -> None:
        self._config = config
        self._backend = (
            RedisBackend(config.redis_url, config.key_prefix, config.redis_timeout_s) if config.redis_url else None
        )
        self._table = TenantTable(self._backend, config.max_tenants_in_memory)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_snapshot_error: str | None = None
        self._last_snapshot_ok_at: float | None = None  # unix seconds
        self._side: dict[tuple[str, str, str], bytes] = {}  # (name, fingerprint, tenant) -> blob
        self._side_lock = threading.Lock()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        """Start the background snapshot thread (idempotent; without Redis there is nothing to do)."""
        if self._backend is None or (self._thread is not None and self._thread.is_alive()):
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="matrix-store-snapshots", daemon=True)
        self._thread.start()

    def close(self, final_snapshot: bool = True) -> None:
        """Stop the thread; snapshot every tenant with unsnapshotted changes (best effort)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._backend is None:
            return
        if final_snapshot:
            self._maintain(force=True)
        self._backend.close()

    # -- per-tenant side state (the online tree tuner's acceptance records) --------------------
    def side_state(self, name: str, fingerprint: str, tenant: str) -> bytes | None:
        """The last blob saved for this tenant (memory, else its Redis copy); None when there is none
        or Redis cannot be read (the caller starts fresh: side state is an optimisation)."""
        key = (name, validate_fingerprint(fingerprint), validate_tenant_id(tenant))
        with self._side_lock:
            blob = self._side.get(key)
        if blob is None and self._backend is not None:
            try:
                blob = self._backend.read_side(fingerprint, tenant, name)
            except Unavailable as e:
                log.warning("side state %s of tenant %s not read: %s", name, tenant, e)
        return blob

    def save_side_state(self, name: str, fingerprint: str, tenant: str, blob: bytes) -> None:
        """Keep `blob` for this tenant and write it through to Redis (best effort, never raises for Redis)."""
        key = (name, validate_fingerprint(fingerprint), validate_tenant_id(tenant))
        with self._side_lock:
            self._side[key] = blob
        if self._backend is not None:
            try:
                self._backend.write_side(fingerprint, tenant, name, blob)
            except Unavailable as e:
                log.warning("side state %s of tenant %s kept in memory only: %s", name, tenant, e)

    # -- reads and writes on the hot path ----------------------------------------------------
    def checkout(self, spec: ModelSpec, tenant: str, domain: str | None = None) -> Checkout:
        """A private copy of the tenant's matrix. `source` says where a first use loaded it from
        ("redis", "domain", "global", "zeros"); "tenant" when it was already loaded."""
        entry, created = self._table.get(spec, tenant, domain)
        with entry.lock:
            return Checkout(entry.version, entry.rows.copy(), entry.source if created else "tenant")

    def view(self, spec: ModelSpec, tenant: str, domain: str | None = None) -> tuple[int, np.ndarray]:
        """(version, live [V, K] array): no copy, for drafting in place. Read only; rows may
        change under the reader (any draft is verified, so a torn row only costs acceptance)."""
        entry, _ = self._table.get(spec, tenant, domain)
        with entry.lock:
            return entry.version, entry.rows

    def apply(
        self, spec: ModelSpec, tenant: str, tokens: np.ndarray, topk: np.ndarray, domain: str | None = None
    ) -> int:
        """rows[tokens[i]] = topk[i] (a token repeated in the batch: its LAST row wins); returns
        the new version, exactly one more than before. Concurrent batches on a tenant serialise."""
        tokens, topk = validate_batch(spec, tokens, topk, self._config.max_batch_rows)  # [n], [n, K]
        while True:
            entry, _ = self._table.get(spec, tenant, domain)
            with entry.lock:
                if entry.gone:  # evicted/deleted between lookup and lock: look it up again
                    continue
                written = apply_rows(entry.rows, tokens, topk)
                if entry.pending_restore:
                    entry.written[written] = True
                    entry.batches += 1
                entry.version += 1
                if entry.dirty_since is None:
                    entry.dirty_since = time.monotonic()
                return entry.version

    # -- administration ----------------------------------------------------------------------
    def describe(self, fingerprint: str, tenant: str) -> dict:
        """The tenant's state; `in_memory` says whether it was loaded before this call (describe
        itself restores it). NotFound if neither memory nor Redis has it."""
        was_loaded = self._table.entry(fingerprint, tenant) is not None
        entry = self._table.named(fingerprint, tenant)
        with entry.lock:
            return {
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
        validate_tenant_id(tenant)
        return [] if self._backend is None else self._backend.list_versions(fingerprint, tenant)

    def snapshot_now(self, fingerprint: str, tenant: str) -> int:
        """Write a snapshot synchronously; returns its version. Unavailable without Redis."""
        backend = self._require_backend("snapshot")
        backend.ping()
        entry = self._table.named(fingerprint, tenant)
        if entry.pending_restore:
            self._restore_pending(entry)
        return self._snapshot(entry)

    def rollback(self, fingerprint: str, tenant: str, version: int) -> int:
        """Make a kept snapshot current (rows and version); newer snapshots are deleted."""
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise InvalidArgument(f"rollback version must be an int >= 0, got {version!r}")
        backend = self._require_backend("rollback")
        entry = self._table.named(fingerprint, tenant)
        with entry.io_lock:
            stored = read_stored(backend, entry.spec, tenant, only_version=version)
            if stored is None or stored.snapshot is None:
                kept = stored.versions if stored else []
                raise NotFound(f"tenant {tenant!r} has no good snapshot at version {version}; kept: {kept}")
            backend.drop_versions_above(fingerprint, tenant, version)
            with entry.lock:
                entry.rows[...] = stored.snapshot.rows  # in place: view() holders see the rollback
                entry.version = entry.snap_version = version
                entry.dirty_since, entry.pending_restore, entry.written, entry.batches = None, False, None, 0
        log.info("tenant %s/%s rolled back to version %d", fingerprint, tenant, version)
        return version

    def fork(self, fingerprint: str, src_tenant: str, dst_tenant: str) -> int:
        """dst := a copy of src, version included; snapshotted at once when Redis is configured."""
        validate_tenant_id(dst_tenant, "destination tenant")
        if dst_tenant == src_tenant:
            raise InvalidArgument(f"fork needs two different tenants, got {src_tenant!r} twice")
        src = self._table.named(fingerprint, src_tenant)
        if src.pending_restore:
            self._restore_pending(src)
        with self._table.load_lock:  # no first-time load of dst can slip in between check and insert
            if self._table.contains(fingerprint, dst_tenant) or (
                self._backend is not None and self._backend.read_meta(fingerprint, dst_tenant) is not None
            ):
                raise FailedPrecondition(f"tenant {dst_tenant!r} already exists; delete it first or pick another id")
            with src.lock:
                dst = TenantState(
                    spec=src.spec, name=dst_tenant, domain=src.domain, rows=src.rows.copy(),
                    version=src.version, source="tenant", dirty_since=time.monotonic(),
                )
            self._table.insert(dst)
        if self._backend is not None:
            try:
                self._snapshot(dst)
            except Unavailable as exc:  # the background thread snapshots it once Redis is back
                log.warning("fork %s -> %s not snapshotted yet: %s", src_tenant, dst_tenant, exc)
        return dst.version

    def delete(self, fingerprint: str, tenant: str) -> None:
        validate_fingerprint(fingerprint)
        validate_tenant_id(tenant)
        entry = self._table.entry(fingerprint, tenant)
        # Holding io_lock: a snapshot in flight must not re-create the tenant in Redis afterwards.
        with entry.io_lock if entry is not None else contextlib.nullcontext():
            stored = False
            if self._backend is not None:
                stored = self._backend.read_meta(fingerprint, tenant) is not None
                self._backend.delete_tenant(fingerprint, tenant)
            if entry is None and not stored:
                raise NotFound(f"tenant {tenant!r} does not exist for fingerprint {fingerprint!r}")
            if entry is not None:
                self._table.remove(entry)
            with self._side_lock:
                for key in [k for k in self._side if k[1:] == (fingerprint, tenant)]:
                    del self._side[key]

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

    def health(self) -> dict:
        if self._backend is None:
            redis_state = "disabled"
        else:
            try:
                self._backend.ping()
                redis_state = "ok"
            except Unavailable:
                redis_state = "failing"
        entries = self._table.entries()
        return {
            "redis": redis_state,
            "last_snapshot_error": self._last_snapshot_error,
            "last_snapshot_ok_at": self._last_snapshot_ok_at,
            "tenants_in_memory": len(entries),
            "dirty_tenants": sum(not e.clean for e in entries),
        }

    # -- snapshots and delayed restores ------------------------------------------------------
    def _require_backend(self, what: str) -> RedisBackend:
        if self._backend is None:
            raise Unavailable(f"cannot {what}: snapshots need Redis and no redis_url is configured")
        return self._backend

    def _snapshot(self, entry: TenantState) -> int:
        """Write the tenant's current rows; returns the version written. The copy is taken under
        the tenant lock; encoding and the Redis write happen outside it."""
        backend = self._require_backend("snapshot")
        with entry.io_lock:
            with entry.lock:
                if entry.gone:
                    raise NotFound(f"tenant {entry.name!r} was deleted or evicted; look it up again")
                if entry.pending_restore or entry.conflict:
                    raise Unavailable(f"tenant {entry.name!r} is not reconciled with Redis yet")
                rows, version, taken = entry.rows.copy(), entry.version, time.monotonic()  # [V, K]
            fp = entry.spec.fingerprint
            blob = encode_snapshot(fp, entry.name, version, rows)
            meta = {"fingerprint": fp, "vocab_size": str(entry.spec.vocab_size), "k": str(entry.spec.k),
                    "domain": entry.domain or ""}
            try:
                backend.write_snapshot(fp, entry.name, meta, version, blob, self._config.keep_snapshots)
            except Unavailable as exc:
                self._last_snapshot_error = str(exc)
                raise
            self._last_snapshot_error, self._last_snapshot_ok_at = None, time.time()
            with entry.lock:
                entry.snap_version = version
                # Batches applied while writing stay dirty, counted from when the copy was taken.
                entry.dirty_since = None if entry.version == version else taken
        log.debug("snapshot %s/%s@%d: %d bytes", fp, entry.name, version, len(blob))
        return version

    def _restore_pending(self, entry: TenantState) -> None:
        """Merge what Redis holds under a tenant first used while Redis was unreachable (see the
        module docstring). Raises Unavailable while Redis still fails."""
        backend = self._require_backend("restore")
        with entry.io_lock:
            if not entry.pending_restore or entry.gone:
                return
            try:
                stored = read_stored(backend, entry.spec, entry.name)
            except FingerprintMismatch as exc:
                with entry.lock:
                    entry.conflict = str(exc)
                self._last_snapshot_error = f"tenant {entry.name!r} not reconciled: {exc}"
                log.error("tenant %s is kept in memory only: %s", entry.name, exc)
                return
            if stored is not None and stored.snapshot is not None:
                base, base_version = stored.snapshot.rows, stored.snapshot.version  # [V, K]
                snap_version: int | None = base_version
            else:
                base, _ = self._table.inherit(entry.spec, entry.name, entry.domain)  # [V, K]
                base_version, snap_version = (stored.next_version_floor if stored else 0), None
            with entry.lock:
                base[entry.written] = entry.rows[entry.written]  # memory's rows are newer
                entry.rows[...] = base  # in place: view() holders keep a live array
                entry.version = base_version + entry.batches
                entry.snap_version = snap_version
                if entry.batches == 0:
                    entry.dirty_since = None
                elif entry.dirty_since is None:
                    entry.dirty_since = time.monotonic()
                entry.pending_restore, entry.written, entry.batches = False, None, 0
        log.info("tenant %s/%s reconciled with Redis at version %d", entry.spec.fingerprint, entry.name, entry.version)

    def _due(self, entry: TenantState, now: float) -> bool:
        with entry.lock:
            if entry.dirty_since is None or entry.pending_restore or entry.conflict or entry.gone:
                return False
            behind, waited = entry.version - (entry.snap_version or 0), now - entry.dirty_since
        return behind >= self._config.snapshot_every_versions or waited >= self._config.snapshot_every_s

    def _maintain(self, force: bool = False) -> None:
        """One background pass: reconcile pending tenants, snapshot due (or, forced, all dirty)
        ones, evict. Stops at the first Redis failure; the backend's breaker spaces retries."""
        now = time.monotonic()
        for entry in self._table.entries():
            try:
                if entry.pending_restore:
                    self._restore_pending(entry)
                if entry.dirty_since is not None and (force or self._due(entry, now)):
                    self._snapshot(entry)
            except Unavailable as exc:
                self._last_snapshot_error = str(exc)
                log.warning("snapshots paused, serving from memory: %s", exc)
                break
            except NotFound:
                continue  # deleted meanwhile
            except Exception:  # keep the thread alive whatever one tenant does
                log.exception("snapshot of tenant %s failed", entry.name)
        self._table.evict()

    def _run(self) -> None:
        tick = min(0.25, self._config.snapshot_every_s / 2)
        while not self._stop.wait(tick):
            self._maintain()
