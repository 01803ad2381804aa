"""Security: per-tenant bearer tokens on a worker, a shared secret on the matrix service, TLS on
both, with a self-signed certificate made here by the openssl CLI. Real servers on port 0."""

from __future__ import annotations

import functools
import json
import secrets
import subprocess
import sys

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from trserve.matrix_store import StoreConfig
from trserve.services.cli import build_parser
from trserve_client import BalancedClient
from trserve.services.common.security import ServerTLS, SharedSecret, TenantTokens, client_channel
from trserve.services.matrix.server import MatrixServiceConfig
from trserve.services.node.cli import build_configs
from trserve.services.worker.config import Limits, WorkerConfig
from trserve.services.worker.drafting.link import DraftClientConfig
from trserve.services.worker.drafting.remote import RemoteDraftSource
from tests.conftest import REPO
from tests.services.cluster_helpers import self_signed
from tests.services.matrix_helpers import ServerThread, model, random_rows
from tests.services.worker_harness import serving
from trserve.v1 import generate_pb2 as gpb
from trserve.v1 import generate_pb2_grpc, matrix_pb2_grpc
from trserve.v1 import matrix_pb2 as mpb

HI = [{"role": "user", "content": "Say hello."}]
TOKENS = {"acme": secrets.token_urlsafe(24), "globex": [secrets.token_urlsafe(24), secrets.token_urlsafe(24)],
          "initech": {"tokens": [secrets.token_urlsafe(24)], "domains": ["legal"]}}


@pytest.fixture(scope="module")
def tls(tmp_path_factory) -> ServerTLS:
    return self_signed(tmp_path_factory.mktemp("tls"))


@pytest.fixture(scope="module")
def worker(decoder, tls):
    config = WorkerConfig(port=0, metrics_port=None, limits=Limits(default_max_new_tokens=8), tls=tls,
                          tenant_tokens=TenantTokens.from_mapping(TOKENS))
    yield from serving(config, decoder)


def call_code(stub_call, *args, **kwargs) -> grpc.StatusCode:
    try:
        result = stub_call(*args, **kwargs)
        if not isinstance(result, gpb.GenerateResponse | gpb.ModelInfoResponse):
            list(result)  # a stream: the status comes with its end
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


# -- tenant tokens on a TLS worker ---------------------------------------------------------------------
def test_worker_refuses_missing_wrong_and_foreign_tokens(worker, tls) -> None:
    with client_channel(worker.addr, tls.cert_file) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        acme = gpb.GenerateRequest(tenant="acme", text="Hi", max_new_tokens=2)
        bearer = lambda token: (("authorization", f"Bearer {token}"),)  # noqa: E731
        for rpc in (stub.Generate, stub.GenerateStream):
            assert call_code(rpc, acme, timeout=30) == grpc.StatusCode.UNAUTHENTICATED
            assert call_code(rpc, acme, timeout=30, metadata=bearer("not-a-token")) == grpc.StatusCode.UNAUTHENTICATED
            foreign = bearer(TOKENS["globex"][1])
            assert call_code(rpc, acme, timeout=30, metadata=foreign) == grpc.StatusCode.PERMISSION_DENIED
            default_tenant = gpb.GenerateRequest(text="Hi", max_new_tokens=2)  # no tenant = "default"
            assert call_code(rpc, default_tenant, timeout=30, metadata=bearer(TOKENS["acme"])) == \
                grpc.StatusCode.PERMISSION_DENIED
            assert call_code(rpc, acme, timeout=30, metadata=bearer(TOKENS["acme"])) == grpc.StatusCode.OK
        info = gpb.ModelInfoRequest()
        assert call_code(stub.ModelInfo, info, timeout=30) == grpc.StatusCode.UNAUTHENTICATED
        assert call_code(stub.ModelInfo, info, timeout=30, metadata=bearer(TOKENS["globex"][0])) == grpc.StatusCode.OK
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token


def test_a_domain_must_be_granted_to_the_tokens_tenant(worker, tls) -> None:
    bearer = lambda token: (("authorization", f"Bearer {token}"),)  # noqa: E731
    with client_channel(worker.addr, tls.cert_file) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        initech = bearer(TOKENS["initech"]["tokens"][0])
        for rpc in (stub.Generate, stub.GenerateStream):
            foreign = gpb.GenerateRequest(tenant="initech", domain="acme", text="Hi", max_new_tokens=2)
            assert call_code(rpc, foreign, timeout=30, metadata=initech) == grpc.StatusCode.PERMISSION_DENIED
            ungranted = gpb.GenerateRequest(tenant="acme", domain="legal", text="Hi", max_new_tokens=2)
            assert call_code(rpc, ungranted, timeout=30, metadata=bearer(TOKENS["acme"])) == \
                grpc.StatusCode.PERMISSION_DENIED
            reserved = gpb.GenerateRequest(tenant="initech", domain="_global", text="Hi", max_new_tokens=2)
            assert call_code(rpc, reserved, timeout=30, metadata=initech) in (grpc.StatusCode.PERMISSION_DENIED,
                                                                             grpc.StatusCode.INVALID_ARGUMENT)
            granted = gpb.GenerateRequest(tenant="initech", domain="legal", text="Hi", max_new_tokens=2)
            assert call_code(rpc, granted, timeout=30, metadata=initech) == grpc.StatusCode.OK


def test_balanced_client_sends_each_tenants_token_over_tls(worker, tls) -> None:
    tokens = {"acme": TOKENS["acme"], "globex": TOKENS["globex"][1]}
    with BalancedClient([worker.addr], timeout=60, tokens=tokens, tls_ca_file=tls.cert_file) as client:
        for tenant in tokens:
            assert client.generate(messages=HI, tenant=tenant, max_new_tokens=4).stats.generated_tokens > 0
        with pytest.raises(grpc.RpcError) as denied:
            client.generate(messages=HI, tenant="initech", max_new_tokens=4)  # no token for it
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_generate_cli_with_token_file_and_tls(worker, tls, tmp_path) -> None:
    """`trserve generate --token-file F --tls-ca CA` as a process of its own, as a user runs it."""
    token = tmp_path / "acme.token"
    token.write_text(TOKENS["acme"] + "\n")
    args = [sys.executable, "-m", "trserve.services.cli", "generate", "--addr", worker.addr, "--tls-ca", tls.cert_file,
            "--token-file", str(token), "--max-new-tokens", "4", "Hi"]
    run = functools.partial(subprocess.run, cwd=REPO, capture_output=True, text=True, timeout=60)
    ok = run([*args, "--tenant", "acme"])
    assert ok.returncode == 0 and "tokens in" in ok.stderr and ok.stdout.strip(), ok.stderr
    foreign = run([*args, "--tenant", "globex"])
    assert foreign.returncode == 1 and "PERMISSION_DENIED" in foreign.stderr


def test_plaintext_client_cannot_talk_to_a_tls_worker(worker) -> None:
    with grpc.insecure_channel(worker.addr) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        assert call_code(stub.ModelInfo, gpb.ModelInfoRequest(), timeout=5) == grpc.StatusCode.UNAVAILABLE


def test_token_file_and_flags_say_what_is_wrong(tmp_path) -> None:
    for mapping, message in (({"acme": "short"}, "at least 16"), ({"a:b": "x" * 20}, "invalid"),
                             ({"a": "x" * 20, "b": ["x" * 20]}, "share a token"), ([], "JSON object")):
        path = tmp_path / "tokens.json"
        path.write_text(json.dumps(mapping))
        with pytest.raises(ValueError, match=message):
            TenantTokens.from_file(path)
    with pytest.raises(ValueError, match="at least 16"):
        SharedSecret("too-short")
    assert "s3cret" not in repr(SharedSecret("s3cret" * 4))
    args = build_parser().parse_args(["serve", "--tls-cert", str(tmp_path / "cert.pem")])
    with pytest.raises(ValueError, match="go together"):
        build_configs(args)


# -- the matrix service's shared secret, over TLS ------------------------------------------------------
@pytest.fixture(scope="module")
def secret() -> SharedSecret:
    return SharedSecret(secrets.token_urlsafe(24))


@pytest.fixture(scope="module")
def matrix(tls, secret):
    config = MatrixServiceConfig(host="127.0.0.1", port=0, store=StoreConfig(), tls=tls, secret=secret)
    server = ServerThread(config)
    yield server
    server.stop(0, final_snapshot=False)


def test_matrix_service_requires_the_shared_secret(matrix, tls, secret) -> None:
    rows = random_rows(np.random.default_rng(0))
    push = mpb.PushRowsRequest(tenant="t", model=model(), rows=rows)
    for given in (None, SharedSecret("x" * 20)):
        with client_channel(matrix.addr, tls.cert_file, given) as channel:
            with pytest.raises(grpc.RpcError) as refused:
                matrix_pb2_grpc.MatrixServiceStub(channel).PushRows(push, timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    with client_channel(matrix.addr, tls.cert_file, secret) as channel:
        assert matrix_pb2_grpc.MatrixServiceStub(channel).PushRows(push, timeout=10).version == 1


def test_a_worker_refused_by_the_matrix_service_reports_not_serving(matrix, tls, secret, caplog) -> None:
    import asyncio

    from trserve.services.worker.drafting.split import MatrixServiceSources, SplitConfig, watch_matrix_auth

    def watch(given: SharedSecret) -> list[bool]:
        sources = MatrixServiceSources(SplitConfig(matrix.addr, client=DraftClientConfig(tls_ca_file=tls.cert_file,
                                                                                          secret=given)))
        states: list[bool] = []

        async def record(ok: bool) -> None:
            states.append(ok)

        async def run() -> None:
            task = asyncio.create_task(watch_matrix_auth(sources, record, every_s=0.05))
            await asyncio.sleep(0.5)
            task.cancel()

        asyncio.run(run())
        sources.close()
        return states

    with caplog.at_level("ERROR", logger="trserve.matrix.client"):
        assert watch(SharedSecret("w" * 20)) == [False]  # wrong secret: NOT_SERVING, once
    assert "refuses this worker's secret" in caplog.text
    assert watch(secret) == []  # the right one: health untouched (SERVING)


def test_worker_drafts_through_a_secured_matrix_service(decoder, matrix, tls, secret) -> None:
    reference = decoder.generate(messages=HI, max_new_tokens=16)
    good = RemoteDraftSource(matrix.addr, "secured", config=DraftClientConfig(tls_ca_file=tls.cert_file, secret=secret))
    wrong = RemoteDraftSource(matrix.addr, "secured",
                              config=DraftClientConfig(tls_ca_file=tls.cert_file, secret=SharedSecret("y" * 20)))
    try:
        served = decoder.generate(messages=HI, max_new_tokens=16, matrix=good)
        refused = decoder.generate(messages=HI, max_new_tokens=16, matrix=wrong)
    finally:
        good.close()
        wrong.close()
    assert served.stats.draft_mode == "remote" and served.ids == reference.ids
    assert refused.stats.draft_mode == "local-fallback" and refused.ids == reference.ids  # refused: drafts locally


def test_tenant_tokens_are_never_sent_in_plaintext_to_another_host(tmp_path) -> None:
    """Issue 28, defect 6: like the matrix secrets, bearer tokens need TLS off loopback."""
    from trserve_client import Client

    with pytest.raises(ValueError, match="without TLS to 10.1.2.3:50051"):
        Client("10.1.2.3:50051", token="t")
    with pytest.raises(ValueError, match="without TLS to 10.1.2.3:50051"):
        BalancedClient(["127.0.0.1:50051", "10.1.2.3:50051"], tokens={"acme": "t"})
    Client("10.1.2.3:50051", token="t", allow_plaintext_token=True).close()
    BalancedClient(["10.1.2.3:50051"], tokens={"acme": "t"}, allow_plaintext_token=True).close()
    Client("10.1.2.3:50051").close()  # no token: nothing to protect
    token = tmp_path / "acme.token"
    token.write_text("t\n")
    refused = subprocess.run([sys.executable, "-m", "trserve.services.cli", "generate", "--addr", "10.1.2.3:50051",
                              "--token-file", str(token), "Hi"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "refusing to send tenant tokens without TLS" in refused.stderr


def test_trserve_client_sends_its_token_over_tls(worker, tls) -> None:
    from trserve_client import Client

    with Client(worker.addr, timeout=60, tls_ca_file=tls.cert_file, token=TOKENS["acme"]) as client:
        assert client.generate(messages=HI, tenant="acme", max_new_tokens=4).stats.generated_tokens > 0
        assert len(client.tokenize("Hi")) > 0
    with Client(worker.addr, timeout=60, tls_ca_file=tls.cert_file) as anonymous:
        with pytest.raises(grpc.RpcError) as denied:
            anonymous.generate(messages=HI, tenant="acme", max_new_tokens=4)
        assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_leaving_rotation_keeps_the_server_alive_for_liveness_probes() -> None:
    """What the worker does while its matrix service refuses the secret (services/worker/server.py):
    the Generate service is NOT_SERVING (readiness), the server's own health stays SERVING (liveness)."""
    import asyncio

    from grpc_health.v1 import health_pb2
    from grpc_health.v1.health import aio as health_aio

    from trserve.services.common.server import set_status

    async def run():
        health = health_aio.HealthServicer()
        await set_status(health, ["trserve.v1.Generate"], serving=True)
        await set_status(health, ["trserve.v1.Generate"], serving=False, overall=False)
        return [(await health.Check(health_pb2.HealthCheckRequest(service=s), None)).status
                for s in ("", "trserve.v1.Generate")]

    assert asyncio.run(run()) == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING]
