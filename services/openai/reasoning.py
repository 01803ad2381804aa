"""`--reasoning-parser`: a chat reply's reasoning apart from its answer, as vLLM returns it: the
message's (or a streamed delta's) `reasoning_content` beside `content`.

The split is on text, in the HTTP layer only: the tokens generated (and TR == AR) are untouched, and
gRPC returns the whole text. Parsers: `think` (and vLLM's names `deepseek_r1` and `qwen3` for it): a
reply that opens with `<think>` (after whitespace) reasons until `</think>`; the rest is content. A reply
with no such opening is all content. Where the prompt already opened `<think>` after the final message
(a template that starts the reply inside its reasoning: DeepSeek-R1's, QwQ's, Qwen3 thinking models'),
the reply starts as reasoning; where it closed one (Qwen3 with {"enable_thinking": false}), all is
content. A reply cut (max_tokens) inside its reasoning has reasoning_content and a null content.

Requests whose reply a grammar shapes from its first token (response_format, guided_*, a forced tool
call) are not split: their text is the answer. tool_choice "auto" replies are (their grammar shapes only
the calls): the text outside calls (tools.py) is split.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass

from ...engine.request.prompt import PromptBuilder
from .convert import ChunkWriter, OpenAIRequest
from .reasoning_parsers import PARSERS

log = logging.getLogger("trserve.openai")


def prompt_state(tail: str, tags: tuple[str, str]) -> str:
    """Where a reply starts given the prompt's text after its final message: "inside" (the prompt opened
    a reasoning block it did not close), "after" (it closed one: the reply is the answer) or "start".

    >>> prompt_state("<|im_start|>assistant\\n<think>\\n", THINK), prompt_state("<think>\\n\\n</think>\\n\\n", THINK)
    ('inside', 'after')
    """
    opened, closed = tail.rfind(tags[0]), tail.rfind(tags[1])
    return "inside" if opened > closed else "after" if closed >= 0 else "start"


@dataclass
class ReasoningSplitter:
    """One reply's text, piece by piece as it streams, split into (reasoning, content). Text that may
    still become a tag (`<thi`) is held until the next piece (or the end) says what it is.

    >>> s = ReasoningSplitter(THINK)
    >>> s.push("<thi"), s.push("nk>Hm, 2+2</th"), s.push("ink>\\n\\n4"), s.push("", final=True)
    (('', ''), ('Hm, 2+2', ''), ('', '\\n\\n4'), ('', ''))
    """

    tags: tuple[str, str]
    state: str = "start"  # "start": nothing but whitespace yet; "inside": reasoning; "after": the answer
    held: str = ""  # text that may be the start of a tag
    reasoned: bool = False  # a reasoning block was opened (by the reply or by the prompt)

    def __post_init__(self) -> None:
        self.reasoned = self.state == "inside"

    def push(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) of `text`; `final`: the reply ends here (anything held is flushed)."""
        buf, self.held = self.held + text, ""
        reasoning = content = ""
        while buf:
            if self.state == "start":
                rest = buf.lstrip()
                if rest.startswith(self.tags[0]):
                    buf, self.state, self.reasoned = rest[len(self.tags[0]):], "inside", True
                elif self.tags[0].startswith(rest) and not final:  # whitespace, or part of the tag so far
                    self.held, buf = buf, ""
                else:
                    self.state = "after"
            elif self.state == "inside":
                end = buf.find(self.tags[1])
                if end >= 0:
                    reasoning += buf[:end]
                    buf, self.state = buf[end + len(self.tags[1]):], "after"
                    continue
                keep = 0 if final else _partial_suffix(buf, self.tags[1])
                reasoning, self.held, buf = reasoning + buf[:len(buf) - keep], buf[len(buf) - keep:], ""
            else:
                content, buf = content + buf, ""
        return reasoning, content


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a proper beginning of `tag` (0: none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def split(text: str, tags: tuple[str, str], state: str = "start") -> tuple[str | None, str | None]:
    """A whole reply's (reasoning_content, content): reasoning None where the reply has none, content None
    where a reasoning reply has no answer (cut inside its reasoning).

    >>> split("<think>\\nshort</think>\\n\\nYes.", THINK), split("Yes.", THINK), split("still thinking", THINK, "inside")
    (('\\nshort', '\\n\\nYes.'), (None, 'Yes.'), ('still thinking', None))
    """
    splitter = ReasoningSplitter(tags, state)
    reasoning, content = splitter.push(text, final=True)
    if not splitter.reasoned:
        return None, text
    return reasoning, content or None


@dataclass
class ReasoningChunkWriter(ChunkWriter):
    """A chat stream's chunks with each delta's text split: `reasoning_content` until the reasoning
    closes, then `content` (a delta may carry both where one step's text crosses the closing tag)."""

    splitter: ReasoningSplitter | None = None

    def chunk(self, text: str | None, finish_reason: str | None = None, role: bool = False,
              token_ids: list[int] | None = None, logprobs=None) -> dict:
        out = super().chunk(text, finish_reason, role, token_ids, logprobs)
        if not out["choices"] or self.splitter is None:
            return out
        delta, final = out["choices"][0]["delta"], finish_reason is not None
        given = delta.get("content")
        if given is None and not final:
            return out
        reasoning, content = self.splitter.push(given or "", final)
        if given == "" and not reasoning and not content:
            return out
        delta.pop("content", None)
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        return out

    def choices(self, n: int) -> list[ChunkWriter]:
        """One writer per choice, each with its own splitter."""
        return [dataclasses.replace(self, index=i, splitter=dataclasses.replace(self.splitter)
                                    if self.splitter is not None else None) for i in range(n)]


class Reasoning:
    """The server's reasoning parser (None: `none`), applied to one request's answer or stream."""

    def __init__(self, name: str | None, prompts: PromptBuilder) -> None:
        if name is not None and name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}: use one of {sorted(PARSERS)}")
        self.tags = PARSERS[name] if name is not None else None
        self.prompts = prompts

    def applies(self, req: OpenAIRequest) -> bool:
        return self.tags is not None and req.kind == "chat" and (req.ask.options.get("structured") is None or
                                                                 req.auto is not None)  # auto: free text but calls

    async def state(self, req: OpenAIRequest) -> str:
        """Where this request's reply starts (prompt_state), from its prompt's text after the final message.
        Asked once the reply is decoded or streaming (the template rendered these messages already); should
        rendering fail now, the reply is split as if the prompt opened nothing, and the server log says so."""
        options = req.ask.options
        try:
            tail = await asyncio.to_thread(self.prompts.reply_prefix, options["messages"], options.get("chat"),
                                           options.get("tools"))
        except Exception:  # noqa: BLE001 - the answer goes out regardless
            log.warning("reasoning parser: the prompt's text after its final message could not be rendered",
                        exc_info=True)
            return "start"
        return prompt_state(tail, self.tags)

    async def answer(self, req: OpenAIRequest, body: dict) -> dict:
        """A unary chat completion with each choice's message split (a `reasoning_content` field added)."""
        if not self.applies(req):
            return body
        state = await self.state(req)
        for choice in body["choices"]:
            message = choice.get("message")
            if message is not None and isinstance(message.get("content"), str):
                message["reasoning_content"], message["content"] = split(message["content"], self.tags, state)
        return body

    async def writers(self, req: OpenAIRequest, writer: ChunkWriter, n: int) -> list[ChunkWriter]:
        """The stream's writer of each of n choices: splitting each delta where the parser applies."""
        if self.applies(req):
            fields = {f.name: getattr(writer, f.name) for f in dataclasses.fields(ChunkWriter)}
            writer = ReasoningChunkWriter(**fields, splitter=ReasoningSplitter(self.tags, await self.state(req)))
        return writer.choices(n)
