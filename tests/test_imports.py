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


LAYER = {"core": 0, "engine": 1, "matrix_store": 1, "services": 2, "bench": 3}  # a folder imports only below or beside


def _module_graph() -> tuple[dict[str, set[str]], list[tuple[str, str]]]:
    """Every module of the checkout (as the files lie) -> the trserve modules it imports (resolved to a
    file: a module or a package's __init__), and the imports that resolve to no file. The gRPC code
    (trserve.v1) is generated into an ignored build folder, so it is not in the checkout."""
    files = {}
    for top in TOP:
        for path in (REPO / top).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            files[".".join(("trserve",) + (parts[:-1] if parts[-1] == "__init__" else parts))] = path

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph, unresolved = {}, []
    for module, path in files.items():
        graph[module] = set()
        for name in _imports(path):
            if name.split(".")[0] != "trserve" or name.startswith("trserve.v1"):
                continue
            target = resolve(name)
            if target is None:
                unresolved.append((module, name))
            elif target != module:
                graph[module].add(target)
    return graph, unresolved


def _cycles(graph: dict[str, set[str]], scope: str) -> list[list[str]]:
    """The import cycles among the modules under `scope` (strongly connected parts of more than one)."""
    nodes = sorted(m for m in graph if m.startswith(scope))
    index, low, stack, found = {}, {}, [], []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w.startswith(scope) and w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = stack[stack.index(v):]
            del stack[stack.index(v):]
            if len(part) > 1:
                found.append(part)

    for v in nodes:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_resolves_every_import_with_no_upward_arrow_and_no_cycle() -> None:
    """Issue 58: read as the files lie, every trserve import is a file of the checkout; no folder
    imports one above it (core < engine, matrix_store < services < bench; engine and matrix_store
    never each other); no cycles in the whole tree (function-level imports included)."""
    graph, unresolved = _module_graph()
    assert len(graph) > 150 and not unresolved, unresolved
    upward = [(a, b) for a, targets in graph.items() for b in targets
              if LAYER[b.split(".")[1]] > LAYER[a.split(".")[1]]
              or {a.split(".")[1], b.split(".")[1]} == {"engine", "matrix_store"}]
    assert not upward, upward
    for scope in ("trserve.", "trserve.engine.", "trserve.services."):
        assert not _cycles(graph, scope), scope
