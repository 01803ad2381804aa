"""Build hook: the generated gRPC code (trserve/v1/*_pb2*.py) is gitignored, so a clean clone has
none; building runs protoc on protos/ (grpcio-tools is a build requirement, pyproject.toml).

A wheel gets the code in its build directory; an editable install imports from the source tree,
so it is generated there, as `make proto` does.

Packages: pyproject.toml's package-dir maps each import root to its folder (trserve.engine ->
engine/, ...); the packages are every package (data folders too, as namespaces) under those folders, named under their root.
Everything else is declared in pyproject.toml.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

from setuptools import find_namespace_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
PROTO_DIR = ROOT / "protos"


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


class BuildPyWithProtos(build_py):
    def run(self) -> None:
        super().run()
        generate_protos(ROOT if self.editable_mode else Path(self.build_lib))


def packages() -> list[str]:
    """Each package-dir root and the packages under its folder, named under the root."""
    roots = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    found = {root: find_namespace_packages(str(ROOT / folder), exclude=["*__pycache__*"]) for root, folder in roots.items()}
    return sorted({*found, *(f"{root}.{sub}" for root, subs in found.items() for sub in subs)})


setup(packages=packages(), cmdclass={"build_py": BuildPyWithProtos})
