"""The Generate servicer: validate (from_pb) -> prepare (a thread) -> admission -> the batching
engine (engine/engine.py, its own thread) -> to_pb.

Deadlines: a call's gRPC deadline becomes the engine's `deadline`, early by `deadline_margin_s` or
two recent decoding steps (whichever is longer), so decoding stops in time to return the partial result with finish_reason TIME_LIMIT (status OK).
Only a call whose deadline is already (nearly) over when it reaches the decoder is refused with
DEADLINE_EXCEEDED; one that expires while queued is cancelled by gRPC itself.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from core.errors import TRServeError
from engine import Decoder
from engine.engine import BatchEngine
from engine.request.request import GenerationRequest, PreparedRequest
from engine.results import GenerationResult, StepChunk
from engine.tuning.online import OnlineTuner, TunerBook
from services.common.errors import grpc_errors, status_for
from services.worker import convert
from services.worker.admission import Admission, QueueFull
from services.worker.bridge import EngineStream
from services.worker.config import WorkerConfig
from services.worker.drafting.embedded import DraftSourceFactory
from services.worker.metrics import WorkerMetrics
from trserve.v1 import generate_pb2 as pb
from trserve.v1 import generate_pb2_grpc

log = logging.getLogger("trserve.worker")


class DeadlineTooShort(TRServeError):
    status = "DEADLINE_EXCEEDED"


@dataclass
class _Call:
    """One admitted Generate call."""

    call: convert.GenerateCall
    cancelled: threading.Event = field(default_factory=threading.Event)
    queue_s: float = 0.0


def observed(method):
    """Count each RPC by final status code; refuse a full queue with a retry-after trailer.

    Sits inside @grpc_errors, so it sees the domain exception before it becomes a status.
    """
    name = method.__name__

    async def on_error(self, exc: BaseException, context) -> str:
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            return "CANCELLED"
        if isinstance(exc, QueueFull):
            self.metrics.requests.labels(name, "RESOURCE_EXHAUSTED").inc()
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc),
                                trailing_metadata=(("retry-after-ms", str(int(exc.retry_after_s * 1000))),))
        return "ABORTED" if isinstance(exc, grpc.aio.AbortError) else status_for(exc).name

    if inspect.isasyncgenfunction(method):
        @functools.wraps(method)
        async def stream(self, request, context):
            try:
                async for item in method(self, request, context):
                    yield item
            except BaseException as exc:
                self.metrics.requests.labels(name, await on_error(self, exc, context)).inc()
                raise
            self.metrics.requests.labels(name, "OK").inc()
        return stream

    @functools.wraps(method)
    async def unary(self, request, context):
        try:
            response = await method(self, request, context)
        except BaseException as exc:
            self.metrics.requests.labels(name, await on_error(self, exc, context)).inc()
            raise
        self.metrics.requests.labels(name, "OK").inc()
        return response
    return unary


class GenerateServicer(generate_pb2_grpc.GenerateServicer):
    def __init__(self, decoder: Decoder, engine: BatchEngine, config: WorkerConfig, draft_sources: DraftSourceFactory,
                 metrics: WorkerMetrics, tuner_states=None) -> None:
        self.decoder = decoder
        self.engine = engine
        self.config = config
        self.limits = config.limits
        self.draft_sources = draft_sources
        self.metrics = metrics
        self.admission = Admission(config.max_batch, config.max_queue)
        metrics.queue_depth.set_function(lambda: self.admission.waiting)  # read at scrape time
        metrics.active.set_function(lambda: self.admission.active)
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe to encode concurrently
        self._step_s = 0.1  # moving average of one decoding step, for deadline margins
        # tree "adaptive": each tenant's tree is re-tuned online from its own acceptance; with
        # `tuner_states` (load/save by tenant) the records are kept with the tenant's matrix
        self.tuners = TunerBook(decoder.new_tuner, states=tuner_states) if decoder.autotuner is not None else None

    # ---- RPCs ------------------------------------------------------------------------------
    @grpc_errors
    @observed
    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.GenerateResponse:
        call = _Call(convert.generate_call_from_pb(request, self.limits, self.config.default_tenant))
        result = None
        async for item in self._decode(call, context):  # consumed to the end: the decode slot is freed on exit
            if isinstance(item, GenerationResult):
                result = item
        if result is None:
            raise RuntimeError("the engine ended without a result")
        return convert.result_to_pb(result, call.call, call.queue_s)

    @grpc_errors
    @observed
    async def GenerateStream(self, request: pb.GenerateRequest,
                             context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateStreamResponse]:
        call = _Call(convert.generate_call_from_pb(request, self.limits, self.config.default_tenant))
        sent: list[str] = []
        async for item in self._decode(call, context):
            if isinstance(item, StepChunk):
                sent.append(item.text)
                yield convert.chunk_to_pb(item)
            else:
                text_sent = "".join(sent)
                if not item.text.startswith(text_sent):
                    log.warning("streamed text %r is not a prefix of the final text %r", text_sent, item.text)
                yield convert.final_chunk_to_pb(item, text_sent, call.queue_s)

    @grpc_errors
    @observed
    async def Tokenize(self, request: pb.TokenizeRequest, context: grpc.aio.ServicerContext) -> pb.TokenizeResponse:
        text, messages = convert.tokenize_input_from_pb(request, self.limits)
        ids = await asyncio.to_thread(self._prompt_ids, text, messages)
        tokens = self.decoder.tokenizer.convert_ids_to_tokens(ids)
        return pb.TokenizeResponse(token_ids=ids, tokens=[str(t) for t in tokens])

    @grpc_errors
    @observed
    async def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.aio.ServicerContext) -> pb.ModelInfoResponse:
        return convert.model_info_to_pb(self.decoder, self.limits)

    # ---- warm-up -----------------------------------------------------------------------------
    async def warm_up(self) -> None:
        """One short generation through the engine (kernels, caches, first-call costs), throwaway matrix."""
        t0 = time.perf_counter()
        prepared = await asyncio.to_thread(self.decoder.prepare, GenerationRequest(prompt="Hello", max_new_tokens=4))
        async with self.admission.slot():
            stream = EngineStream(asyncio.get_running_loop(), threading.Event(), self.config.stream_buffer)
            await asyncio.to_thread(self.engine.submit, prepared, stream.emit)
            await stream.finish()
        log.info("warm-up done in %.1f s", time.perf_counter() - t0)

    # ---- the decode path -----------------------------------------------------------------------
    async def _decode(self, call: _Call, context: grpc.aio.ServicerContext) -> AsyncIterator[StepChunk | GenerationResult]:
        prepared, tuner = await asyncio.to_thread(self._prepare, call.call)
        async with self.admission.slot() as queue_s:
            call.queue_s = queue_s
            self.metrics.queue_seconds.observe(queue_s)
            deadline = self._engine_deadline(context)
            stream = EngineStream(asyncio.get_running_loop(), call.cancelled, self.config.stream_buffer)
            c = call.call
            source = self.draft_sources(c.tenant, c.domain) if prepared.request.mode == "tr" else None
            await asyncio.to_thread(self.engine.submit, prepared, stream.emit, matrix=source,
                                    cancelled=call.cancelled.is_set, deadline=deadline, tuner=tuner, tenant=c.tenant)
            try:
                last = None
                async for item in stream.items():
                    now = time.perf_counter()
                    if isinstance(item, StepChunk) and last is not None:  # the first chunk comes from the prefill
                        self.metrics.step_seconds.observe(now - last)
                        self._step_s = 0.9 * self._step_s + 0.1 * (now - last)
                    last = now
                    yield item
            finally:  # also when the caller went away: the engine frees the request's place first
                result = await stream.finish()
                if result is not None:
                    self._observe_result(result)

    def _observe_result(self, result: GenerationResult) -> None:
        m, s = self.metrics, result.stats
        m.finished.labels(result.finish_reason).inc()
        m.prompt_tokens.inc(s.prompt_tokens)
        m.generated_tokens.inc(s.generated_tokens)
        m.decode_seconds.observe(s.prefill_s + s.decode_s)
        if s.draft_mode != "none" and s.steps:
            m.mat.observe(s.mat)
        if s.draft_mode == "local-fallback":
            m.draft_fallbacks.inc()

    # ---- helpers -------------------------------------------------------------------------------
    def _prepare(self, call: convert.GenerateCall) -> tuple[PreparedRequest, OnlineTuner | None]:
        """Tokenize and check against the model (once), then against this server's prompt limit; the
        tenant's online tuner (which may load its saved state) when the request uses the default tree."""
        with self._tokenizer_lock:
            prepared = self.decoder.prepare(call.request)
        convert.check_prompt_length(len(prepared.ids), self.limits)
        tuner = self.tuners.get(call.tenant) if self.tuners is not None and call.request.uses_default_tree else None
        return prepared, tuner

    def _prompt_ids(self, text: str | None, messages: list[dict] | None) -> list[int]:
        with self._tokenizer_lock:
            ids = self.decoder.prompts.build(text, messages, None)
        convert.check_prompt_length(len(ids), self.limits)
        return ids

    def _engine_deadline(self, context: grpc.aio.ServicerContext) -> float | None:
        """The engine's stop time: the call's deadline less a margin of at least two recent steps."""
        remaining = context.time_remaining()
        if remaining is None:
            return None
        margin = max(self.config.deadline_margin_s, 2 * self._step_s)
        if remaining <= margin:
            raise DeadlineTooShort(
                f"only {remaining * 1000:.0f} ms of the call's deadline were left when decoding could start "
                f"(a step takes ~{self._step_s * 1000:.0f} ms now); give the call a longer deadline"
            )
        return time.monotonic() + remaining - margin
