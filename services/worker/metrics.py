"""Prometheus metrics of one worker, in a registry of its own (several workers may share a process in tests).

Request series carry a `model_name` label (vLLM's name; the served model's id), so dashboards built
for vLLM's series select ours the same way. Code uses them as if the label were not there: a family
whose only label is model_name is bound to its child at construction, and `_Named` prepends the
model to the other labels."""

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
# request lengths in tokens (vLLM's request_prompt_tokens / request_generation_tokens / request_params_max_tokens)
LENGTH_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
MODEL = "model_name"


class _Named:
    """A family labelled (model_name, *rest), used as one labelled (*rest)."""

    def __init__(self, family, model: str) -> None:
        self.family, self.model = family, model

    def labels(self, *values: str):
        return self.family.labels(self.model, *values)


class WorkerMetrics:
    def __init__(self, model_name: str = "unknown") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r, named = self.registry, self._named
        self.requests = named(Counter, "trserve_requests", "Finished calls by method and gRPC status code "
                              "(HTTP calls by the status their failure has over gRPC)", ("method", "code"))
        self.finished = named(Counter, "trserve_finish", "Generations by finish reason", ("reason",))
        self.prompt_tokens = named(Counter, "trserve_prompt_tokens",
                                   "Prompt tokens (prefilled or from the prefix cache)")
        self.generated_tokens = named(Counter, "trserve_generated_tokens", "Tokens generated")
        self.prompt_cached_tokens = named(
            Counter, "trserve_prompt_cached_tokens", "Prompt tokens whose keys and values came from the prefix "
            "cache (an earlier request of the same tenant that started the same way) instead of a prefill")
        self.prefix_cache_bytes = Gauge("trserve_prefix_cache_bytes",
                                        "Bytes of finished requests' keys and values kept for prefix caching",
                                        registry=r)
        self.mat = named(Histogram, "trserve_mean_accepted_tokens", "Mean accepted tokens per step, per TR request",
                         buckets=MAT_BUCKETS)
        self.step_seconds = Histogram("trserve_step_seconds", "Wall time of one decoding step",
                                      buckets=STEP_BUCKETS, registry=r)
        self.decode_seconds = named(Histogram, "trserve_decode_seconds", "Prefill + decode wall time per request")
        self.queue_seconds = named(Histogram, "trserve_queue_seconds", "Time waiting for admission")
        self.queue_depth = named(Gauge, "trserve_queue_depth", "Requests waiting for the decoder")
        self.active = named(Gauge, "trserve_active_requests", "Requests decoding now")
        self.draft_fallbacks = Counter(
            "trserve_draft_fallbacks",
            "Requests that drafted from a local matrix because the matrix store/service failed", registry=r)
        self.ttft_seconds = named(Histogram, "trserve_time_to_first_token_seconds",
                                  "From the call's arrival to its first token (queue and prefill included)",
                                  buckets=TTFT_BUCKETS)
        self.tpot_seconds = named(Histogram, "trserve_time_per_output_token_seconds",
                                  "Decode time per generated token after the first, per request", buckets=TPOT_BUCKETS)
        self.e2e_seconds = named(Histogram, "trserve_e2e_request_latency_seconds",
                                 "From the call's arrival to its last token", buckets=LATENCY_BUCKETS)
        self.prompt_length = named(Histogram, "trserve_request_prompt_tokens", "Prompt tokens per finished request",
                                   buckets=LENGTH_BUCKETS)
        self.generation_length = named(Histogram, "trserve_request_generation_tokens",
                                       "Generated tokens per finished request", buckets=LENGTH_BUCKETS)
        self.max_tokens = named(Histogram, "trserve_request_max_tokens",
                                "The max_new_tokens (max_tokens) each finished request asked for", buckets=LENGTH_BUCKETS)
        self.kv_usage = named(Gauge, "trserve_kv_cache_usage_ratio",
                              "KV tokens reserved by running requests over --max-batch-tokens")
        self.drafted_tokens = named(Counter, "trserve_draft_tokens", "Draft tokens verified, by draft source "
                                    "(matrix, context, history)", ("source",))
        self.accepted_tokens = named(Counter, "trserve_draft_accepted_tokens", "Draft tokens accepted, by draft "
                                     "source", ("source",))
        self.drafts = named(Counter, "trserve_drafts", "Steps that verified at least one draft token (vLLM's "
                            "spec_decode_num_drafts): mean acceptance length = 1 + accepted tokens / drafts")
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        PlatformCollector(registry=r)
        self.stalled_streams = Counter(
            "trserve_stalled_streams", "Streams cancelled because the reader fell behind (behind) or took no "
            "chunk for stream_stall_s (stalled)", ["reason"], registry=r)
        # trserve_build_info{device, kernels, attention, tree, threads, model} 1: what this worker runs on
        self.build = Info("trserve_build", "What this worker decodes with", registry=r)
        self._http = None

    def _named(self, kind, name: str, doc: str, labels: tuple[str, ...] = (), **kwargs):
        """A family labelled model_name (+ labels), bound to this worker's model."""
        family = kind(name, doc, [MODEL, *labels], registry=self.registry, **kwargs)
        return _Named(family, self.model_name) if labels else family.labels(self.model_name)

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
        """Current value of a sample (0 when absent), for tests and logs; this worker's model_name is
        implied on the families that have it."""
        labels = labels or {}
        named = self.registry.get_sample_value(name, {MODEL: self.model_name, **labels})
        return named if named is not None else self.registry.get_sample_value(name, labels) or 0.0
