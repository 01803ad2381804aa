"""README.md and docs/*.md match the code.

- every `trserve ...` command they show names a real subcommand, and every flag written after it
  exists on that subcommand's parser;
- every `path:Name` reference (`engine/engine.py:BatchEngine.step`) names a file of the repository
  that defines Name (Python: a top-level def, class or assignment, or a member of such a class;
  C, headers, protos and data files: the name appears in the text);
- every plain repo-relative file or folder path in an inline code span, and every relative link,
  exists;
- the README stays a guide: at most 250 lines.
"""

from __future__ import annotations

import argparse
import ast
import functools
import re
from pathlib import Path

import pytest

from trserve.services.cli import build_parser
from tests.conftest import REPO

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
README_MAX_LINES = 250

CODE_EXT = ("py", "c", "h", "proto", "json", "toml", "yaml", "yml")
# `path:Name`, the whole inline code span
NAMED_REF = re.compile(rf"([\w./-]+\.(?:{'|'.join(CODE_EXT)})):([\w.]+)")
# a plain repo-relative path: at least one slash, and a known extension, a trailing slash (a folder)
# or a first folder that is one of the repository's (`docker/Dockerfile`, `deploy/k8s`)
PATH_EXT = (*CODE_EXT, "md", "png", "txt", "jsonl", "cfg", "in", "ini", "sh")
PATH_LIKE = re.compile(r"[\w.-]+(?:/[\w.-]+)*/?")
# written by the tools, not in the repository: bench and tune output, the generated protos, the venv
GENERATED = ("bench-results/", "build/proto/trserve/v1/", ".venv/", ".cache/")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def is_plain_path(span: str) -> bool:
    if "/" not in span or not PATH_LIKE.fullmatch(span) or span.startswith(GENERATED):
        return False
    top = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".")}
    return span.endswith("/") or span.rsplit(".", 1)[-1] in PATH_EXT or span.split("/")[0] in top


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def without_fences(text: str) -> str:
    """The text with fenced code blocks blanked (their lines kept, so line counts still hold)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            out.append("")
        else:
            out.append("" if fenced else line)
    return "\n".join(out)


def inline_spans(path: Path) -> list[str]:
    """The inline code spans of a markdown file (outside fenced blocks), whitespace collapsed."""
    return [" ".join(s.split()) for s in re.findall(r"`([^`]+)`", without_fences(path.read_text()))]


def commands(path: Path) -> list[str]:
    """Inline code spans starting with `trserve `, and command lines in code blocks."""
    text = path.read_text()
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


def test_every_documented_command_and_flag_exists() -> None:
    root = build_parser()
    assert len(commands(REPO / "README.md")) > 10  # the command table was found
    problems = []
    for doc in doc_files():
        for command in commands(doc):
            parser, path = subcommand(root, command.split()[1:])
            if not path and command.split()[1:2] and command.split()[1] in root._option_string_actions:
                continue  # a top-level flag (`trserve --version`)
            if not path:
                problems.append(f"{doc.name}: {command!r}: no such subcommand")
                continue
            problems += [f"{doc.name}: {command!r}: `trserve {' '.join(path)}` has no {flag}"
                         for flag in FLAG.findall(command) if flag not in parser._option_string_actions]
    assert problems == []


@functools.cache
def python_names(path: Path) -> dict[str, object]:
    """Top-level names of a Python file -> the class node (for members) or None."""
    names: dict[str, object] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names[node.name] = None
        else:
            names.update(dict.fromkeys(_assigned(node)))
    return names


def _assigned(node: ast.AST) -> list[str]:
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
    return [t.id for t in targets if isinstance(t, ast.Name)]


def _member(cls: ast.ClassDef, name: str) -> object | bool:
    """The member `name` of a class body: a nested class node, True for a def or attribute, False if absent."""
    for node in cls.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return True
        if name in _assigned(node):
            return True
    return False


def defines(path: Path, name: str) -> bool:
    first, *rest = name.split(".")
    if path.suffix != ".py":
        text = path.read_text()
        return all(re.search(rf"\b{re.escape(part)}\b", text) for part in name.split("."))
    names = python_names(path)
    if first not in names:
        return False
    node = names[first]
    for part in rest:
        if not isinstance(node, ast.ClassDef):
            return False
        node = _member(node, part)
        if node is False:
            return False
    return True


def references() -> list[tuple[str, str, str | None]]:
    """(document, path, name or None) for every path reference in an inline code span."""
    refs = []
    for doc in doc_files():
        for span in inline_spans(doc):
            if span.startswith(("/", "~", "../")) or "*" in span or "<" in span:
                continue
            named = NAMED_REF.fullmatch(span)
            if named:
                refs.append((doc.name, named.group(1), named.group(2)))
            elif is_plain_path(span):
                refs.append((doc.name, span, None))
    return refs


def test_every_code_reference_resolves() -> None:
    refs = references()
    assert sum(name is not None for _, _, name in refs) > 20  # the architecture's hops were found
    problems = []
    for doc, path, name in refs:
        file = REPO / path
        if not file.exists():
            problems.append(f"{doc}: `{path}` does not exist")
        elif name is not None and not defines(file, name):
            problems.append(f"{doc}: `{path}:{name}`: {path} defines no {name}")
    assert problems == []


def test_relative_links_resolve() -> None:
    problems = []
    for doc in doc_files():
        for target in LINK.findall(without_fences(doc.read_text())):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same file
            if not (doc.parent / target.split("#")[0]).exists():
                problems.append(f"{doc.name}: link to {target} does not resolve")
    assert problems == []


def test_readme_is_a_guide_not_a_notebook() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move details to docs/"


@pytest.mark.parametrize("span, expected", [
    ("engine/engine.py:BatchEngine.step", ("engine/engine.py", "BatchEngine.step")),
    ("engine/model/csrc/forward.c:exp_poly", ("engine/model/csrc/forward.c", "exp_poly")),
])
def test_reference_pattern(span: str, expected: tuple[str, str]) -> None:
    assert NAMED_REF.fullmatch(span).groups() == expected


def test_resolver_rejects_what_is_not_there(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("X = 1\nclass A:\n    y: int = 0\n    def f(self): pass\ndef g(): pass\n")
    assert all(defines(src, n) for n in ("X", "A", "A.f", "A.y", "g"))
    assert not any(defines(src, n) for n in ("A.g", "g.f", "B", "A.f.x"))
