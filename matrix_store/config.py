"""Configuration of the matrix store (validated once, passed down) and model fingerprints; the model
identity `ModelSpec` lives in core/model_spec.py (the engine uses it too) and tenant ids in
core/tenants.py (the services validate them too)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.errors import InvalidArgument
from ..core.model_spec import ModelSpec


# Bytes one matrix entry takes in memory: an int32 successor id and its uint8 confidence
# (engine/tr/confidence.py), kept side by side as rows [V, K] int32 and probs [V, K] uint8.
BYTES_PER_ENTRY = 5


def matrix_bytes(spec: ModelSpec) -> int:
    """Bytes one tenant's matrix of this model takes in memory: V x K x 5 (ids and confidences)."""
    return spec.vocab_size * spec.k * BYTES_PER_ENTRY


def validate_fingerprint(fingerprint: object) -> str:
    if not isinstance(fingerprint, str) or not fingerprint:
        raise InvalidArgument(f"model fingerprint must be a non-empty string, got {fingerprint!r}")
    return fingerprint


@dataclass(frozen=True)
class StoreConfig:
    """How the store keeps matrices: where snapshots go, how often, and its memory bound."""

    redis_url: str | None = None  # None = memory only (embedded default); e.g. "redis://host:6379/0"
    # Redis AUTH password (Redis' requirepass), kept out of the URL and of reprs; None = the URL's, if any
    redis_password: str | None = field(default=None, repr=False)
    key_prefix: str = "trserve"  # every Redis key lives under "{key_prefix}:"
    snapshot_every_versions: int = 64  # background snapshot once a tenant advanced this many versions...
    snapshot_every_s: float = 10.0  # ...or this many seconds after its first unsnapshotted change
    keep_snapshots: int = 3  # last R snapshots kept per tenant (rollback targets)
    max_tenants_in_memory: int = 256  # bound on tenants in memory, with Redis or without (see store.py)
    # The models (fingerprint, V, K) served. Empty: the first `max_models` distinct models that
    # register or are used are served, later ones are refused (FailedPrecondition).
    models: tuple[ModelSpec, ...] = ()
    max_models: int = 2
    max_matrix_bytes: int = 64 << 20  # one tenant's rows and probs (V x K x 5 bytes); larger models are refused
    max_side_states: int = 256  # side blobs (tuner records) kept in memory, LRU (Redis keeps the rest)
    max_side_bytes: int = 64 << 20  # their total size in memory
    max_tombstones: int = 4096  # deleted tenants remembered in memory (Redis keeps them all)
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
        for name in ("max_models", "max_matrix_bytes", "max_side_states", "max_side_bytes", "max_tombstones"):
            _positive_int(name, getattr(self, name))
        if not isinstance(self.models, tuple) or not all(isinstance(m, ModelSpec) for m in self.models):
            raise ValueError("models must be a tuple of ModelSpec")
        if len({m.fingerprint for m in self.models}) != len(self.models):
            raise ValueError("models lists a fingerprint twice")
        for m in self.models:
            if matrix_bytes(m) > self.max_matrix_bytes:
                raise ValueError(f"model {m.fingerprint!r} needs {matrix_bytes(m)} bytes per tenant, "
                                 f"above max_matrix_bytes {self.max_matrix_bytes}")
        if not self.snapshot_every_s > 0:
            raise ValueError(f"snapshot_every_s must be > 0 seconds, got {self.snapshot_every_s}")
        if not 0 < self.redis_timeout_s <= 30:
            raise ValueError(f"redis_timeout_s must be in (0, 30] seconds, got {self.redis_timeout_s}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(name: str, value: object) -> None:
    if not _is_int(value) or value <= 0:  # type: ignore[operator]
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def parse_model(text: str) -> ModelSpec:
    """FINGERPRINT:V:K (the flag form of a served model), e.g. "smollm2-135m-...:49152:8"."""
    fingerprint, sep, rest = text.rpartition(":")
    fingerprint, sep2, vocab = fingerprint.rpartition(":")
    if not sep or not sep2 or not vocab.isdigit() or not rest.isdigit():
        raise ValueError(f"a model is FINGERPRINT:VOCAB_SIZE:K, got {text!r}")
    return ModelSpec(fingerprint, int(vocab), int(rest))
