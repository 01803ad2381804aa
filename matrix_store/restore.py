"""Reading a tenant back from Redis: the newest snapshot that passes every check, or none."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..core.errors import FingerprintMismatch
from ..core.model_spec import ModelSpec
from .redis_backend import RedisBackend
from .snapshot import Snapshot, SnapshotError, decode_snapshot

log = logging.getLogger("trserve.matrix_store")


@dataclass(frozen=True)
class Stored:
    """What Redis holds for one tenant."""

    domain: str | None  # recorded when the tenant was first snapshotted
    versions: list[int]  # kept snapshot versions, ascending
    snapshot: Snapshot | None  # newest one that validated; None if none did

    @property
    def next_version_floor(self) -> int:
        """The version a tenant restarting without a good snapshot continues from."""
        return self.snapshot.version if self.snapshot else max(self.versions, default=0)


def spec_from_meta(fingerprint: str, meta: dict[str, str]) -> ModelSpec | None:
    """The model a stored tenant belongs to; None (logged) if its meta hash is incomplete."""
    try:
        return ModelSpec(meta.get("fingerprint", fingerprint), int(meta["vocab_size"]), int(meta["k"]))
    except (KeyError, ValueError) as exc:
        log.error("ignoring incomplete meta of a tenant of %s: %r (%s)", fingerprint, meta, exc)
        return None


def read_stored(
    backend: RedisBackend, spec: ModelSpec, tenant: str, only_version: int | None = None
) -> Stored | None:
    """None if Redis holds nothing for the tenant. Raises FingerprintMismatch if the stored matrix
    has another shape or model than `spec`, Unavailable if Redis fails. Corrupt, truncated or
    mismatched blobs are logged and skipped in favour of the next older one (or, with
    `only_version`, only that version is tried)."""
    meta = backend.read_meta(spec.fingerprint, tenant)
    stored_spec = spec_from_meta(spec.fingerprint, meta) if meta is not None else None
    if meta is None or stored_spec is None:
        return None
    if stored_spec != spec:
        raise FingerprintMismatch(
            f"tenant {tenant!r} holds a matrix for {stored_spec}, but the request is for {spec}; "
            "use the model it was built with, or another tenant id"
        )
    versions = backend.list_versions(spec.fingerprint, tenant)
    candidates = [only_version] if only_version is not None else versions[::-1]
    snapshot = None
    for version in candidates:
        if version not in versions:
            continue
        blob = backend.read_blob(spec.fingerprint, tenant, version)
        if blob is None:
            log.error("snapshot %s/%s@%d is listed but missing; skipped", spec.fingerprint, tenant, version)
            continue
        try:
            snapshot = decode_snapshot(blob, spec.fingerprint, spec.shape, tenant, version)
            break
        except SnapshotError as exc:
            log.error("refusing snapshot %s/%s@%d: %s", spec.fingerprint, tenant, version, exc)
    return Stored(domain=meta.get("domain") or None, versions=versions, snapshot=snapshot)
