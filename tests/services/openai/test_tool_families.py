"""Issue 59: each tool-call parser on a real `trserve serve` of a tiny random model that carries its
family's own chat template (Llama 3.1: llama3_json, Mistral Nemo: mistral, Qwen2.5: hermes; families.py)
and its family's special tokens. The format is recognised from the template (no --tool-call-parser) and
reported (GET /v1/models, gRPC ModelInfo); "required" and a named function give calls that validate
(the grammar holds a random model to the schema), unary == streamed, TR == AR token for token; in
"auto" a call opens with the family's marker, one special token where the tokenizer has it as one
(the grammar lets it: toolgrammar.py); a tool result turn renders in the family's template and the
model continues; a call cut by max_tokens is content with stop_reason "malformed_tool_call", a 200."""

from __future__ import annotations

import json

import grpc
import openai
import pytest
from transformers import AutoTokenizer

from trserve.engine.tr.grammar import GrammarCompiler, StructuredOutput
from trserve.services.openai.toolgrammar import auto_grammar
from trserve.services.openai.toolparse import marker_tokens
from trserve.v1 import generate_pb2 as pb
from trserve.v1 import generate_pb2_grpc
from trserve_client import Client

from .families import FAMILIES, tiny_family
from .served import serving
from .test_tool_auto import SCHEMAS, TIME, WEATHER, check_args, post, streamed_calls

pytestmark = pytest.mark.timeout(600)
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(format, the checkpoint's folder, gRPC address, OpenAI client, model id, the tokenizer, the server's log)."""
    fmt = request.param
    folder, logs = tiny_family(tmp_path_factory.mktemp(f"tiny-{fmt}"), fmt), tmp_path_factory.mktemp(f"serve-{fmt}")
    with serving(logs, "--model", str(folder)) as (addr, base):
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0, timeout=300)
        yield (fmt, folder, addr, client, client.models.list().data[0].id, AutoTokenizer.from_pretrained(folder),
               logs / "serve.log")


def ask(model: str, question: str = "What time is it in Asia/Tokyo?", history: tuple = (), **more) -> dict:
    return {"model": model, "temperature": 0, "max_tokens": 200, "tools": [WEATHER, TIME],
            "messages": [*history, {"role": "user", "content": question}], **more}


def test_the_template_s_format_is_recognised_and_reported(family):
    fmt, _, addr, client, model, tok = family[:6]
    assert f"tool calls: {fmt}, reasoning parser: none" in family[6].read_text()  # the startup line
    card = client.models.retrieve(model)
    assert card.model_extra["trserve"] == {"tool_call_parser": fmt, "reasoning_parser": ""}
    with grpc.insecure_channel(addr) as channel:
        info = generate_pb2_grpc.GenerateStub(channel).ModelInfo(pb.ModelInfoRequest(), timeout=60)
    assert (info.tool_call_parser, info.reasoning_parser) == (fmt, "")
    with Client(addr, timeout=120) as grpc_client:  # the family's template renders the tools
        ids = grpc_client.tokenize(messages=[{"role": "user", "content": "hi"}], tools=[WEATHER, TIME])
    shown = tok.decode(ids)
    opening = {"llama3_json": "<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython",
               "mistral": "[AVAILABLE_TOOLS][{\"type\": \"function\"", "hermes": "<tools>\n{\"type\": \"function\""}
    assert opening[fmt] in shown and '"get_weather"' in shown and '"get_time"' in shown


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_required_and_named_calls_validate_stream_as_unary_and_tr_equals_ar(family, choice):
    _, _, _, client, model, _ = family[:6]
    body = ask(model, tool_choice=choice)
    reply, ar = (client.chat.completions.create(**body, extra_body={"mode": mode}) for mode in ("tr", "ar"))
    assert reply.model_extra["trserve"]["token_ids"] == ar.model_extra["trserve"]["token_ids"]
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls" and len(reply.choices[0].message.tool_calls) == 1
    assert call.function.name in (["get_time"] if choice == NAMED else SCHEMAS)
    check_args(call.function.name, call.function.arguments)
    with client.chat.completions.stream(**body) as stream:
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(call.function.name, call.function.arguments)]


def marked(fmt: str, model: str, tok, **more) -> dict:
    """tool_choice "auto", the family's call marker made the likeliest token (a random model would not
    open a call otherwise); one call (parallel_tool_calls false). hermes's grammar lets text follow a
    call, where the biased model would open another: the reply stops at the call's end."""
    marker = tok.convert_tokens_to_ids(FAMILIES[fmt].marker)
    stop = ["</tool_call>"] if fmt == "hermes" else None
    return ask(model, tool_choice="auto", parallel_tool_calls=False, logit_bias={str(marker): 100}, stop=stop, **more)


def test_auto_a_call_opened_by_the_family_s_marker_is_parsed_and_held(family):
    fmt, _, _, client, model, tok = family[:6]
    body = marked(fmt, model, tok)
    reply, ar = (client.chat.completions.create(**body, extra_body={"mode": mode}) for mode in ("tr", "ar"))
    ids = reply.model_extra["trserve"]["token_ids"]
    assert ids == ar.model_extra["trserve"]["token_ids"]
    assert ids[0] == tok.convert_tokens_to_ids(FAMILIES[fmt].marker)  # the marker, one token
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    assert not choice.message.content
    call = choice.message.tool_calls[0]
    check_args(call.function.name, call.function.arguments)
    assert len(call.id) == 9 and call.id.isalnum() if fmt == "mistral" else call.id.startswith("call_")
    calls, _ = streamed_calls(client, body)
    assert calls == {0: {"name": call.function.name, "arguments": call.function.arguments}}


def test_without_the_markers_in_the_grammar_the_marker_tokens_are_masked(family):
    """Each family's call markers are tokens of their own here (added tokens: Llama's and Mistral's special,
    Qwen's not), which the grammar engine matches by id only, masking them where a grammar names their
    text: the grammar names their ids (toolparse.py:marker_tokens), so the model can open a call with the
    token it was trained to write; without them it could not."""
    fmt, _, _, _, _, tok = family[:6]
    markers = marker_tokens(tok, fmt)
    want = [FAMILIES[fmt].marker] + (["</tool_call>"] if fmt == "hermes" else [])
    assert markers == tuple(tok.convert_tokens_to_ids(want))
    compiler = GrammarCompiler(tok, len(tok), frozenset({tok.eos_token_id}))
    functions = {t["function"]["name"]: t["function"] for t in (WEATHER, TIME)}
    for given, allowed in ((markers, True), ((), False)):
        grammar = compiler.compile(StructuredOutput("grammar", auto_grammar(fmt, functions, True, given)))
        assert bool(grammar.first()[markers[0]]) is allowed


def test_a_tool_result_turn_renders_and_the_model_continues(family):
    fmt, _, _, client, model, tok = family[:6]
    question = "What time is it in Asia/Tokyo?"
    call = client.chat.completions.create(**marked(fmt, model, tok, question=question)).choices[0].message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'}
    history = ({"role": "user", "content": question}, {"role": "assistant", "content": None,
                                                        "tool_calls": [call.model_dump()]}, result)
    body = {"model": model, "temperature": 0, "max_tokens": 24, "tools": [WEATHER, TIME], "messages": list(history)}
    reply, ar = (client.chat.completions.create(**body, extra_body={"mode": mode}) for mode in ("tr", "ar"))
    assert reply.model_extra["trserve"]["token_ids"] == ar.model_extra["trserve"]["token_ids"]
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert choice.message.content or choice.message.tool_calls
    for c in choice.message.tool_calls or []:
        check_args(c.function.name, c.function.arguments)
    shown = tok.decode(post(str(client.base_url).rstrip("/").removesuffix("/v1") + "/tokenize",
                            {"messages": list(history)})["tokens"])
    assert "12:00" in shown and shown.rstrip().endswith(
        {"llama3_json": "<|start_header_id|>assistant<|end_header_id|>", "mistral": "[/TOOL_RESULTS]",
         "hermes": "<|im_start|>assistant"}[fmt]), shown[-200:]
    if fmt == "mistral":  # its template checks the id itself: a 400 naming why, never a 500
        bad = {**body, "messages": [*history[:2], {**result, "tool_call_id": "call_1"}]}
        with pytest.raises(openai.BadRequestError, match="alphanumeric strings with length 9"):
            client.chat.completions.create(**bad)


def test_a_call_cut_by_max_tokens_is_content_with_a_malformed_reason(family):
    fmt, _, _, client, model, tok = family[:6]
    body = {**marked(fmt, model, tok), "max_tokens": 6, "stop": None}
    reply = client.chat.completions.create(**body)
    choice = reply.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content and choice.model_extra["stop_reason"] == "malformed_tool_call"
    text = choice.message.content.lstrip()  # (Mistral's marker is kept as text: it may follow text)
    assert text.startswith({"llama3_json": '{"name": "', "mistral": '[TOOL_CALLS][{"name": "',
                            "hermes": "<tool_call>\n{"}[fmt])


def test_grpc_replies_carry_the_calls_read_in_the_family_s_format(family):
    """gRPC GenerateResponse.tool_calls: with ChatMessages.tools, the calls the reply writes in the served
    format, read as HTTP's auto reads them. Held by the same grammar as `structured_output`, the reply is
    HTTP's auto reply token for token, and its calls are HTTP's; streamed, the last message carries them."""
    fmt, _, addr, client, model, tok = family[:6]
    body = marked(fmt, model, tok)
    http = client.chat.completions.create(**body)
    functions = {t["function"]["name"]: t["function"] for t in (WEATHER, TIME)}
    marker = tok.convert_tokens_to_ids(FAMILIES[fmt].marker)
    request = pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=body["messages"][0]["content"])],
                                 tools=json.dumps([WEATHER, TIME])),
        max_new_tokens=body["max_tokens"], logit_bias={marker: 100.0}, stop_sequences=body["stop"] or [],
        structured_output=pb.StructuredOutput(grammar=auto_grammar(fmt, functions, False, marker_tokens(tok, fmt))),
        return_token_ids=True)
    with grpc.insecure_channel(addr) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        reply = stub.Generate(request, timeout=300)
        last = list(stub.GenerateStream(request, timeout=300))[-1]
        bare = stub.Generate(pb.GenerateRequest(messages=request.messages, max_new_tokens=4), timeout=300)
    assert list(reply.token_ids) == http.model_extra["trserve"]["token_ids"]
    want = [(c.function.name, c.function.arguments) for c in http.choices[0].message.tool_calls]
    for got in (reply, last):
        assert [(c.name, c.arguments_json) for c in got.tool_calls] == want and not got.tool_call_error
    assert reply.tool_calls[0].id and not bare.tool_calls and not bare.tool_call_error  # random text: no call


def test_a_grpc_agent_loop_sends_its_calls_back_through_the_family_s_template(family):
    """An agent loop over gRPC. Turn 1 (TOOL_CHOICE_REQUIRED, no caller grammar): the reply is one call held
    to its tool's schema, TR == AR, its id spelled as the family's templates want. Turn 2 sends that call back
    (ChatMessage.tool_calls) with its result (tool_call_id): the prompt shows the call in the family's own
    rendering (Mistral's with the ids), is Generate's prompt and HTTP's for the same history, and the
    reply (auto, held by the served format's grammar) is HTTP's token for token, TR == AR."""
    fmt, _, addr, client, model, tok = family[:6]
    first = [{"role": "user", "content": "What time is it in Asia/Tokyo?"}]
    with Client(addr, timeout=300) as grpc_client:
        one = [grpc_client.generate(messages=first, tools=[WEATHER, TIME], tool_choice="required", max_new_tokens=200,
                                    mode=mode, return_token_ids=True) for mode in ("tr", "ar")]
        assert one[0].token_ids == one[1].token_ids and one[0].finish_reason == "grammar"
        (call,) = one[0].raw.tool_calls
        args = check_args(call.name, call.arguments_json)
        assert not one[0].raw.tool_call_error and (len(call.id) == 9 and call.id.isalnum() if fmt == "mistral"
                                                   else call.id.startswith("call_"))
        history = [*first, {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments_json}}]},
            {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": '{"time": "12:00"}'}]
        prompt = grpc_client.tokenize(messages=history, tools=[WEATHER, TIME])
        two = [grpc_client.generate(messages=history, tools=[WEATHER, TIME], tool_choice="auto", max_new_tokens=16,
                                    mode=mode, return_token_ids=True) for mode in ("tr", "ar")]
    shown, written = tok.decode(prompt), json.dumps(args, ensure_ascii=False)
    rendered = {"hermes": f'<|im_start|>assistant\n<tool_call>\n{{"name": "{call.name}", "arguments": {written}}}\n'
                          "</tool_call><|im_end|>",
                "llama3_json": f'<|start_header_id|>assistant<|end_header_id|>\n\n{{"name": "{call.name}", '
                               f'"parameters": {written}}}<|eot_id|>',
                "mistral": f'[TOOL_CALLS][{{"name": "{call.name}", "arguments": {written}, "id": "{call.id}"}}]</s>'
                           f'[TOOL_RESULTS]{{"content": {{"time": "12:00"}}, "call_id": "{call.id}"}}[/TOOL_RESULTS]'}
    assert rendered[fmt] in shown, shown[-400:]
    assert two[0].token_ids == two[1].token_ids and two[0].stats.prompt_tokens == len(prompt)
    for c in two[0].raw.tool_calls:
        check_args(c.name, c.arguments_json)
    http = client.chat.completions.create(model=model, temperature=0, max_tokens=16, tools=[WEATHER, TIME],
                                          tool_choice="auto", messages=history)
    assert http.usage.prompt_tokens == len(prompt) and http.model_extra["trserve"]["token_ids"] == two[0].token_ids


@pytest.mark.parametrize("family", ["mistral"], indirect=True)
def test_mistral_s_marker_after_text_keeps_its_call(family):
    """Mistral's special [TOOL_CALLS] after text (as its models write it): the reply keeps the token's text
    (GenerationRequest.kept_special), so the call after it is read, in Generate and GenerateStream, TR == AR.
    Decoded without it, as every other special token, the call's opening would be lost with it."""
    fmt, _, addr, _, _, tok = family[:6]
    functions = {t["function"]["name"]: t["function"] for t in (WEATHER, TIME)}
    lines = auto_grammar(fmt, functions, False, marker_tokens(tok, fmt)).splitlines()
    lines[1] = 'start: "Let me check." marker calls'  # the served grammar's calls, after this text
    request = pb.GenerateRequest(
        messages=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="What time is it in Asia/Tokyo?")],
                                 tools=json.dumps([WEATHER, TIME])),
        max_new_tokens=200, structured_output=pb.StructuredOutput(grammar="\n".join(lines)), return_token_ids=True)
    with grpc.insecure_channel(addr) as channel:
        stub = generate_pb2_grpc.GenerateStub(channel)
        replies = []
        for mode in (pb.DECODING_MODE_TR, pb.DECODING_MODE_AR):
            request.mode = mode
            replies.append(stub.Generate(request, timeout=300))
        last = list(stub.GenerateStream(request, timeout=300))[-1]
    reply = replies[0]
    assert list(reply.token_ids) == list(replies[1].token_ids)
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    assert marker in reply.token_ids and reply.text.startswith("Let me check.[TOOL_CALLS][{"), reply.text
    (call,) = reply.tool_calls
    check_args(call.name, call.arguments_json)
    assert not reply.tool_call_error and [(c.name, c.arguments_json) for c in last.tool_calls] == \
        [(call.name, call.arguments_json)]
