"""Builds trserve-client without writing into its source folder: the stubs are generated, and the
.proto files copied, into the build's own tree (build_py), from the repository when building from it,
else from the copies an sdist carries (made by sdist below). The service config
(trserve_client/service_config.json) is package data, the one copy. The stubs live in
trserve_client/_proto/trserve/v1 with their imports pointed there, so this package never shadows the
server's own `trserve` modules; the protobuf file names stay trserve/v1/*.proto. setuptools' scratch
(build/, *.egg-info) goes to a temporary folder too.

An editable install (`pip install -e clients/python`, what the project's `make install` does) imports
the package from this folder, so there the stubs are generated in place, into the gitignored
trserve_client/_proto/."""

from __future__ import annotations

import atexit
import re
import shutil
import tempfile
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SCRATCH = Path(tempfile.mkdtemp(prefix="trserve-client-build-"))
atexit.register(shutil.rmtree, SCRATCH, True)


def _proto_dir() -> Path:
    """The trserve/v1 protos: the repository's, else an sdist's copies."""
    if (REPO / "protos" / "trserve" / "v1").is_dir():
        return REPO / "protos"
    return HERE / "trserve_client" / "protos"


def _copy_sources(pkg: Path) -> None:
    (pkg / "protos" / "trserve" / "v1").mkdir(parents=True, exist_ok=True)
    for proto in (_proto_dir() / "trserve" / "v1").glob("*.proto"):
        shutil.copyfile(proto, pkg / "protos" / "trserve" / "v1" / proto.name)


def _generate(pkg: Path, root: Path) -> None:
    """The stubs of root/trserve/v1/*.proto into pkg/_proto/trserve/v1, importing from there."""
    from grpc_tools import protoc

    out = pkg / "_proto" / "trserve" / "v1"
    with tempfile.TemporaryDirectory() as tmp:
        protos = sorted(str(p.relative_to(root)) for p in (root / "trserve" / "v1").glob("*.proto"))
        args = ["protoc", f"-I{root}", f"-I{Path(protoc.__file__).parent / '_proto'}", f"--python_out={tmp}",
                f"--grpc_python_out={tmp}", f"--pyi_out={tmp}", *protos]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on " + ", ".join(protos))
        out.mkdir(parents=True, exist_ok=True)
        for d in (out.parent.parent, out.parent, out):
            (d / "__init__.py").touch()
        for f in (Path(tmp) / "trserve" / "v1").iterdir():
            text = re.sub(r"^from trserve\.v1 import", "from trserve_client._proto.trserve.v1 import", f.read_text(),
                          flags=re.MULTILINE)
            (out / f.name).write_text(text)


class BuildPy(build_py):
    def run(self) -> None:
        super().run()
        if self.editable_mode:  # imported from this folder: the stubs go beside the sources
            _generate(HERE / "trserve_client", _proto_dir())
            return
        pkg = Path(self.build_lib) / "trserve_client"
        _copy_sources(pkg)
        _generate(pkg, pkg / "protos")


class Sdist(sdist):
    def make_release_tree(self, base_dir, files) -> None:
        super().make_release_tree(base_dir, files)
        _copy_sources(Path(base_dir) / "trserve_client")  # an sdist builds without the repository


setup(cmdclass={"build_py": BuildPy, "sdist": Sdist},
      options={"build": {"build_base": str(SCRATCH / "build")}, "egg_info": {"egg_base": str(SCRATCH)}})
