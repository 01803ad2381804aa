"""Issue 59: the grammars that hold tool_choice "auto"'s calls in each format (toolgrammar.py), checked as
text and against the bundled model's tokenizer (llguidance's matcher: what it lets a reply be), and the
calls streamed in fragments (toolstream.py) assembling to exactly the unary answer's arguments."""

from __future__ import annotations

import dataclasses
import json

import pytest
from llguidance import LLMatcher
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from trserve.engine.tr.grammar import GrammarCompiler, StructuredOutput
from trserve.services.openai import convert
from trserve.services.openai.toolgrammar import auto_grammar, not_opening, object_end, scan_calls
from trserve.services.openai.tools import AutoTools
from trserve.services.openai.toolstream import AutoStream

from .test_toolparse import _body, _result

WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                                           "required": ["timezone"], "additionalProperties": False}}
FUNCTIONS = {"get_weather": WEATHER, "get_time": TIME}
PARIS = '{"name": "get_weather", "%s": {"city": "Paris", "unit": "celsius"}}'
TOKYO = '{"name": "get_time", "%s": {"timezone": "Asia/Tokyo"}}'


def test_the_grammars_as_text():
    llama = auto_grammar("llama3_json", FUNCTIONS).splitlines()
    assert llama[1] == 'start: LEAD? (TEXT | call ("; " call)*)?' and llama[2] == "LEAD: /\\s+/"
    assert '"parameters": {"$ref": "#/$defs/tool_0"}' in llama[-1] and '"arguments"' not in llama[-1]
    assert auto_grammar("llama3_json", FUNCTIONS, parallel=False).splitlines()[1] == "start: LEAD? (TEXT | call)?"
    mistral = auto_grammar("mistral", FUNCTIONS, parallel=False).splitlines()
    assert mistral[1] == "start: LEAD? (TEXT | call_trigger calls | calls)?" and 'calls: "[" call "]"' in mistral
    assert 'call_trigger[lazy]: BEFORE "[TOOL_CALLS]"' in mistral
    assert not_opening(("{", "<|a")) == "/([^\\s<\\{](.|\\n)*|<([^\\|](.|\\n)*)?|<\\|([^a](.|\\n)*)?)/"
    assert auto_grammar("hermes", FUNCTIONS).splitlines()[1] == "start: call* TEXT"
    # a marker that is the tokenizer's special token (its id): the calls may open with it (llama3_json: at the
    # start only; mistral: after text too)
    llama = auto_grammar("llama3_json", FUNCTIONS, markers=(7,)).splitlines()
    assert llama[1] == 'start: LEAD? (TEXT | marker? call ("; " call)*)?' and llama[-1] == "marker: <[7]>"
    mistral = auto_grammar("mistral", FUNCTIONS, False, (9,)).splitlines()
    assert mistral[1] == "start: LEAD? (TEXT | call_trigger calls | TEXT? marker calls | calls)?" and \
        mistral[-1] == "marker: <[9]>"
    hermes = auto_grammar("hermes", FUNCTIONS, markers=(3, 4)).splitlines()  # <tool_call>, </tool_call> tokens
    assert hermes[3].startswith('call: TEXT <[3]> "\\n" %json ') and hermes[3].endswith('"\\n" <[4]>')
    assert auto_grammar("hermes", FUNCTIONS, markers=(3,)).endswith('"\\n" "</tool_call>"')


def test_calls_are_scanned_as_written():
    assert object_end('x{"a": "}{\\"", "b": [{}]}y', 1) == 25 and object_end('{"a": [', 0) is None
    region = '[TOOL_CALLS][' + PARIS % "arguments" + ", " + (TOKYO % "arguments")[:-3]
    assert scan_calls(region) == [("get_weather", '{"city": "Paris", "unit": "celsius"}', True),
                                  ("get_time", '{"timezone": "Asia/Tokyo', False)]
    assert scan_calls('{"name": "get_time", "parameters": ') == [("get_time", "", False)]
    assert scan_calls('{"name": "get_time", "parameters": 7}') == [] == scan_calls('{"name": "get_ti')


@pytest.fixture(scope="module")
def matcher(loaded_smollm2):
    tok = loaded_smollm2.tokenizer
    compiler = GrammarCompiler(tok, int(loaded_smollm2.model.config.vocab_size), frozenset({tok.eos_token_id}))

    def run(fmt: str, text: str, parallel: bool = True) -> str:
        compiled = compiler.compile(StructuredOutput("grammar", auto_grammar(fmt, FUNCTIONS, parallel)))
        m = LLMatcher(compiled.tokenizer, compiled.text)
        if not all(m.consume_token(t) for t in tok(text, add_special_tokens=False)["input_ids"]):
            return "refused"
        return "whole" if m.is_accepting() else "unfinished"
    return run


L, M = PARIS % "parameters", PARIS % "arguments"


@pytest.mark.parametrize("fmt, text, verdict", [
    ("llama3_json", "The weather is mild.", "whole"), ("llama3_json", "  Hi {x}", "whole"),
    ("llama3_json", "", "whole"), ("llama3_json", L, "whole"),
    ("llama3_json", "\n\n" + L + "; " + TOKYO % "parameters", "whole"),
    ("llama3_json", L.replace("celsius", "kelvin"), "refused"),  # not in the enum
    ("llama3_json", L.replace("parameters", "arguments"), "refused"),
    ("llama3_json", '{"answer": 42}', "refused"), ("llama3_json", ' {"answer": 42}', "refused"),
    ("llama3_json", "<|python_tag|>" + L, "refused"), ("llama3_json", "<|pyth", "whole"),
    ("llama3_json", "<b>", "whole"),
    ("llama3_json", L[:30], "unfinished"),
    ("mistral", "Sure.", "whole"), ("mistral", "Sure. [TOOL_CALLS][" + M + "]", "whole"),
    ("mistral", "[TOOL_CALLS][" + M + ", " + TOKYO % "arguments" + "]", "whole"), ("mistral", "\n[" + M + "]", "whole"),
    ("mistral", "[1, 2] is a list", "whole"), ("mistral", '[{"answer": 42}]', "refused"),
    ("mistral", "Sure [TOOL_CALLS] and more text", "refused"),
    ("mistral", 'Sure [TOOL_CALLS][{"name": "send_mail", "arguments": {}}]', "refused"),
    ("hermes", "x <tool_call>\n" + TOKYO % "arguments" + "\n</tool_call>", "whole"),
    ("hermes", 'x <tool_call>\n{"answer": 42}', "refused"),
])
def test_what_each_grammar_lets_a_reply_be(matcher, fmt, text, verdict):
    assert matcher(fmt, text) == verdict


def test_parallel_tool_calls_false_allows_one_call(matcher):
    assert matcher("llama3_json", L + "; ", parallel=False) == "refused" == matcher("mistral", "[" + M + ", ", False)
    assert matcher("llama3_json", L, parallel=False) == "whole" == matcher("mistral", "[" + M + "]", False)


HERMES = "Let me check. <tool_call>\n" + M + "\n</tool_call>\n<tool_call>\n" + TOKYO % "arguments" + "\n</tool_call>"
LLAMA3 = "\n\n" + L + "; " + TOKYO % "parameters"
MISTRAL = "Checking. [TOOL_CALLS][" + M + ", " + TOKYO % "arguments" + "]"


def stream(fmt: str, text: str, size: int, finish: str = "eos", **body) -> tuple[list[dict], object]:
    """`text` streamed in `size`-character pieces through the chat chunk writer: (the chunks, the final
    completion the openai package assembles from them)."""
    writer = convert.ChunkWriter.of(convert.parse_request(_body(stream=True, **body), "chat", "m", None, fmt), "fp")
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    chunks = [writer.chunk(p, role=i == 0) for i, p in enumerate(pieces[:-1])]
    chunks.append(writer.last_chunk(pieces[-1], _result(text), finish, 0.0, "default"))
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    # (a reply cut by the length: the package's final completion refuses it, its snapshot has what came)
    done = state.current_completion_snapshot if finish == "length" else state.get_final_completion()
    return chunks, done.choices[0]


@pytest.mark.parametrize("fmt, text", [("hermes", HERMES), ("llama3_json", LLAMA3), ("mistral", MISTRAL)])
@pytest.mark.parametrize("size", [1, 4, 1000])
def test_streamed_arguments_come_in_fragments_that_add_up_to_the_unary_answer(fmt, text, size):
    chunks, done = stream(fmt, text, size)
    unary = convert.completion(convert.parse_request(_body(), "chat", "m", None, fmt), _result(text), 0.0, "fp", None,
                               "default")["choices"][0]
    assert done.finish_reason == unary["finish_reason"] == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in done.message.tool_calls] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in unary["message"]["tool_calls"]]
    assert json.loads(done.message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    deltas = [d for c in chunks for d in c["choices"][0]["delta"].get("tool_calls", [])]
    firsts = [d for d in deltas if "id" in d]
    assert [(d["index"], d["type"], d["function"]["name"]) for d in firsts] == \
        [(0, "function", "get_weather"), (1, "function", "get_time")]
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in deltas if "id" not in d)
    if size < 1000:  # written piece by piece: the arguments went out as they were written
        assert len(deltas) > 10 and max(len(d["function"]["arguments"]) for d in deltas) <= size


def test_a_stream_cut_inside_a_call_has_sent_its_fragments():
    text = "\n\n" + L + "; " + (TOKYO % "parameters")[:-6]
    chunks, done = stream("llama3_json", text, 5, finish="length")
    assert done.finish_reason == "length" and not done.message.content
    assert [(c.function.name, c.function.arguments) for c in done.message.tool_calls] == \
        [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", '{"timezone": "Asia/To')]
    cut = dataclasses.replace(_result(text), finish_reason="length")
    unary = convert.completion(convert.parse_request(_body(), "chat", "m", None, "llama3_json"), cut, 0.0, "fp", None,
                               "default")["choices"][0]
    assert unary["finish_reason"] == "length" and unary["message"] == {"role": "assistant", "content": text}


def test_without_a_grammar_each_call_goes_out_whole():
    auto = AutoTools("hermes", ("get_weather", "get_time"))  # held False: nothing holds the calls' form
    reader, deltas = AutoStream(auto), []
    for i in range(0, len(HERMES), 3):
        deltas += reader.feed(HERMES[i:i + 3])[1]
    assert [(d["index"], d["function"]["name"], json.loads(d["function"]["arguments"])) for d in deltas] == \
        [(0, "get_weather", {"city": "Paris", "unit": "celsius"}), (1, "get_time", {"timezone": "Asia/Tokyo"})]
    held = AutoStream(AutoTools("hermes", ("get_weather", "get_time"), parallel=False, held=True))
    out = [d for i in range(0, len(HERMES), 3) for d in held.feed(HERMES[i:i + 3])[1]]
    assert {d["index"] for d in out} == {0} and len(out) > 1


def test_mistral_s_special_marker_may_follow_text():
    """Where the tokenizer has [TOOL_CALLS] as a special token (Mistral's), the calls open with it at the
    start or after text, as Mistral's models write it; its text form stays a lazy trigger, and the token
    never opens anything but a list of calls."""
    from .families import family_tokenizer

    tok = family_tokenizer("mistral")
    marker = tok.convert_tokens_to_ids("[TOOL_CALLS]")
    compiler = GrammarCompiler(tok, len(tok), frozenset({tok.eos_token_id}))
    compiled = compiler.compile(StructuredOutput("grammar", auto_grammar("mistral", FUNCTIONS, True, (marker,))))

    def verdict(*parts) -> str:
        m = LLMatcher(compiled.tokenizer, compiled.text)
        ids = [t for p in parts for t in ([marker] if p is marker else tok.encode(p, add_special_tokens=False))]
        if not all(m.consume_token(t) for t in ids):
            return "refused"
        return "whole" if m.is_accepting() else "unfinished"

    assert verdict("Let me check.", marker, "[" + M + "]") == "whole"
    assert verdict(marker, "[" + M + ", " + TOKYO % "arguments" + "]") == "whole"
    assert verdict("Let me check.", marker, "[" + M) == "unfinished"
    assert verdict("Let me check.", marker, "Paris is sunny.") == "refused"
    assert verdict("Let me check.", marker, '[{"name": "send_mail", "arguments": {}}]') == "refused"
    assert verdict("Sure.") == "whole"
