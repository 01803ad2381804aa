"""`trserve` command line: one entry point, subcommands registered by the packages that own them.

Each module in COMMAND_MODULES defines `register(subparsers)`, adding its subcommands with
`set_defaults(func=callable(args) -> int)`. Those modules keep heavy imports (torch, grpc)
inside the functions so `trserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMAND_MODULES = (
    "services.worker.cli",  # serve, worker
    "services.client.cli",  # generate
    "services.matrix.cli",  # matrix, matrix-admin
    "services.cluster.cli",  # cluster up|down|status, health
    "services.load.cli",  # load
    "bench.cli",  # bench
    "engine.tuning.cli",  # tune
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trserve", description="Lossless speculative decoding with Token Recycling")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):  # that subcommand package is not built yet
                continue
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
