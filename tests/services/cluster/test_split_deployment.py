"""Split deployment as real processes: Redis, one `trserve matrix` and two `trserve worker`s
(A: --draft-mode remote, B: --draft-mode replica) on port 0, all on one Redis key prefix.

Shows: output through either worker equals in-process TR; a tenant warmed through one worker is
hot on the other (the workers verify full trees, so a hot matrix shows as acceptance whatever the
host's forward costs make the batch budget choose); kill -9 of the matrix service mid-stream still
completes the request identically and counts a fallback; kill -9 of a worker loses no committed
matrix version, and a matrix service restarted on the same Redis comes back at the last snapshot.
"""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import redis

from trserve_client import Client
from trserve.services.cluster.procs import Proc, wait_serving
from trserve.services.worker.drafting.remote import RemoteDraftSource
from trserve.services.worker.drafting.replica import ReplicaDraftSource
from trserve.services.worker.drafting.split import MatrixServiceSources, SplitConfig
from trserve.v1 import generate_pb2, matrix_pb2, matrix_pb2_grpc

REPO = Path(__file__).resolve().parents[3]
REDIS_URL = "redis://127.0.0.1:6379/0"
N = 32  # max_new_tokens: short, the model runs ~25 tok/s on 2 CPU cores
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
COUNT = [{"role": "user", "content": "Count from one to twenty, in words."}]
MODES = {"A": "remote", "B": "replica"}


def processes(test):
    """The marks of a test that runs the deployment (model processes, Redis)."""
    return pytest.mark.slow(pytest.mark.redis(pytest.mark.timeout(300)(test)))


class Cluster:
    """The matrix service (restartable on the same port and Redis prefix) and the workers."""

    def __init__(self, prefix: str, log_dir: Path) -> None:
        self.prefix, self.log_dir = prefix, log_dir
        self.procs: list[Proc] = []  # every process ever started: close() kills them all
        self.matrix_port = 0  # fixed by the first start, so a restart is where the workers look
        self.workers: dict[str, tuple[Proc, str, str]] = {}  # name -> (process, gRPC addr, /metrics URL)
        self._channel: grpc.Channel | None = None

    def start(self) -> None:
        self.matrix = self.start_matrix()
        self.matrix_addr = f"127.0.0.1:{self.matrix_port}"
        for name in MODES:  # both load the model at once
            self._spawn_worker(name)
        for name in MODES:
            self._await_worker(name)
        self._channel = grpc.insecure_channel(self.matrix_addr)
        self.admin = matrix_pb2_grpc.MatrixServiceStub(self._channel)
        with Client(self.addr("A"), timeout=30) as client:
            self.fingerprint = client.model_info().fingerprint

    def _start(self, name: str, args: list[str]) -> Proc:
        proc = Proc.trserve(name, args, self.log_dir)
        self.procs.append(proc)
        return proc

    def start_matrix(self) -> Proc:
        proc = self._start("matrix", ["matrix", "--host", "127.0.0.1", "--port", str(self.matrix_port),
                                      "--redis-url", REDIS_URL, "--key-prefix", self.prefix])
        addr = proc.wait_line("matrix service listening on", timeout=60)
        self.matrix_port = int(addr.rsplit(":", 1)[1])
        wait_serving(addr)
        return proc

    def _spawn_worker(self, name: str) -> None:
        proc = self._start(f"worker-{name}", ["worker", "--matrix-addr", self.matrix_addr, "--draft-mode", MODES[name],
                                              "--port", "0", "--metrics-port", "0", "--grace", "1",
                                              "--http-port", "0", "--full-trees"])  # hot vs fresh MAT must not hang on the budget
        self.workers[name] = (proc, "", "")

    def _await_worker(self, name: str) -> None:
        proc = self.workers[name][0]
        addr = proc.wait_line("trserve listening on")
        metrics = proc.wait_line("trserve metrics on", timeout=10)
        wait_serving(addr)
        self.workers[name] = (proc, addr, metrics)

    def addr(self, name: str) -> str:
        if not self.workers[name][0].alive:  # killed by an earlier test: start a new one
            self._spawn_worker(name)
            self._await_worker(name)
        return self.workers[name][1]

    def restart_matrix(self) -> None:
        self.matrix.kill()
        self.matrix = self.start_matrix()

    def ensure_matrix(self) -> None:
        if not self.matrix.alive:  # killed by an earlier test
            self.matrix = self.start_matrix()

    def describe(self, tenant: str) -> matrix_pb2.DescribeReply | None:
        try:
            return self.admin.Describe(matrix_pb2.TenantRef(tenant=tenant, fingerprint=self.fingerprint), timeout=10)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                return None
            raise

    def fallbacks(self, name: str) -> float:
        """The worker's trserve_draft_fallbacks counter, scraped from its /metrics."""
        text = urllib.request.urlopen(self.workers[name][2], timeout=10).read().decode()
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("trserve_draft_fallbacks_total"))

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
        if self._channel is not None:
            self._channel.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    prefix = f"trtest:split:{uuid.uuid4().hex}"
    cluster = Cluster(prefix, tmp_path_factory.mktemp("split"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.close()
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
        client.close()


@pytest.fixture(scope="module")
def reference(decoder_served) -> dict[str, tuple[list[int], str]]:
    """In-process TR from a cold matrix, in the arithmetic the workers serve: (ids, text) per prompt."""
    out = {}
    for key, messages in (("poem", POEM), ("count", COUNT)):
        result = decoder_served.generate(messages=messages, max_new_tokens=N)
        out[key] = (result.ids, result.text)
    return out


def generate(cluster: Cluster, worker: str, tenant: str, messages: list[dict]) -> generate_pb2.GenerateResponse:
    with Client(cluster.addr(worker), timeout=60) as client:
        return client.generate(messages=messages, tenant=tenant, max_new_tokens=N, return_token_ids=True).raw


@processes
@pytest.mark.parametrize("worker", MODES)
def test_output_equals_in_process(cluster, reference, worker) -> None:
    reply = generate(cluster, worker, f"eq-{worker}", POEM)
    assert list(reply.token_ids) == reference["poem"][0] and reply.text == reference["poem"][1]
    assert reply.stats.draft_mode == MODES[worker]
    assert reply.stats.matrix_version > 0


@processes
@pytest.mark.parametrize(("warm_on", "check_on"), [("A", "B"), ("B", "A")])
def test_tenant_warmed_on_one_worker_is_hot_on_the_other(cluster, reference, warm_on, check_on) -> None:
    tenant = f"hot-{warm_on}{check_on}"
    generate(cluster, warm_on, tenant, POEM)
    warmed = cluster.describe(tenant).version  # committed: close() flushed before the reply
    assert warmed > 0
    fresh = generate(cluster, check_on, f"fresh-{warm_on}{check_on}", POEM)
    hot = generate(cluster, check_on, tenant, POEM)
    assert list(hot.token_ids) == list(fresh.token_ids) == reference["poem"][0]
    assert hot.stats.draft_mode == MODES[check_on]
    assert hot.stats.matrix_version > warmed  # started from the warmed matrix, then added this request's rows
    assert hot.stats.mean_accepted_tokens > fresh.stats.mean_accepted_tokens, (hot.stats, fresh.stats)
    print(f"{warm_on}->{check_on}: MAT hot {hot.stats.mean_accepted_tokens:.2f} vs fresh "
          f"{fresh.stats.mean_accepted_tokens:.2f}; version warmed {warmed}, hot {hot.stats.matrix_version}")


@processes
def test_killing_a_worker_loses_no_committed_version(cluster) -> None:
    tenant = "crash-worker"
    with Client(cluster.addr("B"), timeout=60) as client:
        chunks = client.stream(messages=COUNT, tenant=tenant, max_new_tokens=N)
        before = None
        for chunk in chunks:  # wait until some of this request's rows are committed on the service
            assert not chunk.raw.HasField("stats"), "the request finished before any rows were pushed"
            if (info := cluster.describe(tenant)) is not None and info.version > 0:
                before = info.version
                break
        assert before is not None, "the stream ended before any rows were committed"
        cluster.workers["B"][0].kill()
        with pytest.raises(grpc.RpcError):
            list(chunks)
    time.sleep(0.3)  # a push already on the wire may still land; it only adds versions
    after = cluster.describe(tenant).version
    assert after >= before > 0
    snapshot = cluster.admin.Snapshot(matrix_pb2.TenantRef(tenant=tenant, fingerprint=cluster.fingerprint),
                                      timeout=10).version
    assert snapshot == after

    cluster.restart_matrix()  # kill -9, then a new process on the same port and Redis prefix
    restored = cluster.describe(tenant)
    assert restored.version == restored.last_snapshot_version == snapshot
    print(f"worker killed: committed v{before} before, v{after} after; restored v{restored.version}")


@processes
@pytest.mark.parametrize("worker", MODES)
def test_matrix_killed_mid_stream_completes_identically(cluster, reference, worker) -> None:
    cluster.ensure_matrix()
    tenant = f"crash-matrix-{worker}"
    with Client(cluster.addr(worker), timeout=60) as client:
        before = cluster.fallbacks(worker)
        chunks = client.stream(messages=COUNT, tenant=tenant, max_new_tokens=N)
        received = [next(chunks)]
        while (info := cluster.describe(tenant)) is None or info.version == 0:  # the service has this request's rows
            received.append(next(chunks))
            assert not received[-1].raw.HasField("stats"), "the request finished before its rows reached the service"
        cluster.matrix.kill()
        at_kill = len(received)
        received += list(chunks)
    final = received[-1]
    assert [t for c in received for t in c.token_ids] == reference["count"][0]
    assert "".join(c.text for c in received) == reference["count"][1]
    assert final.stats.draft_mode == "local-fallback"
    assert cluster.fallbacks(worker) == before + 1

    after_death = generate(cluster, worker, f"after-matrix-death-{worker}", COUNT)  # still down: cold, local
    assert list(after_death.token_ids) == reference["count"][0]
    assert after_death.stats.draft_mode == "local-fallback"
    assert cluster.fallbacks(worker) == before + 2
    print(f"{MODES[worker]}: matrix killed after {at_kill} of {len(received)} chunks (version {info.version}); "
          f"fallbacks {before} -> {cluster.fallbacks(worker)}")


# -- the worker's factory and flags, without processes --------------------------------------------------
def test_split_config_says_how_to_fix_bad_values() -> None:
    with pytest.raises(ValueError, match="HOST:PORT"):
        SplitConfig("localhost")
    with pytest.raises(ValueError, match="draft mode"):
        SplitConfig("127.0.0.1:50052", draft_mode="local")
    with pytest.raises(ValueError, match="max_sources"):
        SplitConfig("127.0.0.1:50052", max_sources=1)


@pytest.mark.parametrize(("mode", "cls"), [("remote", RemoteDraftSource), ("replica", ReplicaDraftSource)])
def test_matrix_service_sources_keep_one_source_per_tenant(mode, cls) -> None:
    sources = MatrixServiceSources(SplitConfig("127.0.0.1:1", draft_mode=mode, max_sources=2))
    try:
        a = sources("a", None)
        assert isinstance(a, cls) and sources("a", None) is a and sources("a", "legal") is not a
        sources("b", None)  # a (LRU) is evicted and closed: the next request of `a` gets a new source
        assert sources("a", None) is not a
    finally:
        sources.close()


def test_worker_cli_refuses_a_bad_matrix_address() -> None:
    out = subprocess.run([sys.executable, "-m", "trserve.services.cli", "worker", "--matrix-addr", "nowhere", "--port", "0"],
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "matrix address must be HOST:PORT" in out.stderr
