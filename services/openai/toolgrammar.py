"""The grammars that hold tool_choice "auto"'s calls to the tools' schemas (issue 59), one per format
toolparse.py reads, in llguidance's Lark dialect (engine/tr/grammar.py compiles them):

- hermes: free text; each `<tool_call>` the model writes (a lazy trigger, or the token where the
  tokenizer has it as an added token: Qwen's) is followed by one call's JSON and `</tool_call>`; any
  number of calls.
- llama3_json: the reply is either text that does not open a call (it does not start, after
  whitespace, with `{` or the text `<|python_tag|>`) or (after whitespace, if any) the calls
  `{"name": ..., "parameters": {...}}` separated by `; ` (one where parallel_tool_calls is false).
  `<|python_tag|>` is a special token in Llama 3 tokenizers: where the served tokenizer has it as one
  (`marker`, its id), the calls may open with that token (`<[id]>`, llguidance's name for a token by
  id; the text is masked as every special token is); elsewhere the bare JSON form alone (what Llama
  3.x writes for user-defined tools).
- mistral: text, then `[TOOL_CALLS]` (its text) and a JSON list of `{"name", "arguments"}` calls to
  the end; or the list alone at the start, after whitespace if any; or, where the tokenizer has
  `[TOOL_CALLS]` as a special token (`marker`), that token then the list, at the start or after text. Mistral's
  newer `name[ARGS]{...}` form is read but not forced.

Markers that are tokens of their own (added tokens, `markers`: toolparse.py:marker_tokens) are named
by id, `<[id]>`: the grammar engine never matches an added token by its text. The server decodes
replies without special tokens (as vLLM's default skip_special_tokens), so a call llama3_json's
special `<|python_tag|>` opens reads as a reply that starts with its JSON, which toolparse.py reads as
a call: that marker is allowed at the reply's start only. Mistral's `[TOOL_CALLS]` may follow text (as
Mistral's models write it, and vLLM's parser reads it): the reply keeps that special token's text
(toolchoice.py:kept_markers, GenerationRequest.kept_special), so the parser finds the call there.

Each call's JSON is laid out as json.dumps lays it out (JSON_OPTIONS: no free whitespace), and the
answer's arguments are the text the model wrote, not written again (toolparse.py:ToolReader `held`),
which services/openai/toolstream.py streams as it is written.
"""

from __future__ import annotations

import json
import re


TEXT_ANY = "(.|\\n)*"
LEAD = "LEAD: /\\s+/"  # whitespace before calls (the parser drops it)


def call_schema(functions: dict[str, dict], key: str = "arguments") -> dict:
    """The JSON Schema of a reply that calls one of `functions`: {"name": its name, `key`: its
    parameters} (`key` "parameters" for llama3_json). Each function's parameters are a schema document
    of their own (pydantic's `$defs` and `#/...` refs point into them): kept whole under the wrapper's
    $defs, their local refs re-rooted there, so whatever validates as response_format validates as a
    tool's parameters."""
    defs, calls = {}, []
    for i, (name, f) in enumerate(functions.items()):
        at = f"/$defs/tool_{i}"
        defs[f"tool_{i}"] = _rerooted(f.get("parameters") or {"type": "object"}, at)
        calls.append({"type": "object", "properties": {"name": {"const": name}, key: {"$ref": "#" + at}},
                      "required": ["name", key], "additionalProperties": False})
    return {"$defs": defs, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}


def _rerooted(schema: object, at: str) -> object:
    """`schema` with every local "$ref" ("#", "#/...") pointing at the same place below JSON pointer `at`."""
    if isinstance(schema, dict):
        return {k: "#" + at + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rerooted(v, at)
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rerooted(v, at) for v in schema]
    return schema


def _json(functions: dict[str, dict], key: str = "arguments") -> str:
    """One call's JSON as a Lark expression."""
    from ...engine.tr.grammar import JSON_OPTIONS  # here: engine.tr.grammar imports torch, the CLI must not

    return "%json " + json.dumps({**call_schema(functions, key), "x-guidance": JSON_OPTIONS})


def not_opening(openings: tuple[str, ...], blank: bool = False) -> str:
    """A regex of text that starts with neither whitespace (LEAD's, the one lexeme that does: the lexer
    then never has to back off more than a byte) nor any of `openings` (each a literal): a first
    character no opening starts with, or a proper prefix of an opening that then goes another way (or
    ends). `blank`: the empty text too.

    >>> print(not_opening(("{",)))
    /([^\\s\\{](.|\\n)*)/
    """
    firsts = "".join(sorted({re.escape(o[0]) for o in openings}))
    alts = [f"[^\\s{firsts}]{TEXT_ANY}"]
    for o in openings:
        alts += [f"{re.escape(o[:k])}([^{re.escape(o[k])}]{TEXT_ANY})?" for k in range(1, len(o))]
    return "/(" + "|".join(alts) + (")?/" if blank else ")/")


def hermes_grammar(functions: dict[str, dict], parallel: bool = True, markers: tuple[int, ...] = ()) -> str:
    """A hermes reply: free text, where each `<tool_call>` the model writes (a lazy trigger: the text
    before it is anything) is followed by one call's JSON and its closing tag; any number of calls
    (llguidance's structural tags). `parallel` is not used: text after a last call would be free to
    open another, unheld, so every call is held and parallel_tool_calls false keeps the first.
    `markers`: the ids of `<tool_call>` (and `</tool_call>`) where the tokenizer has them as tokens of
    their own (Qwen's do), which the grammar engine matches by id only (their text would be masked): the
    call then opens with that token, as the text would open it.

    >>> print(hermes_grammar({"f": {"name": "f"}}).splitlines()[3])
    call_trigger[lazy]: TEXT "<tool_call>"
    >>> print(hermes_grammar({"f": {"name": "f"}}, markers=(5, 6)).splitlines()[3][-10:])
    "\\n" <[6]>
    """
    if markers:
        close = f"<[{int(markers[1])}]>" if len(markers) > 1 else '"</tool_call>"'
        return "\n".join(("%llguidance {}", "start: call* TEXT", "TEXT: /(.|\\n)*/",
                          f'call: TEXT <[{int(markers[0])}]> "\\n" {_json(functions)} "\\n" {close}'))
    return "\n".join(("%llguidance {}", "start: call* TEXT", "TEXT: /(.|\\n)*/",
                      'call_trigger[lazy]: TEXT "<tool_call>"',
                      f'call: call_trigger "\\n" {_json(functions)} "\\n</tool_call>"'))


def _marker(marker: int | None) -> tuple[str, tuple[str, ...]]:
    """(the start rule's opening before the calls, the rule that names it) for a special-token marker."""
    return ("", ()) if marker is None else ("marker? ", (f"marker: <[{int(marker)}]>",))


def llama3_grammar(functions: dict[str, dict], parallel: bool = True, marker: int | None = None) -> str:
    """A llama3_json reply: text that does not open a call, or the calls (after whitespace, if any),
    opened by the special token `marker` (the id of `<|python_tag|>`) where it is given.

    >>> print(llama3_grammar({"f": {"name": "f"}}, parallel=False).splitlines()[1])
    start: LEAD? (TEXT | call)?
    >>> print(llama3_grammar({"f": {"name": "f"}}, marker=7).splitlines()[-1])
    marker: <[7]>
    """
    more = ' ("; " call)*' if parallel else ""
    opening, rule = _marker(marker)
    return "\n".join(("%llguidance {}", f"start: LEAD? (TEXT | {opening}call{more})?", LEAD,
                      f"TEXT: {not_opening(('{', '<|python_tag|>'))}", f"call: {_json(functions, 'parameters')}",
                      *rule))


def mistral_grammar(functions: dict[str, dict], parallel: bool = True, marker: int | None = None) -> str:
    """A mistral reply: text, then (a lazy trigger) `[TOOL_CALLS]` and a JSON list of calls to the end;
    or the list alone (after whitespace, if any); or, where the special token `marker` (the id of
    `[TOOL_CALLS]`) is given, that token then the list, at the start or after text (the reply keeps the
    token's text: toolchoice.py:kept_markers); or text (that does not start with `[{`) alone.

    >>> print(mistral_grammar({"f": {"name": "f"}}).splitlines()[1])
    start: LEAD? (TEXT | call_trigger calls | calls)?
    >>> print(mistral_grammar({"f": {"name": "f"}}, marker=9).splitlines()[1])
    start: LEAD? (TEXT | call_trigger calls | TEXT? marker calls | calls)?
    """
    more = ' (", " call)*' if parallel else ""
    opening = "" if marker is None else "TEXT? marker calls | "
    rule = () if marker is None else (f"marker: <[{int(marker)}]>",)
    return "\n".join(("%llguidance {}", f"start: LEAD? (TEXT | call_trigger calls | {opening}calls)?", LEAD,
                      f"TEXT: {not_opening(('[{',))}", f"BEFORE: {not_opening(('[{',), blank=True)}",
                      'call_trigger[lazy]: BEFORE "[TOOL_CALLS]"',
                      f'calls: "[" call{more} "]"', f"call: {_json(functions)}", *rule))


GRAMMARS = {"hermes": hermes_grammar, "llama3_json": llama3_grammar, "mistral": mistral_grammar}


def auto_grammar(fmt: str, functions: dict[str, dict], parallel: bool = True, markers: tuple[int, ...] = ()) -> str:
    """The Lark grammar that holds format `fmt`'s calls to `functions`' schemas; `markers`: the ids of the
    format's call markers as the tokenizer's tokens of their own (toolparse.py:marker_tokens), () where none."""
    if fmt == "hermes":
        return hermes_grammar(functions, parallel, markers)
    return GRAMMARS[fmt](functions, parallel, markers[0] if markers else None)


# the head of a call as the grammars write it (the name, then the arguments' key): the arguments follow
HEAD = re.compile(r'\{"name": "([A-Za-z0-9_-]{1,64})", "(?:arguments|parameters)": ')


def object_end(text: str, start: int) -> int | None:
    """Where the JSON object opening at text[start] ("{") ends (the index after its "}"; None: not yet)."""
    depth, quoted, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if escaped:
            escaped = False
        elif quoted:
            escaped, quoted = c == "\\", c != '"'
        elif c == '"':
            quoted = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def scan_calls(region: str) -> list[tuple[str, str, bool]]:
    """The calls written so far in a grammar-held region of a reply (from where a call opens), in order:
    (name, the arguments' text so far, whether they are whole), each from its HEAD on; a call whose
    arguments are not an object ends the scan (it is read whole at its end).

    >>> scan_calls('<tool_call>\\n{"name": "f", "arguments": {"a": "}"}}\\n</tool_call>')
    [('f', '{"a": "}"}', True)]
    >>> scan_calls('[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"b": [1')
    [('f', '{}', True), ('g', '{"b": [1', False)]
    """
    out, i = [], 0
    while (head := HEAD.search(region, i)) is not None:
        start = head.end()
        if start < len(region) and region[start] != "{":
            break
        end = object_end(region, start) if start < len(region) else None
        out.append((head.group(1), region[start:end], end is not None))
        if end is None:
            break
        i = end
    return out
