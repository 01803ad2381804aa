"""Worker configuration: frozen, validated once in main() (or a test) and passed down."""

from __future__ import annotations

import math
import re

from dataclasses import dataclass, field

from ...engine.engine import EngineConfig
from ..common.security import ServerTLS, TenantTokens
from ..openai.reasoning_parsers import PARSERS
from ..openai.toolparse import PARSERS as TOOL_PARSERS


@dataclass(frozen=True)
class Limits:
    """What one request may ask for; larger requests are refused with INVALID_ARGUMENT."""

    max_new_tokens_cap: int = 2048  # largest max_new_tokens accepted
    default_max_new_tokens: int = 128  # used when a request leaves max_new_tokens unset
    max_prompt_tokens: int = 4096  # longest prompt (after the chat template)
    max_messages: int = 256  # chat turns in one request
    max_stop_sequences: int = 16
    max_stop_sequence_chars: int = 128  # longest stop string
    max_stop_token_ids: int = 64

    def __post_init__(self) -> None:
        for name in ("max_new_tokens_cap", "default_max_new_tokens", "max_prompt_tokens", "max_messages",
                     "max_stop_sequences", "max_stop_sequence_chars", "max_stop_token_ids"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.default_max_new_tokens > self.max_new_tokens_cap:
            raise ValueError(
                f"default_max_new_tokens ({self.default_max_new_tokens}) must be <= max_new_tokens_cap "
                f"({self.max_new_tokens_cap})"
            )

    @property
    def max_prompt_chars(self) -> int:
        """Raw text longer than this is refused before tokenizing (no real token is 32 characters on average)."""
        return 32 * self.max_prompt_tokens


# Each chat turn counts this many characters towards max_prompt_chars besides its content (the
# template's markup around it): a million empty turns are as large as they are to tokenize.
MESSAGE_OVERHEAD_CHARS = 16


@dataclass(frozen=True)
class WorkerConfig:
    host: str = "127.0.0.1"
    port: int = 50051  # 0 = any free port (the bound one is reported)
    metrics_port: int | None = 9464  # Prometheus /metrics over HTTP; 0 = any free port, None = off
    # the OpenAI-compatible HTTP API (services/openai) on the same engine; 0 = any free port, None = off
    # (the CLI's default is 8000); http_host None = `host`
    http_port: int | None = None
    http_host: str | None = None
    # browser origins the HTTP API answers cross-origin (CORS), e.g. ("https://app.example.com",);
    # "*" = any; empty (default) = none: browsers then refuse cross-origin calls
    allowed_origins: tuple[str, ...] = ()
    # the model's name to callers (OpenAI's model id, ModelInfo.model, metrics' model_name); None = --model
    served_model_name: str | None = None
    # tool_choice "auto"'s reading of replies (services/openai/toolparse.py): auto = the format the chat
    # template that renders tools teaches, hermes / llama3_json / mistral = that one, none = "auto" refused
    tool_call_parser: str = "auto"
    # The batching engine (engine/engine.py): requests decoding together in one forward per step, the
    # KV tokens they may reserve (prompt + max_new_tokens + tree each), prompt tokens prefilled per step
    max_batch: int = 16
    max_batch_tokens: int = 65536
    prefill_chunk: int = 128
    max_tenant_prompt_tokens: int = 16384  # a tenant's queued prompt tokens (engine/scheduler.py)
    max_queue: int = 16  # requests waiting for a batch place; beyond -> RESOURCE_EXHAUSTED
    # finished requests' keys and values kept for the same tenant's later prompts that start the same way
    # (engine/prefix_cache.py), MiB; 0 = off
    prefix_cache_mb: int = 512
    # Every TR request verifies its whole tree each step; default (False): trees sized per step for the
    # batch under the measured cost model (engine/drafting/budget/choose.py), down to plain one-token steps
    full_trees: bool = False
    stream_buffer: int = 256  # chunks a stream's reader may fall behind before its request is cancelled
    stream_stall_s: float = 15.0  # ...or seconds it may take none of the chunks waiting for it
    limits: Limits = Limits()
    # Work before admission is bounded: a request body larger than this is refused by gRPC itself
    # (RESOURCE_EXHAUSTED, grpc.max_receive_message_length), and beyond max_concurrent_rpcs calls of
    # Generate, GenerateStream and Tokenize in flight a new one is refused (RESOURCE_EXHAUSTED with a
    # retry hint) before anything is tokenized. Health, reflection and ModelInfo are not counted.
    max_request_bytes: int = 1 << 20
    max_concurrent_rpcs: int = 64
    # Client connections are closed after about this long (GOAWAY; clients reconnect and re-resolve, so
    # load spreads to workers the autoscaler added); calls in flight get the grace to finish. None = never.
    max_connection_age_s: float | None = 300.0
    max_connection_age_grace_s: float = 600.0
    # A gRPC deadline stops decoding this long (or two recent steps, if longer) before it, so the
    # partial result (TIME_LIMIT) reaches the caller in time.
    deadline_margin_s: float = 0.25
    grace_s: float = 10.0  # on SIGTERM: how long in-flight requests may finish
    warmup: bool = True  # one short generation before reporting SERVING
    redis_url: str | None = None  # embedded matrix store snapshots; None = memory only
    redis_password: str | None = field(default=None, repr=False)  # Redis AUTH (requirepass); None = the URL's
    # every tenant's suffix history (services/common/histories.py) in memory, in bytes; 0 = no histories
    history_bytes: int = 64 << 20
    default_tenant: str = "default"
    tls: ServerTLS | None = None  # serve TLS with this certificate; None = plaintext
    tenant_tokens: TenantTokens | None = None  # require a per-tenant bearer token; None = open
    # the HTTP API's split of chat replies into reasoning_content and content (services/openai/reasoning.py,
    # a name of services/openai/reasoning_parsers.py:PARSERS); None = none
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must be a hostname or address, e.g. 127.0.0.1 or 0.0.0.0")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535] (0 = any free port), got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535] or None (off), got {self.metrics_port}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535] or None (off), got {self.http_port}")
        if self.http_host is not None and not self.http_host:
            raise ValueError("http_host must be a hostname or address, or None for the gRPC host")
        if self.served_model_name is not None and (not self.served_model_name.strip() or
                                                   self.served_model_name != self.served_model_name.strip()):
            raise ValueError(f"served_model_name must be a name without surrounding spaces, got {self.served_model_name!r}")
        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_PARSERS)}, got {self.tool_call_parser!r}")
        for origin in self.allowed_origins:
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                raise ValueError(f"allowed origin {origin!r} must be '*' or scheme://host[:port], e.g. "
                                 "https://app.example.com (no path, no trailing slash)")
        if self.max_batch < 1 or self.max_batch_tokens < 64 or self.prefill_chunk < 1 or self.stream_buffer < 1:
            raise ValueError("max_batch, prefill_chunk and stream_buffer must be >= 1, max_batch_tokens >= 64")
        if not self.stream_stall_s > 0:
            raise ValueError(f"stream_stall_s must be > 0, got {self.stream_stall_s}")
        if not 1024 <= self.max_request_bytes <= 64 << 20:
            raise ValueError(f"max_request_bytes must be in [1024, 64 MiB], got {self.max_request_bytes}")
        if self.max_connection_age_s is not None and not 0 < self.max_connection_age_s < math.inf:
            raise ValueError(f"max_connection_age_s must be > 0 and finite, or None (never), got {self.max_connection_age_s}")
        if not 0 <= self.max_connection_age_grace_s < math.inf:
            raise ValueError(f"max_connection_age_grace_s must be >= 0, got {self.max_connection_age_grace_s}")
        if self.max_concurrent_rpcs < 1:
            raise ValueError(f"max_concurrent_rpcs must be >= 1, got {self.max_concurrent_rpcs}")
        if self.prefix_cache_mb < 0:
            raise ValueError(f"prefix_cache_mb must be >= 0 (0 = off), got {self.prefix_cache_mb}")
        if self.max_tenant_prompt_tokens < 1:
            raise ValueError(f"max_tenant_prompt_tokens must be >= 1, got {self.max_tenant_prompt_tokens}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if not 0 <= self.deadline_margin_s < 10:
            raise ValueError(f"deadline_margin_s must be in [0, 10) seconds, got {self.deadline_margin_s}")
        if not 0 <= self.grace_s < math.inf:
            raise ValueError(f"grace_s must be a finite number of seconds >= 0, got {self.grace_s}")
        if not isinstance(self.history_bytes, int) or self.history_bytes < 0:
            raise ValueError(f"history_bytes must be an int >= 0 (0 = no histories), got {self.history_bytes!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in PARSERS:
            raise ValueError(f"reasoning_parser must be one of {sorted(PARSERS)} or None, got {self.reasoning_parser!r}")

    def engine_config(self) -> EngineConfig:
        # admission (services/worker/admission.py) lets at most max_batch + max_queue reach the engine
        return EngineConfig(max_batch=self.max_batch, max_batch_tokens=self.max_batch_tokens,
                            max_waiting=self.max_batch + self.max_queue, prefill_chunk=self.prefill_chunk,
                            batch_aware=not self.full_trees, prefix_cache_mb=self.prefix_cache_mb,
                            max_tenant_prompt_tokens=self.max_tenant_prompt_tokens)
