"""The OpenAI-compatible HTTP API of a real `trserve serve` (loopback, free ports, tenant tokens),
driven by the official `openai` package and curl, and checked against the gRPC API."""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import openai
import pytest

from trserve_client import Client

from .served import serving

TOKENS = {"alice": "alice-token-0123456789abcdef", "bob": "bob-token-0123456789abcdef"}
CHAT = [{"role": "user", "content": "Write one sentence about the ocean."}]

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A `trserve serve` process: (gRPC address, OpenAI base URL, its log file)."""
    tmp = tmp_path_factory.mktemp("openai")
    (tmp / "tokens.json").write_text(json.dumps(TOKENS))
    with serving(tmp, "--tenant-tokens", str(tmp / "tokens.json")) as (grpc_address, base_url):
        yield grpc_address, base_url, tmp / "serve.log"


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1], api_key=TOKENS["alice"], max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_id(server):
    with Client(server[0], timeout=60, token=TOKENS["alice"]) as c:
        return c.model_info().model


def test_models_lists_the_served_model(client, model_id):
    assert [m.id for m in client.models.list()] == [model_id]


def test_chat_streamed_and_grpc_agree(client, server, model_id):
    reply = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=24, temperature=0)
    text = reply.choices[0].message.content
    assert text and reply.choices[0].finish_reason in ("stop", "length")
    usage, extra = reply.usage, reply.model_extra["trserve"]
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.completion_tokens == len(extra["token_ids"]) > 0
    details = usage.completion_tokens_details
    drafted = sum(s["drafted"] for s in extra["draft_sources"].values())
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == drafted
    assert extra["mat"] >= 1.0 and extra["tenant"] == "alice"

    chunks = list(client.chat.completions.create(model=model_id, messages=CHAT, max_completion_tokens=24,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reply.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == usage.completion_tokens

    with Client(server[0], timeout=60, token=TOKENS["alice"]) as grpc_client:
        same = grpc_client.generate(messages=CHAT, max_new_tokens=24, tenant="alice", return_token_ids=True)
    assert list(same.token_ids) == extra["token_ids"] and same.text == text


def test_completion_matches_grpc(client, server, model_id):
    prompt = "The capital of France is"
    reply = client.completions.create(model=model_id, prompt=prompt, max_tokens=8, temperature=0)
    assert reply.object == "text_completion" and reply.choices[0].text
    streamed = client.completions.create(model=model_id, prompt=[prompt], max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == reply.choices[0].text
    with Client(server[0], timeout=60, token=TOKENS["alice"]) as grpc_client:
        same = grpc_client.generate(prompt, max_new_tokens=8, tenant="alice", return_token_ids=True)
    assert same.text == reply.choices[0].text and list(same.token_ids) == reply.model_extra["trserve"]["token_ids"]


def test_errors_are_openai_shaped(client, server, model_id):
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=model_id, messages=CHAT, n=0)
    assert bad.value.status_code == 400 and bad.value.body["param"] == "n" and "n must be an integer in 1..16" in \
        bad.value.message
    with pytest.raises(openai.BadRequestError) as too_many:  # the worker's own limits, as over gRPC
        client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=100000)
    assert "max_new_tokens must be in" in too_many.value.message
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-nothing", messages=CHAT)
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.InternalServerError) as late:  # too little time left to start decoding
        client.chat.completions.create(model=model_id, messages=CHAT, extra_headers={"X-Request-Timeout": "0.001"})
    assert late.value.status_code == 504 and late.value.code == "deadline_exceeded"
    # greedy, this prompt runs the whole 1000 tokens (~5 s on 2 cores): the deadline cuts it short
    count = [{"role": "user", "content": "Count from one to five hundred, in words, one number per line."}]
    reply = client.chat.completions.create(model=model_id, messages=count, max_tokens=1000, temperature=0,
                                           extra_headers={"X-Request-Timeout": "1.5"})  # stops early, partial
    assert reply.model_extra["trserve"]["finish_reason"] == "time_limit"
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content


def test_tenant_tokens(client, server, model_id):
    stranger = openai.OpenAI(base_url=server[1], api_key="not-a-token-0123456789", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        stranger.chat.completions.create(model=model_id, messages=CHAT, max_tokens=4)
    with pytest.raises(openai.PermissionDeniedError):
        client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=4, extra_headers={"X-Tenant": "bob"})
    # OpenAI's `user` is an end-user id: accepted, ignored (issue 46: it used to pick the tenant)
    reply = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=4, user="bob")
    assert reply.model_extra["trserve"]["tenant"] == "alice"
    bob = openai.OpenAI(base_url=server[1], api_key=TOKENS["bob"], max_retries=0)
    reply = bob.chat.completions.create(model=model_id, messages=CHAT, max_tokens=4, extra_headers={"X-Tenant": "bob"})
    assert reply.model_extra["trserve"]["tenant"] == "bob"


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl on PATH")
def test_curl(client, server, model_id):
    body = {"model": model_id, "messages": CHAT, "max_tokens": 24, "temperature": 0}
    out = subprocess.run(["curl", "-sS", f"{server[1]}/chat/completions", "-H", "Content-Type: application/json",
                          "-H", f"Authorization: Bearer {TOKENS['alice']}", "-d", json.dumps(body)],
                         capture_output=True, text=True, timeout=120, check=True)
    text = json.loads(out.stdout)["choices"][0]["message"]["content"]
    assert text == client.chat.completions.create(**body).choices[0].message.content
    unauthorised = subprocess.run(["curl", "-sS", "-w", "%{http_code}", "-o", "/dev/null", f"{server[1]}/models"],
                                  capture_output=True, text=True, timeout=60)
    assert unauthorised.stdout == "401"
    # with tenant tokens the API port faces tenants: no metrics naming them there (issue 46)
    hidden = subprocess.run(["curl", "-sS", "-w", "%{http_code}", "-o", "/dev/null",
                             server[1].removesuffix("/v1") + "/metrics"], capture_output=True, text=True, timeout=60)
    health = subprocess.run(["curl", "-sS", server[1].removesuffix("/v1") + "/health"], capture_output=True,
                            text=True, timeout=60)
    assert hidden.stdout == "403" and json.loads(health.stdout) == {"status": "ok"}


def test_logprobs_are_openais_shapes_and_the_same_under_tr_and_ar(client, model_id):
    """Issue 44, item 3: chat logprobs / top_logprobs and completions' logprobs N, unary and streamed,
    as the openai package reads them; TR's numbers equal plain decoding's exactly."""
    ask = dict(model=model_id, messages=CHAT, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    tr = client.chat.completions.create(**ask)
    ar = client.chat.completions.create(**ask, extra_body={"mode": "ar"})
    content = tr.choices[0].logprobs.content
    assert len(content) == tr.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert "".join(c.token for c in content) == tr.choices[0].message.content
    assert [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in content] == \
        [(c.token, c.logprob, [(t.token, t.logprob) for t in c.top_logprobs]) for c in ar.choices[0].logprobs.content]
    assert all(c.logprob <= 0 and c.top_logprobs[0].logprob >= c.logprob for c in content)
    streamed = [e for chunk in client.chat.completions.create(**ask, stream=True) if chunk.choices
                for e in (chunk.choices[0].logprobs.content if chunk.choices[0].logprobs else [])]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]
    assert client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=4).choices[0].logprobs is None
    text = client.completions.create(model=model_id, prompt="The ocean is", max_tokens=6, temperature=0, logprobs=2)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == text.usage.completion_tokens
    assert all(len(alternatives) == 2 for alternatives in lp.top_logprobs) and lp.text_offset[0] == 0
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=4, top_logprobs=3)


def test_min_p_over_http_is_grpcs_and_lossless(client, server, model_id):
    """vLLM's min_p (extra_body): the same tokens as gRPC's min_p for a seed, under TR and AR; out of
    [0, 1] a 400 naming it."""
    ask = dict(model=model_id, messages=CHAT, max_tokens=12, temperature=1.5, seed=5, extra_body={"min_p": 0.25})
    tr = client.chat.completions.create(**ask).model_extra["trserve"]["token_ids"]
    ar = client.chat.completions.create(**{**ask, "extra_body": {"min_p": 0.25, "mode": "ar"}})
    assert ar.model_extra["trserve"]["token_ids"] == tr
    with Client(server[0], timeout=60, token=TOKENS["alice"]) as grpc_client:
        same = grpc_client.generate(messages=CHAT, max_new_tokens=12, temperature=1.5, seed=5, min_p=0.25,
                                    tenant="alice", return_token_ids=True)
    assert list(same.token_ids) == tr
    for value in (-0.1, 1.5):
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(**{**ask, "extra_body": {"min_p": value}})
        assert bad.value.status_code == 400 and bad.value.body["param"] == "min_p" and "min_p" in bad.value.message


def test_n_choices_each_reproducible_with_a_seed(client, model_id):
    """Issue 44, item 4: n > 1 gives n choices decoded side by side, unary or streamed; greedy ones are the
    same text, seeded sampled ones are each reproducible (choice i samples with seed + i) and equal a
    single call with that seed; usage counts the prompt once and every choice's tokens."""
    greedy = client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=8, temperature=0, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2] and len({c.message.content for c in greedy.choices}) == 1
    ask = dict(model=model_id, messages=CHAT, max_tokens=12, temperature=1.0, seed=7)
    first, again = (client.chat.completions.create(**ask, n=3) for _ in range(2))
    texts = [c.message.content for c in first.choices]
    assert texts == [c.message.content for c in again.choices]
    assert client.chat.completions.create(**{**ask, "seed": 8}).choices[0].message.content == texts[1]
    assert first.usage.completion_tokens == sum(
        client.chat.completions.create(**{**ask, "seed": 7 + i}).usage.completion_tokens for i in range(3))
    assert first.usage.prompt_tokens == greedy.usage.prompt_tokens
    # streamed: every choice's deltas under its index, interleaved, the same texts; usage once, for all
    texts_streamed, usages = ["", "", ""], []
    for chunk in client.chat.completions.create(**ask, n=3, stream=True, stream_options={"include_usage": True}):
        for c in chunk.choices:
            texts_streamed[c.index] += c.delta.content or ""
        usages += [chunk.usage] if chunk.usage else []
    assert texts_streamed == texts and len(usages) == 1
    assert (usages[0].prompt_tokens, usages[0].completion_tokens) == (first.usage.prompt_tokens,
                                                                      first.usage.completion_tokens)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model_id, messages=CHAT, max_tokens=4, n=17)


def test_echo_scores_a_prompt_as_lm_evaluation_harness_asks(client, model_id):
    """Issue 44, item 3: lm-evaluation-harness's local-completions sends echo=true, logprobs=1,
    max_tokens=0 and reads the prompt's token logprobs (the first null). The same numbers under AR, and
    the model's own (each token's logprob is at most its top alternative's)."""
    prompt = "The capital of France is Paris. The capital of Italy is Rome."
    ask = dict(model=model_id, prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0)
    scored = client.completions.create(**ask)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == prompt and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert all(v <= max(t.values()) + 1e-9 for v, t in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]))
    assert scored.usage.completion_tokens == 0 and scored.usage.prompt_tokens == len(lp.tokens)
    ar = client.completions.create(**ask, extra_body={"mode": "ar"}).choices[0].logprobs
    assert ar.token_logprobs == lp.token_logprobs and ar.tokens == lp.tokens
    more = client.completions.create(**{**ask, "max_tokens": 3})
    assert more.choices[0].text.startswith(prompt) and len(more.choices[0].logprobs.tokens) == len(lp.tokens) + 3
    assert more.choices[0].logprobs.token_logprobs[: len(lp.tokens)] == lp.token_logprobs
    for bad in ({"max_tokens": 0, "echo": False}, {"stream": True}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(**{**ask, **bad})


def test_structured_output_as_the_openai_package_asks(client, server, model_id):
    """Issue 44, item 1: a json_schema reply the package parses into its pydantic model (sync, unary and
    streamed, and async), vLLM's guided_choice / guided_regex through extra_body, the same text under TR
    and AR, and a schema the grammar engine cannot compile answered 400 naming why."""
    import asyncio

    import pydantic

    class Person(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        name: str
        age: int
        city: str

    ask = dict(model=model_id, temperature=0, max_tokens=64, messages=[
        {"role": "user", "content": "Extract the person as JSON: Maria Lopez is a 34 year old engineer in Madrid."}])
    parsed = client.chat.completions.parse(**ask, response_format=Person)
    person = parsed.choices[0].message.parsed
    assert isinstance(person, Person) and person.age == 34 and parsed.choices[0].finish_reason == "stop"
    text = parsed.choices[0].message.content
    fmt = {"type": "json_schema", "json_schema": {"name": "Person", "strict": True, "schema": Person.model_json_schema()}}
    ar = client.chat.completions.create(**ask, response_format=fmt, extra_body={"mode": "ar"})
    assert ar.choices[0].message.content == text
    streamed = "".join(c.choices[0].delta.content or "" for c in
                       client.chat.completions.create(**ask, response_format=fmt, stream=True) if c.choices)
    assert streamed == text

    async def async_call():
        aclient = openai.AsyncOpenAI(base_url=server[1], api_key=TOKENS["alice"], max_retries=0, timeout=120)
        try:
            return await aclient.chat.completions.create(**ask, response_format={"type": "json_object"})
        finally:
            await aclient.close()

    obj = asyncio.run(async_call()).choices[0]
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.message.content), dict)
    yes_no = client.chat.completions.create(**{**ask, "messages": CHAT}, extra_body={"guided_choice": ["yes", "no"]})
    assert yes_no.choices[0].message.content in ("yes", "no")
    digits = client.completions.create(model=model_id, prompt="The year is", max_tokens=8, temperature=0,
                                       extra_body={"guided_regex": " [0-9]{4}"})
    assert len(digits.choices[0].text) == 5 and digits.choices[0].text[1:].isdigit()
    with pytest.raises(openai.BadRequestError, match="objectx"):
        client.chat.completions.create(**ask, extra_body={"guided_json": {"type": "objectx"}})


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}}, "required": ["timezone"]}}}


def test_tool_calls_as_the_openai_package_reads_them(client, model_id):
    """Issue 44, item 2: tool_choice "required" and a named function give one tool call the package
    parses (unary and streamed deltas alike, TR == AR), its arguments following the tool's schema; a
    tool-role turn continues the conversation; "auto" is answered (issue 59: tests/services/openai/test_tool_auto.py)."""
    ask = dict(model=model_id, temperature=0, max_tokens=64, tools=[WEATHER, TIME],
               messages=[{"role": "user", "content": "What is the weather in Paris, in celsius?"}])
    reply = client.chat.completions.create(**ask, tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in ("get_weather", "get_time")
    named = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    weather = named.choices[0].message.tool_calls[0]
    args = json.loads(weather.function.arguments)
    assert weather.function.name == "get_weather" and set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    ar = client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                        extra_body={"mode": "ar"})
    assert ar.choices[0].message.tool_calls[0].function.arguments == weather.function.arguments
    deltas = [c.choices[0] for c in client.chat.completions.create(
        **ask, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True) if c.choices]
    streamed = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert len(streamed) == 1 and streamed[0].function.name == "get_weather" and deltas[-1].finish_reason == "tool_calls"
    assert streamed[0].function.arguments == weather.function.arguments and not any(d.delta.content for d in deltas)
    follow = client.chat.completions.create(model=model_id, temperature=0, max_tokens=24, tools=[WEATHER], messages=[
        *ask["messages"], {"role": "assistant", "content": None, "tool_calls": [weather.model_dump()]},
        {"role": "tool", "tool_call_id": weather.id, "content": '{"temperature": 21, "sky": "sunny"}'}], tool_choice="none")
    assert follow.choices[0].finish_reason in ("stop", "length") and follow.choices[0].message.content
    auto = client.chat.completions.create(**ask).choices[0]  # tool_choice defaults to "auto" with tools
    assert auto.message.content or auto.message.tool_calls  # the shipped hermes template (test_tool_auto.py)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "nope"}})


def test_a_forged_path_cannot_write_a_log_line(server):
    """Issue 56, defect 5: a percent-encoded newline in the path (no credentials) stays on its access
    line, escaped, in the log `trserve serve` writes."""
    import urllib.error
    import urllib.request

    forged = "FORGED INFO trserve.access: GET /admin -> 200"
    path = "/v1/models/x%0a" + urllib.request.quote(forged) + "%0d%1b%5b31m"
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(server[1].removesuffix("/v1") + path, timeout=30)
    for _ in range(50):  # the access line is written once the response has ended
        lines = server[2].read_text().splitlines()
        if any(forged in line for line in lines):
            break
        time.sleep(0.1)
    hits = [line for line in lines if forged in line]
    assert hits and all(" trserve.access: GET /v1/models/x\\nFORGED" in line and "\\r\\x1b[31m" in line
                        for line in hits), hits
    assert not any(line.startswith("FORGED") for line in lines)


def test_tenant_token_refusals_carry_the_request_id(server):
    """Issue 56, defect 8: the gRPC interceptor's refusals (no token, an unknown one, another tenant's)
    carry the call's request id in their trailers, as every other error does; made when not given."""
    import grpc

    from trserve.v1 import generate_pb2 as pb
    from trserve.v1 import generate_pb2_grpc

    with grpc.insecure_channel(server[0]) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        ask = pb.GenerateRequest(text="Hi", max_new_tokens=1, tenant="bob")
        for token, code in ((None, grpc.StatusCode.UNAUTHENTICATED), ("nope", grpc.StatusCode.UNAUTHENTICATED),
                            (TOKENS["alice"], grpc.StatusCode.PERMISSION_DENIED)):
            auth = (("authorization", f"Bearer {token}"),) if token else ()
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(ask, metadata=auth + (("x-request-id", f"r-{code.name}"),), timeout=30)
            assert refused.value.code() == code
            assert ("x-request-id", f"r-{code.name}") in refused.value.trailing_metadata()
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(ask, timeout=30)
        made = dict(refused.value.trailing_metadata())["x-request-id"]
        assert len(made) == 32
