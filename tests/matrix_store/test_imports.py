"""matrix_store stays free of the service and device stacks (see STYLE.md)."""

import ast
import pathlib
import subprocess
import sys

import matrix_store


def test_no_forbidden_imports_in_source() -> None:
    for path in pathlib.Path(matrix_store.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            assert not [n for n in names if n.split(".")[0] in ("grpc", "torch") or n.startswith("google.protobuf")], (
                f"{path.name} imports {names}"
            )


def test_importing_the_package_loads_no_grpc_or_protobuf() -> None:
    code = "import sys, matrix_store; print(','.join(m for m in ('grpc', 'google.protobuf') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""
