"""The client: one channel to a worker (or any gRPC target), methods mirroring the rpcs. Replies come
back as `Reply` / `Chunk` (finish reasons as strings, the protobuf message as `.raw`); failures as
the typed errors of errors.py. `AsyncClient` (aio.py) is the same over grpc.aio, `BalancedClient`
(balanced.py) the same calls spread over several workers.

The standard gRPC service config for Generate clients in any language (service_config.json beside
this file, the one copy): round_robin over every address the target resolves to (a headless
Service's pods), client-side health checks, and retries of UNAVAILABLE and RESOURCE_EXHAUSTED that
honour the server's grpc-retry-pushback-ms."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from trserve_client._proto.trserve.v1 import generate_pb2 as pb
from trserve_client._proto.trserve.v1 import generate_pb2_grpc
from trserve_client.errors import typed

SERVICE_CONFIG_FILE = Path(__file__).with_name("service_config.json")
_MODES = {None: pb.DECODING_MODE_UNSPECIFIED, "tr": pb.DECODING_MODE_TR, "ar": pb.DECODING_MODE_AR}


def service_config() -> str:
    """The standard gRPC service config (round robin, health checks, retries) as a JSON string."""
    return json.dumps(json.loads(SERVICE_CONFIG_FILE.read_text()))


def channel_options() -> list[tuple[str, object]]:
    """Channel options that apply the service config (retries on, health checks on), for a plain
    grpc channel: `grpc.insecure_channel(target, options=channel_options())`."""
    return [("grpc.service_config", service_config()), ("grpc.enable_retries", 1)]


def finish_reason_name(value: int) -> str | None:
    """FINISH_REASON_STOP_SEQUENCE -> "stop_sequence"; None for UNSPECIFIED (not a last message)."""
    if value == pb.FINISH_REASON_UNSPECIFIED:
        return None
    return pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


@dataclass(frozen=True)
class Reply:
    """A Generate answer: `finish_reason` "length", "eos", "stop_sequence", "time_limit" or "shutdown"."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: pb.GenerationStats
    raw: pb.GenerateResponse
    logprobs: list[pb.TokenLogprob] | None = None  # per token, where asked (logprobs=True)

    @classmethod
    def of(cls, r: pb.GenerateResponse) -> Reply:
        return cls(r.text, list(r.token_ids), finish_reason_name(r.finish_reason), r.stats, r, list(r.logprobs) or None)


@dataclass(frozen=True)
class Chunk:
    """One step of a stream; the last has `finish_reason` and `stats` (None before)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    stats: pb.GenerationStats | None
    raw: pb.GenerateStreamResponse
    logprobs: list[pb.TokenLogprob] | None = None  # per token of token_ids, where asked

    @classmethod
    def of(cls, r: pb.GenerateStreamResponse) -> Chunk:
        reason = finish_reason_name(r.finish_reason)
        return cls(r.text, list(r.token_ids), reason, r.stats if reason is not None else None, r,
                   list(r.logprobs) or None)


def build_request(prompt: str | None = None, *, messages: Sequence[dict] | None = None,
                  token_ids: Sequence[int] | None = None, tenant: str = "", domain: str | None = None,
                  max_new_tokens: int | None = None, max_tokens: int | None = None, stop: Sequence[str] = (),
                  stop_token_ids: Sequence[int] = (), temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0,
                  min_p: float = 0.0, seed: int | None = None, mode: str | None = None, tree: str = "",
                  return_token_ids: bool = False, logprobs: bool = False, top_logprobs: int = 0,
                  ignore_eos: bool = False, min_tokens: int = 0, chat_template_kwargs: dict | None = None,
                  continue_final_message: bool = False, add_generation_prompt: bool | None = None,
                  tools: Sequence[dict] | None = None, tool_choice: str | dict | None = None,
                  parallel_tool_calls: bool | None = None) -> pb.GenerateRequest:
    """A GenerateRequest; give exactly one of prompt (raw text), messages (chat turns), token_ids.
    `max_tokens` is OpenAI's name for `max_new_tokens` (give one). `ignore_eos`: decode through the
    model's end-of-sequence ids (fixed-length output); `min_tokens`: none of them among the first N.
    With messages, vLLM's: `chat_template_kwargs` (variables for the chat template, e.g.
    {"enable_thinking": False}), `continue_final_message` (the reply continues the final, assistant,
    message; needs add_generation_prompt=False), `add_generation_prompt` (None: the server's default, true),
    `tools` (OpenAI-style function tools the chat template describes; the reply's calls come back in
    `reply.raw.tool_calls`), `tool_choice` ("auto", "none", "required" or {"type": "function", "function":
    {"name": ...}}; None: the server's default) and `parallel_tool_calls` as OpenAI's. Messages are OpenAI's:
    an assistant turn may carry its earlier `tool_calls` ([{"id", "type": "function", "function": {"name",
    "arguments": JSON text or a dict}}]), a tool turn its `tool_call_id` (and `name`)."""
    if mode not in _MODES:
        raise ValueError(f"mode must be 'tr', 'ar' or None, got {mode!r}")
    if max_tokens is not None:
        if max_new_tokens is not None and max_new_tokens != max_tokens:
            raise ValueError("give max_new_tokens or max_tokens (the same), not both")
        max_new_tokens = max_tokens
    req = pb.GenerateRequest(tenant=tenant, stop_sequences=list(stop), stop_token_ids=list(stop_token_ids),
                             sampling=pb.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                                                        min_p=min_p),
                             mode=_MODES[mode], tree=tree, return_token_ids=return_token_ids,
                             logprobs=logprobs, top_logprobs=top_logprobs, ignore_eos=ignore_eos,
                             min_tokens=min_tokens)
    if seed is not None:
        req.sampling.seed = seed
    if domain is not None:
        req.domain = domain
    if max_new_tokens is not None:
        req.max_new_tokens = max_new_tokens
    if prompt is not None:
        req.text = prompt
    if messages is not None:
        req.messages.CopyFrom(chat_messages(messages, chat_template_kwargs, continue_final_message,
                                            add_generation_prompt, tools, tool_choice, parallel_tool_calls))
    elif chat_template_kwargs or continue_final_message or add_generation_prompt is not None or tools or \
            tool_choice is not None or parallel_tool_calls is not None:
        raise ValueError("chat_template_kwargs, continue_final_message, add_generation_prompt and tools (with "
                         "tool_choice, parallel_tool_calls) need messages")
    if token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    return req


def chat_messages(messages: Sequence[dict], chat_template_kwargs: dict | None = None,
                  continue_final_message: bool = False, add_generation_prompt: bool | None = None,
                  tools: Sequence[dict] | None = None, tool_choice: str | dict | None = None,
                  parallel_tool_calls: bool | None = None) -> pb.ChatMessages:
    """The wire's ChatMessages: the turns (with earlier tool calls and tool_call_ids), how the server's chat
    template renders them, the tools it describes and how the reply may call them."""
    out = pb.ChatMessages(messages=[chat_message(m) for m in messages],
                          chat_template_kwargs=json.dumps(chat_template_kwargs) if chat_template_kwargs else "",
                          continue_final_message=continue_final_message, tools=json.dumps(list(tools)) if tools else "")
    if add_generation_prompt is not None:
        out.add_generation_prompt = add_generation_prompt
    if parallel_tool_calls is not None:
        out.parallel_tool_calls = parallel_tool_calls
    if isinstance(tool_choice, dict):
        out.tool_choice, out.tool_choice_function = pb.TOOL_CHOICE_REQUIRED, tool_choice["function"]["name"]
    elif tool_choice is not None:
        out.tool_choice = pb.ToolChoice.Value("TOOL_CHOICE_" + tool_choice.upper())
    return out


def chat_message(m: dict) -> pb.ChatMessage:
    """An OpenAI-style message as the wire's ChatMessage (content None = "", a dict's arguments as JSON)."""
    calls = [pb.ToolCall(id=c["id"], name=c["function"]["name"], arguments_json=a if isinstance(
        a := c["function"].get("arguments", ""), str) else json.dumps(a)) for c in m.get("tool_calls") or ()]
    return pb.ChatMessage(role=m["role"], content=m.get("content") or "", tool_calls=calls,
                          tool_call_id=m.get("tool_call_id") or "",
                          name=(m.get("name") or "") if m["role"] == "tool" else "")


def tokenize_request(text: str | None, messages: Sequence[dict] | None, **chat) -> pb.TokenizeRequest:
    """`chat`: chat_template_kwargs, continue_final_message, add_generation_prompt, tools, tool_choice,
    parallel_tool_calls (as build_request's)."""
    if text is not None:
        return pb.TokenizeRequest(text=text)
    return pb.TokenizeRequest(messages=chat_messages(messages or [], **chat))


def is_loopback(target: str) -> bool:
    """Whether a target (HOST:PORT, dns:///HOST:PORT) names this machine (localhost, 127.0.0.0/8, ::1)."""
    host = target.split("///")[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def channel_setup(addr: str, tls_ca_file: str | None, token: str | None, allow_plaintext_token: bool,
                  retries: bool) -> tuple[tuple, list, grpc.ChannelCredentials | None]:
    """(call metadata, channel options, TLS credentials or None), checking the plaintext-token rule."""
    if token is not None and tls_ca_file is None and not allow_plaintext_token and not is_loopback(addr):
        raise ValueError(f"refusing to send a tenant token without TLS to {addr}: pass tls_ca_file, or "
                         "allow_plaintext_token=True on a trusted network")
    return bearer_metadata(token), channel_options() if retries else [], credentials(tls_ca_file)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Per-call metadata for a tenant token (empty without one)."""
    return () if token is None else (("authorization", f"Bearer {token}"),)


def credentials(tls_ca_file: str | None) -> grpc.ChannelCredentials | None:
    """TLS trusting the PEM CA in `tls_ca_file`; None (plaintext) without one."""
    return None if tls_ca_file is None else grpc.ssl_channel_credentials(
        root_certificates=Path(tls_ca_file).read_bytes())


def open_channel(addr: str, creds: grpc.ChannelCredentials | None, options: Sequence = ()) -> grpc.Channel:
    """A sync channel: TLS with `creds`, else plaintext."""
    if creds is None:
        return grpc.insecure_channel(addr, options=list(options))
    return grpc.secure_channel(addr, creds, options=list(options))


class Stream:
    """The chunks of a GenerateStream call as `Chunk`s (an iterator); `.cancel()` stops decoding on
    the server."""

    def __init__(self, call) -> None:
        self._call = call

    def __iter__(self) -> Iterator[Chunk]:
        return self

    def __next__(self) -> Chunk:
        try:
            return Chunk.of(next(self._call))
        except grpc.RpcError as e:
            raise typed(e) from None

    def cancel(self) -> None:
        self._call.cancel()


class Client:
    """`timeout`: the default deadline in seconds. `tls_ca_file`: PEM CA to trust (TLS). `token`: the
    tenant's bearer token; refused without TLS to a non-loopback target unless `allow_plaintext_token`.
    `retries`: apply the service config (retries of UNAVAILABLE and RESOURCE_EXHAUSTED)."""

    def __init__(self, addr: str = "127.0.0.1:50051", timeout: float | None = None, *, tls_ca_file: str | None = None,
                 token: str | None = None, allow_plaintext_token: bool = False, retries: bool = True) -> None:
        self._metadata, options, creds = channel_setup(addr, tls_ca_file, token, allow_plaintext_token, retries)
        self.addr, self.timeout = addr, timeout
        self._channel = open_channel(addr, creds, options)
        self.stub = generate_pb2_grpc.GenerateStub(self._channel)  # the raw stub, for futures and metadata

    def _call(self, method, request, timeout: float | None):
        try:
            return method(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise typed(e) from None

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Reply:
        """Decode to the end; keyword arguments as `build_request`."""
        return Reply.of(self._call(self.stub.Generate, build_request(prompt, **kwargs), timeout))

    def stream(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Stream:
        """Per-step chunks; the last one has finish_reason and stats. `.cancel()` stops decoding."""
        return Stream(self.stub.GenerateStream(build_request(prompt, **kwargs), timeout=timeout or self.timeout,
                                               metadata=self._metadata))

    def tokenize(self, text: str | None = None, *, messages: Sequence[dict] | None = None, **chat) -> list[int]:
        """`chat`: chat_template_kwargs, continue_final_message, add_generation_prompt, tools (as build_request's)."""
        return list(self._call(self.stub.Tokenize, tokenize_request(text, messages, **chat), None).token_ids)

    def model_info(self) -> pb.ModelInfoResponse:
        return self._call(self.stub.ModelInfo, pb.ModelInfoRequest(), None)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
