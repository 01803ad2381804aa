"""Probe round 3 (issue 56) on a real worker's HTTP API, driven by the `openai` package.

Defect 1: a victim streams while each trigger of the probe is sent beside it, from another tenant:
every trigger is a 400 naming why (at validation, or while decoding for those whose grammar meets a
limit later or whose rules leave no token), and the victim's stream ends as its output alone does.
Defects 2-3: grammars that can match nothing (or only "" where JSON is asked) and malformed GBNF are
400s naming why, never 200 with empty content or a 500."""

from __future__ import annotations

import json
import socket
import threading

import openai
import pytest

from trserve.services.openai.server import front_end
from trserve.services.worker.config import WorkerConfig
from tests.services.worker_harness import serving

pytestmark = pytest.mark.timeout(600)
VICTIM = dict(messages=[{"role": "user", "content": "Tell me a short story about a lighthouse keeper."}],
              max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
WIDE = " | ".join(f'"o{i}"' for i in range(2001))


@pytest.fixture(scope="module")
def worker(decoder):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    yield from serving(WorkerConfig(port=0, metrics_port=None, http_port=port), decoder, front_end=front_end)


def client(worker, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{worker.worker.http_port}/v1", api_key="none", max_retries=0,
                         timeout=300, default_headers={"X-Tenant": tenant})


def triggers(tok) -> list[tuple[dict, str]]:
    """(extra_body, words the 400 must carry): the issue's triggers, then three that pass validation and
    fail while decoding (a limit met after a chosen token, `ar` and sampled too; no token allowed)."""
    x, z, q = tok.convert_tokens_to_ids(["x", "Z", "Q"])
    late = 'start: "A" | "Z" y\ny: "A" | "Z" x\nx: ' + WIDE
    return [  # the decoding ones first, while the victim surely decodes
        ({"guided_grammar": late, "logit_bias": {str(z): 100}}, "cannot go on at output token 1.*max is 2000"),
        ({"guided_grammar": late, "logit_bias": {str(z): 100}, "mode": "ar", "temperature": 0.8, "seed": 5},
         "max is 2000"),
        ({"guided_grammar": 'start: "Z" "Q"', "stop_token_ids": [q], "min_tokens": 5},
         "no token is allowed at output token 1"),
        ({"guided_regex": "a{0}", "min_tokens": 1}, "allows only a stop token first"),
        ({"guided_choice": [f"opt{i}" for i in range(2001)]}, "max is 2000"),
        ({"guided_json": {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}}},
         "max is 2000"),
        ({"guided_regex": "(a{1000}){1000}"}, "too many expressions"),
        ({"guided_grammar": 'start: "a" start'}, "limit of the grammar engine"),
        ({"guided_choice": ["x"], "stop_token_ids": [x], "min_tokens": 2}, "allows only a stop token first"),
    ]


def test_no_trigger_fails_the_request_beside_it(worker, decoder) -> None:
    alice, mallory = client(worker, "alice"), client(worker, "mallory")
    model = alice.models.list().data[0].id
    alone = alice.chat.completions.create(model=model, **VICTIM).choices[0].message.content
    started, pieces, errors = threading.Event(), [], []

    def victim() -> None:
        try:
            for chunk in alice.chat.completions.create(model=model, stream=True, **VICTIM):
                if chunk.choices:
                    pieces.append(chunk.choices[0].delta.content or "")
                    started.set()
        except Exception as exc:  # noqa: BLE001 - the assertion below reports it
            errors.append(exc)
            started.set()

    thread = threading.Thread(target=victim)
    thread.start()
    assert started.wait(120)
    ask = dict(model=model, max_tokens=8, temperature=0, messages=[{"role": "user", "content": "One letter."}])
    for body, words in triggers(decoder.tokenizer):
        temperature = body.pop("temperature", 0)
        with pytest.raises(openai.BadRequestError, match=words):
            mallory.chat.completions.create(**{**ask, "temperature": temperature}, extra_body=body)
    thread.join(300)
    assert not errors, errors
    assert "".join(pieces) == alone
    again = alice.chat.completions.create(model=model, **VICTIM).choices[0].message.content
    assert again == alone  # and the server serves on


@pytest.mark.parametrize("body, words", [
    ({"guided_json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}, "can match no output"),
    ({"guided_regex": "[^\\s\\S]"}, "can match no output"),
    ({"guided_grammar": "start: start"}, "can match no output"),
    ({"guided_grammar": "root ::= (((("}, "cannot be read"),
    ({"guided_grammar": "root ::= ["}, "cannot be read"),
    ({"guided_grammar": "root ::= x{5,2}"}, "cannot be read"),
    ({"guided_grammar": "root ::= " + "(" * 3000 + '"a"' + ")" * 3000}, "nests too deeply"),
])
def test_grammars_that_cannot_be_served_are_400s(worker, body, words) -> None:
    c = client(worker, "alice")
    with pytest.raises(openai.BadRequestError, match=words) as err:
        c.chat.completions.create(model=c.models.list().data[0].id, max_tokens=8, extra_body=body,
                                  messages=[{"role": "user", "content": "Hi"}])
    assert err.value.status_code == 400 and json.dumps(err.value.body).count("Traceback") == 0


def test_tools_whose_parameters_use_defs_and_refs(worker) -> None:
    """Defect 4: a tool made by openai.pydantic_function_tool from nested pydantic models ($defs, $ref,
    anyOf) is taken, and the call the model writes validates as that model, as response_format does."""
    import pydantic

    class Address(pydantic.BaseModel):
        street: str
        city: str

    class Move(pydantic.BaseModel):
        """Record a person's move to a new address."""
        person: str
        to: Address
        previous: Address | None = None

    c = client(worker, "alice")
    tool = openai.pydantic_function_tool(Move)
    assert "$defs" in json.dumps(tool)  # the premise: parameters with refs of their own
    reply = c.chat.completions.create(
        model=c.models.list().data[0].id, max_tokens=96, temperature=0, tools=[tool], tool_choice="required",
        messages=[{"role": "user", "content": "Ana moved to 5 Main Street, Springfield."}])
    call = reply.choices[0].message.tool_calls[0].function
    assert reply.choices[0].finish_reason == "tool_calls" and call.name == "Move"
    Move.model_validate_json(call.arguments)


def test_call_schema_keeps_each_tools_parameters_a_document_of_their_own() -> None:
    from trserve.services.openai.toolgrammar import call_schema

    params = {"$defs": {"A": {"type": "integer"}}, "type": "object",
              "properties": {"a": {"$ref": "#/$defs/A"}, "self": {"$ref": "#"}, "$ref": {"type": "string"}}}
    got = call_schema({"f": {"parameters": params}, "g": {}})
    assert got["$defs"]["tool_0"]["properties"] == {"a": {"$ref": "#/$defs/tool_0/$defs/A"},
                                                   "self": {"$ref": "#/$defs/tool_0"}, "$ref": {"type": "string"}}
    assert got["$defs"]["tool_1"] == {"type": "object"} and params["properties"]["a"] == {"$ref": "#/$defs/A"}
    assert [c["properties"]["arguments"] for c in got["anyOf"]] == [{"$ref": "#/$defs/tool_0"},
                                                                    {"$ref": "#/$defs/tool_1"}]


def test_logprobs_carry_each_tokens_own_bytes_and_echo_its_exact_text(worker, decoder) -> None:
    """Defect 6: an answer whose characters are split across tokens (an emoji, a CJK character): each
    logprob's `bytes` are the token's own, so joined they rebuild the text (OpenAI's documented way),
    a partial token reads "bytes:\\x..", and echo of a token-id prompt returns its exact text."""
    c = client(worker, "alice")
    model = c.models.list().data[0].id
    answer = "Dragons 🐉 are 龍"
    reply = c.chat.completions.create(model=model, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2,
                                      messages=[{"role": "user", "content": "Hi"}], extra_body={"guided_choice": [answer]})
    content = reply.choices[0].logprobs.content
    assert reply.choices[0].message.content == answer
    assert bytes(b for e in content for b in e.bytes).decode("utf-8") == answer
    assert any(e.token.startswith("bytes:\\x") for e in content) and not any("\ufffd" in e.token for e in content)
    for e in content:
        for alt in e.top_logprobs:
            assert "\ufffd" not in alt.token and isinstance(alt.bytes, list)
    ids = decoder.tokenizer.encode(answer)
    echo = c.completions.create(model=model, prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=1)
    assert echo.choices[0].text.startswith(answer)
    lp = echo.choices[0].logprobs
    text = echo.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[len(ids)] == len(answer)
    assert lp.text_offset[-1] <= len(text)
    streamed = list(c.completions.create(model=model, prompt="Dragons are called", max_tokens=8, temperature=0,
                                         logprobs=1, stream=True, extra_body={"guided_choice": [" 龍 or 🐉"]}))
    offsets = [o for ch in streamed if ch.choices and ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset]
    assert offsets == sorted(offsets) and offsets[0] == 0
