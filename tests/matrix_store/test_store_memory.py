"""MatrixStore without Redis: validation, inheritance, versions under concurrency, isolation."""

import threading

import numpy as np
import pytest

from trserve.core.errors import (
    FailedPrecondition,
    FingerprintMismatch,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from trserve.core.model_spec import ModelSpec
from trserve.matrix_store import GLOBAL_TENANT, MatrixStore, StoreConfig

V, K = 1000, 8


@pytest.fixture
def store():
    s = MatrixStore(StoreConfig(max_batch_rows=64, max_tenants_in_memory=8))
    yield s
    s.close()


def _batch(tokens: list[int], value: int) -> tuple[np.ndarray, np.ndarray]:
    return np.array(tokens), np.full((len(tokens), K), value)


@pytest.mark.parametrize(
    ("tokens", "topk", "match"),
    [
        (np.array([1]), np.zeros((1, K - 1), int), "K=8"),
        (np.array([V]), np.zeros((1, K), int), r"\[0, 1000\)"),
        (np.array([-1]), np.zeros((1, K), int), r"\[0, 1000\)"),
        (np.array([1]), np.full((1, K), V), r"\[0, 1000\)"),
        (np.array([1, 2]), np.zeros((3, K), int), "must match"),
        (np.array([], int), np.zeros((0, K), int), "1..64"),
        (np.arange(65), np.zeros((65, K), int), "1..64"),
        (np.array([[1]]), np.zeros((1, K), int), "1-D"),
        (np.array([1.5]), np.zeros((1, K), int), "integer"),
    ],
)
def test_bad_batches_are_refused_and_change_nothing(store, spec, tokens, topk, match) -> None:
    with pytest.raises(InvalidArgument, match=match):
        store.apply(spec, "t", tokens, topk)
    assert store.checkout(spec, "t").version == 0


def test_probs_round_trip_through_apply_and_checkout(store, spec) -> None:
    tokens, topk = np.array([5, 9, 5]), np.stack([np.full(K, v) for v in (1, 2, 3)])  # [3, K]
    probs = np.stack([np.full(K, p, np.uint8) for p in (10, 20, 30)])  # [3, K]: the last 5 wins, as its ids
    assert store.apply(spec, "t", tokens, topk, probs=probs) == 1
    out = store.checkout(spec, "t")
    assert out.probs.dtype == np.uint8 and out.probs.shape == (V, K)
    assert out.probs[5].tolist() == [30] * K and out.probs[9].tolist() == [20] * K and out.probs.sum() == 50 * K
    out.probs[5] = 0  # a private copy
    assert store.checkout(spec, "t").probs[5, 0] == 30
    store.apply(spec, "t", *_batch([5], 7))  # ids only: the row's confidences become unknown
    again = store.checkout(spec, "t")
    assert again.rows[5, 0] == 7 and not again.probs[5].any() and again.probs[9, 0] == 20
    info = store.describe(spec.fingerprint, "t")
    assert info["probs_sha256"] == __import__("hashlib").sha256(again.probs.tobytes()).hexdigest()
    assert store.fork(spec.fingerprint, "t", "t2") == 2 and np.array_equal(store.checkout(spec, "t2").probs, again.probs)
    store.fork(spec.fingerprint, "t", GLOBAL_TENANT)
    inherited = store.checkout(spec, "newcomer")  # a new tenant inherits the confidences with the ids
    assert inherited.source == "global" and np.array_equal(inherited.probs, again.probs)


@pytest.mark.parametrize(
    ("probs", "match"),
    [
        (np.zeros((1, K), np.uint8), r"\[n=2, K=8\]"),
        (np.zeros((2, K - 1), np.uint8), r"\[n=2, K=8\]"),
        (np.zeros(2 * K, np.uint8), r"\[n=2, K=8\]"),
        (np.full((2, K), 0.5), "uint8"),
        (np.full((2, K), 256), "0..255"),
        (np.full((2, K), -1), "0..255"),
    ],
)
def test_bad_probs_are_refused_and_change_nothing(store, spec, probs, match) -> None:
    store.apply(spec, "t", *_batch([1, 2], 3), probs=np.full((2, K), 40, np.uint8))
    before = store.checkout(spec, "t")
    with pytest.raises(InvalidArgument, match=match):
        store.apply(spec, "t", *_batch([1, 2], 4), probs=probs)
    after = store.checkout(spec, "t")
    assert after.version == 1 and np.array_equal(after.rows, before.rows) and np.array_equal(after.probs, before.probs)


@pytest.mark.parametrize("tenant", ["", "a:b", "x" * 65])
def test_bad_tenant_and_domain_ids_are_refused(store, spec, tenant) -> None:
    with pytest.raises(InvalidArgument):
        store.checkout(spec, tenant)
    with pytest.raises(InvalidArgument):
        store.apply(spec, "ok", *_batch([1], 1), domain=tenant)


def test_duplicate_tokens_last_occurrence_wins(store, spec) -> None:
    tokens = np.array([5, 9, 5, 5])
    topk = np.stack([np.full(K, v) for v in (1, 2, 3, 4)])  # [4, K]
    assert store.apply(spec, "t", tokens, topk) == 1
    rows = store.checkout(spec, "t").rows
    assert rows[5].tolist() == [4] * K and rows[9].tolist() == [2] * K


def test_inheritance_tenant_domain_global_zeros_with_copies(store, spec) -> None:
    assert store.checkout(spec, "fresh").source == "zeros"
    assert store.tenants() == []  # a read does not create the tenant
    store.apply(spec, "curated-legal", *_batch([2], 22))  # before _global has rows: starts from zeros
    store.fork(spec.fingerprint, "curated-legal", "_domain.legal")  # administration writes a domain
    store.apply(spec, "curated", *_batch([1], 11))
    store.fork(spec.fingerprint, "curated", GLOBAL_TENANT)  # ... and the global matrix
    from_global = store.checkout(spec, "a")
    assert from_global.source == "global" and from_global.rows[1, 0] == 11 and from_global.version == 0
    from_domain = store.checkout(spec, "b", domain="legal")
    assert from_domain.source == "domain" and from_domain.rows[2, 0] == 22 and from_domain.rows[1, 0] == 0
    # a domain is its own namespace: naming tenant "curated" as a domain reads nothing of it
    assert store.checkout(spec, "c", domain="curated").source == "global"
    # a tenant's writes stay its own: neither the domain nor the global matrix sees them
    assert store.apply(spec, "b", *_batch([2, 3], 99), domain="legal") == 1
    legal = store.describe(spec.fingerprint, "_domain.legal")
    assert legal["version"] == 1 and legal["nonzero_rows"] == 1
    assert not store.checkout(spec, "zz").rows[3].any()
    # and later domain writes do not reach a tenant that already exists
    store.apply(spec, "curated-legal", *_batch([7], 77))
    store.delete(spec.fingerprint, "_domain.legal")
    store.fork(spec.fingerprint, "curated-legal", "_domain.legal")
    again = store.checkout(spec, "b", domain="legal")
    assert again.source == "tenant" and again.rows[7, 0] == 0 and again.rows[2, 0] == 99


@pytest.mark.parametrize("tenant", ["_global", "_domain.legal", "_x"])
def test_callers_cannot_read_or_write_reserved_tenants(store, spec, tenant) -> None:
    with pytest.raises(InvalidArgument, match="reserved"):
        store.apply(spec, tenant, *_batch([1], 1))
    with pytest.raises(InvalidArgument, match="reserved"):
        store.checkout(spec, tenant)
    with pytest.raises(InvalidArgument, match="reserved"):
        store.checkout(spec, "t", domain=tenant)  # a domain id is not a tenant id either
    assert store.apply(spec, "t", *_batch([1], 1)) == 1  # and the store keeps serving


def test_checkout_is_a_copy_and_view_is_live(store, spec) -> None:
    store.apply(spec, "t", *_batch([1], 1))
    copy = store.checkout(spec, "t").rows
    version, live = store.view(spec, "t")
    copy[3] = 1
    store.apply(spec, "t", *_batch([4], 5))
    assert version == 1 and live[4, 0] == 5 and not store.checkout(spec, "t").rows[3].any()


@pytest.mark.parametrize("tenants", [["solo"], ["a", "b", "c"]])
def test_concurrent_applies_lose_nothing_and_tenants_stay_apart(store, spec, tenants) -> None:
    threads_per_tenant, batches = 8 // len(tenants) + 1, 50

    def worker(tenant: str, slot: int) -> None:
        value = tenants.index(tenant) + 1
        for i in range(batches):
            token = tenants.index(tenant) * 300 + slot * batches + i  # disjoint rows per tenant
            store.apply(spec, tenant, np.array([token]), np.full((1, K), value))

    threads = [threading.Thread(target=worker, args=(t, s)) for t in tenants for s in range(threads_per_tenant)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for index, tenant in enumerate(tenants):
        out = store.checkout(spec, tenant)
        assert out.version == threads_per_tenant * batches
        written = np.flatnonzero(out.rows.any(axis=1))
        assert len(written) == threads_per_tenant * batches
        assert set(np.unique(out.rows[written])) == {index + 1}  # only its own values


def test_shape_mismatch_on_a_loaded_tenant_is_refused(store, spec) -> None:
    store.apply(spec, "t", *_batch([1], 1))
    with pytest.raises(FingerprintMismatch):
        store.checkout(ModelSpec(spec.fingerprint, V, 4), "t")
    # the same tenant id under another fingerprint is a different matrix
    assert store.checkout(ModelSpec("other", V, 4), "t").version == 0


def test_describe_fork_delete_without_redis(store, spec) -> None:
    with pytest.raises(NotFound):
        store.describe(spec.fingerprint, "t")
    store.apply(spec, "t", *_batch([1, 2], 3), domain="d")
    info = store.describe(spec.fingerprint, "t")
    assert {k: v for k, v in info.items() if k not in ("epoch", "rows_sha256", "probs_sha256")} == {
        "tenant": "t", "domain": "d", "fingerprint": spec.fingerprint, "version": 1,
        "nonzero_rows": 2, "last_snapshot_version": None, "in_memory": True, "memory_bytes": V * K * 5,
    }
    assert info["rows_sha256"] == __import__("hashlib").sha256(store.checkout(spec, "t").rows.tobytes()).hexdigest()
    assert store.fork(spec.fingerprint, "t", "t2") == 1
    with pytest.raises(FailedPrecondition):
        store.fork(spec.fingerprint, "t", "t2")
    store.apply(spec, "t2", *_batch([9], 9))
    assert not store.checkout(spec, "t").rows[9].any()
    store.delete(spec.fingerprint, "t")
    assert store.tenants(spec.fingerprint) == ["t2"]
    with pytest.raises(NotFound):
        store.delete(spec.fingerprint, "t")


def test_without_redis_snapshots_are_unavailable_and_nothing_is_evicted(store, spec) -> None:
    for tenant in "abcde":
        store.apply(spec, tenant, *_batch([1], 1))
    with pytest.raises(Unavailable, match="redis_url"):
        store.snapshot_now(spec.fingerprint, "a")
    with pytest.raises(Unavailable):
        store.rollback(spec.fingerprint, "a", 0)
    assert store.versions(spec.fingerprint, "a") == []
    assert store.health()["redis"] == "disabled" and store.health()["tenants_in_memory"] == 5


def test_without_redis_new_tenants_beyond_the_bound_are_refused(spec) -> None:
    store = MatrixStore(StoreConfig(max_tenants_in_memory=3))
    for tenant in "abc":
        store.apply(spec, tenant, *_batch([1], ord(tenant)))
    for i in range(50):  # cycling tenant ids: reads create nothing, writes are refused
        assert store.checkout(spec, f"cycle-{i}").version == 0
        with pytest.raises(ResourceExhausted, match="max_tenants_in_memory = 3"):
            store.apply(spec, f"cycle-{i}", *_batch([1], 1))
    health = store.health()
    assert health["tenants_in_memory"] == 3 and health["memory_bytes"] == 3 * V * K * 5
    assert store.apply(spec, "a", *_batch([2], 5)) == 2  # existing tenants keep serving, intact
    assert [store.checkout(spec, t).rows[1, 0] for t in "abc"] == [ord(t) for t in "abc"]
    store.delete(spec.fingerprint, "c")
    assert store.apply(spec, "d", *_batch([1], 1)) == 1  # room again


def test_only_served_models_are_accepted(spec) -> None:
    fixed = MatrixStore(StoreConfig(models=(spec,)))
    with pytest.raises(FailedPrecondition, match="not served"):
        fixed.apply(ModelSpec("other", V, K), "t", *_batch([1], 1))
    with pytest.raises(FailedPrecondition, match="not served"):
        fixed.checkout(ModelSpec("other", V, K), "t")
    learned = MatrixStore(StoreConfig(max_models=2))
    with pytest.raises(FailedPrecondition, match="max_matrix_bytes"):  # 3.2 GB: refused before allocating
        learned.checkout(ModelSpec("huge", 100_000_000, 8), "t")
    learned.apply(spec, "t", *_batch([1], 1))
    learned.apply(ModelSpec("second", 10, 2), "t", np.array([1]), np.ones((1, 2), int))
    for i in range(20):  # cycling fingerprints
        with pytest.raises(FailedPrecondition, match="max_models = 2"):
            learned.apply(ModelSpec(f"fp-{i}", 10, 2), "t", np.array([1]), np.ones((1, 2), int))
    with pytest.raises(FailedPrecondition, match="V=1000, K=8"):
        learned.apply(ModelSpec(spec.fingerprint, 10, 2), "t", np.array([1]), np.ones((1, 2), int))
    assert learned.apply(spec, "t", *_batch([1], 2)) == 2 and len(learned.models()) == 2


def test_side_state_is_bounded_in_memory(spec) -> None:
    store = MatrixStore(StoreConfig(max_side_states=3, max_side_bytes=100))
    for i in range(10):
        store.save_side_state("tuner", spec.fingerprint, f"t{i}", b"x" * 10)
    assert store.side_state_counts() == (3, 30)
    assert store.side_state("tuner", spec.fingerprint, "t9") == b"x" * 10
    assert store.side_state("tuner", spec.fingerprint, "t0") is None  # least recently used: dropped
    store.save_side_state("tuner", spec.fingerprint, "big", b"y" * 95)
    assert store.side_state_counts()[1] <= 100


def test_delete_leaves_a_tombstone_for_sessions_opened_before_it(store, spec) -> None:
    opened = store.checkout(spec, "t")  # a session opens before the tenant even exists
    assert store.apply(spec, "t", *_batch([1], 1), since_epoch=opened.epoch) == 1
    store.delete(spec.fingerprint, "t")
    with pytest.raises(FailedPrecondition, match="deleted after this session opened"):
        store.apply(spec, "t", *_batch([2], 2), since_epoch=opened.epoch)
    assert store.tenants() == []  # not resurrected
    fresh = store.checkout(spec, "t")  # a session opened after the delete may create it again
    assert store.apply(spec, "t", *_batch([3], 3), since_epoch=fresh.epoch) == 1
    assert store.checkout(spec, "t").epoch > opened.epoch


def test_list_tenants_without_redis_reports_memory_figures(store, spec) -> None:
    other = ModelSpec("other-fp", 10, 2)
    store.apply(spec, "t", *_batch([1, 2], 3), domain="d")
    store.apply(other, "x", np.array([4]), np.ones((1, 2), int))
    listed = store.list_tenants()
    assert [(s.fingerprint, s.tenant) for s in listed] == [("other-fp", "x"), (spec.fingerprint, "t")]
    t = listed[1]
    assert (t.domain, t.version, t.in_memory, t.nonzero_rows, t.memory_bytes) == ("d", 1, True, 2, V * K * 5)
    assert t.last_snapshot_version is None and t.last_snapshot_age_s is None
    assert [s.tenant for s in store.list_tenants("other-fp")] == ["x"]
    assert store.list_tenants("no-such-fp") == []
