"""MatrixStore: versioned [V, K] adjacency matrices per (model fingerprint, tenant).

A matrix is its successor ids `rows` [V, K] int32 and, beside them, their confidences `probs`
[V, K] uint8 (engine/tr/confidence.py; 0 = unknown, e.g. rows from an ids-only batch or a
format-1 snapshot). They are applied, checked out, snapshotted, rolled back and forked together.

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

Layout: MatrixStore (here) is the hot path (checkout, view, apply) and delegates the rest to its
parts: registry.py (the models served), side_state.py (side-state LRU), tombstones.py (deleted
tenants), snapshotter.py (snapshots, delayed restores, the background thread), admin.py
(administration and health), over table.py (the tenants in memory) and redis_backend.py.
"""

from __future__ import annotations

import time

import numpy as np

from ..core.errors import ResourceExhausted
from ..core.model_spec import ModelSpec
from ..core.tenants import validate_tenant_id
from .admin import StoreAdmin
from .config import StoreConfig
from .redis_backend import RedisBackend
from .registry import ModelRegistry
from .side_state import SideStates
from .snapshotter import Snapshotter
from .table import TenantTable
from .tenant import Checkout, TenantState, TenantSummary, apply_rows, validate_batch
from .tombstones import Tombstones


class NotLoaded(Exception):
    """apply/view/checkout with only_loaded=True on a tenant not in memory: the caller (an event
    loop) should retry the call in a thread, where loading it may wait on Redis."""


class MatrixStore:
    """Thread-safe store of tenant matrices, snapshotting to Redis in a background thread."""

    def __init__(self, config: StoreConfig) -> None:
        self._config = config
        self._backend = (
            RedisBackend(config.redis_url, config.key_prefix, config.redis_timeout_s, config.redis_password)
            if config.redis_url else None
        )
        self._table = TenantTable(self._backend, config.max_tenants_in_memory)
        self._models = ModelRegistry(config)
        self._side = SideStates(config, self._backend)
        self._tombs = Tombstones(self._backend, config.max_tombstones)
        self._snapshots = Snapshotter(config, self._backend, self._table, self._tombs)
        self._admin = StoreAdmin(config, self._backend, self._table, self._models, self._side, self._tombs,
                                 self._snapshots)

    # -- the models served (registry.py) -----------------------------------------------------
    def register(self, spec: ModelSpec) -> None:
        """Serve this model (a worker registering its model, or any first use). FailedPrecondition
        if the configured models do not include it, it is too large, or `max_models` are served."""
        self._models.register(spec)

    def models(self) -> list[ModelSpec]:
        return self._models.models()

    # -- lifecycle (snapshotter.py) ----------------------------------------------------------
    def start(self) -> None:
        """Start the background snapshot thread (idempotent; without Redis there is nothing to do)."""
        self._snapshots.start()

    def close(self, final_snapshot: bool = True) -> None:
        """Stop the thread; snapshot every tenant with unsnapshotted changes (best effort)."""
        self._snapshots.stop()
        if self._backend is None:
            return
        if final_snapshot:
            self._snapshots.maintain(force=True)
        self._backend.close()

    # -- per-tenant side state, the online tree tuner's acceptance records (side_state.py) -----
    def side_state(self, name: str, fingerprint: str, tenant: str) -> bytes | None:
        """The last blob saved for this tenant (memory, else its Redis copy); None when there is none
        or Redis cannot be read (the caller starts fresh: side state is an optimisation)."""
        return self._side.get(name, fingerprint, tenant)

    def save_side_state(self, name: str, fingerprint: str, tenant: str, blob: bytes) -> None:
        """Keep `blob` for this tenant and write it through to Redis (best effort, never raises for
        Redis); memory keeps a bounded LRU (see SideStates.save)."""
        self._side.save(name, fingerprint, tenant, blob)

    def side_state_counts(self) -> tuple[int, int]:
        """(blobs, bytes) of side state in memory."""
        return self._side.counts()

    # -- reads and writes on the hot path ----------------------------------------------------
    def checkout(self, spec: ModelSpec, tenant: str, domain: str | None = None,
                 only_loaded: bool = False) -> Checkout:
        """A private copy of the tenant's matrix, rows and probs of one version. `source` says where
        a first use loaded it from ("redis", "domain", "global", "zeros"); "tenant" when it was
        already loaded. A tenant that does not exist is not created: its inherited matrix comes
        back at version 0."""
        entry, created = self._lookup(spec, tenant, domain, create=False, only_loaded=only_loaded)
        with entry.lock:
            return Checkout(entry.version, entry.rows.copy(), entry.probs.copy(), entry.source if created else "tenant",
                            entry.epoch)

    def shared_checkout(self, spec: ModelSpec, tenant: str, domain: str | None = None) -> Checkout:
        """As checkout(), but READ-ONLY arrays shared by every caller of the same (epoch, version):
        concurrent bulk readers (the service's Checkout calls) hold one copy of a large matrix, not
        one each. The copy lives as long as some caller holds it (a weak reference on the entry)."""
        entry, created = self._lookup(spec, tenant, domain, create=False, only_loaded=False)
        with entry.lock:
            shared = entry.shared() if not created else None
            if shared is not None and (shared.epoch, shared.version) == (entry.epoch, entry.version):
                return shared
            rows, probs = entry.rows.copy(), entry.probs.copy()
            rows.flags.writeable = probs.flags.writeable = False
            out = Checkout(entry.version, rows, probs, entry.source if created else "tenant", entry.epoch)
            entry.share(out)
            return out

    def head(self, spec: ModelSpec, tenant: str, domain: str | None = None) -> tuple[int, int]:
        """(version, epoch) of the tenant without copying its matrix (not created by asking)."""
        entry, _ = self._lookup(spec, tenant, domain, create=False, only_loaded=False)
        with entry.lock:
            return entry.version, entry.epoch

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
        since_epoch: int | None = None, only_loaded: bool = False, probs: np.ndarray | None = None,
    ) -> int:
        """rows[tokens[i]] = topk[i] and probs[tokens[i]] = probs[i] (a token repeated in the batch:
        its LAST row wins); returns the new version, exactly one more than before. Concurrent
        batches on a tenant serialise.
        `probs`: [n, K] uint8 confidence buckets beside `topk` (engine/tr/confidence.py); None =
        unknown, written as zeros (the rows' old confidences belong to other ids).
        `since_epoch`: the epoch the caller's session opened at (Checkout.epoch; < 0 = unknown, not
        checked); if the tenant was deleted after it, FailedPrecondition (a delete is not undone
        by a late session).
        `only_loaded`: raise NotLoaded instead of loading (an event loop must not wait on Redis)."""
        return self.apply_versioned(spec, tenant, tokens, topk, domain, since_epoch, only_loaded, probs)[0]

    def apply_versioned(
        self, spec: ModelSpec, tenant: str, tokens: np.ndarray, topk: np.ndarray, domain: str | None = None,
        since_epoch: int | None = None, only_loaded: bool = False, probs: np.ndarray | None = None,
    ) -> tuple[int, int]:
        """`apply`, returning (new version, the epoch it was written under), read together under the
        tenant's lock: a concurrent rollback cannot make one pair name two contents. A batch that
        fails validation (probs included) changes nothing."""
        # [n], [n, K] int32, [n, K] uint8
        tokens, topk, probs = validate_batch(spec, tokens, topk, self._config.max_batch_rows, probs)
        while True:
            entry, _ = self._lookup(spec, tenant, domain, create=True, only_loaded=only_loaded,
                                    since_epoch=since_epoch)
            with entry.lock:
                if entry.gone:  # evicted/deleted between lookup and lock: look it up again
                    continue
                written = apply_rows(entry.rows, tokens, topk, entry.probs, probs)
                if entry.pending_restore:
                    entry.written[written] = True
                    entry.batches += 1
                entry.version += 1
                if entry.dirty_since is None:
                    entry.dirty_since = time.monotonic()
                return entry.version, entry.epoch

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
            self._tombs.check(spec.fingerprint, tenant, since_epoch, read_redis=entry is None and not only_loaded)
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
                if self._backend is None or attempt == 7 or not self._snapshots.make_room():
                    raise
        raise AssertionError("unreachable")

    # -- administration and health (admin.py) ------------------------------------------------
    def describe(self, fingerprint: str, tenant: str) -> dict:
        """The tenant's state, loaded or only in Redis (not loaded by describing it); NotFound if neither has it."""
        return self._admin.describe(fingerprint, tenant)

    def versions(self, fingerprint: str, tenant: str) -> list[int]:
        """Snapshot versions kept in Redis, ascending ([] without Redis)."""
        return self._admin.versions(fingerprint, tenant)

    def snapshot_now(self, fingerprint: str, tenant: str) -> int:
        """Write a snapshot synchronously; returns its version. Unavailable without Redis."""
        return self._admin.snapshot_now(fingerprint, tenant)

    def rollback(self, fingerprint: str, tenant: str, version: int) -> int:
        """Make a kept snapshot current (rows, probs and version); newer snapshots are deleted."""
        return self._admin.rollback(fingerprint, tenant, version)

    def fork(self, fingerprint: str, src_tenant: str, dst_tenant: str) -> int:
        """dst := a copy of src (rows, probs and version); snapshotted at once when Redis is configured."""
        return self._admin.fork(fingerprint, src_tenant, dst_tenant)

    def delete(self, fingerprint: str, tenant: str) -> None:
        """Remove the tenant from memory and Redis and leave a tombstone (see the module docstring)."""
        self._admin.delete(fingerprint, tenant)

    def tenants(self, fingerprint: str | None = None) -> list[str]:
        """Tenant ids in memory or in Redis (memory only while Redis is unreachable)."""
        return self._admin.tenants(fingerprint)

    def list_tenants(self, fingerprint: str | None = None) -> list[TenantSummary]:
        """Every tenant in memory or in Redis (of one model, or all), by (fingerprint, tenant);
        loads none of them. While Redis is unreachable: the tenants in memory only."""
        return self._admin.list_tenants(fingerprint)

    def memory(self) -> list[tuple[str, str, int]]:
        """(fingerprint, tenant, bytes of its rows and probs) of every tenant in memory; never reads Redis."""
        return self._admin.memory()

    def health(self) -> dict:
        """health_in_memory() plus Redis' state (one PING)."""
        return self._admin.health()

    def health_in_memory(self) -> dict:
        """The store's figures from memory alone (never waits on Redis)."""
        return self._admin.health_in_memory()
