"""Import boundaries (STYLE.md): core/ needs nothing heavy; engine/ and matrix_store/ never reach
into the service stack; matrix_store/ never into the device stack or the engine. The layout: engine/,
services/, matrix_store/ at the repository root, importable only as trserve.<folder>."""

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


FOLDERS = {"core": "core", "engine": "engine", "matrix_store": "matrix_store"}


def _imports(path: pathlib.Path) -> list[str]:
    """Every module a source file imports, relative imports resolved (the root is the package trserve)."""
    package = ["trserve", *path.relative_to(REPO).parts[:-1]]
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1])
            names += [f"{base}.{node.module}"] if node.module else [f"{base}.{a.name}" for a in node.names]
    return names


def test_relative_imports_resolve_as_written() -> None:
    assert _imports(REPO / "engine" / "model" / "loader.py").count("trserve.core.errors") == 1
    assert "trserve.engine.model.kernels.build" in _imports(REPO / "engine" / "model" / "kernels" / "qlinear.py")


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_forbidden_imports_in_source(package: str) -> None:
    files = sorted((REPO / FOLDERS[package]).rglob("*.py"))
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


TOP = ("engine", "services", "matrix_store", "core", "bench")


@pytest.mark.parametrize("folder", TOP)
def test_the_design_cards_folders_sit_at_the_root_and_import_only_under_trserve(folder: str, tmp_path) -> None:
    assert (REPO / folder / "__init__.py").is_file() and not (REPO / "trserve").exists()
    code = (f"import importlib, trserve.{folder} as p; print(p.__file__)\n"
            f"try:\n    importlib.import_module({folder!r})\nexcept ImportError as e:\n    print(type(e).__name__, e)\n"
            "else:\n    print('imported')")
    # from the repository root (its folders on sys.path: the package refuses the bare name) and from
    # elsewhere (the installed environment has no such name at all)
    for cwd, refusal in ((REPO, f"ImportError import trserve.{folder}, not {folder}"),
                         (tmp_path, f"ModuleNotFoundError No module named '{folder}'")):
        lines = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                               check=True).stdout.splitlines()
        assert pathlib.Path(lines[0]) == REPO / folder / "__init__.py"
        assert lines[1].startswith(refusal), lines
