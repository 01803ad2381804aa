"""HTTP callers that go away, or send what no parser should recurse into (issue 45, defects 2-4): a
unary call whose client left is cancelled (its slot freed), a body cut short is CANCELLED, not
INTERNAL, and JSON nested 100,000 deep is the caller's error (400)."""

from __future__ import annotations

import http.client
import socket
import time

import pytest

from trserve.services.openai.server import front_end

from trserve.services.worker.config import Limits, WorkerConfig
from tests.services.worker_harness import serving

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def worker(decoder):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = WorkerConfig(port=0, metrics_port=None, http_port=port, limits=Limits(max_new_tokens_cap=4096))
    yield from serving(config, decoder, front_end=front_end)


def _post(worker, body: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", worker.worker.http_port, timeout=60)
    conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    return resp.status, resp.read()


def _count(worker, code: str) -> float:
    return worker.worker.metrics.value("trserve_requests_total", {"method": "openai.completions", "code": code})


def test_deeply_nested_json_is_a_400(worker) -> None:
    status, body = _post(worker, b"[" * 100_000 + b"]" * 100_000)
    assert status == 400 and b"too deeply" in body
    status, _ = _post(worker, b'{"prompt": "x", "extra": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert status == 400


def test_a_unary_call_whose_client_left_is_cancelled(worker) -> None:
    metrics = worker.worker.metrics
    cancelled = _count(worker, "CANCELLED")
    body = b'{"model": "smollm2-135m-instruct", "prompt": "Count from one to a thousand:", "max_tokens": 2048}'
    s = socket.create_connection(("127.0.0.1", worker.worker.http_port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    end = time.monotonic() + 30
    while metrics.value("trserve_active_requests") < 1 and time.monotonic() < end:
        time.sleep(0.05)
    assert metrics.value("trserve_active_requests") == 1, "the call never started decoding"
    s.close()
    end = time.monotonic() + 5
    while metrics.value("trserve_active_requests") > 0 and time.monotonic() < end:
        time.sleep(0.05)
    assert metrics.value("trserve_active_requests") == 0, "the request kept decoding for a client that left"
    assert _count(worker, "CANCELLED") == cancelled + 1 and _count(worker, "INTERNAL") == 0


def test_a_body_cut_short_is_cancelled_not_internal(worker) -> None:
    cancelled = _count(worker, "CANCELLED")
    s = socket.create_connection(("127.0.0.1", worker.worker.http_port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 5000\r\n\r\n{\"prompt\": ")
    time.sleep(0.3)
    s.close()
    end = time.monotonic() + 5
    while _count(worker, "CANCELLED") == cancelled and time.monotonic() < end:
        time.sleep(0.05)
    assert _count(worker, "CANCELLED") == cancelled + 1 and _count(worker, "INTERNAL") == 0


def test_a_stream_of_several_choices_whose_client_left_frees_every_choice(worker) -> None:
    """n > 1 streamed: each choice is its own request, merged into one stream; when the client goes,
    every choice's request ends (none keeps decoding for nobody)."""
    metrics = worker.worker.metrics
    body = (b'{"model": "smollm2-135m-instruct", "prompt": "Count from one to a thousand:", "max_tokens": 2048, '
            b'"n": 3, "stream": true, "temperature": 1.0, "seed": 5}')
    s = socket.create_connection(("127.0.0.1", worker.worker.http_port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    assert s.recv(4096).startswith(b"HTTP/1.1 200")  # streaming: every choice is decoding
    assert metrics.value("trserve_active_requests") == 3
    s.close()
    end = time.monotonic() + 10
    while metrics.value("trserve_active_requests") > 0 and time.monotonic() < end:
        time.sleep(0.05)
    assert metrics.value("trserve_active_requests") == 0, "a choice kept decoding for a client that left"
