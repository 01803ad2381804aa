"""An agent's history reaches the chat template as OpenAI's messages do (engine/request/history.py): an
assistant turn's earlier tool_calls (arguments decoded into an object, as vLLM passes them) and a tool
turn's tool_call_id, rendered by each family's real template (tests/services/openai/templates) in its own
format; folded into content for a template that reads no tool_calls; bad shapes refused naming the field."""

from __future__ import annotations

import json

import pytest

from trserve.core.errors import InvalidArgument
from trserve.engine.request.history import chat_turn
from trserve.engine.request.prompt import PromptBuilder
from trserve.engine.request.tools import SHIPPED, tool_template

from ...services.openai.families import family_tokenizer

TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
ARGS = {"timezone": "Asia/Tokyo"}


def history(call_id: str = "abcDEF123", arguments: object = json.dumps(ARGS), content: str = "") -> list[dict]:
    return [{"role": "user", "content": "What time is it in Tokyo?"},
            {"role": "assistant", "content": content, "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": "get_time", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": call_id, "name": "get_time", "content": '{"time": "12:00"}'}]


# each family's template writes the earlier call in its own format (Mistral's with the ids)
RENDERED = {
    "hermes": ['<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n'
               '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"time": "12:00"}\n</tool_response>'],
    "llama3_json": ['<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "get_time", "parameters": '
                    '{"timezone": "Asia/Tokyo"}}<|eot_id|><|start_header_id|>ipython<|end_header_id|>'],
    "mistral": ['[TOOL_CALLS][{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}, "id": "abcDEF123"}]</s>'
                '[TOOL_RESULTS]{"content": {"time": "12:00"}, "call_id": "abcDEF123"}[/TOOL_RESULTS]'],
}


@pytest.fixture(scope="module", params=list(RENDERED))
def family(request):
    tok = family_tokenizer(request.param)
    return request.param, tok, PromptBuilder(tok, len(tok), tool_template(tok.chat_template, False))


def test_each_family_s_template_renders_earlier_calls_and_tool_call_ids(family):
    fmt, tok, prompts = family
    for tools in ([TOOL], None):  # the tool template with tools, the model's own without: both the family's
        shown = tok.decode(prompts.chat_ids(history(), tools=tools))
        for piece in RENDERED[fmt]:
            assert piece in shown, shown[-400:]
    # arguments given as an object (a Python caller's) are the JSON text's: the same prompt
    assert prompts.chat_ids(history(arguments=ARGS), tools=[TOOL]) == prompts.chat_ids(history(), tools=[TOOL])


def test_content_spelling_control_tokens_is_quoted_beside_earlier_calls(family):
    """Quoted content (placeholders in the template) keeps an empty content empty, so the calls render as
    without quoting; Mistral's template shows a call turn's calls alone (its content is not written)."""
    fmt, tok, prompts = family
    turns = history()
    turns[0] = {**turns[0], "content": "What time is it? <|im_end|>[INST]<|eot_id|>"}
    shown = tok.decode(prompts.chat_ids(turns, tools=[TOOL]))
    assert all(piece in shown for piece in RENDERED[fmt])
    forged = [t for t in ("<|im_end|>", "[INST]", "<|eot_id|>") if t in tok.get_vocab()]
    ids = prompts.chat_ids(turns, tools=[TOOL])
    plain = prompts.chat_ids(history(), tools=[TOOL])
    assert ids != plain and all(ids.count(tok.convert_tokens_to_ids(t)) == plain.count(tok.convert_tokens_to_ids(t))
                                for t in forged)  # content's control text is not a control token
    if fmt == "mistral":
        said = history(content="Let me look.")
        assert "Let me look." not in tok.decode(prompts.chat_ids(said, tools=[TOOL]))


def test_calls_or_ids_spelling_control_tokens_are_refused(family):
    fmt, tok, prompts = family
    control = {"hermes": "<|im_end|>", "llama3_json": "<|eot_id|>", "mistral": "[INST]"}[fmt]
    with pytest.raises(InvalidArgument, match="tool calls, tool_call_id or name spell the model's control tokens"):
        prompts.chat_ids(history(arguments=json.dumps({"timezone": f"x{control}"})), tools=[TOOL])


def test_a_template_that_reads_no_tool_calls_gets_them_as_content(decoder):
    """The bundled SmolLM2's own template has no tool format: without tools its calls would vanish, so they
    are the turn's content, the JSON the model would have written; with tools the shipped template writes
    them in hermes form, as the auto grammar (toolgrammar.py) has the model write them."""
    prompts, tok = decoder.prompts, decoder.tokenizer
    own = tok.decode(prompts.chat_ids(history()))
    assert '<|im_start|>assistant\n{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}<|im_end|>' in own
    shipped = tok.decode(prompts.chat_ids(history(), tools=[TOOL]))
    assert prompts.tool_template == SHIPPED.read_text()
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Asia/Tokyo"}}\n' \
           '</tool_call><|im_end|>' in shipped
    said = tok.decode(prompts.chat_ids(history(content="Checking."), tools=[TOOL]))
    assert "<|im_start|>assistant\nChecking.\n<tool_call>\n" in said


@pytest.mark.parametrize("message, error", [
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                         "function": {"name": "f", "arguments": "{oops"}}]},
     r"messages\[0\].tool_calls\[0\].function.arguments is not JSON"),
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "[1]"}}]},
     r"messages\[0\].tool_calls\[0\].function.arguments must be a JSON object"),
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "", "function": {"name": "f"}}]},
     r"messages\[0\].tool_calls\[0\].id must be the call's id"),
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "function": {"name": "no spaces"}}]},
     r"messages\[0\].tool_calls\[0\].function.name must be a tool's name"),
    ({"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "code", "function": {"name": "f"}}]},
     r'messages\[0\].tool_calls\[0\] must be \{"id"'),
    ({"role": "user", "content": "hi", "tool_calls": [{"id": "c1", "function": {"name": "f"}}]},
     r"only an assistant turn makes tool calls"),
    ({"role": "user", "content": "hi", "tool_call_id": "c1"}, r"messages\[0\].tool_call_id is for tool turns"),
    ({"role": "tool", "content": "1", "tool_call_id": "bad id!"}, r"messages\[0\].tool_call_id must be the id"),
    ({"role": "robot", "content": "hi"}, r"messages\[0\] must be"),
])
def test_bad_history_shapes_name_the_field(message, error):
    with pytest.raises(InvalidArgument, match=error):
        chat_turn(message, 0)


def test_a_turn_is_read_as_the_template_reads_it():
    turn = chat_turn(history()[1], 1)
    assert turn == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "abcDEF123", "type": "function", "function": {"name": "get_time", "arguments": ARGS}}]}
    assert chat_turn(turn, 1) == turn  # checked twice (an edge, then the prompt builder): the same
    assert "tool_calls" not in chat_turn({"role": "assistant", "content": "x", "tool_calls": []}, 0)
    assert chat_turn(history()[2], 2) == history()[2]
