"""OpenAI's Responses API, `POST /v1/responses`, stateless, on top of chat completions: a Responses
request becomes the chat completion request the app already serves (`chat_request`: `input` items as
messages, `instructions` as a system turn first, flat function tools as chat's nested ones,
`text.format` as `response_format`, `max_output_tokens` as `max_tokens`), decoded by the same front
door (services/worker/front.py) and engine, and its chat completion (or its chunks) written back as a
Response (`from_chat`; streamed: response_events.py). Nothing is stored: `previous_response_id` is a
400, `store: true` is accepted and echoed as false. What is accepted and refused: docs/openai.md.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ...engine.results import StepChunk
from . import convert
from .errors import BadParam, ClientGone, HttpDeadline
from .errors import error_body as chat_error_body
from .response_events import EventWriter, call_item, message_item, reasoning_item, responses_usage
from .streams import first_items, merged
from ..worker.front import StreamEnd

METHOD = "openai.responses"
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text", "text")
# accepted, and mapped to chat's field of the same meaning (None: used here, not passed on)
FIELDS = {"model": "model", "input": None, "instructions": None, "tools": None, "tool_choice": None, "text": None,
          "max_output_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p",
          "parallel_tool_calls": "parallel_tool_calls", "stream": "stream", "mode": "mode", "store": None,
          "previous_response_id": None}
# accepted without effect on the output: nothing is stored, one tier, an end-user id, stream obfuscation
IGNORED = ("metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier", "stream_options")
DEFAULTS = {"background": False, "include": [], "truncation": "disabled", "top_logprobs": 0}  # only these values
# chat's field names in errors (error.param) as a Responses caller named them
PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text.format"}


def chat_request(body: object) -> dict:
    """The chat completion request (a JSON body for convert.parse_request) a Responses request asks for;
    a field it cannot serve is a 400 naming it."""
    if not isinstance(body, dict):
        raise BadParam("the request body must be a JSON object")
    _check_fields(body)
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadParam("instructions must be a string", "instructions")
    chat: dict = {"messages": ([{"role": "system", "content": instructions}] if instructions else []) +
                  input_messages(body.get("input"))}
    for name, theirs in FIELDS.items():
        if theirs is not None and body.get(name) is not None:
            chat[theirs] = body[name]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise BadParam("tools must be a list of function tools", "tools")
        chat["tools"] = [_tool(t, i) for i, t in enumerate(tools)]
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _text_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    return chat


def _check_fields(body: dict) -> None:
    if body.get("previous_response_id") is not None:
        raise BadParam("previous_response_id: this server stores no responses (it is stateless); send the whole "
                       "conversation in input (earlier output items included)", "previous_response_id")
    if not isinstance(body.get("store", False), bool):
        raise BadParam("store must be true or false (nothing is stored either way)", "store")
    for name, value in body.items():
        if name in FIELDS or name in IGNORED or value is None:
            continue
        if name in DEFAULTS and value == DEFAULTS[name]:
            continue
        raise BadParam(f"{name} is not supported by /v1/responses on this server; leave it out", name)


def input_messages(items: object) -> list[dict]:
    """`input` (a string: one user turn; or a list of message, function_call, function_call_output and
    reasoning items) as chat messages: consecutive function_call items are one assistant turn's
    tool_calls, each function_call_output a tool turn; a reasoning item (an earlier reply's, sent back as
    the Responses API asks) is left out, as reasoning models' templates drop earlier turns' reasoning."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise BadParam("input must be a string or a non-empty list of items", "input")
    out: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            if item.get("role") not in ROLES:
                raise BadParam(f"input[{i}].role must be one of {list(ROLES)}, got {item.get('role')!r}",
                               f"input[{i}].role")
            out.append({"role": item["role"], "content": _text(item.get("content"), f"input[{i}].content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if not all(isinstance(v, str) for v in (call["id"], item.get("name"), item.get("arguments"))):
                raise BadParam(f"input[{i}]: a function_call item needs call_id, name and arguments (JSON text)",
                               f"input[{i}]")
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "reasoning":
            continue
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise BadParam(f"input[{i}]: a function_call_output item needs its call_id", f"input[{i}]")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _text(item.get("output"), f"input[{i}].output")})
        else:
            raise BadParam(f"input[{i}] must be a message, function_call, function_call_output or reasoning item, "
                           f"got type {kind!r}", f"input[{i}].type")
    if not out:
        raise BadParam("input has no message, function_call or function_call_output item (reasoning items are "
                       "left out of the prompt)", "input")
    return out


def _text(content: object, where: str) -> str:
    """A string, or a list of text parts (input_text, output_text) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise BadParam(f"{where} must be a string or a list of input_text/output_text parts (text only)", where)


def _tool(tool: object, i: int) -> dict:
    """Responses' flat function tool {"type": "function", "name", "description", "parameters", "strict"} as
    chat's nested one (strict or not, a call the grammar holds follows the schema: docs/openai.md)."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise BadParam(f'tools[{i}]: only function tools {{"type": "function", "name", "parameters"}} are served, '
                       f"got type {kind!r}", "tools")
    return {"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters")
                                             if tool.get(k) is not None}}


def _tool_choice(choice: object) -> object:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise BadParam('tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}',
                   "tool_choice")


def _text_format(text: object) -> dict | None:
    """`text.format` as chat's response_format (None: plain text)."""
    if text is None:
        return None
    if not isinstance(text, dict) or text.get("verbosity") not in (None, "medium"):
        raise BadParam('text must be {"format": {...}} (verbosity "medium" only)', "text")
    fmt = text.get("format")
    if fmt is None or fmt == {"type": "text"}:
        return None
    if isinstance(fmt, dict) and fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema" and isinstance(fmt.get("schema"), dict):
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    raise BadParam('text.format must be {"type": "text"}, {"type": "json_object"} or {"type": "json_schema", '
                   '"name", "schema": {...}}', "text.format")


def echoed(body: dict) -> dict:
    """The request's parameters as a Response repeats them (what the `openai` package's Response reads)."""
    tools = [{"strict": False, "parameters": {}, **t} for t in body.get("tools") or []]
    return {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls") is not False,
            "previous_response_id": None, "reasoning": None, "store": False, "temperature": body.get("temperature"),
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto", "tools": tools, "top_p": body.get("top_p"),
            "truncation": "disabled", "user": body.get("user")}


def from_chat(chat: dict, writer: EventWriter) -> dict:
    """A unary chat completion (convert.completion) as the Response: its reasoning (where the reasoning
    parser split one off) as a reasoning item, the message's text as a message item, each tool call a
    function_call item; cut by the length: status incomplete (max_output_tokens)."""
    choice = chat["choices"][0]
    message, status = choice["message"], "incomplete" if choice["finish_reason"] == "length" else "completed"
    thought = message.get("reasoning_content")
    output = [reasoning_item("rs_" + uuid.uuid4().hex, thought, status)] if thought else []
    output += [message_item("msg_" + uuid.uuid4().hex, message["content"], status)] if message.get("content") else []
    output += [call_item(c) for c in message.get("tool_calls") or ()]
    if not any(item["type"] != "reasoning" for item in output):
        output.append(message_item("msg_" + uuid.uuid4().hex, "", status))
    writer.output = output
    out = writer.snapshot(status, responses_usage(chat["usage"]))
    out["trserve"] = chat["trserve"]
    return out


class Responses:
    """The `POST /v1/responses` route of an OpenAIApp (app.py, which builds this): its credentials,
    body limit, tenant, metrics and front door."""

    def __init__(self, app) -> None:
        self.app = app

    async def create(self, request: Request) -> Response:
        app = self.app
        try:
            token_tenant = app._token_tenant(request)
            body = await app._body(request)
            req = convert.parse_request(chat_request(body), "chat", app.model_id,
                                        app._tenant(request, body, token_tenant), app.tools,
                                        app.tool_markers, app.tool_fold)
            writer = EventWriter("resp_" + uuid.uuid4().hex, int(time.time()), req.model, echoed(body))
            deadline = HttpDeadline(request)
            if req.stream:
                return await self._stream(req, writer, deadline, request.state)
            done = await app._complete_while_connected(request, req.ask, deadline)
        except Exception as exc:  # noqa: BLE001 - every failure is mapped, never dropped
            app._count(METHOD, exc)
            return error_response(exc)
        app._count(METHOD, None)
        request.state.tenant = done.call.tenant
        request.state.tokens = (done.result.stats.prompt_tokens, done.result.stats.generated_tokens)
        chat = convert.completion(req, [done.result], done.queue_s, app.fingerprint, app.vocab, done.call.tenant)
        return JSONResponse(from_chat(await app.reasoning.answer(req, chat), writer))

    async def _stream(self, req: convert.OpenAIRequest, writer: EventWriter, deadline, state) -> Response:
        """Waits for the first chunk (after the prefill), so refusals are still plain HTTP errors."""
        streams = [self.app.door.stream(req.ask, deadline)]
        firsts = await first_items(streams)
        chunks = (await self.app.reasoning.writers(req, convert.ChunkWriter.of(req, self.app.fingerprint,
                                                                               self.app.vocab), 1))[0]
        return StreamingResponse(self._events(chunks, writer, merged(streams, firsts, StreamEnd), state),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                          "X-Accel-Buffering": "no"})

    async def _events(self, chunks: convert.ChunkWriter, writer: EventWriter,
                      items: AsyncIterator[tuple[int, StepChunk | StreamEnd]], state) -> AsyncIterator[str]:
        """The Response's events: created and in_progress, each output item's as the chat chunks carry
        its text or calls, then completed (or incomplete) with the usage."""
        error: BaseException | None = ClientGone("the client closed the stream")  # until the end is sent
        async with contextlib.aclosing(items):
            try:
                for event in writer.start():
                    yield event
                async for _, item in items:
                    if isinstance(item, StreamEnd):
                        state.tenant = item.call.tenant
                        reason = "shutdown" if item.drained else item.result.finish_reason
                        last = chunks.last_chunk(item.rest, item.result, reason, item.queue_s, item.call.tenant)
                        stats = item.result.stats
                        state.tokens = (stats.prompt_tokens, stats.generated_tokens)
                        events = writer.chunk(last) + writer.finish(convert.FINISH[reason] == "length",
                                                                    responses_usage(convert.usage(stats)), last["trserve"])
                    else:
                        events = writer.chunk(chunks.chunk(item.text or None))
                    for event in events:
                        yield event
                error = None
            except Exception as exc:  # noqa: BLE001 - headers are sent: the error goes in the stream
                error = exc
                yield writer.error(error_body(exc)[1]["error"])
            finally:
                self.app._count(METHOD, error)


def error_body(exc: BaseException) -> tuple[int, dict, dict[str, str]]:
    """app.py's error body, its param named as a Responses request names it."""
    status, body, headers = chat_error_body(exc)
    param = body["error"]["param"]
    if isinstance(param, str):
        body["error"]["param"] = "input" if param.startswith("messages") else PARAMS.get(param, param)
    return status, body, headers


def error_response(exc: BaseException) -> JSONResponse:
    status, body, headers = error_body(exc)
    return JSONResponse(body, status_code=status, headers=headers)
