"""The Generate servicer, the gRPC edge: protobuf -> an Ask (convert.py), the front door (front.py:
admission, validation, deadline, the engine bridge, metrics), its plain answers -> protobuf. Domain errors
become status codes (@grpc_errors); a full queue gets the retry-after trailers (@observed)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from ..common.errors import grpc_errors
from . import convert
from .front import FrontDoor, StreamEnd
from .observed import observed
from ...v1 import generate_pb2 as pb
from ...v1 import generate_pb2_grpc


class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    """The Generate API over a worker's front door (its `metrics` are what @observed counts in)."""

    def __init__(self, door: FrontDoor) -> None:
        self.door = door
        self.metrics = door.metrics
        # (tool-call format replies are read in, reasoning parser): fixed by the config and the model's
        # template, so resolved once (ModelInfo reports them)
        self.parsers = convert.served_parsers(door.config, door.decoder)
        self.tools = convert.served_tools(self.parsers[0], door.decoder)  # the format with its marker tokens

    @grpc_errors
    @observed
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        ask, reading = convert.ask_from_pb(request, self.tools)
        done = await self.door.complete(ask, context)
        reply = convert.result_to_pb(done.result, done.call, done.queue_s)
        convert.read_tool_calls(reading, done.result, reply)
        return reply

    @grpc_errors
    @observed
    async def GenerateStream(self, request: pb.GenerateRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateStreamResponse]:
        ask, reading = convert.ask_from_pb(request, self.tools)
        async with contextlib.aclosing(self.door.stream(ask, context)) as items:
            async for item in items:
                if isinstance(item, StreamEnd):
                    final = convert.final_chunk_to_pb(item.result, item.text_sent, item.queue_s)
                    if item.drained:
                        final.finish_reason = pb.FINISH_REASON_SHUTDOWN
                    convert.read_tool_calls(reading, item.result, final)
                    yield final
                else:
                    yield convert.chunk_to_pb(item)

    @grpc_errors
    @observed
    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        ids = await self.door.tokenize(*convert.tokenize_input_from_pb(request, self.tools))
        tokens = self.door.decoder.tokenizer.convert_ids_to_tokens(ids)
        return pb.TokenizeResponse(token_ids=ids, tokens=[str(t) for t in tokens])

    @grpc_errors
    @observed
    async def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        return convert.model_info_to_pb(self.door.decoder, self.door.limits, self.door.model_name, self.parsers)
