"""The client: one channel to a worker (or any gRPC target), methods mirroring the rpcs."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc

from trserve_client._proto.trserve.v1 import generate_pb2 as pb
from trserve_client._proto.trserve.v1 import generate_pb2_grpc

SERVICE_CONFIG_FILE = Path(__file__).with_name("service_config.json")
_MODES = {None: pb.DECODING_MODE_UNSPECIFIED, "tr": pb.DECODING_MODE_TR, "ar": pb.DECODING_MODE_AR}


def service_config() -> str:
    """The standard gRPC service config (round robin, health checks, retries) as a JSON string."""
    return json.dumps(json.loads(SERVICE_CONFIG_FILE.read_text()))


def build_request(prompt: str | None = None, *, messages: Sequence[dict] | None = None,
                  token_ids: Sequence[int] | None = None, tenant: str = "", domain: str | None = None,
                  max_new_tokens: int | None = None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                  temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0, seed: int | None = None,
                  mode: str | None = None, tree: str = "", return_token_ids: bool = False) -> pb.GenerateRequest:
    """A GenerateRequest; give exactly one of prompt (raw text), messages (chat turns), token_ids."""
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
        req.messages.CopyFrom(pb.ChatMessages(messages=[pb.ChatMessage(role=m["role"], content=m["content"])
                                                        for m in messages]))
    if token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    return req


def _is_loopback(target: str) -> bool:
    host = target.split("///")[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Client:
    """`timeout`: the default deadline in seconds. `tls_ca_file`: PEM CA to trust (TLS). `token`: the
    tenant's bearer token; refused without TLS to a non-loopback target unless `allow_plaintext_token`.
    `retries`: apply the service config (retries of UNAVAILABLE and RESOURCE_EXHAUSTED)."""

    def __init__(self, addr: str = "127.0.0.1:50051", timeout: float | None = None, *, tls_ca_file: str | None = None,
                 token: str | None = None, allow_plaintext_token: bool = False, retries: bool = True) -> None:
        if token is not None and tls_ca_file is None and not allow_plaintext_token and not _is_loopback(addr):
            raise ValueError(f"refusing to send a tenant token without TLS to {addr}: pass tls_ca_file, or "
                             "allow_plaintext_token=True on a trusted network")
        self.addr, self.timeout = addr, timeout
        self._metadata = () if token is None else (("authorization", f"Bearer {token}"),)
        options = [("grpc.service_config", service_config()), ("grpc.enable_retries", 1)] if retries else []
        if tls_ca_file is None:
            self._channel = grpc.insecure_channel(addr, options=options)
        else:
            creds = grpc.ssl_channel_credentials(root_certificates=Path(tls_ca_file).read_bytes())
            self._channel = grpc.secure_channel(addr, creds, options=options)
        self.stub = generate_pb2_grpc.GenerateStub(self._channel)

    def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> pb.GenerateResponse:
        """Decode to the end; keyword arguments as `build_request`."""
        return self.stub.Generate(build_request(prompt, **kwargs), timeout=timeout or self.timeout,
                                  metadata=self._metadata)

    def stream(self, prompt: str | None = None, *, timeout: float | None = None,
               **kwargs) -> Iterator[pb.GenerateStreamResponse]:
        """Per-step chunks; the last one has finish_reason and stats. `.cancel()` stops decoding."""
        return self.stub.GenerateStream(build_request(prompt, **kwargs), timeout=timeout or self.timeout,
                                        metadata=self._metadata)

    def tokenize(self, text: str | None = None, *, messages: Sequence[dict] | None = None) -> list[int]:
        req = pb.TokenizeRequest(text=text) if text is not None else pb.TokenizeRequest(
            messages=build_request(messages=messages or []).messages)
        return list(self.stub.Tokenize(req, timeout=self.timeout, metadata=self._metadata).token_ids)

    def model_info(self) -> pb.ModelInfoResponse:
        return self.stub.ModelInfo(pb.ModelInfoRequest(), timeout=self.timeout, metadata=self._metadata)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
