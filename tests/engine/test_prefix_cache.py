"""Prefix caching (engine/prefix_cache.py): the cache's rules on tiny tensors, then on the real model
that cached keys and values are the bits a prefill writes and that outputs do not change."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trserve.engine.prefix_cache import PrefixCache, common_prefix


def _kv(n: int, fill: float = 0.0) -> torch.Tensor:
    return torch.full((2, 1, 1, n, 2), fill)  # [2, layers, Hkv, n, D]: 16 bytes a token


def test_common_prefix():
    a = np.array([1, 2, 3, 4])
    assert common_prefix(a, np.array([1, 2, 9])) == 2
    assert common_prefix(a, np.array([1, 2, 3, 4, 5])) == 4
    assert common_prefix(a, np.array([7])) == 0
    assert common_prefix(a, np.array([], dtype=np.int64)) == 0


def test_lookup_takes_the_longest_prefix_of_the_same_tenant_and_runs_the_last_prompt_token():
    cache = PrefixCache(max_bytes=1 << 20, min_tokens=4, block_tokens=1)
    assert cache.store("a", [1, 2, 3, 4, 5, 6], _kv(6))
    assert cache.store("a", [1, 2, 3, 7, 8, 9], _kv(6, 1.0))
    hit = cache.lookup("a", [1, 2, 3, 4, 5, 9, 9])
    assert hit is not None and hit.tokens == 5 and hit.entry.tokens.tolist() == [1, 2, 3, 4, 5, 6]
    hit = cache.lookup("a", [1, 2, 3, 4, 5, 6])  # the whole entry: its last token is run again
    assert hit is not None and hit.tokens == 5
    assert cache.lookup("b", [1, 2, 3, 4, 5, 6]) is None  # never across tenants
    assert cache.lookup("a", [1, 2, 3, 9, 9]) is None  # 3 shared tokens < min_tokens
    assert (cache.hits, cache.misses, cache.hit_tokens) == (2, 2, 10)


def test_an_entry_extending_another_replaces_it_and_the_least_recently_used_go_first():
    cache = PrefixCache(max_bytes=3 * (6 * 16 + 6 * 8), min_tokens=2, block_tokens=1)  # three 6-token entries
    cache.store("a", [1, 2, 3], _kv(3))
    cache.store("a", [1, 2, 3, 4, 5, 6], _kv(6))  # turn 2 extends turn 1: turn 1 goes
    assert len(cache) == 1 and cache.lookup("a", [1, 2, 3, 9]).entry.tokens.shape[0] == 6
    cache.store("b", [1, 2, 3, 4, 5, 6], _kv(6))  # another tenant's same tokens: kept beside
    cache.store("c", [5, 5, 5, 5, 5, 5], _kv(6))
    assert len(cache) == 3
    cache.lookup("a", [1, 2, 3, 4, 0])  # a is now the most recently used; b the least
    cache.store("d", [6, 6, 6, 6, 6, 6], _kv(6))
    assert cache.lookup("b", [1, 2, 3, 4, 0]) is None and cache.lookup("a", [1, 2, 3, 4, 0]) is not None
    assert cache.bytes == 3 * (6 * 16 + 6 * 8)
    assert not cache.store("e", [1], _kv(1))  # shorter than min_tokens
    assert not PrefixCache(max_bytes=10).store("a", list(range(40)), _kv(40))  # larger than the cache


def test_evicted_entries_blocks_hold_the_next_ones_and_never_more_than_max_bytes_are_allocated():
    block = 4 * 16  # 4 columns of 16 bytes
    cache = PrefixCache(max_bytes=5 * block + 2 * 10 * 8, min_tokens=2, block_tokens=4)
    ramp = torch.arange(2 * 10 * 2, dtype=torch.float32).reshape(2, 1, 1, 10, 2)  # [2, layers, Hkv, 10, D]
    assert cache.store("a", list(range(10)), ramp)  # 10 columns: 3 blocks, the last one half used
    assert cache.allocated == 3 * block and cache.bytes == 3 * block + 10 * 8
    assert torch.equal(cache.lookup("a", list(range(10)) + [99]).entry.kv, ramp)
    first = set(map(id, cache.lookup("a", list(range(10)) + [99]).entry.blocks))
    assert cache.store("b", list(range(10)), ramp + 1)  # 3 more blocks would pass max_bytes: a goes, b takes its blocks
    assert len(cache) == 1 and cache.lookup("a", list(range(10)) + [99]) is None
    hit = cache.lookup("b", list(range(10)) + [99])
    assert set(map(id, hit.entry.blocks)) == first and torch.equal(hit.entry.kv, ramp + 1)
    assert cache.allocated == 3 * block
    assert cache.store("c", [7, 7], ramp[:, :, :, :2])  # one block: two left free to allocate
    assert cache.allocated == 4 * block and len(cache) == 2
    cache.clear()
    assert (len(cache), cache.bytes, cache.allocated) == (0, 0, 0)


def _chat(turns: list[str], answers: list[str]) -> list[dict]:
    messages = []
    for i, turn in enumerate(turns):
        messages.append({"role": "user", "content": turn})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    return messages


@pytest.fixture(scope="module")
def engines(decoder):
    from trserve.engine.engine import BatchEngine, EngineConfig

    if decoder.engine.runner.native is None:
        pytest.skip("prefix caching runs with the native forward only")
    cached = BatchEngine(decoder, EngineConfig(max_batch=2))
    cold = BatchEngine(decoder, EngineConfig(max_batch=2, prefix_cache_mb=0))
    assert cached.prefix is not None and cold.prefix is None
    return cached, cold


def test_cached_keys_and_values_are_the_bits_a_prefill_writes(decoder, engines):
    """After a TR request (trees with branches and chains, kept paths moved down the row), its cached
    entry equals what prefilling the same tokens in one go writes."""
    from trserve.engine import GenerationRequest

    cached, _ = engines
    cached.prefix.clear()
    prepared = decoder.prepare(GenerationRequest(
        messages=[{"role": "user", "content": "List the days of the week, then list them again in reverse."}],
        max_new_tokens=48, mode="tr"))
    matrix = decoder.new_tenant()
    cached.generate(prepared, tenant="bits", matrix=matrix)  # the tenant's matrix and history warm
    cached.prefix.clear()
    result = cached.generate(prepared, tenant="bits", matrix=matrix)
    assert result.stats.steps < len(result.ids) - 1  # some steps accepted drafts
    hit = cached.prefix.lookup("bits", list(prepared.ids) + result.ids + [0])
    assert hit is not None
    entry = hit.entry
    n = entry.tokens.shape[0]
    # the prompt and every committed token but the last went through the model (all of them where the last
    # step's accepted path was cut at max_new_tokens)
    assert n in (len(prepared.ids) + len(result.ids) - 1, len(prepared.ids) + len(result.ids))
    runner = cached.runner
    with cached.stepping():
        row = runner.kv.open_row()
        ids = torch.tensor(entry.tokens.tolist())
        for s in range(0, n, 128):
            e = min(n, s + 128)
            runner.prefill(row, ids[s:e], torch.tensor([e - s - 1]))
        fresh = runner.kv.row_view(row)[:, :, :, :n].clone()
        runner.kv.rows.lens[row] = 0
    assert torch.equal(fresh, entry.kv)


def test_a_second_turn_reuses_the_first_and_decodes_the_same_tokens(decoder, engines):
    from trserve.engine import GenerationRequest

    cached, cold = engines
    cached.prefix.clear()
    turn1 = "Write a Python function that returns the n-th Fibonacci number."
    turn2 = "Now add a docstring and type hints to it."
    outputs = {}
    for name, engine in (("cached", cached), ("cold", cold)):
        for mode in ("tr", "ar"):
            prepared = decoder.prepare(GenerationRequest(messages=_chat([turn1], []), max_new_tokens=40, mode=mode))
            first = engine.generate(prepared, tenant=f"t-{mode}")
            second = engine.generate(decoder.prepare(GenerationRequest(
                messages=_chat([turn1, turn2], [first.text]), max_new_tokens=40, mode=mode)), tenant=f"t-{mode}")
            outputs[name, mode] = (first.ids, second.ids, second.stats.cached_tokens, len(prepared.ids))
    for mode in ("tr", "ar"):
        assert outputs["cached", mode][:2] == outputs["cold", mode][:2]
        # the whole first prompt (and the part of its answer the chat template renders the same) was reused
        assert outputs["cached", mode][2] >= outputs["cached", mode][3] and outputs["cold", mode][2] == 0
    assert outputs["cached", "tr"][:2] == outputs["cached", "ar"][:2]  # lossless: TR is plain greedy's output
    # another tenant's identical second prompt reuses nothing
    other = cached.generate(decoder.prepare(GenerationRequest(
        messages=_chat([turn1, turn2], ["def fib(n):"]), max_new_tokens=4, mode="ar")), tenant="someone-else")
    assert other.stats.cached_tokens == 0


def test_requests_waiting_with_the_same_prompt_prefill_it_once_and_decode_what_they_would_alone(decoder, engines):
    """n > 1 choices (the OpenAI layer submits one request per choice): the first prefills the prompt,
    which is kept as soon as it is in because the others wait with it; they load it and run only the
    prompt's last token, then decode the tokens they decode alone (seeded sampling, TR and AR)."""
    import queue

    from trserve.engine import GenerationRequest, SamplingParams

    cached, cold = engines
    messages = [{"role": "user", "content": "Name three rivers of Europe and say one thing about each."}]
    for mode in ("tr", "ar"):
        cached.prefix.clear()
        preps = [decoder.prepare(GenerationRequest(messages=messages, max_new_tokens=24, mode=mode,
                                                   sampling=SamplingParams(temperature=0.8, seed=seed)))
                 for seed in (1, 2, 3)]
        items: queue.SimpleQueue = queue.SimpleQueue()
        for i, prepared in enumerate(preps):  # queued together, before any step
            cached.submit(prepared, lambda item, i=i: items.put((i, item)), tenant=f"n-{mode}")
        results = {}
        with cached.stepping():
            while len(results) < 3:
                cached.step()
                while not items.empty():
                    i, item = items.get()
                    assert not isinstance(item, Exception), item
                    if not hasattr(item, "tokens"):
                        results[i] = item
        p = len(preps[0].ids)
        assert [results[i].stats.cached_tokens for i in range(3)] == [0, p - 1, p - 1]
        for i, prepared in enumerate(preps):  # each choice as it decodes alone, on an engine without the cache
            assert results[i].ids == cold.generate(prepared, tenant=f"alone-{mode}-{i}").ids
        assert len({tuple(results[i].ids) for i in range(3)}) > 1  # the seeds give different choices


def test_share_keeps_a_prompt_only_for_a_waiting_prompt_that_gains_from_it():
    class Row:  # a KV holding one row of 20 columns (the real BatchKV is exercised above)
        def __init__(self, kv):
            self.kv = kv

        def row_view(self, row):
            return self.kv

    cache = PrefixCache(1 << 20, min_tokens=4)
    prompt = list(range(20))
    kv = Row(_kv(20))
    assert not cache.share("a", prompt, [], kv, 0, 0)  # nobody waits
    assert not cache.share("a", prompt, [[0, 1, 2, 9, 9]], kv, 0, 0)  # shares 3 < min_tokens
    assert not cache.share("a", prompt, [list(range(10))], kv, 0, 9)  # it already had all it could reuse
    assert cache.share("a", prompt, [list(range(10)) + [7]], kv, 0, 0)
    hit = cache.lookup("a", list(range(10)) + [7])
    assert hit is not None and hit.tokens == 10 and hit.entry.tokens.tolist() == list(range(10))  # the shared part
