"""A real `trserve serve` with a chat template of its own (`--chat-template`: ChatML that opens `<think>`
in the generation prompt unless {"enable_thinking": false}, as DeepSeek-R1's and Qwen3's do) and the
`think` reasoning parser (set by TRSERVE_REASONING_PARSER), driven by the `openai` package, curl-like
HTTP and the gRPC client: chat_template_kwargs reach the template over both APIs, continue_final_message
and add_generation_prompt shape the prompt, and replies split into reasoning_content and content, unary
and streamed, with the generated tokens those of plain decoding."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest

from trserve.services.openai.reasoning import split
from trserve.services.openai.reasoning_parsers import THINK
from trserve.v1 import generate_pb2 as pb
from trserve.v1 import generate_pb2_grpc
from trserve_client import Client, build_request
from tests.services.openai.served import serving

REPO = Path(__file__).resolve().parents[3]
TEMPLATE = ("{%- if count is defined %}{% for i in range(count) %}.{% endfor %}{% endif %}"
            "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
            "enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "What is 2+2?"}]
# the model continues an opened block, copying the reasoning it was shown, and closes it: a reply with both parts
COPY = [{"role": "user", "content": "Copy this line exactly: <think>Two plus two is four.</think>The answer is 4."},
        {"role": "assistant", "content": "<think>"}]
CONTINUE = {"continue_final_message": True, "add_generation_prompt": False}

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(gRPC address, OpenAI base URL)."""
    tmp = tmp_path_factory.mktemp("reasoning")
    (tmp / "think.jinja").write_text(TEMPLATE)
    with serving(tmp, "--chat-template", str(tmp / "think.jinja"), env={"TRSERVE_REASONING_PARSER": "think"}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[1], api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def grpc_client(server):
    with Client(server[0], timeout=300) as c:
        yield c


@pytest.fixture(scope="module")
def model_id(grpc_client):
    return grpc_client.model_info().model


def post(server, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(server[1].removesuffix("/v1") + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_chat_template_kwargs_reach_the_template_over_http_and_grpc(client, server, grpc_client, model_id):
    """enable_thinking false makes the template close the block in the prompt: more prompt tokens, the
    same count over HTTP (usage, /tokenize) and gRPC (stats, Tokenize), and a reply that is all content."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    thinking = client.chat.completions.create(model=model_id, messages=ASK, max_tokens=16, temperature=0)
    plain = client.chat.completions.create(model=model_id, messages=ASK, max_tokens=16, temperature=0, extra_body=off)
    tokenized = [post(server, "/tokenize", {"messages": ASK, **extra})[1] for extra in ({}, off)]
    assert [r.usage.prompt_tokens for r in (thinking, plain)] == [t["count"] for t in tokenized]
    assert plain.usage.prompt_tokens > thinking.usage.prompt_tokens  # "\n</think>\n\n" after "<think>\n"
    assert grpc_client.tokenize(messages=ASK, chat_template_kwargs={"enable_thinking": False}) == tokenized[1]["tokens"]
    by_grpc = grpc_client.generate(messages=ASK, max_new_tokens=16, chat_template_kwargs={"enable_thinking": False},
                                   return_token_ids=True)
    assert by_grpc.stats.prompt_tokens == plain.usage.prompt_tokens
    assert list(by_grpc.token_ids) == plain.model_extra["trserve"]["token_ids"]
    # the reply split by where the prompt left it: inside the opened block (all reasoning), or after it
    assert plain.choices[0].message.content == by_grpc.text and plain.choices[0].message.reasoning_content is None
    opened = grpc_client.generate(messages=ASK, max_new_tokens=16)
    message = thinking.choices[0].message
    assert (message.reasoning_content, message.content) == split(opened.text, THINK, "inside")
    assert message.reasoning_content and "</think>" not in opened.text  # the bundled model does not close it


def test_reasoning_content_unary_and_streamed_with_the_openai_package(client, grpc_client, model_id):
    """A reply that closes its reasoning: reasoning_content before the tag, content after; streamed deltas
    carry reasoning_content until the tag, then content, and join to the unary answer. TR == AR tokens."""
    whole = grpc_client.generate(messages=COPY, max_new_tokens=40, continue_final_message=True,
                                 add_generation_prompt=False, return_token_ids=True)
    reasoning, content = split(whole.text, THINK, "inside")
    assert reasoning and content, whole.text  # the model did close the block: both parts exercised
    for mode in ("tr", "ar"):
        reply = client.chat.completions.create(model=model_id, messages=COPY, max_tokens=40, temperature=0,
                                               extra_body={**CONTINUE, "mode": mode})
        message = reply.choices[0].message
        assert (message.reasoning_content, message.content) == (reasoning, content)
        assert reply.model_extra["trserve"]["token_ids"] == list(whole.token_ids)  # gRPC's (TR) ids, in TR and AR
    stream = client.chat.completions.create(model=model_id, messages=COPY, max_tokens=40, temperature=0, stream=True,
                                            extra_body=CONTINUE)
    deltas = [(c.choices[0].delta.model_extra.get("reasoning_content"), c.choices[0].delta.content)
              for c in stream if c.choices]
    assert "".join(r or "" for r, _ in deltas) == reasoning and "".join(c or "" for _, c in deltas) == content
    first_content = next(i for i, (_, c) in enumerate(deltas) if c)
    assert not any(r for r, _ in deltas[first_content + 1:])  # reasoning first, then the answer
    assert all("</think>" not in (r or "") + (c or "") for r, c in deltas)


def test_responses_carry_the_reasoning_as_a_reasoning_item_unary_and_streamed(client, model_id):
    """/v1/responses with the reasoning parser: what a chat completion gives as reasoning_content is a
    reasoning item before the message, streamed as response.reasoning_text.delta events before any answer
    text; the same tokens as the chat completion's; a reasoning item sent back in input is accepted."""
    chat = client.chat.completions.create(model=model_id, messages=COPY[:1], max_tokens=40, temperature=0)
    message = chat.choices[0].message
    assert message.reasoning_content  # the template opens the reasoning: the reasoning item is exercised
    reply = client.responses.create(model=model_id, input=COPY[0]["content"], max_output_tokens=40, temperature=0)
    assert reply.output[0].type == "reasoning" and reply.output[0].content[0].text == message.reasoning_content
    assert [i.type for i in reply.output[1:]] == ["message"] and reply.output_text == (message.content or "")
    assert reply.model_extra["trserve"]["token_ids"] == chat.model_extra["trserve"]["token_ids"]
    with client.responses.stream(model=model_id, input=COPY[0]["content"], max_output_tokens=40,
                                 temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == message.reasoning_content
    first_text = next((i for i, e in enumerate(events) if e.type == "response.output_text.delta" and e.delta),
                      len(events))
    assert not any(e.type.startswith("response.reasoning_text") for e in events[first_text:])
    assert [i.type for i in final.output] == [i.type for i in reply.output]
    assert final.output[0].content[0].text == message.reasoning_content and final.output_text == reply.output_text
    turns = [{"role": "user", "content": COPY[0]["content"]}, *(i.model_dump(exclude_none=True) for i in reply.output),
             {"role": "user", "content": "Thanks."}]
    again = client.responses.create(model=model_id, input=turns, max_output_tokens=4, temperature=0)
    assert again.status in ("completed", "incomplete") and again.output[0].type == "reasoning"


def test_a_reply_cut_inside_its_reasoning_has_no_content(client, model_id):
    for stream in (False, True):
        reply = client.chat.completions.create(model=model_id, messages=ASK, max_tokens=3, temperature=0,
                                               stream=stream)
        if stream:
            chunks = [c for c in reply if c.choices]
            assert not any(c.choices[0].delta.content for c in chunks)
            assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
            assert chunks[-1].choices[0].finish_reason == "length"
        else:
            assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content is None
            assert reply.choices[0].message.reasoning_content


def test_continue_final_message_and_add_generation_prompt_shape_the_prompt(server, grpc_client):
    status, continued = post(server, "/tokenize", {"messages": COPY, **CONTINUE})
    assert status == 200
    assert continued["tokens"] == grpc_client.tokenize(messages=COPY, **CONTINUE)
    status, closed = post(server, "/tokenize", {"messages": COPY, "add_generation_prompt": False})
    _, opened = post(server, "/tokenize", {"messages": COPY})
    # the same turns: left open after "<think>", closed, closed and the next assistant turn opened
    assert status == 200 and continued["count"] < closed["count"] < opened["count"]
    assert closed["tokens"][:continued["count"]] == continued["tokens"] == opened["tokens"][:continued["count"]]
    assert opened["tokens"][:closed["count"]] == closed["tokens"]


@pytest.mark.parametrize("fields,param,message", [
    ({"continue_final_message": True}, "continue_final_message", "cannot both be true"),
    ({**CONTINUE, "messages": ASK}, "continue_final_message", "final message to be the assistant's"),
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "must be a JSON object"),
    ({"chat_template_kwargs": {"count": "many"}}, None, "failed with these chat_template_kwargs: TypeError"),
    ({"chat_template_kwargs": {"count": 10 ** 9}}, None, "failed with these chat_template_kwargs: OverflowError"),
])
def test_bad_chat_fields_are_a_400_over_http_and_invalid_argument_over_grpc(server, model_id, fields, param,
                                                                           message):
    body = {"model": model_id, "messages": COPY, "max_tokens": 4, **fields}
    for stream in (False, True):
        status, answer = post(server, "/v1/chat/completions", {**body, "stream": stream})
        assert status == 400 and message in answer["error"]["message"] and answer["error"]["param"] == param, answer
    request = build_request(messages=body["messages"], max_new_tokens=4,
                            chat_template_kwargs=fields.get("chat_template_kwargs"),
                            continue_final_message=fields.get("continue_final_message", False),
                            add_generation_prompt=fields.get("add_generation_prompt"))
    with grpc.insecure_channel(server[0]) as channel:
        with pytest.raises(grpc.RpcError) as refused:
            generate_pb2_grpc.GenerateStub(channel).Generate(request, timeout=120)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and message in refused.value.details()
        bad_json = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")],
                                                               chat_template_kwargs="{enable_thinking: false}"))
        with pytest.raises(grpc.RpcError, match="not valid JSON"):
            generate_pb2_grpc.GenerateStub(channel).Generate(bad_json, timeout=120)
