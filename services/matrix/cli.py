"""`trserve matrix` (run the service) and `trserve matrix-admin` (admin calls, JSON out)."""

from __future__ import annotations

import argparse
import json
import sys

ADMIN_ACTIONS = ("list", "describe", "versions", "snapshot", "rollback", "fork", "delete")


def register(sub: argparse._SubParsersAction) -> None:
    from ..common.argtypes import integer, port, redis_url, seconds

    run = sub.add_parser("matrix", help="run the matrix service (per-tenant adjacency matrices, Redis snapshots)")
    run.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1, as the worker)")
    run.add_argument("--port", type=port(), default=50052, help="listen port; 0 = any free port, printed (default 50052)")
    run.add_argument("--redis-url", default=None, type=redis_url, help="e.g. redis://127.0.0.1:6379/0; omitted = memory only")
    run.add_argument("--redis-password-file", default=None, help="file holding Redis' password (its requirepass)")
    run.add_argument("--key-prefix", default="trserve", help="prefix of every Redis key (default trserve)")
    run.add_argument("--snapshot-every-versions", type=integer(1), default=64,
                     help="snapshot a tenant once it is this many versions past its last snapshot (default 64)...")
    run.add_argument("--snapshot-every-s", type=seconds(above=True), default=10.0,
                     help="...or this many seconds after its first unsnapshotted change (default 10)")
    run.add_argument("--max-tenants", type=integer(1), default=256, help="tenants kept in memory (LRU, default 256)")
    run.add_argument("--metrics-port", type=port(off=-1), default=-1,
                     help="Prometheus /metrics (tenants and bytes in memory, per tenant) on this port; 0 = any free "
                          "port; -1 = off (default)")
    run.add_argument("--grace-s", type=seconds(), default=5.0, help="drain time on SIGTERM (default 5)")
    run.add_argument("--secret-file", default=None,
                     help="file holding the workers' secret (DraftSession, Checkout, PushRows need it)")
    run.add_argument("--admin-secret-file", default=None,
                     help="file holding the admin secret: admin RPCs need it (the workers' secret does not suffice); "
                          "without it admin RPCs are refused when --secret-file is set, and reserved tenants "
                          "(_global, _domain.*) cannot be written")
    run.add_argument("--model", action="append", default=[], metavar="MODEL",
                     help="serve only this model (repeatable): FINGERPRINT:V:K as `trserve model-spec` prints it, "
                          "or the workers' --model (a builtin name or local directory; K = the workers' default). "
                          "Without it: the first --max-models that callers name, which needs a loopback --host, "
                          "--secret-file or --open-registration")
    run.add_argument("--max-models", type=integer(1), default=2, help="models served when no --model is given (default 2)")
    run.add_argument("--open-registration", action="store_true",
                     help="without --model and --secret-file, still listen beyond loopback (anyone who reaches the "
                          "service can then fill its --max-models with models of their own)")
    run.add_argument("--insecure-no-secret", action="store_true",
                     help="listen beyond loopback without --secret-file: anyone who reaches the port can then read "
                          "every tenant's matrix and history (recent prompts and outputs) and write rows; refused "
                          "without this flag")
    run.add_argument("--history-mb", type=integer(0, meaning="0 = keep none"), default=64,
                     help="the tenants' suffix histories handed to replica workers, in memory (LRU beyond; saved "
                          "with each tenant's matrix); 0 = keep none (default 64)")
    run.add_argument("--max-message-mb", type=integer(1, 64), default=4,
                     help="largest gRPC message taken or sent, MiB (default 4: a full PushRows batch is ~1.3 MB, a "
                          "Checkout chunk ~2.9 MB); larger ones are refused with RESOURCE_EXHAUSTED")
    run.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS (with --tls-key)")
    run.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    run.set_defaults(func=run_service)

    spec = sub.add_parser("model-spec", help="print a model's FINGERPRINT:V:K (what `trserve matrix --model` takes)")
    spec.add_argument("--model", default=None, help="the workers' --model (builtin name or local directory; "
                                                    "default: the bundled model)")
    spec.add_argument("--k", type=int, default=None, help="successors per row, if not the workers' default")
    spec.set_defaults(func=run_model_spec)

    _register_secret_and_admin(sub)


def _register_secret_and_admin(sub: argparse._SubParsersAction) -> None:
    make = sub.add_parser("secret", help="write a fresh shared secret into each FILE not there yet (mode 0600; "
                                         "existing files are kept): what --secret-file and --matrix-secret-file read")
    make.add_argument("files", nargs="+", metavar="FILE")
    make.set_defaults(func=run_make_secrets)

    admin = sub.add_parser("matrix-admin", help="admin calls on a matrix service; prints JSON")
    admin.add_argument("action", choices=ADMIN_ACTIONS, help="list: every tenant; the others act on --tenant")
    admin.add_argument("--addr", default="127.0.0.1:50052", help="matrix service host:port")
    admin.add_argument("--tenant", default=None, help="the tenant (every action but list)")
    admin.add_argument("--fingerprint", default=None,
                       help="model fingerprint of the tenant's matrix (default: the one model the service holds "
                            "tenants of); list: only that model's tenants")
    admin.add_argument("--version", type=int, help="rollback: the kept snapshot version to restore")
    admin.add_argument("--to", help="fork: the new tenant id")
    admin.add_argument("--table", action="store_true", help="list: a text table instead of JSON")
    admin.add_argument("--timeout-s", type=float, default=10.0, help="deadline of each call (default 10)")
    admin.add_argument("--secret-file", default=None, help="the service's admin secret, when it requires one")
    admin.add_argument("--allow-plaintext-secret", action="store_true",
                       help="send the secret without TLS to a non-loopback address (refused otherwise)")
    admin.add_argument("--tls-ca", default=None, help="PEM CA file: reach the service over TLS")
    admin.set_defaults(func=run_admin)


def service_config(args: argparse.Namespace):
    """The MatrixServiceConfig of `trserve matrix`'s flags; ValueError / LookupError on bad ones."""
    from ...matrix_store import StoreConfig
    from ..common.security import SharedSecret, password_file, server_tls
    from .server import MatrixServiceConfig

    store = StoreConfig(redis_url=args.redis_url,
                        redis_password=password_file(args.redis_password_file, "--redis-password-file"),
                        key_prefix=args.key_prefix,
                        snapshot_every_versions=args.snapshot_every_versions,
                        snapshot_every_s=args.snapshot_every_s, max_tenants_in_memory=args.max_tenants,
                        models=tuple(_served_model(m) for m in args.model), max_models=args.max_models)
    secret = SharedSecret.from_file(args.secret_file) if args.secret_file else None
    admin = SharedSecret.from_file(args.admin_secret_file) if args.admin_secret_file else None
    return MatrixServiceConfig(host=args.host, port=args.port, store=store, grace_s=args.grace_s,
                               max_message_bytes=args.max_message_mb << 20,
                               tls=server_tls(args.tls_cert, args.tls_key), secret=secret, admin_secret=admin,
                               metrics_port=None if args.metrics_port < 0 else args.metrics_port,
                               open_registration=args.open_registration, insecure_no_secret=args.insecure_no_secret,
                               history_bytes=args.history_mb << 20)


def run_service(args: argparse.Namespace) -> int:
    import asyncio

    from .server import serve

    try:
        config = service_config(args)
    except (ValueError, LookupError) as exc:
        print(f"trserve matrix: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(serve(config))
    except OSError as exc:  # a port in use: which, and what to do
        print(f"trserve matrix: {exc}", file=sys.stderr)
        return 1
    return 0


def run_make_secrets(args: argparse.Namespace) -> int:
    """Create each missing secret file atomically (O_EXCL, 0600) with 43 url-safe characters; a file
    already there is kept, so a restarted deployment keeps the secret its peers hold."""
    import os
    import secrets

    for path in args.files:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            print(f"kept {path}")
            continue
        except OSError as exc:
            print(f"trserve secret: cannot create {path}: {exc.strerror or exc}", file=sys.stderr)
            return 2
        with os.fdopen(fd, "w") as out:
            out.write(secrets.token_urlsafe(32) + "\n")
        print(f"wrote {path}")
    return 0


def _served_model(text: str):
    """A --model value: FINGERPRINT:V:K as is, else a model source (builtin name, directory) whose spec
    is read from its tokenizer and config, with the workers' default K."""
    from ...matrix_store.config import parse_model

    if ":" in text:  # FINGERPRINT:V:K (parse_model says what is wrong with a bad one)
        return parse_model(text)
    from ...engine.config import DecoderConfig
    from ...engine.model.loader import ModelConfig, model_spec_of

    return model_spec_of(ModelConfig(source=text), DecoderConfig().k)


def run_model_spec(args: argparse.Namespace) -> int:
    """Print FINGERPRINT:V:K of a model, as `trserve matrix --model` takes it."""
    from ...core.errors import NotFound
    from ...engine.model.choices import BUILTIN_MODEL

    try:
        spec = _served_model(args.model or BUILTIN_MODEL)
    except (ValueError, NotFound) as exc:
        print(f"trserve model-spec: {exc}", file=sys.stderr)
        return 2
    if args.k is not None:
        from ...core.model_spec import ModelSpec

        spec = ModelSpec(spec.fingerprint, spec.vocab_size, args.k)
    print(f"{spec.fingerprint}:{spec.vocab_size}:{spec.k}")
    return 0


def run_admin(args: argparse.Namespace) -> int:
    import grpc

    from ..common.security import SharedSecret, client_channel
    from ...v1 import matrix_pb2_grpc as pb_grpc

    problem = _usage_problem(args)
    try:
        secret = SharedSecret.from_file(args.secret_file) if args.secret_file else None
    except ValueError as exc:
        problem = problem or str(exc)
    if problem:
        print(f"trserve matrix-admin {args.action}: {problem}", file=sys.stderr)
        return 2
    try:
        channel = client_channel(args.addr, args.tls_ca, secret, allow_plaintext_secret=args.allow_plaintext_secret)
    except ValueError as exc:
        print(f"trserve matrix-admin {args.action}: {exc}", file=sys.stderr)
        return 2
    with channel:
        stub = pb_grpc.MatrixServiceStub(channel)
        try:
            if args.action == "list":
                return _list(stub, args)
            fingerprint = args.fingerprint or _only_fingerprint(stub, args.timeout_s)
            out = _admin_call(stub, args, fingerprint)
        except grpc.RpcError as exc:
            print(json.dumps({"error": exc.code().name, "details": exc.details()}), file=sys.stderr)
            return 1
        except LookupError as exc:
            print(f"trserve matrix-admin {args.action}: {exc}", file=sys.stderr)
            return 2
    print(json.dumps(out, indent=2))
    return 0


def _usage_problem(args: argparse.Namespace) -> str | None:
    if args.action != "list" and not args.tenant:
        return "--tenant is required (see `trserve matrix-admin list`)"
    if args.action == "rollback" and args.version is None:
        return "--version is required (see `versions`)"
    if args.action == "fork" and not args.to:
        return "--to NEW_TENANT is required"
    return None


def _only_fingerprint(stub, timeout: float) -> str:
    """The one model the service holds tenants of; LookupError naming them when there are several or none."""
    from ...v1 import matrix_pb2 as pb

    found = sorted({t.fingerprint for t in stub.ListTenants(pb.ListTenantsRequest(), timeout=timeout).tenants})
    if len(found) != 1:
        held = f"tenants of {len(found)} models: {', '.join(found)}" if found else "no tenants"
        raise LookupError(f"the service holds {held}; pass --fingerprint")
    return found[0]


def _list(stub, args: argparse.Namespace) -> int:
    from ...v1 import matrix_pb2 as pb

    reply = stub.ListTenants(pb.ListTenantsRequest(fingerprint=args.fingerprint or ""), timeout=args.timeout_s)
    rows = [_summary(t) for t in reply.tenants]
    if args.table:
        print(_tenant_table(rows))
        if reply.redis == "failing":
            print("(Redis unreachable: tenants only in Redis are missing)")
    else:
        print(json.dumps({"redis": reply.redis, "models": list(reply.models), "memory_bytes": reply.memory_bytes,
                          "history_bytes": reply.history_bytes, "tenants": rows}, indent=2))
    return 0


def _summary(t) -> dict:
    """A TenantSummary as JSON, the proto's -1 / "" sentinels as null."""
    age = _known(t.last_snapshot_age_s)
    return {"tenant": t.tenant, "fingerprint": t.fingerprint, "domain": t.domain or None, "version": t.version,
            "in_memory": t.in_memory, "nonzero_rows": _known(t.nonzero_rows), "memory_bytes": t.memory_bytes,
            "history_bytes": t.history_bytes, "last_snapshot_version": _known(t.last_snapshot_version),
            "last_snapshot_age_s": None if age is None else round(age, 1)}


def _known(value):
    return None if value < 0 else value


def _tenant_table(rows: list[dict]) -> str:
    from ...core.progress import format_duration

    def show(value) -> str:
        return "-" if value is None else str(value)

    lines = [f"{'tenant':<20} {'fingerprint':<36} {'version':>8} {'rows':>7} {'memory':>9} {'history':>9} "
             f"{'snapshot':>8} {'age':>7}"]
    for r in rows:
        age = r["last_snapshot_age_s"]
        memory = f"{r['memory_bytes'] / 2**20:.1f} MiB" if r["in_memory"] else "redis"
        lines.append(f"{r['tenant']:<20} {r['fingerprint']:<36} {r['version']:>8} {show(r['nonzero_rows']):>7} "
                     f"{memory:>9} {r['history_bytes'] / 2**10:>6.0f} KiB {show(r['last_snapshot_version']):>8} "
                     f"{'-' if age is None else format_duration(age):>7}")
    return "\n".join(lines)


def _admin_call(stub, args: argparse.Namespace, fingerprint: str) -> dict:
    from ...v1 import matrix_pb2 as pb

    t, ref = args.timeout_s, pb.TenantRef(tenant=args.tenant, fingerprint=fingerprint)
    if args.action == "describe":
        r = stub.Describe(ref, timeout=t)
        return {"tenant": r.tenant, "domain": r.domain or None, "fingerprint": r.fingerprint,
                "version": r.version, "nonzero_rows": r.nonzero_rows,
                "last_snapshot_version": r.last_snapshot_version if r.last_snapshot_version >= 0 else None,
                "in_memory": r.in_memory, "redis": r.redis, "last_snapshot_error": r.last_snapshot_error or None,
                "epoch": r.epoch, "rows_sha256": r.rows_sha256 or None, "probs_sha256": r.probs_sha256 or None,
                "memory_bytes": r.memory_bytes}
    if args.action == "versions":
        return {"tenant": args.tenant, "versions": list(stub.ListVersions(ref, timeout=t).versions)}
    if args.action == "snapshot":
        return {"tenant": args.tenant, "version": stub.Snapshot(ref, timeout=t).version}
    if args.action == "rollback":
        return {"tenant": args.tenant,
                "version": stub.Rollback(pb.RollbackRequest(ref=ref, version=args.version), timeout=t).version}
    if args.action == "fork":
        return {"tenant": args.to, "from": args.tenant,
                "version": stub.Fork(pb.ForkRequest(ref=ref, to=args.to), timeout=t).version}
    stub.Delete(ref, timeout=t)
    return {"tenant": args.tenant, "deleted": True}
