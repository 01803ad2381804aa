"""The matrix service process: a grpc.aio server around one MatrixStore.

`create_server(config)` builds and binds (port 0 = any free port) without serving, so tests and
embedding callers control the lifecycle; `serve(config)` runs until SIGTERM/SIGINT, then drains
in-flight calls and writes the final snapshots (`MatrixStore.close`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
from grpc_health.v1.health import aio as health_aio

from ...matrix_store import MatrixStore, StoreConfig
from ..common.histories import HistoryBook
from ..common.security import ServerTLS, SharedSecret, SharedSecretAuth, is_loopback
from ..common.server import add_standard_services, bind, new_server, serve_until_signal, set_status
from .metrics import serve_metrics
from .servicer import ADMIN_METHODS, SERVICE_NAME, MatrixServicer, ServicerLimits, add_to_server

log = logging.getLogger("trserve.matrix")


@dataclass(frozen=True)
class MatrixServiceConfig:
    host: str = "127.0.0.1"  # loopback unless asked: compose, k8s and the images pass --host 0.0.0.0
    port: int = 50052  # 0 = any free port (printed at start)
    store: StoreConfig = field(default_factory=StoreConfig)
    limits: ServicerLimits = field(default_factory=ServicerLimits)
    grace_s: float = 5.0  # in-flight calls get this long to finish on shutdown
    # Largest request/reply: a full PushRows batch (4096 rows at K=64, ids and probs) is ~1.3 MB; a
    # Checkout chunk of 65536 rows at K=8 is ~2.9 MB. Bigger messages are refused by gRPC itself.
    max_message_bytes: int = 4 * 1024 * 1024
    tls: ServerTLS | None = None  # serve TLS with this certificate; None = plaintext
    secret: SharedSecret | None = None  # workers' secret: DraftSession, Checkout, PushRows; None = open
    admin_secret: SharedSecret | None = None  # admin RPCs need it (the worker secret does not suffice)
    metrics_port: int | None = None  # Prometheus /metrics of the store (memory per tenant); None = off
    # Without a model list (store.models) the service serves the first `max_models` models any caller
    # names: whoever reaches it first can fill that list and lock the real model out. That is allowed
    # on loopback or behind the workers' secret; anywhere else only when asked for (--open-registration).
    open_registration: bool = False
    # Beyond loopback without the workers' secret, anyone who reaches the port reads every tenant's
    # matrix and its history (recent prompts and outputs, as token ids) and writes rows into any
    # tenant: refused at start unless this says the network itself is the boundary (--insecure-no-secret).
    insecure_no_secret: bool = False
    # the tenants' suffix histories it hands replica workers (GetHistory, PushHistory), in memory, in
    # bytes (LRU beyond; saved as side state with the matrix); 0 = it keeps none
    history_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if not isinstance(self.history_bytes, int) or self.history_bytes < 0:
            raise ValueError(f"history_bytes must be an int >= 0 (0 = no histories), got {self.history_bytes!r}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535 (0 = any free port), got {self.port}")
        if self.grace_s < 0:
            raise ValueError(f"grace_s must be >= 0, got {self.grace_s}")
        if self.max_message_bytes < 64 * 1024:
            raise ValueError(f"max_message_bytes must be >= 65536, got {self.max_message_bytes}")
        if self.secret is not None and self.admin_secret is not None and self.admin_secret.value == self.secret.value:
            raise ValueError("the admin secret must differ from the worker secret")
        if self.secret is None and not self.insecure_no_secret and not is_loopback(f"{self.host}:0"):
            raise ValueError(
                f"a matrix service on {self.host} without the workers' secret would hand anyone who reaches it "
                "every tenant's matrix and history (recent prompts and outputs) and take rows into any tenant: "
                "pass --secret-file (the workers pass the same file as --matrix-secret-file), or listen on "
                "loopback, or --insecure-no-secret where the network alone decides who reaches the port")
        if (not self.store.models and self.secret is None and not self.open_registration
                and not is_loopback(f"{self.host}:0")):
            raise ValueError(
                f"an open matrix service on {self.host} without --model would serve the first "
                f"{self.store.max_models} models anyone who reaches it names, so a stranger could lock your model "
                "out: pass --model (the workers' model: a builtin name or directory, or FINGERPRINT:V:K as "
                "`trserve model-spec` prints it), or --secret-file, or --open-registration to accept that")


@dataclass
class MatrixServer:
    """A bound, not yet started matrix service. `start()` serves; `stop()` drains and snapshots."""

    server: grpc.aio.Server
    port: int
    health: health_aio.HealthServicer
    store: MatrixStore
    owns_store: bool  # stop() closes (final snapshots) only a store it created
    metrics_http: object | None = None  # the /metrics HTTP server, when metrics_port is set
    metrics_port: int | None = None
    servicer: MatrixServicer | None = None
    histories: HistoryBook | None = None

    async def start(self) -> None:
        await set_status(self.health, [SERVICE_NAME], serving=False)  # health answers before the store is up
        await self.server.start()
        self.store.start()
        await set_status(self.health, [SERVICE_NAME], serving=True)
        log.info("matrix service serving on port %d (redis: %s)", self.port, self.store.health()["redis"])

    async def stop(self, grace_s: float | None = 0, final_snapshot: bool = True) -> None:
        """NOT_SERVING, stop (grace_s: let in-flight calls finish; 0 = cancel them), close the store."""
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace_s)
        if self.metrics_http is not None:
            self.metrics_http.shutdown()
            self.metrics_http.server_close()
            self.metrics_http = None
        await asyncio.to_thread(self.close_store, final_snapshot)

    def close_store(self, final_snapshot: bool = True) -> None:
        """Save the histories (side state of the store), then close the store if this server made it."""
        if self.histories is not None:
            self.histories.close()
        if self.owns_store:
            self.store.close(final_snapshot)


def create_server(config: MatrixServiceConfig, store: MatrixStore | None = None) -> MatrixServer:
    """Build the server (health NOT_SERVING, reflection, bounded messages) and bind it. Must be
    called with an event loop running (grpc.aio)."""
    owns = store is None
    store = store if store is not None else MatrixStore(config.store)
    secured = config.secret is not None or config.admin_secret is not None
    auth = [SharedSecretAuth(config.secret, config.admin_secret, ADMIN_METHODS)] if secured else []
    if config.admin_secret is None:
        log.warning("no admin secret: admin RPCs are %s, and reserved tenants (_global, _domain.*) cannot be written",
                    "refused" if config.secret is not None else "open to anyone who reaches this port")
    server = new_server(config.max_message_bytes, interceptors=auth)
    histories = HistoryBook(store, config.history_bytes) if config.history_bytes else None
    servicer = MatrixServicer(store, config.limits, admin_secured=config.admin_secret is not None, histories=histories)
    add_to_server(servicer, server)
    health = add_standard_services(server, [SERVICE_NAME])
    port = bind(server, config.host, config.port, config.tls)
    running = MatrixServer(server, port, health, store, owns, servicer=servicer, histories=histories)
    if config.metrics_port is not None:
        running.metrics_http, running.metrics_port = serve_metrics(store, config.host, config.metrics_port, histories)
    return running


async def serve(config: MatrixServiceConfig) -> None:
    running = create_server(config)
    await running.start()
    print(f"matrix service listening on {config.host}:{running.port}", flush=True)
    if running.metrics_port is not None:
        print(f"matrix service metrics on http://{config.host}:{running.metrics_port}/metrics", flush=True)
    await serve_until_signal(running.server, running.health, config.grace_s,
                             on_stop=lambda: asyncio.to_thread(running.close_store, True))
