import doctest
import hashlib
import json
import struct
import zlib

import numpy as np
import pytest

import trserve.matrix_store.snapshot
import trserve.matrix_store.tenant
from trserve.matrix_store.snapshot import SnapshotError, decode_snapshot, encode_snapshot

V, K = 1000, 8


def _rows(seed: int = 0, filled: int = 50) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = np.zeros((V, K), np.int32)  # [V, K]
    rows[rng.choice(V, filled, replace=False)] = rng.integers(0, V, (filled, K))
    return rows


def test_doctests_hold() -> None:
    for module in (trserve.matrix_store.snapshot, trserve.matrix_store.tenant):
        assert doctest.testmod(module).failed == 0


def test_roundtrip_is_exact_and_compact() -> None:
    rows = _rows()
    blob = encode_snapshot("fp", "acme", 7, rows, created=123.0)
    snap = decode_snapshot(blob, "fp", (V, K), tenant="acme", version=7)
    assert np.array_equal(snap.rows, rows) and snap.rows.dtype == np.int32
    assert (snap.version, snap.tenant, snap.created) == (7, "acme", 123.0)
    assert len(blob) < rows.nbytes // 10  # only the 50 nonzero rows are stored


def test_all_zero_matrix_roundtrips() -> None:
    rows = np.zeros((V, K), np.int32)
    assert not decode_snapshot(encode_snapshot("fp", "t", 0, rows), "fp", (V, K)).rows.any()


@pytest.mark.parametrize("position", [0, 10, 60, -5, -1])
def test_any_flipped_byte_is_refused(position: int) -> None:
    blob = bytearray(encode_snapshot("fp", "t", 1, _rows()))
    blob[position] ^= 0x01
    with pytest.raises(SnapshotError):
        decode_snapshot(bytes(blob), "fp", (V, K))


@pytest.mark.parametrize("keep", [0, 3, 7, 40, -1])
def test_truncated_blob_is_refused(keep: int) -> None:
    blob = encode_snapshot("fp", "t", 1, _rows())
    with pytest.raises(SnapshotError):
        decode_snapshot(blob[:keep], "fp", (V, K))


@pytest.mark.parametrize(
    ("fingerprint", "shape", "tenant", "version", "what"),
    [
        ("other", (V, K), None, None, "fingerprint"),
        ("fp", (V + 1, K), None, None, "shape"),
        ("fp", (V, 4), None, None, "shape"),
        ("fp", (V, K), "other", None, "tenant"),
        ("fp", (V, K), None, 2, "version"),
    ],
)
def test_mismatched_identity_is_refused(fingerprint, shape, tenant, version, what) -> None:
    blob = encode_snapshot("fp", "t", 1, _rows())
    with pytest.raises(SnapshotError, match=what):
        decode_snapshot(blob, fingerprint, shape, tenant=tenant, version=version)


def test_out_of_range_ids_in_a_consistent_blob_are_refused() -> None:
    # A blob made for a larger vocabulary but relabelled: checksum fine, ids impossible.
    big = np.zeros((V, K), np.int32)
    big[3] = V + 5
    blob = encode_snapshot("fp", "t", 1, big)
    with pytest.raises(SnapshotError, match="outside"):
        decode_snapshot(blob, "fp", (V, K))


def test_payload_is_zlib_of_indices_rows_and_probs() -> None:
    rows = np.zeros((V, K), np.int32)
    rows[4] = np.arange(K)
    probs = np.zeros((V, K), np.uint8)
    probs[4] = np.arange(K) + 100
    probs[7, 0] = 9  # a row of zero ids with a known confidence is stored too
    blob = encode_snapshot("fp", "t", 1, rows, probs=probs)
    body = zlib.decompress(blob[blob.index(b"}") + 1 :])
    n = 2
    assert np.frombuffer(body, "<i4", count=n * (1 + K)).tolist() == [4, 7, *range(K), *[0] * K]
    assert np.frombuffer(body, "u1", offset=4 * n * (1 + K)).tolist() == [*range(100, 100 + K), 9, *[0] * (K - 1)]
    assert json.loads(blob[8 : blob.index(b"}") + 1])["format"] == 2


def test_probs_roundtrip_exactly_and_default_to_zeros() -> None:
    rows = _rows(seed=4)
    probs = np.random.default_rng(4).integers(0, 256, (V, K)).astype(np.uint8)
    probs[~rows.any(axis=1)] = 0
    snap = decode_snapshot(encode_snapshot("fp", "t", 2, rows, probs=probs), "fp", (V, K))
    assert np.array_equal(snap.rows, rows) and np.array_equal(snap.probs, probs) and snap.probs.dtype == np.uint8
    unknown = decode_snapshot(encode_snapshot("fp", "t", 2, rows), "fp", (V, K))
    assert np.array_equal(unknown.rows, rows) and not unknown.probs.any()
    with pytest.raises(ValueError, match="probs"):
        encode_snapshot("fp", "t", 2, rows, probs=probs.astype(np.int32))


# Written by the format-1 code (matrix_store/snapshot.py before confidences, commit 8642678):
# encode_snapshot("fp-v1", "acme", 7, rows, created=1700000000.0, epoch=3) with V=16, K=4,
# rows[3] = [5, 1, 2, 0], rows[9] = [15, 14, 0, 7], every other row zeros.
FORMAT1_BLOB = bytes.fromhex(
    "54524d58000000ed7b2263726561746564223a20313730303030303030302e302c20226474797065223a20223c6934"
    "222c202265706f6368223a20332c202266696e6765727072696e74223a202266702d7631222c2022666f726d617422"
    "3a20312c20226e6f6e7a65726f5f726f7773223a20322c2022736861323536223a2022373336353936623932343333"
    "36343734616339616466666636343636323163663130313233383962666261393733373434396132376361373637363"
    "366323066222c20227368617065223a205b31362c20345d2c202274656e616e74223a202261636d65222c2022766572"
    "73696f6e223a20377d780163666060e004625620660462262006017e20e603b31818d881340004840039"
)


def encode_format1(fingerprint: str, tenant: str, version: int, rows: np.ndarray, created: float,
                   epoch: int = 0) -> bytes:
    """The format-1 encoder as it was (ids only, no probs), kept to write old blobs in tests."""
    indices = np.flatnonzero(rows.any(axis=1)).astype("<i4")
    payload = zlib.compress(indices.tobytes() + rows[indices].astype("<i4").tobytes(), 1)
    header = {"format": 1, "fingerprint": fingerprint, "tenant": tenant, "version": version,
              "shape": [int(rows.shape[0]), int(rows.shape[1])], "dtype": "<i4", "nonzero_rows": int(indices.size),
              "created": float(created), "epoch": epoch}
    canonical = json.dumps(header, sort_keys=True).encode()
    header["sha256"] = hashlib.sha256(canonical + payload).hexdigest()
    header_bytes = json.dumps(header, sort_keys=True).encode()
    return b"TRMX" + struct.pack(">I", len(header_bytes)) + header_bytes + payload


def test_a_format1_blob_written_by_the_old_code_loads_with_zero_probs() -> None:
    want = np.zeros((16, 4), np.int32)
    want[3], want[9] = [5, 1, 2, 0], [15, 14, 0, 7]
    snap = decode_snapshot(FORMAT1_BLOB, "fp-v1", (16, 4), tenant="acme", version=7)
    assert np.array_equal(snap.rows, want) and snap.probs.dtype == np.uint8 and snap.probs.shape == (16, 4)
    assert not snap.probs.any() and (snap.epoch, snap.created) == (3, 1700000000.0)
    assert encode_format1("fp-v1", "acme", 7, want, 1700000000.0, epoch=3) == FORMAT1_BLOB  # the old code path
    corrupt = bytearray(FORMAT1_BLOB)
    corrupt[-3] ^= 0x01
    with pytest.raises(SnapshotError):  # still covered by its checksum
        decode_snapshot(bytes(corrupt), "fp-v1", (16, 4))


@pytest.mark.parametrize("fmt", [0, 3, "2", 2.0, True])
def test_unknown_formats_are_refused(fmt) -> None:
    blob = encode_snapshot("fp", "t", 1, _rows())
    header = json.loads(blob[8 : blob.index(b"}") + 1])
    payload = blob[blob.index(b"}") + 1 :]
    header = {k: v for k, v in header.items() if k != "sha256"} | {"format": fmt}
    header["sha256"] = hashlib.sha256(json.dumps(header, sort_keys=True).encode() + payload).hexdigest()
    raw = json.dumps(header, sort_keys=True).encode()
    with pytest.raises(SnapshotError, match="format"):
        decode_snapshot(b"TRMX" + struct.pack(">I", len(raw)) + raw + payload, "fp", (V, K))
