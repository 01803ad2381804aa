"""OpenAI tool calling (issue 44, item 2) on top of structured output.

- `tools` with `tool_choice` "required" or a named function: the reply is constrained to the JSON
  `{"name": <a tool's name>, "arguments": <its parameters' schema>}` (structured output, lossless
  under TR, forced keys drafted), then answered as one `tool_calls` entry with finish_reason
  "tool_calls". The tools are described to the model in the system turn (the bundled model's chat
  template has no tool format of its own), with how to call one.
- `tool_choice` "none": the tools are neither described nor callable; plain text.
- `tool_choice` "auto" (OpenAI's default with tools): the tools go to the chat template (the engine's
  `tools`), which describes them in its own format, and the reply is read for calls in that format
  (toolparse.py: hermes, llama3_json or mistral, recognised from the template or named by
  --tool-call-parser). The bundled ChatML model gets a shipped hermes template (engine/request/tools.py).
  A call the model opens is held to the tools' schemas by a grammar (toolgrammar.py, per format).
  Where the server has no format for its template: 400 naming why.
- `tool`-role messages go to the template as they are (ChatML renders any role); an assistant turn's
  `tool_calls` as the JSON it would have written.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from ...core.errors import InvalidArgument
from ...engine.request.tools import tool_functions
from ...engine.tr.grammar import StructuredOutput
from .errors import BadParam
from .toolgrammar import auto_grammar, call_schema
from .toolparse import parse_reply, render_calls

HOW = ("You can call these functions. To call one, answer with only a JSON object "
       '{"name": <the function name>, "arguments": <its arguments>}.\nFunctions:\n')


@dataclass(frozen=True)
class AutoTools:
    """tool_choice "auto": the reply is read for calls to `names` in the template's format `fmt`."""

    fmt: str  # toolparse.FORMATS
    names: tuple[str, ...]
    parallel: bool = True  # parallel_tool_calls: False keeps only the first call
    held: bool = False  # a grammar holds the calls (toolgrammar.py): streamed in fragments (toolstream.py)


def tool_options(body: dict, opts: dict, kind: str, auto_format: str | None = None,
                 markers: tuple[int, ...] = ()) -> tuple[tuple[str, ...] | None, AutoTools | None]:
    """(the callable tools' names when the reply must be a tool call (its schema then set in `opts`, the
    engine request's fields), AutoTools for tool_choice "auto"); `auto_format`: the served template's
    tool format (None: "auto" is refused); `markers`: the ids of its call markers as tokens of their own,
    where the tokenizer has them (toolparse.py:marker_tokens)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise BadParam("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if not tools:
        if choice not in (None, "none"):
            raise BadParam("tool_choice needs tools", "tool_choice")
        return None, None
    if kind != "chat":
        raise BadParam("tools are for chat completions", "tools")
    functions = _functions(tools)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None, None
    if choice == "auto":
        return None, _auto(body, opts, functions, auto_format, parallel is not False, markers)
    if choice != "required":
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
            choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
        if name not in functions:
            raise BadParam('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                           '{"name": one of the tools}}', "tool_choice")
        functions = {name: functions[name]}
    if opts.get("structured") is not None:
        raise BadParam("a tool call and response_format (or guided_*) cannot both shape one reply", "tool_choice")
    opts["structured"] = StructuredOutput("json_schema", json.dumps(call_schema(functions)))
    _describe(opts, functions)
    return tuple(functions), None


def _auto(body: dict, opts: dict, functions: dict[str, dict], fmt: str | None, parallel: bool,
          markers: tuple[int, ...] = ()) -> AutoTools:
    """tool_choice "auto": the tools to the template (`opts["tools"]`), earlier calls in its format."""
    if fmt is None:
        raise BadParam('tool_choice "auto" needs a chat template with a tool format, and this model\'s has none '
                       '(serve it with --tool-call-parser or a --chat-template that has one): use "required", a '
                       'named function ({"type": "function", "function": {"name": ...}}) or "none"', "tool_choice")
    if opts.get("structured") is not None:
        raise BadParam('tool_choice "auto" and response_format (or guided_*) cannot both shape one reply',
                       "tool_choice")
    opts["tools"] = tuple({"type": "function", "function": f} for f in functions.values())
    # once the model opens a call, its JSON follows the tools' schemas (toolgrammar.py)
    opts["structured"] = StructuredOutput("grammar", auto_grammar(fmt, functions, parallel, markers))
    for i, m in enumerate(body["messages"]):
        calls = _calls(m, i) if m.get("role") == "assistant" else None
        if calls:
            text = opts["messages"][i]["content"] if m.get("content") not in (None, "") else ""
            opts["messages"][i] = {**opts["messages"][i], "content": (text + "\n" if text else "") +
                                   render_calls(fmt, calls)}
    return AutoTools(fmt, tuple(functions), parallel, held=True)


def _functions(tools: object) -> dict[str, dict]:
    """tools [{"type": "function", "function": {"name", "description"?, "parameters"?}}] -> name: function."""
    try:
        return tool_functions(tools)
    except InvalidArgument as e:
        raise BadParam(str(e), "tools") from None


def _describe(opts: dict, functions: dict[str, dict]) -> None:
    """The tools and how to call them, into the system turn (a new first turn where there is none)."""
    lines = [json.dumps({k: f[k] for k in ("name", "description", "parameters") if k in f}) for f in functions.values()]
    text = HOW + "\n".join(lines)
    turns = opts["messages"]
    if turns and turns[0]["role"] == "system":
        turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{text}"}
    else:
        opts["messages"] = [{"role": "system", "content": text}, *turns]


def assistant_content(message: dict, i: int) -> str | None:
    """An assistant turn's tool_calls as the JSON the model would have written (None: it has none)."""
    calls = _calls(message, i)
    return "\n".join(json.dumps({"name": n, "arguments": a}) for n, a in calls) if calls else None


def _calls(message: dict, i: int) -> list[tuple[str, object]]:
    """An assistant turn's tool_calls as (name, arguments)."""
    out = []
    for call in message.get("tool_calls") or ():
        f = call.get("function") if isinstance(call, dict) else None
        try:
            out.append((f["name"], json.loads(f.get("arguments") or "{}")))
        except (TypeError, KeyError, ValueError):
            raise BadParam(f"messages[{i}].tool_calls must be OpenAI tool calls with JSON arguments",
                           f"messages[{i}].tool_calls") from None
    return out


def tool_calls(text: str, names: tuple[str, ...]) -> list[dict] | None:
    """The reply's text as OpenAI tool_calls, or None where it is not a whole call (cut by the length)."""
    try:
        call = json.loads(text)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in names:
        return None
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}}]


def auto_choice(auto: AutoTools, text: str, finish_reason: str) -> dict:
    """A unary choice's message (content and tool_calls) for tool_choice "auto", its finish_reason
    ("tool_calls" where the reply stopped after calls) and, where an opened call did not parse (its text
    then stays content), stop_reason "malformed_tool_call" (vLLM's field; docs/openai.md)."""
    parsed = parse_reply(auto.fmt, text, auto.names, auto.parallel, auto.held)
    message: dict = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = parsed.calls
    out = {"message": message, "finish_reason": "tool_calls" if parsed.calls and finish_reason == "stop" else finish_reason}
    if parsed.error:
        out["stop_reason"] = "malformed_tool_call"
    return out
