"""Configuration of the matrix store and tenant ids (validated once, passed down); the model
identity `ModelSpec` lives in core/model_spec.py (the engine uses it too)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from core.errors import InvalidArgument

# Reserved tenant whose matrix every tenant without its own (or a domain's) starts from.
GLOBAL_TENANT = "_global"

# Tenant ids become parts of Redis keys; keeping them to this alphabet (no ':') keeps keys unambiguous.
_TENANT_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")


def validate_tenant_id(tenant: object, what: str = "tenant") -> str:
    """Return `tenant` if it is a valid tenant id, else raise InvalidArgument saying what is allowed."""
    if not isinstance(tenant, str) or _TENANT_RE.fullmatch(tenant) is None:
        raise InvalidArgument(
            f"{what} id {tenant!r} is invalid: use 1-64 characters from A-Z a-z 0-9 . _ -"
        )
    return tenant


def validate_fingerprint(fingerprint: object) -> str:
    if not isinstance(fingerprint, str) or not fingerprint:
        raise InvalidArgument(f"model fingerprint must be a non-empty string, got {fingerprint!r}")
    return fingerprint


@dataclass(frozen=True)
class StoreConfig:
    """How the store keeps matrices: where snapshots go, how often, and its memory bound."""

    redis_url: str | None = None  # None = memory only (embedded default); e.g. "redis://host:6379/0"
    key_prefix: str = "trserve"  # every Redis key lives under "{key_prefix}:"
    snapshot_every_versions: int = 64  # background snapshot once a tenant advanced this many versions...
    snapshot_every_s: float = 10.0  # ...or this many seconds after its first unsnapshotted change
    keep_snapshots: int = 3  # last R snapshots kept per tenant (rollback targets)
    max_tenants_in_memory: int = 256  # LRU bound; only safely snapshotted tenants are evicted
    max_batch_rows: int = 4096  # larger apply() batches are refused with InvalidArgument
    redis_timeout_s: float = 0.5  # socket timeouts: a dead Redis must never stall callers for long

    def __post_init__(self) -> None:
        if self.redis_url is not None and not self.redis_url.startswith(
            ("redis://", "rediss://", "unix://")
        ):
            raise ValueError(
                f"redis_url {self.redis_url!r} must start with redis://, rediss:// or unix:// (or be None)"
            )
        if not self.key_prefix or self.key_prefix != self.key_prefix.strip() or self.key_prefix.endswith(":"):
            raise ValueError(
                f"key_prefix {self.key_prefix!r} must be non-empty, without surrounding spaces "
                "and without a trailing ':' (the store adds it)"
            )
        _positive_int("snapshot_every_versions", self.snapshot_every_versions)
        _positive_int("keep_snapshots", self.keep_snapshots)
        _positive_int("max_tenants_in_memory", self.max_tenants_in_memory)
        _positive_int("max_batch_rows", self.max_batch_rows)
        if not self.snapshot_every_s > 0:
            raise ValueError(f"snapshot_every_s must be > 0 seconds, got {self.snapshot_every_s}")
        if not 0 < self.redis_timeout_s <= 30:
            raise ValueError(f"redis_timeout_s must be in (0, 30] seconds, got {self.redis_timeout_s}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(name: str, value: object) -> None:
    if not _is_int(value) or value <= 0:  # type: ignore[operator]
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
