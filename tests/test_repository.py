"""The repository stands alone: nothing in it reads a folder beside the clone."""

from __future__ import annotations

import subprocess

from trserve.core.datasets import PROMPT_SETS, prompt_file
from tests.conftest import REPO

OUTSIDE = ("../shared", "TRSERVE_SHARED_DATA", "parent.parent.parent")


def test_no_tracked_file_points_outside_the_repository() -> None:
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    assert files
    offenders = []
    for name in files:
        if name.endswith((".py", ".toml", ".cfg", ".yaml", ".yml", ".sh", ".md")) or name in ("Makefile", ".ci/run") \
                or name.endswith("Dockerfile"):
            if not (REPO / name).exists():  # deleted in the work tree, not yet committed
                continue
            text = (REPO / name).read_text(errors="replace")
            offenders += [f"{name}: {needle}" for needle in OUTSIDE if needle in text and name != "tests/test_repository.py"]
    assert offenders == []


def test_bundled_prompt_sets_are_in_the_repository() -> None:
    for name in PROMPT_SETS:
        path = prompt_file(name)
        assert path.is_relative_to(REPO) and path.stat().st_size > 10_000


def test_files_and_functions_stay_small() -> None:
    """House style: no product Python file over 400 lines, no function over 60 (tests excepted)."""
    import ast

    files = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    problems = []
    for name in files:
        path = REPO / name
        if name.startswith("tests/") or not path.exists():
            continue
        text = path.read_text()
        if text.count("\n") > 400:
            problems.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                problems.append(f"{name}:{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert problems == []
