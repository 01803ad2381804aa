"""MatrixStore: versioned [V, K] adjacency matrices per (model fingerprint, tenant).

Locks, in the only order they are ever nested: TenantState.io_lock -> TenantTable.load_lock ->
TenantTable.lock -> TenantState.lock. The last two guard the table and one tenant's rows and are
never held during Redis I/O, so apply()/view() on a loaded tenant never wait on Redis.

Inheritance: a tenant with no matrix yet (none in memory, none in Redis) starts from a copy of
its domain's matrix (the reserved tenant `_domain.<domain>`, written only by administration),
else of the `_global` tenant's, else zeros, at version 0. The domain is recorded when the tenant
is created; a different domain passed later is ignored. Reads (checkout, view) of a tenant that
does not exist return that inherited matrix without creating the tenant; only apply() creates.

Bounds (with or without Redis): only the models in `StoreConfig.models` (or, without a list, the
first `max_models` seen, each at most `max_matrix_bytes` per tenant) are served, others get
FailedPrecondition; at most `max_tenants_in_memory` tenants are in memory: a new one evicts least
recently used clean tenants, snapshotting dirty ones to Redis first when Redis is configured, and
is refused with ResourceExhausted when none can go (always the case without Redis once full).
Side state is an LRU bounded by count and bytes (Redis keeps every blob).

Epochs and tombstones (see redis_backend.py): every load or creation of a tenant takes a new
writer epoch; a snapshot is written only while its epoch still owns the tenant, so two stores on
one prefix, or a store restarted after kill -9, never write different rows under one (tenant,
epoch, version). A fenced store drops the tenant (the next use reloads it). Delete leaves a
tombstone epoch: apply(since_epoch=E) with E older than it (a session opened before the delete)
is refused with FailedPrecondition instead of resurrecting the tenant.

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
import hashlib
import logging
import threading
import time
from collections import OrderedDict

import numpy as np

from core.errors import (
    FailedPrecondition,
    FingerprintMismatch,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from core.model_spec import ModelSpec
from matrix_store.config import StoreConfig, validate_fingerprint, validate_tenant_id
from matrix_store.redis_backend import Fenced, RedisBackend
from matrix_store.restore import read_stored
from matrix_store.snapshot import encode_snapshot
from matrix_store.table import TenantTable
from matrix_store.tenant import Checkout, TenantState, TenantSummary, apply_rows, validate_batch

log = logging.getLogger("trserve.matrix_store")


class NotLoaded(Exception):
    """apply/view/checkout with only_loaded=True on a tenant not in memory: the caller (an event
    loop) should retry the call in a thread, where loading it may wait on Redis."""


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
        # (name, fingerprint, tenant) -> blob, least recently used first; bounded (config)
        self._side: OrderedDict[tuple[str, str, str], bytes] = OrderedDict()
        self._side_bytes = 0
        self._side_lock = threading.Lock()
        self._models: dict[str, ModelSpec] = {m.fingerprint: m for m in config.models}
        self._models_lock = threading.Lock()
        self._tombs: OrderedDict[tuple[str, str], int] = OrderedDict()  # deleted tenant -> tombstone epoch
        self._tombs_lock = threading.Lock()

    # -- the models served -------------------------------------------------------------------
    def register(self, spec: ModelSpec) -> None:
        """Serve this model (a worker registering its model, or any first use). FailedPrecondition
        if the configured models do not include it, it is too large, or `max_models` are served."""
        served = self._models.get(spec.fingerprint)
        if served == spec:
            return
        with self._models_lock:
            served = self._models.get(spec.fingerprint)
            if served == spec:
                return
            if served is not None:
                raise FingerprintMismatch(
                    f"model {spec.fingerprint!r} is served here as [V={served.vocab_size}, K={served.k}], "
                    f"not [V={spec.vocab_size}, K={spec.k}]")
            if self._config.models:
                raise FailedPrecondition(
                    f"model {spec.fingerprint!r} is not served by this matrix service; it serves "
                    f"{sorted(self._models)} (--model)")
            nbytes = spec.vocab_size * spec.k * 4
            if nbytes > self._config.max_matrix_bytes:
                raise FailedPrecondition(
                    f"a matrix of [V={spec.vocab_size}, K={spec.k}] takes {nbytes} bytes per tenant; this service "
                    f"serves matrices of at most {self._config.max_matrix_bytes} bytes (max_matrix_bytes)")
            if len(self._models) >= self._config.max_models:
                raise FailedPrecondition(
                    f"model {spec.fingerprint!r} is not served: this service already serves "
                    f"{len(self._models)} models {sorted(self._models)} (max_models = {self._config.max_models})")
            self._models[spec.fingerprint] = spec
            log.info("serving model %s [V=%d, K=%d]", spec.fingerprint, spec.vocab_size, spec.k)

    def models(self) -> list[ModelSpec]:
        return sorted(self._models.values(), key=lambda m: m.fingerprint)

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
            if blob is not None:
                self._side.move_to_end(key)
        if blob is None and self._backend is not None:
            try:
                blob = self._backend.read_side(fingerprint, tenant, name)
            except Unavailable as e:
                log.warning("side state %s of tenant %s not read: %s", name, tenant, e)
        return blob

    def save_side_state(self, name: str, fingerprint: str, tenant: str, blob: bytes) -> None:
        """Keep `blob` for this tenant and write it through to Redis (best effort, never raises for Redis).
        Memory keeps at most max_side_states blobs of max_side_bytes in all, least recently used
        dropped first (their Redis copy stays; without Redis they are gone: side state is an
        optimisation). A blob larger than max_side_bytes is not kept in memory."""
        key = (name, validate_fingerprint(fingerprint), validate_tenant_id(tenant))
        with self._side_lock:
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

    def side_state_counts(self) -> tuple[int, int]:
        """(blobs, bytes) of side state in memory."""
        with self._side_lock:
            return len(self._side), self._side_bytes

    # -- reads and writes on the hot path ----------------------------------------------------
    def checkout(self, spec: ModelSpec, tenant: str, domain: str | None = None,
                 only_loaded: bool = False) -> Checkout:
        """A private copy of the tenant's matrix. `source` says where a first use loaded it from
        ("redis", "domain", "global", "zeros"); "tenant" when it was already loaded. A tenant that
        does not exist is not created: its inherited matrix comes back at version 0."""
        entry, created = self._lookup(spec, tenant, domain, create=False, only_loaded=only_loaded)
        with entry.lock:
            return Checkout(entry.version, entry.rows.copy(), entry.source if created else "tenant", entry.epoch)

    def view(self, spec: ModelSpec, tenant: str, domain: str | None = None,
             only_loaded: bool = False) -> tuple[int, np.ndarray]:
        """(version, live [V, K] array): no copy, for drafting in place. Read only; rows may
        change under the reader (any draft is verified, so a torn row only costs acceptance).
        A tenant that does not exist is not created (its inherited rows, not live)."""
        entry, _ = self._lookup(spec, tenant, domain, create=False, only_loaded=only_loaded)
        with entry.lock:
            return entry.version, entry.rows

    def apply(
        self, spec: ModelSpec, tenant: str, tokens: np.ndarray, topk: np.ndarray, domain: str | None = None,
        since_epoch: int | None = None, only_loaded: bool = False,
    ) -> int:
        """rows[tokens[i]] = topk[i] (a token repeated in the batch: its LAST row wins); returns
        the new version, exactly one more than before. Concurrent batches on a tenant serialise.
        `since_epoch`: the epoch the caller's session opened at (Checkout.epoch; < 0 = unknown, not
        checked); if the tenant was deleted after it, FailedPrecondition (a delete is not undone
        by a late session).
        `only_loaded`: raise NotLoaded instead of loading (an event loop must not wait on Redis)."""
        tokens, topk = validate_batch(spec, tokens, topk, self._config.max_batch_rows)  # [n], [n, K]
        while True:
            entry, _ = self._lookup(spec, tenant, domain, create=True, only_loaded=only_loaded,
                                    since_epoch=since_epoch)
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

    def epoch(self, spec: ModelSpec, tenant: str) -> int:
        """The loaded tenant's writer epoch (-1 when it is not in memory). Never loads."""
        entry = self._table.entry(spec.fingerprint, tenant)
        return entry.epoch if entry is not None else -1

    def _lookup(self, spec: ModelSpec, tenant: str, domain: str | None, create: bool, only_loaded: bool,
                since_epoch: int | None = None) -> tuple[TenantState, bool]:
        """The entry for a caller's read or write (reserved ids refused, the model admitted)."""
        validate_tenant_id(tenant)
        self.register(spec)
        entry = self._table.loaded(spec, tenant)
        if since_epoch is not None and since_epoch >= 0:
            self._check_tombstone(spec.fingerprint, tenant, since_epoch, read_redis=entry is None and not only_loaded)
        if entry is not None:
            return entry, False
        if only_loaded:
            raise NotLoaded(tenant)
        for attempt in range(8):
            try:
                return self._table.get(spec, tenant, domain, create=create)
            except ResourceExhausted:
                # With Redis, dirty tenants are snapshotted so they can be evicted; the bound is
                # only refused when that is impossible (no Redis, Redis failing, all busy).
                if self._backend is None or attempt == 7 or not self._make_room():
                    raise
        raise AssertionError("unreachable")

    def _check_tombstone(self, fingerprint: str, tenant: str, since_epoch: int, read_redis: bool) -> None:
        with self._tombs_lock:
            tomb = self._tombs.get((fingerprint, tenant))
        if tomb is None and read_redis and self._backend is not None:
            try:
                tomb = self._backend.tombstone(fingerprint, tenant)
            except Unavailable:
                tomb = None
            if tomb is not None:
                self._remember_tomb(fingerprint, tenant, tomb)
        if tomb is not None and since_epoch < tomb:
            raise FailedPrecondition(
                f"tenant {tenant!r} was deleted after this session opened (session epoch {since_epoch}, deleted at "
                f"epoch {tomb}); its rows are not written back: open a new session")

    def _remember_tomb(self, fingerprint: str, tenant: str, epoch: int) -> None:
        with self._tombs_lock:
            self._tombs[(fingerprint, tenant)] = max(epoch, self._tombs.get((fingerprint, tenant), 0))
            self._tombs.move_to_end((fingerprint, tenant))
            while len(self._tombs) > self._config.max_tombstones:
                self._tombs.popitem(last=False)

    def _make_room(self) -> bool:
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
                self._snapshot(entry)
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

    # -- administration ----------------------------------------------------------------------
    def describe(self, fingerprint: str, tenant: str) -> dict:
        """The tenant's state; `in_memory` says whether it is loaded (describe reads a tenant only
        in Redis without loading it). `rows_sha256`: sha256 of its rows as int32 little-endian.
        NotFound if neither memory nor Redis has it."""
        was_loaded = self._table.entry(fingerprint, tenant) is not None
        entry = self._table.named(fingerprint, tenant, load=False)  # only in Redis: read, not loaded
        with entry.lock:
            return {
                "epoch": entry.epoch,
                "memory_bytes": int(entry.rows.nbytes) if was_loaded else 0,
                "rows_sha256": hashlib.sha256(np.ascontiguousarray(entry.rows, "<i4").tobytes()).hexdigest(),
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
            # Take the tenant (a new epoch) before reading and trimming: a store still writing it
            # elsewhere is fenced from here on, so it cannot re-add versions above the target.
            epoch = self._table.take_epoch(fingerprint, tenant)
            with entry.lock:
                entry.epoch = epoch
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
        validate_tenant_id(dst_tenant, "destination tenant", reserved_ok=True)
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
            self._table.require_room(dst_tenant)
            epoch = self._table.take_epoch(fingerprint, dst_tenant)
            with src.lock:
                dst = TenantState(
                    spec=src.spec, name=dst_tenant, domain=src.domain, rows=src.rows.copy(),
                    version=src.version, source="tenant", dirty_since=time.monotonic(), epoch=epoch,
                )
            self._table.insert(dst)
        if self._backend is not None:
            try:
                self._snapshot(dst)
            except Unavailable as exc:  # the background thread snapshots it once Redis is back
                log.warning("fork %s -> %s not snapshotted yet: %s", src_tenant, dst_tenant, exc)
        return dst.version

    def delete(self, fingerprint: str, tenant: str) -> None:
        """Remove the tenant from memory and Redis and leave a tombstone (see the module docstring)."""
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
            self._remember_tomb(fingerprint, tenant, tomb)
            if entry is not None:
                self._table.remove(entry)
            with self._side_lock:
                for key in [k for k in self._side if k[1:] == (fingerprint, tenant)]:
                    self._side_bytes -= len(self._side.pop(key))

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
        """(fingerprint, tenant, bytes of its rows) of every tenant in memory; never reads Redis."""
        return [(e.spec.fingerprint, e.name, int(e.rows.nbytes)) for e in self._table.entries()]

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
            "last_snapshot_error": self._last_snapshot_error,
            "last_snapshot_ok_at": self._last_snapshot_ok_at,
            "tenants_in_memory": len(entries),
            "max_tenants_in_memory": self._config.max_tenants_in_memory,
            "memory_bytes": sum(int(e.rows.nbytes) for e in entries),
            "side_states": self.side_state_counts()[0],
            "dirty_tenants": sum(not e.clean for e in entries),
            "models": [m.fingerprint for m in self.models()],
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
                epoch = entry.epoch
            fp = entry.spec.fingerprint
            if epoch <= 0:  # loaded read-only (an inheritance parent): take the tenant before writing it
                epoch = self._table.take_epoch(fp, entry.name)
                with entry.lock:
                    entry.epoch = epoch
            blob = encode_snapshot(fp, entry.name, version, rows, epoch=epoch)
            meta = {"fingerprint": fp, "vocab_size": str(entry.spec.vocab_size), "k": str(entry.spec.k),
                    "domain": entry.domain or ""}
            try:
                backend.write_snapshot(fp, entry.name, meta, version, blob, self._config.keep_snapshots, epoch)
            except Unavailable as exc:
                self._last_snapshot_error = str(exc)
                raise
            except Fenced as exc:
                # Another store (or a restart of this one) took the tenant, or it was deleted: never
                # overwrite it. Drop ours; the next use reloads it (at a newer epoch) or stays deleted.
                if exc.deleted:
                    self._remember_tomb(fp, entry.name, exc.epoch)
                self._table.remove(entry)
                log.warning("snapshot of %s/%s@%d refused, tenant dropped from memory: %s", fp, entry.name,
                            version, exc)
                raise FailedPrecondition(f"snapshot refused: {exc}") from None
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
            epoch = backend.take_epoch(entry.spec.fingerprint, entry.name)  # before reading: fences older writers
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
                entry.epoch = epoch
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
            except (NotFound, FailedPrecondition):
                continue  # deleted or fenced meanwhile
            except Exception:  # keep the thread alive whatever one tenant does
                log.exception("snapshot of tenant %s failed", entry.name)
        self._table.evict()

    def _run(self) -> None:
        tick = min(0.25, self._config.snapshot_every_s / 2)
        while not self._stop.wait(tick):
            self._maintain()
