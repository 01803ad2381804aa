"""Every command-line flag may also come from the environment: TRSERVE_<FLAG>, the long flag's name
upper-cased with '-' as '_' (`--max-batch 8` = TRSERVE_MAX_BATCH=8, `--redis-url` = TRSERVE_REDIS_URL).

The command line wins over the environment, the environment over the built-in default. A name
applies to every command that has that flag (TRSERVE_PORT sets `serve`'s and `matrix`'s --port:
each container runs one command). Switches take 1/true/yes/on or 0/false/no/off; repeatable flags
(`matrix --model`) take a comma-separated list. Read once, by `main`, never at import time.
`environment_doc(parser)` writes docs/environment.md (kept current by a test).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from pathlib import Path

PREFIX = "TRSERVE_"
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}
_SKIP = {"help", "version"}  # flags with no value to set


def env_name(action: argparse.Action) -> str | None:
    longs = [o for o in action.option_strings if o.startswith("--")]
    if not longs or action.dest in _SKIP:
        return None
    return PREFIX + longs[0][2:].upper().replace("-", "_")


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, (*path, name))


class BadEnv(ValueError):
    """A variable's value its flag cannot take. It stands as the flag's default, so it matters only
    where the command line does not give the flag (the command line wins): `check_parsed` raises it."""


def apply_env(parser: argparse.ArgumentParser, environ: Mapping[str, str]) -> None:
    """Set each flag's default from the environment (see the module docstring). A value a flag
    cannot take becomes a BadEnv default, naming the variable and why (see `check_parsed`)."""
    for path, sub in _parsers(parser):
        for action in sub._actions:
            name = env_name(action)
            if name is None or name not in environ:
                continue
            try:
                action.default = _value(action, name, environ[name])
            except BadEnv as bad:
                action.default = bad
            action.required = False  # given by the environment


def check_parsed(args: argparse.Namespace) -> None:
    """Raise the first BadEnv left in the parsed flags: a bad variable whose flag the command line
    did not override."""
    for value in vars(args).values():
        if isinstance(value, BadEnv):
            raise value


def _value(action: argparse.Action, name: str, raw: str):
    flag = action.option_strings[-1]
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        text = raw.strip().lower()
        if text not in _TRUE | _FALSE:
            raise BadEnv(f"{name}={raw!r} (for {flag}): a switch takes one of {sorted(_TRUE | _FALSE)}")
        return (text in _TRUE) == isinstance(action, argparse._StoreTrueAction)
    values = [v.strip() for v in raw.split(",") if v.strip()] if isinstance(action, argparse._AppendAction) else [raw]
    out = []
    for v in values:
        try:
            value = action.type(v) if action.type is not None else v
        except argparse.ArgumentTypeError as exc:
            raise BadEnv(f"{name}={v!r} is not a valid value for {flag}: {exc}") from None
        except (TypeError, ValueError):
            raise BadEnv(f"{name}={v!r} is not a valid value for {flag}") from None
        if action.choices is not None and value not in action.choices:
            raise BadEnv(f"{name}={v!r} (for {flag}): choose from {', '.join(map(str, action.choices))}")
        out.append(value)
    return out if isinstance(action, argparse._AppendAction) else out[0]


def _shown(default) -> str:
    """A default as the table shows it: paths inside the repository relative to it (a checkout's
    location must not change the documented table)."""
    text = str(default)
    root = str(Path(__file__).resolve().parents[1]) + "/"  # the repository's root (the trserve package)
    return text[len(root):] if text.startswith(root) else text


def env_table(parser: argparse.ArgumentParser) -> str:
    """A markdown table: variable, flag, commands that have it, default."""
    rows: dict[str, dict] = {}
    for path, sub in _parsers(parser):
        for action in sub._actions:
            name = env_name(action)
            if name is None:
                continue
            row = rows.setdefault(name, {"flag": action.option_strings[-1], "commands": [], "defaults": set()})
            row["commands"].append(" ".join(path) or "(any)")
            default = action.default
            if isinstance(action, argparse._StoreTrueAction):
                default = "off"
            row["defaults"].add("" if default in (None, argparse.SUPPRESS, []) else _shown(default))
    lines = ["| variable | flag | commands | default |", "|---|---|---|---|"]
    for name in sorted(rows):
        row = rows[name]
        defaults = " / ".join(sorted(d for d in row["defaults"] if d)) or "-"
        lines.append(f"| `{name}` | `{row['flag']}` | {', '.join(row['commands'])} | {defaults} |")
    return "\n".join(lines) + "\n"


DOC_HEADER = """# Environment variables

Every flag of every `trserve` command may also be set by an environment variable: `TRSERVE_` and
the long flag's name upper-cased, `-` as `_` (`--max-batch 8` is `TRSERVE_MAX_BATCH=8`). The command
line wins over the environment, the environment over the default. A variable applies to every
command that has that flag (`TRSERVE_PORT` is `serve`'s and `matrix`'s `--port`: a container runs
one command). Switches take `1/true/yes/on` or `0/false/no/off`; repeatable flags (`matrix --model`)
a comma-separated list. A value a flag cannot take (a wrong kind or out of the flag's range) stops the
command with a usage error naming the variable, the flag and the range, unless the command line
gives that flag. Secrets stay in files (`--secret-file`, `--tenant-tokens`): the variables name the files.

This table is generated from the parser (`services/envconfig.py:env_table`); a test keeps it current.

"""


def environment_doc(parser: argparse.ArgumentParser) -> str:
    """docs/environment.md: `python -c "from trserve.services.cli import build_parser; from trserve.services.envconfig import
    environment_doc; print(environment_doc(build_parser()), end='')" > docs/environment.md` (every command)."""
    return DOC_HEADER + env_table(parser)
