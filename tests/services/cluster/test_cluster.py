"""`trserve cluster up|status|down` and `trserve load` as a user runs them: a local cluster of
Redis, the matrix service and 2 workers (1 torch thread each), secured (TLS everywhere, tenant
tokens on the workers, a shared secret on the matrix service); the same load through 1 worker and
through both (4 concurrent clients, 3 tenants), no failed request, and the scaling ratio. Also the
balanced client on an in-process worker, and the load generator's bounds."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from trserve_client import BalancedClient
from trserve.services.cluster.procs import free_port, pid_runs
from trserve.services.load.runner import LoadConfig
from trserve.services.worker.config import WorkerConfig
from tests.services.cluster_helpers import N, self_signed
from tests.services.worker_harness import serving

REPO = Path(__file__).resolve().parents[3]
HI = [{"role": "user", "content": "Say hello."}]


def trserve(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trserve.services.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def load(addrs: list[str], prefix: str, *security: str, requests: int = 12) -> subprocess.CompletedProcess:
    return trserve("load", "--addrs", ",".join(addrs), "--concurrency", "4", "--requests", str(requests),
                   "--tenants", "3", "--tenant-prefix", prefix, "--max-new-tokens", str(N), "--json", *security)


def _push_another_model(matrix: str, tls_ca: str, secret_file: Path) -> grpc.RpcError:
    """PushRows of a model the cluster's workers do not run; returns the error it must get."""
    import numpy as np

    from trserve.services.common.matrix_convert import rows_to_pb
    from trserve.services.common.security import SharedSecret, client_channel
    from trserve.v1 import matrix_pb2 as mpb
    from trserve.v1 import matrix_pb2_grpc

    with client_channel(matrix, tls_ca, SharedSecret.from_file(secret_file)) as channel:
        stub = matrix_pb2_grpc.MatrixServiceStub(channel)
        request = mpb.PushRowsRequest(tenant="squatter", model=mpb.ModelSpec(fingerprint="junk-model", vocab_size=64,
                                                                              k=8),
                                      rows=rows_to_pb(np.array([1], np.int32), np.ones((1, 8), np.int32)))
        with pytest.raises(grpc.RpcError) as refused:
            stub.PushRows(request, timeout=30)
    return refused.value


def secured(directory: Path) -> tuple[list[str], list[str]]:
    """(`cluster up` flags, `load` flags) for TLS, tenant tokens and a matrix secret."""
    tls = self_signed(directory)
    tokens, secret = directory / "tokens.json", directory / "matrix-secret"
    tokens.write_text(json.dumps({f"{p}-{i}": secrets.token_urlsafe(24) for p in ("one", "two") for i in range(3)}))
    secret.write_text(secrets.token_urlsafe(24) + "\n")
    admin = directory / "matrix-admin-secret"  # admin RPCs (ListTenants included) need their own secret
    admin.write_text(secrets.token_urlsafe(24) + "\n")
    up = ["--tls-cert", tls.cert_file, "--tls-key", tls.key_file, "--tenant-tokens", str(tokens),
          "--matrix-secret-file", str(secret), "--matrix-admin-secret-file", str(admin)]
    return up, ["--tls-ca", tls.cert_file, "--tokens", str(tokens)]


@pytest.fixture(scope="module")
def worker(decoder):
    yield from serving(WorkerConfig(port=0, metrics_port=None), decoder)


def test_balanced_client_round_robins_and_retries_unavailable_elsewhere(worker) -> None:
    dead = f"127.0.0.1:{free_port()}"
    with BalancedClient([dead, worker.addr, worker.addr], timeout=60, down_for_s=60) as client:
        served = [client.generate_served(messages=HI, max_new_tokens=2) for _ in range(3)]
        assert served[0].retried_after == ("UNAVAILABLE",) and served[0].addr == worker.addr
        assert [s.retried_after for s in served[1:]] == [(), ()]  # the dead one is skipped while marked down
        with pytest.raises(grpc.RpcError) as refused:  # not retryable: raised at once
            client.generate(messages=HI, max_new_tokens=10**6)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        chunks = list(client.stream(messages=HI, max_new_tokens=4))
        assert chunks[-1].stats.generated_tokens == sum(len(c.token_ids) for c in chunks)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_workers_share_the_load_with_no_failed_request(tmp_path) -> None:
    """Behaviour only: throughput (2 workers against 1) is measured by `make bench`, not asserted here."""
    run_dir = str(tmp_path / "cluster")
    up_flags, client_flags = secured(tmp_path)
    up = trserve("cluster", "up", "--workers", "2", "--threads", "1", "--run-dir", run_dir, *up_flags)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        status = trserve("cluster", "status", "--run-dir", run_dir, "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        state = json.loads(status.stdout)
        assert [p["state"] for p in state["processes"]] == ["up", "SERVING", "SERVING", "SERVING"]
        workers = state["workers"]

        no_token = load(workers, "one", client_flags[0], client_flags[1], requests=2)  # TLS, but no tokens
        assert no_token.returncode == 1
        assert json.loads(no_token.stdout)["errors_by_code"] == {"UNAUTHENTICATED": 2}
        run = load(workers, "two", *client_flags)
        assert run.returncode == 0, run.stdout + run.stderr
        two = json.loads(run.stdout)
        (matrix,) = [p["addr"] for p in state["processes"] if p["name"] == "matrix"]
        listed = trserve("matrix-admin", "list", "--addr", matrix, "--tls-ca", client_flags[1],
                         "--secret-file", str(tmp_path / "matrix-admin-secret"))
        assert listed.returncode == 0, listed.stdout + listed.stderr
        tenants = {t["tenant"]: t for t in json.loads(listed.stdout)["tenants"]}
        served = json.loads(listed.stdout)["models"]  # `cluster up` names the workers' model: only it is served
        junk = _push_another_model(matrix, client_flags[1], tmp_path / "matrix-secret")
    finally:
        down = trserve("cluster", "down", "--run-dir", run_dir)
    assert down.returncode == 0 and "stopped: worker-1, worker-0, matrix, redis" in down.stdout, down.stdout
    assert not any(pid_runs(p["pid"], "") for p in state["processes"])

    assert two["failed"] == 0 and two["ok"] == 12 and two["errors_by_code"] == {}, two
    assert served == [next(iter(tenants.values()))["fingerprint"]], (served, tenants)
    # a caller with the workers' secret still cannot make the service serve another model (issue 28, defect 2)
    assert junk.code() == grpc.StatusCode.FAILED_PRECONDITION and "not served" in junk.details(), junk.details()
    assert set(two["mat_by_tenant"]) == {f"two-{i}" for i in range(3)}
    # MAT >= 1.0 holds by construction (and under this load the batch budgets mostly verify one-token
    # steps): what shows that drafting went through the matrix service is each tenant's rows there
    for t in two["mat_by_tenant"]:
        assert tenants[t]["version"] >= 1 and tenants[t]["nonzero_rows"] > 0, tenants.get(t)
    assert two["draft_modes"] == {"remote": 12}  # workers reached the matrix service: TLS + secret
    assert set(two["by_worker"]) == set(workers)


def test_load_refuses_non_loopback_addresses_and_unbounded_runs() -> None:
    with pytest.raises(ValueError, match="loopback only"):
        LoadConfig(addrs=("127.0.0.1:50051", "10.0.0.7:50051"))
    with pytest.raises(ValueError, match="requests must be in"):
        LoadConfig(addrs=("localhost:50051",), requests=10**6)
    out = trserve("load", "--addrs", "192.168.1.2:50051", timeout=60)
    assert out.returncode == 2 and "loopback only" in out.stderr
