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
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from services.load.runner import LoadConfig, run_load

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
