"""A matrix service that answers Checkout with malformed rows (issue 28, defect 3), or with probs of
the wrong length: a replica worker drafts locally ("local-fallback") and the caller's request
succeeds with the plain-decoding ids; it is never INTERNAL or INVALID_ARGUMENT, the next request is
served, and nothing of the malformed reply is kept or pushed back."""

from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np
import pytest

from trserve_client import Client
from trserve.services.common.matrix_convert import rows_to_pb
from trserve.services.worker.config import WorkerConfig
from trserve.services.worker.drafting.link import DraftClientConfig
from trserve.services.worker.drafting.replica import ReplicaDraftSource
from tests.services.worker_harness import serving
from trserve.v1 import matrix_pb2 as mpb
from trserve.v1 import matrix_pb2_grpc

PROMPT = [{"role": "user", "content": "Name three rivers in Europe."}]


class _Hostile(matrix_pb2_grpc.MatrixServiceServicer):
    """Checkout replies that break the API's contract, one kind per server."""

    def __init__(self, kind: str, vocab_size: int, k: int) -> None:
        self.kind, self.v, self.k = kind, vocab_size, k
        self.pushes = 0

    def Checkout(self, request, context):
        tokens = np.array([5, 6], np.int32)
        topk = np.ones((2, self.k), np.int32)
        if self.kind == "row index >= V":
            tokens = np.array([5, self.v + 100], np.int32)
        elif self.kind == "successor id >= V":
            topk[1, 3] = self.v
        rows = rows_to_pb(tokens, topk)
        if self.kind == "top-k width":
            rows = rows_to_pb(tokens, np.ones((2, self.k + 3), np.int32))
        elif self.kind == "probs length":  # ids fine, one confidence byte short
            rows.probs = b"\x80" * (2 * self.k - 1)
        yield mpb.CheckoutChunk(version=3, total_rows=2, rows=rows, epoch=1)

    def PushRows(self, request, context):
        self.pushes += 1
        return mpb.PushRowsReply(version=4)


KINDS = ["row index >= V", "successor id >= V", "top-k width", "probs length"]


def test_malformed_probs_in_a_checkout_are_never_kept_nor_pushed() -> None:
    """No model needed: the replica session drafts from zeros, and its rows never reach the service."""
    import torch

    from trserve.core.model_spec import ModelSpec
    from trserve.engine.tr.recycle import RecycledRows
    from trserve.engine.tr.tree import TreeTemplate, get_compiled

    hostile = _Hostile("probs length", 1000, 8)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    matrix_pb2_grpc.add_MatrixServiceServicer_to_server(hostile, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    source = ReplicaDraftSource(f"127.0.0.1:{port}", "acme", None, DraftClientConfig(retry_after_s=0.01))
    try:
        session = source.open(get_compiled(TreeTemplate.from_paths("t", [[0], [1]]), "cpu", torch.float32),
                              ModelSpec("fp", 1000, 8))
        assert session.info().mode == "local-fallback" and source.fallbacks == 1
        assert not session.matrix.rows.any() and not session.matrix.probs.any()  # nothing of the reply kept
        recycled = RecycledRows(torch.tensor([5]), torch.ones((1, 8), dtype=torch.int32),
                                torch.full((1, 8), 9, dtype=torch.uint8))
        session.step(recycled, 5)
        session.close(recycled)
        assert hostile.pushes == 0
    finally:
        source.close()
        server.stop(0)


@pytest.fixture(scope="module", params=KINDS)
def hostile(request, decoder):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    matrix_pb2_grpc.add_MatrixServiceServicer_to_server(_Hostile(request.param, decoder.vocab_size, decoder.config.k),
                                                        server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


def test_malformed_checkout_falls_back_to_local_drafting(decoder, hostile) -> None:
    config = DraftClientConfig(retry_after_s=0.01)
    sources: dict[tuple, ReplicaDraftSource] = {}

    def factory(tenant, domain):
        if (tenant, domain) not in sources:
            sources[tenant, domain] = ReplicaDraftSource(hostile, tenant, domain, config)
        return sources[tenant, domain]

    try:
        for worker in serving(WorkerConfig(port=0, metrics_port=None, warmup=False), decoder,
                              draft_source_factory=factory):
            with Client(worker.addr, timeout=120) as client:
                want = list(client.generate(messages=PROMPT, mode="ar", max_new_tokens=16, return_token_ids=True).token_ids)
                for _ in range(2):  # and the next request is served too
                    r = client.generate(messages=PROMPT, mode="tr", tenant="acme", max_new_tokens=16,
                                        return_token_ids=True)
                    assert list(r.token_ids) == want
                    assert r.stats.draft_mode == "local-fallback"
    finally:
        for source in sources.values():
            source.close()


@pytest.mark.parametrize("mode", ["replica", "remote"])
def test_a_matrix_service_serving_other_models_leaves_requests_served(decoder, mode) -> None:
    """Issue 28, defect 2: a matrix service whose model list lacks the worker's model (or that a
    stranger filled first) failed every TR request with FAILED_PRECONDITION; the worker drafts
    locally instead, each request complete and exact, and counts the fallback."""
    from trserve.core.model_spec import ModelSpec
    from trserve.matrix_store import StoreConfig
    from trserve.services.matrix.server import MatrixServiceConfig
    from trserve.services.worker.drafting.link import fallback_count
    from trserve.services.worker.drafting.remote import RemoteDraftSource
    from tests.services.matrix_helpers import ServerThread

    other = ModelSpec("someone-elses-model", 1000, decoder.config.k)
    matrix = ServerThread(MatrixServiceConfig(host="127.0.0.1", port=0, store=StoreConfig(models=(other,))))
    cls = ReplicaDraftSource if mode == "replica" else RemoteDraftSource
    source = cls(matrix.addr, "acme", None, DraftClientConfig(retry_after_s=0.01))
    before = fallback_count()
    try:
        for worker in serving(WorkerConfig(port=0, metrics_port=None, warmup=False), decoder,
                              draft_source_factory=lambda tenant, domain: source):
            with Client(worker.addr, timeout=120) as client:
                want = list(client.generate(messages=PROMPT, mode="ar", max_new_tokens=16, return_token_ids=True).token_ids)
                for _ in range(2):
                    r = client.generate(messages=PROMPT, mode="tr", tenant="acme", max_new_tokens=16,
                                        return_token_ids=True)
                    assert list(r.token_ids) == want and r.stats.draft_mode == "local-fallback"
        assert fallback_count() >= before + 2
    finally:
        source.close()
        matrix.stop(0, final_snapshot=False)


def test_a_full_embedded_store_logs_once_per_interval_and_serves_every_tenant(decoder, caplog) -> None:
    """Issue 28, defect 8: once the embedded store holds its bound of tenants, every new tenant's
    request logged an ERROR with a traceback; now one line per interval, and each request is served
    (drafting locally, counted as a fallback)."""
    import logging

    from trserve.core.model_spec import ModelSpec
    from trserve.matrix_store import MatrixStore, StoreConfig
    from trserve.services.worker.drafting.embedded import embedded_factory

    store = MatrixStore(StoreConfig(max_tenants_in_memory=2))
    spec = ModelSpec(decoder.fingerprint, decoder.vocab_size, decoder.config.k)
    try:
        for worker in serving(WorkerConfig(port=0, metrics_port=None, warmup=False), decoder,
                              draft_source_factory=embedded_factory(store, spec, decoder.device)):
            with Client(worker.addr, timeout=120) as client, caplog.at_level(logging.INFO):
                modes = [client.generate(messages=PROMPT, mode="tr", tenant=f"t{i}", max_new_tokens=4).stats.draft_mode
                         for i in range(8)]
    finally:
        store.close()
    assert modes[:2] == ["embedded", "embedded"] and set(modes[2:]) == {"local-fallback"}
    store_lines = [r for r in caplog.records if r.name == "trserve.worker" and "matrix" in r.getMessage()
                   and "failed for tenant" in r.getMessage()]
    assert 1 <= len(store_lines) <= 2, [r.getMessage() for r in store_lines]  # checkout and/or apply: once each
    assert all(r.exc_info is None and r.levelno == logging.WARNING for r in store_lines)
