"""tool_choice "auto" streamed (issue 59): a choice's text read for calls as it comes, answered as
content deltas and tool_calls deltas the way the `openai` package (and vLLM) stream them.

Where a grammar holds the calls (AutoTools.held: toolgrammar.py, every format served over HTTP), a
call goes out as it is written: a first delta `{index, id, type: "function", function: {name,
arguments}}` as soon as its name is known (arguments: what is written of them yet, often ""), then
`{index, function: {arguments: <fragment>}}` as more is written. The fragments are the model's own
text, which the grammar keeps valid JSON, and the unary answer's arguments are that same text
(toolparse.py:ToolReader, `held`), so what a client concatenates is what the unary reply carries.
Where no grammar holds them, a call could turn out malformed (its text then content): each goes out
whole, once read (the first delta carries all of it).

A reply cut (max_tokens) inside a call has sent the fragments written (as vLLM does): the call's
arguments are then not whole JSON and the finish reason is "length" (stop_reason as the unary
answer's); the call's text is not sent again as content (the unary answer of the same reply has it
as content and no call: docs/openai.md).

    >>> s = AutoStream(AutoTools("llama3_json", ("f",), held=True))
    >>> s.feed('{"name": "f", "parameters": {"a": ')[1][0]["function"]
    {'name': 'f', 'arguments': '{"a": '}
    >>> s.feed('1}')[1]
    [{'index': 0, 'function': {'arguments': '1}'}}]
"""

from __future__ import annotations

from .toolgrammar import scan_calls
from .toolparse import ToolReader, new_call_id
from .tools import AutoTools


class AutoStream:
    """One streamed choice's text read for calls: content deltas and tool_calls deltas."""

    def __init__(self, auto: AutoTools) -> None:
        self.auto = auto
        self.reader = ToolReader(auto.fmt, auto.names, auto.parallel, auto.held)
        self.sent: dict[int, list] = {}  # a call's index -> [its id, characters of its arguments sent]

    def feed(self, text: str | None) -> tuple[str | None, list[dict]]:
        content, calls = self.reader.feed(text or "")
        return content or None, self._deltas(calls)

    def end(self, text: str, finish_reason: str) -> tuple[str | None, list[dict], str, str | None]:
        """(content, call deltas, finish_reason, stop_reason) of the last chunk, `text` the reply's last piece."""
        content, calls = self.reader.feed(text)
        deltas = self._deltas(calls)
        open_sent = self.reader.inside and self.reader.calls in self.sent  # an open call streamed in part
        more, last = self.reader.finish()
        if open_sent and not last:
            more = ""  # cut inside a call whose fragments went out: not sent again as content
        deltas += self._deltas(last, live=False)
        if self.reader.calls and finish_reason == "stop":
            finish_reason = "tool_calls"
        return (content + more) or None, deltas, finish_reason, \
            "malformed_tool_call" if self.reader.errors else None

    def _deltas(self, calls: list[dict], live: bool = True) -> list[dict]:
        """The deltas of calls read whole now (`calls`) and, held, of those written in part so far in the
        open call region (after them: their indexes follow the calls read)."""
        out = [self._grow(c["index"], c["function"]["name"], c["function"]["arguments"], c["id"]) for c in calls]
        if live and self.auto.held and self.reader.inside:
            for k, (name, args, _) in enumerate(scan_calls(self.reader.text[self.reader.at:])):
                index = self.reader.calls + k
                if index and not self.auto.parallel:
                    break  # parallel_tool_calls false: only the first call is answered
                out.append(self._grow(index, name, args, None))
        return [d for d in out if d is not None]

    def _grow(self, index: int, name: str, args: str, call_id: str | None) -> dict | None:
        """Call `index`'s next delta: the first (id, name, arguments so far), or its new arguments (None: none)."""
        if index not in self.sent:
            self.sent[index] = [call_id or new_call_id(self.auto.fmt), len(args)]
            return {"index": index, "id": self.sent[index][0], "type": "function",
                    "function": {"name": name, "arguments": args}}
        fragment, self.sent[index][1] = args[self.sent[index][1]:], len(args)
        return {"index": index, "function": {"arguments": fragment}} if fragment else None
