"""pyproject.toml declares what requirements.txt pins, and building from a clean copy of the
repository (no generated code: it is gitignored) yields a package that carries the gRPC code."""

from __future__ import annotations

import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.conftest import REPO

BUILD_ONLY = {"grpcio-tools"}  # generates the code at build time; not needed at run time
# the tests' client of the OpenAI-compatible API (tests/services/openai); the manifests' schema checker
# (tests/services/cluster/test_deploy_files.py); llama.cpp's converter's tokenizer step (bench/converter.py)
TEST_ONLY = {"openai", "kubernetes-validate", "sentencepiece"}


def _pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _lines(name: str) -> list[str]:
    return [ln for ln in (ln.split("#")[0].strip() for ln in (REPO / name).read_text().splitlines()) if ln]


def _pins() -> list[Requirement]:
    """requirements-runtime.txt's lines, plus the torch pin the Makefile installs first."""
    pins = [Requirement(ln) for ln in _lines("requirements-runtime.txt")]
    torch = re.search(r"^TORCH_SPEC\s*\?=\s*(\S+)", (REPO / "Makefile").read_text(), re.MULTILINE)
    pins.append(Requirement(torch.group(1)))
    return pins


def test_requirements_are_the_runtime_ones_plus_build_and_test_tools_and_the_image_installs_only_the_runtime():
    full = _lines("requirements.txt")
    assert full[0] == "-r requirements-runtime.txt"
    extra = {canonicalize_name(Requirement(ln).name) for ln in full[1:]}
    assert extra == BUILD_ONLY | TEST_ONLY | {"pytest", "pytest-timeout"}
    runtime = {canonicalize_name(r.name) for r in _pins()}
    assert not runtime & extra
    dockerfile = (REPO / "docker" / "Dockerfile").read_text()
    assert "requirements.txt" not in dockerfile and "pip install -r requirements-runtime.txt" in dockerfile
    # the image's stages that run the services (FROM base) never install the code generator
    runtime_stages = dockerfile[dockerfile.index("AS base"):]
    assert "grpcio-tools" not in runtime_stages and "grpc_tools" not in runtime_stages


def test_every_pinned_runtime_requirement_is_declared_with_a_range_that_admits_it() -> None:
    declared = {canonicalize_name(r.name): r for r in map(Requirement, _pyproject()["project"]["dependencies"])}
    pins = _pins()
    problems = []
    for pin in pins:
        dep = declared.get(canonicalize_name(pin.name))
        exact = [s.version for s in pin.specifier if s.operator == "=="]
        # a range in requirements.txt (numpy<3, tqdm): the version installed from it must fit both
        wanted = exact[0] if exact else version(pin.name)
        if dep is None:
            problems.append(f"{pin.name} is not declared in pyproject.toml")
        elif not dep.specifier.contains(wanted.split("+")[0]):
            problems.append(f"{pin.name} {wanted} is outside pyproject's {dep.specifier}")
    assert problems == []
    assert set(declared) == {canonicalize_name(p.name) for p in pins}  # nothing declared that is not pinned


def test_the_build_uses_the_pinned_code_generator() -> None:
    pins = [ln.strip() for ln in (REPO / "requirements.txt").read_text().splitlines()]
    generator = next(ln for ln in pins if ln.startswith("grpcio-tools=="))
    assert generator in _pyproject()["build-system"]["requires"]


def _clean_copy(dest: Path) -> Path:
    """What a clone holds (tracked and new, not ignored, files): no generated code (build/proto/)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes((REPO / name).read_bytes())
    assert not (dest / "build").exists()
    return dest


def test_a_wheel_built_from_a_clean_copy_carries_the_grpc_code(tmp_path: Path) -> None:
    src = _clean_copy(tmp_path / "src")
    # --no-build-isolation: offline, with this environment's setuptools and grpcio-tools
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("trserve-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("generate_pb2", "generate_pb2_grpc", "matrix_pb2", "matrix_pb2_grpc"):
        assert f"trserve/v1/{module}.py" in names
    assert {"trserve/core/data/spec_bench/dev.jsonl", "trserve/engine/tr/trees/paper.json",
            "trserve/engine/model/csrc/qlinear.c", "trserve/core/data/structured/dev.jsonl",
            "trserve/core/data/agent/tasks.json",
            "trserve/engine/model/kernels/kept/kept-llama-v49152-d126c95948029258-n824cf4dfddc6.json",
            "trserve/engine/model/kernels/kept/keypairs-llama-v49152-d126c95948029258-n824cf4dfddc6.json"} <= names
    # one name in site-packages, no generic ones (core, engine, services, bench) beside other packages'
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"trserve"}

    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    code = "import trserve.services.cli, trserve.v1.generate_pb2 as g, trserve.v1.matrix_pb2_grpc; print(g.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(target)},
                         capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()).is_relative_to(target)


def test_the_source_distribution_carries_the_protos(tmp_path: Path) -> None:
    src = _clean_copy(tmp_path / "src")
    code = "from setuptools import build_meta; print(build_meta.build_sdist('sdist'))"
    out = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, check=True)
    sdist = src / "sdist" / out.stdout.strip().splitlines()[-1]
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
    assert any(n.endswith("protos/trserve/v1/generate.proto") for n in names)
    assert any(n.endswith("protos/trserve/v1/matrix.proto") for n in names)


def test_the_version_the_cli_reports_is_the_packages() -> None:
    import tomllib

    from trserve.core.version import __version__

    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"] == __version__
