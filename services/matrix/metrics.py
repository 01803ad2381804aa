"""Prometheus metrics of a MatrixStore, read at scrape time (memory only, never Redis): tenants in
memory and their bound, bytes per tenant and in all (ids and confidences: V x K x 5 per tenant),
side state. Used by `trserve matrix --metrics-port` and registered in an embedded worker's /metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ...matrix_store import MatrixStore


class StoreCollector(Collector):
    def __init__(self, store: MatrixStore) -> None:
        self._store = store

    def collect(self):
        health = self._store.health_in_memory()
        yield GaugeMetricFamily("trserve_matrix_tenants_in_memory", "Tenants whose matrix is in memory",
                                value=health["tenants_in_memory"])
        yield GaugeMetricFamily("trserve_matrix_max_tenants_in_memory", "The bound on tenants in memory",
                                value=health["max_tenants_in_memory"])
        yield GaugeMetricFamily("trserve_matrix_memory_bytes",
                                "Bytes of every tenant's matrix (ids and confidences) in memory",
                                value=health["memory_bytes"])
        per = GaugeMetricFamily("trserve_matrix_tenant_memory_bytes",
                                "Bytes of one tenant's matrix (ids and confidences) in memory",
                                labels=["fingerprint", "tenant"])
        for fingerprint, tenant, nbytes in self._store.memory():
            per.add_metric([fingerprint, tenant], nbytes)
        yield per
        blobs, nbytes = self._store.side_state_counts()
        yield GaugeMetricFamily("trserve_matrix_side_states", "Side-state blobs (tuner records) in memory", value=blobs)
        yield GaugeMetricFamily("trserve_matrix_side_state_bytes", "Bytes of side state in memory", value=nbytes)


def serve_metrics(store: MatrixStore, host: str, port: int, histories=None):
    """Expose /metrics for `store` (and `histories`, a HistoryBook) on host:port (0 = any free port);
    returns (http server, port)."""
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    if histories is not None:
        from ..common.histories import HistoryCollector

        registry.register(HistoryCollector(histories))
    try:
        server, _ = start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise OSError(f"cannot serve metrics on {host}:{port} ({e.strerror or e}); pick another --metrics-port") from None
    return server, int(server.server_port)
