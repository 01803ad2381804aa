"""Snapshot blobs: serialise a matrix compactly and validate everything on the way back.

A blob is `MAGIC | u32 header length | header JSON | payload`:

- header (JSON, UTF-8): format, fingerprint, tenant, version, shape [V, K], dtype "<i4",
  nonzero_rows (n, the rows stored), created (unix seconds), epoch (the writer's) and sha256;
- payload, format 2 (written now): zlib( indices int32-LE [n] ++ rows int32-LE [n, K] ++ probs
  uint8 [n, K] ), only the n rows whose ids or confidences are not all zero (most rows of a young
  matrix are); probs are the confidence buckets beside the ids (engine/tr/confidence.py);
- payload, format 1 (written before confidences were kept, still read): zlib( indices ++ rows ),
  the rows whose ids are not all zero; its probs decode as zeros (unknown).

sha256 covers the canonical header (without the sha256 field) and the payload, so a flipped bit
anywhere, header included, is caught. Pure functions, no Redis.
"""

from __future__ import annotations

import hashlib
import json
import struct
import time
import zlib
from dataclasses import dataclass

import numpy as np

MAGIC = b"TRMX"
FORMAT_VERSION = 2  # what encode_snapshot writes
READ_FORMATS = (1, 2)  # what decode_snapshot accepts: 1 = ids only (probs decode as zeros)
DTYPE = "<i4"
PROBS_DTYPE = "u1"
_HEADER_LEN = struct.Struct(">I")
_HEADER_KEYS = {"format", "fingerprint", "tenant", "version", "shape", "dtype", "nonzero_rows", "created"}


class SnapshotError(ValueError):
    """A blob is corrupt, truncated or belongs to another model/tenant/version: never serve it."""


@dataclass(frozen=True)
class Snapshot:
    """One decoded, validated snapshot."""

    fingerprint: str
    tenant: str
    version: int
    created: float  # unix seconds when it was written
    rows: np.ndarray  # [V, K] int32, a fresh array owned by the caller
    probs: np.ndarray  # [V, K] uint8 confidence buckets, a fresh array; zeros from a format-1 blob
    epoch: int = 0  # the writer's epoch (redis_backend.py); 0 in blobs written before epochs

    def __repr__(self) -> str:
        return (
            f"Snapshot(fingerprint={self.fingerprint!r}, tenant={self.tenant!r}, "
            f"version={self.version}, rows=int32{list(self.rows.shape)}, probs=uint8{list(self.probs.shape)})"
        )


def encode_snapshot(
    fingerprint: str, tenant: str, version: int, rows: np.ndarray, created: float | None = None, epoch: int = 0,
    probs: np.ndarray | None = None,
) -> bytes:
    """Serialise `rows` ([V, K] int32) and `probs` ([V, K] uint8; None = zeros, unknown) with their
    identity into one format-2 blob.

    Example:
        >>> rows = np.zeros((1000, 8), np.int32); rows[5] = [6, 7, 0, 0, 0, 0, 0, 0]
        >>> probs = np.zeros((1000, 8), np.uint8); probs[5, :2] = [200, 40]
        >>> blob = encode_snapshot("smollm2", "acme", 3, rows, probs=probs)
        >>> snap = decode_snapshot(blob, "smollm2", (1000, 8))
        >>> snap.version, snap.rows[5, :2].tolist(), snap.probs[5, :2].tolist(), int(snap.rows.any(axis=1).sum())
        (3, [6, 7], [200, 40], 1)
    """
    if rows.ndim != 2 or rows.dtype != np.int32:
        raise ValueError(f"rows must be a 2-D int32 array, got {rows.dtype} {rows.shape}")
    if probs is None:
        probs = np.zeros(rows.shape, np.uint8)
    if probs.shape != rows.shape or probs.dtype != np.uint8:
        raise ValueError(f"probs must be uint8 of the rows' shape {rows.shape}, got {probs.dtype} {probs.shape}")
    indices = np.flatnonzero(rows.any(axis=1) | probs.any(axis=1)).astype(DTYPE)  # [n]
    # [n] ++ [n, K] ++ [n, K]
    body = indices.tobytes() + rows[indices].astype(DTYPE).tobytes() + probs[indices].tobytes()
    payload = zlib.compress(body, 1)  # level 1: fast; zero-heavy and repetitive ids compress anyway
    header = {
        "format": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "tenant": tenant,
        "version": int(version),
        "shape": [int(rows.shape[0]), int(rows.shape[1])],
        "dtype": DTYPE,
        "nonzero_rows": int(indices.size),
        "created": time.time() if created is None else float(created),
        "epoch": int(epoch),
    }
    header["sha256"] = _digest(header, payload)
    header_bytes = json.dumps(header, sort_keys=True).encode()
    return MAGIC + _HEADER_LEN.pack(len(header_bytes)) + header_bytes + payload


def decode_snapshot(
    blob: bytes,
    fingerprint: str,
    shape: tuple[int, int],
    tenant: str | None = None,
    version: int | None = None,
) -> Snapshot:
    """Validate and decode a blob for the expected model (and, if given, tenant and version).

    Raises SnapshotError naming the first problem found; a blob that raises is never served.
    """
    header, payload = _split(blob)
    if header.get("sha256") != _digest(header, payload):
        raise SnapshotError("checksum mismatch: the blob is corrupt")
    expected = {"fingerprint": fingerprint, "shape": [shape[0], shape[1]], "dtype": DTYPE}
    if tenant is not None:
        expected["tenant"] = tenant
    if version is not None:
        expected["version"] = version
    for key, want in expected.items():
        if header[key] != want:
            raise SnapshotError(f"snapshot {key} is {header[key]!r}, expected {want!r}")
    rows, probs = _decode_rows(payload, header["nonzero_rows"], shape, header["format"] >= 2)
    return Snapshot(
        fingerprint=header["fingerprint"],
        tenant=header["tenant"],
        version=header["version"],
        created=header["created"],
        rows=rows,
        probs=probs,
        epoch=header.get("epoch", 0) if isinstance(header.get("epoch", 0), int) else 0,
    )


def _split(blob: bytes) -> tuple[dict, bytes]:
    """Check the framing and the header's fields; return (header, payload)."""
    if not isinstance(blob, (bytes, bytearray)) or len(blob) < len(MAGIC) + _HEADER_LEN.size:
        raise SnapshotError("blob is truncated (shorter than its fixed prefix)")
    if blob[: len(MAGIC)] != MAGIC:
        raise SnapshotError(f"blob does not start with {MAGIC!r}: not a matrix snapshot")
    start = len(MAGIC) + _HEADER_LEN.size
    (header_len,) = _HEADER_LEN.unpack_from(blob, len(MAGIC))
    if start + header_len > len(blob):
        raise SnapshotError("blob is truncated inside its header")
    try:
        header = json.loads(blob[start : start + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotError(f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict) or not _HEADER_KEYS | {"sha256"} <= header.keys():
        raise SnapshotError("header lacks required fields")
    types = {"fingerprint": str, "tenant": str, "version": int, "created": (int, float), "shape": list}
    if any(not isinstance(header[key], t) or isinstance(header[key], bool) for key, t in types.items()):
        raise SnapshotError("header fields have the wrong types")
    if type(header["format"]) is not int or header["format"] not in READ_FORMATS:
        raise SnapshotError(f"snapshot format {header['format']!r} is not supported (want one of {READ_FORMATS})")
    return header, bytes(blob[start + header_len :])


def _decode_rows(payload: bytes, n: object, shape: tuple[int, int], with_probs: bool) -> tuple[np.ndarray, np.ndarray]:
    """payload -> (rows [V, K] int32, probs [V, K] uint8); a format-1 payload (`with_probs` False)
    holds no probs: they come back zero (unknown)."""
    vocab, k = shape
    if not isinstance(n, int) or not 0 <= n <= vocab:
        raise SnapshotError(f"nonzero_rows {n!r} is outside 0..{vocab}")
    try:
        body = zlib.decompress(payload)
    except zlib.error as exc:
        raise SnapshotError(f"payload does not decompress: {exc}") from None
    expected = 4 * n * (1 + k) + (n * k if with_probs else 0)  # indices, ids [, probs]
    if len(body) != expected:
        raise SnapshotError(f"payload holds {len(body)} bytes, expected {expected}")
    indices = np.frombuffer(body, DTYPE, count=n)  # [n]
    values = np.frombuffer(body, DTYPE, count=n * k, offset=4 * n).reshape(n, k)  # [n, K]
    if n and (indices[0] < 0 or indices[-1] >= vocab or np.any(np.diff(indices) <= 0)):
        raise SnapshotError("row indices are not strictly increasing within [0, V)")
    if values.size and (values.min() < 0 or values.max() >= vocab):
        raise SnapshotError(f"token ids outside [0, {vocab}) in the payload")
    rows = np.zeros(shape, np.int32)  # [V, K]
    rows[indices] = values
    probs = np.zeros(shape, np.uint8)  # [V, K]
    if with_probs:
        probs[indices] = np.frombuffer(body, PROBS_DTYPE, offset=4 * n * (1 + k)).reshape(n, k)
    return rows, probs


def _digest(header: dict, payload: bytes) -> str:
    canonical = json.dumps({k: v for k, v in header.items() if k != "sha256"}, sort_keys=True)
    return hashlib.sha256(canonical.encode() + payload).hexdigest()
