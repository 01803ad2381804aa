"""A worker serving tree "adaptive": each tenant's tree is re-tuned online, output stays exact."""

from __future__ import annotations

import pytest

from trserve.engine import Decoder, DecoderConfig
from trserve.engine.tuning.calibrate import CostModel, cost_model_path, save_cost_model
from trserve.engine.tuning.online import AutoTuneConfig
from trserve_client import Client
from trserve.services.worker.config import WorkerConfig
from tests.services.worker_harness import serving

PROMPT = [{"role": "user", "content": "Name three colours of the rainbow and one fruit of each colour."}]


@pytest.fixture(scope="module")
def adaptive_worker(loaded_smollm2, tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    # a stand-in cost curve (calibrating takes a minute); this test checks mechanics, not speed
    save_cost_model(CostModel("t", (1, 128), (128,), ((0.04, 0.30),)), cost_model_path(loaded_smollm2, cache))
    config = DecoderConfig(tree="adaptive", cache_dir=str(cache),
                           autotune=AutoTuneConfig(explore_every=2, explore_budget=None, retune_every=4, min_records=4))
    yield from serving(WorkerConfig(port=0, metrics_port=None), Decoder(config, loaded=loaded_smollm2))


def test_each_tenant_gets_its_own_online_tuner(adaptive_worker, decoder):
    expected = decoder.generate(messages=PROMPT, max_new_tokens=40, mode="ar").ids
    with Client(adaptive_worker.addr, timeout=120) as client:
        for tenant in ("acme", "globex", "acme"):
            reply = client.generate(messages=PROMPT, tenant=tenant, max_new_tokens=40, return_token_ids=True)
            assert list(reply.token_ids) == expected
            assert reply.stats.tree.startswith("adaptive:")
        named = client.generate(messages=PROMPT, tenant="acme", max_new_tokens=8, tree="cpu-8")
        assert named.stats.tree == "cpu-8"  # a named tree bypasses the tuner
    tuners = adaptive_worker.worker.door.tuners
    assert len(tuners) == 2
    assert tuners.get("acme").retunes >= 1 and tuners.get("acme").log.total_steps > tuners.get("globex").log.total_steps


@pytest.mark.redis
def test_tuner_records_are_kept_with_the_tenant_matrix_across_restarts(loaded_smollm2, tmp_path):
    """A restarted worker (same Redis) resumes a tenant's tuner from its saved records and tree."""
    import uuid

    import redis

    from trserve.matrix_store import MatrixStore, StoreConfig
    from tests.services.matrix_helpers import REDIS_URL

    cache = tmp_path / "cache"
    save_cost_model(CostModel("t", (1, 128), (128,), ((0.04, 0.30),)), cost_model_path(loaded_smollm2, cache))
    config = DecoderConfig(tree="adaptive", cache_dir=str(cache),
                           autotune=AutoTuneConfig(explore_every=2, explore_budget=None, retune_every=4, min_records=4))
    tenant = f"tuned-{uuid.uuid4().hex[:12]}"  # its keys are this test's alone
    saved = None
    try:
        for run in range(2):
            for w in serving(WorkerConfig(port=0, metrics_port=None, redis_url=REDIS_URL),
                             Decoder(config, loaded=loaded_smollm2)):
                if run == 0:
                    with Client(w.addr, timeout=120) as client:
                        client.generate(messages=PROMPT, tenant=tenant, max_new_tokens=40)
                tuner = w.worker.door.tuners.get(tenant)
                if run == 0:
                    assert tuner.retunes >= 1
                    saved = (len(tuner.log), tuner.current.paths, tuner.current.lookup, tuner.retunes)
                else:  # nothing decoded in this worker: records and tree came back from Redis
                    assert (len(tuner.log), tuner.current.paths, tuner.current.lookup, tuner.retunes) == saved
        fresh = MatrixStore(StoreConfig(redis_url=REDIS_URL))
        assert fresh.side_state("tuner", loaded_smollm2.fingerprint, tenant) is not None
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        keys = list(client.scan_iter(match=f"trserve:*{tenant}*"))
        if keys:
            client.delete(*keys)
