"""tool_choice as both edges shape a request with it (services/openai/toolchoice.py): HTTP's `tool_choice`
and gRPC's ChatMessages.tool_choice give the same engine fields and read replies the same way."""

from __future__ import annotations

import json

import pytest

from trserve.core.errors import InvalidArgument
from trserve.engine.request.history import chat_turns
from trserve.services.openai.toolchoice import HOW, apply_tool_choice
from trserve.services.openai.toolgrammar import auto_grammar

FUNCTIONS = {"get_time": {"name": "get_time", "parameters": {"type": "object", "properties": {
    "timezone": {"type": "string"}}, "required": ["timezone"]}}, "noop": {"name": "noop"}}
TURNS = chat_turns([{"role": "user", "content": "Time in Tokyo?"}, {"role": "assistant", "content": "", "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"timezone": "UTC"}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "12:00"}, {"role": "user", "content": "And Tokyo?"}])


def opts() -> dict:
    return {"messages": list(TURNS), "structured": None, "tools": None}


def test_required_and_named_hold_the_reply_to_one_call_and_read_it():
    o = opts()
    reading = apply_tool_choice(o, FUNCTIONS, "required", "mistral", function="get_time")
    schema = json.loads(o["structured"].spec)
    assert o["structured"].kind == "json_schema" and schema["properties"]["name"] == {"const": "get_time"}
    assert o["messages"][0]["role"] == "system" and o["messages"][0]["content"].startswith(HOW) and o["tools"] is None
    whole = reading.read('{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}', "grammar")
    (call,) = whole.calls
    assert call["function"] == {"name": "get_time", "arguments": '{"timezone": "Asia/Tokyo"}'} and not whole.error
    assert len(call["id"]) == 9 and call["id"].isalnum()  # mistral's templates take only such ids back
    cut = reading.read('{"name": "get_time", "argu', "length")
    assert not cut.calls and cut.content == '{"name": "get_time", "argu' and "cut (length)" in cut.error


def test_auto_gives_the_tools_to_the_template_and_the_format_s_grammar():
    o = opts()
    reading = apply_tool_choice(o, FUNCTIONS, "auto", "hermes", parallel=False)
    assert o["structured"].spec == auto_grammar("hermes", FUNCTIONS, False) and len(o["tools"]) == 2
    assert o["messages"] == TURNS and reading.auto.held and not reading.auto.parallel
    text = '<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>'
    assert [c["function"]["name"] for c in reading.read(text, "eos").calls] == ["noop"]
    # a template that reads no tool_calls: earlier calls become content, as the model writes them in the format
    folded = opts()
    apply_tool_choice(folded, FUNCTIONS, "auto", "llama3_json", fold=True)
    assert folded["messages"][1] == {"role": "assistant", "content": '{"name": "get_time", "parameters": '
                                                                     '{"timezone": "UTC"}}'}
    assert apply_tool_choice(opts(), FUNCTIONS, "none", "hermes") is None


@pytest.mark.parametrize("choice, fmt, function, structured, message", [
    ("auto", None, None, None, "needs a chat template with a tool format"),
    ("auto", "hermes", None, "x", "cannot both shape one reply"),
    ("required", "hermes", None, "x", "cannot both shape one reply"),
    ("auto", "hermes", "noop", None, 'goes with tool_choice "required"'),
    ("required", "hermes", "other", None, "'other', which is not one of the tools"),
    ("any", "hermes", None, None, "tool_choice must be one of"),
])
def test_refusals_say_what_to_send(choice, fmt, function, structured, message):
    o = {**opts(), "structured": structured}
    with pytest.raises(InvalidArgument, match=message):
        apply_tool_choice(o, FUNCTIONS, choice, fmt, function=function)
