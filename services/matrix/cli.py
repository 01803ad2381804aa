"""`trserve matrix` (run the service) and `trserve matrix-admin` (admin calls, JSON out)."""

from __future__ import annotations

import argparse
import json
import sys

ADMIN_ACTIONS = ("describe", "versions", "snapshot", "rollback", "fork", "delete")


def register(sub: argparse._SubParsersAction) -> None:
    run = sub.add_parser("matrix", help="run the matrix service (per-tenant adjacency matrices, Redis snapshots)")
    run.add_argument("--host", default="0.0.0.0", help="listen address (default 0.0.0.0)")
    run.add_argument("--port", type=int, default=50052, help="listen port; 0 = any free port, printed (default 50052)")
    run.add_argument("--redis-url", default=None, help="e.g. redis://127.0.0.1:6379/0; omitted = memory only")
    run.add_argument("--key-prefix", default="trserve", help="prefix of every Redis key (default trserve)")
    run.add_argument("--snapshot-every-versions", type=int, default=64)
    run.add_argument("--snapshot-every-s", type=float, default=10.0)
    run.add_argument("--max-tenants", type=int, default=256, help="tenants kept in memory (LRU, default 256)")
    run.add_argument("--grace-s", type=float, default=5.0, help="drain time on SIGTERM (default 5)")
    run.add_argument("--secret-file", default=None, help="file holding a shared secret every worker must send")
    run.add_argument("--tls-cert", default=None, help="PEM certificate chain: serve TLS (with --tls-key)")
    run.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    run.set_defaults(func=run_service)

    admin = sub.add_parser("matrix-admin", help="admin calls on a matrix service; prints JSON")
    admin.add_argument("action", choices=ADMIN_ACTIONS)
    admin.add_argument("--addr", default="127.0.0.1:50052", help="matrix service host:port")
    admin.add_argument("--tenant", required=True)
    admin.add_argument("--fingerprint", required=True, help="model fingerprint the tenant's matrix belongs to")
    admin.add_argument("--version", type=int, help="rollback: the kept snapshot version to restore")
    admin.add_argument("--to", help="fork: the new tenant id")
    admin.add_argument("--timeout-s", type=float, default=10.0)
    admin.add_argument("--secret-file", default=None, help="the service's shared secret, when it requires one")
    admin.add_argument("--tls-ca", default=None, help="PEM CA file: reach the service over TLS")
    admin.set_defaults(func=run_admin)


def run_service(args: argparse.Namespace) -> int:
    import asyncio

    from matrix_store import StoreConfig
    from services.common.security import SharedSecret, server_tls
    from services.matrix.server import MatrixServiceConfig, serve

    try:
        store = StoreConfig(redis_url=args.redis_url, key_prefix=args.key_prefix,
                            snapshot_every_versions=args.snapshot_every_versions,
                            snapshot_every_s=args.snapshot_every_s, max_tenants_in_memory=args.max_tenants)
        secret = SharedSecret.from_file(args.secret_file) if args.secret_file else None
        config = MatrixServiceConfig(host=args.host, port=args.port, store=store, grace_s=args.grace_s,
                                     tls=server_tls(args.tls_cert, args.tls_key), secret=secret)
    except ValueError as exc:
        print(f"trserve matrix: {exc}", file=sys.stderr)
        return 2
    asyncio.run(serve(config))
    return 0


def run_admin(args: argparse.Namespace) -> int:
    import grpc

    from services.common.security import SharedSecret, client_channel
    from trserve.v1 import matrix_pb2 as pb
    from trserve.v1 import matrix_pb2_grpc as pb_grpc

    if args.action == "rollback" and args.version is None:
        print("trserve matrix-admin rollback: --version is required (see `versions`)", file=sys.stderr)
        return 2
    if args.action == "fork" and not args.to:
        print("trserve matrix-admin fork: --to NEW_TENANT is required", file=sys.stderr)
        return 2
    try:
        secret = SharedSecret.from_file(args.secret_file) if args.secret_file else None
    except ValueError as exc:
        print(f"trserve matrix-admin: {exc}", file=sys.stderr)
        return 2
    ref = pb.TenantRef(tenant=args.tenant, fingerprint=args.fingerprint)
    with client_channel(args.addr, args.tls_ca, secret) as channel:
        stub = pb_grpc.MatrixServiceStub(channel)
        try:
            out = _admin_call(stub, pb, args, ref)
        except grpc.RpcError as exc:
            print(json.dumps({"error": exc.code().name, "details": exc.details()}), file=sys.stderr)
            return 1
    print(json.dumps(out, indent=2))
    return 0


def _admin_call(stub, pb, args: argparse.Namespace, ref) -> dict:
    t = args.timeout_s
    if args.action == "describe":
        r = stub.Describe(ref, timeout=t)
        return {"tenant": r.tenant, "domain": r.domain or None, "fingerprint": r.fingerprint,
                "version": r.version, "nonzero_rows": r.nonzero_rows,
                "last_snapshot_version": r.last_snapshot_version if r.last_snapshot_version >= 0 else None,
                "in_memory": r.in_memory, "redis": r.redis, "last_snapshot_error": r.last_snapshot_error or None}
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
