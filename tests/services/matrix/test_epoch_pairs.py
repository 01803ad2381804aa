"""An (epoch, version) pair names one content (issue 28, defect 5): PushRows replies read the epoch
together with the version it wrote, and a rollback changes epoch, rows and version at once, so
pushes racing rollbacks never get the same pair back twice (each push writes new content)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests.services.matrix_helpers import (  # noqa: F401 - fixtures
    channel_to,
    model,
    push,
    random_rows,
    redis_prefix,
    ref,
    start_server,
)
from trserve.v1 import matrix_pb2 as pb

pytestmark = pytest.mark.redis


def test_pushes_racing_rollbacks_never_share_an_epoch_version_pair(start_server, channel_to) -> None:
    server = start_server()
    stub = channel_to(server)
    rng = np.random.default_rng(5)
    push(stub, "t", random_rows(rng))
    assert stub.Snapshot(ref("t"), timeout=10).version == 1
    pairs: list[tuple[int, int]] = []
    lock, stop = threading.Lock(), time.monotonic() + 6.0

    def pusher(seed: int) -> None:
        r = np.random.default_rng(seed)
        while time.monotonic() < stop:
            reply = stub.PushRows(pb.PushRowsRequest(tenant="t", model=model(), rows=random_rows(r, m=4)), timeout=10)
            with lock:
                pairs.append((reply.epoch, reply.version))

    threads = [threading.Thread(target=pusher, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    rollbacks = 0
    while time.monotonic() < stop:
        stub.Rollback(pb.RollbackRequest(ref=ref("t"), version=1), timeout=10)
        rollbacks += 1
        time.sleep(0.01)
    for t in threads:
        t.join()
    assert rollbacks > 20 and len(pairs) > 200
    repeated = len(pairs) - len(set(pairs))
    assert repeated == 0, f"{repeated} of {len(pairs)} pushes got an (epoch, version) pair another push had"
