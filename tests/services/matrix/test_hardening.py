"""Hardening of the matrix service against real servers on loopback (issue 15): served models,
memory bounds, reserved ids and domains, the admin credential, plaintext secrets, tree caps, and
a Delete during an open draft session. Each refusal is checked for its exact status code and
that the server keeps serving the next good request."""

from __future__ import annotations

import queue
import secrets

import grpc
import numpy as np
import pytest

from trserve.core.model_spec import ModelSpec
from trserve.matrix_store import StoreConfig
from trserve.services.common.security import SharedSecret, client_channel
from trserve.services.matrix.server import MatrixServiceConfig
from tests.services.matrix_helpers import (  # noqa: F401 - fixtures
    FP,
    K,
    ServerThread,
    V,
    channel_to,
    checkout,
    model,
    push,
    random_rows,
    redis_prefix,
    ref,
    service_config,
    start_server,
)
from trserve.v1 import matrix_pb2 as pb
from trserve.v1 import matrix_pb2_grpc as pb_grpc

RNG = np.random.default_rng(7)


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def _memory_server(**store: object) -> ServerThread:
    return ServerThread(MatrixServiceConfig(host="127.0.0.1", port=0, store=StoreConfig(**store)))  # type: ignore[arg-type]


@pytest.fixture
def servers():
    started: list[ServerThread] = []
    yield started
    for s in started:
        s.stop(0, final_snapshot=False)


def test_only_served_models_and_bounded_tenants_without_redis(servers, channel_to) -> None:
    server = _memory_server(models=(ModelSpec(FP, V, K),), max_tenants_in_memory=3)
    servers.append(server)
    stub = channel_to(server)
    huge = model(fingerprint="huge", vocab_size=100_000_000)
    code, details = _code(lambda: push(stub, "t", random_rows(RNG), spec=huge))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "not served" in details
    code, _ = _code(lambda: checkout(stub, "t", spec=model(fingerprint="other")))
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    for tenant in ("a", "b", "c"):
        assert push(stub, tenant, random_rows(RNG)) == 1
    for i in range(20):  # cycling tenant ids: reads create nothing, new writers are refused
        assert checkout(stub, f"cycle-{i}")[0] == 0
        code, details = _code(lambda: push(stub, f"cycle-{i}", random_rows(RNG)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_tenants_in_memory = 3" in details
    listed = stub.ListTenants(pb.ListTenantsRequest(), timeout=10)
    assert [t.tenant for t in listed.tenants] == ["a", "b", "c"]
    assert (listed.tenants_in_memory, listed.max_tenants_in_memory, listed.memory_bytes) == (3, 3, 3 * V * K * 5)
    assert list(listed.models) == [FP] and all(t.memory_bytes == V * K * 5 for t in listed.tenants)
    assert push(stub, "a", random_rows(RNG)) == 2  # still serving


def test_domains_are_their_own_namespace_and_reserved_ids_are_refused(servers, channel_to) -> None:
    open_server = _memory_server()
    servers.append(open_server)
    stub = channel_to(open_server)
    push(stub, "B", random_rows(RNG, m=64))  # tenant B's private rows
    reply = list(stub.Checkout(pb.CheckoutRequest(tenant="A", domain="B", model=model()), timeout=10))
    assert reply[0].source == "zeros" and reply[0].total_rows == 0  # "domain B" is not tenant B
    for call in (lambda: push(stub, "_global", random_rows(RNG)),
                 lambda: push(stub, "t", random_rows(RNG), domain="_domain.x"),
                 lambda: checkout(stub, "_domain.B")):
        assert _code(call)[0] == grpc.StatusCode.INVALID_ARGUMENT
    # without an admin secret nobody writes the matrix every new tenant inherits
    code, details = _code(lambda: stub.Fork(pb.ForkRequest(ref=ref("B"), to="_global"), timeout=10))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "admin secret" in details
    assert checkout(stub, "fresh")[1].any() == False  # noqa: E712 - _global untouched
    assert push(stub, "B", random_rows(RNG)) == 2


def test_admin_secret_is_separate_from_the_worker_secret(servers, channel_to) -> None:
    worker, admin = SharedSecret(secrets.token_urlsafe(24)), SharedSecret(secrets.token_urlsafe(24))
    server = ServerThread(MatrixServiceConfig(host="127.0.0.1", port=0, store=StoreConfig(),
                                              secret=worker, admin_secret=admin))
    servers.append(server)

    def stub(secret):
        return pb_grpc.MatrixServiceStub(client_channel(server.addr, None, secret))

    as_worker, as_admin, anonymous = stub(worker), stub(admin), stub(None)
    assert push(as_worker, "t", random_rows(RNG, m=8)) == 1
    for call in (lambda s: s.Delete(ref("t"), timeout=10),
                 lambda s: s.Fork(pb.ForkRequest(ref=ref("t"), to="_global"), timeout=10),
                 lambda s: s.ListTenants(pb.ListTenantsRequest(), timeout=10)):
        assert _code(lambda: call(as_worker))[0] == grpc.StatusCode.PERMISSION_DENIED
        assert _code(lambda: call(anonymous))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert _code(lambda: push(anonymous, "t", random_rows(RNG)))[0] == grpc.StatusCode.UNAUTHENTICATED
    assert as_admin.Fork(pb.ForkRequest(ref=ref("t"), to="_domain.legal"), timeout=10).version == 1
    assert as_admin.Fork(pb.ForkRequest(ref=ref("t"), to="_global"), timeout=10).version == 1
    _, inherited = checkout(as_worker, "new")
    _, source_rows = checkout(as_worker, "t")
    assert np.array_equal(inherited, source_rows)  # the operator set _global
    chunk = next(iter(as_worker.Checkout(pb.CheckoutRequest(tenant="n2", domain="legal", model=model()), timeout=10)))
    assert chunk.source == "domain"
    as_admin.Delete(ref("t"), timeout=10)
    assert push(as_worker, "u", random_rows(RNG)) == 1  # still serving


def test_a_secret_is_never_sent_in_plaintext_to_another_host() -> None:
    secret = SharedSecret("s" * 20)
    with pytest.raises(ValueError, match="without TLS"):
        client_channel("10.1.2.3:50052", None, secret)
    client_channel("10.1.2.3:50052", None, secret, allow_plaintext_secret=True).close()
    client_channel("127.0.0.1:50052", None, secret).close()
    client_channel("localhost:50052", None, secret).close()
    client_channel("10.1.2.3:50052", None, None).close()  # no secret: nothing to leak
    from trserve.services.worker.drafting.link import DraftClientConfig
    from trserve.services.worker.drafting.split import SplitConfig

    with pytest.raises(ValueError, match="without TLS"):  # a split worker refuses to start
        SplitConfig("matrix.internal:50052", client=DraftClientConfig(secret=secret))
    SplitConfig("matrix.internal:50052", client=DraftClientConfig(secret=secret, allow_plaintext_secret=True))


def test_delete_during_an_open_draft_session_is_not_undone(start_server, channel_to) -> None:
    stub = channel_to(start_server())
    push(stub, "t", random_rows(RNG))
    q: queue.SimpleQueue = queue.SimpleQueue()
    q.put(pb.DraftRequest(open=pb.DraftOpen(tenant="t", model=model(), tree="paper")))
    call = stub.DraftSession(iter(q.get, None), timeout=20)
    opened = next(call)
    assert opened.version == 1 and opened.epoch > 0
    q.put(pb.DraftRequest(step=pb.DraftStep(rows=random_rows(RNG), root=1)))
    assert next(call).version == 2
    stub.Delete(ref("t"), timeout=10)
    q.put(pb.DraftRequest(step=pb.DraftStep(rows=random_rows(RNG), root=1)))
    with pytest.raises(grpc.RpcError) as refused:
        next(call)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "deleted after this session opened" in refused.value.details()
    q.put(None)
    assert [t.tenant for t in stub.ListTenants(pb.ListTenantsRequest(), timeout=10).tenants] == []
    stale = pb.PushRowsRequest(tenant="t", model=model(), rows=random_rows(RNG), since_epoch=opened.epoch)
    assert _code(lambda: stub.PushRows(stale, timeout=10))[0] == grpc.StatusCode.FAILED_PRECONDITION
    assert push(stub, "t", random_rows(RNG)) == 1  # a new session may create it again


def test_a_step_on_a_tenant_evicted_mid_session_reloads_it_off_the_loop(start_server, channel_to) -> None:
    server = start_server(max_tenants_in_memory=1)
    stub = channel_to(server)
    q: queue.SimpleQueue = queue.SimpleQueue()
    q.put(pb.DraftRequest(open=pb.DraftOpen(tenant="a", model=model(), tree="paper")))
    call = stub.DraftSession(iter(q.get, None), timeout=20)
    assert next(call).version == 0  # opening creates nothing
    rows = random_rows(RNG)
    q.put(pb.DraftRequest(step=pb.DraftStep(rows=rows, root=1)))  # the first write creates "a" (in a thread)
    assert next(call).version == 1
    assert push(stub, "b", random_rows(RNG)) == 1  # "a" is snapshotted to Redis and evicted to make room
    assert [t.tenant for t in stub.ListTenants(pb.ListTenantsRequest(), timeout=10).tenants if t.in_memory] == ["b"]
    q.put(pb.DraftRequest(step=pb.DraftStep(rows=random_rows(RNG), root=1)))
    assert next(call).version == 2  # NotLoaded on the loop -> reloaded from Redis in a thread
    q.put(None)
    assert stub.Describe(ref("a"), timeout=10).version == 2


def test_memory_per_tenant_is_exported_on_metrics(servers, promtool) -> None:
    import subprocess
    import urllib.request

    config = MatrixServiceConfig(host="127.0.0.1", port=0, store=StoreConfig(max_tenants_in_memory=4), metrics_port=0)
    server = ServerThread(config)
    servers.append(server)
    with grpc.insecure_channel(server.addr) as channel:
        stub = pb_grpc.MatrixServiceStub(channel)
        push(stub, "a", random_rows(RNG))
        push(stub, "b", random_rows(RNG))
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.running.metrics_port}/metrics", timeout=10).read().decode()
    assert f'trserve_matrix_tenant_memory_bytes{{fingerprint="{FP}",tenant="a"}} {float(V * K * 5)}' in text
    assert f"trserve_matrix_memory_bytes {float(2 * V * K * 5)}" in text
    assert "trserve_matrix_tenants_in_memory 2.0" in text and "trserve_matrix_max_tenants_in_memory 4.0" in text
    lint = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert lint.returncode == 0 and not lint.stdout.strip() and not lint.stderr.strip(), lint.stdout + lint.stderr


class _SlowProxy:
    """Forwards a local port to Redis; while `delay_s` > 0 every reply from Redis waits that long
    (a slow Redis, e.g. a big snapshot being reloaded over a busy link)."""

    def __init__(self) -> None:
        import socket
        import threading

        self.delay_s = 0.0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"redis://127.0.0.1:{self._listener.getsockname()[1]}/0"
        self._socket, self._threading = socket, threading
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            upstream = self._socket.create_connection(("127.0.0.1", 6379))
            for a, b, slow in ((client, upstream, False), (upstream, client, True)):
                self._threading.Thread(target=self._pipe, args=(a, b, slow), daemon=True).start()

    def _pipe(self, src, dst, slow: bool) -> None:
        import time

        try:
            while data := src.recv(65536):
                if slow and self.delay_s:
                    time.sleep(self.delay_s)
                dst.sendall(data)
        except OSError:
            pass

    def close(self) -> None:
        self._listener.close()


def test_a_slow_reload_mid_session_does_not_stall_other_sessions(redis_prefix, channel_to) -> None:
    import threading
    import time

    proxy = _SlowProxy()
    server = ServerThread(service_config(redis_prefix, redis_url=proxy.url, max_tenants_in_memory=2,
                                         redis_timeout_s=5.0))
    try:
        stub = channel_to(server)

        def session(tenant: str):
            q: queue.SimpleQueue = queue.SimpleQueue()
            q.put(pb.DraftRequest(open=pb.DraftOpen(tenant=tenant, model=model(), tree="paper")))
            call = stub.DraftSession(iter(q.get, None), timeout=60)
            next(call)

            def step() -> pb.DraftReply:
                q.put(pb.DraftRequest(step=pb.DraftStep(rows=random_rows(RNG), root=1)))
                return next(call)
            return step, lambda: q.put(None)

        hot, end_hot = session("hot")
        cold, end_cold = session("cold")
        hot(), cold()  # both created and in memory
        push(stub, "other", random_rows(RNG))  # "cold" (least recently used) is snapshotted and evicted
        hot()
        proxy.delay_s = 0.3  # every Redis reply now takes 0.3 s: reloading "cold" takes seconds
        done, outcome = threading.Event(), []

        def reload_cold() -> None:
            try:
                outcome.append(cold().version)
            except grpc.RpcError as exc:
                outcome.append(exc.code())
            finally:
                done.set()

        started_reload = time.monotonic()
        threading.Thread(target=reload_cold, daemon=True).start()
        time.sleep(0.2)
        worst = 0.0
        while not done.is_set():
            started = time.monotonic()
            hot()  # in memory: answered on the event loop while "cold" reloads in a thread
            worst = max(worst, time.monotonic() - started)
            time.sleep(0.05)
        reload_s = time.monotonic() - started_reload
        assert outcome == [2] and reload_s > 1.0  # "cold" came back from Redis, slowly
        assert worst < 0.3, f"a step of an in-memory tenant took {worst:.2f} s while another tenant reloaded"
        end_hot(), end_cold()
    finally:
        server.stop(0, final_snapshot=False)
        proxy.close()


def test_an_open_service_beyond_loopback_needs_a_model_list_or_a_secret(tmp_path) -> None:
    """Issue 28, defect 2: without --model, a service serves the first `max_models` models anyone names.
    Listening beyond loopback with neither a model list nor the workers' secret is refused at start
    (where the operator has accepted an open port at all, --insecure-no-secret)."""
    import subprocess
    import sys
    from pathlib import Path

    store = StoreConfig()
    with pytest.raises(ValueError, match="stranger could lock your model out"):
        MatrixServiceConfig(host="0.0.0.0", port=0, store=store, insecure_no_secret=True)
    secret = SharedSecret(secrets.token_urlsafe(24))
    for fine in (dict(host="127.0.0.1"), dict(host="::1"), dict(host="0.0.0.0", secret=secret),
                 dict(host="0.0.0.0", open_registration=True, insecure_no_secret=True),
                 dict(host="0.0.0.0", store=StoreConfig(models=(ModelSpec(FP, V, K),)), insecure_no_secret=True)):
        MatrixServiceConfig(**{"port": 0, "store": store, **fine})  # type: ignore[arg-type]

    repo = Path(__file__).resolve().parents[3]
    run = subprocess.run([sys.executable, "-m", "trserve.services.cli", "matrix", "--host", "0.0.0.0", "--port", "0",
                          "--insecure-no-secret"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--model" in run.stderr and "--open-registration" in run.stderr, run.stderr


def test_a_service_beyond_loopback_needs_the_workers_secret() -> None:
    """Issue 45, defect 5: a matrix service on 0.0.0.0 without a secret handed any peer every tenant's
    history (recent prompts and outputs) and matrix. Beyond loopback it now needs --secret-file, or
    --insecure-no-secret said out loud; a model list does not make it safe."""
    import subprocess
    import sys
    from pathlib import Path

    served = StoreConfig(models=(ModelSpec(FP, V, K),))
    for host in ("0.0.0.0", "::", "10.1.2.3", "matrix.internal"):
        with pytest.raises(ValueError, match="every tenant's matrix and history") as refused:
            MatrixServiceConfig(host=host, port=0, store=served)
        assert "--secret-file" in str(refused.value) and "--insecure-no-secret" in str(refused.value)
    MatrixServiceConfig(host="localhost", port=0, store=served)
    repo = Path(__file__).resolve().parents[3]
    run = subprocess.run([sys.executable, "-m", "trserve.services.cli", "matrix", "--host", "0.0.0.0", "--port", "0",
                          "--model", f"{FP}:{V}:{K}"], cwd=repo, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--secret-file" in run.stderr, run.stderr


def test_a_service_with_a_model_list_never_admits_another_model(servers, channel_to) -> None:
    """The squatter's push is FAILED_PRECONDITION, the served model's push is applied, and the
    squatter's model is not in the list afterwards."""
    served = ModelSpec(FP, V, K)
    server = _memory_server(models=(served,))
    servers.append(server)
    stub = channel_to(server)
    squatter = pb.ModelSpec(fingerprint="junk", vocab_size=64, k=K)
    code, details = _code(lambda: push(stub, "squatter", random_rows(RNG, 2, vocab_size=64), squatter))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "not served" in details, details
    assert push(stub, "t", random_rows(RNG, 4)) == 1
    assert list(stub.ListTenants(pb.ListTenantsRequest(), timeout=10).models) == [FP]
