"""Bad input, a full queue and cancellation: the right status code, an actionable message, and the
server keeps serving."""

from __future__ import annotations

import grpc
import pytest

from trserve_client import Client, build_request
from trserve.services.worker.config import Limits, WorkerConfig
from tests.helpers import wait_for
from tests.services.worker_harness import rpc_error, serving
from trserve.v1 import generate_pb2 as pb

LIMITS = Limits(max_new_tokens_cap=256, default_max_new_tokens=8, max_prompt_tokens=64)
INVALID = grpc.StatusCode.INVALID_ARGUMENT
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to read."}]


@pytest.fixture(scope="module")
def worker(decoder):
    yield from serving(WorkerConfig(port=0, metrics_port=None, limits=LIMITS, max_batch=1, max_queue=1), decoder)


@pytest.fixture(scope="module")
def client(worker):
    with Client(worker.addr, timeout=60, retries=False) as c:  # the refusals themselves are under test
        yield c


BAD_REQUESTS = {
    "empty prompt": (build_request(""), INVALID, "empty"),
    "blank prompt": (build_request("   "), INVALID, "empty"),
    "no input": (pb.GenerateRequest(), INVALID, "set one of text, messages or token_ids"),
    "oversized prompt (tokens)": (build_request(token_ids=[42] * 65), INVALID, "at most 64"),
    "oversized prompt (text)": (build_request("word " * 2000), INVALID, "characters; the limit is"),
    "max_new_tokens 0": (build_request("Hi", max_new_tokens=0), INVALID, "max_new_tokens must be in [1, 256]"),
    "max_new_tokens huge": (build_request("Hi", max_new_tokens=10**6), INVALID, "max_new_tokens must be in [1, 256]"),
    "bad tenant id": (build_request("Hi", tenant="acme corp/1"), INVALID, "tenant id 'acme corp/1' is invalid"),
    "bad domain id": (build_request("Hi", domain="a:b"), INVALID, "domain id"),
    "ids out of vocab": (build_request(token_ids=[1, 49152]), INVALID, "outside the vocabulary"),
    "negative id": (build_request(token_ids=[-3]), INVALID, "outside the vocabulary"),
    "stop id out of vocab": (build_request("Hi", stop_token_ids=[10**7]), INVALID, "outside the vocabulary"),
    "negative temperature": (build_request("Hi", temperature=-1.0), INVALID, "temperature must be >= 0"),
    "unknown role": (build_request(messages=[{"role": "wizard", "content": "hi"}]), INVALID, "role"),
    "no messages": (pb.GenerateRequest(messages=pb.ChatMessages()), INVALID, "non-empty list"),
    "empty messages": (build_request(messages=[{"role": "user", "content": " "}]), INVALID, "empty"),
    "unknown tree": (build_request("Hi", tree="../../etc/passwd"), grpc.StatusCode.NOT_FOUND, "unknown tree"),
    "empty stop sequence": (build_request("Hi", stop=[""]), INVALID, "empty string"),
    "many empty messages": (build_request(messages=[{"role": "user", "content": ""}] * 200
                                          + [{"role": "user", "content": "hi"}]), INVALID, "plus 16 per message"),
    "too many messages": (build_request(messages=[{"role": "user", "content": "hi"}] * 257), INVALID,
                          "257 chat messages given; at most 256"),
    "long stop sequence": (build_request("Hi", stop=["x" * 129]), INVALID, "the limit is 128"),
    "too many stop ids": (build_request("Hi", stop_token_ids=[5] * 65), INVALID, "at most 64"),
    "tiny temperature": (build_request("Hi", temperature=1e-39), INVALID, "temperature must be 0 (greedy) or in [0.01"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_input_is_refused_with_an_actionable_message(client, case):
    request, code, message = BAD_REQUESTS[case]
    for call in (client.stub.Generate, lambda r, **kw: list(client.stub.GenerateStream(r, **kw))):
        e = rpc_error(call, request, timeout=30)
        assert e.code() == code, (case, e.details())
        assert message in e.details(), (case, e.details())


def test_server_keeps_serving_after_bad_input(client, worker):
    rpc_error(client.generate, "", max_new_tokens=4)
    reply = client.generate("Hello, my name is", max_new_tokens=4)
    assert reply.stats.generated_tokens == 4 and reply.raw.finish_reason == pb.FINISH_REASON_LENGTH
    assert worker.metrics.value("trserve_requests_total", {"method": "Generate", "code": "INVALID_ARGUMENT"}) >= 1
    e = rpc_error(client.tokenize, "")
    assert e.code() == INVALID


def test_queue_full_then_cancel_stops_decoding(client, worker):
    metrics, admission = worker.metrics, worker.worker.door.admission
    engine = worker.worker.engine
    cancelled_before = metrics.value("trserve_finish_total", {"reason": "cancelled"})
    generated_before = metrics.value("trserve_generated_tokens_total")
    running = client.stream(messages=STORY, max_new_tokens=256, tenant="busy", mode="ar")  # one token per step
    received = sum(len(next(running).token_ids) for _ in range(3))  # decoding has started: the one slot is taken
    queued = client.stub.Generate.future(build_request("Hello", max_new_tokens=4), timeout=60)
    wait_for(lambda: admission.waiting == 1, timeout=30)

    e = rpc_error(client.generate, "Hello", max_new_tokens=4)
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "retry after" in e.details() and "max_queue=1" in e.details()
    trailers = dict(e.trailing_metadata())
    assert int(trailers["retry-after-ms"]) > 0

    received += sum(len(next(running).token_ids) for _ in range(2))
    running.cancel()
    wait_for(lambda: metrics.value("trserve_finish_total", {"reason": "cancelled"}) == cancelled_before + 1, timeout=30)
    assert queued.result().stats.generated_tokens == 4  # the queued request got the freed slot
    wait_for(lambda: metrics.value("trserve_requests_total", {"method": "GenerateStream", "code": "CANCELLED"}) >= 1, timeout=30)
    assert admission.active == 0 and admission.waiting == 0
    wait_for(lambda: engine.runner.kv.active == 0 and engine.reserved == 0, timeout=10)  # its KV row is freed
    # The cancelled call decoded only a few steps past what its caller read (not on to 256 tokens).
    cancelled_tokens = metrics.value("trserve_generated_tokens_total") - generated_before - 4
    assert received <= cancelled_tokens <= received + 8, (received, cancelled_tokens)


def test_a_plain_grpc_channel_with_the_shipped_service_config_retries_a_busy_worker(client, worker):
    """Issue 30 item 3: RESOURCE_EXHAUSTED carries the standard grpc-retry-pushback-ms trailer, and a
    channel with clients/python/trserve_client/service_config.json (what any gRPC language can load) retries it after
    that pause: the first attempt is refused, the call itself succeeds once the worker has room."""
    from trserve_client import channel_options
    from trserve.v1 import generate_pb2_grpc

    metrics, admission = worker.metrics, worker.worker.door.admission
    refused = {"method": "Generate", "code": "RESOURCE_EXHAUSTED"}
    running = client.stream(messages=STORY, max_new_tokens=256, tenant="busy", mode="ar")
    next(running)
    queued = client.stub.Generate.future(build_request("Hello", max_new_tokens=4), timeout=60)
    wait_for(lambda: admission.waiting == 1, timeout=30)
    e = rpc_error(client.generate, "Hello", max_new_tokens=4)  # no retries: refused, with both hints
    trailers = dict(e.trailing_metadata())
    assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(trailers["grpc-retry-pushback-ms"]) == int(trailers["retry-after-ms"]) > 0

    before = metrics.value("trserve_requests_total", refused)
    with grpc.insecure_channel(worker.addr, options=channel_options()) as channel:
        retried = generate_pb2_grpc.GenerateStub(channel).Generate.future(build_request("Hello", max_new_tokens=4),
                                                                         timeout=60)
        wait_for(lambda: metrics.value("trserve_requests_total", refused) >= before + 1, timeout=30)
        running.cancel()  # room again: the retry after the pushback is served
        assert retried.result().stats.generated_tokens == 4
    assert queued.result().stats.generated_tokens == 4
    wait_for(lambda: admission.active == 0 and admission.waiting == 0, timeout=30)
