"""uvicorn serving the OpenAI-compatible API (app.py) on the worker's own event loop, beside gRPC:
the front door, its admission and the engine bridge are event-loop objects, so HTTP calls share them
directly. The socket is bound here, so a port in use is an OSError like gRPC's (not uvicorn's exit)."""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

import uvicorn

from ..common.security import ServerTLS
from .app import OpenAIApp
from ..worker.config import WorkerConfig
from ..worker.front import FrontDoor

log = logging.getLogger("trserve.openai")


@dataclass
class HttpServer:
    """A started HTTP API; `port` is the bound one."""

    server: uvicorn.Server
    sock: socket.socket
    port: int
    main: asyncio.Task

    async def stop(self) -> None:
        """Stop accepting, let responses in flight end (the worker's drain has stopped their decoding)."""
        self.server.should_exit = True
        await self.main
        await self.server.shutdown(sockets=[self.sock])


def _listen(host: str, port: int) -> socket.socket:
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} for the HTTP API ({exc.strerror or exc}); "
                      "pick another --http-port, or 0 to turn it off") from None
    sock.set_inheritable(True)
    return sock


async def front_end(door: FrontDoor, config: WorkerConfig) -> HttpServer:
    """The worker's front end for config.http_port (services/worker/server.py:FrontEndStarter)."""
    assert config.http_port is not None
    return await start_http(door, config.http_host or config.host, config.http_port, config.tls, config.grace_s)


async def start_http(door: FrontDoor, host: str, port: int, tls: ServerTLS | None,
                     grace_s: float) -> HttpServer:
    """Serve the API on host:port (TLS with the gRPC certificate when `tls` is set)."""
    sock = _listen(host, port)
    # log_config None: uvicorn's loggers go through trserve's logging setup, not a config of their own
    config = uvicorn.Config(OpenAIApp(door).asgi(), lifespan="off", log_config=None, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=max(1, int(grace_s)),
                            ssl_certfile=tls.cert_file if tls else None, ssl_keyfile=tls.key_file if tls else None)
    config.load()
    server = uvicorn.Server(config)
    server.lifespan = config.lifespan_class(config)
    await server.startup(sockets=[sock])
    main = asyncio.create_task(server.main_loop(), name="trserve-http")
    bound = sock.getsockname()[1]
    log.info("OpenAI-compatible API on %s:%d", host, bound)
    return HttpServer(server, sock, bound, main)
