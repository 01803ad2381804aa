"""Build hook: the generated gRPC code (trserve.v1: build/proto/trserve/v1/*_pb2*.py) is gitignored,
so a clean clone has none; building runs protoc on protos/ into build/proto/ first (grpcio-tools is a
build requirement, pyproject.toml), where pyproject.toml's package-dir finds trserve.v1 (a wheel
copies it from there; an editable install imports it there, as `make proto` regenerates it).

Packages: the repository's root is the package trserve (package-dir "trserve" = "."), and each code
folder X/ is trserve.X; the packages are every package under those folders (data folders too, as
namespaces). Everything else is declared in pyproject.toml.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_namespace_packages, setup

ROOT = Path(__file__).resolve().parent
PROTO_DIR = ROOT / "protos"
GENERATED = ROOT / "build" / "proto"  # trserve.v1 (pyproject.toml's package-dir)
INIT = '"""trserve.v1: the gRPC code generated from protos/trserve/v1 (setup.py, `make proto`)."""\n'
CODE = ("core", "engine", "matrix_store", "services", "bench")  # the code folders: trserve.<folder>


def generate_protos(out: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p) for p in (PROTO_DIR / "trserve" / "v1").glob("*.proto"))
    if not protos:
        raise RuntimeError(f"no .proto files under {PROTO_DIR}/trserve/v1")
    well_known = Path(grpc_tools.__file__).parent / "_proto"  # google/protobuf/*.proto
    out.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO_DIR}", f"-I{well_known}", f"--python_out={out}", f"--grpc_python_out={out}",
            f"--pyi_out={out}", *protos]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {protos}")
    (out / "trserve" / "v1" / "__init__.py").write_text(INIT)


def packages() -> list[str]:
    """trserve, trserve.v1, and each code folder's packages, named under trserve."""
    found = [f"trserve.{folder}" + (f".{sub}" if sub else "") for folder in CODE
             for sub in ("", *find_namespace_packages(str(ROOT / folder), exclude=["*__pycache__*"]))]
    return sorted({"trserve", "trserve.v1", *found})


if (PROTO_DIR / "trserve" / "v1").is_dir():  # a source tree or sdist (a wheel's build has run it already)
    generate_protos(GENERATED)
setup(packages=packages())
