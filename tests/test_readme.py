"""README matches the CLI: every `trserve ...` command it shows names a real subcommand, and every
flag written after it exists on that subcommand's parser."""

from __future__ import annotations

import argparse
import re

from services.cli import build_parser
from tests.conftest import REPO

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def readme_commands() -> list[str]:
    """Inline code spans starting with `trserve `, and command lines in code blocks."""
    text = (REPO / "README.md").read_text()
    spans = re.findall(r"`(?:\.venv/bin/)?(trserve [^`]+)`", text)
    spans += [m.group(1) for m in re.finditer(r"^\s*(?:\.venv/bin/)?(trserve .*)$", text, re.MULTILINE)]
    return spans


def subcommand(parser: argparse.ArgumentParser, words: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The deepest subparser the leading words name, and those words."""
    path: list[str] = []
    for word in words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or word not in subs[0].choices:
            break
        parser, path = subs[0].choices[word], [*path, word]
    return parser, path


def test_every_readme_command_and_flag_exists() -> None:
    root = build_parser()
    commands = readme_commands()
    assert len(commands) > 20  # the tables were found
    problems = []
    for command in commands:
        parser, path = subcommand(root, command.split()[1:])
        if not path:
            problems.append(f"{command!r}: no such subcommand")
            continue
        problems += [f"{command!r}: `trserve {' '.join(path)}` has no {flag}"
                     for flag in FLAG.findall(command) if flag not in parser._option_string_actions]
    assert problems == []
