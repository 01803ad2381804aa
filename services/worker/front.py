"""The worker's one way in, below both edges: the gRPC servicer (servicer.py) and the OpenAI HTTP API
(services/openai/app.py) each turn their wire format into an `Ask` (checks.py) and call the front door,
which does the rest in one place: admission, validation, the deadline, the bridge to the engine thread,
and metrics. It answers plain Python objects (engine StepChunks and GenerationResults) and raises domain
errors (core/errors.py: each names its status), which each edge maps to its own (a gRPC code; an HTTP
status with OpenAI's error body). No protobuf, no HTTP here.

Before any work: at most `max_concurrent_rpcs` calls are in flight (admission.py:Admission.call), and
checks.py:check_call checks the request against the server's limits before anything is tokenized.

Deadlines: a call's deadline (gRPC's, or HTTP's X-Request-Timeout) becomes the engine's `deadline`, early
by a margin covering the longest step the engine may be in when it passes: `deadline_margin_s`, or what
the engine measures of its own steps (engine/engine.py:BatchEngine.longest_step_s: two decoding steps, or
1.5 steps with a prefill chunk plus a decoding step; the chunk counted for the part this prompt fills
when no other prompt is being prefilled). So decoding (or a long prompt's prefill) stops in time to
return the partial result with finish_reason TIME_LIMIT. Only a call whose deadline is already (nearly)
over when it reaches the decoder is refused with DEADLINE_EXCEEDED.

Shutdown (`drain`): new calls get UNAVAILABLE; calls still running when the grace period is nearly
over are stopped: a unary call, or a stream that sent nothing yet, gets UNAVAILABLE (clients retry
elsewhere), a stream ends with a StreamEnd whose `drained` is set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

from ...core.errors import InvalidArgument, PermissionDenied, TRServeError, Unavailable
from ...engine.engine import BatchEngine
from ...engine.request.chat import ChatOptions
from ...engine.request.request import GenerationRequest, PreparedRequest
from ...engine.request.text import HeldText
from ...engine.results import GenerationResult, StepChunk
from ...engine.target import TargetModel
from ...engine.tuning.online import OnlineTuner, TunerBook
from .admission import Admission
from .bridge import EngineStream
from .checks import Ask, GenerateCall, check_call, check_prompt_length, check_prompt_size
from .config import WorkerConfig
from .drafting.embedded import DraftSourceFactory
from .metrics import WorkerMetrics

log = logging.getLogger("trserve.worker")


class DeadlineTooShort(TRServeError):
    status = "DEADLINE_EXCEEDED"


class Deadline(Protocol):
    """What the decode path needs of a call's deadline: seconds left (None: no deadline)."""

    def time_remaining(self) -> float | None: ...


@dataclass(frozen=True)
class Finished:
    """The end of one generation: its result, how long it queued, the checked call."""

    result: GenerationResult
    queue_s: float
    call: GenerateCall


@dataclass(frozen=True)
class StreamEnd(Finished):
    """The last item of FrontDoor.stream: also the text the chunks carried, and whether the worker's
    shutdown stopped it."""

    text_sent: str = ""
    drained: bool = False  # stopped by the worker's shutdown

    @property
    def rest(self) -> str:
        """Text of the result the chunks held back (a stop string's candidate prefix that was not one)."""
        return self.result.text[len(self.text_sent):] if self.result.text.startswith(self.text_sent) else ""


@dataclass(eq=False)
class _Call:
    """One admitted Generate call."""

    call: GenerateCall
    cancelled: threading.Event = field(default_factory=threading.Event)
    queue_s: float = 0.0
    drained: bool = False  # stopped by the worker's shutdown, not by its caller
    t0: float = field(default_factory=time.perf_counter)  # when the call arrived (latency metrics)


class FrontDoor:
    def __init__(self, decoder: TargetModel, engine: BatchEngine, config: WorkerConfig, draft_sources: DraftSourceFactory,
                 metrics: WorkerMetrics, tuner_states=None) -> None:
        self.decoder = decoder
        self.engine = engine
        self.config = config
        self.limits = config.limits
        self.draft_sources = draft_sources
        self.metrics = metrics
        self.admission = Admission(config.max_batch, config.max_queue, config.max_concurrent_rpcs)
        self.calls: set[_Call] = set()  # in flight, for drain()
        self.draining = False
        self.ready = False  # warmed up (server.py:_warm_up): what HTTP /health reports with `draining`
        self.model_name = config.served_model_name or decoder.config.model.source  # what callers name it
        # with tenant tokens, tenants whose matrices another tenant may not name as its domain
        self._token_tenants = frozenset(config.tenant_tokens.by_digest.values()) if config.tenant_tokens else frozenset()
        metrics.queue_depth.set_function(lambda: self.admission.waiting)  # read at scrape time
        metrics.active.set_function(lambda: self.admission.active)
        metrics.kv_usage.set_function(lambda: self.engine.reserved / config.max_batch_tokens)
        metrics.prefix_cache_bytes.set_function(lambda: self.engine.prefix.bytes if self.engine.prefix else 0)
        self._tokenizer_lock = threading.Lock()  # HF fast tokenizers are not safe to encode concurrently
        # tree "adaptive": each tenant's tree is re-tuned online from its own acceptance; with
        # `tuner_states` (load/save by tenant) the records are kept with the tenant's matrix
        self.tuners = TunerBook(decoder.new_tuner, states=tuner_states) if decoder.autotuner is not None else None

    # ---- one generation, for either edge ---------------------------------------------------------
    async def complete(self, ask: Ask, deadline: Deadline) -> Finished:
        """A whole generation."""
        with self.admission.call():
            call = self._new_call(ask)
            result = None
            async for item in self._decode(call, deadline, text=False):  # to the end: the slot is freed on exit
                if isinstance(item, GenerationResult):
                    result = item
            if result is None:
                raise RuntimeError("the engine ended without a result")
            if call.drained:
                raise Unavailable(f"the worker is shutting down: this call was stopped after "
                                  f"{len(result.ids)} tokens; retry on another worker")
            return Finished(result, call.queue_s, call.call)

    async def stream(self, ask: Ask, deadline: Deadline) -> AsyncIterator[StepChunk | StreamEnd]:
        """Step chunks whose text never shows part of a stop string too early, then a StreamEnd."""
        with self.admission.call():
            call = self._new_call(ask)
            held = HeldText(call.call.request.stop_strings)
            sent = False
            async with contextlib.aclosing(self._decode(call, deadline)) as items:
                async for item in items:
                    if isinstance(item, StepChunk):
                        sent = True
                        yield StepChunk(item.tokens, held.push(item.text), item.logprobs)
                        continue
                    if call.drained and not sent:
                        raise Unavailable("the worker is shutting down: this call was stopped before its first "
                                          "token; retry on another worker")
                    if held.rest(item.text) is None:  # sizes only: no user text in logs
                        log.warning("streamed text (%d characters) is not a prefix of the final text (%d characters)",
                                    len(held.sent), len(item.text))
                    yield StreamEnd(item, call.queue_s, call.call, held.sent, call.drained)

    async def tokenize(self, text: str | None, messages: list[dict] | None, chat: ChatOptions | None = None,
                       tools: tuple[dict, ...] | None = None) -> list[int]:
        """The ids a text or chat prompt becomes, as Generate would see them (gRPC Tokenize, HTTP /tokenize);
        `tools`: described by the chat template (gRPC ChatMessages.tools)."""
        with self.admission.call():
            check_prompt_size(text, messages, None, self.limits)
            return await asyncio.to_thread(self._prompt_ids, text, messages, chat, tools)

    async def detokenize(self, ids: list[int]) -> str:
        """The text of token ids (HTTP /detokenize); InvalidArgument for an id outside the vocabulary."""
        vocab = self.decoder.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise InvalidArgument(f"token id {bad} is outside the vocabulary [0, {vocab})")
        if len(ids) > self.limits.max_prompt_tokens + self.limits.max_new_tokens_cap:
            raise InvalidArgument(f"at most {self.limits.max_prompt_tokens + self.limits.max_new_tokens_cap} ids")
        with self.admission.call():
            return await asyncio.to_thread(self._decode_ids, ids)

    def _decode_ids(self, ids: list[int]) -> str:
        with self._tokenizer_lock:
            return self.decoder.tokenizer.decode(ids)

    # ---- warm-up -----------------------------------------------------------------------------
    async def warm_up(self) -> None:
        """One short generation through the engine (kernels, caches, first-call costs), throwaway
        matrix; its prompt is one full prefill chunk, whose step cost starts the deadline margin."""
        t0 = time.perf_counter()
        n = max(1, min(self.config.prefill_chunk, self.decoder.max_context // 2, 1024))
        token = self.decoder.tokenizer("Hello", add_special_tokens=False)["input_ids"][0]
        prepared = await asyncio.to_thread(self.decoder.prepare, GenerationRequest(input_ids=[token] * n, max_new_tokens=4))
        async with self.admission.slot():
            stream = EngineStream(asyncio.get_running_loop(), threading.Event(), self.config.stream_buffer)
            await asyncio.to_thread(self.engine.submit, prepared, stream.emit)
            async for item in stream.items():
                if isinstance(item, StepChunk):
                    break
            await stream.finish()
        log.info("warm-up done in %.1f s (a %d-token prefill chunk: %.0f ms)", time.perf_counter() - t0, n,
                 self.engine.times.chunk_s * 1000)

    # ---- shutdown ----------------------------------------------------------------------------
    async def drain(self, grace_s: float) -> None:
        """Refuse new calls; let calls in flight finish until the grace period is nearly over, then
        stop the rest so each still ends properly (see the module docstring) before gRPC cancels it."""
        self.draining = True
        loop = asyncio.get_running_loop()
        end = loop.time() + max(0.0, grace_s - min(grace_s, 2 * self._margin_s()))
        while self.calls and loop.time() < end:
            await asyncio.sleep(0.02)
        if self.calls:
            log.info("grace period nearly over: stopping %d call(s) still in flight", len(self.calls))
        for call in list(self.calls):
            call.drained = True
            call.cancelled.set()
        while self.calls and loop.time() < end + min(grace_s, 2 * self._margin_s()):
            await asyncio.sleep(0.02)

    # ---- the decode path -----------------------------------------------------------------------
    def _new_call(self, ask: Ask) -> _Call:
        if self.draining:
            raise Unavailable("the worker is shutting down; retry on another worker")
        call = _Call(check_call(ask, self.limits, self.config.default_tenant))
        c = call.call
        if c.domain is not None and c.domain != c.tenant and c.domain in self._token_tenants:
            raise PermissionDenied("the domain names another tenant: a tenant may start only from a domain that "
                                   "is not another tenant's matrix")
        return call

    async def _decode(self, call: _Call, deadline: Deadline, text: bool = True
                      ) -> AsyncIterator[StepChunk | GenerationResult]:
        """`text` False: the chunks carry no text (a unary call sends only the result's)."""
        self.calls.add(call)
        try:
            async for item in self._decode_admitted(call, deadline, text):
                yield item
        finally:
            self.calls.discard(call)

    async def _decode_admitted(self, call: _Call, deadline: Deadline, text: bool
                               ) -> AsyncIterator[StepChunk | GenerationResult]:
        prepared, tuner = await asyncio.to_thread(self._prepare, call.call)
        async with self.admission.slot() as queue_s:
            if call.drained:
                raise Unavailable("the worker is shutting down; retry on another worker")
            call.queue_s = queue_s
            self.metrics.queue_seconds.observe(queue_s)
            stop_at = self._engine_deadline(deadline, len(prepared.ids))
            stream = EngineStream(asyncio.get_running_loop(), call.cancelled, self.config.stream_buffer,
                                  self.config.stream_stall_s, self._reader_cut_off)
            c = call.call
            source = self.draft_sources(c.tenant, c.domain) if prepared.request.mode == "tr" else None
            await asyncio.to_thread(self.engine.submit, prepared, stream.emit, matrix=source,
                                    cancelled=call.cancelled.is_set, deadline=stop_at, tuner=tuner, tenant=c.tenant,
                                    text=text)
            try:
                last = None
                async for item in stream.items():
                    now = time.perf_counter()
                    if isinstance(item, StepChunk) and last is not None:  # the first chunk comes from the prefill
                        self.metrics.step_seconds.observe(now - last)
                    elif isinstance(item, StepChunk):
                        self.metrics.ttft_seconds.observe(now - call.t0)
                    last = now
                    yield item
            finally:  # also when the caller went away: the engine frees the request's place first
                result = await stream.finish()
                if result is not None:
                    self._observe_result(result, prepared.request.max_new_tokens)
                    self.metrics.e2e_seconds.observe(time.perf_counter() - call.t0)

    def _reader_cut_off(self, why: str) -> None:
        """A stream's reader fell `stream_buffer` chunks behind or took none for `stream_stall_s`:
        its request was cancelled (the engine frees its place at the next step)."""
        self.metrics.stalled_streams.labels(why).inc()
        log.info("a stream's reader %s: its request is cancelled", "fell behind" if why == "behind" else
                 f"took nothing for {self.config.stream_stall_s:g} s")

    def _observe_result(self, result: GenerationResult, max_new_tokens: int) -> None:
        m, s = self.metrics, result.stats
        m.finished.labels(result.finish_reason).inc()
        m.prompt_tokens.inc(s.prompt_tokens)
        m.prompt_cached_tokens.inc(s.cached_tokens)
        m.generated_tokens.inc(s.generated_tokens)
        m.decode_seconds.observe(s.prefill_s + s.decode_s)
        if s.generated_tokens > 1:
            m.tpot_seconds.observe(s.decode_s / (s.generated_tokens - 1))
        for source, n in s.drafted.items():
            m.drafted_tokens.labels(source).inc(n)
        for source, n in s.accepted.items():
            m.accepted_tokens.labels(source).inc(n)
        if s.draft_steps:
            m.drafts.inc(s.draft_steps)
        m.prompt_length.observe(s.prompt_tokens)
        m.generation_length.observe(s.generated_tokens)
        m.max_tokens.observe(max_new_tokens)
        if s.draft_mode != "none" and s.steps:
            m.mat.observe(s.mat)
        if s.draft_mode == "local-fallback":
            m.draft_fallbacks.inc()

    # ---- helpers -------------------------------------------------------------------------------
    def _prepare(self, call: GenerateCall) -> tuple[PreparedRequest, OnlineTuner | None]:
        """Tokenize and check against the model (once), then against this server's prompt limit; the
        tenant's online tuner (which may load its saved state) when the request uses the default tree."""
        with self._tokenizer_lock:
            prepared = self.decoder.prepare(call.request)
        check_prompt_length(len(prepared.ids), self.limits)
        tuner = self.tuners.get(call.tenant) if self.tuners is not None and call.request.uses_default_tree else None
        return prepared, tuner

    def _prompt_ids(self, text: str | None, messages: list[dict] | None, chat: ChatOptions | None,
                    tools: tuple[dict, ...] | None = None) -> list[int]:
        with self._tokenizer_lock:
            ids = self.decoder.prompts.build(text, messages, None, chat, tools)
        check_prompt_length(len(ids), self.limits)
        return ids

    def _margin_s(self, prompt_tokens: int | None = None) -> float:
        """How long the engine's longest step may take now (engine/engine.py:BatchEngine.longest_step_s),
        at least `deadline_margin_s`."""
        return max(self.config.deadline_margin_s, self.engine.longest_step_s(prompt_tokens))

    def _engine_deadline(self, deadline: Deadline, prompt_tokens: int) -> float | None:
        """The engine's stop time: the call's deadline less the margin (a step the engine may be in)."""
        remaining = deadline.time_remaining()
        if remaining is None:
            return None
        margin = self._margin_s(prompt_tokens)
        if remaining <= margin:
            raise DeadlineTooShort(
                f"only {remaining * 1000:.0f} ms of the call's deadline were left when decoding could start "
                f"(a step takes up to ~{margin * 1000:.0f} ms now); give the call a longer deadline"
            )
        return time.monotonic() + remaining - margin
