"""A small synchronous client of the Generate API for other services.

    with TRServeClient("127.0.0.1:50051") as client:
        reply = client.generate(messages=[{"role": "user", "content": "Hello"}], max_new_tokens=32)
        print(reply.text, reply.stats.mean_accepted_tokens)
        for chunk in client.stream("Once upon a time", max_new_tokens=32):
            print(chunk.text, end="")

Responses are the protobuf messages of protos/trserve/v1/generate.proto. Errors are grpc.RpcError
with the status code and an actionable message from the server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..common.security import bearer_metadata, check_plaintext_tokens, client_channel
from ...v1 import generate_pb2 as pb
from ...v1 import generate_pb2_grpc

# The standard gRPC service config for Generate clients in any language (services/client/service_config.json):
# round_robin over every address the target resolves to (a headless Service's pods), client-side health
# checks, and retries of UNAVAILABLE and RESOURCE_EXHAUSTED that honour the server's grpc-retry-pushback-ms.
SERVICE_CONFIG_FILE = Path(__file__).with_name("service_config.json")


def service_config() -> str:
    """The service config as the JSON string the `grpc.service_config` channel option takes."""
    return json.dumps(json.loads(SERVICE_CONFIG_FILE.read_text()))


def channel_options() -> list[tuple[str, object]]:
    """Channel options that apply the service config (retries on, health checks on)."""
    return [("grpc.service_config", service_config()), ("grpc.enable_retries", 1)]


_MODES = {None: pb.DECODING_MODE_UNSPECIFIED, "tr": pb.DECODING_MODE_TR, "ar": pb.DECODING_MODE_AR}


def build_request(
    prompt: str | None = None,
    *,
    messages: Sequence[dict] | None = None,
    token_ids: Sequence[int] | None = None,
    tenant: str = "",
    domain: str | None = None,
    max_new_tokens: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    temperature: float = 0.0,
    top_p: float = 0.0,
    top_k: int = 0,
    seed: int | None = None,
    mode: str | None = None,
    tree: str = "",
    return_token_ids: bool = False,
) -> pb.GenerateRequest:
    """A GenerateRequest from Python values; give exactly one of prompt (raw text), messages, token_ids.

    temperature 0 = greedy; top_p / top_k 0 = off; seed None = a fresh random seed per request.
    """
    if mode not in _MODES:
        raise ValueError(f"mode must be 'tr', 'ar' or None, got {mode!r}")
    req = pb.GenerateRequest(tenant=tenant, stop_sequences=list(stop), stop_token_ids=list(stop_token_ids),
                             sampling=pb.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k),
                             mode=_MODES[mode], tree=tree, return_token_ids=return_token_ids)
    if seed is not None:
        req.sampling.seed = seed
    if domain is not None:
        req.domain = domain
    if max_new_tokens is not None:
        req.max_new_tokens = max_new_tokens
    if prompt is not None:
        req.text = prompt
    if messages is not None:
        req.messages.CopyFrom(_messages(messages))
    if token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    return req


def _messages(messages: Sequence[dict]) -> pb.ChatMessages:
    return pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"]) for m in messages])


class TRServeClient:
    """One channel to a worker; methods mirror the rpcs. `timeout` (seconds) is the default deadline.
    `tls_ca_file`: PEM CA to trust, for a worker serving TLS; `token`: the tenant's bearer token, for
    a worker with --tenant-tokens (never sent without TLS to a non-loopback address unless
    `allow_plaintext_token`). `retries`: the standard service config (SERVICE_CONFIG_FILE): a busy
    (RESOURCE_EXHAUSTED) or unreachable (UNAVAILABLE) worker is retried after its pushback, up to 4
    attempts within the deadline; a stream only until its first message. `addr` may be any gRPC target,
    e.g. dns:///trserve-worker:50051, whose addresses the calls then go round."""

    def __init__(self, addr: str = "127.0.0.1:50051", timeout: float | None = None, *, tls_ca_file: str | None = None,
                 token: str | None = None, allow_plaintext_token: bool = False, retries: bool = True) -> None:
        check_plaintext_tokens([addr], tls_ca_file, token is not None, allow_plaintext_token)
        self.addr = addr
        self.timeout = timeout
        self._metadata = bearer_metadata(token)
        self._channel = client_channel(addr, tls_ca_file, options=channel_options() if retries else ())
        self._stub = generate_pb2_grpc.GenerateStub(self._channel)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> pb.GenerateResponse:
        """Decode to the end; keyword arguments as `build_request`."""
        return self._stub.Generate(build_request(prompt, **kwargs), timeout=timeout or self.timeout,
                                   metadata=self._metadata)

    def stream(self, prompt: str | None = None, *, timeout: float | None = None,
               **kwargs) -> Iterator[pb.GenerateStreamResponse]:
        """Per-step chunks; the last one has finish_reason and stats. Closing the iterator (or
        calling .cancel() on it) cancels the call and stops decoding at the next step."""
        return self._stub.GenerateStream(build_request(prompt, **kwargs), timeout=timeout or self.timeout,
                                         metadata=self._metadata)

    def tokenize(self, text: str | None = None, *, messages: Sequence[dict] | None = None) -> list[int]:
        req = pb.TokenizeRequest(text=text) if text is not None else pb.TokenizeRequest(messages=_messages(messages or []))
        return list(self._stub.Tokenize(req, timeout=self.timeout, metadata=self._metadata).token_ids)

    def model_info(self) -> pb.ModelInfoResponse:
        return self._stub.ModelInfo(pb.ModelInfoRequest(), timeout=self.timeout, metadata=self._metadata)

    @property
    def stub(self) -> generate_pb2_grpc.GenerateStub:
        """The raw stub, for futures and metadata."""
        return self._stub

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> TRServeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
