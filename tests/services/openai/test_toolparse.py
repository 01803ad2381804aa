"""Issue 59, item 1: tool calls read out of replies written in each family's own format (hermes / Qwen,
Llama 3 JSON, Mistral), malformed ones kept as content, the same calls whether the reply comes whole or
streamed (through the HTTP layer's chunk writer, assembled by the `openai` package), and which format a
chat template teaches."""

from __future__ import annotations

import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from trserve.engine.request.tools import SHIPPED, tool_template
from trserve.engine.results import GenerationResult, GenerationStats
from trserve.services.openai import convert
from trserve.services.openai.toolparse import Parsed, ToolReader, detect_format, parse_reply, resolve_parser

NAMES = ("get_weather", "get_time")
HERMES = ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
          '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n'
          '</tool_call>')
LLAMA3 = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
          '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}')
MISTRAL = ('Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
           '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]')
MISTRAL_V11 = ('Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
               '[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{"timezone": "Europe/Paris"}')  # tokenizers v11 on
BOTH = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})]


def calls_of(parsed) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.calls]


@pytest.mark.parametrize("fmt, text, content", [("hermes", HERMES, "I will look both up."),
                                                 ("llama3_json", LLAMA3, None), ("mistral", MISTRAL, "Checking."),
                                                 ("mistral", MISTRAL_V11, "Checking.")])
def test_each_format_gives_its_calls_and_the_text_around_them(fmt, text, content):
    parsed = parse_reply(fmt, text, NAMES)
    assert calls_of(parsed) == BOTH and parsed.content == content and parsed.error is None
    assert all(c["type"] == "function" for c in parsed.calls)
    # ids: Mistral's templates take 9 letters and digits (a tool result's tool_call_id), the others call_...
    assert all(len(c["id"]) == 9 and c["id"].isalnum() if fmt == "mistral" else c["id"].startswith("call_")
               for c in parsed.calls)
    assert len({c["id"] for c in parsed.calls}) == 2
    first = parse_reply(fmt, text, NAMES, parallel=False)  # parallel_tool_calls: false
    assert calls_of(first) == BOTH[:1]


@pytest.mark.parametrize("fmt, text", [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}'),  # tag decoded away
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}]'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"unit\\": \\"celsius\\"}"}'
               '\n</tool_call>'),  # arguments written as a JSON string
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}'),  # EOS, no close
])
def test_variants_the_families_write(fmt, text):
    parsed = parse_reply(fmt, text, NAMES)
    assert calls_of(parsed) == [("get_weather", {"city": "Oslo", "unit": "celsius"})] and parsed.error is None


@pytest.mark.parametrize("fmt, text", [
    ("hermes", 'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"\n</tool_call>'),  # bad JSON
    ("hermes", '<tool_call>\n{"name": "send_mail", "arguments": {}}\n</tool_call>'),  # not one of the tools
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>'),  # arguments not an object
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"timezone": '),  # cut
    ("llama3_json", '{"name": "get_tme", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS][{"name": "get_time", "arguments": {}}'),
    ("mistral", '[TOOL_CALLS]{"name": "get_time", "arguments": {}}'),  # not a list
    ("mistral", '[TOOL_CALLS]get_time{"timezone": "UTC"}'),  # the newer form without [ARGS]
    ("mistral", '[TOOL_CALLS]get_time[ARGS]{"timezone": "UTC"} {}'),  # two values after [ARGS]
    ("mistral", '[TOOL_CALLS]get_tme[ARGS]{}'),  # not one of the tools
    ("mistral", '[TOOL_CALLS][ARGS]{}'),  # no name
])
def test_a_malformed_call_stays_content_and_says_why(fmt, text):
    parsed = parse_reply(fmt, text, NAMES)
    assert parsed.calls == [] and parsed.content == text and parsed.error


@pytest.mark.parametrize("fmt, text", [
    ("llama3_json", '{"name": "get_time", "parameters": {"timezone": "As'),  # `<|python_tag|>` decoded away
    ("llama3_json", '  {"name": "get_'),
    ("mistral", '[{"name": "get_time", "arguments": {"timezone": '),  # `[TOOL_CALLS]` decoded away
])
def test_a_held_call_cut_without_its_marker_is_malformed_not_text(fmt, text):
    """Where the grammar held the reply, text cannot open with `{` (`[{`): a reply that does is a call whose
    special-token marker was decoded away; cut by max_tokens, it is malformed (stop_reason says so). Unheld,
    such text may be an answer in JSON: content, no error."""
    held = parse_reply(fmt, text, NAMES, held=True)
    assert held.calls == [] and held.content == text and held.error
    assert parse_reply(fmt, text, NAMES) == Parsed(text, [], None)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "mistral"])
@pytest.mark.parametrize("text", ["The weather in Paris is mild.", '{"answer": 42}', "[1, 2] is a list", "  "])
def test_a_reply_without_a_call_is_its_text(fmt, text):
    assert parse_reply(fmt, text, NAMES) == Parsed(text, [], None)


@pytest.mark.parametrize("fmt, text", [("hermes", HERMES), ("llama3_json", LLAMA3), ("mistral", MISTRAL),
                                       ("mistral", MISTRAL_V11),
                                       ("hermes", "Plain text, <tool_ no call here"),
                                       ("hermes", HERMES.replace('"celsius"}}', '"celsius"}'))])
def test_streamed_in_any_pieces_the_reply_reads_the_same(fmt, text):
    whole = parse_reply(fmt, text, NAMES)
    for size in (1, 3, 7):
        reader, content, calls = ToolReader(fmt, NAMES), "", []
        for i in range(0, len(text), size):
            more, got = reader.feed(text[i:i + size])
            content, calls = content + more, calls + got
        more, got = reader.finish()
        content, calls = content + more, calls + got
        assert [c["index"] for c in calls] == list(range(len(calls)))
        assert [c["function"] for c in calls] == [c["function"] for c in whole.calls]
        assert (content.strip() or None) == (whole.content.strip() if whole.content else None)


def _result(text: str) -> GenerationResult:
    stats = GenerationStats(prompt_tokens=3, generated_tokens=5, steps=5, accepted_per_step=[1] * 5, mat=1.0,
                            prefill_s=0.0, decode_s=0.1, tokens_per_s=50.0, matrix_version=None, matrix_epoch=None,
                            draft_mode="none", tree="none")
    return GenerationResult(ids=[1, 2, 3, 4, 5], text=text, finish_reason="eos", stats=stats)


def _body(**more) -> dict:
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [
        tool, {"type": "function", "function": {"name": "get_time"}}], **more}


@pytest.mark.parametrize("parallel", [True, False])
def test_the_chunk_writer_streams_calls_the_openai_package_assembles(parallel):
    req = convert.parse_request(_body(stream=True, parallel_tool_calls=parallel), "chat", "m", None, "hermes")
    assert req.auto is not None and req.ask.options["tools"][0]["function"]["name"] == "get_weather"
    writer = convert.ChunkWriter.of(req, "fp")
    state = ChatCompletionStreamState()
    pieces = [HERMES[i:i + 5] for i in range(0, len(HERMES) - 5, 5)]
    chunks = [writer.chunk(p, role=i == 0) for i, p in enumerate(pieces)]
    chunks.append(writer.last_chunk(HERMES[len("".join(pieces)):], _result(HERMES), "eos", 0.0, "default"))
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    done = state.get_final_completion().choices[0]
    assert done.finish_reason == "tool_calls" and done.message.content == "I will look both up."
    got = [(c.function.name, json.loads(c.function.arguments)) for c in done.message.tool_calls]
    assert got == (BOTH if parallel else BOTH[:1])
    unary = convert.completion(req, _result(HERMES), 0.0, "fp", None, "default")["choices"][0]
    assert unary["finish_reason"] == "tool_calls" and unary["message"]["content"] == "I will look both up."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in unary["message"]["tool_calls"]] == \
        [(c.function.name, c.function.arguments) for c in done.message.tool_calls]


def test_a_malformed_call_is_a_stop_with_its_text_unary_and_streamed():
    text = 'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    req = convert.parse_request(_body(), "chat", "m", None, "hermes")
    unary = convert.completion(req, _result(text), 0.0, "fp", None, "default")["choices"][0]
    assert unary["finish_reason"] == "stop" and unary["stop_reason"] == "malformed_tool_call"
    assert unary["message"] == {"role": "assistant", "content": text}
    writer = convert.ChunkWriter.of(convert.parse_request(_body(stream=True), "chat", "m", None, "hermes"), "fp")
    chunks = [writer.chunk(text[:20], role=True), writer.last_chunk(text[20:], _result(text), "eos", 0.0, "default")]
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    done = state.get_final_completion().choices[0]
    assert done.finish_reason == "stop" and done.message.content == text and not done.message.tool_calls
    assert chunks[-1]["choices"][0]["stop_reason"] == "malformed_tool_call"


def test_earlier_calls_go_to_the_template_as_tool_calls():
    """An assistant turn's tool_calls reach the template as they are, arguments decoded into an object (as
    vLLM passes them), so the template writes them in its own format (tests/engine/request/test_history.py);
    a tool turn's tool_call_id too (Mistral's template shows it). Bad ones: a 400 naming the message."""
    body = _body(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"timezone": "UTC"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "12:00"}])
    for fmt in ("hermes", "llama3_json"):
        turns = convert.parse_request(body, "chat", "m", None, fmt).ask.options["messages"]
        assert turns[1] == {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": {"timezone": "UTC"}}}]}
        assert turns[2] == {"role": "tool", "content": "12:00", "tool_call_id": "call_1"}
    body["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{'timezone': 'UTC'}"
    with pytest.raises(convert.BadParam, match=r"messages\[1\].tool_calls\[0\].function.arguments is not JSON") as bad:
        convert.parse_request(body, "chat", "m", None, "hermes")
    assert bad.value.param == "messages[1]"


def test_auto_without_a_format_is_refused_naming_why():
    with pytest.raises(convert.BadParam, match="tool format"):
        convert.parse_request(_body(), "chat", "m", None, None)
    with pytest.raises(convert.BadParam, match="parallel_tool_calls"):
        convert.parse_request(_body(parallel_tool_calls="no"), "chat", "m", None, "hermes")


# excerpts of each family's own chat template: the text that says how a call is written
QWEN25 = ('{%- if tools %}...For each function call, return a json object with function name and arguments within '
          '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}')
LLAMA31 = ('{%- if tools is not none %}...{%- if builtin_tools is defined and tool_call.name in builtin_tools %}'
           '{{- "<|python_tag|>" + tool_call.name + ".call(" }}')
LLAMA32_JSON = ("{%- if tools is not none %}{{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}{{- 'Respond in "
                'the format {"name": function name, "parameters": dictionary of argument name and its value}. \' }}')
MISTRAL_V3 = '{%- if tools is not none and (message == user_messages[-1]) %}...{{- "[TOOL_CALLS] [" }}'
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}")


def test_the_format_is_read_from_the_template():
    assert [detect_format(t) for t in (QWEN25, LLAMA31, LLAMA32_JSON, MISTRAL_V3, CHATML, None)] == \
        ["hermes", "llama3_json", "llama3_json", "mistral", None, None]
    assert detect_format(SHIPPED.read_text()) == "hermes"
    assert resolve_parser("auto", CHATML) is None and resolve_parser("mistral", CHATML) == "mistral"
    assert resolve_parser("none", QWEN25) is None
    with pytest.raises(ValueError, match="hermes"):
        resolve_parser("qwen", QWEN25)


def test_which_template_renders_tools():
    assert tool_template(CHATML, custom=False) == SHIPPED.read_text()  # the bundled model's case
    assert tool_template(CHATML, custom=True) == CHATML  # --chat-template wins
    assert tool_template(QWEN25, custom=False) == QWEN25
    plain = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}"
    assert tool_template(plain, custom=False) == plain and tool_template(None, custom=False) is None


def test_the_parser_is_a_flag_and_a_variable(capsys):
    from trserve.services.cli import build_parser, main
    from trserve.services.envconfig import apply_env
    from trserve.services.node.cli import build_configs
    from trserve.services.worker.config import WorkerConfig

    parser = build_parser()
    apply_env(parser, {"TRSERVE_TOOL_CALL_PARSER": "none"})
    assert build_configs(parser.parse_args(["worker", "--matrix-addr", "m:1"]))[0].tool_call_parser == "none"
    assert build_configs(build_parser().parse_args(["serve", "--tool-call-parser", "mistral"]))[0].tool_call_parser == \
        "mistral"
    assert WorkerConfig().tool_call_parser == "auto"
    with pytest.raises(ValueError, match="tool_call_parser must be one of auto, hermes"):
        WorkerConfig(tool_call_parser="qwen")
    with pytest.raises(SystemExit):
        main(["serve"], environ={"TRSERVE_TOOL_CALL_PARSER": "qwen"})
    assert "TRSERVE_TOOL_CALL_PARSER='qwen' (for --tool-call-parser): choose from auto" in capsys.readouterr().err


def test_with_a_reasoning_parser_the_thinking_is_split_off_and_the_calls_read():
    """--reasoning-parser think with tool_choice auto: reasoning_content, then the call (streamed)."""
    import dataclasses

    from trserve.services.openai.reasoning import ReasoningChunkWriter, ReasoningSplitter, split
    from trserve.services.openai.reasoning_parsers import THINK

    text = '<think>The user wants the weather.</think>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    req = convert.parse_request(_body(stream=True), "chat", "m", None, "hermes")
    base = convert.ChunkWriter.of(req, "fp")
    fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(convert.ChunkWriter)}
    writer = ReasoningChunkWriter(**fields, splitter=ReasoningSplitter(THINK)).choices(1)[0]
    chunks = [writer.chunk(text[i:i + 6], role=i == 0) for i in range(0, 96, 6)]
    chunks.append(writer.last_chunk(text[96:], _result(text), "eos", 0.0, "default"))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants the weather."
    assert not "".join(d.get("content") or "" for d in deltas).strip()
    assert [c["function"]["name"] for d in deltas for c in d.get("tool_calls", []) if "id" in c] == ["get_time"]
    unary = convert.completion(convert.parse_request(_body(), "chat", "m", None, "hermes"), _result(text), 0.0, "fp",
                               None, "default")["choices"][0]
    assert unary["finish_reason"] == "tool_calls"
    assert split(unary["message"]["content"], THINK) == ("The user wants the weather.", None)
