"""An agent's history as the chat template reads it: an assistant turn's earlier tool calls and a tool
turn's `tool_call_id` (and `name`), the same over gRPC (ChatMessage.tool_calls) and HTTP (OpenAI's
messages). Checked here once, each message naming the field to fix.

A turn goes to the template as OpenAI's message does, with each call's arguments decoded from their JSON
text into an object, as vLLM passes them: Qwen2.5's and Llama 3.1's templates write `arguments | tojson`
and Mistral's `function | tojson`, which would quote a string a second time. A template that reads no
`tool_calls` (SmolLM2's own) would drop the calls, so there they become the turn's content, as the JSON
{"name", "arguments"} the model would have written (`fold_calls`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence

from ...core.errors import InvalidArgument

ROLES = ("system", "user", "assistant", "tool")
MAX_CALLS = 64  # per assistant turn, as the tools a request may offer
MAX_ARGUMENTS_CHARS = 64 << 10
CALL_ID = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def chat_turn(message: object, i: int) -> dict:
    """A checked copy of message `i` ({"role", "content", "tool_calls"?, "tool_call_id"?, "name"?}) as the
    template reads it: tool_calls only on an assistant turn and only where it has some, each
    {"id", "type": "function", "function": {"name", "arguments": an object}}; tool_call_id and name only on
    a tool turn. InvalidArgument naming `messages[i]...` otherwise.

    >>> chat_turn({"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
    ...     "function": {"name": "f", "arguments": '{"a": 1}'}}]}, 0)["tool_calls"][0]["function"]
    {'name': 'f', 'arguments': {'a': 1}}
    """
    if not isinstance(message, Mapping) or message.get("role") not in ROLES or \
            not isinstance(message.get("content"), str):
        raise InvalidArgument(f"messages[{i}] must be {{'role': one of {ROLES}, 'content': str}}, got {message!r:.80}")
    role = message["role"]
    turn = {"role": role, "content": message["content"]}
    calls = message.get("tool_calls")
    if calls:
        if role != "assistant":
            raise InvalidArgument(f"messages[{i}].tool_calls: only an assistant turn makes tool calls; this turn's "
                                  f"role is {role!r}")
        if not isinstance(calls, (list, tuple)) or len(calls) > MAX_CALLS:
            raise InvalidArgument(f"messages[{i}].tool_calls must be a list of at most {MAX_CALLS} calls")
        turn["tool_calls"] = [_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
    for name, pattern, what in (("tool_call_id", CALL_ID, "the id of the call it answers, [A-Za-z0-9_.:-]{1,64}"),
                                ("name", NAME, "the function's name, [A-Za-z0-9_-]{1,64}")):
        value = message.get(name)
        if value in (None, ""):
            continue
        if role != "tool":
            raise InvalidArgument(f"messages[{i}].{name} is for tool turns (the result of a call); this turn's "
                                  f"role is {role!r}: leave it out")
        if not isinstance(value, str) or not pattern.match(value):
            raise InvalidArgument(f"messages[{i}].{name} must be {what}, got {value!r:.80}")
        turn[name] = value
    return turn


def _call(call: object, at: str) -> dict:
    """One earlier call, OpenAI's shape, its arguments decoded (an object, or JSON text of one)."""
    f = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(f, Mapping) or call.get("type", "function") != "function":
        raise InvalidArgument(f'{at} must be {{"id": ..., "type": "function", "function": {{"name": ..., '
                              f'"arguments": JSON text of an object}}}}, got {call!r:.80}')
    if not isinstance(call.get("id"), str) or not CALL_ID.match(call["id"]):
        raise InvalidArgument(f"{at}.id must be the call's id as the reply gave it, [A-Za-z0-9_.:-]{{1,64}}, "
                              f"got {call.get('id')!r:.80}")
    if not isinstance(f.get("name"), str) or not NAME.match(f["name"]):
        raise InvalidArgument(f"{at}.function.name must be a tool's name, [A-Za-z0-9_-]{{1,64}}, got "
                              f"{f.get('name')!r:.80}")
    args = f.get("arguments")
    if args is None or args == "":
        args = {}
    elif isinstance(args, str):
        if len(args) > MAX_ARGUMENTS_CHARS:
            raise InvalidArgument(f"{at}.function.arguments is {len(args)} characters; at most {MAX_ARGUMENTS_CHARS}")
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            raise InvalidArgument(f"{at}.function.arguments is not JSON: send the arguments as the reply gave "
                                  f'them, the JSON text of an object (e.g. {{"city": "Paris"}})') from None
    if not isinstance(args, Mapping):
        raise InvalidArgument(f"{at}.function.arguments must be a JSON object (the call's named arguments), got "
                              f"{type(args).__name__}")
    return {"id": call["id"], "type": "function", "function": {"name": f["name"], "arguments": dict(args)}}


def chat_turns(messages: Sequence[object]) -> list[dict]:
    """Every message checked by chat_turn: the template's input."""
    return [chat_turn(m, i) for i, m in enumerate(messages)]


def reads_tool_calls(template: object) -> bool:
    """Whether a chat template's text reads the `tool_calls` it is given."""
    return isinstance(template, str) and "tool_calls" in template


def _json_lines(calls: list[tuple[str, dict]]) -> str:
    return "\n".join(json.dumps({"name": name, "arguments": args}) for name, args in calls)


def fold_calls(turns: list[dict], render: Callable[[list[tuple[str, dict]]], str] = _json_lines) -> list[dict]:
    """For a template that reads no tool_calls: each assistant turn's calls as its content (after any
    text), written by `render` from their (name, arguments) (default: one JSON {"name", "arguments"} per
    line), the other keys left as they are.

    >>> fold_calls([{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function",
    ...     "function": {"name": "f", "arguments": {}}}]}])
    [{'role': 'assistant', 'content': '{"name": "f", "arguments": {}}'}]
    """
    out = []
    for turn in turns:
        calls = turn.get("tool_calls")
        if calls:
            text = render([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
            turn = {k: v for k, v in turn.items() if k != "tool_calls"}
            turn["content"] = f"{turn['content']}\n{text}" if turn["content"] else text
        out.append(turn)
    return out


def call_strings(turns: Sequence[dict]) -> list[str]:
    """The text of every call and id in `turns` (what the prompt builder checks for control tokens)."""
    out = []
    for turn in turns:
        out += [turn[k] for k in ("tool_call_id", "name") if k in turn]
        for c in turn.get("tool_calls", ()):
            out += [c["id"], c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False)]
    return out


def calls_chars(turn: Mapping) -> int:
    """The characters a turn's calls and ids add to its content (a limit on the prompt's size counts them)."""
    return sum(len(s) for s in call_strings([turn])) if "tool_calls" in turn or "tool_call_id" in turn else 0
