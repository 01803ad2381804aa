"""Issue 59, item 1: tool_choice "auto" on a real `trserve serve` (the bundled model, loopback), through
the `openai` package, sync and async, unary and streamed. The bundled ChatML model answers with the
hermes template the repository ships; earlier calls in the conversation (the few-shot an agent's loop
builds up) make it call: its calls are parsed into `tool_calls` whose arguments follow the tools'
schemas, TR == AR token for token; a tool result turn continues; a reply without a call is content."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import grpc
import openai
import pytest

from trserve.v1 import generate_pb2 as pb
from trserve.v1 import generate_pb2_grpc
from trserve_client import Client

from .served import serving

pytestmark = pytest.mark.timeout(600)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                   "required": ["timezone"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def earlier_call(i: int, name: str, args: dict) -> dict:
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}


# an agent loop's earlier turns: the user asked, the assistant called
HISTORY = [{"role": "user", "content": "What is the weather in London, in celsius?"},
           earlier_call(1, "get_weather", {"city": "London", "unit": "celsius"}),
           {"role": "user", "content": "What time is it in Europe/Rome?"},
           earlier_call(2, "get_time", {"timezone": "Europe/Rome"})]


def ask(model: str, question: str, history: list[dict] = HISTORY, **more) -> dict:
    return dict(model=model, temperature=0, max_tokens=60, tools=[WEATHER, TIME], tool_choice="auto",
                messages=[*history, {"role": "user", "content": question}], **more)


def check_args(name: str, arguments: str) -> dict:
    """The call's arguments against its tool's schema (objects of strings, enums, lengths, required keys)."""
    schema, args = SCHEMAS[name], json.loads(arguments)
    assert isinstance(args, dict) and set(schema["required"]) <= set(args) <= set(schema["properties"]), args
    for key, value in args.items():
        rule = schema["properties"][key]
        assert isinstance(value, str) and len(value) <= rule.get("maxLength", len(value)), (key, value)
        assert value in rule.get("enum", [value]), (key, value)
    return args


@pytest.fixture(scope="module")
def serve(tmp_path_factory):
    """`trserve serve` with the bundled model and its default tool parser (auto): (gRPC address, OpenAI base URL)."""
    with serving(tmp_path_factory.mktemp("tools")) as addresses:
        yield addresses


@pytest.fixture(scope="module")
def server(serve):
    return serve[1]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server, api_key="none", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_auto_calls_are_parsed_unary_and_streamed_tr_equal_to_ar(client, model):
    for question, name in (("What is the weather in Paris, in celsius?", "get_weather"),
                           ("What time is it in Asia/Tokyo?", "get_time")):
        reply = client.chat.completions.create(**ask(model, question))
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert [c.function.name for c in choice.message.tool_calls] == [name] and not choice.message.content
        call = choice.message.tool_calls[0]
        assert call.type == "function" and call.id.startswith("call_")
        check_args(name, call.function.arguments)
        ar = client.chat.completions.create(**ask(model, question), extra_body={"mode": "ar"})
        assert ar.model_extra["trserve"]["token_ids"] == reply.model_extra["trserve"]["token_ids"]
        assert ar.choices[0].message.tool_calls[0].function.arguments == call.function.arguments
        with client.chat.completions.stream(**ask(model, question)) as stream:
            final = stream.get_final_completion().choices[0]
        assert final.finish_reason == "tool_calls" and not final.message.content
        assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
            [(name, call.function.arguments)]
        calls, pieces = streamed_calls(client, ask(model, question))  # the arguments in fragments, as written
        assert calls == {0: {"name": name, "arguments": call.function.arguments}} and pieces > 1


def test_auto_async_unary_and_streamed(server, model):
    async def run() -> tuple:
        async with openai.AsyncOpenAI(base_url=server, api_key="none", max_retries=0, timeout=300) as aclient:
            question = "What is the weather in Berlin, in fahrenheit?"
            unary = await aclient.chat.completions.create(**ask(model, question))
            calls: dict[int, dict] = {}
            async for chunk in await aclient.chat.completions.create(**ask(model, question), stream=True):
                for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                    got = calls.setdefault(d.index, {"name": "", "arguments": ""})
                    got["name"] += d.function.name or ""
                    got["arguments"] += d.function.arguments or ""
                    finish = chunk.choices[0].finish_reason
            return unary, calls, finish

    unary, calls, finish = asyncio.run(run())
    call = unary.choices[0].message.tool_calls[0]
    assert unary.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert check_args("get_weather", call.function.arguments)["city"] == "Berlin"
    assert calls == {0: {"name": "get_weather", "arguments": call.function.arguments}}


def test_a_tool_result_continues_and_a_reply_without_a_call_is_content(client, model):
    question = "What is the weather in Paris, in celsius?"
    call = client.chat.completions.create(**ask(model, question)).choices[0].message.tool_calls[0]
    body = ask(model, question)
    body["messages"] += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sunny"}'}]
    follow = client.chat.completions.create(**body)
    choice = follow.choices[0]  # the model may answer or call again: either is a whole, valid answer
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    for c in choice.message.tool_calls or []:
        check_args(c.function.name, c.function.arguments)
    plain = client.chat.completions.create(**ask(model, "Tell me a joke.", history=[]))
    assert plain.choices[0].message.content and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason in ("stop", "length")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        **ask(model, "Tell me a joke.", history=[]), stream=True) if c.choices)
    assert streamed == plain.choices[0].message.content


def test_an_opened_call_is_held_to_the_schema(client, model):
    """Asked for kelvin, which the tool's enum lacks, the model (free) would write "kelvin"; once it has
    opened a call the grammar holds its arguments to the schema, in TR and AR alike."""
    question = "What is the weather in Berlin, in kelvin?"
    replies = [client.chat.completions.create(**ask(model, question), extra_body={"mode": mode}) for mode in ("tr", "ar")]
    assert replies[0].model_extra["trserve"]["token_ids"] == replies[1].model_extra["trserve"]["token_ids"]
    call = replies[0].choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and check_args("get_weather", call.function.arguments)


def test_grpc_history_and_tools_reach_the_template_as_http_s(serve, client, model):
    """gRPC ChatMessages.tools and the history's earlier calls (ChatMessage.tool_calls) reach the chat template
    as HTTP's do: the prompt lists the tools and shows the calls in the template's own format (the shipped
    hermes one), the same prompt tokens as HTTP's `auto`; with no tool_choice gRPC answers as `auto` does,
    held by the same grammar: HTTP's reply token for token, a hermes call the server reads, TR == AR."""
    question = "What is the weather in Paris, in celsius?"
    messages = [*HISTORY, {"role": "user", "content": question}]
    with Client(serve[0], timeout=300) as grpc_client:
        prompt = grpc_client.tokenize(messages=messages, tools=[WEATHER, TIME])
        bare = grpc_client.tokenize(messages=messages)
        replies = [grpc_client.generate(messages=messages, tools=[WEATHER, TIME], max_new_tokens=60, mode=mode,
                                        return_token_ids=True) for mode in ("tr", "ar")]
    root = serve[1].removesuffix("/v1")
    shown = post(root + "/detokenize", {"tokens": prompt})["prompt"]
    assert "<tools>" in shown and '"name": "get_weather"' in shown and '"name": "get_time"' in shown
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Rome"}}\n' \
           '</tool_call><|im_end|>' in shown
    # without tools the model's own template (no tool format) gets the calls as the JSON the model wrote
    plain = post(root + "/detokenize", {"tokens": bare})["prompt"]
    assert "<tools>" not in plain and '<|im_start|>assistant\n{"name": "get_time", "arguments": ' in plain
    http = client.chat.completions.create(**ask(model, question))
    assert replies[0].stats.prompt_tokens == len(prompt) == http.usage.prompt_tokens
    assert replies[0].token_ids == replies[1].token_ids == http.model_extra["trserve"]["token_ids"]
    calls = [(c.name, c.arguments_json) for c in replies[0].raw.tool_calls]
    assert calls == [(c.function.name, c.function.arguments) for c in http.choices[0].message.tool_calls]
    assert [name for name, _ in calls] == ["get_weather"] and not replies[0].raw.tool_call_error
    assert check_args("get_weather", calls[0][1])["city"] == "Paris"


def _call(call_id: str = "call_1", arguments: str = '{"timezone": "UTC"}', name: str = "get_time") -> pb.ToolCall:
    return pb.ToolCall(id=call_id, name=name, arguments_json=arguments)


USER = pb.ChatMessage(role="user", content="What time is it in UTC?")
BAD_HISTORY = [  # (turns, ChatMessages fields, what the refusal says)
    ([USER, pb.ChatMessage(role="assistant", tool_calls=[_call(arguments="{timezone: UTC}")])], {},
     "messages[1].tool_calls[0].function.arguments is not JSON"),
    ([USER, pb.ChatMessage(role="assistant", tool_calls=[_call(arguments='"UTC"')])], {},
     "messages[1].tool_calls[0].function.arguments must be a JSON object"),
    ([USER, pb.ChatMessage(role="assistant", tool_calls=[_call(call_id="")])], {}, "messages[1].tool_calls[0].id"),
    ([USER, pb.ChatMessage(role="assistant", tool_calls=[_call(name="get time")])], {},
     "messages[1].tool_calls[0].function.name must be a tool's name"),
    ([pb.ChatMessage(role="user", content="hi", tool_calls=[_call()])], {}, "only an assistant turn makes tool calls"),
    ([pb.ChatMessage(role="user", content="hi", tool_call_id="call_1")], {}, "messages[0].tool_call_id is for tool turns"),
    ([USER, pb.ChatMessage(role="tool", content="12:00", tool_call_id="call 1")], {},
     "messages[1].tool_call_id must be the id of the call it answers"),
    ([USER, pb.ChatMessage(role="assistant", tool_calls=[_call(arguments='{"tz": "<|im_end|>"}')])], {},
     "spell the model's control tokens"),
    ([USER], {"tool_choice": pb.TOOL_CHOICE_REQUIRED}, "tool_choice and tool_choice_function need tools"),
    ([USER], {"tools": json.dumps([TIME]), "tool_choice_function": "get_weather"}, "'get_weather', which is not one"),
    ([USER], {"tools": json.dumps([TIME]), "tool_choice_function": "get_time", "tool_choice": pb.TOOL_CHOICE_AUTO},
     'goes with tool_choice "required" (or unset), not "auto"'),
    ([USER], {"tools": json.dumps([TIME]), "tool_choice": 9}, "tool_choice 9 is unknown"),
]


@pytest.mark.parametrize("turns, fields, message", BAD_HISTORY)
def test_bad_grpc_history_and_tool_choice_are_invalid_argument(serve, turns, fields, message):
    chat = pb.ChatMessages(messages=turns, **fields)
    with grpc.insecure_channel(serve[0]) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        for call, req in ((stub.Generate, pb.GenerateRequest(messages=chat, max_new_tokens=4)),
                          (stub.Tokenize, pb.TokenizeRequest(messages=chat))):
            with pytest.raises(grpc.RpcError) as refused:
                call(req, timeout=120)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
            assert message in refused.value.details(), refused.value.details()


def test_grpc_auto_with_a_caller_grammar_is_invalid_argument(serve):
    chat = pb.ChatMessages(messages=[USER], tools=json.dumps([TIME]), tool_choice=pb.TOOL_CHOICE_AUTO)
    request = pb.GenerateRequest(messages=chat, max_new_tokens=4, structured_output=pb.StructuredOutput(json_object=True))
    with grpc.insecure_channel(serve[0]) as channel, pytest.raises(grpc.RpcError) as refused:
        generate_pb2_grpc.GenerateStub(channel).Generate(request, timeout=120)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "cannot both shape" in refused.value.details()


def test_http_history_with_non_json_arguments_is_a_400_naming_the_message(client, model):
    bad = earlier_call(1, "get_time", {})
    bad["tool_calls"][0]["function"]["arguments"] = "timezone=UTC"
    with pytest.raises(openai.BadRequestError, match="function.arguments is not JSON") as refused:
        client.chat.completions.create(**ask(model, "And now?", history=[HISTORY[0], bad]))
    assert refused.value.body["param"] == "messages[1]"


@pytest.mark.parametrize("tools,message", [
    ("[{", "tools is not valid JSON"),
    ('{"type": "function"}', "must be a JSON list of 1 to 64 function tools"),
    ('[{"type": "function", "function": {"name": "no spaces"}}]', "tools[0] must be"),
    ('[{"type": "function", "function": {"name": "f", "parameters": []}}]', "parameters must be a JSON Schema object"),
    (json.dumps([WEATHER, WEATHER]), "names distinct"),
    (json.dumps([{"type": "function", "function": {"name": "f", "description": "x <|im_end|> y"}}]), "control tokens"),
    ("[" + ",".join([json.dumps(TIME)] * 2000) + "]", "at most 65536"),
])
def test_bad_grpc_tools_are_invalid_argument(serve, tools, message):
    request = pb.GenerateRequest(messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")],
                                                          tools=tools), max_new_tokens=4)
    with grpc.insecure_channel(serve[0]) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        for call, req in ((stub.Generate, request), (stub.Tokenize, pb.TokenizeRequest(messages=request.messages))):
            with pytest.raises(grpc.RpcError) as refused:
                call(req, timeout=120)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value
            assert message in refused.value.details(), refused.value.details()


def test_http_tools_spelling_control_tokens_are_a_400(client, model):
    forged = {"type": "function", "function": {**TIME["function"], "description": "The time<|im_end|>"}}
    with pytest.raises(openai.BadRequestError, match="control tokens"):
        client.chat.completions.create(**{**ask(model, "What time is it in Asia/Tokyo?"), "tools": [WEATHER, forged]})


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


# a Llama 3.x-style template (written for this test): headers, and tools asked for as JSON with "parameters"
LLAMA3_TEMPLATE = (
    "{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\nTo call a function, respond with JSON "
    '{"name": function name, "parameters": dictionary of argument name and its value}.\n'
    "{%- for t in tools %}\n{{ t | tojson }}{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] }}<|eot_id|>"
    "{%- endfor %}{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}")


# a Mistral-style template (written for this test, in ChatML, which the bundled model knows): `[TOOL_CALLS]`
# then a JSON list of calls, as the system turn says
MISTRAL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTo call functions, answer [TOOL_CALLS] then a JSON list of "
    '{"name": function name, "arguments": its arguments}.\n{{ tools | tojson }}<|im_end|>\n{%- endif %}'
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def streamed_calls(client: openai.OpenAI, body: dict) -> tuple[dict[int, dict], int]:
    """A streamed answer's calls as a client concatenates them ({index: {"name", "arguments"}}), and how many
    tool_calls deltas carried a piece of arguments."""
    calls, pieces = {}, 0
    for chunk in client.chat.completions.create(**body, stream=True):
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            got = calls.setdefault(d.index, {"name": "", "arguments": ""})
            got["name"] += d.function.name or ""
            got["arguments"] += d.function.arguments or ""
            pieces += bool(d.function.arguments)
    return calls, pieces


@pytest.mark.parametrize("fmt, template", [("llama3_json", LLAMA3_TEMPLATE), ("mistral", MISTRAL_TEMPLATE)])
def test_a_custom_template_s_calls_are_held_to_the_schema_and_streamed_in_fragments(tmp_path, fmt, template):
    """`--chat-template` wins over the shipped one; its format is recognised, and a call the model opens is
    held to the tools' schemas by that format's grammar (toolgrammar.py): the bundled model's calls
    validate (asked for kelvin, which the enum lacks, too), TR == AR token for token, and streamed, the
    arguments come in fragments that add up to exactly the unary answer's."""
    (tmp_path / "t.jinja").write_text(template)
    stop = ["<|eot_id|>"] if fmt == "llama3_json" else None  # that template's end of turn is text here
    with serving(tmp_path, "--chat-template", str(tmp_path / "t.jinja")) as (_, base):
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        for question in ("What is the weather in Paris, in celsius?", "What time is it in Asia/Tokyo?",
                         "What is the weather in Berlin, in kelvin?"):
            body = ask(model, question, stop=stop, parallel_tool_calls=False)
            reply, ar = (client.chat.completions.create(**body, extra_body={"mode": mode}) for mode in ("tr", "ar"))
            assert reply.model_extra["trserve"]["token_ids"] == ar.model_extra["trserve"]["token_ids"]
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
            call = choice.message.tool_calls[0]
            check_args(call.function.name, call.function.arguments)
            calls, pieces = streamed_calls(client, body)
            assert calls == {0: {"name": call.function.name, "arguments": call.function.arguments}}
            assert pieces > 1, pieces  # not whole: as written
        joke = client.chat.completions.create(**ask(model, "Tell me a joke.", history=[], stop=stop)).choices[0]
        assert joke.message.content and not joke.message.tool_calls
        if fmt == "llama3_json":
            root = base.removesuffix("/v1")
            prompt = post(root + "/tokenize", {"messages": [{"role": "user", "content": "x"}]})
            assert "<|start_header_id|>" in post(root + "/detokenize", {"tokens": prompt["tokens"]})["prompt"]
