"""Suffix histories on the embedded store: one per tenant, never read for another; loaded from and
saved to the store's side state, not on every request; bounded in memory; reported in metrics."""

from __future__ import annotations

import logging

import pytest

from trserve.core.model_spec import ModelSpec
from trserve.engine.tr.history import SuffixHistory
from trserve.engine.tr.tree import TreeTemplate, compile_tree
from trserve.matrix_store import MatrixStore, StoreConfig
from trserve.services.worker.drafting.embedded import embedded_factory
from trserve.services.common.histories import SIDE_STATE, HistoryBook, HistoryCollector
from trserve.services.worker.metrics import WorkerMetrics
from tests.services.matrix_helpers import redis_prefix  # noqa: F401 - fixture

SPEC = ModelSpec("fp-history", 1000, 4)
TREE = compile_tree(TreeTemplate.from_paths("ex", [[0], [1], [0, 0]]))
SECRET = [101, 102, 103, 104, 105, 106, 107, 108, 109, 110]  # "the launch code is ..."


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _open(factory, tenant):
    return factory(tenant, None).open(TREE, SPEC)


def test_histories_are_per_tenant():
    store = MatrixStore(StoreConfig())
    book = HistoryBook(store)
    factory = embedded_factory(store, SPEC, "cpu", book)
    a, b = _open(factory, "tenant-a"), _open(factory, "tenant-b")
    assert a.history is not None and b.history is not None and a.history is not b.history
    a.remember(SECRET)
    a.close(None)
    book.flush()
    a2, b2 = _open(factory, "tenant-a"), _open(factory, "tenant-b")
    assert a2.history is a.history and b2.history is b.history  # one object per tenant across requests
    assert a2.history.propose(SECRET[:3], 8).tokens == SECRET[3:]
    assert b2.history.propose(SECRET[:3], 8) is None and b2.history.tokens == 0
    b2.remember([1, 2, 3, 4])
    book.flush()
    assert a2.history.propose([1, 2, 3], 1) is None and b2.history.propose([1, 2, 3], 1).tokens == [4]
    book.close()


def test_saved_now_and_then_and_loaded_by_a_later_book():
    store, clock = MatrixStore(StoreConfig()), _Clock()
    book = HistoryBook(store, save_every_adds=3, save_every_s=60.0, clock=clock)
    history = book.get(SPEC.fingerprint, "acme")
    for i in range(2):
        book.remember(SPEC.fingerprint, "acme", history, SECRET + [i])
    book.flush()
    assert store.side_state(SIDE_STATE, SPEC.fingerprint, "acme") is None  # not on every request
    book.remember(SPEC.fingerprint, "acme", history, SECRET)
    book.flush()
    assert SuffixHistory.from_bytes(store.side_state(SIDE_STATE, SPEC.fingerprint, "acme")).documents == 3
    clock.now = 61.0  # one request after the interval saves too
    book.remember(SPEC.fingerprint, "acme", history, [7, 8, 9, 10])
    book.flush()
    assert SuffixHistory.from_bytes(store.side_state(SIDE_STATE, SPEC.fingerprint, "acme")).documents == 4
    book.remember(SPEC.fingerprint, "acme", history, [20, 21, 22, 23])
    book.close()  # shutdown saves what is left
    later = HistoryBook(store).get(SPEC.fingerprint, "acme")
    assert later.documents == 5 and later.propose([20, 21, 22], 1).tokens == [23]
    assert HistoryBook(store).get(SPEC.fingerprint, "other").tokens == 0
    assert store.side_state(SIDE_STATE, SPEC.fingerprint, "other") is None


def test_memory_bound_drops_the_least_recently_used_and_saves_it():
    store = MatrixStore(StoreConfig())
    one = SuffixHistory().memory_bytes()
    book = HistoryBook(store, max_bytes=int(2.5 * one), save_every_adds=1000)
    first = book.get(SPEC.fingerprint, "t0")
    book.remember(SPEC.fingerprint, "t0", first, SECRET)
    book.flush()
    for i in range(1, 4):
        book.get(SPEC.fingerprint, f"t{i}")
    assert [t for _, t, _ in book.memory()] == ["t2", "t3"] and book.memory_bytes <= 2.5 * one
    again = book.get(SPEC.fingerprint, "t0")  # reloaded from what was saved when it was dropped
    assert again is not first and again.propose(SECRET[:4], 2).tokens == SECRET[4:6]
    book.close()


def test_unreadable_history_starts_empty_and_never_fails(caplog):
    store = MatrixStore(StoreConfig())
    store.save_side_state(SIDE_STATE, SPEC.fingerprint, "acme", b"TRSH not a history at all")
    book = HistoryBook(store)
    with caplog.at_level(logging.WARNING):
        history = _open(embedded_factory(store, SPEC, "cpu", book), "acme").history
    assert history is not None and history.tokens == 0
    assert any("history load failed for tenant acme" in r.getMessage() for r in caplog.records)
    book.remember(SPEC.fingerprint, "acme", history, [1, -5, 3])  # bad ids: logged on the book's thread
    book.flush()
    book.close()


def test_worker_metrics_report_history_bytes_per_tenant():
    store = MatrixStore(StoreConfig())
    book = HistoryBook(store)
    for tenant in ("a", "b"):
        book.remember(SPEC.fingerprint, tenant, book.get(SPEC.fingerprint, tenant), list(range(2000)))
    book.flush()
    metrics = WorkerMetrics()
    metrics.registry.register(HistoryCollector(book))
    per = {t: metrics.value("trserve_history_tenant_memory_bytes", {"fingerprint": SPEC.fingerprint, "tenant": t})
           for t in ("a", "b")}
    assert per["a"] == book.get(SPEC.fingerprint, "a").memory_bytes() > 8000 and per["b"] > 8000
    assert metrics.value("trserve_history_memory_bytes") == per["a"] + per["b"] == book.memory_bytes
    assert metrics.value("trserve_history_tenants") == 2
    book.close()


def test_sessions_without_a_book_have_no_history():
    store = MatrixStore(StoreConfig())
    session = _open(embedded_factory(store, SPEC, "cpu"), "acme")
    assert session.history is None
    session.remember(SECRET)  # nothing to do, nothing raised
    session.close(None)


def test_a_worker_keeps_each_tenants_history_reports_it_and_saves_it_on_stop(decoder):
    import urllib.request

    from trserve_client import Client
    from trserve.services.worker.config import WorkerConfig
    from tests.services.worker_harness import BackgroundWorker

    w = BackgroundWorker(WorkerConfig(port=0, metrics_port=0, warmup=False), decoder)
    try:
        w.wait_ready()
        with Client(w.addr, timeout=120) as client:
            for tenant in ("h1", "h2"):
                client.generate("The quick brown fox jumps over the lazy dog.", mode="tr", tenant=tenant,
                                max_new_tokens=8)
        book = w.worker.histories
        book.flush()
        per = {t: n for _, t, n in book.memory()}
        assert set(per) == {"h1", "h2"} and book.get(decoder.fingerprint, "h1").documents == 1
        body = urllib.request.urlopen(f"http://127.0.0.1:{w.worker.metrics_port}/metrics", timeout=5).read().decode()
        assert f'trserve_history_tenant_memory_bytes{{fingerprint="{decoder.fingerprint}",tenant="h1"}}' in body
    finally:
        w.stop()
    blob = w.worker.store.side_state(SIDE_STATE, decoder.fingerprint, "h2")
    assert blob is not None and SuffixHistory.from_bytes(blob).documents == 1


@pytest.mark.redis
def test_kept_in_redis_across_stores_and_deleted_with_the_tenant(redis_prefix):
    from tests.services.matrix_helpers import REDIS_URL

    config = StoreConfig(redis_url=REDIS_URL, key_prefix=redis_prefix)
    first = MatrixStore(config)
    first.apply(SPEC, "acme", [5], [[1, 2, 3, 4]])  # the tenant exists (a matrix) beside its history
    book = HistoryBook(first)
    book.remember(SPEC.fingerprint, "acme", book.get(SPEC.fingerprint, "acme"), SECRET)
    book.close()
    first.close()
    second = MatrixStore(config)  # another worker (or a restart) on the same Redis
    assert HistoryBook(second).get(SPEC.fingerprint, "acme").propose(SECRET[:3], 2).tokens == SECRET[3:5]
    second.delete(SPEC.fingerprint, "acme")
    assert MatrixStore(config).side_state(SIDE_STATE, SPEC.fingerprint, "acme") is None
    second.close(final_snapshot=False)
