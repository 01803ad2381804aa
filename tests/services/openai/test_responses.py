"""Issue 59, item 3: `POST /v1/responses` on a real `trserve serve` (the bundled model, loopback), through
the `openai` package's `client.responses.create` and its streaming helper, sync and async: the same text
as the chat completion of the same messages (greedy, TR == AR), function tools called and continued with
a function_call_output item, json_schema text format, and 400s for what is not served."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import openai
import pytest

from .test_tool_auto import SCHEMAS, TIME, WEATHER, check_args, serve, server  # noqa: F401 - the server fixtures

pytestmark = pytest.mark.timeout(600)

# Responses' flat function tools
TOOLS = [{"type": "function", **t["function"]} for t in (WEATHER, TIME)]
# an agent loop's earlier turns as Responses items: the user asked, the assistant called, the tool answered
HISTORY = [{"role": "user", "content": "What is the weather in London, in celsius?"},
           {"type": "function_call", "call_id": "call_1", "name": "get_weather",
            "arguments": json.dumps({"city": "London", "unit": "celsius"})},
           {"role": "user", "content": "What time is it in Europe/Rome?"},
           {"type": "function_call", "call_id": "call_2", "name": "get_time",
            "arguments": json.dumps({"timezone": "Europe/Rome"})}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(server):  # noqa: F811 - the imported fixture
    return openai.OpenAI(base_url=server, api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def ids(response) -> list[int]:
    return response.model_extra["trserve"]["token_ids"]


def test_text_input_answers_as_chat_does_tr_equal_to_ar_and_streamed(client, model):
    question, system = "Write one sentence about the ocean.", "You are brief."
    chat = client.chat.completions.create(model=model, temperature=0, max_tokens=40, messages=[
        {"role": "system", "content": system}, {"role": "user", "content": question}])
    reply = client.responses.create(model=model, input=question, instructions=system, temperature=0,
                                    max_output_tokens=40)
    assert reply.object == "response" and reply.id.startswith("resp_") and reply.model == model
    assert reply.output_text == chat.choices[0].message.content and ids(reply) == chat.model_extra["trserve"]["token_ids"]
    ar = client.responses.create(model=model, input=question, instructions=system, temperature=0, max_output_tokens=40,
                                 extra_body={"mode": "ar"})
    assert ids(ar) == ids(reply) and ar.output_text == reply.output_text
    assert reply.usage.input_tokens == chat.usage.prompt_tokens and reply.usage.output_tokens == len(ids(reply))
    assert reply.usage.total_tokens == reply.usage.input_tokens + reply.usage.output_tokens
    cut = chat.choices[0].finish_reason == "length"
    assert reply.status == ("incomplete" if cut else "completed")
    assert (reply.incomplete_details.reason if cut else reply.incomplete_details) == ("max_output_tokens" if cut else None)
    deltas, kinds = [], []
    with client.responses.stream(model=model, input=question, instructions=system, temperature=0,
                                 max_output_tokens=40) as stream:
        for event in stream:
            kinds.append((event.type, event.sequence_number))
            deltas += [event.delta] if event.type == "response.output_text.delta" else []
        final = stream.get_final_response() if not cut else None
    assert [n for _, n in kinds] == list(range(len(kinds)))
    assert [k for k, _ in kinds[:4]] == ["response.created", "response.in_progress", "response.output_item.added",
                                         "response.content_part.added"]
    assert kinds[-1][0] == ("response.incomplete" if cut else "response.completed")
    assert "".join(deltas) == reply.output_text
    if final is not None:
        assert final.output_text == reply.output_text and final.usage.output_tokens == reply.usage.output_tokens


def test_message_items_and_a_short_limit_are_incomplete(client, model):
    """Input items (input_text parts, an earlier assistant turn in output_text parts) answer as chat's
    messages; a reply cut by max_output_tokens is incomplete, unary and streamed."""
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Answer briefly."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Blue."}]},
             {"role": "user", "content": "Now describe the sea in detail."}]
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Now describe the sea in detail."}]
    chat = client.chat.completions.create(model=model, temperature=0, max_tokens=3, messages=messages)
    reply = client.responses.create(model=model, input=items, max_output_tokens=3)
    assert chat.choices[0].finish_reason == "length" and reply.status == "incomplete"
    assert reply.incomplete_details.reason == "max_output_tokens" and reply.output[0].status == "incomplete"
    assert reply.output_text == chat.choices[0].message.content
    events = list(client.responses.create(model=model, input=items, max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == reply.output_text


def test_a_function_tool_is_called_and_its_output_continues(client, model):
    question = {"role": "user", "content": "What is the weather in Paris, in celsius?"}
    reply = client.responses.create(model=model, input=[*HISTORY, question], tools=TOOLS, temperature=0,
                                    max_output_tokens=60)
    calls = [item for item in reply.output if item.type == "function_call"]
    assert reply.status == "completed" and [c.name for c in calls] == ["get_weather"], reply.output
    check_args("get_weather", calls[0].arguments)
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    ar = client.responses.create(model=model, input=[*HISTORY, question], tools=TOOLS, max_output_tokens=60,
                                 extra_body={"mode": "ar"})
    assert ids(ar) == ids(reply)
    with client.responses.stream(model=model, input=[*HISTORY, question], tools=TOOLS, max_output_tokens=60) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds.count("response.function_call_arguments.delta") > 1  # the arguments as they are written
    assert "response.function_call_arguments.done" in kinds
    assert [(i.type, i.name, i.arguments) for i in final.output] == [("function_call", "get_weather", calls[0].arguments)]
    # the call and its result go back as items (the call as the client got it), and the model goes on
    follow = [*HISTORY, question, calls[0].model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": calls[0].call_id, "output": '{"temperature": 21}'}]
    more = client.responses.create(model=model, input=follow, tools=TOOLS, max_output_tokens=60)
    assert more.output and (more.output_text or any(i.type == "function_call" for i in more.output))
    for item in more.output:
        if item.type == "function_call":
            check_args(item.name, item.arguments)
    named = client.responses.create(model=model, input="Hello.", tools=TOOLS, max_output_tokens=60,
                                    tool_choice={"type": "function", "name": "get_time"})
    assert [(i.type, i.name) for i in named.output] == [("function_call", "get_time")]
    check_args("get_time", named.output[0].arguments)


def test_async_create_and_stream(server, model):  # noqa: F811 - the imported fixture
    question = {"role": "user", "content": "What is the weather in Berlin, in fahrenheit?"}

    async def run() -> tuple:
        async with openai.AsyncOpenAI(base_url=server, api_key="none", max_retries=0, timeout=300) as aclient:
            unary = await aclient.responses.create(model=model, input=[*HISTORY, question], tools=TOOLS,
                                                   max_output_tokens=60)
            async with aclient.responses.stream(model=model, input=[*HISTORY, question], tools=TOOLS,
                                                max_output_tokens=60) as stream:
                final = await stream.get_final_response()
            text = await aclient.responses.create(model=model, input="Tell me a joke.", max_output_tokens=30)
            streamed = [e async for e in await aclient.responses.create(model=model, input="Tell me a joke.",
                                                                        max_output_tokens=30, stream=True)]
            return unary, final, text, streamed

    unary, final, text, streamed = asyncio.run(run())
    call = unary.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert check_args("get_weather", call.arguments)["city"] == "Berlin"
    assert [(i.name, i.arguments) for i in final.output] == [(call.name, call.arguments)]
    assert text.output_text and "".join(e.delta for e in streamed if e.type == "response.output_text.delta") == \
        text.output_text


def test_json_schema_text_format_validates(client, model):
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    reply = client.responses.create(model=model, input="Invent a person.", text={"format": fmt}, max_output_tokens=60)
    person = json.loads(reply.output_text)
    assert set(person) == {"name", "age"} and isinstance(person["name"], str) and len(person["name"]) <= 20
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 150
    assert reply.text.format.type == "json_schema"
    plain = client.responses.create(model=model, input="Invent a person.", text={"format": {"type": "text"}},
                                    max_output_tokens=20)
    assert plain.output_text


def post(base: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(base + "/responses", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content"),
    ({"input": [{"type": "image_generation_call", "id": "ig_1"}]}, "input[0].type"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),  # left out: nothing remains
    ({"input": []}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"max_output_tokens": -1}, "max_output_tokens"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"frobnicate": 1}, "frobnicate"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_what_is_not_served_is_a_400_naming_it(server, model, extra, param):  # noqa: F811
    status, body = post(server, {"model": model, "input": "Hi.", **extra})
    assert status == 400 and body["error"]["param"] == param, body


def test_store_is_accepted_and_nothing_is_stored(server, model):  # noqa: F811
    status, body = post(server, {"model": model, "input": "Hi.", "store": True, "max_output_tokens": 5})
    assert status == 200 and body["store"] is False and body["object"] == "response"
    status, body = post(server, {"model": model, "input": "Hi.", "previous_response_id": body["id"]})
    assert status == 400 and "stateless" in body["error"]["message"]


def test_a_request_becomes_the_chat_request_it_means():
    """Without a server: instructions first, consecutive calls one assistant turn, outputs tool turns,
    flat tools nested, text.format as response_format, max_output_tokens as max_tokens."""
    from trserve.services.openai.responses import chat_request

    chat = chat_request({"model": "m", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0.5,
                         "tools": TOOLS, "tool_choice": {"type": "function", "name": "get_time"}, "store": False,
                         "text": {"format": {"type": "json_schema", "name": "p", "schema": PERSON, "strict": True}},
                         "input": [{"role": "user", "content": "Hi"},
                                   {"type": "function_call", "call_id": "a", "name": "get_time", "arguments": "{}"},
                                   {"type": "function_call", "call_id": "b", "name": "get_weather", "arguments": "{}"},
                                   {"type": "function_call_output", "call_id": "a", "output": "noon"}]})
    assert [m["role"] for m in chat["messages"]] == ["system", "user", "assistant", "tool"]
    assert [c["id"] for c in chat["messages"][2]["tool_calls"]] == ["a", "b"]
    assert chat["messages"][3] == {"role": "tool", "tool_call_id": "a", "content": "noon"}
    assert chat["tools"] == [WEATHER, TIME] and chat["tool_choice"] == {"type": "function", "function": {"name": "get_time"}}
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    assert (chat["max_tokens"], chat["temperature"], chat["model"]) == (7, 0.5, "m") and "store" not in chat
