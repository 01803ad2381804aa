"""What operators and browsers reach on the HTTP API port (issue 46, items 1-2): /health, /metrics,
/tokenize and /detokenize (vLLM's shapes), CORS from --allowed-origins only, a request id taken or
made and echoed (HTTP header, gRPC metadata, the access line and the error line of the call), and
tenants from X-Tenant (no tokens here), never from OpenAI's `user` field."""

from __future__ import annotations

import json
import logging
import socket
import time
import urllib.error
import urllib.request

import grpc
import pytest

from trserve.services.openai.server import front_end

from trserve.services.worker.config import WorkerConfig
from trserve.v1 import generate_pb2 as pb
from trserve.v1 import generate_pb2_grpc
from tests.services.worker_harness import serving

pytestmark = pytest.mark.timeout(300)
ORIGIN = "https://app.example.com"
MODEL = "team-model"  # --served-model-name: what callers name the bundled model here


@pytest.fixture(scope="module")
def worker(decoder):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = WorkerConfig(port=0, metrics_port=None, http_port=port, allowed_origins=(ORIGIN,),
                          served_model_name=MODEL)
    yield from serving(config, decoder, front_end=front_end)


def call(worker, method: str, path: str, body: object | None = None, headers: dict | None = None):
    """(status, headers, parsed body or text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{worker.worker.http_port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            status, head, raw = resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        status, head, raw = err.code, err.headers, err.read()
    text = raw.decode()
    try:
        return status, head, json.loads(text)
    except ValueError:
        return status, head, text


def test_the_served_model_name_is_what_callers_see(worker) -> None:
    assert [m["id"] for m in call(worker, "GET", "/v1/models")[2]["data"]] == [MODEL]
    status, _, body = call(worker, "POST", "/v1/completions", {"model": "smollm2-135m-instruct", "prompt": "Hi"})
    assert status == 404 and body["error"]["code"] == "model_not_found"
    with grpc.insecure_channel(worker.addr) as channel:
        assert generate_pb2_grpc.GenerateStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=30).model == MODEL


def test_health_is_200_when_serving_and_503_while_draining(worker) -> None:
    assert call(worker, "GET", "/health")[:3:2] == (200, {"status": "ok"})
    servicer = worker.worker.door
    servicer.draining = True
    try:
        status, _, body = call(worker, "GET", "/health")
        assert (status, body) == (503, {"status": "draining"})
    finally:
        servicer.draining = False
    servicer.ready = False
    try:
        assert call(worker, "GET", "/health")[0] == 503
    finally:
        servicer.ready = True


def test_metrics_on_the_api_port_are_the_workers_registry(worker) -> None:
    call(worker, "POST", "/tokenize", {"prompt": "hello"})
    status, head, text = call(worker, "GET", "/metrics")
    assert status == 200 and head["content-type"].startswith("text/plain")
    assert f'trserve_requests_total{{code="OK",method="openai.tokenize",model_name="{MODEL}"}}' in text
    assert "trserve_active_requests" in text


def test_tokenize_and_detokenize_round_trip(worker) -> None:
    tokenizer = worker.worker.door.decoder.tokenizer
    status, _, body = call(worker, "POST", "/tokenize", {"model": MODEL, "prompt": "The ocean is deep."})
    ids = tokenizer("The ocean is deep.", add_special_tokens=False)["input_ids"]
    assert status == 200 and body["tokens"] == ids and body["count"] == len(ids) and body["max_model_len"] > 0
    chat = call(worker, "POST", "/tokenize", {"messages": [{"role": "user", "content": "Hi"}]})[2]
    assert chat["count"] > 3  # the chat template's turns around "Hi"
    status, _, body = call(worker, "POST", "/detokenize", {"tokens": ids})
    assert (status, body) == (200, {"prompt": "The ocean is deep."})
    for bad, param in (({"tokens": [10 ** 9]}, None), ({"tokens": "abc"}, "tokens")):
        status, _, body = call(worker, "POST", "/detokenize", bad)
        assert status == 400 and body["error"]["param"] == param, body
    status, _, body = call(worker, "POST", "/tokenize", {"prompt": "a", "messages": []})
    assert status == 400 and "exactly one" in body["error"]["message"]


def test_cors_only_for_the_allowed_origins(worker) -> None:
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, head, _ = call(worker, "OPTIONS", "/v1/chat/completions", headers=preflight)
    assert status == 200 and head["access-control-allow-origin"] == ORIGIN
    status, head, _ = call(worker, "OPTIONS", "/v1/chat/completions", headers={**preflight, "Origin": "https://evil.example"})
    assert status == 400 and "access-control-allow-origin" not in head
    status, head, _ = call(worker, "GET", "/health", headers={"Origin": ORIGIN})
    assert head["access-control-allow-origin"] == ORIGIN and "x-request-id" in head["access-control-expose-headers"]


def test_a_request_id_is_echoed_and_on_its_log_lines(worker, caplog) -> None:
    from trserve.services.common.logcontext import RequestIdFilter

    caplog.set_level(logging.INFO)
    caplog.handler.addFilter(RequestIdFilter())  # as the CLI's handler: each record gets its call's id
    body = {"model": MODEL, "prompt": "One, two,", "max_tokens": 4, "temperature": 0}
    status, head, reply = call(worker, "POST", "/v1/completions", body, headers={"X-Request-Id": "req-42"})
    assert status == 200 and head["x-request-id"] == "req-42"
    usage = reply["usage"]
    # the access line is written once the response has ended, which may be just after the client has it
    deadline = time.monotonic() + 10
    while not [r for r in caplog.records if r.name == "trserve.access"] and time.monotonic() < deadline:
        time.sleep(0.01)
    (record,) = [r for r in caplog.records if r.name == "trserve.access" and r.request_id == "req-42"]
    line = record.getMessage()
    assert record.request_id == "req-42" and line.startswith("POST /v1/completions -> 200 tenant=default")
    assert f"tokens={usage['prompt_tokens']}+{usage['completion_tokens']}" in line
    # made when not given (or not a plain token); an error line carries the id of its call
    status, head, _ = call(worker, "POST", "/v1/completions", {**body, "max_tokens": -1},
                           headers={"X-Request-Id": "bad id\twith spaces"})
    made = head["x-request-id"]
    assert status == 400 and len(made) == 32 and made != "bad id\twith spaces"
    errors = [r for r in caplog.records if r.name == "trserve.openai" and "-> 400" in r.getMessage()]
    assert errors and errors[-1].request_id == made
    # gRPC: taken from metadata, sent back in the initial metadata
    with grpc.insecure_channel(worker.addr) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        _, rpc = stub.Tokenize.with_call(pb.TokenizeRequest(text="hi"), metadata=(("x-request-id", "g-7"),),
                                         timeout=30)
        assert ("x-request-id", "g-7") in rpc.initial_metadata()
        with pytest.raises(grpc.RpcError) as refused:  # an error carries it in its trailers
            stub.Tokenize(pb.TokenizeRequest(), metadata=(("x-request-id", "g-8"),), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("x-request-id", "g-8") in refused.value.trailing_metadata()


def test_the_tenant_is_x_tenant_never_user(worker) -> None:
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    assert call(worker, "POST", "/v1/completions", {**body, "user": "alice@example.com"})[2]["trserve"]["tenant"] \
        == "default"  # accepted (it used to be a 400) and ignored
    assert call(worker, "POST", "/v1/completions", body, headers={"X-Tenant": "team-a"})[2]["trserve"]["tenant"] \
        == "team-a"
    status, _, err = call(worker, "POST", "/v1/completions", body, headers={"X-Tenant": "bad tenant!"})
    assert status == 400 and err["error"]["param"] == "X-Tenant"
    tenants = {s.labels.get("tenant") for m in worker.worker.metrics.registry.collect() for s in m.samples}
    assert "alice@example.com" not in tenants


def test_metrics_name_the_model_count_lengths_and_drafts(worker) -> None:
    """Issue 46, item 3: vLLM's model_name label, request length histograms, and a drafts counter from
    which vLLM's mean acceptance length (1 + accepted / drafts) follows."""
    m = worker.worker.metrics
    before = (m.value("trserve_request_prompt_tokens_count"), m.value("trserve_drafts_total"))
    body = {"model": MODEL, "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", "max_tokens": 40, "temperature": 0}
    usage = call(worker, "POST", "/v1/completions", body)[2]["usage"]
    text = call(worker, "GET", "/metrics")[2]
    assert f'trserve_requests_total{{code="OK",method="openai.completions",model_name="{MODEL}"}}' in text
    assert m.value("trserve_request_prompt_tokens_count") == before[0] + 1
    assert m.value("trserve_request_max_tokens_bucket", {"le": "50.0"}) >= 1
    assert m.value("trserve_request_generation_tokens_sum") >= usage["completion_tokens"]
    drafts = m.value("trserve_drafts_total") - before[1]
    accepted = sum(m.value("trserve_draft_accepted_tokens_total", {"source": s}) for s in ("matrix", "context", "history"))
    assert 0 < drafts <= usage["completion_tokens"] and accepted > 0  # a counting prompt: drafts are accepted


def test_a_413_and_an_abandoned_stream_are_counted_as_what_they_are(worker) -> None:
    """Issue 46, item 3: a 413 counted as RESOURCE_EXHAUSTED (the "refusing requests" alert), a stream
    its reader left as OK."""
    m = worker.worker.metrics
    labels = {"method": "openai.completions"}
    exhausted = m.value("trserve_requests_total", {**labels, "code": "RESOURCE_EXHAUSTED"})
    invalid = m.value("trserve_requests_total", {**labels, "code": "INVALID_ARGUMENT"})
    status, _, _ = call(worker, "POST", "/v1/completions", {"model": MODEL, "prompt": "x" * (2 << 20)})
    assert status == 413
    assert m.value("trserve_requests_total", {**labels, "code": "INVALID_ARGUMENT"}) == invalid + 1
    assert m.value("trserve_requests_total", {**labels, "code": "RESOURCE_EXHAUSTED"}) == exhausted
    cancelled = m.value("trserve_requests_total", {**labels, "code": "CANCELLED"})
    ok = m.value("trserve_requests_total", {**labels, "code": "OK"})
    body = json.dumps({"model": MODEL, "prompt": "Count to a thousand:", "max_tokens": 2000, "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", worker.worker.http_port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    import time

    got, end = b"", time.monotonic() + 60
    while b"data:" not in got and time.monotonic() < end:  # streaming has begun
        got += s.recv(65536)
    assert b"data:" in got
    s.close()

    end = time.monotonic() + 10
    while m.value("trserve_requests_total", {**labels, "code": "CANCELLED"}) == cancelled and time.monotonic() < end:
        time.sleep(0.05)
    assert m.value("trserve_requests_total", {**labels, "code": "CANCELLED"}) == cancelled + 1
    assert m.value("trserve_requests_total", {**labels, "code": "OK"}) == ok


def test_grpc_logprobs_unary_and_streamed(worker) -> None:
    """Issue 44, item 3 over gRPC: GenerateRequest.logprobs / top_logprobs fill TokenLogprob per token,
    the stream's per chunk; top_logprobs without logprobs, or above 20, is INVALID_ARGUMENT."""
    ask = pb.GenerateRequest(text="One, two, three,", max_new_tokens=8, return_token_ids=True, logprobs=True,
                             top_logprobs=2)
    with grpc.insecure_channel(worker.addr) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        reply = stub.Generate(ask, timeout=60)
        assert [lp.token_id for lp in reply.logprobs] == list(reply.token_ids)
        assert all(len(lp.top) == 2 and lp.top[0].logprob >= lp.logprob for lp in reply.logprobs)
        chunks = list(stub.GenerateStream(ask, timeout=60))
        assert [(lp.token_id, lp.logprob) for c in chunks for lp in c.logprobs] == \
            [(lp.token_id, lp.logprob) for lp in reply.logprobs]
        assert not stub.Generate(pb.GenerateRequest(text="Hi", max_new_tokens=2), timeout=60).logprobs
        for bad in (pb.GenerateRequest(text="Hi", top_logprobs=2), pb.GenerateRequest(text="Hi", logprobs=True,
                                                                                      top_logprobs=21)):
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(bad, timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_grpc_prompt_logprobs(worker) -> None:
    """GenerateRequest.prompt_logprobs: each prompt token after the first, with top_logprobs alternatives."""
    with grpc.insecure_channel(worker.addr) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        ids = stub.Tokenize(pb.TokenizeRequest(text="Scoring this short text."), timeout=30).token_ids
        reply = stub.Generate(pb.GenerateRequest(text="Scoring this short text.", max_new_tokens=1, prompt_logprobs=True,
                                                 top_logprobs=2), timeout=60)
        assert [lp.token_id for lp in reply.prompt_logprobs] == list(ids)[1:] and not reply.logprobs
        assert all(len(lp.top) == 2 and lp.logprob <= lp.top[0].logprob for lp in reply.prompt_logprobs)
