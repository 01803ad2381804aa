"""Fault drills on a local cluster (private Redis with AOF, matrix service, 2 workers with 1 torch
thread each), under load from 4 concurrent clients over 3 tenants:

- Redis killed (-9) and restarted: requests keep succeeding, snapshots fail while it is down and
  resume after; the matrix service restarted on it restores exactly the last snapshot (checksummed).
- the matrix service killed (-9) mid-load: workers draft locally (fallbacks counted), every request
  succeeds with the same output; restarted, it resumes from Redis at the last snapshotted version
  (the loss window is what came after it), and workers draft through it again.
- a worker killed (-9) mid-load: clients retry on the other worker; only calls in flight on the
  killed worker may fail, and only with UNAVAILABLE.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from trserve_client import BalancedClient
from trserve.services.cluster.config import ClusterConfig
from trserve.services.cluster.runner import LocalCluster
from trserve.services.load.prompts import PROMPTS
from trserve.services.load.report import LoadReport, RequestRecord
from trserve.services.load.runner import LoadConfig, run_load
from tests.helpers import wait_for
from tests.services.cluster_helpers import Admin, N, assert_same_text_per_prompt, fallbacks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
CONCURRENCY = 4


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    config = ClusterConfig(run_dir=str(tmp_path_factory.mktemp("faults")), workers=2, threads=1,
                           snapshot_every_versions=8, snapshot_every_s=1.0)
    cluster = LocalCluster(config)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def admin(cluster) -> Iterator[Admin]:
    admin = Admin(cluster)
    yield admin
    admin.close()


def load(cluster: LocalCluster, prefix: str, requests: int = 12, on_done=None) -> LoadReport:
    config = LoadConfig(addrs=tuple(w.addr for w in cluster.workers if w.proc.alive), concurrency=CONCURRENCY,
                        requests=requests, tenants=3, tenant_prefix=prefix, max_new_tokens=N, timeout_s=120)
    return run_load(config, on_done=on_done)


def once(after: int, action: Callable[[], None]) -> Callable[[RequestRecord, int], None]:
    """An on_done callback running `action()` once, when `after` requests have finished."""
    lock, fired = threading.Lock(), []

    def on_done(record: RequestRecord, done: int) -> None:
        with lock:
            if done < after or fired:
                return
            fired.append(time.monotonic())
        action()

    return on_done


def generate(cluster: LocalCluster, tenant: str, prompt: int = 0):
    with BalancedClient([w.addr for w in cluster.workers if w.proc.alive], timeout=120) as client:
        return client.generate(messages=[{"role": "user", "content": PROMPTS[prompt]}], tenant=tenant, max_new_tokens=N)


def test_redis_restart_keeps_snapshots_and_they_resume(cluster, admin) -> None:
    tenant = "redis-drill"
    generate(cluster, tenant)
    before = admin.snapshot(tenant)
    time.sleep(1.2)  # Redis fsyncs its append-only file every second
    cluster.kill_redis()
    during = load(cluster, "redis-down", requests=4)
    assert not during.failed, during.summary
    assert admin.snapshot_code(tenant) == grpc.StatusCode.UNAVAILABLE
    assert admin.describe(tenant).redis == "failing"

    cluster.start_redis()  # same port and data directory: the AOF is replayed
    assert before in admin.versions(tenant)
    generate(cluster, tenant, prompt=1)
    resumed = admin.snapshot(tenant)  # retried while the store's Redis breaker is still open
    assert resumed > before and admin.describe(tenant).last_snapshot_error == ""
    # rows, not only versions: the digest of what was snapshotted must come back after a restart
    expected = {}
    for t in [tenant] + sorted({r.tenant for r in during.records}):
        if t != tenant:  # first used while Redis was down: reconciled, then snapshotted in the background
            wait_for(lambda t=t: (i := admin.describe(t)) is not None and i.version > 0
                     and i.last_snapshot_version == i.version and i.last_snapshot_error == "", timeout=20)
        info = admin.describe(t)
        assert info.nonzero_rows > 0 and info.last_snapshot_version == info.version
        expected[t] = (info.version, info.rows_sha256)
    time.sleep(1.2)  # AOF fsync of the last snapshots

    cluster.kill_matrix()
    cluster.start_matrix()
    restored = admin.describe(tenant)  # restored from Redis, checksum verified
    assert restored.version == restored.last_snapshot_version == resumed == max(admin.versions(tenant))
    for t, (version, digest) in expected.items():
        back = admin.describe(t)
        assert (back.version, back.rows_sha256) == (version, digest), t  # an all-zero matrix would not pass
    print(f"\nredis drill: snapshot v{before} kept over kill -9 + restart; snapshots resumed at v{resumed}; "
          f"matrix restart restored v{restored.version} (rows digest equal); {len(during.records)} requests during "
          f"the outage, 0 failed; {len(expected) - 1} tenants first used during the outage restored with equal rows")


def test_matrix_service_killed_mid_load(cluster, admin) -> None:
    prefix, tenants = "mx", ["mx-0", "mx-1", "mx-2"]
    at_kill: dict[str, tuple[int, int]] = {}  # tenant -> (version, last snapshot version) just before the kill
    fallbacks_before = fallbacks(cluster)

    def kill() -> None:
        # Batched workers finish the first requests within one snapshot interval (1 s): wait until
        # every tenant has a snapshot, so the drill measures the loss window after it, not before it.
        wait_for(lambda: all((i := admin.describe(t)) is not None and i.last_snapshot_version >= 1 for t in tenants),
                 timeout=10)
        for t in tenants:
            info = admin.describe(t)
            at_kill[t] = (info.version, info.last_snapshot_version)
        cluster.kill_matrix()

    report = load(cluster, prefix, on_done=once(CONCURRENCY, kill))
    assert not report.failed, report.summary
    assert_same_text_per_prompt(report.records)
    assert "local-fallback" in report.summary["draft_modes"]
    fell_back = fallbacks(cluster) - fallbacks_before
    assert fell_back >= 1

    cluster.start_matrix()
    lines, restored = [], {}
    for t in tenants:
        info = admin.describe(t)
        restored[t] = info.version
        version, last_snapshot = at_kill[t]
        assert last_snapshot >= 1, f"{t} was never snapshotted before the kill: the drill measures nothing"
        assert info.nonzero_rows > 0  # restored rows, not a cold matrix at the right version
        assert last_snapshot <= info.version == info.last_snapshot_version == max(admin.versions(t))
        lines.append(f"{t}: v{version} at kill, last snapshot v{last_snapshot}, restored v{info.version} "
                     f"(lost {max(0, version - info.version)} versions)")
    for _ in range(20):  # the workers skip a failed service for a few seconds, then draft through it again
        reply = generate(cluster, "mx-0")
        if reply.stats.draft_mode == "remote":
            break
        time.sleep(0.5)
    assert reply.stats.draft_mode == "remote" and reply.stats.matrix_version > restored["mx-0"]
    print(f"\nmatrix drill: {report.summary['ok']}/{len(report.records)} ok, draft modes "
          f"{report.summary['draft_modes']}, fallbacks +{fell_back:.0f}\n" + "\n".join(lines))


def test_worker_killed_mid_load(cluster) -> None:
    victim = cluster.workers[1].addr
    report = load(cluster, "wk", on_done=once(CONCURRENCY, lambda: cluster.kill_worker(1)))
    # unary calls cut off by the kill end UNAVAILABLE and the balanced client retries them on the survivor
    assert not report.failed, report.summary
    assert report.summary["retried"] >= 1 and set(report.summary["retried_after"]) == {"UNAVAILABLE"}
    assert_same_text_per_prompt(report.records)
    print(f"\nworker drill: killed {victim}; {report.summary['ok']}/{len(report.records)} ok, failed by code "
          f"{report.summary['errors_by_code']}, {report.summary['retried']} retried on the other worker after "
          f"{report.summary['retried_after']}, "
          f"by worker {report.summary['by_worker']}")
