"""`trserve serve` (embedded all-in-one: worker + in-process matrix store) and `trserve worker`
(a stateless worker of a split deployment, drafting through `trserve matrix`)."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the Generate API (embedded: worker + in-process matrix store)",
                       description="Serve the Generate API with an in-process matrix store (Redis only with --redis-url).")
    _add_worker_flags(p)
    from ..common.argtypes import redis_url

    p.add_argument("--redis-url", default=None, type=redis_url, help="snapshot tenant matrices to this Redis (redis://host:6379/0)")
    p.add_argument("--redis-password-file", default=None, help="file holding Redis' password (its requirepass)")
    p.set_defaults(func=run_serve)

    w = sub.add_parser("worker", help="serve the Generate API, drafting through a matrix service (split deployment)",
                       description="A stateless worker: tenant matrices live in the matrix service (`trserve matrix`). "
                                   "If it is unreachable, requests still complete, drafting locally (counted in metrics).")
    w.add_argument("--matrix-addr", required=True, help="HOST:PORT of the matrix service")
    w.add_argument("--draft-mode", choices=("remote", "replica"), default="replica",
                   help="replica (default): check the tenant's matrix out, draft locally, push recycled rows back; "
                        "remote: the service drafts each step (one round trip per request per step, in series "
                        "within a batch: slower under load)")
    w.add_argument("--matrix-secret-file", default=None,
                   help="file holding the matrix service's shared secret (when it requires one)")
    w.add_argument("--matrix-tls-ca", default=None, help="PEM CA file: reach the matrix service over TLS")
    w.add_argument("--matrix-allow-plaintext-secret", action="store_true",
                   help="send --matrix-secret-file without TLS to a non-loopback matrix service (refused otherwise)")
    _add_worker_flags(w)
    w.set_defaults(func=run_worker, redis_url=None, redis_password_file=None)  # stateless: matrices live in the matrix service


def _add_worker_flags(p: argparse.ArgumentParser) -> None:
    from ...engine.model.choices import ARITHMETIC_CHOICES, BATCH_STEPS, KERNELS
    from ..common.argtypes import integer, port, seconds

    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 = all)")
    p.add_argument("--port", type=port(), default=50051, help="gRPC port (default 50051; 0 = pick a free one and print it)")
    p.add_argument("--metrics-port", type=port(off=-1), default=9464,
                   help="Prometheus /metrics HTTP port (default 9464; 0 = pick a free one and print it; -1 = off)")
    p.add_argument("--http-port", type=integer(0, 65535, "0 = off"), default=8000,
                   help="OpenAI-compatible HTTP API port, /v1/chat/completions etc. (default 8000; 0 = off)")
    p.add_argument("--http-host", default=None, help="address of the HTTP API (default: the same as --host)")
    p.add_argument("--allowed-origins", default="",
                   help="comma-separated browser origins the HTTP API answers cross-origin (CORS), e.g. "
                        "https://app.example.com; * = any; default none")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")
    _add_model_flags(p)
    p.add_argument("--tree", default="auto", help="draft tree template name or file (default: best known for the device)")
    p.add_argument("--max-batch", type=integer(1), default=16, help="requests decoding together, one forward per step (default 16)")
    p.add_argument("--max-batch-tokens", type=integer(64), default=65536,
                   help="KV tokens the requests of a batch may reserve, prompt + max_new_tokens + tree each (default 65536)")
    p.add_argument("--prefill-chunk", type=integer(1), default=128,
                   help="prompt tokens prefilled per step: a long prompt delays the others by one chunk per step")
    p.add_argument("--prefix-cache-mb", type=integer(0, meaning="0 = off"), default=512,
                   help="MiB of finished requests' keys and values kept per worker for later prompts of the same "
                        "tenant that start the same way: multi-turn chats, agent loops (default 512; 0 = off)")
    p.add_argument("--full-trees", action="store_true",
                   help="every TR request verifies its whole tree each step (default: trees sized per step for the "
                        "batch under the measured forward cost, down to plain one-token steps)")
    p.add_argument("--max-queue", type=integer(0), default=16, help="requests waiting for a batch place before RESOURCE_EXHAUSTED")
    p.add_argument("--max-tenant-prompt-tokens", type=integer(1), default=16384, help="prompt tokens one tenant "
                   "may have queued before RESOURCE_EXHAUSTED (one with none queued is always taken; default 16384)")
    p.add_argument("--max-new-tokens-cap", type=integer(1), default=2048, help="largest max_new_tokens a request may ask")
    p.add_argument("--max-prompt-tokens", type=integer(1), default=4096, help="longest prompt accepted, in tokens")
    p.add_argument("--max-messages", type=integer(1), default=256, help="chat messages a request may have (default 256)")
    p.add_argument("--max-request-bytes", type=integer(1024, 64 << 20), default=1 << 20,
                   help="largest request body, bytes (default 1 MiB; gRPC refuses larger ones with RESOURCE_EXHAUSTED)")
    p.add_argument("--max-concurrent-rpcs", type=integer(1), default=64,
                   help="Generate/GenerateStream/Tokenize calls in flight; beyond it RESOURCE_EXHAUSTED (default 64)")
    p.add_argument("--max-connection-age-s", type=seconds(meaning="0 = never"), default=300.0,
                   help="close client connections after about this long, so clients re-resolve and reach workers "
                        "added since; calls in flight get 600 s to finish (0 = never; default 300)")
    p.add_argument("--grace", type=seconds(), default=10.0, help="seconds in-flight requests may finish on SIGTERM")
    p.add_argument("--threads", type=integer(1), default=None, help="torch intra-op CPU threads (default: torch's choice)")
    p.add_argument("--kernels", choices=KERNELS, default="auto",
                   help="linear-layer kernels: auto (default: exact compressed on AVX-512 / AVX2 CPUs for "
                        "block-quantised weights, else oneDNN pre-packed on CPU float32), stock, packed or "
                        "compressed (also on the slow portable scalar variant)")
    p.add_argument("--arithmetic", choices=ARITHMETIC_CHOICES, default="auto",
                   help="the compressed kernels' arithmetic: auto (default: int8 wherever they run, except on a "
                        "checkpoint quantized at load, else exact), exact (float32 over the exact weights: the "
                        "model's own greedy output) or int8 (activations quantized per block of 32, integer dot "
                        "products: cheaper verified rows, within 0.4 points of bfloat16's top-1 agreement with "
                        "exact; TR == plain decoding bit for bit in each; docs/kernels.md)")
    p.add_argument("--batch-step", choices=BATCH_STEPS, default="auto",
                   help="transformers' forward, batch steps: auto (default: fixed-shape buckets with a CUDA graph "
                        "each on CUDA, else eager), eager, static (the buckets without graphs) or graphs")
    p.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    p.add_argument("--tenant-tokens", default=None, help='JSON file {"tenant": "token" or ["token", ...]}: require '
                   "'authorization: Bearer <token>' and serve each token its own tenant only")


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    from ...engine.model.choices import QUANTIZE_CHOICES
    from ..openai.reasoning_parsers import PARSERS
    from ..openai.toolparse import PARSERS as TOOL_PARSERS

    p.add_argument("--model", default=None, help="builtin model name, local transformers directory, local .gguf "
                   "file (converted once into the cache) or hub id (default: the bundled smollm2-135m-instruct)")
    p.add_argument("--served-model-name", default=None,
                   help="the name callers use: OpenAI's model id, ModelInfo.model, metrics' model_name (default: --model)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template file (or the template itself) replacing the model's own")
    p.add_argument("--reasoning-parser", choices=tuple(PARSERS), default="none",
                   help="the HTTP API returns a chat reply's reasoning apart from its answer, as reasoning_content: "
                        "think (<think>...</think>; deepseek_r1 and qwen3 are vLLM's names for it) or none (default)")
    p.add_argument("--tool-call-parser", choices=TOOL_PARSERS, default="auto",
                   help='how replies to tool_choice "auto" are read for tool calls: auto (default: the format the '
                        "chat template teaches: <tool_call> hermes, <|python_tag|> llama3_json, [TOOL_CALLS] "
                        "mistral; the bundled ChatML model gets a shipped hermes template), hermes, llama3_json, "
                        'mistral (for a custom template in that format) or none (tool_choice "auto" refused)')
    p.add_argument("--quantize", choices=QUANTIZE_CHOICES, default="auto",
                   help="a transformers checkpoint's float linear layers, quantized once at load into the compressed "
                        "kernels' blocks and cached: auto (default: q8_0 in the exact arithmetic, the cheapest that met "
                        "int8's fidelity rule on the bundled model's bf16 checkpoint), q8_0, q6_k, q4_k (llama.cpp's types; rows that are "
                        "not whole super-blocks of 256 take its fallbacks) or none (float weights, as transformers "
                        "loads them); weights that already are exact 4/8-bit blocks are kept as they are")
    p.add_argument("--cache-dir", default=None,
                   help="where converted models, built kernels and calibrations are kept (default "
                        "$XDG_CACHE_HOME/trserve or ~/.cache/trserve); must be writable")


def build_configs(args: argparse.Namespace):
    """(WorkerConfig, DecoderConfig) from the parsed flags; raises ValueError on bad values."""
    from ...engine import DecoderConfig, ModelConfig
    from ..common.security import TenantTokens, password_file, server_tls
    from ..worker.config import Limits, WorkerConfig

    from ...core.errors import TRServeError
    from ...engine.tr.template import load_template

    if args.tree != "auto":  # a tree that does not exist fails before the model loads
        try:
            load_template(args.tree)
        except TRServeError as e:
            raise ValueError(f"--tree: {e}") from None
    source = {} if args.model is None else {"source": args.model}
    model = ModelConfig(**source, device=args.device, threads=args.threads, kernels=args.kernels,
                        arithmetic=args.arithmetic, quantize=args.quantize, batch_step=args.batch_step,
                        cache_dir=args.cache_dir,
                        chat_template=_chat_template(args.chat_template))
    limits = Limits(max_new_tokens_cap=args.max_new_tokens_cap, max_prompt_tokens=args.max_prompt_tokens,
                    default_max_new_tokens=min(128, args.max_new_tokens_cap), max_messages=args.max_messages)
    tokens = TenantTokens.from_file(args.tenant_tokens) if args.tenant_tokens else None
    worker = WorkerConfig(
        host=args.host, port=args.port, metrics_port=None if args.metrics_port < 0 else args.metrics_port,
        http_port=args.http_port or None, http_host=args.http_host,
        allowed_origins=tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip()),
        served_model_name=args.served_model_name, tool_call_parser=args.tool_call_parser,
        max_batch=args.max_batch, max_batch_tokens=args.max_batch_tokens, prefill_chunk=args.prefill_chunk,
        max_queue=args.max_queue, max_tenant_prompt_tokens=args.max_tenant_prompt_tokens, full_trees=args.full_trees, prefix_cache_mb=args.prefix_cache_mb, limits=limits,
        grace_s=args.grace,
        redis_url=args.redis_url, redis_password=password_file(args.redis_password_file, "--redis-password-file"),
        max_request_bytes=args.max_request_bytes, max_concurrent_rpcs=args.max_concurrent_rpcs,
        max_connection_age_s=args.max_connection_age_s or None,
        tls=server_tls(args.tls_cert, args.tls_key), tenant_tokens=tokens,
        reasoning_parser=None if args.reasoning_parser == "none" else args.reasoning_parser,
    )
    return worker, DecoderConfig(model=model, tree=args.tree, cache_dir=args.cache_dir)


def _chat_template(value: str | None) -> str | None:
    """--chat-template: a file's text, or the value itself where it reads as a template."""
    from pathlib import Path

    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        try:
            return path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {value!r}: {e}") from None
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template: {value!r} is neither a file nor a Jinja template")


def check_ports(config) -> None:
    """Each port the worker will listen on (gRPC, HTTP, metrics; 0 = any free one, skipped) is its own
    and can be bound now: a port in use stops the start before the model loads, naming its flag. (The
    servers bind again later; this only says early what would fail then.)"""
    import socket

    taken: dict[int, str] = {}
    for flag, host, port in (("--port", config.host, config.port),
                             ("--http-port", config.http_host or config.host, config.http_port),
                             ("--metrics-port", config.host, config.metrics_port)):
        if not port:
            continue
        if port in taken:
            raise ValueError(f"{flag} {port} is also {taken[port]}: give each server a port of its own")
        taken[port] = flag
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                probe.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port} ({flag}: {e.strerror or e}); pick another port") from None


def build_split_config(args: argparse.Namespace, max_batch: int):
    """The worker's SplitConfig; raises ValueError on a bad address or secret."""
    from ..common.security import SharedSecret
    from ..worker.drafting.link import DraftClientConfig
    from ..worker.drafting.split import SplitConfig

    secret = SharedSecret.from_file(args.matrix_secret_file) if args.matrix_secret_file else None
    client = DraftClientConfig(tls_ca_file=args.matrix_tls_ca, secret=secret,
                               allow_plaintext_secret=args.matrix_allow_plaintext_secret)
    split = SplitConfig(matrix_addr=args.matrix_addr, draft_mode=args.draft_mode, client=client)
    if split.max_sources <= max_batch:  # see SplitConfig.max_sources
        raise ValueError(f"max_sources ({split.max_sources}) must exceed max_batch ({max_batch})")
    return split


def run_serve(args: argparse.Namespace) -> int:
    return _run("serve", args, split=False)


def run_worker(args: argparse.Namespace) -> int:
    return _run("worker", args, split=True)


def _run(command: str, args: argparse.Namespace, split: bool) -> int:
    try:
        worker_config, decoder_config = build_configs(args)
        split_config = build_split_config(args, worker_config.max_batch) if split else None
    except ValueError as e:
        print(f"trserve {command}: {e}", file=sys.stderr)
        return 2
    from ..worker.drafting.split import MatrixServiceSources
    from ..worker.server import WarmUpFailed, serve

    from ...core.errors import FailedPrecondition, InvalidArgument, NotFound

    try:
        check_ports(worker_config)  # in seconds, before the model loads
    except (OSError, ValueError) as e:
        print(f"trserve {command}: {e}", file=sys.stderr)
        return 1
    sources = MatrixServiceSources(split_config) if split_config is not None else None
    front_end = None
    if worker_config.http_port is not None:  # uvicorn and starlette only when the API is on
        from ..openai.server import front_end
    try:
        return serve(worker_config, decoder_config, sources, front_end)
    except (NotFound, InvalidArgument, FailedPrecondition) as e:  # the operator's choice of model, tree, device
        print(f"trserve {command}: {e}", file=sys.stderr)
        return 2
    except (OSError, WarmUpFailed) as e:  # a port in use (say which, how to pick another); a failed warm-up
        print(f"trserve {command}: {e}", file=sys.stderr)
        return 1
