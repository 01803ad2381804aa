"""Per-tenant in-memory state and the pure row-batch functions the store applies to it."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field

import numpy as np

from ..core.errors import InvalidArgument
from ..core.model_spec import ModelSpec

# Where the matrix handed out by a checkout came from (see MatrixStore.checkout).
SOURCES = ("tenant", "domain", "global", "zeros", "redis")


@dataclass(frozen=True)
class Checkout:
    """A tenant's matrix at one version, copied out for a replica drafter."""

    version: int  # the tenant's version the rows belong to
    rows: np.ndarray  # [V, K] int32, a private copy
    probs: np.ndarray  # [V, K] uint8 confidences beside the rows (engine/tr/confidence.py; 0 = unknown), a copy
    source: str  # one of SOURCES: "tenant" once it was already loaded, else where it was loaded from
    # The writer epoch (see redis_backend.py): (tenant, epoch, version) names one content. Pass it
    # back as `since_epoch` to apply(): a tenant deleted after this checkout is not resurrected.
    epoch: int = 0

    def __repr__(self) -> str:
        return (f"Checkout(version={self.version}, rows=int32{list(self.rows.shape)}, "
                f"probs=uint8{list(self.probs.shape)}, source={self.source!r}, epoch={self.epoch})")


@dataclass(eq=False)
class TenantState:
    """One tenant's live matrix. `lock` guards every mutable field; `io_lock` serialises its Redis
    writes (snapshot, rollback, delete) so they land in order without holding `lock` during I/O."""

    spec: ModelSpec
    name: str
    domain: str | None
    rows: np.ndarray  # [V, K] int32; the same array for the entry's life (view() hands it out)
    probs: np.ndarray  # [V, K] uint8 confidences beside `rows`; changed with them, under `lock`
    version: int  # advances by 1 per applied batch
    source: str  # where the rows came from when the entry was created
    snap_version: int | None = None  # version of the newest snapshot written/read in Redis
    dirty_since: float | None = None  # monotonic time of the first change not yet snapshotted
    # Created while Redis was unreachable, so its stored snapshot (if any) is not merged in yet;
    # `written` [V] bool and `batches` record what memory added since, to replay on top later.
    pending_restore: bool = False
    written: np.ndarray | None = None
    batches: int = 0
    conflict: str | None = None  # a delayed restore found another model's matrix: never snapshot
    gone: bool = False  # evicted or deleted: holders must look the tenant up again
    epoch: int = 0  # writer epoch taken when this store loaded/created it; 0 = none (read-only), -1 = unknown (pending)
    transient: bool = False  # a read of a tenant that does not exist: never inserted in the table
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    io_lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # the read-only Checkout bulk readers share while any holds it (MatrixStore.shared_checkout), and
    # the digests of one (epoch, version) (admin describe): set and read under `lock`
    _shared: weakref.ref | None = field(default=None, repr=False)
    digests: tuple[int, int, str, str] | None = field(default=None, repr=False)  # (epoch, version, rows, probs)

    def shared(self) -> Checkout | None:
        return None if self._shared is None else self._shared()

    def share(self, checkout: Checkout) -> None:
        self._shared = weakref.ref(checkout)

    def __post_init__(self) -> None:
        probs = self.probs
        if not isinstance(probs, np.ndarray) or probs.shape != self.rows.shape or probs.dtype != np.uint8:
            raise ValueError(f"tenant {self.name!r}: probs must be uint8 {list(self.rows.shape)}, got "
                             f"{getattr(probs, 'dtype', type(probs).__name__)} {getattr(probs, 'shape', '')}")

    @property
    def nbytes(self) -> int:
        """Bytes its matrix takes in memory: rows and probs (V x K x 5)."""
        return int(self.rows.nbytes) + int(self.probs.nbytes)

    @property
    def clean(self) -> bool:
        """Nothing only memory holds: safe to evict."""
        return self.dirty_since is None and not self.pending_restore and self.conflict is None


@dataclass(frozen=True)
class TenantSummary:
    """One tenant as MatrixStore.list_tenants reports it: from memory when loaded, else from its
    Redis meta hash (listing never loads a tenant)."""

    fingerprint: str
    tenant: str
    domain: str | None
    version: int  # in memory: the current version; only in Redis: its newest snapshot's
    in_memory: bool
    nonzero_rows: int | None  # None when only in Redis: counting would mean loading it
    memory_bytes: int  # of its rows and probs in memory (V x K x 5); 0 when only in Redis
    last_snapshot_version: int | None  # None = never snapshotted
    last_snapshot_age_s: float | None  # since its snapshots last changed in Redis; None = unknown

    @classmethod
    def loaded(cls, entry: TenantState, meta: dict[str, str] | None, now: float) -> TenantSummary:
        """`meta`: the tenant's Redis meta hash (for the snapshot's age), None without one."""
        with entry.lock:
            nonzero = int(np.count_nonzero(entry.rows.any(axis=1)))
            return cls(entry.spec.fingerprint, entry.name, entry.domain, entry.version, True, nonzero,
                       entry.nbytes, entry.snap_version, _age(meta, now))

    @classmethod
    def stored(cls, fingerprint: str, tenant: str, meta: dict[str, str], now: float) -> TenantSummary:
        latest = int(meta["latest"]) if meta.get("latest", "").isdigit() else None
        return cls(fingerprint, tenant, meta.get("domain") or None, latest or 0, False, None, 0, latest,
                   _age(meta, now))


def _age(meta: dict[str, str] | None, now: float) -> float | None:
    try:
        return max(now - float(meta["updated"]), 0.0) if meta else None
    except (KeyError, ValueError):
        return None


def validate_batch(
    spec: ModelSpec, tokens: object, topk: object, max_rows: int, probs: object = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check a row batch against the model; return (tokens int64 [n], topk int32 [n, K], probs
    uint8 [n, K]). `probs`: the confidence buckets beside `topk` (engine/tr/confidence.py), integers
    in 0..255; None = unknown (zeros).

    Raises InvalidArgument saying what was wrong and what is allowed.
    """
    tokens_arr, topk_arr = np.asarray(tokens), np.asarray(topk)
    for name, arr in (("tokens", tokens_arr), ("topk", topk_arr)):
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise InvalidArgument(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    if tokens_arr.ndim != 1:
        raise InvalidArgument(f"tokens must be 1-D [n], got shape {tokens_arr.shape}")
    n = tokens_arr.shape[0]
    if not 1 <= n <= max_rows:
        raise InvalidArgument(f"a batch must hold 1..{max_rows} rows, got {n}; split larger batches")
    if topk_arr.ndim != 2 or topk_arr.shape[1] != spec.k:
        raise InvalidArgument(f"topk must be [n, K={spec.k}] for this model, got shape {topk_arr.shape}")
    if topk_arr.shape[0] != n:
        raise InvalidArgument(f"tokens has {n} rows but topk has {topk_arr.shape[0]}; they must match")
    for name, arr in (("tokens", tokens_arr), ("topk", topk_arr)):
        lo, hi = int(arr.min()), int(arr.max())
        if lo < 0 or hi >= spec.vocab_size:
            raise InvalidArgument(
                f"{name} holds ids in [{lo}, {hi}]; ids must lie in [0, {spec.vocab_size}) for this model"
            )
    return tokens_arr.astype(np.int64), topk_arr.astype(np.int32), validate_probs(probs, n, spec.k)


def validate_probs(probs: object, n: int, k: int) -> np.ndarray:
    """A batch's confidences: uint8 [n, K] (zeros for None). InvalidArgument unless they are
    integers in 0..255 of shape [n, K]."""
    if probs is None:
        return np.zeros((n, k), np.uint8)
    arr = np.asarray(probs)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise InvalidArgument(f"probs must hold uint8 confidence buckets (0..255), got dtype {arr.dtype}")
    if arr.shape != (n, k):
        raise InvalidArgument(f"probs must be [n={n}, K={k}] like topk, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 255):
        raise InvalidArgument(f"probs hold values in [{int(arr.min())}, {int(arr.max())}]; buckets lie in 0..255")
    return arr.astype(np.uint8)


def apply_rows(rows: np.ndarray, tokens: np.ndarray, topk: np.ndarray, matrix_probs: np.ndarray | None = None,
               probs: np.ndarray | None = None) -> np.ndarray:
    """Write `rows[tokens[i]] = topk[i]` in place, and `matrix_probs[tokens[i]] = probs[i]` (zeros
    when `probs` is None: the old confidences belong to other ids); for a token repeated in the
    batch the LAST occurrence wins (it is the most recent verification). Returns the distinct
    tokens written.

    rows: [V, K] int32, tokens: [n], topk: [n, K]; matrix_probs: [V, K] uint8, probs: [n, K] uint8.

    Example:
        >>> rows, conf = np.zeros((4, 2), np.int32), np.full((4, 2), 9, np.uint8)
        >>> apply_rows(rows, np.array([1, 3, 1]), np.array([[1, 1], [3, 3], [2, 2]]), conf,
        ...            np.array([[10, 1], [30, 3], [20, 2]], np.uint8)).tolist()
        [1, 3]
        >>> rows.tolist(), conf.tolist()
        ([[0, 0], [2, 2], [0, 0], [3, 3]], [[9, 9], [20, 2], [9, 9], [30, 3]])
    """
    # numpy leaves the winner of duplicate fancy-index assignment unspecified: pick it explicitly.
    uniq, first_in_reversed = np.unique(tokens[::-1], return_index=True)  # [u], [u]
    last = tokens.shape[0] - 1 - first_in_reversed  # [u] index of each token's last occurrence
    rows[uniq] = topk[last]
    if matrix_probs is not None:
        matrix_probs[uniq] = probs[last] if probs is not None else 0
    return uniq
