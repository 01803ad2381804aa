"""The in-memory tenant table: lazy loading from Redis, inheritance, writer epochs and the bound
on tenants in memory (LRU eviction of clean tenants when Redis holds them, else refusal)."""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict

import numpy as np

from ..core.errors import FingerprintMismatch, NotFound, ResourceExhausted, Unavailable
from ..core.model_spec import ModelSpec
from ..core.tenants import GLOBAL_TENANT, domain_tenant, validate_tenant_id
from .config import validate_fingerprint
from .redis_backend import RedisBackend
from .restore import Stored, read_stored, spec_from_meta
from .snapshot import Snapshot
from .tenant import TenantState

Key = tuple[str, str]  # (fingerprint, tenant)


class TenantTable:
    """`lock` guards the table only; `load_lock` serialises first-time loads (which may read
    Redis) so a tenant loads once, without making lookups of loaded tenants wait on Redis.

    Bound: at most `max_in_memory` tenants. A new one first evicts least recently used clean
    tenants (only when Redis holds them: without Redis memory is the only copy); when none can go,
    it is refused with ResourceExhausted (the store snapshots dirty ones first, see store.py)."""

    def __init__(self, backend: RedisBackend | None, max_in_memory: int) -> None:
        self._backend = backend
        self._max = max_in_memory
        self._entries: OrderedDict[Key, TenantState] = OrderedDict()  # least recently used first
        self._epochs = itertools.count(1)  # memory-only stores: one counter for every tenant
        self._last_epoch = 0
        self.lock = threading.Lock()
        self.load_lock = threading.RLock()

    # -- epochs ------------------------------------------------------------------------------
    def take_epoch(self, fingerprint: str, tenant: str) -> int:
        """A new writer epoch for the tenant (Redis: fences earlier writers). Unavailable if Redis fails."""
        if self._backend is not None:
            return self._backend.take_epoch(fingerprint, tenant)
        with self.lock:
            self._last_epoch = next(self._epochs)
            return self._last_epoch

    def current_epoch(self, fingerprint: str, tenant: str) -> int:
        """The newest epoch handed out for the tenant (0 = none yet; -1 = unknown, Redis unreachable)."""
        if self._backend is None:
            return self._last_epoch
        try:
            return self._backend.epoch(fingerprint, tenant)
        except Unavailable:
            return -1

    # -- lookups -----------------------------------------------------------------------------
    def get(self, spec: ModelSpec, tenant: str, domain: str | None, create: bool = True,
            reserved_ok: bool = False, must_load: bool = False) -> tuple[TenantState, bool]:
        """The tenant's entry, loading it on first use; (entry, loaded now). A tenant neither in
        memory nor in Redis is created only when `create` (a write); a read gets a transient entry
        (inherited rows, never inserted), and so does a read of a stored tenant while the table is
        full. ResourceExhausted when a write (or `must_load`) finds the table full."""
        validate_tenant_id(tenant, reserved_ok=reserved_ok)
        if domain is not None:
            validate_tenant_id(domain, "domain")
        entry = self.loaded(spec, tenant)
        if entry is not None:
            return entry, False
        with self.load_lock:
            entry = self.loaded(spec, tenant)
            if entry is not None:
                return entry, False
            if create or must_load:
                self.require_room(tenant)
                room = True
            else:
                room = self.has_room()
            entry = self._build(spec, tenant, domain, create, load=room)
            if not entry.transient:
                self.insert(entry)
            return entry, True

    def named(self, fingerprint: str, tenant: str, load: bool = True) -> TenantState:
        """An existing tenant by name (its shape comes from memory or Redis); NotFound if none.
        Reserved ids are allowed (administration). `load=False`: a tenant only in Redis is read
        into a transient entry, not inserted (and takes no epoch)."""
        validate_fingerprint(fingerprint)
        validate_tenant_id(tenant, reserved_ok=True)
        with self.lock:
            entry = self._entries.get((fingerprint, tenant))
        if entry is not None:
            return self.get(entry.spec, tenant, None, create=False, reserved_ok=True)[0]
        meta = self._backend.read_meta(fingerprint, tenant) if self._backend is not None else None
        spec = spec_from_meta(fingerprint, meta) if meta is not None else None
        if spec is None:
            raise NotFound(f"tenant {tenant!r} does not exist for fingerprint {fingerprint!r}")
        if not load:
            stored = read_stored(self._backend, spec, tenant)  # type: ignore[arg-type]
            if stored is not None and stored.snapshot is not None:
                entry = _from_snapshot(spec, tenant, stored.domain, stored.snapshot, 0)
                entry.transient = True
                return entry
        entry = self.get(spec, tenant, None, create=False, reserved_ok=True, must_load=True)[0]
        if entry.transient:
            raise NotFound(f"tenant {tenant!r} has no readable snapshot for fingerprint {fingerprint!r}")
        return entry

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
        """Least recently used first."""
        with self.lock:
            return list(self._entries.values())

    def names(self, fingerprint: str | None) -> set[str]:
        with self.lock:
            return {t for fp, t in self._entries if fingerprint is None or fp == fingerprint}

    def contains(self, fingerprint: str, tenant: str) -> bool:
        with self.lock:
            return (fingerprint, tenant) in self._entries

    @property
    def full(self) -> bool:
        with self.lock:
            return len(self._entries) >= self._max

    def memory_bytes(self) -> int:
        with self.lock:
            return sum(e.nbytes for e in self._entries.values())  # rows and probs

    # -- changes -----------------------------------------------------------------------------
    def has_room(self) -> bool:
        """Whether one more tenant fits (after evicting clean ones)."""
        with self.lock:
            self.evict_locked(keep=None, extra=1)
            return len(self._entries) < self._max

    def require_room(self, tenant: str) -> None:
        """Make room for one more tenant (evicting clean ones), else raise ResourceExhausted."""
        with self.lock:
            self.evict_locked(keep=None, extra=1)
            if len(self._entries) >= self._max:
                where = ("none is snapshotted to Redis yet" if self._backend is not None
                         else "without Redis memory is their only copy, so none is evicted")
                raise ResourceExhausted(
                    f"cannot load tenant {tenant!r}: {len(self._entries)} tenants are in memory "
                    f"(max_tenants_in_memory = {self._max}) and {where}; retry later"
                )

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

    def evict_locked(self, keep: TenantState | None, extra: int = 0) -> None:
        """Drop least recently used clean tenants beyond the bound (they live on in Redis), so
        that `extra` more fit. Without Redis nothing is evicted: memory is the only copy."""
        excess = len(self._entries) + extra - self._max
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

    def _build(self, spec: ModelSpec, tenant: str, domain: str | None, create: bool, load: bool = True) -> TenantState:
        """The tenant from its newest good snapshot, else inherited (see store.py: a tenant
        built while Redis could not be asked is pending, "Delayed restore"). A loaded or created
        tenant takes a new writer epoch *before* its snapshot is read, so a snapshot an older
        writer still manages to write is fenced, never silently missed."""
        stored, reachable = self._read(spec, tenant)
        exists = stored is not None and stored.snapshot is not None
        if exists and not load:  # full: serve the stored rows without loading (no epoch taken)
            entry = _from_snapshot(spec, tenant, stored.domain, stored.snapshot, 0)  # type: ignore[union-attr]
            entry.transient = True
            return entry
        epoch = 0
        if reachable and (create or exists):
            try:
                epoch = self.take_epoch(spec.fingerprint, tenant)
                stored, reachable = self._read(spec, tenant)
                exists = stored is not None and stored.snapshot is not None
            except Unavailable:
                reachable = False
            if not reachable:
                epoch = -1
        elif not reachable:
            epoch = -1  # unknown: Redis could not be asked
        if exists:
            return _from_snapshot(spec, tenant, stored.domain, stored.snapshot, epoch)  # type: ignore[union-attr]
        floor = 0
        if stored is not None:  # Redis knows the tenant but refused every snapshot of it
            domain, floor = stored.domain or domain, stored.next_version_floor
        rows, probs, source = self.inherit(spec, tenant, domain)
        if not create:
            return TenantState(spec, tenant, domain, rows, probs, floor, source, transient=True,
                               epoch=self.current_epoch(spec.fingerprint, tenant) if reachable else -1)
        return TenantState(
            spec, tenant, domain, rows, probs, floor, source, pending_restore=not reachable,
            written=None if reachable else np.zeros(spec.vocab_size, bool),  # [V]
            epoch=epoch,
        )

    def inherit(self, spec: ModelSpec, tenant: str, domain: str | None) -> tuple[np.ndarray, np.ndarray, str]:
        """A copy of the domain's matrix (the reserved tenant `_domain.<domain>`, never another
        tenant's), else the global one's, else zeros: (rows [V, K] int32, probs [V, K] uint8, source)."""
        parents = ((domain_tenant(domain) if domain else None, "domain"), (GLOBAL_TENANT, "global"))
        for name, source in parents:
            if name is None or name == tenant:
                continue
            parent = self._existing(spec, name)
            if parent is not None:
                with parent.lock:
                    return parent.rows.copy(), parent.probs.copy(), source
        return np.zeros(spec.shape, np.int32), np.zeros(spec.shape, np.uint8), "zeros"

    def _existing(self, spec: ModelSpec, tenant: str) -> TenantState | None:
        """A tenant if it has a matrix in memory or Redis (loading it when there is room, else
        reading it transiently); never creates one."""
        with self.load_lock:
            entry = self.loaded(spec, tenant)
            if entry is None:
                stored, _ = self._read(spec, tenant)
                if stored is None or stored.snapshot is None:
                    return None
                entry = _from_snapshot(spec, tenant, stored.domain, stored.snapshot, 0)
                with self.lock:
                    self.evict_locked(keep=None, extra=1)
                    room = len(self._entries) < self._max
                if room:  # loaded read-only: a parent takes no epoch until something writes it
                    self.insert(entry)
            return entry


def _from_snapshot(spec: ModelSpec, tenant: str, domain: str | None, snap: Snapshot, epoch: int) -> TenantState:
    return TenantState(spec, tenant, domain, snap.rows, snap.probs, snap.version, "redis", snap_version=snap.version,
                       epoch=epoch)
