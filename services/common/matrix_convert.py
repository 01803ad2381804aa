"""Proto <-> domain conversion of the matrix API, for both sides: the matrix service
(services/matrix/) and its clients, the workers' draft sources (services/worker/drafting/), which
therefore never import the matrix service's package.

Row batches travel as little-endian int32 bytes: `tokens` [m] and `topk` [m, K] row-major, and
beside them `probs`, the confidence buckets of topk as uint8 [m, K] row-major (engine/tr/confidence.py;
empty = unknown). Everything read from a request is validated here or by the store, and a bad value
raises InvalidArgument saying what is allowed.
"""

from __future__ import annotations

import numpy as np

from ...core.errors import InvalidArgument
from ...core.model_spec import ModelSpec
from ...core.tenants import validate_tenant_id
from ...matrix_store.tenant import TenantSummary
from ...v1 import matrix_pb2 as pb

WIRE_DTYPE = np.dtype("<i4")
WIRE_PROBS = np.dtype("u1")


def spec_from_pb(model: pb.ModelSpec) -> ModelSpec:
    if not model.fingerprint:
        raise InvalidArgument("model.fingerprint is empty: send the fingerprint of the model the matrix is for")
    return ModelSpec(model.fingerprint, int(model.vocab_size), int(model.k))


def spec_to_pb(spec: ModelSpec) -> pb.ModelSpec:
    return pb.ModelSpec(fingerprint=spec.fingerprint, vocab_size=spec.vocab_size, k=spec.k)


def tenant_from_pb(tenant: str, domain: str = "") -> tuple[str, str | None]:
    """(tenant, domain or None), both validated ([A-Za-z0-9._-]{1,64})."""
    validate_tenant_id(tenant)
    if domain:
        validate_tenant_id(domain, "domain")
    return tenant, domain or None


def rows_from_pb(rows: pb.RowBatch, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(tokens [m] int32, topk [m, K] int32, probs [m, K] uint8 or None when the batch has none)
    from a RowBatch; m may be 0. Id ranges are checked by the store (matrix_store/tenant.py:validate_batch)."""
    if len(rows.tokens) % 4:
        raise InvalidArgument(f"rows.tokens has {len(rows.tokens)} bytes; it must be int32 little-endian, 4 bytes per id")
    tokens = np.frombuffer(rows.tokens, WIRE_DTYPE)  # [m]
    m = tokens.shape[0]
    if len(rows.topk) % 4:
        raise InvalidArgument(f"rows.topk has {len(rows.topk)} bytes; it must be int32 little-endian, 4 bytes per id")
    values = len(rows.topk) // 4
    if values != m * k:
        if m and values % m == 0:
            raise InvalidArgument(f"rows.topk rows are {values // m} ids wide but this model uses K={k}")
        raise InvalidArgument(
            f"rows.tokens has {m} ids but rows.topk has {values} ids; they must match: topk is [m, K={k}], "
            f"i.e. {m * k} ids"
        )
    topk = np.frombuffer(rows.topk, WIRE_DTYPE).reshape(m, k)  # [m, K]
    return tokens, topk, probs_from_pb(rows.probs, m, k)


def probs_from_pb(probs: bytes, m: int, k: int) -> np.ndarray | None:
    """A RowBatch's probs: uint8 [m, K], or None when empty (unknown). Any other length than m * K
    bytes is refused."""
    if not probs:
        return None
    if len(probs) != m * k:
        raise InvalidArgument(f"rows.probs has {len(probs)} bytes but must hold one uint8 confidence per topk id: "
                              f"[m={m}, K={k}], i.e. {m * k} bytes, or be empty (unknown)")
    return np.frombuffer(probs, WIRE_PROBS).reshape(m, k)  # [m, K]


def rows_to_pb(tokens: np.ndarray, topk: np.ndarray, probs: np.ndarray | None = None) -> pb.RowBatch:
    """tokens [m], topk [m, K] (any integer dtype), probs [m, K] uint8 or None (unknown) -> RowBatch."""
    return pb.RowBatch(tokens=np.ascontiguousarray(tokens, WIRE_DTYPE).tobytes(),
                       topk=np.ascontiguousarray(topk, WIRE_DTYPE).tobytes(),
                       probs=b"" if probs is None else np.ascontiguousarray(probs, WIRE_PROBS).tobytes())


def check_root(root: int, vocab_size: int) -> int:
    if not 0 <= root < vocab_size:
        raise InvalidArgument(f"root token {root} is outside the vocabulary [0, {vocab_size})")
    return root


def documents_from_pb(documents, spec: ModelSpec, max_documents: int) -> list[np.ndarray]:
    """PushHistory's documents as [L] int32 arrays, every id in [0, V); InvalidArgument otherwise."""
    if len(documents) > max_documents:
        raise InvalidArgument(f"{len(documents)} documents in one PushHistory; send at most {max_documents} per call")
    out = []
    for i, doc in enumerate(documents):
        if len(doc.tokens) % 4:
            raise InvalidArgument(f"documents[{i}].tokens has {len(doc.tokens)} bytes; it must be int32 little-endian")
        ids = np.frombuffer(doc.tokens, WIRE_DTYPE)  # [L]
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= spec.vocab_size):
            raise InvalidArgument(f"documents[{i}] holds ids outside the vocabulary [0, {spec.vocab_size})")
        out.append(ids.astype(np.int32))
    return out


def documents_to_pb(documents) -> list[pb.TokenDocument]:
    return [pb.TokenDocument(tokens=np.asarray(d, WIRE_DTYPE).tobytes()) for d in documents]


def summary_to_pb(s: TenantSummary, history_bytes: int = 0) -> pb.TenantSummary:
    """Unknowns become the proto's sentinels: -1 (rows, snapshot version and age), "" (domain)."""
    return pb.TenantSummary(
        tenant=s.tenant, fingerprint=s.fingerprint, domain=s.domain or "", version=s.version, in_memory=s.in_memory,
        nonzero_rows=-1 if s.nonzero_rows is None else s.nonzero_rows, memory_bytes=s.memory_bytes,
        last_snapshot_version=-1 if s.last_snapshot_version is None else s.last_snapshot_version,
        last_snapshot_age_s=-1.0 if s.last_snapshot_age_s is None else s.last_snapshot_age_s,
        history_bytes=history_bytes,
    )
