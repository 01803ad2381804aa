"""The whole `trserve` command line: subcommands registered by the packages that own them, the
services' commands and the tools that sit above the services, `bench` and `tune` (bench/; named here
as strings, imported only to register them). The installed `trserve` script and the image's entry
point run this `main`.

Each module in COMMANDS defines `register(subparsers)`, adding its subcommands with
`set_defaults(func=callable(args) -> int)`. Those modules keep heavy imports (torch, grpc)
inside the functions so `trserve --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

COMMANDS = (
    "trserve.services.node.cli",  # serve, worker (worker + OpenAI API)
    "trserve.services.client.cli",  # generate
    "trserve.services.matrix.cli",  # matrix, matrix-admin, model-spec, secret
    "trserve.services.cluster.cli",  # cluster up|down|status, health
    "trserve.services.load.cli",  # load
    "trserve.bench.cli",  # bench
    "trserve.bench.tune",  # tune
)


def build_parser(modules: tuple[str, ...] = COMMANDS) -> argparse.ArgumentParser:
    from ..core.version import __version__

    parser = argparse.ArgumentParser(prog="trserve", description="Lossless speculative decoding with Token Recycling",
                                     epilog="Every flag may also be set by a TRSERVE_* environment variable "
                                            "(docs/environment.md).")
    parser.add_argument("--version", action="version", version=f"trserve {__version__}")
    _log_flags(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name and name.startswith(e.name):  # that subcommand package is not built yet
                continue
            raise
        module.register(sub)
    _each_command_takes_log_flags(sub)
    return parser


def _log_flags(parser: argparse.ArgumentParser) -> None:
    from .common.argtypes import log_level

    parser.add_argument("--log-level", default="INFO", type=log_level, help="DEBUG, INFO, WARNING, ERROR (default INFO)")
    parser.add_argument("--log-format", default="text", choices=("text", "json"),
                        help="text (default) or json: one JSON object per log line")


def _each_command_takes_log_flags(sub: argparse._SubParsersAction) -> None:
    """`trserve serve --log-level DEBUG` as well as `trserve --log-level DEBUG serve`: the flags after
    the command override the ones before it only when given (SUPPRESS leaves the earlier value)."""
    from .common.argtypes import log_level

    for command in sub.choices.values():
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                _each_command_takes_log_flags(action)
        if not any("--log-level" in a.option_strings for a in command._actions):
            command.add_argument("--log-level", default=argparse.SUPPRESS, type=log_level, help="as before the command")
            command.add_argument("--log-format", default=argparse.SUPPRESS, choices=("text", "json"),
                                 help="as before the command")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (and the traceback, when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        import json
        from datetime import datetime, timezone

        from .common.logcontext import escape_controls

        stamp = datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")
        out = {"time": stamp.replace("+00:00", "Z"), "level": record.levelname, "logger": record.name,
               "message": escape_controls(record.getMessage())}  # as the text format writes it
        if getattr(record, "request_id", None):
            out["request_id"] = record.request_id
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def log_handler(log_format: str, stream=None) -> logging.Handler:
    """The handler every command logs through: each line carries its request's id, and no value a caller
    controls can break a line (text: control characters escaped; JSON: escaped by JSON itself)."""
    from .common.logcontext import RequestIdFilter, TextFormatter

    handler = logging.StreamHandler(stream)
    handler.addFilter(RequestIdFilter())  # a request's id on each line logged on its behalf
    handler.setFormatter(JsonFormatter() if log_format == "json"
                         else TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s%(request_suffix)s"))
    return handler


def main(argv: list[str] | None = None, environ: dict[str, str] | None = None,
         modules: tuple[str, ...] = COMMANDS) -> int:
    import os

    from .envconfig import BadEnv, apply_env, check_parsed

    parser = build_parser(modules)
    apply_env(parser, os.environ if environ is None else environ)
    args = parser.parse_args(argv)
    try:
        check_parsed(args)  # a bad variable counts only where the command line did not give its flag
    except BadEnv as bad:
        parser.exit(2, f"trserve {args.command or ''}: error: {bad}\n".replace("trserve : ", "trserve: "))
    logging.basicConfig(level=getattr(logging, args.log_level), handlers=[log_handler(args.log_format)])
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, where a reader that went away is caught, not at the interpreter's exit
        return code
    except ModuleNotFoundError as e:
        if e.name != "trserve_client":
            raise
        print(f"trserve {args.command}: needs the Python client (clients/python, module trserve_client), which "
              "this environment lacks: `make install` installs it, elsewhere `pip install ./clients/python`",
              file=sys.stderr)
        return 2
    except BrokenPipeError:  # `trserve generate --json | head`: the reader is gone, nothing to report
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return 141  # as a shell reports a command ended by SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
