"""Tool calls as each model family writes them (tool_choice "auto", issue 59), read out of a reply's
text: pure functions and one incremental reader, so a unary reply and a stream are parsed the same way.

The formats, as their chat templates teach them:
- hermes (Hermes 2 Pro, Qwen2/2.5/3, the template shipped for ChatML models): any number of
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks, text around them;
- llama3_json (Llama 3.1-3.3): the whole reply is `<|python_tag|>`(optional) `{"name": ...,
  "parameters": {...}}`, several separated by `;`; a reply that starts otherwise is text;
- mistral: text, then `[TOOL_CALLS]` and a JSON list `[{"name": ..., "arguments": {...}}, ...]` to the
  end; or, as Mistral's newer tokenizers (v11 on) write them, `[TOOL_CALLS]name[ARGS]{...}` once per call
  (`name[CALL_ID]id[ARGS]{...}` where the template numbers calls). (`<|python_tag|>` and `[TOOL_CALLS]` are special tokens that decoded text may leave out: a
  reply that starts with `{` (llama3_json) or `[{` (mistral) is read as if it had them.)

A call that does not parse (not JSON, no name, a tool that was not offered, arguments that are not an
object) is not a call: its text stays in `content` and `error` says why (the answer is then
finish_reason "stop", or "tool_calls" where other calls did parse, with `stop_reason`
"malformed_tool_call": docs/openai.md).

    >>> r = ToolReader("hermes", ("f",))
    >>> r.feed('Sure.<tool_call>\\n{"name": "f", "arguments": {"x": 1}}\\n</tool_')
    ('Sure.', [])
    >>> r.feed('call>')[1][0]["function"]
    {'name': 'f', 'arguments': '{"x": 1}'}
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field

from .toolgrammar import scan_calls

FORMATS = ("hermes", "llama3_json", "mistral")
PARSERS = ("auto", *FORMATS, "none")  # --tool-call-parser
# the text by which a chat template shows which format it teaches (first match wins)
MARKERS = (("<tool_call>", "hermes"), ("<|python_tag|>", "llama3_json"), ("[TOOL_CALLS]", "mistral"))
OPEN = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "mistral": "[TOOL_CALLS]"}
CLOSE = "</tool_call>"
ARGS, CALL_ID = "[ARGS]", "[CALL_ID]"  # Mistral's newer call form (mistral_calls)


def detect_format(template: object) -> str | None:
    """The tool-call format a chat template's text teaches (None: it has none it says how to write).

    >>> detect_format("{% for tool in tools %}...<tool_call>...{% endfor %}")
    'hermes'
    """
    if not isinstance(template, str) or "tools" not in template:
        return None
    found = next((fmt for marker, fmt in MARKERS if marker in template), None)
    if found is None and "<|start_header_id|>" in template and '"parameters"' in template:
        return "llama3_json"  # Llama 3.x JSON calls without the python tag (user-defined tools only)
    return found


def marker_tokens(tokenizer, fmt: str | None) -> tuple[int, ...]:
    """The ids of format `fmt`'s call markers where `tokenizer` has them as tokens of their own (added
    tokens, special or not, which the grammar engine matches by id only: toolgrammar.py names them so):
    llama3_json / mistral, its opening (`<|python_tag|>`, `[TOOL_CALLS]`); hermes, `<tool_call>` and
    `</tool_call>` where they are not special (decoded text keeps them; Qwen's tokenizers add them so),
    the opening alone where only it is; () where none."""
    added = {getattr(t, "content", None): (int(i), bool(getattr(t, "special", False)))
             for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()}
    if fmt == "hermes":
        found = [added.get(m) for m in (OPEN["hermes"], CLOSE)]
        if found[0] is None or found[0][1]:
            return ()
        return (found[0][0],) + ((found[1][0],) if found[1] is not None and not found[1][1] else ())
    return (added[OPEN[fmt]][0],) if fmt in ("llama3_json", "mistral") and OPEN[fmt] in added else ()


def new_call_id(fmt: str) -> str:
    """A new call's id: 9 letters and digits for mistral (Mistral's templates refuse a tool result whose
    tool_call_id is not, as vLLM writes them), else `call_` and 24 hex digits."""
    if fmt == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return f"call_{uuid.uuid4().hex[:24]}"


def resolve_parser(name: str, template: object) -> str | None:
    """--tool-call-parser NAME against the template that renders tools: the format "auto" answers in
    (None: tool_choice "auto" is refused)."""
    if name not in PARSERS:
        raise ValueError(f"tool call parser must be one of {', '.join(PARSERS)}; got {name!r}")
    if name == "none":
        return None
    return detect_format(template) if name == "auto" else name


def render_calls(fmt: str, calls: list[tuple[str, dict]]) -> str:
    """An assistant turn's earlier calls (name, arguments) as the model would have written them (for a
    template that reads no tool_calls: toolchoice.py folds them into the turn's content)."""
    if fmt == "hermes":
        return "\n".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls)
    if fmt == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    return json.dumps([{"name": n, "arguments": a} for n, a in calls])


class Malformed(ValueError):
    """Text that opened a call but is not one (the reason is the message)."""


def one_call(obj: object, names: tuple[str, ...]) -> tuple[str, str]:
    """(name, arguments as JSON text) of a decoded call object; Malformed where it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise Malformed("a tool call must be a JSON object with a name")
    if obj["name"] not in names:
        raise Malformed(f"the reply calls {obj['name'][:64]!r}, which is not one of the tools")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            raise Malformed("a tool call's arguments are not JSON") from None
    if not isinstance(args, dict):
        raise Malformed("a tool call's arguments must be a JSON object")
    return obj["name"], json.dumps(args, ensure_ascii=False)


def json_values(text: str, sep: str = "") -> list:
    """The JSON values of `text`, one after another (each followed by `sep` where given, but the last);
    Malformed where anything else is there."""
    decoder, out, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text) and out:
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            raise Malformed("a tool call is not valid JSON") from None
        out.append(value)
        while i < len(text) and text[i].isspace():
            i += 1
        if sep and text.startswith(sep, i):
            i += len(sep)


def mistral_calls(body: str) -> list:
    """The call objects after a reply's first `[TOOL_CALLS]`: one JSON list of them, or the newer form's
    `name[ARGS]{...}` segments (each further call after its own `[TOOL_CALLS]`); Malformed otherwise.

    >>> mistral_calls('f[ARGS]{"a": 1}[TOOL_CALLS]g[CALL_ID]x7[ARGS]{}')
    [{'name': 'f', 'arguments': {'a': 1}}, {'name': 'g', 'arguments': {}}]
    """
    if body.lstrip().startswith("["):
        values = json_values(body)
        if len(values) != 1 or not isinstance(values[0], list) or not values[0]:
            raise Malformed("[TOOL_CALLS] must be followed by one non-empty JSON list of calls")
        return values[0]
    out = []
    for segment in body.split(OPEN["mistral"]):
        head, sep, args = segment.partition(ARGS)
        name = head.partition(CALL_ID)[0].strip()
        if not sep or not name:
            raise Malformed("[TOOL_CALLS] must be followed by a JSON list of calls or by name[ARGS]{...}")
        values = json_values(args)
        if len(values) != 1:
            raise Malformed(f"the call of {name[:64]!r} must have one JSON object after [ARGS]")
        out.append({"name": name, "arguments": values[0]})
    return out


def _held(text: str, marker: str) -> int:
    """Characters at the end of `text` that may be the start of `marker` (held back from content)."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


@dataclass
class ToolReader:
    """Reads a reply's text piece by piece (`feed`, then `finish`): each call a `tool_calls` entry as
    soon as it is whole, the text outside calls as content (text that may still open a call is held).
    `parallel` False keeps only the first call (the others are dropped). `held`: a grammar holds the
    calls' form (toolgrammar.py), and each call's arguments are answered as the model wrote them (the
    text a stream sends in fragments: toolstream.py), not written again."""

    fmt: str
    names: tuple[str, ...]
    parallel: bool = True
    held: bool = False
    text: str = ""  # everything fed so far
    at: int = 0  # text before this is answered (sent as content or read as a call)
    inside: bool = False  # a call is open at `at`
    decided: bool = False  # llama3_json / mistral: whether the reply opens with a call is known
    calls: int = 0  # calls answered
    spaces: str = ""  # whitespace-only content, held: it is dropped where a call follows it
    gap: str = ""  # the whitespace before the open call: content again where the call is malformed
    errors: list[str] = field(default_factory=list)

    def feed(self, piece: str) -> tuple[str, list[dict]]:
        """(content now sure to be text, whole calls now read) after `piece`."""
        self.text += piece
        content, calls = [], []
        while True:
            if self.inside:
                if self.fmt != "hermes" or CLOSE not in self.text[self.at:]:
                    break  # llama3_json and mistral calls run to the end
                end = self.text.index(CLOSE, self.at)
                self._block(self.text[self.at:end + len(CLOSE)], self.text[self.at + len(OPEN["hermes"]):end],
                            content, calls)
                self.at, self.inside = end + len(CLOSE), False
                continue
            start = self._opening()
            if start is None:
                break
            content.append(self.text[self.at:start])
            content = [self._content(content)]  # whitespace right before the call: kept aside (gap)
            self.at, self.inside, self.gap, self.spaces = start, True, self.spaces, ""
        if not self.inside:
            content.append(self.text[self.at:len(self.text) - self._holding()])
            self.at = len(self.text) - self._holding()
        return self._content(content), calls

    def finish(self) -> tuple[str, list[dict]]:
        """The rest, at the end of the reply: an open call read whole (or, malformed, as content)."""
        content, calls = [], []
        rest, self.at = self.text[self.at:], len(self.text)
        if self.inside:
            self._block(rest, self._body(rest), content, calls)
        else:
            content.append(rest)
        out = self._content(content)
        return (out if out.strip() or not self.calls + len(calls) else ""), calls

    def _opening(self) -> int | None:
        """Where a call opens in the unanswered text (None: none yet)."""
        rest = self.text[self.at:]
        if self.fmt == "hermes":
            i = rest.find(OPEN["hermes"])
            return None if i < 0 else self.at + i
        if self.decided and self.fmt == "llama3_json":
            return None
        i = rest.find(OPEN["mistral"]) if self.fmt == "mistral" else -1
        if i >= 0:
            return self.at + i
        lead = rest.lstrip()
        if self.decided or not lead:
            return None
        starts = ("<|python_tag|>", "{") if self.fmt == "llama3_json" else ('[{',)
        if any(lead.startswith(s) for s in starts):
            return self.at + len(rest) - len(lead)
        if not any(s.startswith(lead) for s in starts):
            self.decided = True
        return None

    def _holding(self) -> int:
        """Unanswered characters that may still open a call (at the start of a llama3_json or mistral
        reply, all of them until it is known whether it opens with a call)."""
        rest = self.text[self.at:]
        if self.fmt != "hermes" and not self.decided:
            return len(rest)
        return _held(rest, OPEN[self.fmt]) if self.fmt != "llama3_json" else 0

    def _body(self, block: str) -> str:
        """A call block without its opening (and, hermes, closing) marker."""
        body = block.lstrip()
        body = body[len(OPEN[self.fmt]):] if body.startswith(OPEN[self.fmt]) else body
        return body.removesuffix(CLOSE) if self.fmt == "hermes" else body

    def _block(self, block: str, body: str, content: list[str], calls: list[dict]) -> None:
        """One opened block: its calls, or (malformed) its text as content. A block opened without its
        marker (llama3_json's `{`, mistral's `[{`) that is not call-shaped JSON was plain text, but where a
        grammar held the reply (`held`: there text cannot open so, and a special-token marker is decoded
        away): then it is a call, cut or malformed."""
        marked = block.lstrip().startswith(OPEN[self.fmt]) or self.fmt == "hermes" or self.held
        shaped = False
        try:
            values = mistral_calls(body) if self.fmt == "mistral" else \
                json_values(body, ";" if self.fmt == "llama3_json" else "")
            shaped = isinstance(values[0], dict) and "name" in values[0]
            if not marked and not shaped:
                content.append(self.gap + block)  # JSON the model answered with, not a call
                return
            read = [one_call(v, self.names) for v in values]
            raw = [args for _, args, whole in scan_calls(body) if whole] if self.held else []
            read = [(name, args) for (name, _), args in zip(read, raw)] if len(raw) == len(read) else read
        except Malformed as exc:
            if marked or shaped:
                self.errors.append(str(exc))
            content.append(self.gap + block)
            return
        for name, args in read:
            if self.parallel or not self.calls:
                calls.append({"index": self.calls, "id": new_call_id(self.fmt), "type": "function",
                              "function": {"name": name, "arguments": args}})
                self.calls += 1

    def _content(self, pieces: list[str]) -> str:
        """Content to send: whitespace alone is held until text follows it (or a call drops it)."""
        text = self.spaces + "".join(pieces)
        if not text.strip():
            self.spaces = text
            return ""
        self.spaces = ""
        return text


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the text outside calls (None where there is none)
    calls: list[dict]  # OpenAI tool_calls entries
    error: str | None  # why an opened call was not one (its text is in content)


def parse_reply(fmt: str, text: str, names: tuple[str, ...], parallel: bool = True, held: bool = False) -> Parsed:
    """A whole reply's calls and content, as a stream of it would give them.

    >>> parse_reply("llama3_json", '{"name": "f", "parameters": {}}; {"name": "f", "parameters": {"a": 2}}',
    ...             ("f",)).calls[1]["function"]["arguments"]
    '{"a": 2}'
    """
    reader = ToolReader(fmt, names, parallel, held)
    content, calls = reader.feed(text)
    more, last = reader.finish()
    error = "; ".join(reader.errors) or None
    if not calls + last:
        return Parsed(text, [], error)  # no call: the text as it is
    content = (content + more).strip()
    calls = [{k: v for k, v in c.items() if k != "index"} for c in calls + last]
    return Parsed(content or None, calls, error)
