"""How a request's tool_choice shapes it and how its reply is read, for both edges: HTTP's `tool_choice`
(tools.py maps these InvalidArguments to a 400 naming the field) and gRPC's ChatMessages.tool_choice
(services/worker/convert.py). No HTTP and no protobuf here.

- "auto": the tools go to the chat template (the engine request's `tools`), which describes them in its
  own format `fmt` (toolparse.py); a call the model opens is held to the tools' schemas by that format's
  grammar (toolgrammar.py); the reply is read for calls in that format (`AutoTools`).
- "required" or a tool's name: the reply is the JSON {"name", "arguments"} of one call, held to the
  schema (structured output, lossless under TR), the tools described with how to call them in the system
  turn (the model's own template may have no tool format); read by `required_calls`.
- "none": the tools are neither described nor callable.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ...core.errors import InvalidArgument
from ...engine.request.history import fold_calls
from ...engine.tr.grammar import StructuredOutput
from .toolgrammar import auto_grammar, call_schema
from .toolparse import Parsed, new_call_id, parse_reply, render_calls

HOW = ("You can call these functions. To call one, answer with only a JSON object "
       '{"name": <the function name>, "arguments": <its arguments>}.\nFunctions:\n')
CHOICES = ("none", "auto", "required")


@dataclass(frozen=True)
class AutoTools:
    """tool_choice "auto": the reply is read for calls to `names` in the template's format `fmt`."""

    fmt: str  # toolparse.FORMATS
    names: tuple[str, ...]
    parallel: bool = True  # parallel_tool_calls: False keeps only the first call
    held: bool = False  # a grammar holds the calls (toolgrammar.py): streamed in fragments (toolstream.py)


@dataclass(frozen=True)
class ToolReading:
    """How a reply is read for calls: `auto` in a template's format, else (`required`) as one bare call."""

    auto: AutoTools | None = None
    required: tuple[str, ...] = ()  # the callable tools' names where the reply is one JSON call
    fmt: str | None = None  # the served format, which says how a required call's id is spelled

    def read(self, text: str, finish_reason: str) -> Parsed | None:
        """The reply's calls (OpenAI tool_calls entries) and why an opened one is not a call; None where the
        request asked for none."""
        if self.auto is not None:
            return parse_reply(self.auto.fmt, text, self.auto.names, self.auto.parallel, self.auto.held)
        if not self.required:
            return None
        calls = required_calls(text, self.required, self.fmt) if finish_reason == "grammar" else None
        return Parsed(None if calls else text, calls or [],
                      None if calls else f"the call was cut ({finish_reason}) before its JSON was whole")


def apply_tool_choice(opts: dict, functions: dict[str, dict], choice: str, fmt: str | None, parallel: bool = True,
                      markers: tuple[int, ...] = (), function: str | None = None, fold: bool = False
                      ) -> ToolReading | None:
    """Shape the engine request's fields `opts` (its messages, tools and structured output) for `choice`:
    "none", "auto" or "required" (`function`: the one of `functions` a required call must name); `fmt` the
    served template's tool format (None: "auto" is refused), `markers` its markers' ids as tokens of their
    own (toolparse.py:marker_tokens); `fold`: the template that renders tools reads no tool_calls, so "auto"
    writes earlier calls into their turns' content as the model writes them in `fmt` (the few-shot it follows).
    InvalidArgument saying what to send instead."""
    if choice not in CHOICES:
        raise InvalidArgument(f"tool_choice must be one of {CHOICES} (or a named function), got {choice!r:.80}")
    if function is not None and choice != "required":
        raise InvalidArgument(f'a named function ({function!r:.80}) goes with tool_choice "required" (or unset), '
                              f'not "{choice}"')
    if function is not None and function not in functions:
        raise InvalidArgument(f"tool_choice names the function {function!r:.80}, which is not one of the tools")
    if choice == "none":
        return None
    if opts.get("structured") is not None:
        raise InvalidArgument("a tool call and a response format (response_format, guided_*, structured_output) "
                              "cannot both shape one reply: send one of them")
    if choice == "auto":
        if fmt is None:
            raise InvalidArgument('tool_choice "auto" needs a chat template with a tool format, and this model\'s '
                                  "has none (serve it with --tool-call-parser or a --chat-template that has one): use "
                                  '"required", a named function or "none"')
        opts["tools"] = tuple({"type": "function", "function": f} for f in functions.values())
        # once the model opens a call, its JSON follows the tools' schemas (toolgrammar.py)
        opts["structured"] = StructuredOutput("grammar", auto_grammar(fmt, functions, parallel, markers))
        opts["kept_special"] = kept_markers(fmt, markers)
        if fold:
            opts["messages"] = fold_calls(opts["messages"], lambda calls: render_calls(fmt, calls))
        return ToolReading(auto=AutoTools(fmt, tuple(functions), parallel, held=True))
    if function is not None:
        functions = {function: functions[function]}
    opts["structured"] = StructuredOutput("json_schema", json.dumps(call_schema(functions)))
    describe(opts, functions)
    return ToolReading(required=tuple(functions), fmt=fmt)


def kept_markers(fmt: str | None, markers: tuple[int, ...]) -> tuple[int, ...]:
    """The marker ids a reply in format `fmt` keeps as text (GenerationRequest.kept_special): Mistral's
    `[TOOL_CALLS]` where it is a special token, which may follow text (toolgrammar.py:mistral_grammar) and
    would otherwise be decoded away with the call's opening; the other formats' special markers open a
    reply (llama3_json's `<|python_tag|>`) and are read without their text, or are not special (Qwen's)."""
    return markers[:1] if fmt == "mistral" else ()


def describe(opts: dict, functions: dict[str, dict]) -> None:
    """The tools and how to call them, into the system turn (a new first turn where there is none)."""
    lines = [json.dumps({k: f[k] for k in ("name", "description", "parameters") if k in f}) for f in functions.values()]
    text = HOW + "\n".join(lines)
    turns = opts["messages"]
    if turns and turns[0]["role"] == "system":
        turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{text}"}
    else:
        opts["messages"] = [{"role": "system", "content": text}, *turns]


def required_calls(text: str, names: tuple[str, ...], fmt: str | None = None) -> list[dict] | None:
    """A required call's reply as OpenAI tool_calls, or None where it is not a whole call (cut by the length);
    `fmt`: the served format, whose templates may need ids of their own spelling (toolparse.py:new_call_id)."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    return [{"id": new_call_id(fmt) if fmt else f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}}]
