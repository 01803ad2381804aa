"""Building and running a worker: `create_server` (tests bind port 0) and `serve` (the CLI's blocking main)."""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from collections.abc import Awaitable, Callable
from typing import Protocol

import grpc
from grpc_health.v1.health import aio as health_aio

from ...core.model_spec import ModelSpec
from ...core.version import __version__
from ...engine import Decoder, DecoderConfig
from ...engine.engine import BatchEngine
from ...engine.runtime import RuntimeInfo
from ...engine.tuning.cost import engine_cost
from ...matrix_store import MatrixStore, StoreConfig
from ..common.security import TenantAuth
from ..common.server import (
    add_standard_services,
    bind,
    graceful_stop,
    new_server,
    serve_until_signal,
    set_status,
)
from ..matrix.metrics import StoreCollector
from .config import WorkerConfig
from .drafting.embedded import DraftSourceFactory, embedded_factory
from ..common.histories import HistoryBook, HistoryCollector
from .drafting.split import MatrixServiceSources, watch_matrix_auth
from .metrics import WorkerMetrics
from .front import FrontDoor
from .servicer import GenerateServicer
from ...v1 import generate_pb2, generate_pb2_grpc

log = logging.getLogger("trserve.worker")
MAX_REPLY_BYTES = 16 << 20  # largest reply a worker sends (requests: WorkerConfig.max_request_bytes)

SERVICE_NAME = generate_pb2.DESCRIPTOR.services_by_name["Generate"].full_name  # "trserve.v1.Generate"


class FrontEnd(Protocol):
    """Another API over the worker's front door on a port of its own (services/openai's HTTP API), given
    to `create_server` by the process that composes them (services/node/cli.py): the worker never
    imports one. Started with the worker; its calls drain with the gRPC ones; stopped before the engine."""

    port: int

    async def stop(self) -> None: ...


FrontEndStarter = Callable[[FrontDoor, WorkerConfig], Awaitable[FrontEnd]]  # for config.http_port


@dataclass
class Worker:
    """A started worker. `ready` completes once warm-up is done and health says SERVING."""

    server: grpc.aio.Server
    port: int
    metrics_port: int | None  # None when metrics are off
    health: health_aio.HealthServicer
    servicer: GenerateServicer  # the gRPC edge of `door`
    metrics: WorkerMetrics
    store: MatrixStore | None  # the embedded store; None when a draft_source_factory was given
    ready: asyncio.Task
    executor: ThreadPoolExecutor
    engine: BatchEngine
    engine_loop: asyncio.Future  # the engine thread's run(), on `executor`
    histories: HistoryBook | None = None  # the embedded store's tenants' suffix histories; None when off
    http: FrontEnd | None = None  # the OpenAI-compatible HTTP API (services/openai); None when off

    @property
    def door(self) -> FrontDoor:
        """The one way in below both APIs (front.py): admission, validation, deadline, the engine bridge."""
        return self.servicer.door

    @property
    def http_port(self) -> int | None:
        return self.http.port if self.http is not None else None

    async def stop(self, grace_s: float | None = None) -> None:
        """NOT_SERVING, drain in-flight calls for `grace_s` (None: the config's grace_s; calls still
        running near its end are stopped, each ending with a final status), then release everything."""
        await graceful_stop(self.server, self.health, self.door.config.grace_s if grace_s is None else grace_s,
                            self.door.drain)
        await self.close()

    async def close(self) -> None:
        """After the server stopped: end warm-up, save the tuners, snapshot the store (if Redis), stop /metrics."""
        if not self.ready.done():
            self.ready.cancel()
        if self.http is not None:  # its calls were drained with the gRPC ones
            await self.http.stop()
        self.engine.stop()  # anything still in it ends as cancelled
        await self.engine_loop
        await asyncio.to_thread(self.executor.shutdown, wait=True)
        if self.door.tuners is not None:
            await asyncio.to_thread(self.door.tuners.save_all)
        if self.histories is not None:  # before the store's final snapshot: histories are its side state
            await asyncio.to_thread(self.histories.close)
        if self.store is not None:
            await asyncio.to_thread(self.store.close)
        self.metrics.stop_http()


async def create_server(config: WorkerConfig, decoder: Decoder | None = None, *,
                        decoder_config: DecoderConfig | None = None,
                        draft_source_factory: DraftSourceFactory | None = None,
                        front_end: FrontEndStarter | None = None) -> Worker:
    """Start a worker on config.host:config.port (0 = any free port), NOT_SERVING until warm.

    `decoder`: a loaded Decoder to serve (else one is loaded from `decoder_config`).
    `draft_source_factory(tenant, domain)`: where TR drafts come from; default = an embedded
    MatrixStore (Redis snapshots when config.redis_url is set).
    `front_end`: what serves config.http_port (services/openai/server.py:front_end); required with it.
    """
    if config.http_port is not None and front_end is None:
        raise ValueError("http_port is set but no front end was given to serve it "
                         "(create_server(..., front_end=trserve.services.openai.server.front_end))")
    # Model loading and the decode loop (every forward) run on this executor's one thread: forwards from
    # two threads give two OpenMP thread teams fighting over the cores (measured: ~30% slower decoding).
    # Not everything torch does is here: callers' engine.submit (a request's sampler, its draft session's
    # matrix checkout) and tokenizing run in the default executor's threads, small tensor work only.
    executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trserve-engine")
    loop = asyncio.get_running_loop()
    if decoder is None:
        decoder = await loop.run_in_executor(executor, Decoder, decoder_config or DecoderConfig())
    engine = BatchEngine(decoder, config.engine_config(), engine_cost(decoder))
    engine_loop = loop.run_in_executor(executor, engine.run)
    started = _Started(executor, engine, engine_loop)
    try:
        return await _start_serving(config, decoder, draft_source_factory, started, front_end)
    except BaseException:
        # A port in use, a bad Redis URL, ...: stop whatever started (the engine thread would otherwise
        # keep the process alive with its ports bound), so the caller's error ends the process.
        await started.stop()
        raise


@dataclass
class _Started:
    """What create_server has started so far, to stop when a later step fails."""

    executor: ThreadPoolExecutor
    engine: BatchEngine
    engine_loop: asyncio.Future
    store: MatrixStore | None = None
    server: grpc.aio.Server | None = None
    http: FrontEnd | None = None
    metrics: WorkerMetrics | None = None

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)
        if self.http is not None:
            await self.http.stop()
        if self.metrics is not None:
            self.metrics.stop_http()
        self.engine.stop()
        await self.engine_loop
        await asyncio.to_thread(self.executor.shutdown, wait=True)
        if self.store is not None:
            await asyncio.to_thread(self.store.close)


async def _start_serving(config: WorkerConfig, decoder: Decoder, draft_source_factory: DraftSourceFactory | None,
                         started: _Started, front_end: FrontEndStarter | None) -> Worker:
    """The rest of create_server once the engine thread runs; each thing it starts is recorded in `started`."""
    engine = started.engine
    store = tuner_states = histories = None
    if draft_source_factory is None:
        store = started.store = MatrixStore(StoreConfig(redis_url=config.redis_url, redis_password=config.redis_password))
        store.start()
        spec = ModelSpec(decoder.fingerprint, decoder.vocab_size, decoder.config.k)
        histories = HistoryBook(store, config.history_bytes) if config.history_bytes else None
        draft_source_factory = embedded_factory(store, spec, decoder.device, histories)
        tuner_states = StoreTunerStates(store, decoder.fingerprint)
    name = config.served_model_name or decoder.config.model.source
    metrics = started.metrics = WorkerMetrics(name)
    if store is not None:  # the embedded store's memory (tenants, bytes per tenant) on this worker's /metrics
        metrics.registry.register(StoreCollector(store))
    if histories is not None:  # and the tenants' suffix histories (bytes per tenant)
        metrics.registry.register(HistoryCollector(histories))
    runtime = RuntimeInfo.of(decoder)
    metrics.build.info({"model": name, "version": __version__, **runtime.labels()})
    door = FrontDoor(decoder, engine, config, draft_source_factory, metrics, tuner_states)
    servicer = GenerateServicer(door)
    tool_format, reasoning = servicer.parsers
    log.info("serving %s: %s, batches of up to %d; tool calls: %s, reasoning parser: %s", name, runtime,
             config.max_batch, tool_format or "none", reasoning or "none")

    auth = [TenantAuth(config.tenant_tokens, config.default_tenant)] if config.tenant_tokens is not None else []
    server = started.server = new_server(MAX_REPLY_BYTES, interceptors=auth, max_receive_bytes=config.max_request_bytes,
                                         max_connection_age_s=config.max_connection_age_s,
                                         max_connection_age_grace_s=config.max_connection_age_grace_s)
    generate_pb2_grpc.add_GenerateServicer_to_server(servicer, server)
    health = add_standard_services(server, [SERVICE_NAME])
    port = bind(server, config.host, config.port, config.tls)
    http = started.http = await front_end(door, config) if front_end is not None and config.http_port is not None \
        else None
    metrics_port = metrics.serve_http(config.host, config.metrics_port) if config.metrics_port is not None else None
    await set_status(health, [SERVICE_NAME], serving=False)
    await server.start()
    ready = asyncio.create_task(_warm_up(door, health, config.warmup), name="trserve-warmup")
    return Worker(server, port, metrics_port, health, servicer, metrics, store, ready, started.executor, engine,
                  started.engine_loop, histories, http)


class StoreTunerStates:
    """Online tuners' records per tenant, kept by the embedded matrix store next to the tenant's
    matrix (and in Redis with it when the store has Redis)."""

    def __init__(self, store: MatrixStore, fingerprint: str) -> None:
        self.store, self.fingerprint = store, fingerprint

    def load(self, tenant: str) -> bytes | None:
        return self.store.side_state("tuner", self.fingerprint, tenant)

    def save(self, tenant: str, blob: bytes) -> None:
        self.store.save_side_state("tuner", self.fingerprint, tenant, blob)


class WarmUpFailed(RuntimeError):
    """The warm-up generation failed: the worker was closed; its command exits 1 with this message."""


async def _warm_up(door: FrontDoor, health: health_aio.HealthServicer, enabled: bool) -> None:
    if enabled:
        await door.warm_up()
    door.ready = True
    await set_status(health, [SERVICE_NAME], serving=True)


async def run(config: WorkerConfig, decoder_config: DecoderConfig, sources: MatrixServiceSources | None = None,
              front_end: FrontEndStarter | None = None) -> None:
    """Serve until a signal; `sources` = a split worker's drafts from the matrix service (else embedded);
    `front_end`: what serves config.http_port (as create_server)."""
    worker = await create_server(config, decoder_config=decoder_config, draft_source_factory=sources,
                                 front_end=front_end)
    try:
        await worker.ready
    except Exception as e:  # noqa: BLE001 - a worker that cannot decode must not sit there unready: exit
        log.exception("warm-up failed")
        await worker.server.stop(0)
        await worker.close()
        if sources is not None:
            await asyncio.to_thread(sources.close)
        raise WarmUpFailed(f"the warm-up generation failed ({type(e).__name__}: {e}); this worker cannot serve "
                           "(the log above has the traceback)") from None
    if sources is not None:
        log.info("drafting through the matrix service at %s (%s mode)", sources.config.matrix_addr,
                 sources.config.draft_mode)
    print(f"trserve listening on {config.host}:{worker.port}", flush=True)
    if worker.http is not None:
        scheme = "https" if config.tls is not None else "http"
        print(f"trserve OpenAI API on {scheme}://{config.http_host or config.host}:{worker.http.port}/v1", flush=True)
    if worker.metrics_port is not None:
        print(f"trserve metrics on http://{config.host}:{worker.metrics_port}/metrics", flush=True)

    # A split worker whose matrix service refuses its secret says NOT_SERVING for Generate (not a silent
    # fallback): readiness takes it out of rotation; the server's own health ("", liveness) stays SERVING,
    # so it is not restarted for a secret a restart cannot fix.
    watcher = asyncio.create_task(watch_matrix_auth(
        sources, lambda ok: set_status(worker.health, [SERVICE_NAME], ok, overall=False))) if sources is not None else None

    async def stop() -> None:
        if watcher is not None:
            watcher.cancel()
        await worker.close()
        if sources is not None:
            await asyncio.to_thread(sources.close)

    await serve_until_signal(worker.server, worker.health, config.grace_s, on_stop=stop, drain=worker.door.drain)


def serve(config: WorkerConfig, decoder_config: DecoderConfig, sources: MatrixServiceSources | None = None,
          front_end: FrontEndStarter | None = None) -> int:
    """Blocking: serve until SIGTERM/SIGINT, then drain gracefully."""
    asyncio.run(run(config, decoder_config, sources, front_end))
    return 0
