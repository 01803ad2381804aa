"""Redis persistence of matrix snapshots, behind a small circuit breaker.

Key layout (P = StoreConfig.key_prefix, FP = model fingerprint, T = tenant id, N = version):

    P:fingerprints          set    every fingerprint that has at least one stored tenant
    P:tenants:FP            set    tenant ids stored for FP
    P:meta:FP:T             hash   fingerprint, vocab_size, k, domain ("" = none), latest (version of
                                   the newest kept snapshot), updated (unix seconds of the last
                                   snapshot written or rollback)
    P:versions:FP:T         zset   kept snapshot versions (member "N", score N)
    P:snap:FP:T:N           string one snapshot blob (see snapshot.py); its header names the
                                   writer's epoch
    P:epoch:FP:T            string the tenant's writer epoch: INCR by every store that loads or
                                   creates the tenant (and by Delete); never deleted
    P:tomb:FP:T             string tombstone: the epoch a Delete took; sessions opened before it
                                   may not write the tenant again

Fencing: a snapshot (and a rollback's trim) is written by one Lua script that first checks that
P:epoch:FP:T still holds the writer's epoch; a store whose tenant another store (or a restart)
has taken over since, or that was deleted, is refused (`Fenced`) and never overwrites it. So a
(tenant, epoch, version) names one content: a restarted or second writer has another epoch.

Tenant ids exclude ':' and N is decimal, so a key names exactly one (FP, T, N) even when FP holds
':'. Each snapshot is written in one MULTI/EXEC (blob, version set, meta, indexes), so a reader
never sees a version without its blob; older versions beyond `keep` are trimmed afterwards.

Every call raises core.errors.Unavailable on any Redis failure. After a failure the breaker
stays open for a short, growing backoff (0.25 s .. 4 s): calls fail fast instead of each waiting
for a socket timeout, and the first call after the backoff probes Redis again.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ..core.errors import Unavailable

_T = TypeVar("_T")
_MIN_BACKOFF_S = 0.25
_MAX_BACKOFF_S = 4.0


SIDE_STATES = ("tuner", "history")  # per-tenant side blobs (tree tuner, suffix history), deleted with the tenant


class Fenced(Exception):
    """A snapshot write was refused: the tenant's epoch in Redis is no longer the writer's
    (another store took the tenant over, or it was deleted). `epoch` is the current one."""

    def __init__(self, message: str, epoch: int, deleted: bool) -> None:
        super().__init__(message)
        self.epoch, self.deleted = epoch, deleted


# KEYS: epoch, tomb, snap, versions, meta, tenants, fingerprints
# ARGV: writer epoch, blob, version, tenant, fingerprint, then meta field/value pairs
_FENCED_SNAPSHOT = """
local cur = redis.call('GET', KEYS[1])
if cur ~= ARGV[1] then return {0, cur or '0'} end
local tomb = redis.call('GET', KEYS[2])
if tomb and tonumber(tomb) >= tonumber(ARGV[1]) then return {-1, tomb} end
redis.call('SET', KEYS[3], ARGV[2])
redis.call('ZADD', KEYS[4], tonumber(ARGV[3]), ARGV[3])
local fields = {}
for i = 6, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[5], unpack(fields))
redis.call('SADD', KEYS[6], ARGV[4])
redis.call('SADD', KEYS[7], ARGV[5])
return {1, cur}
"""


class RedisBackend:
    def __init__(self, url: str, prefix: str, timeout_s: float, password: str | None = None) -> None:
        self._prefix = prefix
        # No client-side retries: the breaker and the store's background thread own retrying.
        self._r = redis.Redis.from_url(
            url,
            **({"password": password} if password is not None else {}),  # else the URL's, if any
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._fenced_snapshot = self._r.register_script(_FENCED_SNAPSHOT)
        self._lock = threading.Lock()
        self.last_error: str | None = None  # None while the last call succeeded
        self._backoff_s = 0.0
        self._retry_at = 0.0  # monotonic time before which calls fail fast

    # -- breaker -----------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        return self.last_error is None

    def _call(self, fn: Callable[[], _T]) -> _T:
        with self._lock:
            if self.last_error is not None and time.monotonic() < self._retry_at:
                raise Unavailable(f"Redis is unreachable ({self.last_error}); retrying shortly")
        try:
            result = fn()
        except redis.RedisError as exc:
            with self._lock:
                self.last_error = f"{type(exc).__name__}: {exc}"
                self._backoff_s = min(max(2 * self._backoff_s, _MIN_BACKOFF_S), _MAX_BACKOFF_S)
                self._retry_at = time.monotonic() + self._backoff_s
            raise Unavailable(f"Redis call failed ({self.last_error}); the store keeps serving from memory") from exc
        with self._lock:
            self.last_error, self._backoff_s = None, 0.0
        return result

    # -- keys --------------------------------------------------------------------------------
    def _key(self, *parts: object) -> str:
        return ":".join([self._prefix, *map(str, parts)])

    # -- reads -------------------------------------------------------------------------------
    def ping(self) -> None:
        self._call(self._r.ping)

    def read_meta(self, fp: str, tenant: str) -> dict[str, str] | None:
        raw = self._call(lambda: self._r.hgetall(self._key("meta", fp, tenant)))
        return {k.decode(): v.decode() for k, v in raw.items()} or None

    def list_versions(self, fp: str, tenant: str) -> list[int]:
        raw = self._call(lambda: self._r.zrange(self._key("versions", fp, tenant), 0, -1))
        return sorted(int(v) for v in raw)

    def read_blob(self, fp: str, tenant: str, version: int) -> bytes | None:
        return self._call(lambda: self._r.get(self._key("snap", fp, tenant, version)))

    def epoch(self, fp: str, tenant: str) -> int:
        """The tenant's current writer epoch (0 = never taken)."""
        raw = self._call(lambda: self._r.get(self._key("epoch", fp, tenant)))
        return int(raw) if raw else 0

    def take_epoch(self, fp: str, tenant: str) -> int:
        """A new writer epoch for the tenant (fences every earlier writer)."""
        return int(self._call(lambda: self._r.incr(self._key("epoch", fp, tenant))))

    def tombstone(self, fp: str, tenant: str) -> int | None:
        """The epoch the tenant's last Delete took; None if never deleted."""
        raw = self._call(lambda: self._r.get(self._key("tomb", fp, tenant)))
        return int(raw) if raw else None

    def read_side(self, fp: str, tenant: str, name: str) -> bytes | None:
        """A tenant's side state kept next to its matrix (e.g. the online tree tuner's records)."""
        return self._call(lambda: self._r.get(self._key("side", name, fp, tenant)))

    def write_side(self, fp: str, tenant: str, name: str, blob: bytes) -> None:
        self._call(lambda: self._r.set(self._key("side", name, fp, tenant), blob))

    def tenants(self, fp: str | None) -> set[tuple[str, str]]:
        """(fingerprint, tenant) pairs stored, for one fingerprint or all."""

        def run() -> set[tuple[str, str]]:
            fps = [fp] if fp is not None else [f.decode() for f in self._r.smembers(self._key("fingerprints"))]
            return {(f, t.decode()) for f in fps for t in self._r.smembers(self._key("tenants", f))}

        return self._call(run)

    def read_metas(self, keys: set[tuple[str, str]]) -> dict[tuple[str, str], dict[str, str]]:
        """The meta hashes of many (fingerprint, tenant) pairs in one round trip; absent ones left out."""
        ordered = sorted(keys)

        def run() -> list:
            pipe = self._r.pipeline(transaction=False)
            for fp, tenant in ordered:
                pipe.hgetall(self._key("meta", fp, tenant))
            return pipe.execute()

        raw = self._call(run) if ordered else []
        metas = {key: {k.decode(): v.decode() for k, v in m.items()} for key, m in zip(ordered, raw)}
        return {key: meta for key, meta in metas.items() if meta}

    # -- writes ------------------------------------------------------------------------------
    def write_snapshot(
        self, fp: str, tenant: str, meta: dict[str, str], version: int, blob: bytes, keep: int, epoch: int
    ) -> None:
        """Store one snapshot atomically if `epoch` still owns the tenant (else raise Fenced), then
        trim to the newest `keep` versions."""
        versions_key = self._key("versions", fp, tenant)

        def run() -> None:
            # A new snapshot is always the newest: versions only grow, and a rollback drops the
            # ones above its target first.
            fields = {**meta, "latest": str(version), "updated": str(time.time()), "epoch": str(epoch)}
            flat = [x for kv in fields.items() for x in kv]
            keys = [self._key("epoch", fp, tenant), self._key("tomb", fp, tenant), self._key("snap", fp, tenant, version),
                    versions_key, self._key("meta", fp, tenant), self._key("tenants", fp), self._key("fingerprints")]
            ok, current = self._fenced_snapshot(keys=keys, args=[str(epoch), blob, str(version), tenant, fp, *flat])
            if int(ok) != 1:
                deleted = int(ok) == -1
                raise Fenced(f"tenant {tenant!r} was {'deleted' if deleted else 'taken over by another writer'} "
                             f"(epoch {int(current)}, this writer's {epoch})", int(current), deleted)
            old = self._r.zrange(versions_key, 0, -(keep + 1))  # all but the newest `keep`
            if old:
                self._drop(fp, tenant, [int(v) for v in old])

        self._call(run)

    def drop_versions_above(self, fp: str, tenant: str, version: int) -> None:
        """Delete snapshots newer than `version` and make it the latest (rollback)."""

        def run() -> None:
            newer = self._r.zrangebyscore(self._key("versions", fp, tenant), f"({version}", "+inf")
            if newer:
                self._drop(fp, tenant, [int(v) for v in newer])
            if self._r.exists(self._key("meta", fp, tenant)):  # never leave a partial meta hash
                fields = {"latest": str(version), "updated": str(time.time())}
                self._r.hset(self._key("meta", fp, tenant), mapping=fields)

        self._call(run)

    def delete_tenant(self, fp: str, tenant: str) -> int:
        """Remove the tenant's snapshots, meta and side state; leave a tombstone at a new epoch
        (which also fences any store still holding it). Returns that epoch."""
        def run() -> int:
            versions = [int(v) for v in self._r.zrange(self._key("versions", fp, tenant), 0, -1)]
            tomb = int(self._r.incr(self._key("epoch", fp, tenant)))
            pipe = self._r.pipeline(transaction=True)
            pipe.set(self._key("tomb", fp, tenant), str(tomb))
            for v in versions:
                pipe.delete(self._key("snap", fp, tenant, v))
            pipe.delete(self._key("versions", fp, tenant), self._key("meta", fp, tenant))
            pipe.delete(*[self._key("side", name, fp, tenant) for name in SIDE_STATES])
            pipe.srem(self._key("tenants", fp), tenant)
            pipe.execute()
            if not self._r.scard(self._key("tenants", fp)):
                self._r.srem(self._key("fingerprints"), fp)
            return tomb

        return self._call(run)

    def _drop(self, fp: str, tenant: str, versions: list[int]) -> None:
        pipe = self._r.pipeline(transaction=True)
        pipe.zrem(self._key("versions", fp, tenant), *[str(v) for v in versions])
        pipe.delete(*[self._key("snap", fp, tenant, v) for v in versions])
        pipe.execute()

    def close(self) -> None:
        self._r.close()
