import doctest
import zlib

import numpy as np
import pytest

import matrix_store.snapshot
import matrix_store.tenant
from matrix_store.snapshot import SnapshotError, decode_snapshot, encode_snapshot

V, K = 1000, 8


def _rows(seed: int = 0, filled: int = 50) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = np.zeros((V, K), np.int32)  # [V, K]
    rows[rng.choice(V, filled, replace=False)] = rng.integers(0, V, (filled, K))
    return rows


def test_doctests_hold() -> None:
    for module in (matrix_store.snapshot, matrix_store.tenant):
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


def test_payload_is_zlib_of_indices_and_rows() -> None:
    rows = np.zeros((V, K), np.int32)
    rows[4] = np.arange(K)
    blob = encode_snapshot("fp", "t", 1, rows)
    body = zlib.decompress(blob[blob.index(b"}") + 1 :])
    assert np.frombuffer(body, "<i4").tolist() == [4, *range(K)]
