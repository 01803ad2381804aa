"""MatrixStore against a real Redis: hot start, retention, rollback, fork, delete, refusal of
corrupt or mismatched snapshots, background snapshots, eviction."""

import logging
import threading
import time

import numpy as np
import pytest

from trserve.core.errors import FailedPrecondition, FingerprintMismatch, InvalidArgument, NotFound
from trserve.core.model_spec import ModelSpec
from trserve.matrix_store.snapshot import decode_snapshot, encode_snapshot
from tests.helpers import wait_for
from tests.matrix_store.test_snapshot import encode_format1

pytestmark = pytest.mark.redis
V, K = 1000, 8


def _fill(store, spec, tenant: str, batches: int, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(batches):
        tokens = rng.integers(0, V, 16)
        store.apply(spec, tenant, tokens, rng.integers(0, V, (16, K)), probs=rng.integers(1, 256, (16, K), np.uint8))


def test_new_store_hot_starts_with_identical_rows_and_version(make_store, spec) -> None:
    first = make_store()
    _fill(first, spec, "a", 5, seed=1)
    _fill(first, spec, "b", 3, seed=2)
    assert first.snapshot_now(spec.fingerprint, "a") == 5
    assert first.snapshot_now(spec.fingerprint, "b") == 3
    second = make_store()
    assert second.describe(spec.fingerprint, "b")["version"] == 3  # read from Redis, not loaded
    assert second.health()["tenants_in_memory"] == 0
    for tenant in ("a", "b"):
        mine, theirs = first.checkout(spec, tenant), second.checkout(spec, tenant)
        assert theirs.version == mine.version and np.array_equal(theirs.rows, mine.rows)
        assert mine.probs.any() and np.array_equal(theirs.probs, mine.probs)  # confidences travel with the ids
    assert second.checkout(spec, "c").source == "zeros"
    assert sorted(second.tenants(spec.fingerprint)) == ["a", "b"]  # reading "c" did not create it


def test_only_the_last_keep_snapshots_are_kept(make_store, spec, redis_client, prefix) -> None:
    store = make_store(keep_snapshots=3)
    for _ in range(5):
        _fill(store, spec, "t", 1)
        store.snapshot_now(spec.fingerprint, "t")
    assert store.versions(spec.fingerprint, "t") == [3, 4, 5]
    assert len(list(redis_client.scan_iter(match=f"{prefix}:snap:*"))) == 3


def test_rollback_restores_rows_and_version_and_drops_newer(make_store, spec) -> None:
    store = make_store(keep_snapshots=5)
    saved = {}
    for version in (1, 2, 3):
        _fill(store, spec, "t", 1, seed=version)
        store.snapshot_now(spec.fingerprint, "t")
        saved[version] = store.checkout(spec, "t")
    _, live = store.view(spec, "t")
    assert store.rollback(spec.fingerprint, "t", 2) == 2
    assert np.array_equal(live, saved[2].rows)  # view holders see the rollback too
    back = store.checkout(spec, "t")
    assert back.version == 2 and store.versions(spec.fingerprint, "t") == [1, 2]
    assert np.array_equal(back.probs, saved[2].probs) and not np.array_equal(back.probs, saved[3].probs)
    with pytest.raises(NotFound, match="version 3"):
        store.rollback(spec.fingerprint, "t", 3)
    with pytest.raises(InvalidArgument):
        store.rollback(spec.fingerprint, "t", -1)
    assert store.apply(spec, "t", np.array([1]), np.ones((1, K), int)) == 3
    restarted = make_store().checkout(spec, "t")
    assert restarted.version == 2 and np.array_equal(restarted.rows, saved[2].rows)
    assert not restarted.probs[1].any()  # the ids-only batch applied after the rollback: unknown
    assert np.array_equal(np.delete(restarted.probs, 1, 0), np.delete(saved[2].probs, 1, 0))


def test_fork_copies_and_snapshots_the_destination(make_store, spec) -> None:
    store = make_store()
    _fill(store, spec, "src", 4)
    store.snapshot_now(spec.fingerprint, "src")
    assert store.fork(spec.fingerprint, "src", "dst") == 4
    store.apply(spec, "src", np.array([0]), np.full((1, K), 7))
    other = make_store()
    dst = other.checkout(spec, "dst")
    assert dst.version == 4 and dst.source == "redis" and dst.rows[0, 0] != 7
    assert dst.probs.any() and np.array_equal(dst.probs, store.checkout(spec, "dst").probs)
    with pytest.raises(FailedPrecondition, match="already exists"):
        other.fork(spec.fingerprint, "src", "dst")  # exists in Redis, other's memory aside


def test_delete_removes_memory_and_redis(make_store, spec, redis_client, prefix) -> None:
    store = make_store()
    _fill(store, spec, "t", 2)
    store.snapshot_now(spec.fingerprint, "t")
    store.delete(spec.fingerprint, "t")
    left = sorted(k.decode() for k in redis_client.scan_iter(match=f"{prefix}:*"))
    assert left == [f"{prefix}:epoch:{spec.fingerprint}:t", f"{prefix}:tomb:{spec.fingerprint}:t"]  # the tombstone
    with pytest.raises(NotFound):
        make_store().describe(spec.fingerprint, "t")
    assert store.checkout(spec, "t").version == 0 and store.tenants() == []


def test_corrupt_snapshot_is_refused_and_previous_good_one_served(make_store, spec, redis_client, prefix, caplog):
    store = make_store()
    _fill(store, spec, "t", 1)
    store.snapshot_now(spec.fingerprint, "t")
    good = store.checkout(spec, "t").rows
    _fill(store, spec, "t", 1, seed=9)
    store.snapshot_now(spec.fingerprint, "t")
    key = f"{prefix}:snap:{spec.fingerprint}:t:2"
    redis_client.setrange(key, redis_client.strlen(key) - 12, b"\x00garbage\x00")  # inside the payload
    with caplog.at_level(logging.ERROR, logger="trserve.matrix_store"):
        served = make_store().checkout(spec, "t")
    assert served.version == 1 and np.array_equal(served.rows, good)
    assert "refusing snapshot" in caplog.text and "checksum" in caplog.text


def test_all_snapshots_unreadable_starts_cold_above_them(make_store, spec, redis_client, prefix) -> None:
    store = make_store()
    _fill(store, spec, "t", 3)
    store.snapshot_now(spec.fingerprint, "t")
    key = f"{prefix}:snap:{spec.fingerprint}:t:3"
    redis_client.set(key, redis_client.get(key)[:-10])  # truncated
    fresh = make_store()
    out = fresh.checkout(spec, "t")
    assert out.version == 3 and not out.rows.any()  # never served, versions stay monotonic
    assert fresh.apply(spec, "t", np.array([1]), np.ones((1, K), int)) == 4


def test_blob_of_another_fingerprint_is_refused(make_store, spec, redis_client, prefix) -> None:
    store = make_store()
    _fill(store, spec, "t", 1)
    store.snapshot_now(spec.fingerprint, "t")
    _fill(store, spec, "t", 1, seed=3)
    store.snapshot_now(spec.fingerprint, "t")
    alien = encode_snapshot("other-model", "t", 2, np.ones((V, K), np.int32))
    redis_client.set(f"{prefix}:snap:{spec.fingerprint}:t:2", alien)
    assert make_store().checkout(spec, "t").version == 1


def test_format1_snapshot_in_redis_loads_with_zero_probs_and_is_rewritten_as_format2(
        make_store, spec, redis_client, prefix) -> None:
    """A tenant snapshotted before confidences were kept (format 1, ids only) hot-starts with its
    ids and probs zero (unknown); its next snapshot is format 2 and carries the probs learned since."""
    store = make_store()
    _fill(store, spec, "t", 2)
    store.snapshot_now(spec.fingerprint, "t")  # a format-2 snapshot at version 2, then replaced by a format-1 one
    ids = store.checkout(spec, "t").rows
    epoch = int(redis_client.get(f"{prefix}:epoch:{spec.fingerprint}:t"))
    old = encode_format1(spec.fingerprint, "t", 2, ids, created=time.time(), epoch=epoch)
    redis_client.set(f"{prefix}:snap:{spec.fingerprint}:t:2", old)
    fresh = make_store()
    out = fresh.checkout(spec, "t")
    assert out.version == 2 and out.source == "redis" and np.array_equal(out.rows, ids) and not out.probs.any()
    fresh.apply(spec, "t", np.array([3]), np.full((1, K), 4), probs=np.full((1, K), 77, np.uint8))
    assert fresh.snapshot_now(spec.fingerprint, "t") == 3
    blob = redis_client.get(f"{prefix}:snap:{spec.fingerprint}:t:3")
    assert decode_snapshot(blob, spec.fingerprint, spec.shape).probs[3].tolist() == [77] * K
    assert b'"format": 2' in blob[:400]
    assert fresh.rollback(spec.fingerprint, "t", 2) == 2  # a rollback to the format-1 one: probs unknown again
    back = fresh.checkout(spec, "t")
    assert np.array_equal(back.rows, ids) and not back.probs.any()


def test_shape_mismatch_with_stored_tenant_raises(make_store, spec) -> None:
    store = make_store()
    _fill(store, spec, "t", 1)
    store.snapshot_now(spec.fingerprint, "t")
    for wrong in (ModelSpec(spec.fingerprint, V, 4), ModelSpec(spec.fingerprint, V + 1, K)):
        with pytest.raises(FingerprintMismatch, match="request is for"):
            make_store().checkout(wrong, "t")


def test_background_snapshots_by_versions_by_time_and_on_close(make_store, spec) -> None:
    by_versions = make_store(snapshot_every_versions=3, snapshot_every_s=60)
    by_versions.start()
    by_versions.start()  # idempotent
    _fill(by_versions, spec, "v", 3)
    wait_for(lambda: by_versions.versions(spec.fingerprint, "v") == [3], timeout=5.0)
    by_time = make_store(snapshot_every_versions=1000, snapshot_every_s=0.1)
    by_time.start()
    _fill(by_time, spec, "s", 1)
    wait_for(lambda: by_time.versions(spec.fingerprint, "s") == [1], timeout=5.0)
    assert by_time.health()["last_snapshot_ok_at"] is not None
    on_close = make_store(snapshot_every_s=60)
    on_close.start()
    _fill(on_close, spec, "c", 2)
    on_close.close()
    assert make_store().checkout(spec, "c").version == 2


def test_eviction_bounds_memory_and_evicted_tenants_return_intact(make_store, spec) -> None:
    store = make_store(max_tenants_in_memory=3)
    expected = {}
    for i in range(10):
        _fill(store, spec, f"t{i}", 2, seed=i)
        store.snapshot_now(spec.fingerprint, f"t{i}")
        expected[f"t{i}"] = store.checkout(spec, f"t{i}").rows
        assert store.health()["tenants_in_memory"] <= 3
    assert not store.describe(spec.fingerprint, "t0")["in_memory"]  # evicted; describe does not load it
    store.checkout(spec, "t0")
    assert store.describe(spec.fingerprint, "t0")["in_memory"]
    for tenant, rows in expected.items():
        out = store.checkout(spec, tenant)
        assert out.version == 2 and np.array_equal(out.rows, rows)


def test_unsnapshotted_tenants_are_snapshotted_before_eviction(make_store, spec) -> None:
    store = make_store(max_tenants_in_memory=2)
    expected = {}
    for i in range(5):
        _fill(store, spec, f"t{i}", 1, seed=i)
        expected[f"t{i}"] = store.checkout(spec, f"t{i}").rows
        assert store.health()["tenants_in_memory"] <= 2
    for i in range(5):  # none lost: each went to Redis before it left memory
        out = store.checkout(spec, f"t{i}")
        assert out.version == 1 and np.array_equal(out.rows, expected[f"t{i}"])


def test_concurrent_applies_with_background_snapshots_and_eviction(make_store, spec) -> None:
    """Applies race snapshots and evictions (bound 2, 6 tenants): no batch may be lost."""
    store = make_store(max_tenants_in_memory=2, snapshot_every_versions=4, snapshot_every_s=0.05)
    store.start()
    tenants, batches = [f"t{i}" for i in range(6)], 40

    def worker(slot: int) -> None:
        for i in range(batches):
            tenant = tenants[(slot + i) % len(tenants)]
            store.apply(spec, tenant, np.array([slot * batches + i]), np.full((1, K), slot + 1))
            time.sleep(0.001)  # give snapshots (and so evictions) room between batches

    threads = [threading.Thread(target=worker, args=(slot,)) for slot in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    store.close()
    fresh = make_store()
    outs = [fresh.checkout(spec, t) for t in tenants]
    assert sum(o.version for o in outs) == 4 * batches
    assert sum(int(o.rows.any(axis=1).sum()) for o in outs) == 4 * batches  # every row landed once


def test_key_layout_matches_the_documented_one(make_store, spec, redis_client, prefix) -> None:
    store = make_store()
    store.apply(spec, "t", np.array([1]), np.ones((1, K), int), domain="legal")
    store.snapshot_now(spec.fingerprint, "t")
    fp = spec.fingerprint
    assert sorted(k.decode() for k in redis_client.scan_iter(match=f"{prefix}:*")) == sorted(
        [f"{prefix}:fingerprints", f"{prefix}:tenants:{fp}", f"{prefix}:meta:{fp}:t",
         f"{prefix}:versions:{fp}:t", f"{prefix}:snap:{fp}:t:1", f"{prefix}:epoch:{fp}:t"]
    )
    meta = {k.decode(): v.decode() for k, v in redis_client.hgetall(f"{prefix}:meta:{fp}:t").items()}
    assert {k: meta[k] for k in ("fingerprint", "vocab_size", "k", "domain", "latest", "epoch")} == {
        "fingerprint": fp, "vocab_size": str(V), "k": str(K), "domain": "legal", "latest": "1",
        "epoch": redis_client.get(f"{prefix}:epoch:{fp}:t").decode(),
    }
    # a meta hash missing its shape is ignored rather than trusted
    redis_client.hdel(f"{prefix}:meta:{fp}:t", "k")
    with pytest.raises(NotFound):
        make_store().describe(fp, "t")


def test_list_tenants_from_memory_and_redis_without_loading(make_store, spec, redis_client, prefix) -> None:
    first = make_store()
    _fill(first, spec, "a", 3, seed=1)
    first.snapshot_now(spec.fingerprint, "a")
    _fill(first, spec, "a", 1, seed=2)  # one version past the snapshot
    _fill(first, spec, "b", 2, seed=3)  # never snapshotted
    listed = {s.tenant: s for s in first.list_tenants(spec.fingerprint)}
    a, b = listed["a"], listed["b"]
    assert (a.version, a.in_memory, a.last_snapshot_version, a.memory_bytes) == (4, True, 3, V * K * 5)
    assert a.nonzero_rows == int(np.count_nonzero(first.checkout(spec, "a").rows.any(axis=1)))
    assert 0 <= a.last_snapshot_age_s < 30
    assert (b.version, b.last_snapshot_version, b.last_snapshot_age_s) == (2, None, None)

    second = make_store()  # a new process: "a" is only in Redis, "b" nowhere
    redis_client.hset(f"{prefix}:meta:{spec.fingerprint}:a", "updated", str(time.time() - 60))
    (stored,) = second.list_tenants()
    assert (stored.tenant, stored.version, stored.in_memory, stored.nonzero_rows, stored.memory_bytes) == \
        ("a", 3, False, None, 0)
    assert stored.last_snapshot_version == 3 and 60 <= stored.last_snapshot_age_s < 90
    assert second.health()["tenants_in_memory"] == 0  # listing loaded nothing


def test_a_redis_with_a_password_is_reached_with_it_and_refuses_without(make_store, spec, tmp_path) -> None:
    """Issue 46: the shipped Redis requires a password; the store sends it from --redis-password-file
    (StoreConfig.redis_password, never in the URL or a repr). A real redis-server with requirepass."""
    import shutil
    import socket
    import subprocess

    import redis

    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server on PATH")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    password = "p4ss-" + "x" * 20
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--requirepass", password,
                               "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: redis.Redis(port=port, password=password).ping(), timeout=10)
        url = f"redis://127.0.0.1:{port}/0"
        with_password = make_store(redis_url=url, redis_password=password)
        _fill(with_password, spec, "a", 2)
        assert with_password.snapshot_now(spec.fingerprint, "a") == 2
        assert with_password.health()["redis"] == "ok" and password not in repr(with_password._config)
        assert make_store(redis_url=url, redis_password=password).describe(spec.fingerprint, "a")["version"] == 2
        without = make_store(redis_url=url)
        assert without.health()["redis"] != "ok"  # NOAUTH: refused, and the store says so
    finally:
        server.terminate()
        server.wait(10)
