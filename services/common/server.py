"""What every trserve gRPC server gets: health, reflection, bounded messages, optional TLS and auth
interceptors (services/common/security.py), graceful stop."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from .security import ServerTLS

log = logging.getLogger("trserve.services")

def new_server(max_message_bytes: int,
               interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
               max_receive_bytes: int | None = None, max_connection_age_s: float | None = None,
               max_connection_age_grace_s: float | None = None) -> grpc.aio.Server:
    """`max_receive_bytes` (default `max_message_bytes`): larger requests are refused by gRPC with
    RESOURCE_EXHAUSTED before any handler runs. `max_connection_age_s`: a client connection is closed
    (GOAWAY: the client reconnects, and re-resolves, so it reaches replicas added since) after about
    this long; calls in flight then get `max_connection_age_grace_s` to finish. None = never."""
    options = [
        ("grpc.max_receive_message_length", max_receive_bytes or max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]
    if max_connection_age_s is not None:
        options.append(("grpc.max_connection_age_ms", int(max_connection_age_s * 1000)))
        if max_connection_age_grace_s is not None:
            options.append(("grpc.max_connection_age_grace_ms", int(max_connection_age_grace_s * 1000)))
    return grpc.aio.server(options=options, interceptors=list(interceptors))


def add_standard_services(server: grpc.aio.Server, service_names: list[str]) -> health_aio.HealthServicer:
    """Health (every service NOT_SERVING until `set_serving`) and reflection for `service_names`."""
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection([*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                         reflection.SERVICE_NAME], server)
    return health


async def set_status(health: health_aio.HealthServicer, service_names: list[str], serving: bool,
                     overall: bool = True) -> None:
    """The health of `service_names` and, with `overall`, of the server ("": liveness probes ask that one;
    readiness probes ask a named service, which alone goes NOT_SERVING when the process is alive but
    should leave rotation)."""
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in (["", *service_names] if overall else service_names):
        await health.set(name, status)


def bind(server: grpc.aio.Server, host: str, port: int, tls: ServerTLS | None = None) -> int:
    """Bind host:port (port 0 = any free port), with TLS when `tls` is given; returns the bound port."""
    addr = f"{host}:{port}"
    try:
        bound = server.add_insecure_port(addr) if tls is None else server.add_secure_port(addr, tls.credentials())
    except RuntimeError:  # newer grpcio raises where older ones returned 0
        bound = 0
    if bound == 0:
        raise OSError(f"cannot listen on {host}:{port} (in use or not allowed); pick another --port or 0")
    return bound


async def graceful_stop(server: grpc.aio.Server, health: health_aio.HealthServicer, grace_s: float,
                        drain=None) -> None:
    """NOT_SERVING, then stop: in-flight calls have `grace_s`, after which gRPC cancels them.
    `drain(grace_s)` (a coroutine function) runs meanwhile, to end the calls itself before that."""
    await health.enter_graceful_shutdown()
    stopping = asyncio.ensure_future(server.stop(grace_s))
    if drain is not None:
        try:
            await drain(grace_s)
        except Exception:  # noqa: BLE001 - stopping goes on
            log.exception("draining failed")
    await stopping


async def serve_until_signal(server: grpc.aio.Server, health: health_aio.HealthServicer, grace_s: float,
                             on_stop=None, drain=None) -> None:
    """Run until SIGTERM/SIGINT, then: NOT_SERVING, drain in-flight calls for `grace_s` (see
    `graceful_stop`), run `on_stop`."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: draining for up to %.1f s", grace_s)
    await graceful_stop(server, health, grace_s, drain)
    if on_stop is not None:
        result = on_stop()
        if asyncio.iscoroutine(result):
            await result
    log.info("stopped")
