"""trserve-client: the Generate API over gRPC, with nothing heavier than grpcio and protobuf."""

from trserve_client._proto.trserve.v1 import generate_pb2 as pb
from trserve_client.aio import AsyncClient
from trserve_client.balanced import BalancedClient, Served, rendezvous
from trserve_client.client import (
    Chunk,
    Client,
    Reply,
    Stream,
    build_request,
    channel_options,
    finish_reason_name,
    service_config,
)
from trserve_client.errors import (
    Busy,
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ServerError,
    TRServeError,
    Unauthenticated,
    Unavailable,
)

__all__ = ["AsyncClient", "BalancedClient", "Busy", "Cancelled", "Chunk", "Client", "DeadlineExceeded",
           "InvalidArgument", "NotFound", "PermissionDenied", "Reply", "Served", "ServerError", "Stream",
           "TRServeError", "Unauthenticated", "Unavailable", "build_request", "channel_options",
           "finish_reason_name", "pb", "rendezvous", "service_config"]
__version__ = "0.2.0"
