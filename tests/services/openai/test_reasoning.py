"""--reasoning-parser on text written in the real format (DeepSeek-R1 / Qwen3 `<think>...</think>`), whole
and streamed in pieces whose boundaries split a tag; the stream writer's deltas; and the HTTP fields that
shape the prompt (chat_template_kwargs, add_generation_prompt, continue_final_message) as the request
parser takes and refuses them. No model: tests/services/openai/test_chat_options_api.py runs a server."""

from __future__ import annotations

import itertools

import pytest

from trserve.engine.request.chat import ChatOptions
from trserve.services.openai.convert import BadParam, ChunkWriter, parse_request, tokenize_request
from trserve.services.openai.reasoning import (ReasoningChunkWriter, ReasoningSplitter, prompt_state,
                                               split)
from trserve.services.openai.reasoning_parsers import PARSERS, THINK
from trserve.services.worker.checks import check_call
from trserve.services.worker.config import Limits

MODEL = "smollm2-135m-instruct"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is 17 * 3?"}]}
# a Qwen3 / DeepSeek-R1 reply as the model writes it (the template did not open the block)
QWEN3 = ("<think>\nOkay, 17 * 3: 10 * 3 = 30 and 7 * 3 = 21, so 51.\n</think>\n\n"
         "17 * 3 = **51**. (The tags <think> and </think> can be named in an answer too.)")
REASONING, ANSWER = QWEN3[len("<think>"):QWEN3.index("</think>")], QWEN3[QWEN3.index("</think>") + 8:]
# DeepSeek-R1-0528 / QwQ: the template's generation prompt ends with "<think>\n"; the reply starts inside
R1 = "Hmm, 17 * 3 is 51.\n</think>\n\nThe answer is 51."


def test_the_parsers_offered():
    assert PARSERS["none"] is None and PARSERS["think"] == THINK == PARSERS["deepseek_r1"] == PARSERS["qwen3"]


def test_a_whole_reply_splits_into_reasoning_and_content():
    assert split(QWEN3, THINK) == (REASONING, ANSWER)
    assert split("  \n" + QWEN3, THINK) == (REASONING, ANSWER)  # whitespace before the block
    assert split(R1, THINK, "inside") == ("Hmm, 17 * 3 is 51.\n", "\n\nThe answer is 51.")
    # no tags: all content, no reasoning (also a reply that names the tags after its first words)
    assert split("17 * 3 = 51.", THINK) == (None, "17 * 3 = 51.")
    assert split("Use <think>x</think> tags.", THINK) == (None, "Use <think>x</think> tags.")
    assert split("", THINK) == (None, "")
    # cut by max_tokens inside the reasoning: reasoning, and no content
    assert split("<think>\nOkay, 17 * 3: 10 * 3 = 3", THINK) == ("\nOkay, 17 * 3: 10 * 3 = 3", None)
    assert split("Okay, 17 * 3: 10 * 3", THINK, "inside") == ("Okay, 17 * 3: 10 * 3", None)
    assert split("<think>\nOkay</th", THINK) == ("\nOkay</th", None)  # a cut tag is text
    assert split("<thi", THINK) == (None, "<thi")  # a reply cut while it opened: what it wrote
    # the prompt closed the block (Qwen3 with enable_thinking false): all content, even a tag
    assert split("<think>x</think>y", THINK, "after") == (None, "<think>x</think>y")
    assert split("<think></think>Yes.", THINK) == ("", "Yes.")  # an empty block is still a block


def test_the_prompt_says_where_the_reply_starts():
    assert prompt_state("<|im_start|>assistant\n", THINK) == "start"
    assert prompt_state("<|im_start|>assistant\n<think>\n", THINK) == "inside"  # R1, QwQ
    assert prompt_state("<|im_start|>assistant\n<think>\n\n</think>\n\n", THINK) == "after"  # Qwen3, no thinking
    assert prompt_state("<think>a</think> b <think>c", THINK) == "inside"


@pytest.mark.parametrize("text,state", [(QWEN3, "start"), (R1, "inside"), ("  <think>a</think>b", "start"),
                                        ("plain answer", "start"), ("<think>cut</thi", "start")])
def test_every_way_of_cutting_the_stream_gives_the_whole_replys_split(text, state):
    """Streamed pieces split anywhere (one or two cuts, e.g. `<thi` + `nk>` and `</th` + `ink>`): the
    pieces joined are the unary split, and no piece shows part of a tag as text."""
    whole = split(text, THINK, state)
    for cuts in itertools.chain(((i,) for i in range(len(text) + 1)),
                                itertools.combinations(range(0, len(text) + 1, 3), 2)):
        bounds = (0, *cuts, len(text))
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        splitter = ReasoningSplitter(THINK, state)
        got = [splitter.push(p, final=i == len(pieces) - 1) for i, p in enumerate(pieces)]
        reasoning, content = "".join(r for r, _ in got), "".join(c for _, c in got)
        assert (reasoning if splitter.reasoned else None, content or (None if splitter.reasoned else "")) == whole


def test_a_tag_split_over_two_pieces_is_held_until_it_is_whole():
    s = ReasoningSplitter(THINK)
    assert s.push("<thi") == ("", "")
    assert s.push("nk>\nFirst") == ("\nFirst", "")
    assert s.push(" step</th") == (" step", "")
    assert s.push("ink>\n\nAns") == ("", "\n\nAns")
    assert s.push("wer", final=True) == ("", "wer")
    s = ReasoningSplitter(THINK, "inside")
    assert s.push("a </") == ("a ", "") and s.push("b") == ("</b", "")  # not the tag after all


def _stream(body: dict, state: str, pieces: list[str]) -> list[dict]:
    """The deltas a reasoning writer makes of these texts (the last one ends the reply)."""
    req = parse_request({**body, "stream": True}, "chat", MODEL, "t")
    plain = ChunkWriter.of(req, "fp")
    writer = ReasoningChunkWriter(req, plain.id, plain.created, "fp", splitter=ReasoningSplitter(THINK, state))
    out = [writer.chunk(p, role=i == 0) for i, p in enumerate(pieces[:-1])]
    out.append(writer.chunk(pieces[-1] or None, "stop"))
    return [o["choices"][0]["delta"] for o in out]


def test_streamed_deltas_carry_reasoning_content_until_the_tag_closes_then_content():
    deltas = _stream(CHAT, "start", ["", "<thi", "nk>\nOkay,", " 51.</th", "ink>\n\n51", ""])
    assert deltas == [{"role": "assistant", "content": ""}, {}, {"reasoning_content": "\nOkay,"},
                      {"reasoning_content": " 51."}, {"content": "\n\n51"}, {}]
    # one step's text crosses the closing tag: both fields in one delta
    assert _stream(CHAT, "inside", ["Hm.</think>Yes", "."]) == [
        {"role": "assistant", "reasoning_content": "Hm.", "content": "Yes"}, {"content": "."}]
    # the end flushes a held partial tag as the text it is
    assert _stream(CHAT, "inside", ["cut </thi", ""]) == [{"role": "assistant", "reasoning_content": "cut "},
                                                        {"reasoning_content": "</thi"}]
    assert _stream(CHAT, "start", ["No tags", " here", ""]) == [
        {"role": "assistant", "content": "No tags"}, {"content": " here"}, {}]


def test_each_choice_of_a_stream_splits_its_own_text():
    req = parse_request({**CHAT, "stream": True, "n": 2}, "chat", MODEL, "t")
    plain = ChunkWriter.of(req, "fp")
    one, two = ReasoningChunkWriter(req, plain.id, plain.created, "fp",
                                    splitter=ReasoningSplitter(THINK)).choices(2)
    assert one.chunk("<think>a")["choices"][0]["delta"] == {"reasoning_content": "a"}
    assert two.chunk("b")["choices"][0] == {"index": 1, "finish_reason": None, "logprobs": None,
                                            "delta": {"content": "b"}}
    assert one.chunk("</think>c", "stop")["choices"][0]["delta"] == {"content": "c"}


# ---- the fields that shape the prompt ------------------------------------------------------------------
def test_chat_fields_reach_the_engine_request():
    ask = parse_request({**CHAT, "chat_template_kwargs": {"enable_thinking": False, "n": [1, {"x": None}]}},
                        "chat", MODEL, "t").ask
    chat = check_call(ask, Limits(), "default").request.chat
    assert dict(chat.template_kwargs) == {"enable_thinking": False, "n": [1, {"x": None}]}
    assert chat.add_generation_prompt and not chat.continue_final_message
    turns = CHAT["messages"] + [{"role": "assistant", "content": "<think>\nSo"}]
    cont = parse_request({**CHAT, "messages": turns, "continue_final_message": True, "add_generation_prompt": False},
                         "chat", MODEL, "t").ask.options["chat"]
    assert cont == ChatOptions({}, add_generation_prompt=False, continue_final_message=True)
    assert parse_request({**CHAT, "add_generation_prompt": False}, "chat", MODEL, "t").ask.options["chat"] == \
        ChatOptions({}, add_generation_prompt=False)
    # the defaults spelled out are no options at all
    defaults = {"chat_template_kwargs": {}, "add_generation_prompt": True, "continue_final_message": False}
    assert parse_request({**CHAT, **defaults}, "chat", MODEL, "t").ask.options["chat"] is None
    assert parse_request({"model": MODEL, "prompt": "hi", **defaults}, "text", MODEL, "t").ask.options["chat"] is None
    text, messages, chat = tokenize_request({"messages": turns, "continue_final_message": True,
                                             "add_generation_prompt": False})
    assert text is None and messages == turns and chat.continue_final_message


@pytest.mark.parametrize("fields,param,message", [
    ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs", "must be a JSON object"),
    ({"chat_template_kwargs": "enable_thinking=false"}, "chat_template_kwargs", "must be a JSON object"),
    ({"chat_template_kwargs": {"enable-thinking": False}}, "chat_template_kwargs", "is not a name"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs", "set by the server"),
    ({"chat_template_kwargs": {"eos_token": "x"}}, "chat_template_kwargs", "set by the server"),
    ({"chat_template_kwargs": {"a": [[[[["deep"]]]]]}}, "chat_template_kwargs", "more than 4 deep"),
    ({"chat_template_kwargs": {"a": "x" * 9000}}, "chat_template_kwargs", "at most 8192"),
    ({"chat_template_kwargs": {f"k{i}": 1 for i in range(33)}}, "chat_template_kwargs", "at most 32"),
    ({"add_generation_prompt": "no"}, "add_generation_prompt", "true or false"),
    ({"continue_final_message": 1}, "continue_final_message", "true or false"),
    ({"continue_final_message": True}, "continue_final_message", "cannot both be true"),
    ({"continue_final_message": True, "add_generation_prompt": False}, "continue_final_message",
     "final message to be the assistant's"),
])
def test_bad_chat_fields_are_a_400_naming_the_field(fields, param, message):
    with pytest.raises(BadParam, match=message) as refused:
        parse_request({**CHAT, **fields}, "chat", MODEL, "t")
    assert refused.value.param == param


def test_chat_fields_on_completions_are_refused():
    for name, value in (("chat_template_kwargs", {"a": 1}), ("continue_final_message", True),
                        ("add_generation_prompt", False)):
        with pytest.raises(BadParam, match="applies to chat messages") as refused:
            parse_request({"model": MODEL, "prompt": "hi", name: value}, "text", MODEL, "t")
        assert refused.value.param == name
