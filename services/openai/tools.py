"""OpenAI tool calling (issue 44, item 2) on top of structured output.

- `tools` with `tool_choice` "required" or a named function: the reply is constrained to the JSON
  `{"name": <a tool's name>, "arguments": <its parameters' schema>}` (structured output, lossless
  under TR, forced keys drafted), then answered as one `tool_calls` entry with finish_reason
  "tool_calls". The tools are described to the model in the system turn (the bundled model's chat
  template has no tool format of its own), with how to call one.
- `tool_choice` "none": the tools are neither described nor callable; plain text.
- `tool_choice` "auto" (OpenAI's default with tools): the model would have to decide between text and
  a call in its own template's tool format, which the served template lacks: 400 naming why.
- `tool`-role messages go to the template as they are (ChatML renders any role); an assistant turn's
  `tool_calls` as the JSON it would have written.
"""

from __future__ import annotations

import json
import re
import uuid

from ...engine.tr.grammar import StructuredOutput
from .errors import BadParam

MAX_TOOLS = 64
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
HOW = ("You can call these functions. To call one, answer with only a JSON object "
       '{"name": <the function name>, "arguments": <its arguments>}.\nFunctions:\n')


def tool_options(body: dict, opts: dict, kind: str) -> tuple[str, ...] | None:
    """The callable tools' names when the reply must be a tool call (its schema then set in `opts`, the
    engine request's fields), else None."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise BadParam("tool_choice needs tools", "tool_choice")
        return None
    if kind != "chat":
        raise BadParam("tools are for chat completions", "tools")
    functions = _functions(tools)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None
    if choice == "auto":
        raise BadParam('tool_choice "auto" needs a chat template with a tool format, and this model\'s has none: '
                       'use "required", a named function ({"type": "function", "function": {"name": ...}}) or "none"',
                       "tool_choice")
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
    return tuple(functions)


def call_schema(functions: dict[str, dict]) -> dict:
    """The JSON Schema of a reply that calls one of `functions`: {"name": its name, "arguments": its
    parameters}. Each function's parameters are a schema document of their own (pydantic's `$defs` and
    `#/...` refs point into them): kept whole under the wrapper's $defs, their local refs re-rooted there,
    so whatever validates as response_format validates as a tool's parameters."""
    defs, calls = {}, []
    for i, (name, f) in enumerate(functions.items()):
        at = f"/$defs/tool_{i}"
        defs[f"tool_{i}"] = _rerooted(f.get("parameters") or {"type": "object"}, at)
        calls.append({"type": "object", "properties": {"name": {"const": name}, "arguments": {"$ref": "#" + at}},
                      "required": ["name", "arguments"], "additionalProperties": False})
    return {"$defs": defs, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}


def _rerooted(schema: object, at: str) -> object:
    """`schema` with every local "$ref" ("#", "#/...") pointing at the same place below JSON pointer `at`."""
    if isinstance(schema, dict):
        return {k: "#" + at + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rerooted(v, at)
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rerooted(v, at) for v in schema]
    return schema


def _functions(tools: object) -> dict[str, dict]:
    """tools [{"type": "function", "function": {"name", "description"?, "parameters"?}}] -> name: function."""
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadParam(f"tools must be a list of at most {MAX_TOOLS} functions", "tools")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        f = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not NAME.match(f["name"]):
            raise BadParam(f'tools[{i}] must be {{"type": "function", "function": {{"name": [A-Za-z0-9_-]{{1,64}}, ...}}}}',
                           "tools")
        if not isinstance(f.get("parameters", {}), dict) or f["name"] in out:
            raise BadParam(f"tools[{i}]: parameters must be a JSON Schema object and names distinct", "tools")
        out[f["name"]] = f
    return out


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
    calls = message.get("tool_calls")
    if not calls:
        return None
    out = []
    for call in calls:
        f = call.get("function") if isinstance(call, dict) else None
        try:
            out.append(json.dumps({"name": f["name"], "arguments": json.loads(f.get("arguments") or "{}")}))
        except (TypeError, KeyError, ValueError):
            raise BadParam(f"messages[{i}].tool_calls must be OpenAI tool calls with JSON arguments",
                           f"messages[{i}].tool_calls") from None
    return "\n".join(out)


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
