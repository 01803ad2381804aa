"""The matrix service against a real Redis: hot start, admin RPCs, corrupt snapshots, errors,
concurrency, Redis outages. Servers run on port 0 (in-process threads, or a `trserve matrix`
subprocess where a separate process is the point)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import grpc
import numpy as np
import pytest
import redis
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trserve.core.model_spec import ModelSpec
from trserve.engine.tr.draft import draft_tokens
from trserve.engine.tr.matrix import AdjacencyMatrix
from trserve.engine.tr.recycle import RecycledRows
from trserve.engine.tr.tree import TreeTemplate, get_compiled, load_template
from trserve.services.matrix.servicer import SERVICE_NAME
from trserve.services.matrix.sessions import plan_for
from trserve.services.worker.drafting.remote import RemoteDraftSource
from tests.helpers import wait_for
from tests.matrix_store.conftest import TcpProxy
from tests.services.matrix_helpers import (  # noqa: F401 - fixtures
    FP,
    REDIS_URL,
    K,
    V,
    channel_to,
    checkout,
    checkout_probs,
    model,
    push,
    random_rows,
    redis_prefix,
    ref,
    service_config,
    start_server,
)
from trserve.v1 import matrix_pb2 as pb

pytestmark = pytest.mark.redis
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_numpy_drafting_equals_engine_drafting() -> None:
    rng = np.random.default_rng(0)
    rows = rng.integers(0, V, (V, K)).astype(np.int32)  # [V, K]
    tree = get_compiled(load_template("paper"), "cpu", torch.float32)
    plan = plan_for(tree.template)
    for root in (0, 5, V - 1):
        expected = draft_tokens(torch.from_numpy(rows), root, tree)
        assert plan.draft(rows, root).tolist() == expected.tolist()
    assert plan.n == tree.n == 81


def test_health_is_serving_after_start_and_not_serving_after_stop(start_server) -> None:
    server = start_server()
    with grpc.insecure_channel(server.addr) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        server.stop(grace_s=1)
        with pytest.raises(grpc.RpcError):
            health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=2)


def test_hot_start_across_restart_and_in_a_new_process(start_server, channel_to, redis_prefix) -> None:
    first = start_server()
    stub = channel_to(first)
    rng = np.random.default_rng(1)
    for _ in range(5):
        push(stub, "acme", random_rows(rng))
    version, rows, probs = checkout_probs(stub, "acme")
    assert version == 5 and rows.any() and probs.any()
    first.stop(grace_s=1)  # graceful: final snapshots

    second = start_server()
    assert checkout(channel_to(second), "acme")[0] == 5
    got = checkout_probs(channel_to(second), "acme")
    assert np.array_equal(got[1], rows) and np.array_equal(got[2], probs)  # confidences came back from Redis
    second.stop(grace_s=1)

    proc = subprocess.Popen(
        [sys.executable, "-m", "trserve.services.cli", "matrix", "--host", "127.0.0.1", "--port", "0",
         "--redis-url", REDIS_URL, "--key-prefix", redis_prefix],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        line = proc.stdout.readline()
        port = int(re.search(r":(\d+)$", line.strip()).group(1))
        stub = channel_to(f"127.0.0.1:{port}")
        assert stub.Describe(ref("acme"), timeout=10).version == 5
        got_version, got_rows = checkout(stub, "acme")
        assert got_version == 5 and np.array_equal(got_rows, rows)
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0


def test_admin_rollback_fork_delete_and_cli(start_server, channel_to) -> None:
    server = start_server()
    stub = channel_to(server)
    rng = np.random.default_rng(2)
    push(stub, "t", random_rows(rng))
    assert stub.Snapshot(ref("t"), timeout=10).version == 1
    _, good, good_probs = checkout_probs(stub, "t")
    push(stub, "t", random_rows(rng))
    assert stub.Snapshot(ref("t"), timeout=10).version == 2
    assert list(stub.ListVersions(ref("t"), timeout=10).versions) == [1, 2]
    assert not np.array_equal(checkout_probs(stub, "t")[2], good_probs)

    assert stub.Rollback(pb.RollbackRequest(ref=ref("t"), version=1), timeout=10).version == 1
    version, rows, probs = checkout_probs(stub, "t")
    assert version == 1 and np.array_equal(rows, good) and np.array_equal(probs, good_probs)  # both rolled back
    assert list(stub.ListVersions(ref("t"), timeout=10).versions) == [1]
    assert _code(lambda: stub.Rollback(pb.RollbackRequest(ref=ref("t"), version=7), timeout=10))[0] == \
        grpc.StatusCode.NOT_FOUND

    assert stub.Fork(pb.ForkRequest(ref=ref("t"), to="t2"), timeout=10).version == 1
    assert np.array_equal(checkout(stub, "t2")[1], good) and np.array_equal(checkout_probs(stub, "t2")[2], good_probs)
    push(stub, "t2", random_rows(rng))  # the fork is independent of its source
    assert checkout(stub, "t")[0] == 1
    assert _code(lambda: stub.Fork(pb.ForkRequest(ref=ref("t"), to="t2"), timeout=10))[0] == \
        grpc.StatusCode.FAILED_PRECONDITION

    out = subprocess.run(
        [sys.executable, "-m", "trserve.services.cli", "matrix-admin", "describe", "--addr", server.addr,
         "--tenant", "t2", "--fingerprint", FP], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    described = json.loads(out.stdout)
    assert described["tenant"] == "t2" and described["version"] == 2 and described["fingerprint"] == FP
    assert described["nonzero_rows"] > 0 and described["last_snapshot_version"] == 1
    # the digest, epoch and memory the API has (issue 28, defect 8): the digest is the rows' own
    _, rows, probs = checkout_probs(stub, "t2")
    assert described["rows_sha256"] == hashlib.sha256(rows.astype("<i4").tobytes()).hexdigest()
    assert described["probs_sha256"] == hashlib.sha256(probs.tobytes()).hexdigest()
    assert described["epoch"] >= 0 and described["memory_bytes"] == rows.nbytes + probs.nbytes == V * K * 5

    stub.Delete(ref("t2"), timeout=10)
    assert _code(lambda: stub.Describe(ref("t2"), timeout=10))[0] == grpc.StatusCode.NOT_FOUND


def _admin(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trserve.services.cli", "matrix-admin", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_list_tenants_rpc_and_cli_and_the_default_fingerprint(start_server, channel_to) -> None:
    server = start_server()
    stub = channel_to(server)
    empty = _admin("describe", "--addr", server.addr, "--tenant", "acme")
    assert empty.returncode == 2 and "holds no tenants; pass --fingerprint" in empty.stderr
    rng = np.random.default_rng(4)
    push(stub, "acme", random_rows(rng))
    push(stub, "acme", random_rows(rng))
    stub.Snapshot(ref("acme"), timeout=10)
    push(stub, "globex", random_rows(rng), domain="legal")

    reply = stub.ListTenants(pb.ListTenantsRequest(), timeout=10)
    assert reply.redis == "ok" and [t.tenant for t in reply.tenants] == ["acme", "globex"]
    acme, globex = reply.tenants
    assert (acme.version, acme.in_memory, acme.memory_bytes, acme.last_snapshot_version) == (2, True, V * K * 5, 2)
    assert acme.nonzero_rows == int(checkout(stub, "acme")[1].any(axis=1).sum()) and 0 <= acme.last_snapshot_age_s < 30
    assert (globex.domain, globex.last_snapshot_version, globex.last_snapshot_age_s) == ("legal", -1, -1)

    out = _admin("list", "--addr", server.addr)
    assert out.returncode == 0, out.stderr
    listed = json.loads(out.stdout)
    assert listed["redis"] == "ok" and [t["tenant"] for t in listed["tenants"]] == ["acme", "globex"]
    assert listed["tenants"][1] | {"last_snapshot_age_s": None} == {
        "tenant": "globex", "fingerprint": FP, "domain": "legal", "version": 1, "in_memory": True,
        "nonzero_rows": listed["tenants"][1]["nonzero_rows"], "memory_bytes": V * K * 5, "history_bytes": 0,
        "last_snapshot_version": None, "last_snapshot_age_s": None,
    }
    table = _admin("list", "--addr", server.addr, "--table").stdout.splitlines()
    assert table[0].split() == ["tenant", "fingerprint", "version", "rows", "memory", "history", "snapshot", "age"]
    assert table[1].split()[:3] == ["acme", FP, "2"] and "MiB" in table[1]

    described = _admin("describe", "--addr", server.addr, "--tenant", "acme")  # the one model held
    assert described.returncode == 0, described.stderr
    assert json.loads(described.stdout)["fingerprint"] == FP
    push(stub, "initech", random_rows(rng, vocab_size=50), spec=model("other-fp", 50))
    ambiguous = _admin("describe", "--addr", server.addr, "--tenant", "acme")
    assert ambiguous.returncode == 2 and f"2 models: other-fp, {FP}; pass --fingerprint" in ambiguous.stderr
    only_other = _admin("list", "--addr", server.addr, "--fingerprint", "other-fp")
    assert [t["tenant"] for t in json.loads(only_other.stdout)["tenants"]] == ["initech"]
    assert "--tenant is required" in _admin("describe", "--addr", server.addr).stderr


def test_corrupt_snapshot_is_refused_and_previous_good_one_served(start_server, channel_to, redis_prefix) -> None:
    server = start_server()
    stub = channel_to(server)
    rng = np.random.default_rng(3)
    push(stub, "t", random_rows(rng))
    stub.Snapshot(ref("t"), timeout=10)
    good = checkout(stub, "t")[1]
    push(stub, "t", random_rows(rng))
    stub.Snapshot(ref("t"), timeout=10)
    server.stop(0, final_snapshot=False)

    client = redis.Redis.from_url(REDIS_URL)
    key = f"{redis_prefix}:snap:{FP}:t:2"
    client.setrange(key, client.strlen(key) - 12, b"\x00garbage\x00")
    client.close()

    stub = channel_to(start_server())
    version, rows = checkout(stub, "t")
    assert version == 1 and np.array_equal(rows, good)


def test_fingerprint_or_shape_mismatch_is_failed_precondition(start_server, channel_to) -> None:
    stub = channel_to(start_server())
    push(stub, "t", random_rows(np.random.default_rng(4)))
    wrong = model(vocab_size=V + 1)
    code, details = _code(lambda: push(stub, "t", random_rows(np.random.default_rng(5)), spec=wrong))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "served here as [V=1000, K=8]" in details
    opened = pb.DraftRequest(open=pb.DraftOpen(tenant="t", model=model(k=4), tree="x",
                                               tree_paths=[pb.TreePath(ranks=[0])]))
    code, _ = _code(lambda: list(stub.DraftSession(iter([opened]), timeout=10)))
    assert code == grpc.StatusCode.FAILED_PRECONDITION


def _draft(stub, open_msg: pb.DraftOpen, *steps: pb.DraftStep) -> list[pb.DraftReply]:
    requests = [pb.DraftRequest(open=open_msg)] + [pb.DraftRequest(step=s) for s in steps]
    return list(stub.DraftSession(iter(requests), timeout=10))


def _rows(tokens, topk) -> pb.RowBatch:
    return pb.RowBatch(tokens=np.asarray(tokens, "<i4").tobytes(), topk=np.asarray(topk, "<i4").tobytes())


OK_OPEN = pb.DraftOpen(tenant="t", model=model(), tree="paper")
BAD_INPUTS = {
    "tenant charset": (lambda s: push(s, "bad tenant!", random_rows(np.random.default_rng(0))), "1-64 characters"),
    "tenant colon": (lambda s: push(s, "a:b", random_rows(np.random.default_rng(0))), "1-64 characters"),
    "tenant too long": (lambda s: push(s, "x" * 65, random_rows(np.random.default_rng(0))), "1-64 characters"),
    "empty tenant": (lambda s: s.Describe(ref(""), timeout=10), "1-64 characters"),
    "bad domain": (lambda s: push(s, "t", random_rows(np.random.default_rng(0)), domain="d/1"), "domain id"),
    "k out of range": (lambda s: push(s, "t", _rows([1], [[1] * 65]), spec=model(k=65)), "1..64"),
    "wrong K rows": (lambda s: push(s, "t", _rows([1, 2], np.ones((2, 4)))), "K=8"),
    "token id >= vocab": (lambda s: push(s, "t", _rows([V], np.ones((1, K)))), f"[0, {V})"),
    "topk id >= vocab": (lambda s: push(s, "t", _rows([1], np.full((1, K), V + 5))), f"[0, {V})"),
    "negative id": (lambda s: push(s, "t", _rows([-1], np.ones((1, K)))), f"[0, {V})"),
    "mismatched lengths": (lambda s: push(s, "t", _rows([1, 2, 3], np.ones((2, K)))), "must match"),
    "ragged bytes": (lambda s: push(s, "t", pb.RowBatch(tokens=b"\x01\x00\x00", topk=b"")), "4 bytes per id"),
    "short probs": (lambda s: push(s, "t", pb.RowBatch(tokens=_rows([1], np.ones((1, K))).tokens,
                                                       topk=_rows([1], np.ones((1, K))).topk, probs=b"\x01" * (K - 1))),
                    f"{K} bytes"),
    "probs without rows": (lambda s: _draft(s, OK_OPEN, pb.DraftStep(rows=pb.RowBatch(probs=b"\x05"), root=3)),
                           "i.e. 0 bytes"),
    "long probs in a step": (lambda s: _draft(s, OK_OPEN, pb.DraftStep(rows=pb.RowBatch(
        tokens=_rows([1], np.ones((1, K))).tokens, topk=_rows([1], np.ones((1, K))).topk, probs=b"\x01" * (K + 1)),
        root=3)), "rows.probs"),
    "empty batch": (lambda s: push(s, "t", pb.RowBatch()), "1..4096 rows"),
    "oversized batch": (lambda s: push(s, "t", _rows(np.arange(5000) % V, np.ones((5000, K)))), "split larger"),
    "empty fingerprint": (lambda s: push(s, "t", _rows([1], np.ones((1, K))), spec=model(fingerprint="")),
                          "fingerprint"),
    "unknown tree": (lambda s: _draft(s, pb.DraftOpen(tenant="t", model=model(), tree="nope")), "'paper'"),
    "tree rank >= K": (lambda s: _draft(s, pb.DraftOpen(tenant="t", model=model(), tree="x",
                                                        tree_paths=[pb.TreePath(ranks=[9])])), "ranks < 8"),
    "tree without parent": (lambda s: _draft(s, pb.DraftOpen(tenant="t", model=model(), tree="x",
                                                             tree_paths=[pb.TreePath(ranks=[0, 0])])), "no parent"),
    "oversized tree": (lambda s: _draft(s, pb.DraftOpen(tenant="t", model=model(k=64), tree="x", tree_paths=[
        pb.TreePath(ranks=p) for p in [[i] for i in range(40)] + [[i, j] for i in range(40) for j in range(40)]
    ])), "at most 1024"),
    "reserved tenant": (lambda s: push(s, "_global", random_rows(np.random.default_rng(0))), "reserved"),
    "reserved domain": (lambda s: push(s, "t", random_rows(np.random.default_rng(0)), domain="_global"), "reserved"),
    "deep tree": (lambda s: _draft(s, pb.DraftOpen(tenant="t", model=model(), tree="x", tree_paths=[
        pb.TreePath(ranks=[0] * d) for d in range(1, 1001)])), "max_tree_depth"),
    "root >= vocab": (lambda s: _draft(s, OK_OPEN, pb.DraftStep(root=V)), "outside the vocabulary"),
    "step before open": (lambda s: list(s.DraftSession(iter([pb.DraftRequest(step=pb.DraftStep())]), timeout=10)),
                         "first DraftRequest"),
    "open twice": (lambda s: list(s.DraftSession(
        iter([pb.DraftRequest(open=OK_OPEN), pb.DraftRequest(open=OK_OPEN)]), timeout=10)), "only the first"),
    "bad chunk size": (lambda s: list(s.Checkout(pb.CheckoutRequest(tenant="t", model=model(),
                                                                    max_rows_per_chunk=10**6), timeout=10)), "0..65536"),
    "negative rollback": (lambda s: s.Rollback(pb.RollbackRequest(ref=ref("t"), version=-1), timeout=10), ">= 0"),
}


def test_bad_input_is_invalid_argument_with_an_actionable_message(start_server, channel_to) -> None:
    stub = channel_to(start_server())
    push(stub, "t", random_rows(np.random.default_rng(0)))
    for name, (call, message) in BAD_INPUTS.items():
        code, details = _code(lambda: call(stub))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
        assert message in details, (name, details)
    assert stub.Describe(ref("t"), timeout=10).version == 1  # nothing bad was applied


def test_message_above_the_transport_limit_is_refused_by_grpc(start_server, channel_to) -> None:
    stub = channel_to(start_server())
    huge = pb.RowBatch(tokens=b"\x00" * (5 << 20))
    code, _ = _code(lambda: push(stub, "t", huge))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_the_message_limit_is_what_the_flag_says(start_server, channel_to) -> None:
    """Issue 45: the limit was a fixed 4 MiB whatever a constant beside it said; now `--max-message-mb`
    sets it (default 4). A 5 MiB push is refused by gRPC at 4 MiB and reaches the handler (which
    refuses the malformed batch itself) at 8."""
    from trserve.services.cli import build_parser
    from trserve.services.matrix.cli import service_config as from_flags

    def flags(*extra: str):
        return from_flags(build_parser().parse_args(["matrix", "--port", "0", *extra]))

    assert flags().max_message_bytes == 4 << 20
    huge = pb.RowBatch(tokens=b"\x00" * (5 << 20))
    for extra, expected in (((), grpc.StatusCode.RESOURCE_EXHAUSTED),
                            (("--max-message-mb", "8"), grpc.StatusCode.INVALID_ARGUMENT)):
        code, details = _code(lambda: push(channel_to(start_server(flags(*extra))), "t", huge))
        assert code == expected, (extra, code, details)


def _session_worker(addr: str, tenant: str, tenant_index: int, steps: int, seed: int, errors: list) -> None:
    """One remote draft session writing rows only this tenant writes (values encode the tenant)."""
    try:
        tree = get_compiled(TreeTemplate.from_paths("t", [[0], [1], [0, 0]]), "cpu", torch.float32)
        source = RemoteDraftSource(addr, tenant)
        session = source.open(tree, ModelSpec(FP, V, K))
        rng = np.random.default_rng(seed)
        for _ in range(steps):
            tokens = torch.tensor(rng.choice(100, 6, replace=False) + 100 * tenant_index)
            topk = torch.full((6, K), 100 * tenant_index + int(rng.integers(100)), dtype=torch.int32)
            session.step(RecycledRows(tokens, topk), int(tokens[0]))
        session.close(None)
        assert session.info().mode == "remote", session.info()
        source.close()
    except Exception as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)


def test_concurrent_sessions_lose_no_batch_and_tenants_stay_isolated(start_server, channel_to) -> None:
    server = start_server()
    tenants = {"a": (0, 6), "b": (1, 2), "c": (2, 2)}  # tenant -> (index, concurrent sessions)
    steps, errors = 20, []
    threads = [threading.Thread(target=_session_worker, args=(server.addr, t, i, steps, 10 * i + s, errors))
               for t, (i, sessions) in tenants.items() for s in range(sessions)]
    pushers = [threading.Thread(target=lambda: [push(channel_to(server), "a", _rows([9], np.full((1, K), 9)))
                                                for _ in range(10)]) for _ in range(2)]
    for t in threads + pushers:
        t.start()
    for t in threads + pushers:
        t.join(timeout=60)
    assert not errors, errors
    stub = channel_to(server)
    for tenant, (index, sessions) in tenants.items():
        version, rows = checkout(stub, tenant)
        assert version == sessions * steps + (20 if tenant == "a" else 0)
        written = np.flatnonzero(rows.any(axis=1))
        own = (written // 100 == index) | (written == 9) if tenant == "a" else written // 100 == index
        assert own.all(), (tenant, written[~own])
        values = rows[written[written != 9]]
        assert ((values // 100) == index).all()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_redis_down_at_start_service_keeps_serving(start_server, channel_to, redis_prefix) -> None:
    config = service_config(redis_prefix, redis_url=f"redis://127.0.0.1:{_closed_port()}/0", redis_timeout_s=0.2)
    stub = channel_to(start_server(config))
    assert push(stub, "t", random_rows(np.random.default_rng(6))) == 1
    replies = _draft(stub, OK_OPEN, pb.DraftStep(rows=random_rows(np.random.default_rng(7)), root=3))
    assert replies[-1].version == 2 and len(replies[-1].tokens) == 81
    described = stub.Describe(ref("t"), timeout=10)
    assert described.redis == "failing" and described.version == 2
    assert _code(lambda: stub.Snapshot(ref("t"), timeout=10))[0] == grpc.StatusCode.UNAVAILABLE


def test_redis_dropped_mid_run_then_snapshots_resume(start_server, channel_to, redis_prefix) -> None:
    proxy = TcpProxy(("127.0.0.1", 6379))
    try:
        config = service_config(redis_prefix, redis_url=proxy.url, redis_timeout_s=0.2,
                                snapshot_every_versions=1, snapshot_every_s=0.2)
        server = start_server(config)
        stub = channel_to(server)
        rng = np.random.default_rng(8)
        push(stub, "t", random_rows(rng))
        wait_for(lambda: stub.Describe(ref("t"), timeout=10).last_snapshot_version == 1)
        proxy.cut()
        for _ in range(3):
            push(stub, "t", random_rows(rng))
        wait_for(lambda: stub.Describe(ref("t"), timeout=10).last_snapshot_error != "")
        described = stub.Describe(ref("t"), timeout=10)
        assert described.redis == "failing" and described.version == 4 and described.last_snapshot_version == 1
        rows = checkout(stub, "t")[1]
        proxy.restore()
        wait_for(lambda: stub.Describe(ref("t"), timeout=10).last_snapshot_version == 4)
        assert stub.Describe(ref("t"), timeout=10).redis == "ok"
        server.stop(0, final_snapshot=False)
        version, restored = checkout(channel_to(start_server()), "t")  # straight from Redis
        assert version == 4 and np.array_equal(restored, rows)
    finally:
        proxy.close()


def test_checkout_in_chunks_equals_the_store(start_server, channel_to) -> None:
    server = start_server()
    stub = channel_to(server)
    rng = np.random.default_rng(9)
    for _ in range(30):
        push(stub, "t", random_rows(rng, m=32))
    chunks = list(stub.Checkout(pb.CheckoutRequest(tenant="t", model=model(), max_rows_per_chunk=100), timeout=10))
    total = chunks[0].total_rows
    assert len(chunks) == -(-total // 100) and {c.version for c in chunks} == {30}
    version, rows = checkout(stub, "t")
    assert np.array_equal(rows, server.store.checkout(ModelSpec(FP, V, K), "t").rows)
    fresh = list(stub.Checkout(pb.CheckoutRequest(tenant="new", model=model()), timeout=10))
    assert len(fresh) == 1 and fresh[0].total_rows == 0 and fresh[0].source == "zeros"


def test_remote_client_matches_local_drafting_and_counts_fallbacks(start_server) -> None:
    server = start_server()
    tree = get_compiled(load_template("paper"), "cpu", torch.float32)
    source = RemoteDraftSource(server.addr, "t")
    session, local = source.open(tree, ModelSpec(FP, V, K)), AdjacencyMatrix(ModelSpec(FP, V, K))
    rng = np.random.default_rng(10)
    recycled, root = None, 1
    for _ in range(30):
        tokens = session.step(recycled, root)
        if recycled is not None:
            local.apply(recycled)
        assert torch.equal(tokens, local.draft(root, tree))
        recycled = RecycledRows(torch.tensor(rng.choice(V, 12, replace=False)),
                                torch.tensor(rng.integers(0, V, (12, K)), dtype=torch.int32))
        root = int(tokens[1])
    server.stop(0)  # dies mid-session: the session drafts from its mirror of the rows
    for _ in range(5):
        tokens = session.step(recycled, root)
        local.apply(recycled)
        assert torch.equal(tokens, local.draft(root, tree))
    assert session.info().mode == "local-fallback" and source.fallbacks == 1
    session.close(None)
    started = time.monotonic()
    assert source.open(tree, ModelSpec(FP, V, K)).info().mode == "local-fallback"  # breaker: no wait
    assert time.monotonic() - started < 0.5 and source.fallbacks == 2
    source.close()
