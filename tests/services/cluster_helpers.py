"""Helpers for the tests that run a LocalCluster (tests/services/test_cluster.py, test_faults.py):
matrix administration through the cluster's service, worker metrics, output checks, and a
self-signed TLS certificate (also for test_security.py)."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from trserve_client import Client
from trserve.services.cluster.runner import LocalCluster
from trserve.services.common.security import ServerTLS
from trserve.services.load.report import RequestRecord
from trserve.v1 import matrix_pb2 as pb
from trserve.v1 import matrix_pb2_grpc

N = 16  # max_new_tokens: short, a worker with one CPU thread makes ~10 tok/s on a busy 2-core machine


class Admin:
    """Admin calls on the cluster's matrix service (the channel reconnects across restarts on its port)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self._channel = grpc.insecure_channel(cluster.matrix_addr)
        self._stub = matrix_pb2_grpc.MatrixServiceStub(self._channel)
        with Client(cluster.worker_addrs[0], timeout=30) as client:
            self.fingerprint = client.model_info().fingerprint

    def ref(self, tenant: str) -> pb.TenantRef:
        return pb.TenantRef(tenant=tenant, fingerprint=self.fingerprint)

    def describe(self, tenant: str) -> pb.DescribeReply | None:
        try:
            return self._stub.Describe(self.ref(tenant), timeout=10, wait_for_ready=True)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def snapshot(self, tenant: str) -> int:
        """A synchronous snapshot, retried while Redis is (still) unreachable."""
        snapshot = self._stub.Snapshot
        return _while_unavailable(lambda: snapshot(self.ref(tenant), timeout=10, wait_for_ready=True)).version

    def snapshot_code(self, tenant: str) -> grpc.StatusCode:
        try:
            self._stub.Snapshot(self.ref(tenant), timeout=10)
        except grpc.RpcError as exc:
            return exc.code()
        return grpc.StatusCode.OK

    def versions(self, tenant: str) -> list[int]:
        """Snapshot versions kept in Redis, retried while Redis is (still) unreachable."""
        return list(_while_unavailable(
            lambda: self._stub.ListVersions(self.ref(tenant), timeout=10, wait_for_ready=True)).versions)

    def close(self) -> None:
        self._channel.close()


def _while_unavailable(call, within_s: float = 15.0):
    """call(), retried while it fails with UNAVAILABLE (the store's Redis breaker backs off up to 4 s)."""
    end = time.monotonic() + within_s
    while True:
        try:
            return call()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > end:
                raise
            time.sleep(0.25)


def fallbacks(cluster: LocalCluster) -> float:
    """trserve_draft_fallbacks summed over the live workers' /metrics."""
    total = 0.0
    for w in cluster.workers:
        if w.proc.alive:
            text = urllib.request.urlopen(w.metrics_url, timeout=10).read().decode()
            total += sum(float(line.split()[-1]) for line in text.splitlines()
                         if line.startswith("trserve_draft_fallbacks_total"))
    return total


def assert_same_text_per_prompt(records: list[RequestRecord]) -> dict[int, str]:
    """Greedy and lossless: a prompt gives one text, whatever the worker, tenant or draft mode."""
    texts: dict[int, set[str]] = {}
    for r in records:
        if r.code == "OK":
            texts.setdefault(r.prompt, set()).add(r.text)
    differing = {p: t for p, t in texts.items() if len(t) > 1}
    assert not differing, f"prompts with more than one output: {differing}"
    return {p: next(iter(t)) for p, t in texts.items()}


def self_signed(directory: Path) -> ServerTLS:
    """A certificate for localhost / 127.0.0.1 that is its own CA, made by the openssl CLI."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl CLI is needed to make a test certificate")
    key, cert = directory / "key.pem", directory / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return ServerTLS(str(cert), str(key))
