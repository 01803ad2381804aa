"""Fair prefill (issue 56, defect 9; engine/scheduler.py): prompts in progress interleave their chunks,
fewest chunks left first with each step waited counting against it, so a short prompt arriving behind
long ones gets its first token after at most a chunk of theirs; the rows that prompts in progress
swap and move (a short one joining past a long one, a running one retiring) keep every output equal
to its output alone; and a tenant's queued prompt tokens are bounded."""

from __future__ import annotations

import pytest

from trserve.core.errors import ResourceExhausted
from trserve.engine import GenerationRequest
from trserve.engine.engine import BatchEngine, EngineConfig
from trserve.engine.results import GenerationResult, StepChunk
from tests.conftest import load_prompts

CHUNK = 64


def _long(decoder, n: int, salt: int) -> tuple[int, ...]:
    text = " ".join(q["turns"][0] for q in load_prompts("spec_bench")[salt: salt + 40])
    return tuple(decoder.tokenizer.encode(text)[:n])


def test_a_short_prompt_is_not_queued_behind_long_ones(decoder) -> None:
    longs = [dict(input_ids=_long(decoder, 600 + 50 * i, 3 * i), max_new_tokens=6, mode=mode)
             for i, mode in enumerate(("tr", "ar", "tr"))]
    running = dict(messages=[{"role": "user", "content": "Count from one to twenty."}], max_new_tokens=30)
    short = dict(messages=[{"role": "user", "content": "Say hi."}], max_new_tokens=8, mode="tr")
    requests = [running, *longs, short]
    engine = BatchEngine(decoder, EngineConfig(max_batch=8, prefill_chunk=CHUNK))
    matrix, outs, first = decoder.new_matrix(), [[] for _ in requests], {}

    def emit(i: int):
        def put(item) -> None:
            if isinstance(item, StepChunk) and i not in first:
                first[i] = engine.steps
            outs[i].append(item)
        return put

    with engine.stepping():
        engine.submit(decoder.prepare(GenerationRequest(**running)), emit(0), matrix=matrix)
        while 0 not in first:
            engine.step()
        for i, kwargs in enumerate(longs, 1):
            engine.submit(decoder.prepare(GenerationRequest(**kwargs)), emit(i), matrix=matrix)
        for _ in range(3):  # the long prompts are under way
            engine.step()
        assert len(engine.scheduler.prefills) == 3 and any(0 < x.place.done for x in engine.scheduler.prefills)
        submitted = engine.steps
        engine.submit(decoder.prepare(GenerationRequest(**short)), emit(4), matrix=matrix)
        while engine.running or engine.waiting or engine.prefilling:
            engine.step()
    assert first[4] - submitted <= 2  # its own chunk in the next step, or the one after
    assert first[4] < min(first[i] for i in (1, 2, 3))  # ahead of prompts that came before it
    for kwargs, out in zip(requests, outs):
        result = out[-1]
        assert isinstance(result, GenerationResult), result
        assert result.ids == decoder.generate(GenerationRequest(**kwargs)).ids


def test_long_prompts_still_progress_beside_a_stream_of_short_ones(decoder) -> None:
    """No starvation: a long prompt gets a chunk at least every max(4, P) + 1 steps (P prompts in progress,
    at most max_batch) while a short prompt arrives every step, more than the engine can prefill."""
    engine = BatchEngine(decoder, EngineConfig(max_batch=8, prefill_chunk=CHUNK))
    matrix, results = decoder.new_matrix(), []
    long = GenerationRequest(input_ids=_long(decoder, 8 * CHUNK, 1), max_new_tokens=2, mode="ar")
    with engine.stepping():
        engine.submit(decoder.prepare(long), results.append, matrix=matrix)
        steps = 0
        while not any(isinstance(r, GenerationResult) for r in results):
            short = GenerationRequest(messages=[{"role": "user", "content": f"Say {steps}."}], max_new_tokens=1)
            engine.submit(decoder.prepare(short), lambda item: None, matrix=matrix)  # one more every step
            engine.step()
            steps += 1
            assert steps <= 8 * (8 + 1) + 2, "the long prompt starved"
        while engine.running or engine.waiting or engine.prefilling:
            engine.step()


def test_a_tenants_queued_prompt_tokens_are_bounded(decoder) -> None:
    engine = BatchEngine(decoder, EngineConfig(max_batch=8, prefill_chunk=CHUNK, max_tenant_prompt_tokens=1000))
    prompt = _long(decoder, 600, 0)
    ask = lambda: decoder.prepare(GenerationRequest(input_ids=prompt, max_new_tokens=2))  # noqa: E731
    engine.submit(ask(), lambda item: None, tenant="a")  # a tenant with nothing queued is always taken
    with pytest.raises(ResourceExhausted, match="tenant 'a' has 600 prompt tokens queued.*bound of 1000"):
        engine.submit(ask(), lambda item: None, tenant="a")
    engine.submit(ask(), lambda item: None, tenant="b")  # another tenant's queue is its own
    with engine.stepping():
        while engine.running or engine.waiting or engine.prefilling:
            engine.step()
    engine.submit(ask(), lambda item: None, tenant="a")  # prefilled: queued no more
