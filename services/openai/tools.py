"""OpenAI tool calling (issue 44, item 2; issue 59) on top of structured output: the request's `tools`,
`tool_choice` and `parallel_tool_calls` checked as OpenAI's fields, then shaped by toolchoice.py (shared
with gRPC's ChatMessages.tool_choice):

- "required" or a named function: the reply is constrained to the JSON `{"name": <a tool's name>,
  "arguments": <its parameters' schema>}` (lossless under TR, forced keys drafted), answered as one
  `tool_calls` entry with finish_reason "tool_calls"; the tools are described in the system turn.
- "none": the tools are neither described nor callable; plain text.
- "auto" (OpenAI's default with tools): the tools go to the chat template, which describes them in its
  own format, and the reply is read for calls in that format (toolparse.py: hermes, llama3_json or
  mistral, recognised from the template or named by --tool-call-parser), each held to its schema by a
  grammar (toolgrammar.py). The bundled ChatML model gets a shipped hermes template
  (engine/request/tools.py). Where the server has no format for its template: 400 naming why.
- Earlier turns (an assistant's `tool_calls`, a tool turn's `tool_call_id`) go to the template as they
  are (engine/request/history.py), which writes them in its own format.
"""

from __future__ import annotations

from ...core.errors import InvalidArgument
from ...engine.request.tools import tool_functions
from .errors import BadParam
from .toolchoice import AutoTools, apply_tool_choice
from .toolparse import parse_reply


def tool_options(body: dict, opts: dict, kind: str, auto_format: str | None = None,
                 markers: tuple[int, ...] = (), fold: bool = False
                 ) -> tuple[tuple[str, ...] | None, AutoTools | None]:
    """(the callable tools' names when the reply must be a tool call (its schema then set in `opts`, the
    engine request's fields), AutoTools for tool_choice "auto"); `auto_format`: the served template's
    tool format (None: "auto" is refused); `markers`: the ids of its call markers as tokens of their own,
    where the tokenizer has them (toolparse.py:marker_tokens); `fold`: the template that renders tools reads
    no tool_calls (toolchoice.py)."""
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
    choice, function = "auto" if choice is None else choice, None
    if choice not in ("none", "auto", "required"):
        name = choice.get("function", {}).get("name") if isinstance(choice, dict) and \
            choice.get("type") == "function" and isinstance(choice.get("function"), dict) else None
        if name not in functions:
            raise BadParam('tool_choice must be "none", "auto", "required" or {"type": "function", "function": '
                           '{"name": one of the tools}}', "tool_choice")
        choice, function = "required", name
    try:
        reading = apply_tool_choice(opts, functions, choice, auto_format, parallel is not False, markers, function,
                                    fold)
    except InvalidArgument as e:
        raise BadParam(str(e), "tool_choice") from None
    if reading is None:
        return None, None
    return reading.required or None, reading.auto


def _functions(tools: object) -> dict[str, dict]:
    """tools [{"type": "function", "function": {"name", "description"?, "parameters"?}}] -> name: function."""
    try:
        return tool_functions(tools)
    except InvalidArgument as e:
        raise BadParam(str(e), "tools") from None


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
