"""Versions and snapshots across processes: two stores on one key prefix, a restart after kill -9,
deletes while a session is open, and a Redis that accepts connections but never answers."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from trserve.core.errors import FailedPrecondition, ResourceExhausted, Unavailable
from tests.helpers import wait_for

pytestmark = pytest.mark.redis
V, K = 1000, 8


def _row(store, spec, tenant: str, token: int, value: int, **kw) -> int:
    return store.apply(spec, tenant, np.array([token]), np.full((1, K), value), **kw)


def test_two_stores_on_one_prefix_never_overwrite_each_other(make_store, spec) -> None:
    a, b = make_store(), make_store()
    _row(a, spec, "t", 1, 10)
    assert a.snapshot_now(spec.fingerprint, "t") == 1
    _row(a, spec, "t", 2, 20)  # a: v2, not snapshotted
    taken = b.checkout(spec, "t")  # b loads t: a newer epoch, from a's snapshot v1
    assert taken.version == 1 and taken.epoch > a.checkout(spec, "t").epoch
    _row(b, spec, "t", 3, 30)  # b: v2 with other rows than a's v2
    with pytest.raises(FailedPrecondition, match="taken over"):
        a.snapshot_now(spec.fingerprint, "t")  # a is fenced: its v2 never reaches Redis
    assert b.snapshot_now(spec.fingerprint, "t") == 2
    stored = make_store().checkout(spec, "t")
    assert stored.rows[3, 0] == 30 and stored.rows[2, 0] == 0  # b's v2, not a's
    assert a.tenants(spec.fingerprint) == ["t"] and a.health()["tenants_in_memory"] == 0  # a dropped it
    again = a.checkout(spec, "t")  # ... and reloads b's state at a newer epoch
    assert again.version == 2 and again.rows[3, 0] == 30 and again.epoch > taken.epoch


def test_restart_after_kill_never_reissues_a_version_under_the_same_epoch(make_store, spec) -> None:
    first = make_store()
    for token in range(1, 4):
        _row(first, spec, "t", token, token)
    first.snapshot_now(spec.fingerprint, "t")  # v3 in Redis
    _row(first, spec, "t", 9, 9)  # v4 only in memory: then "kill -9" (never closed)
    before = first.checkout(spec, "t")
    restarted = make_store()
    assert _row(restarted, spec, "t", 5, 5) == 4  # v4 again, with other rows...
    after = restarted.checkout(spec, "t")
    assert after.epoch != before.epoch  # ...under another epoch: (epoch, version) differ
    assert not np.array_equal(after.rows, before.rows)
    with pytest.raises(FailedPrecondition):
        first.snapshot_now(spec.fingerprint, "t")  # the old writer, if it is still alive, is fenced
    restarted.snapshot_now(spec.fingerprint, "t")
    assert make_store().checkout(spec, "t").rows[5, 0] == 5


def test_delete_is_not_undone_by_a_session_opened_before_it(make_store, spec) -> None:
    store, other = make_store(), make_store()
    opened = store.checkout(spec, "t")
    _row(store, spec, "t", 1, 1, since_epoch=opened.epoch)
    store.snapshot_now(spec.fingerprint, "t")
    other.delete(spec.fingerprint, "t")  # deleted by another store on the same prefix
    with pytest.raises(FailedPrecondition):
        store.snapshot_now(spec.fingerprint, "t")  # fenced by the tombstone's epoch; dropped
    with pytest.raises(FailedPrecondition, match="deleted after this session opened"):
        _row(store, spec, "t", 2, 2, since_epoch=opened.epoch)
    assert store.tenants(spec.fingerprint) == [] and other.tenants(spec.fingerprint) == []
    fresh = store.checkout(spec, "t")
    assert _row(store, spec, "t", 3, 3, since_epoch=fresh.epoch) == 1  # a new session recreates it


class _Blackhole:
    """A TCP listener that accepts connections and never answers (a hung Redis)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"
        self._conns: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            self._conns.append(conn)  # held open, never read or written

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for c in self._conns:
            c.close()


def test_a_redis_that_hangs_times_out_and_the_store_serves_from_memory(make_store, spec) -> None:
    hole = _Blackhole()
    try:
        store = make_store(redis_url=hole.url, redis_timeout_s=0.2, snapshot_every_s=0.05, max_tenants_in_memory=2)
        store.start()
        started = time.monotonic()
        for i in range(20):
            assert _row(store, spec, "t", i, i + 1) == i + 1  # first use times out once, then the breaker
        out = store.checkout(spec, "t")
        assert out.version == 20 and [out.rows[i, 0] for i in range(20)] == list(range(1, 21))
        assert out.epoch == -1  # unknown while Redis does not answer
        with pytest.raises(Unavailable):
            store.snapshot_now(spec.fingerprint, "t")
        wait_for(lambda: store.health()["redis"] == "failing")
        assert time.monotonic() - started < 5
        again = store.checkout(spec, "t")
        assert again.version == 20 and np.array_equal(again.rows, out.rows)  # nothing corrupted
        assert _row(store, spec, "u", 1, 1) == 1
        with pytest.raises(ResourceExhausted):  # full, and nothing can be snapshotted to make room
            _row(store, spec, "v", 1, 1)
        store.close()  # the final snapshot times out quietly
        assert time.monotonic() - started < 8
    finally:
        hole.close()


def test_a_rollback_fences_the_other_writer(make_store, spec) -> None:
    a, b = make_store(keep_snapshots=5), make_store(keep_snapshots=5)
    for token in (1, 2):
        _row(a, spec, "t", token, token)
        a.snapshot_now(spec.fingerprint, "t")
    b.checkout(spec, "t")  # b takes t at v2
    _row(b, spec, "t", 3, 3)
    assert a.rollback(spec.fingerprint, "t", 1) == 1  # a takes it back and rolls back
    with pytest.raises(FailedPrecondition):
        b.snapshot_now(spec.fingerprint, "t")  # b cannot re-add v3 above the rollback
    assert a.versions(spec.fingerprint, "t") == [1]
    assert make_store().checkout(spec, "t").version == 1
