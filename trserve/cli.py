"""`trserve`, the whole command line: the services' commands (services/cli.py) and the tools that sit
above the services, `bench` and `tune` (trserve/bench). The installed `trserve`
script and the image's entry point run this `main`."""

from __future__ import annotations

import argparse
import sys

from trserve.services import cli as services

COMMAND_MODULES = (*services.SERVICE_COMMANDS, "trserve.bench.cli", "trserve.bench.tune")


def build_parser() -> argparse.ArgumentParser:
    return services.build_parser(COMMAND_MODULES)


def main(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> int:
    return services.main(argv, environ, COMMAND_MODULES)


if __name__ == "__main__":
    sys.exit(main())
