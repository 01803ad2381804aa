"""Builds trserve-client: the .proto files and the service config are copied from the repository
(when building from it; an sdist already holds them), and the stubs are generated into
trserve_client/_proto/trserve/v1 with their imports pointed there, so this package never shadows the
server's own `trserve` modules. The protobuf file names stay trserve/v1/*.proto."""

from __future__ import annotations

import re
import shutil
import tempfile
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
PKG = HERE / "trserve_client"
REPO = HERE.parent.parent
PROTOS = PKG / "protos" / "trserve" / "v1"
OUT = PKG / "_proto" / "trserve" / "v1"


def _sync_sources() -> None:
    src = REPO / "protos" / "trserve" / "v1"
    if src.is_dir():  # building from the repository: take its current protos and service config
        PROTOS.mkdir(parents=True, exist_ok=True)
        for proto in src.glob("*.proto"):
            shutil.copyfile(proto, PROTOS / proto.name)
        shutil.copyfile(REPO / "services" / "client" / "service_config.json", PKG / "service_config.json")


def _generate() -> None:
    from grpc_tools import protoc

    root = PKG / "protos"
    with tempfile.TemporaryDirectory() as tmp:
        protos = sorted(str(p.relative_to(root)) for p in PROTOS.glob("*.proto"))
        args = ["protoc", f"-I{root}", f"-I{Path(protoc.__file__).parent / '_proto'}", f"--python_out={tmp}",
                f"--grpc_python_out={tmp}", f"--pyi_out={tmp}", *protos]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on " + ", ".join(protos))
        OUT.mkdir(parents=True, exist_ok=True)
        for d in (OUT.parent.parent, OUT.parent, OUT):
            (d / "__init__.py").touch()
        for f in (Path(tmp) / "trserve" / "v1").iterdir():
            text = re.sub(r"^from trserve\.v1 import", "from trserve_client._proto.trserve.v1 import", f.read_text(),
                          flags=re.MULTILINE)
            (OUT / f.name).write_text(text)


_sync_sources()
_generate()
setup()
