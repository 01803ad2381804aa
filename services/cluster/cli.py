"""`trserve cluster up|down|status` (the split deployment as local processes) and `trserve health`
(a gRPC health probe, for container health checks)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .config import DRAFT_MODES

TRSERVE_MARKER, REDIS_MARKER = "trserve.services.cli", "redis-server"


def default_run_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "trserve" / "cluster")


def register(sub: argparse._SubParsersAction) -> None:
    cluster = sub.add_parser("cluster", help="run the split deployment (Redis, matrix service, N workers) locally",
                             description="Start, inspect or stop a split deployment as local processes on loopback.")
    actions = cluster.add_subparsers(dest="action", metavar="ACTION", required=True)
    up = actions.add_parser("up", help="start Redis, the matrix service and the workers; return once all serve")
    _add_run_dir(up)
    up.add_argument("--workers", type=int, default=2, help="number of workers (default 2)")
    up.add_argument("--draft-mode", choices=DRAFT_MODES, default="remote")
    up.add_argument("--threads", type=int, default=None, help="torch CPU threads per worker (default torch's)")
    up.add_argument("--model", default="smollm2-135m-instruct",
                    help="the workers' model (builtin name or local directory); the matrix service serves only it")
    up.add_argument("--base-port", type=int, default=0, help="workers on P..P+N-1, matrix P+N, Redis P+N+1 "
                    "(default 0: free ports, printed)")
    up.add_argument("--redis-url", default=None, help="use this Redis instead of starting one (AOF on) in the run dir")
    up.add_argument("--key-prefix", default="trserve")
    up.add_argument("--snapshot-every-versions", type=int, default=64)
    up.add_argument("--snapshot-every-s", type=float, default=10.0)
    up.add_argument("--tls-cert", default=None, help="every server serves TLS with this PEM certificate...")
    up.add_argument("--tls-key", default=None, help="...and this key")
    up.add_argument("--tls-ca", default=None, help="PEM CA the workers and probes trust (default: --tls-cert)")
    up.add_argument("--tenant-tokens", default=None, help="workers require per-tenant bearer tokens (JSON file)")
    up.add_argument("--matrix-secret-file", default=None, help="the matrix service requires this shared secret")
    up.add_argument("--matrix-admin-secret-file", default=None,
                    help="the matrix service's admin RPCs require this secret (`trserve matrix-admin --secret-file`)")
    up.set_defaults(func=run_up)
    for name, func, text in (("status", run_status, "pids, addresses and health of a running local cluster"),
                             ("down", run_down, "stop a local cluster gracefully (workers, matrix, Redis)")):
        p = actions.add_parser(name, help=text)
        _add_run_dir(p)
        p.add_argument("--json", action="store_true", help="machine-readable output")
        p.set_defaults(func=func)

    health = sub.add_parser("health", help="gRPC health check of a trserve server; exit 0 when SERVING")
    health.add_argument("--addr", default="127.0.0.1:50051", help="HOST:PORT")
    health.add_argument("--tls-ca", default=None, help="PEM CA file, for a server serving TLS")
    health.add_argument("--timeout-s", type=float, default=3.0)
    health.set_defaults(func=run_health)


def _add_run_dir(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default=None,
                   help="logs, Redis data and cluster.json (default ~/.cache/trserve/cluster)")


def run_up(args: argparse.Namespace) -> int:
    from .config import ClusterConfig
    from .procs import StartError
    from .runner import LocalCluster

    run_dir = args.run_dir or default_run_dir()
    if _live(_load_state(run_dir)):
        print(f"trserve cluster: a cluster is already up in {run_dir}; `trserve cluster down` first", file=sys.stderr)
        return 1
    try:
        config = ClusterConfig(
            run_dir=run_dir, workers=args.workers, draft_mode=args.draft_mode, threads=args.threads, model=args.model,
            base_port=args.base_port, redis_url=args.redis_url, key_prefix=args.key_prefix,
            snapshot_every_versions=args.snapshot_every_versions, snapshot_every_s=args.snapshot_every_s,
            tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca, tenant_tokens=args.tenant_tokens,
            matrix_secret=args.matrix_secret_file, matrix_admin_secret=args.matrix_admin_secret_file)
    except ValueError as exc:
        print(f"trserve cluster up: {exc}", file=sys.stderr)
        return 2
    cluster = LocalCluster(config)
    try:
        cluster.start()
    except StartError as exc:
        print(f"trserve cluster up: {exc}", file=sys.stderr)
        return 1
    print(f"redis   {cluster.redis_url}")
    print(f"matrix  {cluster.matrix_addr}")
    for i, addr in enumerate(cluster.worker_addrs):
        print(f"worker  {addr}  (worker-{i})")
    print(f"workers {','.join(cluster.worker_addrs)}")
    print(f"logs in {cluster.log_dir}; `trserve cluster status|down --run-dir {run_dir}`", flush=True)
    return 0


def _load_state(run_dir: str) -> dict | None:
    from .runner import STATE_FILE

    path = Path(run_dir) / STATE_FILE
    return json.loads(path.read_text()) if path.exists() else None


def _members(state: dict) -> list[tuple[str, int | None, str | None, str]]:
    """(name, pid, gRPC address or None, command-line marker) of every process in a state file."""
    members = [("redis", state["redis"]["pid"], None, REDIS_MARKER),
               ("matrix", state["matrix"]["pid"], state["matrix"]["addr"], TRSERVE_MARKER)]
    members += [(f"worker-{i}", w["pid"], w["addr"], TRSERVE_MARKER) for i, w in enumerate(state["workers"])]
    return members


def _live(state: dict | None) -> bool:
    from .procs import pid_runs

    return state is not None and any(pid and pid_runs(pid, marker) for _, pid, _, marker in _members(state))


def _existing(args: argparse.Namespace) -> tuple[str, dict | None]:
    """The run dir and its cluster state; None (said on stderr) when no cluster was started there."""
    run_dir = args.run_dir or default_run_dir()
    state = _load_state(run_dir)
    if state is None:
        print(f"trserve cluster: no cluster in {run_dir}", file=sys.stderr)
    return run_dir, state


def run_status(args: argparse.Namespace) -> int:
    from .procs import health_status, pid_runs

    run_dir, state = _existing(args)
    if state is None:
        return 1
    rows = []
    for name, pid, addr, marker in _members(state):
        if pid is None:  # a Redis the cluster did not start
            rows.append({"name": name, "pid": None, "addr": state["redis"]["url"], "state": "external", "ok": True})
            continue
        alive = pid_runs(pid, marker)
        health = "DOWN" if not alive else health_status(addr, state.get("tls_ca")) if addr else "up"
        rows.append({"name": name, "pid": pid, "addr": addr or state["redis"]["url"], "state": health,
                     "ok": health in ("SERVING", "up")})
    if args.json:
        print(json.dumps({"processes": rows, "workers": [w["addr"] for w in state["workers"]]}, indent=2))
    else:
        for r in rows:
            print(f"{r['name']:<10} pid {r['pid'] or '-':<8} {r['state']:<12} {r['addr']}")
    return 0 if all(r["ok"] for r in rows) else 1


def run_down(args: argparse.Namespace) -> int:
    from .procs import stop_pid
    from .runner import STATE_FILE

    run_dir, state = _existing(args)
    if state is None:
        return 1
    stopped = []
    for name, pid, _, marker in reversed(_members(state)):  # workers first, Redis last
        if pid and stop_pid(pid, marker):
            stopped.append(name)
    (Path(run_dir) / STATE_FILE).unlink(missing_ok=True)
    print(json.dumps({"stopped": stopped}) if args.json else f"stopped: {', '.join(stopped) or 'nothing was running'}")
    return 0


def run_health(args: argparse.Namespace) -> int:
    from .procs import health_status

    status = health_status(args.addr, args.tls_ca, args.timeout_s)
    print(status)
    return 0 if status == "SERVING" else 1
