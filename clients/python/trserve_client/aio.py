"""`AsyncClient`: the client over grpc.aio, for asyncio applications (the same arguments, replies and
typed errors as `Client`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from trserve_client._proto.trserve.v1 import generate_pb2 as pb
from trserve_client._proto.trserve.v1 import generate_pb2_grpc
from trserve_client.client import Chunk, Reply, build_request, channel_setup, tokenize_request
from trserve_client.errors import typed


class AsyncStream:
    """The chunks of a GenerateStream call (`async for`); `.cancel()` stops decoding on the server."""

    def __init__(self, call) -> None:
        self._call = call

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        try:
            async for item in self._call:
                yield Chunk.of(item)
        except grpc.RpcError as e:
            raise typed(e) from None

    def cancel(self) -> None:
        self._call.cancel()


class AsyncClient:
    """As `Client` (addr, timeout, tls_ca_file, token, allow_plaintext_token, retries); create it inside
    a running event loop, and `await close()` it or use `async with`."""

    def __init__(self, addr: str = "127.0.0.1:50051", timeout: float | None = None, *, tls_ca_file: str | None = None,
                 token: str | None = None, allow_plaintext_token: bool = False, retries: bool = True) -> None:
        self._metadata, options, creds = channel_setup(addr, tls_ca_file, token, allow_plaintext_token, retries)
        self.addr, self.timeout = addr, timeout
        self._channel = (grpc.aio.insecure_channel(addr, options=options) if creds is None
                         else grpc.aio.secure_channel(addr, creds, options=options))
        self.stub = generate_pb2_grpc.GenerateStub(self._channel)

    async def _call(self, method, request, timeout: float | None):
        try:
            return await method(request, timeout=timeout or self.timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise typed(e) from None

    async def generate(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> Reply:
        return Reply.of(await self._call(self.stub.Generate, build_request(prompt, **kwargs), timeout))

    def stream(self, prompt: str | None = None, *, timeout: float | None = None, **kwargs) -> AsyncStream:
        return AsyncStream(self.stub.GenerateStream(build_request(prompt, **kwargs), timeout=timeout or self.timeout,
                                                    metadata=self._metadata))

    async def tokenize(self, text: str | None = None, *, messages: Sequence[dict] | None = None, **chat) -> list[int]:
        """`chat`: chat_template_kwargs, continue_final_message, add_generation_prompt (as build_request's)."""
        return list((await self._call(self.stub.Tokenize, tokenize_request(text, messages, **chat), None)).token_ids)

    async def model_info(self) -> pb.ModelInfoResponse:
        return await self._call(self.stub.ModelInfo, pb.ModelInfoRequest(), None)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
