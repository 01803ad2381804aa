"""A Response's output items and its streamed events (`POST /v1/responses`, responses.py), written from
the chat completion chunks the app already makes (convert.py:ChunkWriter; split by the reasoning parser
where one is set: reasoning.py): a chunk's reasoning_content opens a reasoning item (its
response.reasoning_text.delta events; closed by the first answer text or call), a chunk's text opens a
message item (response.output_item.added, response.content_part.added) and goes out as
response.output_text.delta; a tool call closes the open message (its output_text.done,
content_part.done, output_item.done) and opens a function_call item (output_item.added), its
arguments' fragments going out as function_call_arguments.delta events (one where the call came
whole), closed (arguments' done, output_item.done) by whatever comes next; the end is
response.completed, or response.incomplete where the reply was cut (max_output_tokens). Every event
has its `type` and a `sequence_number` counting from 0, as the `openai` package's streaming helper
reads them.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field


def message_item(item_id: str, text: str | None, status: str) -> dict:
    """An assistant message item; `text` None: just opened (no content part yet)."""
    content = [] if text is None else [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: str | None, status: str) -> dict:
    """A reasoning item (the model's reasoning, as --reasoning-parser splits it from the answer); `text`
    None: just opened (no content yet)."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def call_item(call: dict) -> dict:
    """A chat tool call ({"id", "function": {"name", "arguments"}}) as a function_call item."""
    return {"type": "function_call", "id": "fc_" + uuid.uuid4().hex, "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def responses_usage(usage: dict) -> dict:
    """Chat's usage (convert.usage) as a Response's."""
    return {"input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage["total_tokens"]}


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"


@dataclass
class EventWriter:
    """One Response: its id, creation time and echoed parameters, the output items finished so far and,
    streamed, the message item open now and the events' sequence."""

    id: str
    created_at: int
    model: str
    echo: dict  # the request's parameters as a Response repeats them (responses.py:echoed)
    output: list[dict] = field(default_factory=list)
    sequence: int = 0
    text: str | None = None  # the open message item's text so far (None: no message open)
    message_id: str = ""
    reasoning: str | None = None  # the open reasoning item's text so far (None: none open)
    reasoning_id: str = ""
    call: dict | None = None  # the open function_call item, its arguments so far (None: none open)

    def snapshot(self, status: str, usage: dict | None = None) -> dict:
        """The Response as it stands: `status` in_progress, completed or incomplete (max_output_tokens)."""
        done = status != "in_progress"
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": int(time.time()) if done else None, "error": None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.model, "output": list(self.output), "usage": usage, **self.echo}

    def event(self, kind: str, **fields) -> str:
        out = sse({"type": kind, "sequence_number": self.sequence, **fields})
        self.sequence += 1
        return out

    def start(self) -> list[str]:
        response = self.snapshot("in_progress")
        return [self.event("response.created", response=response),
                self.event("response.in_progress", response=response)]

    def chunk(self, chunk: dict) -> list[str]:
        """The events of one chat completion chunk: its reasoning, its text, then its tool calls' deltas."""
        out: list[str] = []
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                out += self._reasoning(delta["reasoning_content"])
            if delta.get("content"):
                out += self._text(delta["content"])
            for call in delta.get("tool_calls") or ():
                out += self._call(call)
        return out

    def _reasoning(self, text: str) -> list[str]:
        out, index = [], len(self.output)
        if self.reasoning is None:
            self.reasoning, self.reasoning_id = "", "rs_" + uuid.uuid4().hex
            out.append(self.event("response.output_item.added", output_index=index,
                                  item=reasoning_item(self.reasoning_id, None, "in_progress")))
        self.reasoning += text
        out.append(self.event("response.reasoning_text.delta", item_id=self.reasoning_id, output_index=index,
                              content_index=0, delta=text))
        return out

    def _close_reasoning(self, status: str = "completed") -> list[str]:
        """The open reasoning item's last events (none where none is open)."""
        if self.reasoning is None:
            return []
        index, item = len(self.output), reasoning_item(self.reasoning_id, self.reasoning, status)
        out = [self.event("response.reasoning_text.done", item_id=self.reasoning_id, output_index=index,
                          content_index=0, text=self.reasoning),
               self.event("response.output_item.done", output_index=index, item=item)]
        self.output.append(item)
        self.reasoning = None
        return out

    def _text(self, text: str) -> list[str]:
        out = self._close_reasoning() + self._close_call()
        index = len(self.output)
        if self.text is None:
            self.text, self.message_id = "", "msg_" + uuid.uuid4().hex
            out.append(self.event("response.output_item.added", output_index=index,
                                  item=message_item(self.message_id, None, "in_progress")))
            out.append(self.event("response.content_part.added", item_id=self.message_id, output_index=index,
                                  content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
        self.text += text
        out.append(self.event("response.output_text.delta", item_id=self.message_id, output_index=index,
                              content_index=0, delta=text, logprobs=[]))
        return out

    def _close_text(self, status: str = "completed") -> list[str]:
        """The open message item's last events (none where no message is open)."""
        if self.text is None:
            return []
        index, item = len(self.output), message_item(self.message_id, self.text, status)
        out = [self.event("response.output_text.done", item_id=self.message_id, output_index=index, content_index=0,
                          text=self.text, logprobs=[]),
               self.event("response.content_part.done", item_id=self.message_id, output_index=index, content_index=0,
                          part=item["content"][0]),
               self.event("response.output_item.done", output_index=index, item=item)]
        self.output.append(item)
        self.text = None
        return out

    def _call(self, delta: dict) -> list[str]:
        """A tool_calls delta: a call's first (its id and name: the item opens) or more of its arguments."""
        out = []
        if delta.get("id"):
            out = self._close_reasoning() + self._close_text() + self._close_call()
            self.call = {**call_item({**delta, "function": {**delta["function"], "arguments": ""}}),
                         "status": "in_progress"}
            out.append(self.event("response.output_item.added", output_index=len(self.output), item=dict(self.call)))
        fragment = delta["function"].get("arguments") or ""
        if fragment and self.call is not None:
            self.call["arguments"] += fragment
            out.append(self.event("response.function_call_arguments.delta", item_id=self.call["id"],
                                  output_index=len(self.output), delta=fragment))
        return out

    def _close_call(self, status: str = "completed") -> list[str]:
        """The open function_call item's last events (none where none is open)."""
        if self.call is None:
            return []
        index, item = len(self.output), {**self.call, "status": status}
        out = [self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          name=item["name"], arguments=item["arguments"]),
               self.event("response.output_item.done", output_index=index, item=item)]
        self.output.append(item)
        self.call = None
        return out

    def finish(self, cut: bool, usage: dict, extras: dict) -> list[str]:
        """The last events: the open message closed (an empty one where the reply wrote nothing), then
        response.completed, or response.incomplete where `cut` (by max_output_tokens)."""
        status = "incomplete" if cut else "completed"
        out = self._close_reasoning(status) + self._close_call(status)
        out += self._text("") if self.text is None and not any(i["type"] != "reasoning" for i in self.output) else []
        out += self._close_text(status)
        response = self.snapshot("incomplete" if cut else "completed", usage)
        response["trserve"] = extras
        return out + [self.event("response.incomplete" if cut else "response.completed", response=response)]

    def error(self, error: dict) -> str:
        """An error after the stream began (OpenAI's error event: code, message, param)."""
        return self.event("error", code=error["code"], message=error["message"], param=error["param"])
