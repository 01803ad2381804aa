"""The in-memory tenant table: lazy loading from Redis, inheritance and LRU eviction."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

from core.errors import FingerprintMismatch, NotFound, Unavailable
from core.model_spec import ModelSpec
from matrix_store.config import GLOBAL_TENANT, validate_fingerprint, validate_tenant_id
from matrix_store.redis_backend import RedisBackend
from matrix_store.restore import Stored, read_stored, spec_from_meta
from matrix_store.snapshot import Snapshot
from matrix_store.tenant import TenantState

Key = tuple[str, str]  # (fingerprint, tenant)


class TenantTable:
    """`lock` guards the table only; `load_lock` serialises first-time loads (which may read
    Redis) so a tenant loads once, without making lookups of loaded tenants wait on Redis."""

    def __init__(self, backend: RedisBackend | None, max_in_memory: int) -> None:
        self._backend = backend
        self._max = max_in_memory
        self._entries: OrderedDict[Key, TenantState] = OrderedDict()  # least recently used first
        self.lock = threading.Lock()
        self.load_lock = threading.RLock()

    # -- lookups -----------------------------------------------------------------------------
    def get(self, spec: ModelSpec, tenant: str, domain: str | None) -> tuple[TenantState, bool]:
        """The tenant's entry, loading or creating it on first use; (entry, created now)."""
        validate_tenant_id(tenant)
        if domain is not None:
            validate_tenant_id(domain, "domain")
        entry = self.loaded(spec, tenant)
        if entry is not None:
            return entry, False
        with self.load_lock:
            entry = self.loaded(spec, tenant)
            if entry is not None:
                return entry, False
            entry = self._build(spec, tenant, domain)
            self.insert(entry)
            return entry, True

    def named(self, fingerprint: str, tenant: str) -> TenantState:
        """An existing tenant by name (its shape comes from memory or Redis); NotFound if none."""
        validate_fingerprint(fingerprint)
        validate_tenant_id(tenant)
        with self.lock:
            entry = self._entries.get((fingerprint, tenant))
        if entry is not None:
            return self.get(entry.spec, tenant, None)[0]
        meta = self._backend.read_meta(fingerprint, tenant) if self._backend is not None else None
        spec = spec_from_meta(fingerprint, meta) if meta is not None else None
        if spec is None:
            raise NotFound(f"tenant {tenant!r} does not exist for fingerprint {fingerprint!r}")
        return self.get(spec, tenant, None)[0]

    def loaded(self, spec: ModelSpec, tenant: str) -> TenantState | None:
        with self.lock:
            entry = self._entries.get((spec.fingerprint, tenant))
            if entry is None:
                return None
            self._entries.move_to_end((spec.fingerprint, tenant))
        if entry.spec != spec:
            raise FingerprintMismatch(
                f"tenant {tenant!r} holds a matrix for {entry.spec}, but the request is for {spec}; "
                "use the model it was built with, or another tenant id"
            )
        return entry

    def entry(self, fingerprint: str, tenant: str) -> TenantState | None:
        """The loaded entry, if any, without loading or touching its LRU position."""
        with self.lock:
            return self._entries.get((fingerprint, tenant))

    def entries(self) -> list[TenantState]:
        with self.lock:
            return list(self._entries.values())

    def names(self, fingerprint: str | None) -> set[str]:
        with self.lock:
            return {t for fp, t in self._entries if fingerprint is None or fp == fingerprint}

    def contains(self, fingerprint: str, tenant: str) -> bool:
        with self.lock:
            return (fingerprint, tenant) in self._entries

    # -- changes -----------------------------------------------------------------------------
    def insert(self, entry: TenantState) -> None:
        with self.lock:
            self._entries[(entry.spec.fingerprint, entry.name)] = entry
            self.evict_locked(keep=entry)

    def remove(self, entry: TenantState) -> None:
        key = (entry.spec.fingerprint, entry.name)
        with self.lock:
            if self._entries.get(key) is entry:
                del self._entries[key]
        with entry.lock:
            entry.gone = True

    def evict(self) -> None:
        with self.lock:
            self.evict_locked(keep=None)

    def evict_locked(self, keep: TenantState | None) -> None:
        """Drop least recently used clean tenants beyond the bound (they live on in Redis).
        Without Redis nothing is evicted: memory is the only copy."""
        excess = len(self._entries) - self._max
        if self._backend is None or excess <= 0:
            return
        for key, entry in list(self._entries.items()):
            if excess <= 0:
                break
            if entry is keep or not entry.lock.acquire(blocking=False):  # busy: not idle
                continue
            try:
                if entry.clean:
                    entry.gone = True
                    del self._entries[key]
                    excess -= 1
            finally:
                entry.lock.release()

    # -- loading -----------------------------------------------------------------------------
    def _read(self, spec: ModelSpec, tenant: str) -> tuple[Stored | None, bool]:
        """(what Redis holds for the tenant, whether Redis could be asked)."""
        if self._backend is None:
            return None, True
        try:
            return read_stored(self._backend, spec, tenant), True
        except Unavailable:
            return None, False

    def _build(self, spec: ModelSpec, tenant: str, domain: str | None) -> TenantState:
        """The tenant from its newest good snapshot, else inherited (see store.py: a tenant
        built while Redis could not be asked is pending, "Delayed restore")."""
        stored, reachable = self._read(spec, tenant)
        if stored is not None and stored.snapshot is not None:
            return _from_snapshot(spec, tenant, stored.domain, stored.snapshot)
        floor = 0
        if stored is not None:  # Redis knows the tenant but refused every snapshot of it
            domain, floor = stored.domain or domain, stored.next_version_floor
        rows, source = self.inherit(spec, tenant, domain)
        return TenantState(
            spec, tenant, domain, rows, floor, source, pending_restore=not reachable,
            written=None if reachable else np.zeros(spec.vocab_size, bool),  # [V]
        )

    def inherit(self, spec: ModelSpec, tenant: str, domain: str | None) -> tuple[np.ndarray, str]:
        """A copy of the domain's matrix, else the global one's, else zeros: ([V, K], source)."""
        for name, source in ((domain, "domain"), (GLOBAL_TENANT, "global")):
            if name is None or name == tenant:
                continue
            parent = self._existing(spec, name)
            if parent is not None:
                with parent.lock:
                    return parent.rows.copy(), source
        return np.zeros(spec.shape, np.int32), "zeros"

    def _existing(self, spec: ModelSpec, tenant: str) -> TenantState | None:
        """A tenant if it has a matrix in memory or Redis (loading it); never creates one."""
        with self.load_lock:
            entry = self.loaded(spec, tenant)
            if entry is None:
                stored, _ = self._read(spec, tenant)
                if stored is None or stored.snapshot is None:
                    return None
                entry = _from_snapshot(spec, tenant, stored.domain, stored.snapshot)
                self.insert(entry)
            return entry


def _from_snapshot(spec: ModelSpec, tenant: str, domain: str | None, snap: Snapshot) -> TenantState:
    return TenantState(spec, tenant, domain, snap.rows, snap.version, "redis", snap_version=snap.version)
