"""Tenants' suffix histories on the matrix service (GetHistory, PushHistory), and split workers
(replica and remote) drafting from them: what one worker's finished request taught reaches another worker of the same
tenant, never another tenant; admin list and /metrics report the bytes; bad pushes are refused
with the stored history unchanged. A real service on Redis, real gRPC, real replica and remote sources."""

from __future__ import annotations

import urllib.request

import grpc
import numpy as np
import pytest
import torch

from tests.helpers import wait_for
from tests.services.matrix_helpers import (  # noqa: F401 - fixtures
    FP,
    K,
    V,
    channel_to,
    model,
    push,
    random_rows,
    redis_prefix,
    service_config,
    start_server,
)
from trserve.core.model_spec import ModelSpec
from trserve.engine.tr.history import SuffixHistory
from trserve.engine.tr.tree import TreeTemplate, get_compiled
from trserve.services.common.matrix_convert import documents_to_pb
from trserve.services.worker.drafting.link import DraftClientConfig
from trserve.services.worker.drafting.remote import RemoteDraftSource
from trserve.services.worker.drafting.replica import ReplicaDraftSource
from trserve.v1 import matrix_pb2 as pb

pytestmark = pytest.mark.redis
SPEC = ModelSpec(FP, V, K)
TREE = TreeTemplate.from_paths("t", [[0], [1], [0, 0]])
SECRET = [int(t) for t in np.random.default_rng(7).integers(10, V, 40)]  # "alice's secret sentence"


def _history(stub, tenant: str) -> SuffixHistory:
    reply = stub.GetHistory(pb.HistoryRequest(tenant=tenant, model=model()), timeout=10)
    return SuffixHistory.from_bytes(reply.history) if reply.history else SuffixHistory()


def _leaks(history: SuffixHistory) -> bool:
    """Does `history` continue any 3..12-token piece of SECRET with SECRET's next token?"""
    for end in range(3, len(SECRET)):
        proposal = history.propose(SECRET[max(0, end - 12):end], 4)
        if proposal is not None and proposal.tokens[:1] == SECRET[end:end + 1]:
            return True
    return False


def test_pushed_history_is_served_to_its_tenant_only_and_reported(start_server, channel_to) -> None:
    config = service_config(None, redis_url=None)
    server = start_server(type(config)(host="127.0.0.1", port=0, store=config.store, metrics_port=0))
    stub = channel_to(server)
    push(stub, "alice", random_rows(np.random.default_rng(1)))
    push(stub, "bob", random_rows(np.random.default_rng(2)))
    reply = stub.PushHistory(pb.PushHistoryRequest(tenant="alice", model=model(),
                                                   documents=documents_to_pb([SECRET])), timeout=10)
    assert reply.tokens == len(SECRET) and reply.memory_bytes > 0

    alice = _history(stub, "alice")
    assert alice.documents == 1 and alice.propose(SECRET[:10], 8).tokens == SECRET[10:18]
    bob = stub.GetHistory(pb.HistoryRequest(tenant="bob", model=model()), timeout=10)
    assert bob.history == b"" and bob.tokens == 0  # nothing of alice's

    listed = {t.tenant: t for t in stub.ListTenants(pb.ListTenantsRequest(), timeout=10).tenants}
    assert listed["alice"].history_bytes == reply.memory_bytes and listed["bob"].history_bytes > 0  # bob's empty one
    assert stub.ListTenants(pb.ListTenantsRequest(), timeout=10).history_bytes >= reply.memory_bytes
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.running.metrics_port}/metrics", timeout=10).read().decode()
    assert f'trserve_history_tenant_memory_bytes{{fingerprint="{FP}",tenant="alice"}} {float(reply.memory_bytes)}' in text


def test_bad_history_pushes_are_refused_and_change_nothing(start_server, channel_to) -> None:
    server = start_server(service_config(None, redis_url=None, models=(SPEC,)))
    stub = channel_to(server)
    stub.PushHistory(pb.PushHistoryRequest(tenant="alice", model=model(), documents=documents_to_pb([SECRET])),
                     timeout=10)
    before = stub.GetHistory(pb.HistoryRequest(tenant="alice", model=model()), timeout=10).history

    def refused(request: pb.PushHistoryRequest) -> tuple[grpc.StatusCode, str]:
        with pytest.raises(grpc.RpcError) as err:
            stub.PushHistory(request, timeout=10)
        return err.value.code(), err.value.details()

    code, details = refused(pb.PushHistoryRequest(tenant="alice", model=model(),
                                                  documents=documents_to_pb([SECRET, [1, 2, V]])))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "documents[1]" in details and f"[0, {V})" in details
    code, details = refused(pb.PushHistoryRequest(tenant="alice", model=model(),
                                                  documents=[pb.TokenDocument(tokens=b"\x01\x02\x03")]))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "int32" in details
    code, _ = refused(pb.PushHistoryRequest(tenant="bad tenant!", model=model()))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, details = refused(pb.PushHistoryRequest(tenant="alice", model=model("other-model")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "not served" in details
    code, details = refused(pb.PushHistoryRequest(tenant="alice", model=model(),
                                                  documents=documents_to_pb([[1, 2, 3]] * 257)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "at most 256" in details
    assert stub.GetHistory(pb.HistoryRequest(tenant="alice", model=model()), timeout=10).history == before


def test_a_service_without_histories_says_so_and_replicas_stop_pushing(start_server, channel_to) -> None:
    base = service_config(None, redis_url=None)
    server = start_server(type(base)(host="127.0.0.1", port=0, store=base.store, history_bytes=0))
    stub = channel_to(server)
    with pytest.raises(grpc.RpcError) as err:
        stub.PushHistory(pb.PushHistoryRequest(tenant="alice", model=model(), documents=documents_to_pb([SECRET])),
                         timeout=10)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "--history-mb" in err.value.details()
    assert stub.GetHistory(pb.HistoryRequest(tenant="alice", model=model()), timeout=10).history == b""
    source = ReplicaDraftSource(server.addr, "alice")
    session = source.open(get_compiled(TREE, "cpu", torch.float32), SPEC)
    session.remember(SECRET)
    session.close(None)
    wait_for(lambda: not source.history.kept_by_service)
    assert source.history.history.documents == 1  # it still drafts from this worker's own requests
    source.close()


@pytest.mark.parametrize("source_cls", [ReplicaDraftSource, RemoteDraftSource], ids=["replica", "remote"])
def test_split_workers_share_a_tenants_history_through_the_service_and_never_across_tenants(
        start_server, channel_to, redis_prefix, source_cls) -> None:
    """Replica and remote workers alike (a remote one's trees come from the service, its history
    chains from its copy of the tenant's history)."""
    server = start_server()
    stub = channel_to(server)
    tree = get_compiled(TREE, "cpu", torch.float32)
    config = DraftClientConfig(history_refresh_s=0.01)
    worker_1 = source_cls(server.addr, "alice", config=config)
    session = worker_1.open(tree, SPEC)
    assert session.history is not None and session.history.documents == 0
    session.remember(SECRET)  # a finished request of alice's on worker 1
    session.close(None)
    wait_for(lambda: worker_1.history.pushed == 1)
    assert worker_1.history.history.documents == 1  # worker 1's own copy has it at once

    worker_2 = source_cls(server.addr, "alice", config=config)  # another worker, same tenant
    first = worker_2.open(tree, SPEC)  # never waits on the service: its first request drafts without
    assert first.history.documents == 0
    first.close(None)
    wait_for(lambda: worker_2.history.history.documents == 1)  # fetched by its pusher thread meanwhile
    on_2 = worker_2.open(tree, SPEC)
    assert _leaks(on_2.history) and on_2.history.propose(SECRET[:12], 6).tokens == SECRET[12:18]
    other = source_cls(server.addr, "bob", config=config)  # another tenant, on either worker
    on_other = other.open(tree, SPEC)
    on_other.remember([1, 2, 3, 4, 5, 6, 7, 8])  # bob's own request
    on_other.close(None)
    wait_for(lambda: other.history.pushed == 1)
    other.open(tree, SPEC).close(None)
    wait_for(lambda: other.history._fetched_at > 0 and not other.history._refresh_due)
    assert not _leaks(other.open(tree, SPEC).history) and not _leaks(_history(stub, "bob"))
    # the history is the store's side state: a new service on the same Redis serves it after a restart
    for source in (worker_1, worker_2, other):
        source.close()
    server.stop(0, final_snapshot=True)
    again = start_server()
    assert _leaks(_history(channel_to(again), "alice")) and not _leaks(_history(channel_to(again), "bob"))


def test_a_replica_catches_up_by_the_documents_added_since_its_last_fetch(start_server, channel_to) -> None:
    server = start_server()
    stub = channel_to(server)
    tree = get_compiled(TREE, "cpu", torch.float32)
    docs = [[int(t) for t in np.random.default_rng(20 + i).integers(10, V, 30)] for i in range(3)]
    config = DraftClientConfig(history_refresh_s=0.01)
    one, two = (ReplicaDraftSource(server.addr, "carol", config=config) for _ in range(2))

    def finish(source, doc, pushed):
        session = source.open(tree, SPEC)
        session.remember(doc)
        session.close(None)
        wait_for(lambda: source.history.pushed == pushed)

    finish(one, docs[0], 1)
    two.open(tree, SPEC).close(None)
    wait_for(lambda: two.history.fetches["whole"] == 1 and two.history.history.documents == 1)
    finish(two, docs[1], 1)  # in two's copy at once, and on the service
    finish(one, docs[2], 2)
    two.open(tree, SPEC).close(None)  # stale: its pusher catches up
    wait_for(lambda: two.history.fetches["delta"] >= 1 and two.history.history.documents == 3)
    copy = two.history.history
    assert two.history.fetches["whole"] == 1 and copy.documents == 3  # its own document not added twice
    for doc in docs:
        assert copy.propose(doc[:10], 5).tokens == doc[10:15]
    # the protocol itself: nothing new since the current version; a version the service never had: whole
    whole = stub.GetHistory(pb.HistoryRequest(tenant="carol", model=model()), timeout=10)
    now, epoch = whole.version, whole.epoch
    assert now == 3 and not whole.delta

    def since(version, at=epoch):
        return stub.GetHistory(pb.HistoryRequest(tenant="carol", model=model(), since_version=version,
                                                 since_epoch=at), timeout=10)

    same = since(now)
    assert same.delta and list(same.added) == [] and not same.history
    late = since(1)
    assert late.delta and [np.frombuffer(d.tokens, "<i4").tolist() for d in late.added] == docs[1:]  # push order
    for other in (since(now + 5), since(1, epoch + 1)):  # a version it never had; another history's epoch
        assert not other.delta and SuffixHistory.from_bytes(other.history).documents == 3
    for source in (one, two):
        source.close()
