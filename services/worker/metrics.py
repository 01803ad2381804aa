"""Prometheus metrics of one worker, in a registry of its own (several workers may share a process in tests)."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)

MAT_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0)
# latency buckets past 10 s: long generations on CPUs take minutes (names and shapes close to vLLM's)
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)
STEP_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("trserve_requests", "Finished RPCs by method and gRPC status code",
                                ["method", "code"], registry=r)
        self.finished = Counter("trserve_finish", "Generations by finish reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("trserve_prompt_tokens", "Prompt tokens (prefilled or from the prefix cache)",
                                     registry=r)
        self.generated_tokens = Counter("trserve_generated_tokens", "Tokens generated", registry=r)
        self.prompt_cached_tokens = Counter(
            "trserve_prompt_cached_tokens", "Prompt tokens whose keys and values came from the prefix cache "
            "(an earlier request of the same tenant that started the same way) instead of a prefill", registry=r)
        self.prefix_cache_bytes = Gauge("trserve_prefix_cache_bytes",
                                        "Bytes of finished requests' keys and values kept for prefix caching",
                                        registry=r)
        self.mat = Histogram("trserve_mean_accepted_tokens", "Mean accepted tokens per step, per TR request",
                             buckets=MAT_BUCKETS, registry=r)
        self.step_seconds = Histogram("trserve_step_seconds", "Wall time of one decoding step",
                                      buckets=STEP_BUCKETS, registry=r)
        self.decode_seconds = Histogram("trserve_decode_seconds", "Prefill + decode wall time per request", registry=r)
        self.queue_seconds = Histogram("trserve_queue_seconds", "Time waiting for admission", registry=r)
        self.queue_depth = Gauge("trserve_queue_depth", "Requests waiting for the decoder", registry=r)
        self.active = Gauge("trserve_active_requests", "Requests decoding now", registry=r)
        self.draft_fallbacks = Counter(
            "trserve_draft_fallbacks",
            "Requests that drafted from a local matrix because the matrix store/service failed", registry=r)
        self.ttft_seconds = Histogram("trserve_time_to_first_token_seconds",
                                      "From the call's arrival to its first token (queue and prefill included)",
                                      buckets=TTFT_BUCKETS, registry=r)
        self.tpot_seconds = Histogram("trserve_time_per_output_token_seconds",
                                      "Decode time per generated token after the first, per request",
                                      buckets=TPOT_BUCKETS, registry=r)
        self.e2e_seconds = Histogram("trserve_e2e_request_latency_seconds",
                                     "From the call's arrival to its last token", buckets=LATENCY_BUCKETS, registry=r)
        self.kv_usage = Gauge("trserve_kv_cache_usage_ratio",
                              "KV tokens reserved by running requests over --max-batch-tokens", registry=r)
        self.drafted_tokens = Counter("trserve_draft_tokens", "Draft tokens verified, by draft source "
                                      "(matrix, context, history)", ["source"], registry=r)
        self.accepted_tokens = Counter("trserve_draft_accepted_tokens", "Draft tokens accepted, by draft source",
                                       ["source"], registry=r)
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        PlatformCollector(registry=r)
        self.stalled_streams = Counter(
            "trserve_stalled_streams", "Streams cancelled because the reader fell behind (behind) or took no "
            "chunk for stream_stall_s (stalled)", ["reason"], registry=r)
        # trserve_build_info{device, kernels, attention, tree, threads, model} 1: what this worker runs on
        self.build = Info("trserve_build", "What this worker decodes with", registry=r)
        self._http = None

    def serve_http(self, host: str, port: int) -> int:
        """Expose /metrics on host:port (0 = any free port); returns the bound port."""
        try:
            self._http, _ = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise OSError(f"cannot serve metrics on {host}:{port} ({e.strerror or e}); "
                          "pick another --metrics-port, 0 (any free port) or -1 (off)") from None
        return int(self._http.server_port)

    def stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """Current value of a sample (0 when absent), for tests and logs."""
        return self.registry.get_sample_value(name, labels or {}) or 0.0
