"""Tenant affinity in BalancedClient: a tenant's calls go to one worker (rendezvous hashing), so its
next turn finds the previous one's keys and values in that worker's prefix cache."""

from __future__ import annotations

import pytest

from trserve_client import BalancedClient, rendezvous
from trserve.services.worker.config import Limits, WorkerConfig
from tests.services.worker_harness import serving

TURN1 = "Write a Python function that checks whether a string is a palindrome."
TURN2 = "Now make it ignore spaces and letter case."


def test_rendezvous_is_stable_and_removing_a_worker_moves_only_its_tenants():
    addrs = ["10.0.0.1:50051", "10.0.0.2:50051", "10.0.0.3:50051"]
    tenants = [f"tenant-{i}" for i in range(300)]
    first = {t: rendezvous(t, addrs)[0] for t in tenants}
    assert first == {t: rendezvous(t, list(addrs))[0] for t in tenants}  # the same in every call
    assert sorted(rendezvous("acme", addrs)) == [0, 1, 2]
    counts = [sum(1 for i in first.values() if i == w) for w in range(3)]
    assert min(counts) > 60  # spread: about 100 each
    kept = addrs[:2]  # the third worker leaves: only its tenants move, each to its own second choice
    for t in tenants:
        now = kept[rendezvous(t, kept)[0]]
        if first[t] != 2:
            assert now == addrs[first[t]]
        else:
            assert now == addrs[rendezvous(t, addrs)[1]]
    with pytest.raises(ValueError, match="affinity"):
        BalancedClient(addrs, affinity="sticky")


@pytest.fixture(scope="module")
def workers(decoder):
    config = WorkerConfig(port=0, metrics_port=None, warmup=False,
                          limits=Limits(max_new_tokens_cap=64, default_max_new_tokens=16))
    a, b = serving(config, decoder), serving(config, decoder)
    yield next(a), next(b)
    for gen in (a, b):
        next(gen, None)


def _conversation(client: BalancedClient, tenant: str):
    first = client.generate_served(messages=[{"role": "user", "content": TURN1}], tenant=tenant,
                                   max_new_tokens=24, mode="ar")
    second = client.generate_served(messages=[{"role": "user", "content": TURN1},
                                              {"role": "assistant", "content": first.reply.text},
                                              {"role": "user", "content": TURN2}],
                                    tenant=tenant, max_new_tokens=8, mode="ar")
    return first, second


def test_a_tenants_turns_go_to_one_worker_whose_prefix_cache_serves_the_next_turn(workers):
    addrs = [w.addr for w in workers]
    # one tenant whose first choice is each worker
    tenants = {}
    for i in range(100):
        tenants.setdefault(rendezvous(f"t{i}", addrs)[0], f"t{i}")
    assert len(tenants) == 2
    with BalancedClient(addrs, timeout=120, affinity="tenant") as client:
        for index, tenant in tenants.items():
            first, second = _conversation(client, tenant)
            assert first.addr == second.addr == addrs[index]
            assert second.reply.stats.cached_prompt_tokens >= first.reply.stats.prompt_tokens
    with BalancedClient(addrs, timeout=120) as client:  # round robin: the next turn lands on the other worker
        first, second = _conversation(client, "no-affinity")
        assert first.addr != second.addr and second.reply.stats.cached_prompt_tokens == 0
