"""`trserve load`: drive workers with a bounded, loopback-only load and report what it measured."""

from __future__ import annotations

import argparse
import json
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("load", help="bounded load on local workers: throughput, latency, errors, MAT per tenant",
                       description="Send --requests Generate calls from --concurrency threads, round robin over "
                                   "--addrs (retrying on another worker when one is down). Loopback addresses only.")
    p.add_argument("--addrs", required=True, help="comma-separated worker HOST:PORTs (e.g. from `trserve cluster up`)")
    p.add_argument("--concurrency", type=int, default=4, help="client threads, one call in flight each (default 4)")
    p.add_argument("--requests", type=int, default=32, help="calls in the run (default 32, at most 10000)")
    p.add_argument("--tenants", type=int, default=4, help="distinct tenants, round robin (default 4)")
    p.add_argument("--tenant-prefix", default="load", help="tenants are PREFIX-0 .. PREFIX-(T-1) (default load)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--timeout-s", type=float, default=120.0, help="deadline of one call, retries included")
    p.add_argument("--max-duration-s", type=float, default=600.0, help="start no call after this (default 600)")
    p.add_argument("--tokens", default=None, help="tenant token JSON file, for workers run with --tenant-tokens")
    p.add_argument("--tls-ca", default=None, help="PEM CA file, for workers serving TLS")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (no progress bar)")
    p.add_argument("--records", action="store_true", help="with --json: include one record per request")
    p.add_argument("--abuse", action="store_true",
                   help="mix good and bad requests (oversize, malformed, cancelled, stalled, ...) against the first "
                        "worker for --duration-s after a --baseline-s good-only run; exit 1 on any unexpected status "
                        "or if the worker stops serving")
    p.add_argument("--duration-s", type=float, default=60.0, help="--abuse: seconds of abuse (default 60)")
    p.add_argument("--baseline-s", type=float, default=10.0, help="--abuse: seconds of good-only baseline (default 10)")
    p.add_argument("--max-request-bytes", type=int, default=1 << 20,
                   help="--abuse: the worker's body limit, so that the oversize body exceeds it (default 1 MiB)")
    p.set_defaults(func=run)


def run_abuse_cli(args: argparse.Namespace) -> int:
    from .abuse import AbuseConfig, run_abuse

    try:
        config = AbuseConfig(addr=args.addrs.split(",")[0].strip(), duration_s=args.duration_s,
                             baseline_s=args.baseline_s, good_clients=max(1, args.concurrency // 2),
                             bad_clients=max(1, args.concurrency - args.concurrency // 2), tenants=args.tenants,
                             max_new_tokens=args.max_new_tokens, max_request_bytes=args.max_request_bytes,
                             tokens_file=args.tokens, tls_ca_file=args.tls_ca)
    except ValueError as exc:
        print(f"trserve load: {exc}", file=sys.stderr)
        return 2
    report = run_abuse(config)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.format())
    return 0 if report.ok else 1


def run(args: argparse.Namespace) -> int:
    if args.abuse:
        return run_abuse_cli(args)
    from .runner import LoadConfig, run_load

    try:
        config = LoadConfig(
            addrs=tuple(a.strip() for a in args.addrs.split(",") if a.strip()), concurrency=args.concurrency,
            requests=args.requests, tenants=args.tenants, tenant_prefix=args.tenant_prefix,
            max_new_tokens=args.max_new_tokens, timeout_s=args.timeout_s, max_duration_s=args.max_duration_s,
            tokens_file=args.tokens, tls_ca_file=args.tls_ca)
        report = run_load(config, progress=not args.json and sys.stderr.isatty())
    except ValueError as exc:
        print(f"trserve load: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_json(args.records), indent=2) if args.json else report.format())
    return 0 if not report.failed else 1
