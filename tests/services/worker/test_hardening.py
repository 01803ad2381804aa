"""Issue 15, the worker: work before admission is bounded (concurrent calls, body size, message
count), streamed text never runs ahead of a stop string, a shutdown ends calls properly, and a
long prompt's prefill counts inside the deadline. Each case: the exact status code, then a good
request still served."""

from __future__ import annotations

import logging
import threading
import time

import grpc
import pytest

from trserve_client import BalancedClient, Client, build_request
from trserve.services.worker.config import Limits, WorkerConfig
from tests.helpers import wait_for
from tests.services.worker_harness import BackgroundWorker, rpc_error, serving
from trserve.v1 import generate_pb2 as pb

LIMITS = Limits(max_new_tokens_cap=256, default_max_new_tokens=8, max_prompt_tokens=2048, max_messages=64)
MAX_BYTES = 64 * 1024
STORY = [{"role": "user", "content": "Write a very long story about a dragon who learns to read."}]
COFFEE = [{"role": "user", "content": "Write the French word for coffee, with its accent, three times."}]
EMOJI = [{"role": "user", "content": "List three emoji that mean happy."}]


@pytest.fixture(scope="module")
def worker(decoder):
    config = WorkerConfig(port=0, metrics_port=None, limits=LIMITS, max_batch=2, max_queue=4, max_concurrent_rpcs=3,
                          max_request_bytes=MAX_BYTES, prefill_chunk=512)
    yield from serving(config, decoder)


@pytest.fixture(scope="module")
def client(worker):
    with Client(worker.addr, timeout=120, retries=False) as c:  # the refusals themselves are under test
        yield c


def still_serves(client: Client) -> None:
    reply = client.generate("Hello, my name is", max_new_tokens=3)
    assert reply.stats.generated_tokens == 3 and reply.raw.finish_reason == pb.FINISH_REASON_LENGTH


def read_all(stream) -> None:
    try:
        for _ in stream:
            pass
    except grpc.RpcError:
        pass


# ---- 1. work before admission -------------------------------------------------------------------
def test_calls_beyond_the_cap_are_refused_before_tokenizing(client, worker):
    servicer = worker.worker.door
    streams = [client.stream(messages=STORY, max_new_tokens=256, mode="ar") for _ in range(3)]
    readers = [threading.Thread(target=read_all, args=(s,), daemon=True) for s in streams]
    try:
        for r in readers:  # readers that keep reading: two decode (max_batch=2), the third is queued
            r.start()
        wait_for(lambda: servicer.admission.calls == 3 and servicer.admission.active == 2, timeout=30)
        with servicer._tokenizer_lock:  # a call that tokenized would hang here
            t0 = time.monotonic()
            e = rpc_error(client.stub.Generate, build_request(messages=[{"role": "user", "content": "hi"}]), timeout=10)
            assert time.monotonic() - t0 < 5
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.details()
        assert "max_concurrent_rpcs=3" in e.details() and int(dict(e.trailing_metadata())["retry-after-ms"]) > 0
        e = rpc_error(client.tokenize, "hi")
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_concurrent_rpcs=3" in e.details()
    finally:
        for s in streams:
            s.cancel()
    wait_for(lambda: servicer.admission.calls == 0, timeout=30)
    still_serves(client)


def test_oversized_body_and_too_many_messages(client):
    e = rpc_error(client.stub.Generate, build_request("a" * (MAX_BYTES + 100)), timeout=30)
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(MAX_BYTES) in e.details(), e.details()
    million = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user")] * 10**6))
    million.messages.messages.add(role="user", content="hi")
    e = rpc_error(client.stub.Generate, million, timeout=30)
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and str(MAX_BYTES) in e.details(), e.details()
    many = [{"role": "user", "content": ""}] * 64 + [{"role": "user", "content": "hi"}]
    for call in (client.stub.Generate, lambda r, **kw: list(client.stub.GenerateStream(r, **kw))):
        e = rpc_error(call, build_request(messages=many), timeout=30)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "65 chat messages given; at most 64" in e.details()
    still_serves(client)


# ---- 5. streamed text and stop strings ---------------------------------------------------------------
STOP_CASES = {
    "multi-token stop": (COFFEE, [" French word"], pb.FINISH_REASON_STOP_SEQUENCE),
    "prefix of a stop that never completes": (COFFEE, [" French fries", "Café au Lait is a Frog"], None),
    "one multi-byte character": (EMOJI, ["\N{GLOWING STAR}"], pb.FINISH_REASON_STOP_SEQUENCE),
}


@pytest.mark.parametrize("mode", ["tr", "ar"])
@pytest.mark.parametrize("case", list(STOP_CASES))
def test_stream_equals_unary_text_with_stop_strings(client, mode, case, caplog):
    messages, stop, finish = STOP_CASES[case]
    caplog.set_level(logging.INFO)
    kw = dict(messages=messages, max_new_tokens=40, mode=mode, stop=stop, tenant=f"stops-{mode}")
    unary = client.generate(**kw)
    chunks = list(client.stream(**kw))
    assert "".join(c.text for c in chunks) == unary.text
    assert chunks[-1].raw.finish_reason == unary.raw.finish_reason
    if finish is not None:
        assert unary.raw.finish_reason == finish, unary.text
    else:
        assert unary.raw.finish_reason != pb.FINISH_REASON_STOP_SEQUENCE and " French" in unary.text
    assert all(s not in unary.text for s in stop)
    leaked = [r.getMessage() for r in caplog.records
              if r.levelno >= logging.WARNING or unary.text[:12] in r.getMessage()]
    assert not leaked  # no user text in the logs


# ---- 8. deadlines and shutdown ------------------------------------------------------------------------
def test_long_prefill_inside_the_deadline_gives_a_partial_result(client, worker):
    servicer = worker.worker.door
    ids = client.tokenize(messages=STORY)
    prompt = (ids * (2000 // len(ids) + 1))[:2000]  # 4 prefill chunks of 512 tokens
    for _ in range(2):
        # a deadline shorter than the prefill, longer than the longest step the engine can be in
        timeout = 1.5 * servicer._margin_s() + 0.5
        reply = client.generate(token_ids=prompt, max_new_tokens=64, mode="ar", timeout=timeout)
        assert reply.raw.finish_reason == pb.FINISH_REASON_TIME_LIMIT
        assert reply.stats.generated_tokens < 64
    still_serves(client)


# long enough to outlast the 1.5 s grace on any host (~15 ms a token here): the drain must cut it
UNARY = 200


def test_shutdown_ends_calls_with_a_final_chunk_or_unavailable(decoder, worker):
    stopping = BackgroundWorker(WorkerConfig(port=0, metrics_port=None, limits=LIMITS, max_batch=2, warmup=False),
                                decoder)
    stopping.wait_ready()
    balanced = BalancedClient([stopping.addr, worker.addr], timeout=120)
    try:
        with Client(stopping.addr, timeout=120) as direct:
            stream = direct.stream(messages=STORY, max_new_tokens=256, mode="ar")
            first = next(stream)
            served: list = []
            unary = threading.Thread(target=lambda: served.append(
                balanced.generate_served(messages=STORY, max_new_tokens=UNARY, mode="ar")))
            unary.start()  # a fresh balanced client starts with its first address: the stopping worker
            wait_for(lambda: stopping.worker.engine.runner.kv.active == 2, timeout=30)
            stopper = threading.Thread(target=stopping.stop, kwargs={"grace_s": 1.5})
            stopper.start()
            rest = list(stream)  # ends with a final chunk, not CANCELLED
            stopper.join(30)
            unary.join(120)
        last = rest[-1]
        assert last.raw.finish_reason == pb.FINISH_REASON_SHUTDOWN
        assert last.stats.generated_tokens == sum(len(c.token_ids) for c in [first, *rest]) < 256
        (reply,) = served  # UNAVAILABLE from the stopping worker, retried on the other one
        assert reply.retried_after == ("UNAVAILABLE",) and reply.addr == worker.addr
        done = reply.reply  # the whole answer, from the other worker (a story may end before UNARY tokens)
        assert (done.raw.finish_reason, done.stats.generated_tokens == UNARY) in {(pb.FINISH_REASON_LENGTH, True),
                                                                              (pb.FINISH_REASON_EOS, False)}
    finally:
        balanced.close()
        if stopper.is_alive():
            stopper.join(30)
