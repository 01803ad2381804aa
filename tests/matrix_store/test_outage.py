"""Redis unreachable or dropped mid-run: the store keeps serving from memory, loses nothing, and
reconciles with what Redis holds once it is back."""

import time

import numpy as np
import pytest

from trserve.core.errors import Unavailable
from tests.helpers import wait_for

pytestmark = pytest.mark.redis
V, K = 1000, 8


def _row(store, spec, tenant: str, token: int, value: int) -> int:
    """Row `token` := `value` everywhere, its confidences `value` too."""
    return store.apply(spec, tenant, np.array([token]), np.full((1, K), value), probs=np.full((1, K), value, np.uint8))


def test_unreachable_redis_serves_from_memory_without_stalling(make_store, spec) -> None:
    started = time.monotonic()
    store = make_store(redis_url="redis://127.0.0.1:1/0", snapshot_every_s=0.05)
    store.start()
    for i in range(20):
        assert _row(store, spec, "t", i, i + 1) == i + 1
    out = store.checkout(spec, "t", domain="d")
    assert out.version == 20 and out.rows[19, 0] == 20
    assert store.describe(spec.fingerprint, "t")["version"] == 20
    with pytest.raises(Unavailable):
        store.snapshot_now(spec.fingerprint, "t")
    time.sleep(0.2)  # let the background thread fail a few times
    health = store.health()
    assert health["redis"] == "failing" and health["last_snapshot_error"]
    assert health["dirty_tenants"] == 1 and store.tenants() == ["t"]
    store.close()  # the final snapshot fails quietly
    assert time.monotonic() - started < 5


def test_dropped_redis_resumes_snapshots_and_loses_nothing(make_store, spec, proxy) -> None:
    store = make_store(redis_url=proxy.url, snapshot_every_s=0.05)
    store.start()
    _row(store, spec, "t", 1, 10)
    wait_for(lambda: store.versions(spec.fingerprint, "t") == [1])
    proxy.cut()
    for token in range(2, 6):
        _row(store, spec, "t", token, 10 * token)  # never raises
    wait_for(lambda: store.health()["redis"] == "failing")
    proxy.restore()
    wait_for(lambda: store.health()["dirty_tenants"] == 0)
    restarted = make_store().checkout(spec, "t")  # straight to Redis, not via the proxy
    assert restarted.version == 5 and restarted.rows[5, 0] == 50 and restarted.rows[1, 0] == 10
    assert store.health()["redis"] == "ok" and store.health()["last_snapshot_error"] is None


def test_delayed_restore_merges_memory_writes_over_the_stored_matrix(make_store, spec, proxy) -> None:
    writer = make_store()
    for token, value in ((1, 10), (2, 20), (3, 30)):
        _row(writer, spec, "t", token, value)
    writer.snapshot_now(spec.fingerprint, "t")  # Redis holds t@3
    proxy.cut()
    late = make_store(redis_url=proxy.url, snapshot_every_s=0.05)
    late.start()
    assert late.checkout(spec, "t").source == "zeros"  # Redis unreachable: starts from memory
    assert _row(late, spec, "t", 2, 99) == 1
    assert _row(late, spec, "t", 4, 44) == 2
    time.sleep(0.2)
    assert writer.versions(spec.fingerprint, "t") == [3]  # the zero-started matrix was never written
    proxy.restore()
    wait_for(lambda: late.health()["dirty_tenants"] == 0)
    out = late.checkout(spec, "t")
    assert out.version == 3 + 2
    assert [out.rows[t, 0] for t in (1, 2, 3, 4)] == [10, 99, 30, 44]  # stored rows + newer memory rows
    assert [out.probs[t, 0] for t in (1, 2, 3, 4)] == [10, 99, 30, 44]  # and their confidences with them
    assert writer.versions(spec.fingerprint, "t") == [3, 5]
    again = make_store().checkout(spec, "t")
    assert again.version == 5 and np.array_equal(again.rows, out.rows) and np.array_equal(again.probs, out.probs)
