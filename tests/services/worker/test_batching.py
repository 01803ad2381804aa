"""A worker batches its callers: many concurrent requests, none refused while the budgets hold,
each output what that request gets alone; a cancelled stream frees its KV row at once; a reader
that stops reading is cut off without stalling the others."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from trserve.engine.results import GenerationResult, StepChunk
from trserve_client import Client
from trserve.services.worker.bridge import EngineStream
from trserve.services.worker.config import Limits, WorkerConfig
from tests.helpers import wait_for
from tests.services.worker_harness import BackgroundWorker, serving

LIMITS = Limits(max_new_tokens_cap=256, default_max_new_tokens=8, max_prompt_tokens=512)
TOPICS = ["the sea", "a mountain", "a city at night", "an old library", "the desert", "a forest", "winter", "a robot"]


@pytest.fixture(scope="module")
def worker(decoder):
    yield from serving(WorkerConfig(port=0, metrics_port=None, limits=LIMITS, max_batch=16, max_queue=16), decoder)


def test_32_concurrent_callers_all_finish_as_alone(worker, decoder):
    prompts = [[{"role": "user", "content": f"Write one sentence about {TOPICS[i % 8]}."}] for i in range(32)]
    alone = {i: decoder.generate(messages=prompts[i], max_new_tokens=8, mode="ar").ids for i in range(8)}
    engine = worker.worker.engine
    steps_before = engine.steps

    def call(i: int):
        with Client(worker.addr, timeout=300) as client:
            return client.generate(messages=prompts[i], max_new_tokens=8, tenant=f"t{i % 4}", return_token_ids=True)

    with ThreadPoolExecutor(32) as pool:
        replies = list(pool.map(call, range(32)))
    assert len(replies) == 32 and all(r.stats.generated_tokens > 0 for r in replies)  # none refused
    for i, r in enumerate(replies):
        assert list(r.token_ids) == alone[i % 8], i  # batched, drafted by its tenant: the same tokens
    generated = sum(r.stats.generated_tokens for r in replies)
    assert engine.steps - steps_before < generated / 2  # requests shared forwards (serially: >= one step a token)


def test_cancelled_stream_frees_its_row_at_the_next_step(worker):
    engine = worker.worker.engine
    with Client(worker.addr, timeout=120) as client:
        stream = client.stream(messages=[{"role": "user", "content": "Write a very long story."}], max_new_tokens=256)
        next(stream)
        assert engine.runner.kv.active == 1
        stream.cancel()
        wait_for(lambda: engine.runner.kv.active == 0 and engine.reserved == 0, timeout=10)


def test_a_reader_that_falls_behind_is_cancelled_not_waited_for():
    loop = asyncio.new_event_loop()
    cancelled = threading.Event()
    stream = EngineStream(loop, cancelled, limit=4)
    for i in range(6):  # the engine thread keeps emitting; nobody reads
        stream.emit(StepChunk(tokens=[i], text=str(i)))
    loop.run_until_complete(asyncio.sleep(0))
    assert cancelled.is_set()  # the engine drops the request at its next step
    stream.emit(GenerationResult(ids=[0, 1, 2, 3], text="", finish_reason="cancelled", stats=None))

    async def drain():
        return [item async for item in stream.items()], await stream.finish()

    items, result = loop.run_until_complete(drain())
    assert [type(x).__name__ for x in items] == ["StepChunk"] * 4 + ["GenerationResult"]
    assert result.finish_reason == "cancelled"
    loop.close()


def test_a_reader_that_takes_nothing_for_stall_s_is_cancelled_though_not_far_behind():
    """Issue 28, defect 8: the time bound, on a fake clock. A reader that keeps taking chunks is never
    cut, however slowly the chunks come; one that takes none for longer than stall_s is."""
    loop = asyncio.new_event_loop()
    now = [0.0]
    cut: list[str] = []
    cancelled = threading.Event()
    stream = EngineStream(loop, cancelled, limit=1000, stall_s=5.0, on_cut=cut.append, clock=lambda: now[0])

    async def take_one():
        return await stream.items().__anext__()

    for i in range(20):  # a slow but steady reader: 4 s between chunks, each one taken
        stream.emit(StepChunk(tokens=[i], text=str(i)))
        loop.run_until_complete(asyncio.sleep(0))
        assert loop.run_until_complete(take_one()).tokens == [i]
        now[0] += 4.0
    assert not cancelled.is_set() and cut == []
    for i in range(3):  # now nobody reads: chunks wait 0, 4, 8 s
        stream.emit(StepChunk(tokens=[i], text=str(i)))
        loop.run_until_complete(asyncio.sleep(0))
        now[0] += 4.0
    assert cancelled.is_set() and cut == ["stalled"] and stream.cut_off == "stalled"
    loop.close()


@pytest.mark.timeout(300)
def test_a_stream_whose_reader_stops_frees_its_place_within_stall_s(decoder):
    """A real worker and a real client that reads one chunk, then nothing. Its HTTP/2 window is kept
    small (1 KiB, no BDP growth) so the transport backs up at once; the count bound is out of reach
    (stream_buffer 100000): only the time bound can free the place. The next request is served."""
    import grpc

    from tests.helpers import wait_for
    from trserve.v1 import generate_pb2 as gpb
    from trserve.v1 import generate_pb2_grpc as gpb_grpc

    config = WorkerConfig(port=0, metrics_port=None, stream_buffer=100000, stream_stall_s=2.0,
                          limits=Limits(max_new_tokens_cap=2048, max_prompt_tokens=512))
    w = BackgroundWorker(config, decoder)
    try:
        w.wait_ready()
        engine, stalled = w.worker.engine, w.metrics.stalled_streams
        channel = grpc.insecure_channel(w.addr, options=[("grpc.http2.lookahead_bytes", 1024),
                                                         ("grpc.http2.bdp_probe", 0)])
        request = gpb.GenerateRequest(text="Count from 1 to 1000, one number per line:\n1\n2\n3\n",
                                      max_new_tokens=2000, mode=gpb.DECODING_MODE_AR)
        stream = gpb_grpc.GenerateStub(channel).GenerateStream(request, timeout=240)
        next(stream)
        assert engine.runner.kv.active == 1
        wait_for(lambda: engine.runner.kv.active == 0, timeout=60)  # cut off: freed long before its 2000 tokens
        assert stalled.labels("stalled")._value.get() == 1 and stalled.labels("behind")._value.get() == 0
        chunks = list(stream)
        assert chunks[-1].finish_reason == gpb.FINISH_REASON_CANCELLED
        assert 0 < chunks[-1].stats.generated_tokens < 2000
        channel.close()
        with Client(w.addr, timeout=120) as client:
            assert client.generate("Hello", max_new_tokens=3).stats.generated_tokens == 3
    finally:
        w.stop()
