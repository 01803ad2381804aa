"""Import boundaries (STYLE.md): trserve/core/ needs nothing heavy; trserve/engine/ and trserve/matrix_store/ never reach
into the service stack; trserve/matrix_store/ never into the device stack or the engine."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
_T = "trserve."
FORBIDDEN = {
    "core": ("grpc", "google.protobuf", "redis", "torch", "numpy", *(_T + p for p in ("engine", "matrix_store", "services",
                                                                                        "bench", "v1"))),
    "engine": ("grpc", "google.protobuf", "redis", *(_T + p for p in ("services", "matrix_store", "bench", "v1"))),
    "matrix_store": ("grpc", "google.protobuf", "torch", *(_T + p for p in ("engine", "services", "bench", "v1"))),
}


def _imports(path: pathlib.Path) -> list[str]:
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports_in_source(package: str) -> None:
    files = sorted((REPO / "trserve" / package).rglob("*.py"))
    assert files, f"no sources found for {package}"
    for path in files:
        bad = [n for n in _imports(path) if any(n == f or n.startswith(f + ".") for f in FORBIDDEN[package])]
        assert not bad, f"{path.relative_to(REPO)} imports {bad}"


@pytest.mark.parametrize("package, heavy", [
    ("core", ("torch", "grpc", "numpy", "redis")),
    ("engine", ("torch", "grpc", "redis")),  # lazy exports: `import trserve.engine` loads nothing heavy
    ("matrix_store", ("grpc", "google.protobuf", "torch")),
])
def test_importing_the_package_stays_light(package: str, heavy: tuple[str, ...]) -> None:
    code = f"import sys, trserve.{package}; print(','.join(m for m in {heavy!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == ""
