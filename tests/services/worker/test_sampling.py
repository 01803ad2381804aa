"""Sampling through a real worker (port 0): seeds reproduce in-process output, bad params are refused."""

from __future__ import annotations

import json
import math

import grpc
import pytest

from trserve.engine import SamplingParams
from trserve_client import Client, build_request
from trserve.services.worker.config import Limits, WorkerConfig
from tests.services.worker_harness import rpc_error, serving

LIMITS = Limits(max_new_tokens_cap=64, default_max_new_tokens=8, max_prompt_tokens=128)
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
# float32-exact values, so the service (proto floats) and the in-process call sample the same law
SAMPLING = dict(temperature=0.75, top_p=0.875, top_k=40)


@pytest.fixture(scope="module")
def worker(decoder):
    yield from serving(WorkerConfig(port=0, metrics_port=None, limits=LIMITS), decoder)


@pytest.fixture(scope="module")
def client(worker):
    with Client(worker.addr, timeout=120) as c:
        yield c


def test_same_seed_same_output_through_the_service_and_in_process(client, decoder):
    def ids(**kw):
        reply = client.generate(messages=POEM, max_new_tokens=16, return_token_ids=True, tenant="sampling", **kw)
        return list(reply.token_ids)

    first = ids(**SAMPLING, seed=1234)
    assert len(first) == 16
    assert ids(**SAMPLING, seed=1234) == first  # the tenant's matrix is hot now: drafts differ, tokens do not
    assert ids(**SAMPLING, seed=1234, mode="ar") == first
    streamed = [t for chunk in client.stream(messages=POEM, max_new_tokens=16, **SAMPLING, seed=1234)
                for t in chunk.token_ids]
    assert streamed == first
    local = decoder.generate(messages=POEM, max_new_tokens=16, matrix=decoder.new_matrix(),
                             sampling=SamplingParams(**SAMPLING, seed=1234))
    assert local.ids == first
    assert ids(**SAMPLING, seed=1235) != first
    assert ids(temperature=0.0, seed=1234) == decoder.generate(messages=POEM, max_new_tokens=16).ids  # greedy


def test_min_p_through_the_service_is_the_in_process_law(client, decoder):
    """min_p reaches the engine (the text differs from the same seed without it) and, as the other
    samplers, TR (a hot matrix) and AR give the same tokens for a seed."""
    def ids(**kw):
        reply = client.generate(messages=POEM, max_new_tokens=16, return_token_ids=True, tenant="min-p", **kw)
        return list(reply.token_ids)

    sampling = dict(temperature=1.5, min_p=0.25)  # float32-exact
    for seed in (11, 12):
        first = ids(**sampling, seed=seed)
        assert ids(**sampling, seed=seed) == first == ids(**sampling, seed=seed, mode="ar")
        local = decoder.generate(messages=POEM, max_new_tokens=16, sampling=SamplingParams(**sampling, seed=seed))
        assert local.ids == first
    without = [decoder.generate(messages=POEM, max_new_tokens=16,
                                sampling=SamplingParams(temperature=1.5, seed=seed)).ids for seed in (11, 12)]
    assert without != [ids(**sampling, seed=seed) for seed in (11, 12)]


def test_generate_cli_sampling_flags(worker, client, capsys):
    from trserve.services.cli import main

    argv = ["generate", "--addr", worker.addr, "--json", "--raw", "--max-new-tokens", "8", "--temperature", "0.75",
            "--top-p", "0.875", "--top-k", "40", "--seed", "7", "Once upon a time"]
    outputs = []
    for _ in range(2):
        assert main(argv) == 0
        outputs.append(json.loads(capsys.readouterr().out)["token_ids"])
    expected = client.generate("Once upon a time", max_new_tokens=8, return_token_ids=True, **SAMPLING, seed=7)
    assert outputs[0] == outputs[1] == list(expected.token_ids)
    assert main(argv[:-1] + ["--temperature", "-1", "Hi"]) == 1
    assert "INVALID_ARGUMENT" in capsys.readouterr().err


def test_without_a_seed_each_request_draws_its_own(client):
    story = [{"role": "user", "content": "Tell me a story about a cat."}]
    texts = {client.generate(messages=story, max_new_tokens=12, temperature=1.0).text for _ in range(3)}
    assert len(texts) > 1


BAD_SAMPLING = {
    "negative temperature": (dict(temperature=-0.5), "temperature must be >= 0"),
    "NaN temperature": (dict(temperature=math.nan), "temperature must be >= 0 and finite"),
    "infinite temperature": (dict(temperature=math.inf), "temperature must be >= 0 and finite"),
    "top_p above 1": (dict(temperature=0.7, top_p=1.5), "top_p must be in (0, 1]"),
    "negative top_p": (dict(temperature=0.7, top_p=-0.1), "top_p must be in (0, 1]"),
    "NaN top_p": (dict(temperature=0.7, top_p=math.nan), "top_p must be in (0, 1]"),
    "negative top_k": (dict(temperature=0.7, top_k=-1), "top_k must be >= 0"),
    "bad top_p while greedy": (dict(temperature=0.0, top_p=2.0), "top_p must be in (0, 1]"),
    "negative min_p": (dict(temperature=0.7, min_p=-0.1), "min_p must be in [0, 1]"),
    "min_p above 1": (dict(temperature=0.7, min_p=1.5), "min_p must be in [0, 1]"),
    "NaN min_p": (dict(temperature=0.7, min_p=math.nan), "min_p must be in [0, 1]"),
    "bad min_p while greedy": (dict(temperature=0.0, min_p=1.5), "min_p must be in [0, 1]"),
}


@pytest.mark.parametrize("case", list(BAD_SAMPLING))
def test_invalid_sampling_params_are_invalid_argument(client, case):
    kwargs, message = BAD_SAMPLING[case]
    request = build_request("Hi", max_new_tokens=4, **kwargs)
    for call in (client.stub.Generate, lambda r, **kw: list(client.stub.GenerateStream(r, **kw))):
        e = rpc_error(call, request, timeout=30)
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, e.details())
        assert message in e.details(), (case, e.details())
