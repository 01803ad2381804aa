"""trserve-client: the Generate API over gRPC, with nothing heavier than grpcio and protobuf."""

from trserve_client.client import Client, build_request, service_config
from trserve_client._proto.trserve.v1 import generate_pb2 as pb

__all__ = ["Client", "build_request", "pb", "service_config"]
__version__ = "0.1.0"
