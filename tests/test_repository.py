"""The repository stands alone: nothing in it reads a folder beside the clone."""

from __future__ import annotations

import subprocess

from core.datasets import PROMPT_SETS, prompt_file
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
